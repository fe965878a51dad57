"""PostgreSQL: the guard's per-call cost next to two raw round trips on the ledger's own table.

Every run makes its own database (``onceonly_bench_<random>``) on the server of
ONCEONLY_BENCH_POSTGRES_URL (default postgresql://127.0.0.1:5432/postgres) and drops it at the end.

    python benchmarks/bench.py --stores postgres            # the default table, with the others
    python benchmarks/bench_postgres.py                     # the same, PostgreSQL only
    python benchmarks/bench_postgres.py --indexes           # what each index and the trigger cost
    python benchmarks/bench_postgres.py --million           # per-call time with 1 million records

The floor is what any ledger on PostgreSQL pays: two autocommitted statements over one connection
with the same driver settings (psycopg 3, one reused cursor, automatic preparation), an INSERT of a
ledger-shaped row and the UPDATE that settles it, on the ledger's own table (same indexes, same
trigger). The guard adds its pool, its claim statement and its Python work.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
from _harness import Contender, floor_histories, guarded_pair, interleave, report, tool_body

import onceonly
from onceonly.stores.postgres import PostgresStore, parse_postgres_url

SERVER_URL = os.environ.get("ONCEONLY_BENCH_POSTGRES_URL", "postgresql://127.0.0.1:5432/postgres")
# The floors' two statements, on a table named at use: the claim's INSERT and the settle's UPDATE.
INSERT = (
    "INSERT INTO {table} (key, scope, tool, fingerprint, state, attempts, fence, version, lease_owner, "
    "lease_until, created_at, updated_at, args, history) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)"
)
UPDATE = (
    "UPDATE {table} SET version=%s, state=%s, lease_owner=NULL, lease_until=NULL, result=%s, via=%s, "
    "expires_at=%s, updated_at=%s, history=%s WHERE key=%s AND version=%s"
)


@contextmanager
def database() -> Iterator[str]:
    """A database made for this run, dropped at its end; yields its URL."""
    name = f"onceonly_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(SERVER_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield urlsplit(SERVER_URL)._replace(path=f"/{name}").geturl()
    finally:
        with psycopg.connect(SERVER_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


_OPENED: list[psycopg.Connection[Any]] = []  # the raw connections of the floors, closed by close_floors()


def close_floors() -> None:
    while _OPENED:
        conn = _OPENED.pop()
        with contextlib.suppress(psycopg.Error):
            conn.execute("SELECT pg_stat_force_next_flush()")  # PostgreSQL 15+: counters for --indexes
        conn.close()


def floor(url: str, table: str = "public.onceonly_records") -> Callable[[int], None]:
    """Two raw round trips per call (claim insert, settle update) on ``table``, one connection."""
    conn = psycopg.connect(parse_postgres_url(url).conninfo, autocommit=True)
    _OPENED.append(conn)
    history_1, history_2 = floor_histories()
    prefix = uuid.uuid4().hex
    cur = conn.cursor()  # one cursor for all calls, as the store keeps one per connection
    insert, update = INSERT.format(table=table), UPDATE.format(table=table)

    def run(i: int) -> None:
        key = f"default:bench.tool:{hashlib.sha256(f'{prefix}{i}'.encode()).hexdigest()[:32]}"
        now = time.time()
        cur.execute(
            insert,
            (key, "default", "bench.tool", key[-32:] * 2, "in_flight", 1, 1, 1, "h:1:1", now + 30, now, now,
             f'{{"i":{i}}}', history_1),
        )  # fmt: skip
        cur.execute(update, (2, "confirmed", f'{{"ok":true,"i":{i}}}', "run", now + 86400, now, history_2, key, 1))

    return run


def wire_floor(url: str, table: str = "public.onceonly_records") -> Callable[[int], None]:
    """The floor's two statements sent the way the store sends its own: prepared once, binary
    parameters, below psycopg's cursor (onceonly/stores/_pgwire.py). For scale: what the guard's
    store saves against the floor's cursor path, it saves here too."""
    from onceonly.stores import _pgwire as wire

    conn = psycopg.connect(parse_postgres_url(url).conninfo, autocommit=True)
    _OPENED.append(conn)
    history_1, history_2 = (h.encode() for h in floor_histories())
    prefix = uuid.uuid4().hex
    T, I4, I8, F8 = wire.TEXT, wire.INT4, wire.INT8, wire.FLOAT8
    insert = wire.Statement(
        "bench_floor_insert", INSERT.format(table=table), [T, T, T, T, T, I4, I8, I8, T, F8, F8, F8, T, T]
    )
    update = wire.Statement("bench_floor_update", UPDATE.format(table=table), [I8, T, T, T, F8, F8, T, T, I8])
    prepared: set[bytes] = set()
    i4, i8, f8 = wire.int4, wire.int8, wire.float8

    def run(i: int) -> None:
        key = f"default:bench.tool:{hashlib.sha256(f'{prefix}{i}'.encode()).hexdigest()[:32]}".encode()
        now = time.time()
        conn.wait(wire.run(conn.pgconn, prepared, insert, [
            key, b"default", b"bench.tool", key[-32:] * 2, b"in_flight", i4(1), i8(1), i8(1), b"h:1:1",
            f8(now + 30), f8(now), f8(now), f'{{"i":{i}}}'.encode(), history_1,
        ]))  # fmt: skip
        conn.wait(wire.run(conn.pgconn, prepared, update, [
            i8(2), b"confirmed", f'{{"ok":true,"i":{i}}}'.encode(), b"run", f8(now + 86400), f8(now), history_2,
            key, i8(1),
        ]))  # fmt: skip

    return run


