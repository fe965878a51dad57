"""The examples the README points at run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart_runs_and_makes_one_ticket() -> None:
    """examples/quickstart.py: every answer lost, one ticket, the second call replayed."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "settled via probe" in out.stdout
    assert "replayed=True" in out.stdout
    assert "tickets in the service: 1" in out.stdout
