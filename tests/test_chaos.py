"""The short fault matrix (``python -m tests.chaos --short``) in the suite, one store per test: on each
store lost answers, SIGKILLed workers, cut connections (Redis, PostgreSQL) and racing reconcilers at
once (``together``), a caller's clock stepped 10 minutes (``clock-jump``), and on Redis and PostgreSQL a
private server crashed and restarted halfway through a pass. Every cell must be green: no side effect
twice, none lost, every operation confirmed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests._pg_server import postgres_bin
from tests.chaos import SHORT, _verdict
from tests.conftest import POSTGRES_URL, REDIS_URL, _reachable, _unavailable, require_driver

ROOT = Path(__file__).resolve().parent.parent

#: The cells --short runs per store.
CELLS = {
    "sqlite": ["together", "clock-jump"],
    "redis": ["together", "clock-jump", "restart-aof"],
    "postgres": ["together", "clock-jump", "restart"],
}


def _require(store: str) -> None:
    """Skip (under CI: fail) when the store's server, client library or private-server binaries are missing."""
    if store == "redis":
        require_driver("redis")
        reason = _reachable(REDIS_URL, 6379) or (
            None if shutil.which("redis-server") else "redis-server is not installed: no private Redis to restart"
        )
    elif store == "postgres":
        require_driver("postgres")
        reason = _reachable(POSTGRES_URL, 5432) or (
            None if postgres_bin() else "initdb and postgres are not installed: no private PostgreSQL to restart"
        )
    else:
        reason = None
    if reason:
        _unavailable(reason)


@pytest.mark.slow
@pytest.mark.parametrize(
    "store",
    [
        "sqlite",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_the_short_matrix_is_green(store: str) -> None:
    """The store's --short cells, 30 operations each: every one printed with 30 side effects, 0
    duplicates, 0 lost, 0 unsettled, green; and the run exits 0."""
    _require(store)
    out = subprocess.run(
        [sys.executable, "-m", "tests.chaos", "--short", "--stores", store],
        cwd=ROOT, env={**os.environ}, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    for fault in CELLS[store]:
        assert fault in SHORT
        row = next((line for line in out.stdout.splitlines() if line.startswith(f"| {store} | {fault} |")), None)
        assert row is not None, f"no {fault} cell:\n{out.stdout}{out.stderr}"
        assert row.startswith(f"| {store} | {fault} | 30 | 30 | 0 | 0 | 0 |") and row.endswith("| yes |"), row


def test_a_cell_fails_the_run_unless_green_or_allowed_not_to_be() -> None:
    """Any duplicate, lost or unsettled operation fails the run, as does a cell that could not run; a
    cell allowed not to be green (a Redis that persists nothing) says so and does not."""
    green = {"duplicates": 0, "lost": 0, "unsettled": 0}
    assert _verdict(green) == ("yes", False)
    for column in green:
        assert _verdict({**green, column: 1}) == ("NO", True)
    assert _verdict({**green, "duplicates": 3, "expected not green": "persists nothing"}) == (
        "no (persists nothing: allowed)",
        False,
    )
    assert _verdict({"skipped": "FileNotFoundError: initdb"})[1] is True
