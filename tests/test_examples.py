"""The examples the README points at run as written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(example: str) -> str:
    """Run ``examples/<example>`` as a newcomer would; its standard output."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example)], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_quickstart_runs_and_makes_one_ticket() -> None:
    """examples/quickstart.py: every answer lost, one ticket, the second call replayed."""
    stdout = _run("quickstart.py")
    assert "settled via probe" in stdout
    assert "replayed=True" in stdout
    assert "tickets in the service: 1" in stdout


def test_async_dispatch_events_example_runs() -> None:
    """examples/async_dispatch_events.py: the error before dispatch is retried, one email leaves, the
    replay comes back decoded, every transition is printed, the readonly lookup is not recorded."""
    stdout = _run("async_dispatch_events.py")
    assert "pending -> failed (attempt 1, TimeoutError: MX lookup timed out)" in stdout
    assert "failed -> pending (attempt 2, retry after failure)" in stdout
    assert "Receipt(message_id='msg-2', to='ada@example.com'), replayed=True" in stdout
    assert "emails that left: 1; readonly lookups (not recorded): 1" in stdout
