"""examples/mcp_proxy/client.py runs: straight to the server a lost answer and a retry make two
tickets, through the proxy one, and the retry reads as a replay."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mcp_proxy_example() -> None:
    """The example's own output: two tickets direct, one through onceonly, the replay told."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "mcp_proxy" / "client.py")],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "[direct] tickets created: 2" in out
    assert "[onceonly] tickets created: 1" in out
    assert "[onceonly] retry answered (replayed=True)" in out and "was not repeated" in out
