"""Scale mode: each store's operations and per-call cost with many records stored.

    python benchmarks/bench.py --scale 1000000                       # every store, 1 M records
    python benchmarks/bench_scale.py --records 0,1000000 --stores sqlite --throughput 8

For each store and each size: that many settled records, written in bulk in the store's own format
(SQLite: one transaction of the store's INSERT; Redis: the store's claim script, pipelined;
PostgreSQL: one INSERT … SELECT), then a few hundred open ones through the store's ``insert``:
unknown, needs_review, in flight with an expired lease and in flight with a live one, their keys
spread among the settled ones. Then, on that ledger:

- the operations, in ms, with the records each read: ``onceonly stats`` (reads every record, by
  design), ``stats --counts``, ``ls``'s first page (no filter, and ``--state unknown``) and one
  reconcile pass (``onceonly reconcile``'s settle function). Records read: SQLite counts the rows
  its scans visit, PostgreSQL sums ``EXPLAIN (ANALYZE, BUFFERS)``'s rows at each scan node, Redis
  counts the records fetched and the index entries read.
- per call: the store's floor, a guarded first call and a replay, interleaved rounds (as bench.py).
- with ``--throughput N``: N processes' first calls per second next to the floor's, on that ledger.

The servers are those of bench_redis.py and bench_postgres.py (same environment variables); each run
writes under a prefix or database of its own and removes it at the end. SQLite's files go to a
temporary directory (``--dir`` to choose the disk).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _harness import Contender, guarded_pair, interleave, report, tool_body

import onceonly
from onceonly import ops
from onceonly import states as st
from onceonly.settle import reconcile
from onceonly.states import Record, State

#: The open records stored next to the settled ones, by kind.
OPEN = {"unknown": 200, "needs_review": 100, "in flight, lease expired": 100, "in flight, lease live": 20}
TOOL = "bench.fill"


def open_records(now: float, salt: str = "") -> Iterator[tuple[str, Record]]:
    """The open records and their kinds, keys in the settled records' key space (``default:bench.fill:<hex>``)."""
    n = 0
    for kind, count in OPEN.items():
        for _ in range(count):
            n += 1
            key = f"default:{TOOL}:{hashlib.sha256(f'open{salt}{n}'.encode()).hexdigest()[:32]}"
            claimed_at = now - 3600 if kind == "in flight, lease expired" else now
            # A live lease outlasts the run (stats of 10 M records take minutes), as heartbeats would keep it.
            lease = 86400 if kind == "in flight, lease live" else 30
            rec = st.new_record(key=key, scope="default", tool=TOOL, fingerprint="f" * 64, args_json=f'{{"o":{n}}}',
                                state=State.IN_FLIGHT, owner="h:1:1", now=claimed_at, lease_seconds=lease)  # fmt: skip
            if kind in ("unknown", "needs_review"):
                rec = st.mark_unknown(rec, now=now, reason="bench", by=None)
            if kind == "needs_review":
                rec = st.park(rec, now=now, reason="bench", by=None)
            yield kind, rec


@dataclass
class Reads:
    """What one operation read: records (or rows visited), and how."""

    records: int = 0
    how: set[str] = field(default_factory=set)
    entries: int = 0  # Redis: index entries read
    pages: int = 0  # PostgreSQL: buffers (8 KiB pages) read, from the cache or the disk

    def describe(self) -> str:
        how = ", ".join(sorted(self.how)) or "-"
        if self.entries:
            how += f"; {self.entries:,} index entries"
        if self.pages:
            how += f"; {self.pages:,} pages"
        return how


@dataclass
class Setup:
    """One store, filled: its ledger, its floor, how to count what an operation reads, its rate."""

    name: str
    ledger: onceonly.Ledger
    floor: Callable[[int], None]
    counting: Callable[[], contextlib.AbstractContextManager[Reads]]
    rate: Callable[[str, int, float], float]
    extra: list[Contender] = field(default_factory=list)


# --- SQLite -----------------------------------------------------------------------------------------


