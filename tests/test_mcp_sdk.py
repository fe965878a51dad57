"""The guard on the official SDK's MCPServer (guard_server), with the SDK's own Client, in memory."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from mcp import Client
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS

from onceonly import Ledger
from onceonly.mcp import REPLAYED_META, guard_server, meta
from tests._mcp_tickets import Tickets, sdk_server

ARGS = {"session_id": "s1", "title": "printer on fire", "body": "third floor"}


@pytest.fixture(name="tickets")
def fixture_tickets(tmp_path: Path) -> Tickets:
    return Tickets(tmp_path / "tickets.db")


@pytest.fixture(name="mcp_ledger")
def fixture_mcp_ledger(tmp_path: Path) -> Any:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    yield ledger
    ledger.close()


def test_same_key_once_other_sessions_twice(tickets: Tickets, mcp_ledger: Ledger) -> None:
    """Without the guard the same call twice makes two tickets. With it: the same _meta key is one
    execution and a replay; an in-memory transport has exactly one client, so without a key its
    handshake-era sessions are one caller and the call runs once."""
    plain = sdk_server(tickets)

    async def calls(server: MCPServer[Any], mode: str, metas: list[dict[str, Any] | None]) -> list[Any]:
        async with Client(server, mode=mode) as client:  # type: ignore[arg-type]
            return [await client.call_tool("create_ticket", ARGS, meta=m) for m in metas]

    asyncio.run(calls(plain, "auto", [meta("k1"), meta("k1")]))
    assert tickets.count() == 2

    server = sdk_server(tickets)
    guard_server(server, mcp_ledger)
    first, second = asyncio.run(calls(server, "auto", [meta("k1"), meta("k1")]))
    assert tickets.count() == 3
    assert second.meta is not None and second.meta[REPLAYED_META] is True
    assert "not repeated" in second.content[0].text
    assert [b.text for b in second.content[1:]] == [b.text for b in first.content]
    assert second.structured_content == first.structured_content

    asyncio.run(calls(server, "legacy", [None, None]))
    asyncio.run(calls(server, "legacy", [None]))
    assert tickets.count() == 4


def test_read_only_passes_and_unknown_tool_records_nothing(tickets: Tickets, mcp_ledger: Ledger) -> None:
    """A read-only tool is not recorded; an unknown tool gets the server's own error result."""
    server = sdk_server(tickets)
    guard_server(server, mcp_ledger)

    async def main() -> Any:
        async with Client(server) as client:
            await client.call_tool("count_tickets", {"title": "x"}, meta=meta("k"))
            return await client.call_tool("nope", {}, meta=meta("k"))

    unknown = asyncio.run(main())
    assert unknown.is_error and "Unknown tool" in unknown.content[0].text
    assert mcp_ledger.list() == []


def test_arguments_not_an_object_is_an_mcp_error(tickets: Tickets, mcp_ledger: Ledger) -> None:
    """The middleware runs before the SDK validates: arguments that are not a JSON object are refused
    with an invalid-params error, and nothing is recorded."""
    server = sdk_server(tickets)
    guard_server(server, mcp_ledger)

    async def main() -> MCPError:
        async with Client(server, mode="legacy") as client:
            # The client's typed call_tool cannot send a list: the raw request goes below it.
            with pytest.raises(MCPError) as caught:
                await client.session._dispatcher.send_raw_request(
                    "tools/call", {"name": "create_ticket", "arguments": ["s1", "title"], "_meta": meta("k")}
                )
            return caught.value

    error = asyncio.run(main())
    assert error.code == INVALID_PARAMS and "must be a JSON object, got list" in error.message
    assert tickets.count() == 0
    assert mcp_ledger.list() == []


def test_guarded_function_registered_directly(tickets: Tickets, mcp_ledger: Ledger) -> None:
    """A @ledger.tool function on MCPServer: idempotency_key is not in the schema, and two calls run once."""
    server: MCPServer[Any] = MCPServer("direct")

    @server.tool()
    @mcp_ledger.tool
    def open_ticket(session_id: str, title: str, *, idempotency_key: str) -> dict[str, Any]:
        """Open a ticket."""
        return tickets.create(session_id, title, idempotency_key)

    async def main() -> dict[str, Any]:
        async with Client(server) as client:
            schema = (await client.list_tools()).tools[0].input_schema
            for _ in range(2):
                await client.call_tool("open_ticket", {"session_id": "s", "title": "a"})
            return schema

    schema = asyncio.run(main())
    assert set(schema["properties"]) == {"session_id", "title"}
    assert set(schema["required"]) == {"session_id", "title"}
    assert tickets.count("a") == 1
