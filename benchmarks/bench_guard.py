"""The guard's own Python per call, with the store taken out of the measurement.

    python benchmarks/bench_guard.py            # first call and replay, µs of Python per call

The guard runs against a dict held in memory (a stand-in used only here, to isolate the guard's CPU
from any store's I/O; every test and every other benchmark uses the real stores). What it prints is
what every store pays on top of its own statements: keys and canonical JSON, the two records and
their history entries, the lease and the plan's generator and driver. The best of nine runs of
20,000 calls, so that machine noise shows as spread, not as cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter

import onceonly
from onceonly.states import Record, State
from onceonly.stores.base import Query


class DictStore:
    """The sync store interface on a dict, for the guard's happy path. Not a store: no durability,
    no other process, no waiting; what the happy path never calls says so."""

    url = "dict://bench"

    def __init__(self) -> None:
        self.records: dict[str, Record] = {}

    def claim(self, record: Record) -> Record | None:
        current = self.records.get(record.key)
        if current is None:
            self.records[record.key] = record
        return current

    def get(self, key: str) -> Record | None:
        return self.records.get(key)

    def insert(self, record: Record) -> bool:
        if record.key in self.records:
            return False
        self.records[record.key] = record
        return True

    def swap(self, record: Record, expected: Record) -> bool:
        current = self.records.get(record.key)
        if current is None or current.version != expected.version or current.created_at != expected.created_at:
            return False
        self.records[record.key] = record
        return True

    def delete(self, key: str, expected_version: int, created_at: float | None = None) -> bool:
        current = self.records.get(key)
        if current is None or current.version != expected_version or created_at not in (None, current.created_at):
            return False
        del self.records[key]
        return True

    def scan(self, query: Query) -> list[Record]:
        raise NotImplementedError("DictStore holds the happy path only")

    def count_by_state(self) -> dict[State, int]:
        return dict(Counter(r.state for r in self.records.values()))

    def wait_for_change(self, key: str, version: int, timeout: float) -> None:
        raise NotImplementedError("DictStore holds the happy path only: no other caller to wait for")

    def close(self) -> None:
        self.records.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args(argv)
    store = DictStore()
    with onceonly.Ledger(store) as ledger:  # a real ledger: its heartbeat thread, its clock
        tool = ledger.tool(name="bench.tool")(lambda i: {"ok": True, "i": i})
        for i in range(-1000, 0):
            tool(i)
        first: list[float] = []
        replay: list[float] = []
        for run in range(args.runs):
            ops = range(run * args.calls, (run + 1) * args.calls)
            start = time.perf_counter()
            for i in ops:
                tool(i)
            first.append((time.perf_counter() - start) / args.calls * 1e6)
            start = time.perf_counter()
            for i in ops:
                tool(i)
            replay.append((time.perf_counter() - start) / args.calls * 1e6)
            store.records.clear()
    for name, times in (("first call", first), ("replay", replay)):
        print(f"guard's Python, {name}: best {min(times):.2f} µs, median {statistics.median(times):.2f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
