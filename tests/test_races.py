"""Racing callers: every operation's tool body runs exactly once, every caller gets the same result."""

from __future__ import annotations

import json
import multiprocessing
import threading
from pathlib import Path
from typing import Any

import pytest

from tests._workers import count_effects, race_worker

OPS = 200


def _check(results: list[dict[str, Any]], effects: dict[str, int]) -> None:
    assert effects == {str(n): 1 for n in range(OPS)}, "every operation ran exactly once"
    for n in range(OPS):
        answers = {json.dumps(r[str(n)], sort_keys=True) for r in results}
        assert len(answers) == 1, f"operation {n}: callers got different results {answers}"


@pytest.mark.slow
def test_eight_threads_race_200_keys(store_url: str, tmp_path: Path) -> None:
    """8 threads call each of 200 operations: one execution each, one result for all."""
    effects = tmp_path / "effects.db"
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results.append(race_worker(store_url, str(effects), f"t{i}", OPS, seed=i))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 8
    _check(results, count_effects(effects))


@pytest.mark.slow
def test_four_processes_race_200_keys(sqlite_url: str, tmp_path: Path) -> None:
    """4 processes share one SQLite ledger file and call each of 200 operations."""
    effects = tmp_path / "effects.db"
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.starmap(race_worker, [(sqlite_url, str(effects), f"p{i}", OPS, i) for i in range(4)])
    _check(results, count_effects(effects))
