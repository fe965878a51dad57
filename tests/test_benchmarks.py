"""The benchmark commands that docs/benchmarks.md quotes still run (a few calls each; no timing is checked).

Performance is measured by `make bench`, never asserted here: these only catch a benchmark that broke
(a renamed store internal, a script the decomposition no longer recognises) before its figures are needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _run(script: str, *args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {}), "COLUMNS": "200"},
        check=False,
    )
    assert done.returncode == 0, f"{script} {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_sqlite_table() -> None:
    out = _run("bench.py", "--stores", "sqlite", "--rounds", "1", "--batch", "3")
    for row in ("floor: 2 raw writes", "guarded first call", "replay (from the store)"):
        assert row in out


@pytest.mark.usefixtures("redis_base_url")
def test_redis_decomposition(redis_base_url: str) -> None:
    out = _run(
        "bench_redis.py", "--decompose", "--rounds", "1", "--batch", "3",
        env={"ONCEONLY_BENCH_REDIS_URL": redis_base_url},
    )  # fmt: skip
    for row in (
        "floor: 2 raw round trips",
        "same 2 SET below redis-py's client",
        "2 minimal scripts (record only)",
        "guarded first call, scripts without indexes",
        "guarded, no all-keys index, no counters",
        "guarded first call",
    ):
        assert row in out
