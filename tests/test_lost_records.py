"""A record lost from the store (a Redis restart without persistence, a failover to a lagging replica,
a row deleted by hand) and made again by a new caller: the caller that held the lost record must not
write over the new one, and its side effect is counted as a conflict, on every store."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from onceonly import Ledger, Outcome, State
from onceonly import states as st
from onceonly.drivers import drive
from onceonly.plan import late_outcome
from onceonly.states import Record
from onceonly.stores import open_store
from tests._redis_server import PrivateRedis


def _record(url: str, key: str) -> Record:
    store = open_store(url)
    try:
        rec = store.get(key)
    finally:
        store.close()
    assert rec is not None
    return rec


def _lose(url: str, key: str) -> None:
    """Delete ``key``'s record behind the ledgers' backs, as a restart without persistence would."""
    store = open_store(url)
    try:
        rec = store.get(key)
        assert rec is not None and store.delete(key, rec.version)
    finally:
        store.close()


class _Callers:
    """Two ledgers on one store (two hosts), each with the same tool: ``charge`` logs its side effect
    in ``effects`` and, for the callers named in ``hold``, waits on that caller's event first."""

    def __init__(self, url: str) -> None:
        self.effects: list[str] = []
        self.entered = {name: threading.Event() for name in ("a", "b")}
        self.release = {name: threading.Event() for name in ("a", "b")}
        self.ledgers = {name: Ledger.open(url) for name in ("a", "b")}
        self.tools: dict[str, Callable[..., Any]] = {}
        for name, ledger in self.ledgers.items():
            self.tools[name] = self._tool(ledger, name)

    def _tool(self, ledger: Ledger, name: str) -> Callable[..., Any]:
        @ledger.tool(name="charge")
        def charge(order: int) -> dict[str, Any]:
            self.effects.append(name)
            self.entered[name].set()
            assert self.release[name].wait(20), f"caller {name} was never released"
            return {"charge": name, "order": order}

        return charge

    def start(self, name: str) -> tuple[threading.Thread, dict[str, Any]]:
        """Call ``charge(order=7)`` as caller ``name`` in a thread; wait until its tool runs."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["outcome"] = self.tools[name].outcome(7)  # type: ignore[attr-defined]
            except BaseException as exc:  # shown by the test's assertion
                box["error"] = exc

        thread = threading.Thread(target=run, name=f"caller-{name}")
        thread.start()
        assert self.entered[name].wait(20), f"caller {name}'s tool never ran"
        return thread, box

    def close(self) -> None:
        for event in self.release.values():
            event.set()
        for ledger in self.ledgers.values():
            ledger.close()


@pytest.fixture(name="callers")
def fixture_callers(store_url: str) -> Iterator[_Callers]:
    """Two callers (two ledgers) on a fresh store of each kind."""
    callers = _Callers(store_url)
    yield callers
    callers.close()


def _finish(thread: threading.Thread, box: dict[str, Any]) -> Outcome:
    thread.join(30)
    assert not thread.is_alive()
    assert "error" not in box, box.get("error")
    outcome: Outcome = box["outcome"]
    return outcome


def test_a_stale_holder_finishing_after_the_new_record_settled_is_counted(callers: _Callers, store_url: str) -> None:
    """A holds the record; it is lost; B makes it again, runs and confirms it; then A's tool returns.
    A's late success must not pass for B's attempt (both are fence 1 of version 1): the record keeps
    B's result and counts one conflict, since both side effects happened."""
    thread_a, box_a = callers.start("a")
    key = callers.tools["a"].key_for(7)  # type: ignore[attr-defined]
    _lose(store_url, key)

    callers.release["b"].set()
    b = callers.tools["b"].outcome(7)  # type: ignore[attr-defined]
    assert (b.replayed, b.result) == (False, {"charge": "b", "order": 7})

    callers.release["a"].set()
    a = _finish(thread_a, box_a)

    assert callers.effects == ["a", "b"]
    rec = _record(store_url, key)
    assert rec.state is State.CONFIRMED and rec.result == {"charge": "b", "order": 7}
    assert rec.conflicts == 1, rec.history
    assert a.replayed and a.result == {"charge": "b", "order": 7}
    assert "earlier record" in rec.history[-1]["reason"]


