"""When a retry may run, on every store: Retry-After bounded and never stored non-finite, every wait
bounded by the call's ``wait``, a record whose attempts all failed before sending anything started
afresh, and what ``AttemptsExhausted`` says about the last error."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest

import onceonly
from onceonly import AttemptsExhausted, InProgress, Ledger, OutcomeUnknown, Record, Retry, State
from onceonly import states as st
from tests._clock import FakeClock


def _status_error(status: int, retry_after: str | None) -> httpx.HTTPStatusError:
    """What ``response.raise_for_status()`` raises for ``status`` with that ``Retry-After``."""
    request = httpx.Request("POST", "http://api.test/charges")
    headers = {} if retry_after is None else {"Retry-After": retry_after}
    response = httpx.Response(status, headers=headers, request=request)
    return httpx.HTTPStatusError(f"HTTP {status}", request=request, response=response)


def _times(rec: Record) -> list[float | None]:
    return [rec.lease_until, rec.next_attempt_at, rec.expires_at, rec.created_at, rec.updated_at]


def _assert_finite_json(rec: Record) -> None:
    """Every time in the record is a finite number, and the record prints as strict JSON."""
    assert all(t is None or math.isfinite(t) for t in _times(rec)), _times(rec)
    assert all(math.isfinite(h["at"]) for h in rec.history)
    json.dumps(rec.to_dict(), allow_nan=False)


# --- Retry-After ------------------------------------------------------------------------------------


def test_a_retry_after_beyond_wait_ends_the_call_saying_when_it_may_run(ledger: Ledger, clock: FakeClock) -> None:
    """A 503 with ``Retry-After: 86400`` blocked the call for a day despite ``wait=``. The call now ends
    at once with ``RetryScheduled`` (an ``InProgress``: call again later) that says when; the record keeps
    the due time, a call before it runs nothing, and a call after it runs normally."""
    runs: list[int] = []
    up = False

    @ledger.tool(name="charge", wait=10, retry=Retry(attempts=3))
    def charge(amount: int) -> str:
        runs.append(amount)
        if not up:
            raise _status_error(503, "86400")
        return "charged"

    start = clock.now
    with pytest.raises(InProgress) as info:
        charge(5)
    err = info.value
    assert type(err).__name__ == "RetryScheduled" and isinstance(err, onceonly.RetryScheduled)
    assert err.retry_at == pytest.approx(start + 86400)
    assert "2027-01-16T08:00:00Z" in str(err) and "wait=10" in str(err) and "HTTP 503" in str(err)
    assert runs == [5] and all(s <= 10 for s in clock.sleeps)
    rec = ledger.get(charge.key_for(5))
    assert rec is not None and rec.state is State.FAILED and rec.attempts == 1
    assert rec.next_attempt_at == pytest.approx(start + 86400)
    _assert_finite_json(rec)

    clock.now += 3600  # an hour later: still not due
    with pytest.raises(onceonly.RetryScheduled, match="in 82800 s"):
        charge(5)
    assert runs == [5]

    clock.now = start + 86400 + 1
    up = True
    out = charge.outcome(5)
    assert (out.result, out.attempts, out.replayed) == ("charged", 2, False)
    assert runs == [5, 5]


@pytest.mark.parametrize("header", ["nan", "-5", "soon", ""])
def test_a_retry_after_that_asks_for_no_wait_leaves_the_plain_backoff(
    ledger: Ledger, clock: FakeClock, header: str
) -> None:
    """A Retry-After that asks for no wait (negative, NaN) or is no number or date at all: the plain
    backoff applies, and nothing non-finite reaches the store."""
    runs: list[int] = []

    @ledger.tool(name="charge", retry=Retry(attempts=3, base=1.0, cap=1.0))
    def charge(amount: int) -> str:
        runs.append(amount)
        if len(runs) == 1:
            raise _status_error(503, header)
        return "charged"

    assert charge(7) == "charged"
    assert len(runs) == 2 and len(clock.sleeps) == 1 and 0 <= clock.sleeps[0] <= 1.0
    rec = ledger.get(charge.key_for(7))
    assert rec is not None and rec.state is State.CONFIRMED
    _assert_finite_json(rec)


@pytest.mark.parametrize("header", ["inf", "1e400", "Infinity", "1" + "0" * 30, "Fri, 31 Dec 9999 23:59:59 GMT"])
def test_an_endless_retry_after_is_capped_at_a_day(ledger: Ledger, clock: FakeClock, header: str) -> None:
    """``Retry-After: inf`` or ``1e400`` raised ``OverflowError`` and stored ``Infinity`` in the record,
    so every later call failed and ``show`` printed non-JSON; 10**30 seconds or a date in the year 9999
    would lock the operation for ever. The due time is at most a day away (``policy.MAX_RETRY_AFTER``),
    finite, and the call ends at once saying when."""

    @ledger.tool(name="charge", wait=1)
    def charge() -> str:
        raise _status_error(429, header)

    with pytest.raises(onceonly.RetryScheduled) as info:
        charge()
    assert info.value.retry_at == pytest.approx(clock.now + 86400, abs=1)
    rec = ledger.get(charge.key_for())
    assert rec is not None and rec.next_attempt_at == pytest.approx(clock.now + 86400, abs=1)
    _assert_finite_json(rec)


def test_a_classifier_that_answers_an_infinite_retry_after_stores_nothing_infinite(
    ledger: Ledger, clock: FakeClock
) -> None:
    """A ``classify=`` override or an exception's own ``retry_after`` attribute is sanitised like the
    header: infinity is a day at most, NaN is no hint at all."""

    class Busy(Exception):
        onceonly_verdict = onceonly.Verdict.NOT_EXECUTED
        retry_after = float("inf")

    @ledger.tool(name="busy", wait=5)
    def busy() -> None:
        raise Busy("come back never")

    with pytest.raises(onceonly.RetryScheduled) as info:
        busy()
    assert info.value.retry_at == pytest.approx(clock.now + 86400)
    rec = ledger.get(busy.key_for())
    assert rec is not None
    _assert_finite_json(rec)


# --- every wait bounded by wait= -------------------------------------------------------------------


def test_a_backoff_longer_than_wait_ends_the_call_and_a_later_call_takes_it_up(
    ledger: Ledger, clock: FakeClock
) -> None:
    """A backoff is a wait like any other: longer than ``wait``, the call does not sleep it out; it
    ends with ``RetryScheduled`` (its attempt stays counted) and the next call after the due time runs."""
    runs: list[int] = []

    @ledger.tool(name="push", wait=0.5, retry=Retry(attempts=3, base=30.0, cap=30.0))
    def push() -> str:
        runs.append(1)
        if len(runs) == 1:
            raise ConnectionRefusedError("refused")
        return "ok"

    # Backoffs are uniform in [0, 30]: find one beyond wait (nearly all are) with a seeded rng.
    ledger.rng.seed(1)
    with pytest.raises(onceonly.RetryScheduled) as info:
        push()
    assert all(s <= 0.5 for s in clock.sleeps)
    clock.now = info.value.retry_at
    assert push() == "ok" and len(runs) == 2


def test_a_settle_time_longer_than_wait_ends_the_call_as_unknown(ledger: Ledger, clock: FakeClock) -> None:
    """The settle time before a probe is bounded by ``wait`` too: the call ends with ``OutcomeUnknown``
    saying when the probe is due; a call after that probes and settles it."""
    probed: list[str] = []

    def probe(args: dict[str, Any], key: str) -> str:
        probed.append(key)
        return "found"

    @ledger.tool(name="slow", on_unknown="probe", probe=probe, settle=60, wait=1)
    def slow() -> str:
        raise TimeoutError("read timed out")

    with pytest.raises(OutcomeUnknown, match="probe is due"):
        slow()
    assert probed == [] and all(s <= 1 for s in clock.sleeps)
    clock.now += 60
    out = slow.outcome()
    assert out.result == "found" and out.via == "probe" and len(probed) == 1


# --- a record whose attempts never left ----------------------------------------------------------


def test_attempts_that_were_all_not_sent_leave_the_operation_free_to_start_afresh(ledger: Ledger) -> None:
    """Run before its server was up, three refused connections left the record ``abandoned`` for the
    ttl: every later call raised ``AttemptsExhausted`` though nothing had happened. Now the call that
    ran out still says so, and a later call starts afresh with a new attempt budget."""
    runs: list[str] = []
    up = False

    @ledger.tool(name="notify", retry=Retry(attempts=3, base=0.01))
    def notify(user: str) -> str:
        runs.append(user)
        if not up:
            raise ConnectionRefusedError("connection refused")
        return "sent"

    with pytest.raises(AttemptsExhausted, match="none of them reached the other side") as info:
        notify("ann")
    assert "ConnectionRefusedError" in str(info.value)
    rec = ledger.get(notify.key_for("ann"))
    assert rec is not None and rec.state is State.ABANDONED and rec.attempts == 3
    assert not st.may_have_happened(rec)

    up = True
    out = notify.outcome("ann")
    assert (out.result, out.attempts, out.fence, out.replayed) == ("sent", 1, 4, False)
    assert runs == ["ann"] * 4
    rec = ledger.get(out.key)
    assert rec is not None
    assert [h["to"] for h in rec.history][-3:] == ["abandoned", "in_flight", "confirmed"]


def test_an_abandoned_record_of_a_tool_that_never_dispatched_starts_afresh(ledger: Ledger) -> None:
    """A ``reports_dispatch`` tool whose attempts all stopped before ``mark_sent()``: nothing left."""
    runs: list[int] = []

    @ledger.tool(name="dispatching", reports_dispatch=True, retry=Retry(attempts=2, base=0.01))
    def dispatching() -> str:
        runs.append(1)
        if len(runs) <= 2:
            raise TimeoutError("DNS lookup timed out")  # before mark_sent(): not sent
        onceonly.mark_sent()
        return "ok"

    with pytest.raises(AttemptsExhausted):
        dispatching()
    assert dispatching() == "ok" and len(runs) == 3


def test_an_abandoned_record_after_an_attempt_that_may_have_happened_stays_abandoned(ledger: Ledger) -> None:
    """One attempt whose outcome was unknown (it may have charged) keeps ``abandoned`` sticky, whatever
    the attempts after it: only a person resets it."""
    runs: list[str] = []

    @ledger.tool(name="charge", on_unknown="retry", retry=Retry(attempts=3, base=0.01))
    def charge() -> str:
        runs.append("run")
        if len(runs) == 1:
            raise TimeoutError("read timed out")  # may have arrived
        raise ConnectionRefusedError("refused")

    with pytest.raises(AttemptsExhausted):
        charge()
    assert len(runs) == 3
    with pytest.raises(AttemptsExhausted, match="--reset"):
        charge()
    assert len(runs) == 3
    rec = ledger.get(charge.key_for())
    assert rec is not None and rec.state is State.ABANDONED and st.may_have_happened(rec)


def test_an_abandoned_record_after_a_definite_failure_stays_abandoned(ledger: Ledger) -> None:
    """The tool's own error ran the tool: its attempt counts as one that may have had an effect."""
    runs: list[int] = []

    @ledger.tool(name="book", retry=Retry(attempts=2, base=0.01))
    def book() -> str:
        runs.append(1)
        if len(runs) == 1:
            raise ValueError("seat taken")
        raise ConnectionRefusedError("refused")

    with pytest.raises(ValueError, match="seat taken"):
        book()
    with pytest.raises(AttemptsExhausted):
        book()
    with pytest.raises(AttemptsExhausted):
        book()
    assert len(runs) == 2


