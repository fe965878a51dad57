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


def test_async_dispatch_events_example_runs() -> None:
    """examples/async_dispatch_events.py: the error before dispatch is retried, one email leaves, the
    replay comes back decoded, every transition is printed, the readonly lookup is not recorded."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "async_dispatch_events.py")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "pending -> failed (attempt 1, TimeoutError: MX lookup timed out)" in out.stdout
    assert "failed -> pending (attempt 2, retry after failure)" in out.stdout
    assert "Receipt(message_id='msg-2', to='ada@example.com'), replayed=True" in out.stdout
    assert "emails that left: 1; readonly lookups (not recorded): 1" in out.stdout
