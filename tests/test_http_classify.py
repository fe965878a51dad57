"""The guard's classification for HTTP: httpx2's errors, SDK errors raised from a transport error,
and a 409 that means "in progress" or "this key was used already" (``conflict_classifier``), for tools
that send their own requests. Against real servers on 127.0.0.1 (tests/_http_servers.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

import onceonly
from onceonly.policy import Verdict, classify, conflict_classifier
from onceonly.states import State
from tests._http_servers import TICKET, Service, fixture_ledger, fixture_tickets, fixture_used  # noqa: F401 (fixtures)
from tests.test_http import Scripted, fixture_scripted  # noqa: F401 (a fixture)


def test_guard_classification_reads_409_as_exists(used: Service, ledger: onceonly.Ledger) -> None:
    """A tool that does its own HTTP (plain httpx, its own retry on a transport error), sending the
    ledger's key. Its retry after the lost answer gets 409 (the key was used).

    By default that 409 is a definite failure: the ledger records the call failed while its ticket
    exists. With ``classify=conflict_classifier("exists")`` it is unknown, and the probe (the lookup
    by key) confirms the call with the existing ticket. One ticket either way."""

    def find(_args: dict[str, Any], key: str) -> Any:
        response = httpx.get(f"{used.url}/tickets/by-idempotency-key/{key}")
        return response.json() if response.status_code == 200 else onceonly.NOT_FOUND

    def body(title: str, idempotency_key: str) -> dict[str, Any]:
        for _ in range(2):  # the tool's own retry, on a transport error
            try:
                response = httpx.post(
                    f"{used.url}/tickets", json={**TICKET, "title": title}, headers={"Idempotency-Key": idempotency_key}
                )
                break
            except httpx.TransportError:
                continue
        response.raise_for_status()
        out: dict[str, Any] = response.json()
        return out

    plain = ledger.tool(name="plain", on_unknown="probe", probe=find)(body)
    with pytest.raises(httpx.HTTPStatusError):
        plain("a")
    assert ledger.get(plain.key_for("a")).state is State.FAILED  # type: ignore[union-attr]
    assert used.count() == 1

    used.lose_next()
    exists = ledger.tool(name="exists", on_unknown="probe", probe=find, classify=conflict_classifier("exists"))(body)
    outcome = exists.outcome("b")
    assert outcome.via == "probe" and outcome.result == {"id": 2, **TICKET, "title": "b"}
    assert used.count() == 2


def test_guard_classification_reads_409_as_in_progress(scripted: tuple[Scripted, str], ledger: onceonly.Ledger) -> None:
    """``conflict_classifier("in_progress")``: a 409 (a request with this key still runs) is "not
    executed": the ledger tries again after Retry-After with the same key, and gets the result. By
    default the 409 is a definite failure."""
    app, url = scripted
    app.then(409, retry_after="0").then(409, retry_after="0").then(201, b'{"id": 7}')

    def body(idempotency_key: str) -> Any:
        response = httpx.post(f"{url}/x", json={}, headers={"Idempotency-Key": idempotency_key})
        return response.raise_for_status().json()

    with pytest.raises(httpx.HTTPStatusError):
        ledger.tool(name="plain")(body)()
    waited = ledger.tool(name="waited", classify=conflict_classifier("in_progress"))(body)
    assert waited.outcome().result == {"id": 7}
    assert app.keys()[1:] == [waited.key_for()] * 2


# --- classification -----------------------------------------------------------------------------------


def test_httpx2_errors_are_classified_as_httpx_errors(tickets: Service) -> None:
    """httpx2's errors, real ones: a refused connection is not sent, a reset answer is unknown. They
    used to read as the tool's own errors: definite failures."""
    httpx2 = pytest.importorskip("httpx2")
    from onceonly.tickets._serve import bind

    sock = bind()  # bound, never listening: connections are refused
    try:
        with pytest.raises(httpx2.ConnectError) as refused:
            httpx2.post(f"http://127.0.0.1:{sock.getsockname()[1]}/x", json={})
    finally:
        sock.close()
    with pytest.raises(httpx2.TransportError) as reset:
        httpx2.post(f"{tickets.url}/tickets", json=TICKET, headers={"Idempotency-Key": "k-1"})
    assert classify(refused.value).verdict is Verdict.NOT_SENT
    assert classify(reset.value).verdict is Verdict.UNKNOWN


def test_an_error_raised_from_a_transport_error_is_classified_by_its_cause(tickets: Service) -> None:
    """An SDK's own error raised from the client's (``raise APIConnectionError(...) from err``) takes
    its cause's verdict: a reset answer wrapped so is still unknown. The tool's ``classify=`` and an
    error's own ``onceonly_verdict`` still win, and a loop of causes ends."""
    with pytest.raises(httpx.TransportError) as caught:
        httpx.post(f"{tickets.url}/tickets", json=TICKET, headers={"Idempotency-Key": "k-1"})
    reset = caught.value

    class SDKError(Exception):
        pass

    wrapped = SDKError("connection error")
    wrapped.__cause__ = reset
    got = classify(wrapped)
    assert got.verdict is Verdict.UNKNOWN and got.reason.startswith("SDKError from ")
    assert classify(wrapped, lambda _e: onceonly.Classification(Verdict.FAILED)).verdict is Verdict.FAILED
    looped, other = SDKError("a"), SDKError("b")
    looped.__cause__, other.__cause__ = other, looped
    assert classify(looped).verdict is Verdict.FAILED
    assert classify(ValueError("bad input")).verdict is Verdict.FAILED


def test_conflict_classifier_refuses_a_meaning_it_does_not_know() -> None:
    """``conflict_classifier`` takes "in_progress" or "exists" and says what each means."""
    with pytest.raises(ValueError, match=r"'in_progress'.*'exists'"):
        conflict_classifier("used")  # type: ignore[arg-type]