@contextmanager
def sqlite_setup(records: int, workdir: Path) -> Iterator[Setup]:
    import os

    import bench_sqlite
    from _harness import spawn_rate

    from onceonly.stores.sqlite import SQLiteStore

    with tempfile.TemporaryDirectory(prefix="onceonly-bench-", dir=workdir) as tmp:
        path, floor_path = Path(tmp) / "ledger.db", Path(tmp) / "floor.db"
        for p in (path, floor_path):
            bench_sqlite.fill(p, records, TOOL)
        ledger = onceonly.Ledger.open(f"sqlite:///{path}")

        def rate(kind: str, processes: int, seconds: float) -> float:
            os.environ[bench_sqlite._WORKDIR_ENV] = tmp  # the workers open ledger.db and floor.db there
            return spawn_rate(bench_sqlite._make_call, kind, processes, seconds)

        store = ledger.store
        assert isinstance(store, SQLiteStore)
        try:
            yield Setup("sqlite", ledger, bench_sqlite.floor(floor_path), lambda: _sqlite_reads(store), rate)
        finally:
            ledger.close()


@contextmanager
def _sqlite_reads(store: Any) -> Iterator[Reads]:
    """Count the rows SQLite visits for the store's scans and counts: a function of the row's key in
    the WHERE runs once per row the statement reads (not only per row it returns)."""
    from onceonly.stores import sqlite as sqlite_store

    reads = Reads()
    conn = store._conn()

    def seen(_key: object) -> int:
        reads.records += 1
        return 1

    conn.create_function("onceonly_bench_read", 1, seen)
    original = sqlite_store._Connection.execute

    def execute(self: Any, sql: str, params: Any = ()) -> Any:
        if sql.startswith("SELECT") and " FROM onceonly_records" in sql:
            plan = original(self, "EXPLAIN QUERY PLAN " + sql, params).fetchall()
            reads.how.update(str(row[3]) for row in plan)
            head, tail = sql.split(" FROM onceonly_records", 1)
            if tail.startswith(" WHERE "):
                tail = " WHERE onceonly_bench_read(key) AND " + tail[len(" WHERE ") :]
            else:
                tail = " WHERE onceonly_bench_read(key)" + tail
            sql = head + " FROM onceonly_records" + tail
        return original(self, sql, params)

    sqlite_store._Connection.execute = execute  # type: ignore[method-assign]
    try:
        yield reads
    finally:
        sqlite_store._Connection.execute = original  # type: ignore[method-assign]


# --- Redis ------------------------------------------------------------------------------------------


@contextmanager
def redis_setup(records: int, workdir: Path) -> Iterator[Setup]:
    import os

    import bench_redis
    from _harness import spawn_rate

    from onceonly.stores.redis import RedisStore

    with bench_redis._run_prefix() as prefix, onceonly.Ledger.open(bench_redis._url(prefix)) as ledger:
        store = ledger.store
        assert isinstance(store, RedisStore)
        started = time.monotonic()
        bench_redis.fill(store, records, TOOL)
        print(f"redis: {records} records loaded in {time.monotonic() - started:.0f}s", file=sys.stderr)

        def rate(kind: str, processes: int, seconds: float) -> float:
            os.environ[bench_redis._PREFIX_ENV] = prefix
            return spawn_rate(bench_redis._make_call, kind, processes, seconds)

        yield Setup("redis", ledger, bench_redis.floor(store, prefix), lambda: _redis_reads(store), rate)


@contextmanager
def _redis_reads(store: Any) -> Iterator[Reads]:
    """Count the records a scan fetches (one HMGET each) and the index entries it reads."""
    reads = Reads()
    plan = store._scan_plan

    def counted(query: Any) -> Any:
        gen = plan(query)
        try:
            batch = next(gen)
            while True:
                answers = yield batch
                for command, answer in zip(batch, answers, strict=False):
                    if command[0] == "HMGET":
                        reads.records += 1
                    else:  # an index read: which index (the name's last part), and how many entries
                        reads.how.add(f"{command[0]} {command[1].rsplit(':', 1)[-1]}")
                        reads.entries += len(answer)
                batch = gen.send(answers)
        except StopIteration as stop:
            return stop.value

    store._scan_plan = counted
    try:
        yield reads
    finally:
        del store._scan_plan


