"""``onceonly mcp-proxy`` as a real process over stdio, in front of a real upstream server process.

The upstream is examples/mcp_proxy/ticket_server.py; its tickets are counted in its SQLite file.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters

from onceonly import Ledger
from onceonly.mcp import REPLAYED_META, meta
from tests._mcp_tickets import Tickets

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mcp_proxy"
UPSTREAM = [sys.executable, str(EXAMPLE / "ticket_server.py")]


def _env(db: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TICKETS_DB": str(db)}


def proxy_params(ledger_url: str, db: Path, *extra: str) -> StdioServerParameters:
    args = ["-c", "from onceonly.cli import main; main()", "mcp-proxy", "--url", ledger_url, *extra, "--", *UPSTREAM]
    return StdioServerParameters(command=sys.executable, args=args, env=_env(db), cwd=str(db.parent))


def _replayed(result: Any) -> bool:
    return bool((result.meta or {}).get(REPLAYED_META))


def test_without_onceonly_a_retry_makes_a_second_ticket(tmp_path: Path) -> None:
    """The upstream alone: the client retries the same call (its first answer lost): two tickets."""
    tickets = Tickets(tmp_path / "tickets.db")
    params = StdioServerParameters(command=UPSTREAM[0], args=UPSTREAM[1:], env=_env(tickets.path))
    args = {"session_id": "s", "title": "a", "body": "b"}

    async def main() -> None:
        async with Client(params) as client:
            await client.call_tool("create_ticket", args)
            await client.call_tool("create_ticket", args)

    asyncio.run(main())
    assert tickets.count("a") == 2


def test_proxy_over_stdio(tmp_path: Path) -> None:
    """Through the proxy: the read-only tool runs every time, the destructive one once per key (the
    replay visible), an isError answer is retried rather than replayed, and an upstream killed after
    the commit is settled by the configured probe (another upstream tool): one ticket each."""
    tickets = Tickets(tmp_path / "tickets.db")
    ledger_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    params = proxy_params(ledger_url, tickets.path, "--config", str(EXAMPLE / "proxy.toml"))
    tickets.fault("error_once", "flaky")
    tickets.fault("hang", "hang")

    async def kill_upstream_after_commit() -> None:
        while tickets.count("hang") == 0:
            await asyncio.sleep(0.02)
        pid = tickets.last_pid()
        assert pid is not None
        os.kill(pid, signal.SIGKILL)

    async def main() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with Client(params) as client:
            tools = {t.name for t in (await client.list_tools()).tools}
            assert {"create_ticket", "find_ticket", "count_tickets"} <= tools
            before = await client.call_tool("count_tickets", {"session_id": "s"})
            args = {"session_id": "s", "title": "a", "body": "b"}
            out["first"] = await client.call_tool("create_ticket", args, meta=meta("order-1"))
            out["again"] = await client.call_tool("create_ticket", args, meta=meta("order-1"))
            after = await client.call_tool("count_tickets", {"session_id": "s"})
            out["counts"] = (before.structured_content, after.structured_content)

            flaky = {"session_id": "s", "title": "flaky", "body": "b"}
            out["flaky_error"] = await client.call_tool("create_ticket", flaky)
            out["flaky_ok"] = await client.call_tool("create_ticket", flaky)

            killer = asyncio.create_task(kill_upstream_after_commit())
            out["killed"] = await client.call_tool("create_ticket", {"session_id": "s", "title": "hang", "body": "b"})
            await killer
        return out

    out = asyncio.run(main())
    assert out["counts"] == ({"result": 0}, {"result": 1})  # the read-only tool ran both times
    assert not _replayed(out["first"]) and _replayed(out["again"])
    assert "not repeated" in out["again"].content[0].text
    assert tickets.count("a") == 1

    # An isError answer may come after the side effect: the outcome is unknown, so the probe settles it
    # (not found: the ticket was not made) and the call runs again; the second call replays.
    assert not out["flaky_error"].is_error and not _replayed(out["flaky_error"])
    assert not out["flaky_ok"].is_error and _replayed(out["flaky_ok"])
    assert tickets.count("flaky") == 1

    assert not out["killed"].is_error and _replayed(out["killed"])
    assert '"title": "hang"' in out["killed"].content[1].text  # the probe's answer: the ticket
    assert tickets.count("hang") == 1

    with Ledger.open(ledger_url) as ledger:
        by_title = {r.args["arguments"]["title"]: r for r in ledger.list(tool="create_ticket")}
        assert ledger.list(tool="count_tickets") == []
    assert by_title["flaky"].attempts == 2 and by_title["flaky"].via == "run"
    assert by_title["hang"].via == "probe"
