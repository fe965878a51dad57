"""The sync and async drivers run one plan; a store that fails mid-write is handled the same by both.

A store error thrown into the plan means "this write may or may not have landed". Here it is injected
deterministically, before the real write or after it, on every write of a guarded call, through a
real SQLite store: whatever landed, the tool runs exactly once and every caller gets its result.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from onceonly import AttemptsExhausted, Ledger, Retry, State
from onceonly.errors import OutcomeUnknown, StoreUnavailable
from onceonly.events import TransitionEvent
from onceonly.states import Record
from onceonly.stores.sqlite import SQLiteStore
from tests._clock import FakeClock

T = TypeVar("T")


class FailingStore:
    """A real store whose next writes fail as scheduled: ``op:before`` raises without writing,
    ``op:after`` writes and then raises (the answer is lost). Everything else passes through."""

    def __init__(self, inner: SQLiteStore, faults: list[str]) -> None:
        self.inner = inner
        self.faults = list(faults)
        self.injected: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _when(self, op: str) -> str | None:
        for fault in self.faults:
            name, when = fault.split(":")
            if name == op:
                self.faults.remove(fault)
                self.injected.append(fault)
                return when
        return None

    def _write(self, op: str, write: Callable[[], T]) -> T:
        when = self._when(op)
        if when == "before":
            raise StoreUnavailable(f"injected: {op} failed before writing")
        result = write()
        if when == "after":
            raise StoreUnavailable(f"injected: {op} wrote, then its answer was lost")
        return result

    async def _awrite(self, op: str, write: Callable[[], Awaitable[T]]) -> T:
        when = self._when(op)
        if when == "before":
            raise StoreUnavailable(f"injected: {op} failed before writing")
        result = await write()
        if when == "after":
            raise StoreUnavailable(f"injected: {op} wrote, then its answer was lost")
        return result

    def claim(self, record: Record) -> Record | None:
        return self._write("claim", lambda: self.inner.claim(record))

    def insert(self, record: Record) -> bool:
        return self._write("insert", lambda: self.inner.insert(record))

    def swap(self, record: Record, expected: Record) -> bool:
        return self._write("swap", lambda: self.inner.swap(record, expected))

    async def aclaim(self, record: Record) -> Record | None:
        return await self._awrite("claim", lambda: self.inner.aclaim(record))

    async def ainsert(self, record: Record) -> bool:
        return await self._awrite("insert", lambda: self.inner.ainsert(record))

    async def aswap(self, record: Record, expected: Record) -> bool:
        return await self._awrite("swap", lambda: self.inner.aswap(record, expected))


def create_tool(ledger: Ledger, driver: str, runs: list[int]) -> Callable[[], Any]:
    """A guarded ``create(7)`` that records each run, through the sync or the async driver."""
    if driver == "sync":

        @ledger.tool(name="create")
        def create(n: int) -> dict[str, int]:
            runs.append(n)
            return {"id": n}

        return lambda: create(7)

    @ledger.tool(name="create")
    async def acreate(n: int) -> dict[str, int]:
        runs.append(n)
        return {"id": n}

    return lambda: asyncio.run(acreate(7))


FAULTS = [
    ["claim:before"],
    ["claim:after"],
    ["claim:before", "insert:before"],
    ["claim:before", "insert:after"],
    ["swap:before"],
    ["swap:after"],
    ["claim:after", "swap:after"],
]


@pytest.mark.parametrize("driver", ["sync", "async"])
@pytest.mark.parametrize("faults", FAULTS, ids=["+".join(f) for f in FAULTS])
def test_a_write_that_fails_mid_way_runs_the_tool_once(tmp_path: Path, faults: list[str], driver: str) -> None:
    store = FailingStore(SQLiteStore(f"sqlite:///{tmp_path / 'ledger.db'}"), faults)
    ledger = Ledger(store)  # type: ignore[arg-type]
    events: list[TransitionEvent] = []
    ledger.subscribe(events.append)
    runs: list[int] = []
    try:
        if driver == "sync":

            @ledger.tool(name="create")
            def create(n: int) -> dict[str, int]:
                runs.append(n)
                return {"id": n}

            first, again = create(7), create(7)
        else:

            @ledger.tool(name="create")
            async def acreate(n: int) -> dict[str, int]:
                runs.append(n)
                return {"id": n}

            async def both() -> tuple[Any, Any]:
                return await acreate(7), await acreate(7)

            first, again = asyncio.run(both())
        assert store.injected == faults, "every scheduled fault was met"
        assert runs == [7], "the tool ran exactly once"
        assert first == again == {"id": 7}
        rec = store.inner.get(ledger.tools["create"].key_for(7))
        assert rec is not None and rec.state is State.CONFIRMED and rec.attempts == 1
        # Every transition written is announced once, also a write whose answer was lost but landed.
        written = [(e["from"], e["to"]) for e in json.loads(rec.history_json)]
        assert [(e.from_state, e.to_state) for e in events] == written
    finally:
        ledger.close()


@pytest.mark.parametrize("driver", ["sync", "async"])
@pytest.mark.parametrize("refused", ["claim", "settle"])
def test_a_store_that_keeps_refusing_writes_ends_the_call_with_its_error(
    tmp_path: Path, refused: str, driver: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that fails every write while its reads work (a read-only server after a failover, a
    lock, a constraint) must not be asked again and again: a few pauses, then its error, saying
    whether the tool ran. Before, the plan took each unchanged re-read for a lost race and wrote again
    at once, forever."""
    faults = ["claim:before", *["insert:before"] * 10] if refused == "claim" else ["swap:before"] * 10
    store = FailingStore(SQLiteStore(f"sqlite:///{tmp_path / 'ledger.db'}"), faults)
    ledger = Ledger(store)  # type: ignore[arg-type]
    runs: list[int] = []
    call = create_tool(ledger, driver, runs)
    try:
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match="refused 4 writes") as err:
            call()
        assert time.monotonic() - start < 5, "a bounded number of short pauses"
        assert len(store.injected) == 4, "the first write and three more, no spin"
        rec = store.inner.get(ledger.tools["create"].key_for(7))
        if refused == "claim":
            assert runs == [] and rec is None
            assert "did not run the tool" in str(err.value)
        else:
            assert runs == [7], "the tool ran once"
            assert "this call ran the tool" in str(err.value)
            assert rec is not None and rec.state is State.IN_FLIGHT, "held until its lease runs out"
            assert 'returned {"id":7}' in caplog.text, "the result is logged for whoever settles it"
    finally:
        ledger.close()


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_the_refusal_bound_counts_refusals_in_a_row(tmp_path: Path, driver: str) -> None:
    """Three refused claims (a flicker of about a second), then the store takes writes again: the
    settle refused once more is retried and lands. Counted over the whole call, that fourth refusal
    raised after the tool had run, and its result was lost with the error."""
    faults = ["claim:before", "insert:before", "insert:before", "swap:before"]
    store = FailingStore(SQLiteStore(f"sqlite:///{tmp_path / 'ledger.db'}"), faults)
    ledger = Ledger(store)  # type: ignore[arg-type]
    runs: list[int] = []
    call = create_tool(ledger, driver, runs)
    try:
        got = call()
        assert store.injected == faults
        assert runs == [7] and got == {"id": 7}
        rec = store.inner.get(ledger.tools["create"].key_for(7))
        assert rec is not None and rec.state is State.CONFIRMED
    finally:
        ledger.close()


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_refused_write_of_an_unknown_outcome_is_written_again_not_waited_on(tmp_path: Path, driver: str) -> None:
    """The attempt timed out (unknown) and the store refused the write that marks it so: the record is
    still this call's own in_flight claim. The call must write it again (then settle it: review), not
    wait on its own lease as if another caller held it, and end with InProgress after wait=."""
    store = FailingStore(SQLiteStore(f"sqlite:///{tmp_path / 'ledger.db'}"), ["swap:before"])
    ledger = Ledger(store)  # type: ignore[arg-type]
    if driver == "sync":

        @ledger.tool(name="send", wait=5)
        def send(n: int) -> None:
            raise TimeoutError("read timed out")

        call: Callable[[], Any] = lambda: send(7)  # noqa: E731
    else:

        @ledger.tool(name="send", wait=5)
        async def asend(n: int) -> None:
            raise TimeoutError("read timed out")

        call = lambda: asyncio.run(asend(7))  # noqa: E731
    try:
        start = time.monotonic()
        with pytest.raises(OutcomeUnknown, match="settles unknowns by review"):
            call()
        assert time.monotonic() - start < 3, "no wait on its own lease"
        rec = store.inner.get(ledger.tools["send"].key_for(7))
        assert rec is not None and rec.state is State.NEEDS_REVIEW
    finally:
        ledger.close()


