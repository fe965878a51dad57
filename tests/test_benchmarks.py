"""The benchmark commands that docs/benchmarks.md quotes still run (a few calls each; no timing is checked).

Performance is measured by `make bench`, never asserted here: these only catch a benchmark that broke
(a renamed store internal, a script the decomposition no longer recognises, a worker that fails) before
its figures are needed. A command that needs Redis or PostgreSQL carries that store's marker and gets
its server from the suite's fixtures: skipped when the server is down, failed under CI=true.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import RUN_ID, require_driver

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
TINY = ("--rounds", "1", "--batch", "3")
THROUGHPUT = ("--throughput", "2", "--seconds", "0.2", "--throughput-rounds", "1")
SQLITE_ROWS = ("floor: 2 raw writes", "guarded first call", "replay (from the store)")
REDIS_ROWS = ("floor: 2 raw round trips", "same 2 SET below redis-py's client", "guarded first call", "replay")
POSTGRES_ROWS = ("floor: 2 raw round trips", "same 2 statements below psycopg's cursor", "1 raw read")
LANGCHAIN_ROWS = ("floor: the same tool unguarded", "guarded tool invoke, first call", "guarded tool invoke, replay",
                  "bound: unguarded + @ledger.tool", "guarded first call / bound")  # fmt: skip
SCALE = ("--rounds", "1", "--batch", "3", "--repeat", "1")
SCALE_ROWS = ("stats (every record)", "stats --counts", "ls, first page", "ls --state unknown, first page",
              "reconcile pass")  # fmt: skip
redis_mark, postgres_mark = pytest.mark.redis, pytest.mark.postgres


def _run(script: str | Path, *args: str, env: dict[str, str] | None = None, timeout: float = 180) -> str:
    """Run a benchmark script; assert it succeeded; return its stdout and stderr."""
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {}), "COLUMNS": "200"},
        check=False,
    )
    assert done.returncode == 0, f"{script} {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def _fails_within(args: list[str], seconds: float, env: dict[str, str] | None = None) -> str:
    """Run ``args``; assert it exits non-zero in ``seconds`` (not blocked on a barrier); return stderr."""
    done = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=seconds,
        env={**os.environ, **(env or {})},
        check=False,
    )
    assert done.returncode != 0, done.stdout + done.stderr
    return done.stderr


@pytest.fixture(name="server_env")
def fixture_server_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """The servers a command needs, from its markers: the suite's fixtures skip (or under CI fail) it
    when one is down. Redis keys go under this run's test prefix, which the suite removes at its end."""
    env: dict[str, str] = {}
    if request.node.get_closest_marker("redis"):
        env["ONCEONLY_BENCH_REDIS_URL"] = request.getfixturevalue("redis_base_url")
        env["ONCEONLY_BENCH_PREFIX_BASE"] = f"onceonly-test-{RUN_ID}-bench-{uuid.uuid4().hex[:8]}"
    if request.node.get_closest_marker("postgres"):
        # bench_postgres makes (and drops) a database of its own on the server this URL points to.
        env["ONCEONLY_BENCH_POSTGRES_URL"] = request.getfixturevalue("postgres_database_url")
    return env


