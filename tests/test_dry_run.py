"""Dry runs: guarded calls run nothing and write nothing, each returns a ``DryRun`` saying what it would
have done, and the recorder lists them. Real stores; the only store call of a dry-run call is a read."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import onceonly
from onceonly import DryRun, DryRunLog, Ledger, OutcomeUnknown, State
from onceonly.stores import open_store
from tests._clock import FakeClock


class _Watched:
    """A real store that notes the name of each method called on it (reads and writes alike)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.called: list[str] = []

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._store, name)
        if callable(found):

            def noted(*args: Any, **kwargs: Any) -> Any:
                self.called.append(name)
                return found(*args, **kwargs)

            return noted
        return found


def test_a_dry_run_runs_nothing_writes_nothing_and_lists_the_calls(store_url: str, clock: FakeClock) -> None:
    watched = _Watched(open_store(store_url))
    ledger = Ledger(watched, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
    sent: list[str] = []

    @ledger.tool(name="send_email", key=("to",))
    def send_email(to: str, body: str) -> str:
        sent.append(to)
        return f"sent to {to}"

    assert send_email("a@x", "hi") == "sent to a@x"  # a real call first: its record is confirmed
    before = ledger.get(send_email.key_for("a@x", "hi"))
    watched.called.clear()
    with ledger.dry_run() as seen:
        again = send_email("a@x", "hi")
        fresh = send_email("b@x", "hello")
        other = send_email("a@x", "other body")
    assert sent == ["a@x"]  # nothing ran inside
    assert set(watched.called) == {"get"} and len(watched.called) == 3  # one read each, never a claim
    assert isinstance(again, DryRun) and isinstance(seen, DryRunLog)
    assert [(e.tool, dict(e.arguments), e.would) for e in seen] == [
        ("send_email", {"to": "a@x", "body": "hi"}, "replay"),
        ("send_email", {"to": "b@x", "body": "hello"}, "run"),
        ("send_email", {"to": "a@x", "body": "other body"}, "conflict"),
    ]
    assert seen == [again, fresh, other] and again.key == before.key  # type: ignore[union-attr]
    assert ledger.get(fresh.key) is None and ledger.get(before.key) == before  # type: ignore[union-attr]
    assert str(fresh) == "not run: dry run (send_email would run; nothing was done or recorded)"
    # Outside the block the tool runs again, as before.
    assert send_email("b@x", "hello") == "sent to b@x" and sent == ["a@x", "b@x"]
    assert ledger.runtime.dry is None
    ledger.close()


def test_what_a_call_would_do_is_read_from_its_record(ledger: Ledger) -> None:
    """Unknown, needs review and failed records each tell what the call would do next."""

    @ledger.tool(timeout=None)
    def lost(n: int) -> int:
        raise TimeoutError("the answer was lost")

    @ledger.tool(on_unknown="retry", retry=onceonly.Retry(attempts=1))
    def flaky(n: int) -> int:
        raise TimeoutError("the answer was lost")

    with pytest.raises(OutcomeUnknown):
        lost(1)  # review: parked for a person
    with pytest.raises(OutcomeUnknown):
        flaky(1)  # retry, one attempt: used up, parked too
    with ledger.dry_run() as seen:
        lost(1)
        flaky(2)
    assert [e.would for e in seen] == ["refuse", "run"]
    assert ledger.get(lost.key_for(1)).state is State.NEEDS_REVIEW  # type: ignore[union-attr]


def test_a_dry_run_is_only_in_its_own_context(sqlite_url: str) -> None:
    """Another thread's calls on the same ledger run as usual while one thread is in a dry run."""
    ledger = Ledger.open(sqlite_url)
    ran: list[int] = []

    @ledger.tool
    def act(n: int) -> int:
        ran.append(n)
        return n

    results: list[Any] = []
    with ledger.dry_run() as seen:
        worker = threading.Thread(target=lambda: results.append(act(2)))
        worker.start()
        worker.join()
        results.append(act(1))
    assert results[0] == 2 and isinstance(results[1], DryRun)
    assert ran == [2] and [e.arguments for e in seen] == [{"n": 1}]
    ledger.close()


def test_async_tools_and_tell_model_read_not_run(sqlite_url: str) -> None:
    ledger = Ledger.open(sqlite_url)
    ran: list[str] = []

    @ledger.tool(name="book", tell_model=True)
    async def book(room: str) -> str:
        ran.append(room)
        return "booked"

    async def main() -> Any:
        with ledger.dry_run() as seen:
            return await book("r1"), seen

    told, seen = asyncio.run(main())
    assert ran == [] and ledger.list() == []
    assert told == "not run: dry run (book would run; nothing was done or recorded)"
    assert len(seen) == 1 and seen[0].would == "run"
    out = onceonly.tell_model(asyncio.run(_outcome_in_dry_run(ledger, book)))
    assert out.startswith("not run: dry run")
    ledger.close()


async def _outcome_in_dry_run(ledger: Ledger, tool: Any) -> onceonly.Outcome:
    with ledger.dry_run():
        return await tool.outcome("r2")


def test_read_tools_run_in_a_dry_run(ledger: Ledger) -> None:
    """A read has no side effect: it runs as usual, and is not listed."""

    @ledger.tool(effect="read")
    def look(q: str) -> str:
        return q.upper()

    with ledger.dry_run() as seen:
        assert look("x") == "X"
    assert seen == []


def test_the_environment_puts_the_whole_ledger_in_a_dry_run(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONCEONLY_DRY_RUN", "1")
    ledger = Ledger.open(store_url)
    ran: list[int] = []

    @ledger.tool
    def pay(n: int) -> int:
        ran.append(n)
        return n

    got = pay(5)
    with ledger.dry_run() as seen:  # a block inside lists its own calls apart
        pay(6)
    assert isinstance(got, DryRun) and got.would == "run" and ran == []
    assert [e.arguments for e in seen] == [{"n": 6}]
    assert ledger.runtime.dry is not None and [e.arguments for e in ledger.runtime.dry.always or []] == [{"n": 5}]
    assert ledger.list() == []
    ledger.close()
    monkeypatch.delenv("ONCEONLY_DRY_RUN")
    plain = Ledger.open(store_url)
    assert plain.runtime.dry is None
    plain.close()