# --- what AttemptsExhausted says ------------------------------------------------------------------


def test_attempts_exhausted_names_the_recorded_error_when_this_call_had_none(ledger: Ledger) -> None:
    """A call that finds the attempts used up by earlier calls said "the last error was None" while the
    record held it: it now names the recorded error."""

    @ledger.tool(name="validate", retry=Retry(attempts=1))
    def validate(n: int) -> None:
        raise ValueError(f"bad input: {n}")

    with pytest.raises(ValueError):
        validate(42)
    with pytest.raises(AttemptsExhausted) as info:
        validate(42)
    text = str(info.value)
    assert "ValueError: bad input: 42" in text and "None" not in text
    assert info.value.last_exception is None


def test_a_readonly_tool_does_not_wait_out_a_retry_after_longer_than_wait(ledger: Ledger, clock: FakeClock) -> None:
    """A read (``readonly=True``, no record) slept out ``Retry-After: 86400`` too. A wait longer than
    ``wait`` is not waited for: the read fails now with the service's own error; shorter ones are retried."""
    answers = ["86400", "1"]
    reads: list[str] = []

    @ledger.tool(name="lookup", readonly=True, wait=2)
    def lookup() -> str:
        reads.append("read")
        if answers:
            raise _status_error(503, answers.pop(0))
        return "found"

    with pytest.raises(httpx.HTTPStatusError):
        lookup()
    assert reads == ["read"] and clock.sleeps == []
    assert lookup() == "found" and clock.sleeps == [1.0]
