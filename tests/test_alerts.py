"""Alerts: WARNING events on the ``onceonly.alerts`` logger with a stable ``event`` name, for a key
reused with other arguments, a record parked for review and a late outcome that reveals a duplicate
(the audit's disagreements are in test_operate_cli)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from onceonly import KeyConflict, Ledger, OutcomeUnknown, State


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
        assert now is not None and now.conflicts == 1 and now.state is State.CONFIRMED
    names = [e["event"] for e in _events(caplog)]
    assert names == ["ParkedForReview", "LateDuplicate"], names