def read_floor(url: str) -> Callable[[int], None]:
    """One raw round trip: the SELECT of a record by key (what a replay cannot do with less)."""
    conn = psycopg.connect(parse_postgres_url(url).conninfo, autocommit=True)
    _OPENED.append(conn)
    keys = [r[0] for r in conn.execute("SELECT key FROM public.onceonly_records LIMIT 1000")]

    cur = conn.cursor(binary=True)

    def run(i: int) -> None:
        cur.execute("SELECT * FROM public.onceonly_records WHERE key = %s", (keys[i % len(keys)],))
        cur.fetchone()

    return run


def contenders(url: str) -> tuple[list[Contender], onceonly.Ledger]:
    """bare tool, floor, guarded first call, replay, raw read; on the ledger at ``url``."""
    ledger = onceonly.Ledger.open(url)

    # A tool name of its own per run, so a second run's first calls are first calls, not replays.
    first, replay = guarded_pair(ledger.tool(name=f"bench.tool.{uuid.uuid4().hex[:8]}")(tool_body), warm=50)
    return [
        Contender("bare tool", tool_body),
        Contender("floor: 2 raw round trips", floor(url)),
        Contender("same 2 statements below psycopg's cursor", wire_floor(url)),
        first,
        replay,
        Contender("1 raw read (SELECT by key)", read_floor(url)),
    ], ledger


def bench(rounds: int, batch: int, workdir: Path) -> list[dict[str, object]]:
    """The default table: guard vs floor on an empty ledger."""
    with database() as url:
        runs, ledger = contenders(url)
        try:
            interleave(runs, rounds, batch)
        finally:
            ledger.close()
            close_floors()
        return report("postgres", runs)


def fill(url: str, rows: int, unknown_every: int = 100) -> None:
    """``rows`` ledger-shaped records in one INSERT … SELECT: 1 in ``unknown_every`` unknown (none at 0),
    1 in 10 of the others failed, the rest confirmed."""
    with psycopg.connect(parse_postgres_url(url).conninfo, autocommit=True) as conn:
        conn.execute(
            """
            INSERT INTO public.onceonly_records (
                key, scope, tool, fingerprint, state, attempts, fence, version, lease_owner, lease_until,
                next_attempt_at, expires_at, created_at, updated_at, result, error, args, history, via, conflicts)
            SELECT 'default:bench.fill:' || md5(i::text), 'default', 'bench.fill', md5(i::text) || md5(i::text),
                   CASE WHEN i %% %s = 0 THEN 'unknown' WHEN i %% 10 = 0 THEN 'failed' ELSE 'confirmed' END,
                   1, 1, 2, NULL, NULL, NULL,
                   CASE WHEN i %% %s = 0 THEN NULL ELSE extract(epoch FROM now()) + 86400 END,
                   extract(epoch FROM now()), extract(epoch FROM now()),
                   '{"ok":true,"i":' || i || '}', NULL, '{"i":' || i || '}',
                   '[{"at":1,"from":null,"to":"in_flight","fence":1,"reason":"claim","by":"h:1:1"},'
                   || '{"at":2,"from":"in_flight","to":"confirmed","fence":1,'
                   || '"reason":"confirmed via run","by":"h:1:1"}]',
                   'run', 0
            FROM generate_series(1, %s) AS i
            """,
            (unknown_every or rows + 1, unknown_every or rows + 1, rows),
        )
        conn.execute("VACUUM ANALYZE public.onceonly_records")


def scans(url: str) -> None:
    """Print how long the reconciler's and purge's first page take on the filled table."""
    from onceonly.states import State
    from onceonly.stores.base import Query

    store = PostgresStore(url)
    now = time.time()
    queries = {
        "reconciler page (unknown, or held and expired; 100)": Query(
            states=[State.UNKNOWN, State.IN_FLIGHT, State.PENDING], lease_expired_before=now, limit=100
        ),
        "purge page, nothing expired yet (500)": Query(
            states=[State.CONFIRMED, State.FAILED, State.ABANDONED], expires_before=now, limit=500
        ),
        "purge page, everything expired (500)": Query(
            states=[State.CONFIRMED, State.FAILED, State.ABANDONED], expires_before=now + 2 * 86400, limit=500
        ),
    }
    try:
        for name, query in queries.items():
            times = []
            for _ in range(5):
                started = time.perf_counter()
                store.scan(query)
                times.append(time.perf_counter() - started)
            print(f"{name}: {sorted(times)[2] * 1e3:.2f} ms (median of 5)")
    finally:
        store.close()


