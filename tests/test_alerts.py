"""Alerts: WARNING events on the ``onceonly.alerts`` logger with a stable ``event`` name, for a key
reused with other arguments (by the guard, the server middleware's 422 and onceonly.http's), a record
parked for review and a late outcome that reveals a duplicate (the audit's disagreements are in
test_operate_cli)."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

import onceonly.http
from onceonly import KeyConflict, Ledger, OutcomeUnknown, State
from onceonly.events import short_key
from onceonly.metrics import enable, instrument
from onceonly.tickets import create_app, serve_in_thread


def _events(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    return [r.onceonly for r in caplog.records if r.name == "onceonly.alerts"]  # type: ignore[attr-defined]


def test_key_conflict_and_parking_alert(store_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A KeyConflict and a record parked for review each log one WARNING named after them, with the
    key and tool, whether or not anyone listens to the transitions."""
    with Ledger.open(store_url) as ledger:

        @ledger.tool(name="charge", key=["order"])
        def charge(order: str, amount: int) -> None:
            return None

        @ledger.tool(name="refund", on_unknown="review")
        def refund(order: str) -> None:
            raise TimeoutError("read timed out")

        charge("o-1", 10)
        with caplog.at_level(logging.WARNING, logger="onceonly.alerts"):
            with pytest.raises(KeyConflict):
                charge("o-1", 20)
            with pytest.raises(OutcomeUnknown):
                refund("o-1")
        (parked,) = ledger.list(state="needs_review")
    events = _events(caplog)
    assert [e["event"] for e in events] == ["KeyConflict", "ParkedForReview"], events
    assert events[0]["tool"] == "charge" and events[1]["key"] == parked.key and events[1]["tool"] == "refund"


def test_a_late_duplicate_alerts(store_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """An attempt that timed out, was resolved as failed by a person, then succeeded late: the
    record counts a conflict and a LateDuplicate warning is logged."""
    done = threading.Event()
    with Ledger.open(store_url) as ledger:

        @ledger.tool(name="ship", timeout=0.1)
        def ship(order: str) -> str:
            time.sleep(1.0)
            done.set()
            return "shipped"

        with caplog.at_level(logging.WARNING, logger="onceonly.alerts"):
            with pytest.raises(OutcomeUnknown):
                ship("o-1")
            (rec,) = ledger.list(state="needs_review")
            ledger.resolve(rec.key, failed="the carrier has no such parcel", by="ops")
            assert done.wait(10)
            deadline = time.monotonic() + 10
            while (now := ledger.get(rec.key)) is not None and now.conflicts == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            # The late outcome's thread logs its alert just after its write: wait for it, not for the write.
            while len(_events(caplog)) < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
        assert now is not None and now.conflicts == 1 and now.state is State.CONFIRMED
    names = [e["event"] for e in _events(caplog)]
    assert names == ["ParkedForReview", "LateDuplicate"], names


# --- KeyConflict from the server middleware and from onceonly.http ---------------------------------

_SECRET_BODY = "card 4242 4242 4242 4242"
_CLIENT_KEY = "order-77-private-key"


def _ticket(title: str) -> dict[str, str]:
    return {"session_id": "s-1", "title": title, "body": _SECRET_BODY}


def _conflict_alerts(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "onceonly.alerts" and r.onceonly["event"] == "KeyConflict"]  # type: ignore[attr-defined]


def _check_nothing_private(records: list[logging.LogRecord]) -> None:
    """No alert shows the request body or the client's key: only the route and a hash of the key."""
    for record in records:
        shown = f"{record.getMessage()} {record.onceonly}"  # type: ignore[attr-defined]
        assert _SECRET_BODY not in shown and _CLIENT_KEY not in shown, shown
        assert record.onceonly["key"] == short_key(_CLIENT_KEY)  # type: ignore[attr-defined]


def _reuse_key(url: str) -> httpx.Response:
    """The same key twice, with another body the second time: the second answer."""
    with httpx.Client(base_url=url, timeout=10.0) as client:
        first = client.post("/tickets", json=_ticket("a"), headers={"Idempotency-Key": _CLIENT_KEY})
        assert first.status_code == 201, first.text
        return client.post("/tickets", json=_ticket("b"), headers={"Idempotency-Key": _CLIENT_KEY})


@pytest.mark.parametrize("mode", ["store", "transactional"])
def test_the_server_alerts_a_key_reused_with_another_body(
    mode: str, sqlite_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The middleware's 422 (store mode, and transactional mode's own path) logs one KeyConflict alert
    with the route and a hash of the key, never the body or the key, and counts it as a conflict."""
    registry = CollectorRegistry()
    enable(registry)
    app = create_app(tmp_path / "tickets.db", store=sqlite_url if mode == "store" else None)
    with serve_in_thread(app) as server, caplog.at_level(logging.WARNING, logger="onceonly.alerts"):
        answer = _reuse_key(server.url)
    assert answer.status_code == 422, answer.text
    (record,) = _conflict_alerts(caplog)
    fields = record.onceonly  # type: ignore[attr-defined]
    assert fields["source"] == "server" and fields["tool"] == "http" and fields["route"] == "POST /tickets"
    _check_nothing_private([record])
    assert registry.get_sample_value("onceonly_conflicts_total", {"source": "server", "tool": "http"}) == 1


def test_the_http_client_alerts_a_422_once_inside_a_guarded_tool(
    store_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``onceonly.http`` turns a server's 422 into KeyConflict with one alert: outside a guarded call,
    and inside one (with the tool's name), where the guard re-raising the tool's KeyConflict does not
    alert it a second time. The server's own alert is the other one of each pair."""
    registry = CollectorRegistry()
    app = create_app(tmp_path / "tickets.db")
    with Ledger.open(store_url) as ledger, serve_in_thread(app) as server:
        instrument(ledger, registry=registry)

        @ledger.tool(name="open_ticket")
        def open_ticket(title: str) -> int:
            with onceonly.http.Client(base_url=server.url) as client:
                # A fixed key for two different tickets: the mistake the server's 422 reports.
                return int(client.post("/tickets", json=_ticket(title), idempotency_key=_CLIENT_KEY).status_code)

        with caplog.at_level(logging.WARNING, logger="onceonly.alerts"):
            assert open_ticket("a") == 201
            with pytest.raises(KeyConflict):
                open_ticket("b")
            with onceonly.http.Client(base_url=server.url) as client, pytest.raises(KeyConflict):
                client.post("/tickets", json=_ticket("c"), idempotency_key=_CLIENT_KEY)
    records = _conflict_alerts(caplog)
    assert [(r.onceonly["source"], r.onceonly["tool"]) for r in records] == [  # type: ignore[attr-defined]
        ("server", "http"),
        ("http", "open_ticket"),
        ("server", "http"),
        ("http", None),
    ]
    assert records[1].onceonly["route"] == "POST /tickets"  # type: ignore[attr-defined]
    _check_nothing_private(records)
    counted = {
        (s.labels["source"], s.labels["tool"]): s.value
        for family in registry.collect()
        if family.name == "onceonly_conflicts"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert counted == {("server", "http"): 2, ("http", "open_ticket"): 1, ("http", ""): 1}, counted