def test_a_stale_holder_cannot_write_over_the_new_holder(callers: _Callers, store_url: str) -> None:
    """A holds the record; it is lost; B makes it again and is still running when A's tool returns.
    A's confirmation (version 1 → 2, like B's own would be) must be refused by the store: it lands on
    nothing of B's but a counted conflict, and B then confirms its own attempt."""
    thread_a, box_a = callers.start("a")
    key = callers.tools["a"].key_for(7)  # type: ignore[attr-defined]
    created_a = _record(store_url, key).created_at
    _lose(store_url, key)

    thread_b, box_b = callers.start("b")
    held_b = _record(store_url, key)
    assert (held_b.version, held_b.fence, held_b.state) == (1, 1, State.IN_FLIGHT)
    assert held_b.created_at != created_a

    callers.release["a"].set()
    a = _finish(thread_a, box_a)
    after_a = _record(store_url, key)
    assert after_a.state is State.IN_FLIGHT and after_a.lease_owner == held_b.lease_owner, after_a
    assert after_a.conflicts == 1

    callers.release["b"].set()
    b = _finish(thread_b, box_b)

    assert callers.effects == ["a", "b"]
    assert (b.replayed, b.result) == (False, {"charge": "b", "order": 7})
    assert (a.replayed, a.result) == (False, {"charge": "a", "order": 7})  # its own tool's value
    rec = _record(store_url, key)
    assert rec.state is State.CONFIRMED and rec.result == {"charge": "b", "order": 7}
    assert rec.conflicts == 1, rec.history


def test_a_redis_restart_without_persistence_counts_the_second_run(tmp_path: Path) -> None:
    """The real thing on a private Redis that persists nothing: A's tool runs, the server restarts empty,
    B runs the same call again, then A's tool returns. A's late write is refused and counted: the
    record says both side effects happened (conflicts=1) instead of taking A's result for B's."""
    pytest.importorskip("redis")
    server = PrivateRedis(tmp_path).start()
    url = f"{server.url}?warn_persistence=false&prefix=lost"
    callers = _Callers(url)
    try:
        thread_a, box_a = callers.start("a")
        key = callers.tools["a"].key_for(7)  # type: ignore[attr-defined]
        server.restart()

        callers.release["b"].set()
        b = callers.tools["b"].outcome(7)  # type: ignore[attr-defined]
        assert (b.replayed, b.result) == (False, {"charge": "b", "order": 7})

        callers.release["a"].set()
        a = _finish(thread_a, box_a)
        assert callers.effects == ["a", "b"]
        assert a.replayed and a.result == {"charge": "b", "order": 7}
        rec = _record(url, key)
        assert rec.state is State.CONFIRMED and rec.result == {"charge": "b", "order": 7}
        assert rec.conflicts == 1, rec.history
    finally:
        callers.close()
        server.stop()


def test_a_late_outcome_of_an_attempt_on_a_lost_record_never_settles_the_new_one(ledger: Ledger) -> None:
    """A timed-out attempt's outcome arrives after its record was lost and made again (fence 1 again,
    unknown): its definite failure must not fail the new record (whose own attempt may have happened),
    and its success confirms it counted as a conflict, not as that attempt's own result."""

    @ledger.tool(name="t")
    def t() -> int:
        return 1

    call = t.spec.call((), {}, None, 1)
    call.created_at = ledger.clock() - 60  # the lost record's
    rec = st.new_record(
        key=call.key, scope=call.scope, tool=call.tool, fingerprint=call.fingerprint, args_json=call.args_json,
        state=State.IN_FLIGHT, owner="h:2:1", now=ledger.clock(), lease_seconds=30,
    )  # fmt: skip
    unknown = st.mark_unknown(rec, now=ledger.clock(), reason="timed out", by="h:2:1")
    assert ledger.store.insert(unknown)
    drive(ledger.runtime, late_outcome(call, 1, None, ValueError("refused")), t.spec, call, (), {})
    assert ledger.get(call.key) == unknown
    drive(ledger.runtime, late_outcome(call, 1, 5), t.spec, call, (), {})
    after = ledger.get(call.key)
    assert after is not None
    assert (after.state, after.result, after.via, after.conflicts) == (State.CONFIRMED, 5, "late:1", 1)