def _redis_keys(url: str, prefix: str) -> list[bytes]:
    """The keys under ``prefix``: what a benchmark run left behind."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        return list(client.scan_iter(match=f"{prefix}*", count=1000))
    finally:
        client.close()


@pytest.mark.parametrize(
    ("command", "rows"),
    [
        pytest.param(("bench_guard.py", "--calls", "10", "--runs", "1"), ("first call: best", "replay: best"),
                     id="guard"),
        pytest.param(("bench.py", "--stores", "sqlite", *TINY), SQLITE_ROWS, id="bench-sqlite"),
        pytest.param(("bench_sqlite.py", "--preload", "100", *TINY), SQLITE_ROWS, id="sqlite-preload"),
        pytest.param(("bench_sqlite.py", *THROUGHPUT), ("sqlite, 2 processes", "ratio"), id="sqlite-throughput"),
        pytest.param(("bench_sqlite.py", "--indexes", *TINY), ("floor, schema 1 (no secondary index)",
                     "+ index on held records' leases", "guarded first call, as shipped / schema 1"),
                     id="sqlite-indexes"),
        pytest.param(("bench_scale.py", "--records", "50", "--stores", "sqlite", *SCALE, *THROUGHPUT),
                     (*SCALE_ROWS, "INDEX onceonly_records_review", "sqlite, 50 records, 2 processes",
                      "sqlite, 50 records │ guarded first call"), id="scale-sqlite"),
        pytest.param(("bench.py", "--scale", "50", "--stores", "redis,postgres", *TINY),
                     (*SCALE_ROWS, "ZRANGEBYLEX o", "onceonly_records_open", "postgres, 50 records │ replay"),
                     id="bench-scale", marks=[redis_mark, postgres_mark]),
        pytest.param(("bench_redis.py", *TINY), (*REDIS_ROWS, "powertools first call", "/ Powertools first call"),
                     id="redis-table", marks=redis_mark),
        pytest.param(("bench_redis.py", "--preload", "100", *TINY), ("guarded first call, 100 stored",
                     "replay, 100 stored"), id="redis-preload", marks=redis_mark),
        pytest.param(("bench_redis.py", *THROUGHPUT), ("redis, 2 processes", "ratio"), id="redis-throughput",
                     marks=redis_mark),
        pytest.param(("bench_redis.py", "--decompose", *TINY), (
            "floor: 2 raw round trips",
            "same 2 SET below redis-py's client",
            "2 minimal scripts (record only)",
            "guarded first call, scripts without indexes",
            "guarded, no all-keys index, no counters",
            "guarded first call",
        ), id="redis-decompose", marks=redis_mark),
        pytest.param(("bench_postgres.py", *TINY), POSTGRES_ROWS, id="postgres-table", marks=postgres_mark),
        pytest.param(("bench_postgres.py", "--million", "--rows", "100", *TINY), ("postgres, empty",
                     "postgres, 100 records", "reconciler page"), id="postgres-million", marks=postgres_mark),
        pytest.param(("bench_postgres.py", "--indexes", *TINY), ("floor, primary key only",
                     "floor, + both indexes + watch trigger (as shipped)", "of which HOT"), id="postgres-indexes",
                     marks=postgres_mark),
        pytest.param(("measure_connections.py", "--processes", "2", "--threads", "1", "--seconds", "1.5"),
                     ("most server connections seen at once", "per process"), id="postgres-connections",
                     marks=postgres_mark),
        pytest.param(("measure_redis_memory.py", "--records", "200"), ("bytes per record", "MEMORY USAGE of one"),
                     id="redis-memory", marks=redis_mark),
        pytest.param(("bench.py", "--stores", "langchain", *TINY), LANGCHAIN_ROWS, id="bench-langchain"),
        pytest.param(("bench.py", "--stores", "server", *TINY), ("no middleware (1 at a time)",
                     "middleware, store sqlite (8 in flight)", "middleware, transactional (in-process, no network)"),
                     id="bench-server"),
        pytest.param(("bench.py", "--stores", "sqlite,redis,postgres", *TINY),
                     (*SQLITE_ROWS, *REDIS_ROWS, *POSTGRES_ROWS), id="bench-all-stores",
                     marks=[redis_mark, postgres_mark]),
    ],
)  # fmt: skip
def test_quoted_command_runs(command: tuple[str, ...], rows: tuple[str, ...], server_env: dict[str, str]) -> None:
    out = _run(*command, env=server_env)
    if "skipped (ConnectionError: Connection closed by server" in out:
        # The shared Redis closed one of the run's connections while the rest of the suite loads it
        # (seen once in several full runs): the command is what is tested here, so it runs once more.
        out = _run(*command, env=server_env)
    for row in rows:
        assert row in out
    assert "skipped" not in out  # bench.py skips only an unreachable store, and these are reachable
    if "ONCEONLY_BENCH_PREFIX_BASE" in server_env:  # everything the run wrote to Redis is gone
        assert _redis_keys(server_env["ONCEONLY_BENCH_REDIS_URL"], server_env["ONCEONLY_BENCH_PREFIX_BASE"]) == []


# A Redis run that fails after its first write: bench_redis.<target> does its writes, then raises.
FAILS_AFTER_WRITING = """
import sys
from pathlib import Path

