"""SQLite: the guard's per-call cost next to two raw write transactions on the ledger's own table.

python benchmarks/bench.py --stores sqlite                # the table (bench())
python benchmarks/bench_sqlite.py --throughput 8          # 8 processes: guarded vs raw calls/s
python benchmarks/bench_sqlite.py --preload 1000000       # per-call cost with 1M records stored
python benchmarks/bench_sqlite.py --indexes               # what a secondary index costs a call's two writes
"""

from __future__ import annotations

import hashlib
import sqlite3
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from _harness import Contender, floor_histories, guarded_pair, interleave, report, store_main, tool_body

import onceonly
from onceonly.stores.sqlite import SQLiteStore


def floor(path: Path) -> Callable[[int], None]:
    """Two raw write transactions per call (claim insert, settle update), same table, same pragmas."""
    conn = SQLiteStore(f"sqlite:///{path}")._conn()
    history_1, history_2 = floor_histories()
    prefix = uuid.uuid4().hex

    def run(i: int) -> None:
        key = f"default:bench.tool:{hashlib.sha256(f'{prefix}{i}'.encode()).hexdigest()[:32]}"
        now = time.time()
        conn.execute(
            "INSERT INTO onceonly_records (key, scope, tool, fingerprint, state, attempts, fence, version, "
            "lease_owner, lease_until, created_at, updated_at, args, history, conflicts) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,0)",
            (key, "default", "bench.tool", key[-32:] * 2, "in_flight", 1, 1, 1, "h:1:1", now + 30, now, now,
             f'{{"i":{i}}}', history_1),
        )  # fmt: skip
        conn.execute(
            "UPDATE onceonly_records SET state=?, version=?, lease_owner=NULL, lease_until=NULL, result=?, via=?, "
            "expires_at=?, updated_at=?, history=? WHERE key=? AND version=?",
            ("confirmed", 2, f'{{"ok":true,"i":{i}}}', "run", now + 86400, now, history_2, key, 1),
        )

    return run


def bench(rounds: int, batch: int, workdir: Path) -> list[dict[str, object]]:
    ledger = onceonly.Ledger.open(f"sqlite:///{workdir / 'ledger.db'}")

    first, replay = guarded_pair(ledger.tool(name="bench.tool")(tool_body))
    contenders = [
        Contender("bare tool", tool_body),
        Contender("floor: 2 raw writes", floor(workdir / "floor.db")),
        first,
        replay,
    ]
    counted = _with_metrics(workdir / "counted.db")
    if counted is not None:  # the same calls on a ledger instrumented by onceonly.metrics
        on_first, on_replay = guarded_pair(counted.tool(name="bench.tool")(tool_body))
        contenders += [
            Contender("guarded first call, metrics on", on_first.run),
            Contender("replay, metrics on", on_replay.run),
        ]
    interleave(contenders, rounds, batch)
    ledger.close()
    rows = report("sqlite", contenders)
    if counted is not None:
        counted.close()
        # The cost of the metrics alone: per-round ratios of the same calls with and without them.
        for off, on in ((first, contenders[4]), (replay, contenders[5])):
            ratio = statistics.median(a / b for a, b in zip(on.per_call, off.per_call, strict=True))
            print(f"sqlite: {on.name} / metrics off = {ratio:.3f}")
    return rows


def _with_metrics(path: Path) -> onceonly.Ledger | None:
    """A ledger counted into a registry of its own, or ``None`` without the metrics extra."""
    try:
        from prometheus_client import CollectorRegistry

        from onceonly.metrics import instrument
    except ImportError:
        print("sqlite: prometheus-client is not installed: no metrics rows", file=sys.stderr)
        return None
    ledger = onceonly.Ledger.open(f"sqlite:///{path}")
    instrument(ledger, registry=CollectorRegistry())
    return ledger


# --- many processes, and a big ledger -------------------------------------------------------------

_WORKDIR_ENV = "ONCEONLY_BENCH_DIR"


def _make_call(kind: str, worker: int) -> Callable[[int], object]:
    """In a worker process: a guarded first call, or the floor's two raw writes, on the shared files."""
    import os

    workdir = Path(os.environ[_WORKDIR_ENV])
    if kind == "floor":
        return floor(workdir / "floor.db")
    ledger = onceonly.Ledger.open(f"sqlite:///{workdir / 'ledger.db'}")
    # A tool name of its own per process: every round's calls are first calls, never replays.
    guarded: Callable[[int], object] = ledger.tool(name=f"bench.tool.{worker}.{uuid.uuid4().hex[:8]}")(tool_body)
    return guarded


