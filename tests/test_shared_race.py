"""16 worker processes share one ledger (Redis, then PostgreSQL) and race 1,000 operations, each asked
by 4 of them: every side effect happens exactly once, and every asker gets the same result.

The tool's side effect is a row in a PostgreSQL table of its own, written by the tool itself, so the
count is taken outside the ledger under test.
"""

from __future__ import annotations

import multiprocessing
import random
import time
import traceback
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import RUN_ID, join_url

pytestmark = pytest.mark.slow

WORKERS = 16
OPS = 1000
ASKERS = 4


@pytest.fixture(name="ledger_url", params=["redis", "postgres"])
def fixture_ledger_url(request: pytest.FixtureRequest) -> str:
    """An empty shared ledger on each networked store (its server fixture skips, saying why, when the
    server is unreachable or its client library is not installed)."""
    if request.param == "redis":
        base = request.getfixturevalue("redis_base_url")
        return join_url(base, prefix=f"onceonly-test-{RUN_ID}-race-{uuid.uuid4().hex[:8]}", warn_persistence="false")
    base = request.getfixturevalue("postgres_database_url")
    return join_url(base, schema=f"race_{uuid.uuid4().hex[:8]}")


@pytest.fixture(name="effects_table")
def fixture_effects_table(postgres_database_url: str) -> Iterator[str]:
    """A PostgreSQL table of our own for the side effects: one row per real execution of the tool."""
    import psycopg

    table = f"race_effects_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres_database_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (op integer NOT NULL, worker integer NOT NULL)")
    yield table
    with psycopg.connect(postgres_database_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")


def _askers(seed: int) -> dict[int, list[int]]:
    """For every operation, the 4 distinct workers that ask for it."""
    rng = random.Random(seed)
    return {op: rng.sample(range(WORKERS), ASKERS) for op in range(OPS)}


def race_worker(ledger_url: str, pg_url: str, table: str, worker: int, ops: list[int], start: Any, out: Any) -> None:
    """One process: ask for each of its operations in ascending order (so the 4 askers of an
    operation meet on it), and report what each call returned."""
    try:
        import psycopg

        import onceonly

        ledger = onceonly.Ledger.open(ledger_url)
        conn = psycopg.connect(pg_url, autocommit=True)

        @ledger.tool(name="race.op", wait=60.0)
        def op(n: int) -> dict[str, int]:
            conn.execute(f"INSERT INTO {table} (op, worker) VALUES (%s, %s)", (n, worker))
            return {"op": n, "by": worker}

        start.wait(120)
        results = {n: op(n) for n in ops}
        ledger.close()
        conn.close()
        out.put((worker, results, None))
    except BaseException:
        out.put((worker, None, traceback.format_exc()))


def test_sixteen_processes_race_a_thousand_operations(
    ledger_url: str, postgres_database_url: str, effects_table: str
) -> None:
    """Each of 1,000 operations asked by 4 of 16 processes: exactly one row each, one answer each."""
    import psycopg

    askers = _askers(seed=3)
    per_worker: dict[int, list[int]] = {w: [] for w in range(WORKERS)}
    for n, workers in askers.items():
        for w in workers:
            per_worker[w].append(n)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(WORKERS)
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=race_worker,
            args=(ledger_url, postgres_database_url, effects_table, w, per_worker[w], start, out),
            daemon=True,
        )
        for w in range(WORKERS)
    ]
    began = time.monotonic()
    for p in procs:
        p.start()
    reports = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(30)
    errors = [err for _, _, err in reports if err]
    assert not errors, errors[0]
    results = {w: res for w, res, _ in reports}

    with psycopg.connect(postgres_database_url) as conn:
        rows = conn.execute(f"SELECT op, worker FROM {effects_table}").fetchall()
    runs: dict[int, list[int]] = {}
    for n, w in rows:
        runs.setdefault(n, []).append(w)
    assert sorted(runs) == list(range(OPS)), "some operations never ran"
    twice = {n: ws for n, ws in runs.items() if len(ws) != 1}
    assert not twice, f"side effects repeated: {dict(list(twice.items())[:5])}"
    for n, workers in askers.items():
        answers = [results[w][n] for w in workers]
        assert all(a == answers[0] for a in answers), (n, answers)
        assert answers[0] == {"op": n, "by": runs[n][0]}  # the answer of the one execution
    print(f"{ledger_url.split(':', 1)[0]}: {OPS * ASKERS} asks in {time.monotonic() - began:.1f}s")
