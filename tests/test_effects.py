"""Effect classes: ``write`` (the default), ``idempotent`` (an unknown outcome is resent with the same
key) and ``read`` (no record, no lease). Real stores; the side effects land in a real SQLite table."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from onceonly import Ledger, OutcomeUnknown, Retry, State


def _charges(path: Path) -> sqlite3.Connection:
    """A payment service that honours idempotency keys: one row, one charge, per key."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("CREATE TABLE IF NOT EXISTS charges (key TEXT PRIMARY KEY, amount INTEGER, n INTEGER)")
    return conn


def _lost_answer_tool(ledger: Ledger, conn: sqlite3.Connection, **settings: Any) -> tuple[Any, list[str]]:
    """A charge whose first answer comes after timeout=: the charge is made, the caller never hears of it."""
    seen: list[str] = []
    resent = threading.Event()
    lock = threading.Lock()

    @ledger.tool(name="charge", timeout=0.2, retry=Retry(attempts=3, base=0.0, cap=0.0), **settings)
    def charge(order: str, amount: int, idempotency_key: str) -> dict[str, Any]:
        with lock:
            seen.append(idempotency_key)
            first = len(seen) == 1
        conn.execute("INSERT OR IGNORE INTO charges VALUES (?, ?, ?)", (idempotency_key, amount, len(seen)))
        if first:
            resent.wait(5)  # the answer is lost: it arrives after the caller gave up on it
        else:
            resent.set()
        row = conn.execute("SELECT n FROM charges WHERE key = ?", (idempotency_key,)).fetchone()
        return {"order": order, "charge": row[0]}

    return charge, seen


def test_idempotent_tool_is_resent_once_with_the_same_key(store_url: str, tmp_path: Path) -> None:
    conn = _charges(tmp_path / "service.db")
    ledger = Ledger.open(store_url)
    charge, seen = _lost_answer_tool(ledger, conn, effect="idempotent")
    out = charge.outcome("o-1", 500)
    assert out.result == {"order": "o-1", "charge": 1}  # the service's first charge, answered again
    assert seen == [out.key, out.key]  # resent once, with the same key
    assert conn.execute("SELECT COUNT(*) FROM charges").fetchone() == (1,)
    time.sleep(0.3)  # the first attempt's late answer is fenced off: the record stays as it is
    rec = ledger.get(out.key)
    assert rec is not None and rec.state is State.CONFIRMED
    assert charge("o-1", 500) == {"order": "o-1", "charge": 1} and len(seen) == 2  # replayed, not run
    ledger.close()
    conn.close()


def test_write_tool_is_not_resent_after_a_lost_answer(store_url: str, tmp_path: Path) -> None:
    """The default: an unknown outcome of a write goes to review; the tool is not run a second time."""
    conn = _charges(tmp_path / "service.db")
    ledger = Ledger.open(store_url)
    charge, seen = _lost_answer_tool(ledger, conn)
    assert charge.spec.effect == "write" and charge.spec.policy.on_unknown == "review"
    with pytest.raises(OutcomeUnknown):
        charge("o-1", 500)
    assert len(seen) == 1
    ledger.close()
    conn.close()


def test_idempotent_keeps_an_explicit_on_unknown(ledger: Ledger) -> None:
    @ledger.tool(effect="idempotent", on_unknown="review")
    def put(name: str) -> str:
        return name

    assert put.spec.policy.on_unknown == "review" and put.spec.effect == "idempotent"


@pytest.mark.parametrize("settings", [{"effect": "read"}, {"readonly": True}, {"readonly": True, "effect": "read"}])
def test_read_tool_writes_no_record(ledger: Ledger, settings: dict[str, Any]) -> None:
    runs: list[str] = []

    @ledger.tool(**settings)
    def balance(account: str) -> int:
        runs.append(account)
        return 42

    assert balance("a") == 42 and balance("a") == 42
    assert runs == ["a", "a"]  # run as it is, every time
    assert balance.spec.effect == "read" and balance.spec.readonly
    assert ledger.list() == [] and sum(ledger.stats().values()) == 0


def test_read_tool_gives_up_past_its_timeout(sqlite_url: str) -> None:
    ledger = Ledger.open(sqlite_url)
    release = threading.Event()

    @ledger.tool(effect="read", timeout=0.1, retry=Retry(attempts=1))
    def slow(q: str) -> str:
        release.wait(5)
        return q

    with pytest.raises(TimeoutError, match=re.escape("timeout=0.1")):
        slow("x")
    release.set()
    assert ledger.list() == []
    ledger.close()


def test_async_read_tool_gives_up_past_its_timeout(sqlite_url: str) -> None:
    ledger = Ledger.open(sqlite_url)

    @ledger.tool(effect="read", timeout=0.1, retry=Retry(attempts=1))
    async def slow(q: str) -> str:
        await asyncio.sleep(5)
        return q

    with pytest.raises(TimeoutError):
        asyncio.run(slow("x"))
    assert ledger.list() == []
    ledger.close()


@pytest.mark.parametrize(
    ("settings", "error", "says"),
    [
        ({"effect": "read", "on_unknown": "probe"}, TypeError, "effect='read' keeps no record, so on_unknown="),
        ({"effect": "read", "on_unknown": "review"}, TypeError, "drop on_unknown"),
        ({"effect": "read", "probe": lambda a, k: None}, TypeError, "drop probe"),
        ({"readonly": True, "effect": "write"}, TypeError, "pass effect='write' alone"),
        ({"readonly": True, "effect": "idempotent"}, TypeError, "readonly=True is the same as effect='read'"),
        ({"effect": "delete"}, ValueError, "use one of 'write', 'idempotent', 'read'"),
    ],
)
def test_contradictory_settings_are_refused(
    ledger: Ledger, settings: dict[str, Any], error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=re.escape(says)):
        ledger.tool(**settings)
