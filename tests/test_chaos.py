"""`make chaos` (tests/chaos.py) still runs: a tiny run on SQLite prints a green matrix (no figure is checked)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_a_tiny_chaos_run_is_green() -> None:
    """Every SQLite fault on 10 operations: each cell is printed, green, and the run exits 0."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.chaos", "--ops", "10", "--stores", "sqlite"],
        cwd=ROOT, env={**os.environ}, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    for fault in ("race", "lost-answer", "kill"):
        assert f"| sqlite | {fault} | 10 | 10 | 0 | 0 | 0 |" in out.stdout
