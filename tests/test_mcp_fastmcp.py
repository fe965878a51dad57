"""OnceOnlyMiddleware on a real FastMCP server, with a real FastMCP client, in memory.

Each test counts the side effect in the SQLite file the tool writes, without onceonly and with it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from fastmcp import Client
from fastmcp.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS

from onceonly import Ledger
from onceonly.mcp import KEY_META, REPLAYED_META, OnceOnlyMiddleware, meta
from tests._mcp_tickets import Tickets, fastmcp_server

ARGS = {"session_id": "s1", "title": "printer on fire", "body": "third floor"}


@pytest.fixture(name="tickets")
def fixture_tickets(tmp_path: Path) -> Tickets:
    return Tickets(tmp_path / "tickets.db")


@pytest.fixture(name="mcp_ledger")
def fixture_mcp_ledger(tmp_path: Path) -> Any:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    yield ledger
    ledger.close()


def _texts(result: Any) -> list[str]:
    return [b.text for b in result.content]


def test_same_key_runs_once_and_the_replay_says_so(tickets: Tickets, mcp_ledger: Ledger) -> None:
    """The same _meta key twice: without onceonly two tickets, with it one, and the second answer is the
    same content blocks after one text block telling the model, marked replayed."""
    plain = fastmcp_server(tickets)

    async def twice(server: Any) -> list[Any]:
        async with Client(server) as client:
            return [await client.call_tool("create_ticket", ARGS, meta=meta("order-1")) for _ in range(2)]

    asyncio.run(twice(plain))
    assert tickets.count() == 2

    guarded = fastmcp_server(tickets)
    guarded.add_middleware(OnceOnlyMiddleware(mcp_ledger))
    first, second = asyncio.run(twice(guarded))
    assert tickets.count() == 3
    assert not first.is_error and not (first.meta or {}).get(REPLAYED_META)
    assert second.meta[REPLAYED_META] is True
    assert second.meta[KEY_META] == "tickets/local:create_ticket:order-1"  # the in-memory client: one caller
    assert "already done" in _texts(second)[0] and "not repeated" in _texts(second)[0]
    assert _texts(second)[1:] == _texts(first)
    assert second.structured_content == first.structured_content


def test_scope_from_meta_and_sessions(tickets: Tickets, mcp_ledger: Ledger) -> None:
    """No key: the same call in one conversation (_meta scope) runs once, in two conversations twice; an
    in-memory transport has exactly one client, so its handshake-era sessions are one caller."""
    server = fastmcp_server(tickets)
    server.add_middleware(OnceOnlyMiddleware(mcp_ledger))

    async def calls(mode: str, metas: list[dict[str, Any] | None]) -> None:
        async with Client(server, mode=mode) as client:
            for m in metas:
                await client.call_tool("create_ticket", ARGS, meta=m)

    asyncio.run(calls("auto", [meta(scope="thread-a"), meta(scope="thread-a"), meta(scope="thread-b")]))
    assert tickets.count() == 2
    asyncio.run(calls("legacy", [None, None]))  # one session
    asyncio.run(calls("legacy", [None]))  # another session of the same one client
    assert tickets.count() == 3


def test_read_only_runs_every_time_and_error_result_is_retried(tickets: Tickets, mcp_ledger: Ledger) -> None:
    """A read-only tool passes through (nothing recorded); an isError answer is a failed attempt: the
    client sees it as it came, and the same call runs again rather than replaying the error."""
    server = fastmcp_server(tickets)
    server.add_middleware(OnceOnlyMiddleware(mcp_ledger))
    tickets.fault("error_once", ARGS["title"])

    async def main() -> tuple[Any, Any, Any]:
        async with Client(server) as client:
            for _ in range(3):
                await client.call_tool("count_tickets", {"title": "x"})
            failed = await client.call_tool("create_ticket", ARGS, meta=meta("k"), raise_on_error=False)
            ok = await client.call_tool("create_ticket", ARGS, meta=meta("k"))
            again = await client.call_tool("create_ticket", ARGS, meta=meta("k"))
            return failed, ok, again

    failed, ok, again = asyncio.run(main())
    assert failed.is_error and "busy" in _texts(failed)[0]
    assert not ok.is_error and not (ok.meta or {}).get(REPLAYED_META)
    assert again.meta[REPLAYED_META] is True
    assert tickets.count(ARGS["title"]) == 1
    records = mcp_ledger.list()
    assert [(r.tool, r.state.value, r.attempts) for r in records] == [("create_ticket", "confirmed", 2)]


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ({"dev.onceonly/idempotencyKey": "k" * 300}, "characters"),
        ({"dev.onceonly/idempotencyKey": 42}, "must be a str"),
    ],
)
def test_malformed_meta_key_is_an_mcp_error(
    tickets: Tickets, mcp_ledger: Ledger, bad: dict[str, Any], said: str
) -> None:
    """A _meta key that is too long or not a string: a clear MCP error, the tool not run, nothing recorded."""
    server = fastmcp_server(tickets)
    server.add_middleware(OnceOnlyMiddleware(mcp_ledger))

    async def main() -> MCPError:
        async with Client(server) as client:
            with pytest.raises(MCPError) as caught:
                await client.call_tool("create_ticket", ARGS, meta=bad)
            return caught.value

    error = asyncio.run(main())
    assert error.code == INVALID_PARAMS and said in error.message
    assert tickets.count() == 0
    assert mcp_ledger.list() == []


def test_unknown_tool_records_nothing(tickets: Tickets, mcp_ledger: Ledger) -> None:
    """An unknown tool gets the server's own error, and the ledger stays empty."""
    server = fastmcp_server(tickets)
    server.add_middleware(OnceOnlyMiddleware(mcp_ledger))

    async def main() -> None:
        async with Client(server) as client:
            await client.call_tool("delete_everything", {}, meta=meta("k"))

    with pytest.raises(ToolError, match="Unknown tool"):
        asyncio.run(main())
    assert mcp_ledger.list() == []


def test_guarded_function_registered_directly(tickets: Tickets, mcp_ledger: Ledger) -> None:
    """@ledger.tool functions, sync and async, registered with FastMCP: a clean schema (no
    idempotency_key), and the same call twice runs once; the middleware leaves them to their own guard
    (one record each, not two)."""
    from fastmcp import FastMCP

    server: FastMCP[Any] = FastMCP("direct")
    server.add_middleware(OnceOnlyMiddleware(mcp_ledger))

    @server.tool
    @mcp_ledger.tool
    def open_ticket(session_id: str, title: str, *, idempotency_key: str) -> dict[str, Any]:
        """Open a ticket."""
        return tickets.create(session_id, title, idempotency_key)

    @server.tool
    @mcp_ledger.tool
    async def open_ticket_async(session_id: str, title: str) -> dict[str, Any]:
        """Open a ticket, async."""
        return tickets.create(session_id, title, "async")

    async def main() -> dict[str, Any]:
        async with Client(server) as client:
            tools = {t.name: t for t in await client.list_tools()}
            for _ in range(2):
                await client.call_tool("open_ticket", {"session_id": "s", "title": "a"})
                await client.call_tool("open_ticket_async", {"session_id": "s", "title": "b"})
            return {name: t.input_schema for name, t in tools.items()}

    schemas = asyncio.run(main())
    for schema in schemas.values():
        assert set(schema["properties"]) == {"session_id", "title"}, json.dumps(schema)
        assert set(schema["required"]) == {"session_id", "title"}
    assert tickets.count("a") == 1 and tickets.count("b") == 1
    assert len(mcp_ledger.list()) == 2