# --- PostgreSQL -------------------------------------------------------------------------------------


@contextmanager
def postgres_setup(records: int, workdir: Path) -> Iterator[Setup]:
    import os

    import bench_postgres
    from _harness import spawn_rate

    from onceonly.stores.postgres import PostgresStore

    with bench_postgres.database() as url:
        ledger = onceonly.Ledger.open(url)  # makes the schema
        started = time.perf_counter()
        if records:
            bench_postgres.fill(url, records, unknown_every=0)
        print(f"postgres: {records} records filled in {time.perf_counter() - started:.1f}s", file=sys.stderr)

        def rate(kind: str, processes: int, seconds: float) -> float:
            os.environ[bench_postgres._URL_ENV] = url
            return spawn_rate(bench_postgres._make_call, kind, processes, seconds)

        store = ledger.store
        assert isinstance(store, PostgresStore)
        try:
            yield Setup("postgres", ledger, bench_postgres.floor(url), lambda: _postgres_reads(store, url), rate)
        finally:
            ledger.close()
            bench_postgres.close_floors()


@contextmanager
def _postgres_reads(store: Any, url: str) -> Iterator[Reads]:
    """Run each statement the operation sent again under ``EXPLAIN (ANALYZE, BUFFERS)``: the rows its
    scan nodes read (returned and filtered out), and the scan nodes used."""
    import psycopg

    from onceonly.stores.postgres import parse_postgres_url

    reads = Reads()
    sent: list[tuple[str, Any]] = []
    build = store._scan_sql

    def capture(query: Any) -> Any:
        built = build(query)
        if built is not None:
            sent.append(built)
        return built

    count = store.count_by_state

    def count_captured() -> Any:
        sent.append((store._sql_count, []))
        return count()

    store._scan_sql, store.count_by_state = capture, count_captured
    try:
        yield reads
    finally:
        del store._scan_sql, store.count_by_state
    with psycopg.connect(parse_postgres_url(url).conninfo, autocommit=True) as conn:
        for sql, params in sent:
            row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params).fetchone()
            assert row is not None
            top = row[0][0]["Plan"]
            reads.pages += top.get("Shared Hit Blocks", 0) + top.get("Shared Read Blocks", 0)
            for node in _nodes(top):
                if "Scan" in node["Node Type"] and node["Node Type"] != "Bitmap Index Scan":  # its heap scan counts
                    loops = node.get("Actual Loops", 1)
                    reads.records += (node["Actual Rows"] + node.get("Rows Removed by Filter", 0)) * loops
                    reads.how.add(f"{node['Node Type']} {node.get('Index Name', '')}".strip())


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


SETUPS = {"sqlite": sqlite_setup, "redis": redis_setup, "postgres": postgres_setup}


# --- the measures -----------------------------------------------------------------------------------


