"""Helpers of the reconciler's tests: the records a killed caller leaves, and a store that fails on cue."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from onceonly import Ledger, State
from onceonly import states as st
from onceonly.errors import StoreUnavailable
from onceonly.states import Record
from onceonly.stores import Query, Store


def dead_holder(ledger: Ledger, tool: Any, *args: Any, state: State = State.IN_FLIGHT, age: float = 100) -> Record:
    """The record a caller leaves when it is killed mid-call: held, its lease long expired.

    ``tool`` is a tool of ``ledger`` or its name; ``age`` is how long ago, on the ledger's clock, it claimed.
    """
    if isinstance(tool, str):
        tool = ledger.tools[tool]
    call = tool.spec.call(args, {}, None, 1)
    rec = st.new_record(
        key=call.key, scope=call.scope, tool=call.tool, fingerprint=call.fingerprint, args_json=call.args_json,
        state=state, owner="dead-host:1:1", now=ledger.clock() - age, lease_seconds=30,
    )  # fmt: skip
    assert ledger.store.insert(rec)
    return rec


@dataclass
class Fault:
    """One failure, used once: the ``skip``-th next matching call of ``method`` raises StoreUnavailable.

    A swap matches on the states it moves between (``frm`` → ``to``, ``None``: any). With ``lands`` the
    swap writes first, then raises: the write landed, its answer was lost. ``then`` is armed when this
    one fires (a store that stays down for the read that follows).
    """

    method: str
    frm: State | None = None
    to: State | None = None
    lands: bool = False
    skip: int = 0
    then: Fault | None = None


class FlakyStore:
    """The real store, passed through (sync and async), that fails as its ``faults`` say; ``raised``
    lists the methods that raised, in order."""

    def __init__(self, inner: Store, *faults: Fault) -> None:
        self.inner = inner
        self.url = inner.url
        self.faults = list(faults)
        self.raised: list[str] = []

    def _fault(self, method: str, record: Record | None = None, expected: Record | None = None) -> Fault | None:
        for fault in self.faults:
            if fault.method != method:
                continue
            if fault.frm is not None and (expected is None or expected.state is not fault.frm):
                continue
            if fault.to is not None and (record is None or record.state is not fault.to):
                continue
            if fault.skip:
                fault.skip -= 1
                return None
            self.faults.remove(fault)
            if fault.then is not None:
                self.faults.append(fault.then)
            return fault
        return None

    def _fail(self, method: str) -> StoreUnavailable:
        self.raised.append(method)
        return StoreUnavailable(f"injected: {method} failed")

    def get(self, key: str) -> Record | None:
        if self._fault("get"):
            raise self._fail("get")
        return self.inner.get(key)

    def claim(self, record: Record) -> Record | None:
        return self.inner.claim(record)

    def insert(self, record: Record) -> bool:
        return self.inner.insert(record)

    def swap(self, record: Record, expected: Record) -> bool:
        fault = self._fault("swap", record, expected)
        if fault is None:
            return self.inner.swap(record, expected)
        if fault.lands and not self.inner.swap(record, expected):
            self._rearm(fault)
            return False
        raise self._fail("swap")

    def _rearm(self, fault: Fault) -> None:
        """A landing fault met a write whose compare-and-set lost (another write came first): there is
        no landed write whose answer to lose. It waits for the next matching write, as if unmatched."""
        self.faults.insert(0, fault)
        if fault.then is not None and fault.then in self.faults:
            self.faults.remove(fault.then)

    def delete(self, key: str, expected_version: int, created_at: float | None = None) -> bool:
        return self.inner.delete(key, expected_version, created_at)

    def scan(self, query: Query) -> list[Record]:
        if self._fault("scan"):
            raise self._fail("scan")
        return self.inner.scan(query)

    def count_by_state(self) -> dict[State, int]:
        return self.inner.count_by_state()

    def wait_for_change(self, key: str, version: int, timeout: float) -> None:
        self.inner.wait_for_change(key, version, timeout)

    def close(self) -> None:
        self.inner.close()

    # The async face: the same faults on reads and swaps; the rest passes through.

    async def aget(self, key: str) -> Record | None:
        if self._fault("get"):
            raise self._fail("get")
        return await self.inner.aget(key)  # type: ignore[attr-defined, no-any-return]

    async def aswap(self, record: Record, expected: Record) -> bool:
        fault = self._fault("swap", record, expected)
        if fault is None:
            return await self.inner.aswap(record, expected)  # type: ignore[attr-defined, no-any-return]
        if fault.lands and not await self.inner.aswap(record, expected):  # type: ignore[attr-defined]
            self._rearm(fault)  # as in swap
            return False
        raise self._fail("swap")

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("a"):
            raise AttributeError(name)
        return getattr(self.inner, name)  # aclaim, ainsert, await_for_change: passed through
