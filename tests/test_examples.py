"""The examples the README points at run as written."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(example: str) -> str:
    """Run ``examples/<example>`` as a newcomer would; its standard output. The example's temporary
    files go to a directory of the test's own, which must be empty again when it ends."""
    with tempfile.TemporaryDirectory(prefix="onceonly-test-examples-") as tmp:
        out = subprocess.run(
            [sys.executable, str(ROOT / "examples" / example)],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "TMPDIR": tmp},
        )
        assert out.returncode == 0, out.stderr
        assert sorted(p.name for p in Path(tmp).iterdir()) == [], f"{example} left files behind"
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


def test_keyed_shop_example_runs() -> None:
    """examples/keyed_shop.py (docs/server.md): the same key from alice replays, from bob makes a second
    order, both rows record it; IdempotencyTable.get finds alice's response; purge(before=) clears both."""
    stdout = _run("keyed_shop.py")
    assert stdout.splitlines() == [
        "{'id': 1, 'sku': 'A1'} true {'id': 2, 'sku': 'A1'}",
        "[(1, 'order-1'), (2, 'order-1')]",
        '201 b\'{"id": 1, "sku": "A1"}\'',
        "0",
        "2",
    ]


def test_http_client_example_runs() -> None:
    """examples/http_client.py (docs/http.md): a late answer re-sent with the same key is replayed by
    the server; a tool's two requests go as <key> and <key>#2; the tool called again sends nothing; a
    key from the caller's header makes one refund out of two calls."""
    stdout = _run("http_client.py")
    assert "refund answered by a replay of the first run: True" in stdout
    assert "called again, replayed by the ledger: True" in stdout
    assert "handler runs, by key: ['<key>', '<key>#2', 'order-42']" in stdout
    assert "refunds made: 2, notes made: 1" in stdout


def test_pydantic_ai_agent_example_charges_once() -> None:
    """examples/pydantic_ai_agent.py: two charges without onceonly; with it one, the model told the outcome
    is unknown (a failed result, not a retry), and after the operator settled it a replay."""
    pytest.importorskip("pydantic_ai")
    stdout = _run("pydantic_ai_agent.py")
    assert "without onceonly: 2 charges" in stdout
    assert "with onceonly: 1 charge" in stdout
    assert stdout.count("the model read (failed): The outcome of this action is unknown") == 2
    assert "the model read (success): This action was already done at" in stdout
    assert "after the operator settled it, asked again: 1 charge" in stdout
    assert "onceonly resolve" not in stdout


def test_readme_quick_start_declares_the_tool_as_the_example_does() -> None:
    """The README says examples/quickstart.py is its quick start, runnable: the same @ledger.tool(...)."""

    def declarations(text: str) -> list[str]:
        return [line.strip() for line in text.splitlines() if line.strip().startswith("@ledger.tool(")]

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quick_start = readme[readme.index("## Quick start") : readme.index("## How it works")]
    example = (ROOT / "examples" / "quickstart.py").read_text(encoding="utf-8")
    assert declarations(quick_start) == declarations(example)
    assert len(declarations(example)) == 1


def test_the_sqlite_docs_fork_example_runs_each_order_once(tmp_path: Path) -> None:
    """docs/sqlite.md's fork example, as written: a ledger opened at import, a "fork" pool, each order
    charged once; run again, nothing is charged."""
    text = (ROOT / "docs" / "sqlite.md").read_text()
    block = text[text.index("A ledger opened before `fork()`") :]
    block = block[block.index("```python\n") + len("```python\n") : block.index("  ```\n", block.index("```python"))]
    (tmp_path / "fork_example.py").write_text("\n".join(line[2:] for line in block.splitlines()) + "\n")
    command = [sys.executable, "fork_example.py"]
    runs = [
        subprocess.run(command, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=60) for _ in range(2)
    ]
    assert all(run.returncode == 0 for run in runs), runs[0].stderr + runs[1].stderr
    assert sorted(runs[0].stdout.splitlines()[:2]) == ["charging o-1", "charging o-2"]
    assert "charging" not in runs[1].stdout, "the second run is replayed from the ledger"


def test_smolagents_example_shows_the_duplicate_and_its_absence() -> None:
    """examples/smolagents_agent.py (docs/smolagents.md): two tickets without onceonly, one with it, and the
    model reads the unknown, then the replay."""
    pytest.importorskip("smolagents")
    stdout = _run("smolagents_agent.py")
    assert "without onceonly: 2 tickets" in stdout
    assert "with onceonly: 1 ticket" in stdout
    assert "asked again after the late answer: 1 ticket" in stdout
    assert "The outcome of this action is unknown" in stdout and "was not repeated" in stdout


def test_autogen_example_shows_the_duplicate_and_its_absence() -> None:
    """examples/autogen_agent.py (docs/autogen.md): two tickets with a plain FunctionTool, one with
    onceonly; the model reads the unknown, then the replay."""
    pytest.importorskip("autogen_agentchat")
    stdout = _run("autogen_agent.py")
    assert "without onceonly: 2 tickets" in stdout
    assert "with onceonly: 1 ticket" in stdout
    assert "asked again after the late answer: 1 ticket" in stdout
    assert "The outcome of this action is unknown" in stdout and "was not repeated" in stdout