def throughput_table(processes: int, seconds: float, rounds: int) -> None:
    """Total calls/s of ``processes`` processes on one SQLite file: guarded first calls vs the floor."""
    import os
    import tempfile

    from _harness import spawn_rate, throughput

    with tempfile.TemporaryDirectory(prefix="onceonly-bench-") as tmp:
        os.environ[_WORKDIR_ENV] = tmp
        SQLiteStore(f"sqlite:///{tmp}/floor.db").close()  # create both files before the race
        SQLiteStore(f"sqlite:///{tmp}/ledger.db").close()
        throughput(lambda kind: spawn_rate(_make_call, kind, processes, seconds), "sqlite", processes, seconds, rounds)


def fill(path: Path, records: int, tool: str = "bench.fill") -> None:
    """``records`` confirmed records in the ledger at ``path``, in the store's own columns (a real
    record's values with key, arguments and result changed).

    Written fast, as a restore would: the file is made by the store, then filled in one transaction
    without a journal, in key order (keys spread evenly over the hash space, so other keys land among
    them), and put back in WAL mode.
    """
    from _harness import bench_records

    from onceonly.stores.sqlite import _INSERT, _record_values

    SQLiteStore(f"sqlite:///{path}").close()  # the schema, as the store makes it
    values = list(_record_values(bench_records('{"i":0}', '{"ok":true,"i":0}')[1]))
    values[2] = tool
    step = 16**32 // max(records, 1)

    def rows() -> Iterator[list[object]]:
        for i in range(records):
            digest = f"{i * step:032x}"
            values[0], values[3] = f"default:{tool}:{digest}", digest * 2
            values[14], values[16] = f'{{"ok":true,"i":{i}}}', f'{{"i":{i}}}'
            yield values

    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=OFF")
        conn.execute("PRAGMA synchronous=OFF")
        conn.execute("BEGIN")
        conn.executemany(_INSERT, rows())
        conn.execute("COMMIT")
        conn.execute("PRAGMA journal_mode=WAL")
    finally:
        conn.close()


# --- what a secondary index costs the two writes -----------------------------------------------------

_HELD_INDEX = "CREATE INDEX bench_held ON onceonly_records (lease_until) WHERE state = 'in_flight' OR state = 'pending'"
_SCHEMA_1 = "DROP INDEX onceonly_records_review"
#: Each a ledger file as shipped with these statements run on it.
INDEXES = {
    "floor, schema 1 (no secondary index)": [_SCHEMA_1],
    "floor, as shipped (review index)": [],
    "floor, + index on held records' leases": [_HELD_INDEX],
    "floor, + index on created_at (claims only)": ["CREATE INDEX bench_created ON onceonly_records (created_at)"],
    "guarded first call, schema 1": [_SCHEMA_1],
    "guarded first call, as shipped": [],
    "guarded first call, + index on held leases": [_HELD_INDEX],
}


def bench_indexes(rounds: int, batch: int) -> list[dict[str, object]]:
    """The floor's two writes and a guarded first call on files with and without each index, interleaved."""
    import statistics
    import tempfile

    with tempfile.TemporaryDirectory(prefix="onceonly-bench-") as tmp:
        contenders, ledgers = [], []
        for n, (name, statements) in enumerate(INDEXES.items()):
            path = Path(tmp) / f"v{n}.db"
            store = SQLiteStore(f"sqlite:///{path}")
            for statement in statements:
                store._conn().execute(statement)
            store.close()
            if name.startswith("floor"):
                contenders.append(Contender(name, floor(path)))
                continue
            ledgers.append(onceonly.Ledger.open(f"sqlite:///{path}"))
            first, _ = guarded_pair(ledgers[-1].tool(name="bench.tool")(tool_body))
            contenders.append(Contender(name, first.run))
        interleave(contenders, rounds, batch)
        for ledger in ledgers:
            ledger.close()
    rows = report("sqlite", contenders)
    by_name = {c.name: c.per_call for c in contenders}
    base = by_name["guarded first call, schema 1"]
    for name in ("guarded first call, as shipped", "guarded first call, + index on held leases"):
        ratio = statistics.median(a / b for a, b in zip(by_name[name], base, strict=True))
        print(f"sqlite: {name} / schema 1 = {ratio:.3f}")
    return rows


def preload(records: int, rounds: int, batch: int) -> None:
    """The per-call table with ``records`` records already in the ledger (and in the floor's file)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="onceonly-bench-") as tmp:
        workdir = Path(tmp)
        for name in ("ledger.db", "floor.db"):
            fill(workdir / name, records)
        print(f"sqlite: {records} records in each file", file=sys.stderr)
        bench(rounds, batch, workdir)


def main(argv: list[str] | None = None) -> int:
    return store_main(argv, __doc__, bench, throughput_table, preload, indexes=bench_indexes)


if __name__ == "__main__":
    sys.exit(main())
