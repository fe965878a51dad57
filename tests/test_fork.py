"""Heartbeats in a process forked after the ledger was used, and after their thread died: a long tool
keeps its lease, so that a second caller waits for its outcome instead of running it again."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import onceonly
from onceonly import Ledger, State
from onceonly.states import HELD
from tests._workers import count_effects, effects_db

LEASE = 0.6  # heartbeats extend it every 0.2 s; the tool runs 2.5 leases
RUNS = 1.5


def _pay_tool(ledger: Ledger, effects: Path) -> Any:
    # on_unknown="retry", at once: a lease lost while the tool runs would run it again.
    @ledger.tool(name="fork.pay", lease=LEASE, wait=20, on_unknown="retry", retry=onceonly.Retry(base=0.01))
    def pay(order: str) -> dict[str, Any]:
        conn = effects_db(effects)
        try:
            conn.execute("INSERT INTO effects VALUES (?, ?, ?)", (order, str(os.getpid()), time.time()))
        finally:
            conn.close()
        time.sleep(RUNS)
        return {"order": order, "by": os.getpid()}

    return pay


def _wait_for_child(pid: int, seconds: float) -> int:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError(f"the forked child {pid} did not finish in {seconds} s")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_child_forked_after_use_extends_its_leases(store_url: str, tmp_path: Path) -> None:
    """Fork after a guarded call (the parent's heartbeat thread is running, and is not in the child):
    the child's tool outlives its lease, its heartbeats still extend it, and a second caller in the
    parent waits and replays the child's result. One side effect, counted in a SQLite table.

    The parent's second caller opens its own ledger: a forked child must not share the parent's live
    connections (docs/postgres.md), and the heartbeats are what this test is about."""
    effects = tmp_path / "effects.db"
    effects_db(effects).close()
    ledger = Ledger.open(store_url)
    pay = _pay_tool(ledger, effects)

    @ledger.tool(name="fork.warm")
    def warm(n: int) -> int:
        return n

    assert warm(1) == 1  # starts this process's heartbeat thread
    pid = os.fork()
    if pid == 0:  # the child: the long call; its exit code says what it got
        code = 3
        try:
            out = pay.outcome("o-1")
            code = 0 if (out.replayed, out.result["by"]) == (False, os.getpid()) else 1
        except BaseException:
            code = 2
        finally:
            os._exit(code)

    other = Ledger.open(store_url)
    reaped = False
    try:
        pay_again = _pay_tool(other, effects)
        key = pay_again.key_for("o-1")
        deadline = time.monotonic() + 10
        while (rec := other.get(key)) is None or rec.state not in HELD:
            assert time.monotonic() < deadline, "the child never claimed the call"
            time.sleep(0.01)
        time.sleep(LEASE * 1.5)  # past the child's first lease: only its heartbeats keep it held
        out = pay_again.outcome("o-1")
        code = _wait_for_child(pid, 30)
        reaped = True
        assert code == 0, "the child ran the call and got its own result"
        assert out.replayed and out.result == {"order": "o-1", "by": pid}
        assert count_effects(effects) == {"o-1": 1}
        rec = other.get(key)
        assert rec is not None and rec.state is State.CONFIRMED and rec.attempts == 1
        assert [h["to"] for h in rec.history] == ["in_flight", "confirmed"], "the lease was lost on the way"
    finally:
        if not reaped:
            _wait_for_child(pid, 30)
        other.close()
        ledger.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_heartbeat_thread_that_died_is_started_again(sqlite_url: str) -> None:
    """An error that ends the heartbeat thread (here its clock) does not end heartbeats for good: the
    next guarded call starts a new thread, and its long tool's lease is extended."""
    died = threading.Event()

    def clock() -> float:
        if threading.current_thread().name == "onceonly-heartbeat" and not died.is_set():
            died.set()
            raise RuntimeError("the clock failed once")
        return time.time()

    ledger = Ledger.open(sqlite_url, clock=clock)
    seen: list[float | None] = []

    @ledger.tool(name="beat.long", lease=0.3)
    def long(n: int) -> int:
        info = onceonly.current_call()
        assert info is not None
        time.sleep(0.6)
        rec = ledger.get(info.key)
        assert rec is not None
        seen.append(rec.lease_until)
        return n

    @ledger.tool(name="beat.warm")
    def warm(n: int) -> int:
        return n

    warm(1)
    assert died.wait(5), "the first heartbeat thread never looked at its clock"
    time.sleep(0.05)  # let it end
    start = time.time()
    assert long(1) == 1
    until = seen[0]
    assert until is not None and until > start + 0.6, "the lease was never extended: no heartbeat thread ran"
    ledger.close()