def _timed(fn: Callable[[], object], repeat: int) -> float:
    """Median ms of ``repeat`` runs."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def operations(setup: Setup, records: int, repeat: int, only: str = "") -> list[dict[str, object]]:
    """Time each operation, then run it once more counting what it reads."""
    from onceonly.stores.sqlite import SQLiteStore

    ledger = setup.ledger
    expired = "in flight, lease expired"

    def plant(salt: str, kinds: Callable[[str], bool]) -> None:
        # The expired leases are a worker's that died holding them: on SQLite, written through a store
        # of their own, closed holding them (its lease holder's file stays, unlocked; docs/sqlite.md).
        worker = ledger.store
        dead = SQLiteStore(worker.url) if isinstance(worker, SQLiteStore) else worker
        for kind, rec in open_records(time.time(), salt):
            if kinds(kind):
                (dead if kind == expired else worker).insert(rec)
        if dead is not worker:
            dead.close()

    plant("", lambda kind: True)

    def pass_() -> object:
        return reconcile(ledger, tools={}, wait=0)

    def replant() -> None:  # the settling pass is measured twice: timed, then counting its reads
        plant("again", lambda kind: kind == expired)

    measured: dict[str, Callable[[], object]] = {
        "stats (every record)": lambda: ops.stats(ledger),
        "stats --counts": ledger.stats,
        "ls, first page": lambda: ops.page(ledger),
        "ls --state unknown, first page": lambda: ops.page(ledger, states=[State.UNKNOWN]),
        "ls --state needs_review, first page": lambda: ops.page(ledger, states=[State.NEEDS_REVIEW]),
        # The first pass marks the expired leases unknown (a write each); the next ones write nothing.
        f"reconcile pass, settling {OPEN['in flight, lease expired']} expired leases": pass_,
        "reconcile pass, nothing to write": pass_,
    }
    rows = []
    for name, fn in measured.items():
        if only not in name:
            continue
        ms = _timed(fn, 1 if name.startswith("stats (") or "settling" in name else repeat)
        if "settling" in name:
            replant()
        with setup.counting() as reads:
            fn()
        rows.append({"store": setup.name, "records": records, "what": name, "ms": round(ms, 2),
                     "read": reads.records, "how": reads.describe()})  # fmt: skip
    return rows


def per_call(setup: Setup, records: int, rounds: int, batch: int) -> list[dict[str, object]]:
    first, replay = guarded_pair(setup.ledger.tool(name=f"bench.tool.{uuid.uuid4().hex[:8]}")(tool_body), warm=20)
    contenders = [Contender("floor", setup.floor), first, replay]
    interleave(contenders, rounds, batch)
    return [{**row, "records": records} for row in report(f"{setup.name}, {records} records", contenders)]


def print_operations(rows: list[dict[str, object]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="operations with many records stored (ms: median; read: records or rows visited)")
    for column in ("store", "records", "what", "ms", "read", "how"):
        table.add_column(column, justify="right" if column in ("records", "ms", "read") else "left")
    for r in rows:
        table.add_row(str(r["store"]), f"{r['records']:,}", str(r["what"]), f"{r['ms']:.1f}", f"{r['read']:,}",
                      str(r["how"]))  # fmt: skip
    Console(width=200).print(table)


def run(stores: list[str], sizes: list[int], *, rounds: int, batch: int, repeat: int, processes: int, seconds: float,
        throughput_rounds: int, workdir: Path, only: str = "") -> list[dict[str, object]]:  # fmt: skip
    from _harness import throughput

    ops_rows: list[dict[str, object]] = []
    call_rows: list[dict[str, object]] = []
    for store in stores:
        for records in sizes:
            with SETUPS[store](records, workdir) as setup:
                if rounds:
                    call_rows += per_call(setup, records, rounds, batch)
                if processes:
                    got = throughput(
                        lambda kind, s=setup: s.rate(kind, processes, seconds),  # type: ignore[misc]
                        f"{store}, {records} records",
                        processes,
                        seconds,
                        throughput_rounds,
                    )
                    call_rows.append({"store": store, "records": records, "what": f"{processes} processes",
                                      **{k: round(v, 3) for k, v in got.items()}})  # fmt: skip
                if repeat:
                    ops_rows += operations(setup, records, repeat, only)
    if ops_rows:
        print_operations(ops_rows)
    return ops_rows + call_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", default="1000000", help="sizes, comma-separated (0 = an empty ledger)")
    parser.add_argument("--stores", default="sqlite,redis,postgres")
    parser.add_argument("--rounds", type=int, default=10, help="per-call rounds (0: no per-call table)")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--repeat", type=int, default=3, help="runs of each operation, median (0: no operations)")
    parser.add_argument("--throughput", type=int, default=0, metavar="PROCESSES")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one throughput round")
    parser.add_argument("--throughput-rounds", type=int, default=3, metavar="N")
    parser.add_argument("--dir", type=Path, default=None, help="where SQLite's files go (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="also print all rows as JSON")
    parser.add_argument("--only", default="", metavar="TEXT", help="only the operations whose name holds TEXT")
    args = parser.parse_args(argv)
    sizes = [int(n.replace("_", "")) for n in args.records.split(",")]
    rows = run(args.stores.split(","), sizes, rounds=args.rounds, batch=args.batch, repeat=args.repeat,
               processes=args.throughput, seconds=args.seconds, throughput_rounds=args.throughput_rounds,
               workdir=args.dir or Path(tempfile.gettempdir()), only=args.only)  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