# --- many processes -------------------------------------------------------------------------------

_URL_ENV = "ONCEONLY_BENCH_POSTGRES_RUN_URL"  # the database a throughput round's workers use


def _make_call(kind: str, worker: int) -> Callable[[int], object]:
    """In a worker process: a guarded first call (a tool of its own: never a replay), or the floor."""
    url = os.environ[_URL_ENV]
    if kind == "floor":
        return floor(url)
    ledger = onceonly.Ledger.open(url)
    guarded: Callable[[int], object] = ledger.tool(name=f"bench.tool.{worker}.{uuid.uuid4().hex[:8]}")(tool_body)
    return guarded


def bench_million(rounds: int, batch: int, rows: int = 1_000_000) -> list[dict[str, object]]:
    """The same contenders on an empty ledger, then with ``rows`` records already in the table."""
    out: list[dict[str, object]] = []
    with database() as url:
        runs, ledger = contenders(url)
        try:
            interleave(runs, rounds, batch)
            out += report("postgres, empty", runs)
        finally:
            ledger.close()
            close_floors()
        started = time.perf_counter()
        fill(url, rows)
        print(f"filled {rows} records in {time.perf_counter() - started:.1f}s", file=sys.stderr)
        scans(url)
        runs, ledger = contenders(url)
        try:
            interleave(runs, rounds, batch)
            out += report(f"postgres, {rows} records", runs)
        finally:
            ledger.close()
            close_floors()
    return out


# Table variants for --indexes: each is the ledger table with some of its secondary objects dropped.
VARIANTS: dict[str, list[str]] = {
    "primary key only": [
        "DROP INDEX {s}.onceonly_records_open",
        "DROP INDEX {s}.onceonly_records_expires",
        "DROP TRIGGER onceonly_records_changed ON {t}",
        "DROP TRIGGER onceonly_records_deleted ON {t}",
    ],
    "+ open index": [
        "DROP INDEX {s}.onceonly_records_expires",
        "DROP TRIGGER onceonly_records_changed ON {t}",
        "DROP TRIGGER onceonly_records_deleted ON {t}",
    ],
    "+ expires index": [
        "DROP INDEX {s}.onceonly_records_open",
        "DROP TRIGGER onceonly_records_changed ON {t}",
        "DROP TRIGGER onceonly_records_deleted ON {t}",
    ],
    "+ both indexes": ["DROP TRIGGER onceonly_records_changed ON {t}", "DROP TRIGGER onceonly_records_deleted ON {t}"],
    "+ both indexes + watch trigger (as shipped)": [],
}


def bench_indexes(rounds: int, batch: int) -> list[dict[str, object]]:
    """The floor on the ledger table as shipped and with its indexes and trigger dropped, one by one."""
    with database() as url:
        runs: list[Contender] = []
        stores = []
        for n, (name, drops) in enumerate(VARIANTS.items()):
            schema = f"v{n}"
            stores.append(PostgresStore(f"{url}?schema={schema}&listen=false"))
            with psycopg.connect(parse_postgres_url(url).conninfo, autocommit=True) as conn:
                for statement in drops:
                    conn.execute(statement.format(s=schema, t=f"{schema}.onceonly_records"))
            runs.append(Contender(f"floor, {name}", floor(url, f"{schema}.onceonly_records")))
        try:
            interleave(runs, rounds, batch)
        finally:
            for store in stores:
                store.close()
            close_floors()  # a closing backend flushes its statistics: the HOT counts below
        rows = report("postgres", runs, floor_name="floor, primary key only")
        time.sleep(1.0)
        with psycopg.connect(parse_postgres_url(url).conninfo, autocommit=True) as conn:
            for n, name in enumerate(VARIANTS):
                hot = conn.execute(
                    "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables "
                    "WHERE schemaname = %s AND relname = 'onceonly_records'",
                    (f"v{n}",),
                ).fetchone()
                print(f"{name}: settle updates {hot[0] if hot else '?'}, of which HOT {hot[1] if hot else '?'}")
        return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--indexes", action="store_true", help="what each index and the trigger cost the floor")
    parser.add_argument("--million", action="store_true", help="per-call time with 1 million records")
    parser.add_argument("--rows", type=int, default=1_000_000, help="records for --million")
    parser.add_argument("--json", action="store_true", help="also print all rows as JSON")
    args = parser.parse_args(argv)
    if args.indexes:
        rows = bench_indexes(args.rounds, args.batch)
    elif args.million:
        rows = bench_million(args.rounds, args.batch, args.rows)
    else:
        with tempfile.TemporaryDirectory(prefix="onceonly-bench-") as tmp:
            rows = bench(args.rounds, args.batch, Path(tmp))
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