sys.path.insert(0, {benchmarks!r})
import bench_redis

target, run = sys.argv[1], sys.argv[2]
original = getattr(bench_redis, target)


def broken(*args, **kwargs):
    original(*args, **kwargs)
    raise RuntimeError("the benchmark broke")


setattr(bench_redis, target, broken)
{{"bench": lambda: bench_redis.bench(1, 3, Path(".")), "preload": lambda: bench_redis.preload(10, 1, 3),
  "decompose": lambda: bench_redis.decompose(1, 3)}}[run]()
"""


@pytest.mark.redis
@pytest.mark.parametrize(
    ("target", "run"),
    [("powertools", "bench"), ("guarded_pair", "preload"), ("scripts_floor", "decompose")],
)
def test_a_failed_redis_run_leaves_no_keys(target: str, run: str, server_env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "fails_after_writing.py"
    script.write_text(FAILS_AFTER_WRITING.format(benchmarks=str(BENCHMARKS)))
    err = _fails_within([str(script), target, run], 60, env=server_env)
    assert "RuntimeError: the benchmark broke" in err
    assert _redis_keys(server_env["ONCEONLY_BENCH_REDIS_URL"], server_env["ONCEONLY_BENCH_PREFIX_BASE"]) == []


def test_server_help_starts_no_server() -> None:
    started = time.monotonic()
    out = _run("bench_server.py", "--help", timeout=30)
    assert "--seconds" in out
    assert time.monotonic() - started < 10  # a real run takes ~30 s


# --- a failing throughput worker fails the command, promptly -----------------------------------

ONE_WORKER_FAILS = """
import sys

sys.path.insert(0, {benchmarks!r})
from _harness import spawn_rate


def make(kind, worker):
    if worker == 1:
        raise ValueError("worker 1 cannot start")
    return lambda i: None


if __name__ == "__main__":
    spawn_rate(make, "floor", 3, 0.2)
"""


def test_a_worker_that_fails_to_start_fails_the_rate(tmp_path: Path) -> None:
    # Workers 0 and 2 reach the start barrier; worker 1 never does. They must not wait for it forever.
    script = tmp_path / "one_worker_fails.py"
    script.write_text(ONE_WORKER_FAILS.format(benchmarks=str(BENCHMARKS)))
    err = _fails_within([str(script)], 30)
    assert "floor rate: worker 1 of 3 failed: ValueError: worker 1 cannot start" in err


def test_throughput_on_an_unreachable_redis_fails() -> None:
    require_driver("redis")
    err = _fails_within(
        [str(BENCHMARKS / "bench_redis.py"), *THROUGHPUT], 30, env={"ONCEONLY_BENCH_REDIS_URL": "redis://127.0.0.1:1/0"}
    )
    assert "rate: worker" in err
    assert "StoreUnavailable" in err


def test_the_redis_floors_write_what_the_store_writes() -> None:
    """bench_redis's floor writes record-shaped values by hand (cheap per call): they must stay the
    store's own encoding of a claimed and a settled record, or the floor stops meaning the same
    writes once Record changes."""
    require_driver("redis")
    import json

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_redis
        from _harness import bench_records
    finally:
        sys.path.remove(str(BENCHMARKS))
    from onceonly.stores import redis as redis_store

    claimed, settled = bench_records('{"i":0}', '{"ok":true,"i":0}')
    t = claimed.created_at
    assert json.loads(redis_store._encode(claimed)) == bench_redis._claimed(t, claimed.history_json)
    assert json.loads(redis_store._encode(settled)) == bench_redis._settled(0, t, settled.history_json)
