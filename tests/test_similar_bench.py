"""The near-duplicate benchmark that docs/benchmarks.md quotes still runs (a few calls; no timing checked)."""

from __future__ import annotations

import pytest

from tests.test_benchmarks import _redis_keys, _run, fixture_server_env  # noqa: F401 (the fixture, by import)

TINY = ("--records", "20", "--group", "5", "--rounds", "1", "--batch", "3")
ROWS = (
    "plain first call (the floor)",
    "similar first call, 5 in the group",
    "its store calls alone (lock and read, free)",
    "its scoring alone (5 candidates)",
    "similar re-plan taken for an earlier call",
)


@pytest.mark.parametrize(
    "store",
    [
        "sqlite",
        pytest.param("redis", marks=pytest.mark.redis),
        pytest.param("postgres", marks=pytest.mark.postgres),
    ],
)
def test_bench_similar_runs(store: str, server_env: dict[str, str]) -> None:
    """bench_similar.py prints its rows and store-call counts on each store, and leaves nothing in Redis."""
    out = _run("bench_similar.py", "--stores", store, *TINY, env=server_env)
    for row in ROWS:
        assert row in out
    assert f"{store}: similar first call: 3 store calls" in out
    if "ONCEONLY_BENCH_PREFIX_BASE" in server_env:
        assert _redis_keys(server_env["ONCEONLY_BENCH_REDIS_URL"], server_env["ONCEONLY_BENCH_PREFIX_BASE"]) == []