@pytest.mark.parametrize("driver", ["sync", "async"])
@pytest.mark.parametrize(
    ("error", "state", "runs_expected", "raised"),
    [(ConnectionRefusedError, State.ABANDONED, 3, AttemptsExhausted), (ValueError, State.FAILED, 1, ValueError)],
    ids=["not-sent", "failed"],
)
def test_a_refused_write_is_the_same_write_made_again(
    tmp_path: Path, driver: str, error: type[Exception], state: State, runs_expected: int, raised: type[Exception]
) -> None:
    """The store refuses the write that records an attempt's failure once: the same write is made again
    after the pause, and the call goes on as if nothing had happened (retried to its attempt limit; or
    failed for good). Deciding afresh from the call's own unchanged claim took it for an expired lease:
    a not-sent failure went to review after one attempt, a definite one stayed in_flight."""
    clock = FakeClock()

    async def asleep(seconds: float) -> None:
        clock.sleep(seconds)

    store = FailingStore(SQLiteStore(f"sqlite:///{tmp_path / 'ledger.db'}"), ["swap:before"])
    ledger = Ledger(store, clock=clock, sleep=clock.sleep, asleep=asleep)  # type: ignore[arg-type]
    runs: list[int] = []

    def fail(n: int) -> None:
        runs.append(n)
        raise error("refused" if error is ConnectionRefusedError else "bad order")

    if driver == "sync":
        call: Callable[[], Any] = lambda: ledger.tool(name="send", retry=Retry(attempts=3))(fail)(7)  # noqa: E731
    else:

        async def afail(n: int) -> None:
            fail(n)

        call = lambda: asyncio.run(ledger.tool(name="send", retry=Retry(attempts=3))(afail)(7))  # noqa: E731
    try:
        with pytest.raises(raised):
            call()
        assert store.injected == ["swap:before"] and len(runs) == runs_expected
        rec = store.inner.get(ledger.tools["send"].key_for(7))
        assert rec is not None and rec.state is state and rec.attempts == runs_expected
        assert "expired" not in rec.history_json
    finally:
        ledger.close()
