"""A worker SIGKILLed inside its tool, after the side effect: the next run settles it, never re-runs it."""

from __future__ import annotations

import multiprocessing
import signal
import time
from pathlib import Path

import pytest

from onceonly import Ledger, OutcomeUnknown, State
from tests._workers import count_effects, crash_worker, rerun_after_crash


def _crash(ledger_url: str, effects: Path, on_unknown: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=crash_worker, args=(ledger_url, str(effects), on_unknown, "task-7"))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert count_effects(effects) == {"ticket-1": 1}
    time.sleep(0.6)  # the dead worker's 0.5 s lease runs out


@pytest.mark.slow
def test_killed_worker_is_settled_by_probe(sqlite_url: str, tmp_path: Path) -> None:
    """on_unknown='probe': the re-run finds the ticket through the probe; no second side effect."""
    effects = tmp_path / "effects.db"
    _crash(sqlite_url, effects, "probe")
    out = rerun_after_crash(sqlite_url, str(effects), "probe", "task-7")
    assert out.state is State.CONFIRMED and out.via == "probe" and out.replayed
    assert out.result["title"] == "ticket-1"
    assert count_effects(effects) == {"ticket-1": 1}
    again = rerun_after_crash(sqlite_url, str(effects), "probe", "task-7")
    assert again.result == out.result


@pytest.mark.slow
def test_killed_worker_is_parked_for_review(sqlite_url: str, tmp_path: Path) -> None:
    """on_unknown='review': the re-run parks it as needs_review and raises OutcomeUnknown."""
    effects = tmp_path / "effects.db"
    _crash(sqlite_url, effects, "review")
    with pytest.raises(OutcomeUnknown) as info:
        rerun_after_crash(sqlite_url, str(effects), "review", "task-7")
    assert info.value.state == "needs_review"
    assert count_effects(effects) == {"ticket-1": 1}
    with Ledger.open(sqlite_url) as ledger:
        rec = ledger.get(info.value.key)
        assert rec is not None and rec.state is State.NEEDS_REVIEW
        assert [h["to"] for h in rec.history] == ["in_flight", "unknown", "needs_review"]
