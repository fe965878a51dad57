"""The MCP doors: who is calling, the arguments in their real form, what an error result means, and whose
``_meta`` marks reach the client. Real FastMCP servers and proxies, real clients, side effects counted in
SQLite, the ledger on SQLite."""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastmcp import Client, FastMCP
from fastmcp.client.transports import StreamableHttpTransport
from fastmcp.exceptions import ToolError
from fastmcp.server import create_proxy
from fastmcp.tools.base import ToolResult
from mcp.shared.exceptions import MCPError
from mcp_types import TextContent

from onceonly import Ledger
from onceonly.mcp import KEY_META, REPLAYED_META, OnceOnlyMiddleware, ToolPolicy, meta

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _http_server(db: Path, ledger_url: str | None, log: Path) -> Iterator[str]:
    port = _free_port()
    args = [sys.executable, str(HERE / "_mcp_doors_server.py"), str(db), str(port)]
    if ledger_url is not None:
        args.append(ledger_url)
    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60  # a readiness bound for a loaded machine, not a measurement
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited {proc.returncode}: {log.read_text()[-2000:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"nothing listens on {port}: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _effects(db: Path, kind: str) -> list[str]:
    if not db.exists():
        return []
    with sqlite3.connect(db) as conn:
        try:
            return [r[0] for r in conn.execute("SELECT what FROM effects WHERE kind = ? ORDER BY rowid", (kind,))]
        except sqlite3.OperationalError:  # no table: nothing ran
            return []


async def _call(url: str, who: str, tool: str, args: dict[str, Any], m: dict[str, str] | None = None) -> Any:
    """One call on a new connection, as the user whose credentials are ``who``."""
    transport = StreamableHttpTransport(url, headers={"Authorization": f"Bearer {who}"})
    async with Client(transport) as client:
        return await client.call_tool(tool, args, meta=m, raise_on_error=False)


def _text(result: Any) -> str:
    return "\n".join(getattr(b, "text", "") for b in result.content)


def test_two_users_over_http_never_read_each_others_results(tmp_path: Path) -> None:
    """Streamable HTTP on the stateless protocol (the default), no key: without onceonly a user's retry
    mints a second key; with it the retry (on a new connection) replays, and a second user's call runs
    and is never handed the first user's key, whatever _meta key or scope it sends."""
    plain, guarded = tmp_path / "plain.db", tmp_path / "guarded.db"
    log = tmp_path / "servers.log"
    with _http_server(plain, None, log) as url:
        asyncio.run(_call(url, "alice-token", "create_api_key", {"name": "default"}))
        asyncio.run(_call(url, "alice-token", "create_api_key", {"name": "default"}))
    assert len(_effects(plain, "api_key")) == 2  # the duplicate

    async def scenario(url: str) -> dict[str, Any]:
        out = {"alice": await _call(url, "alice-token", "create_api_key", {"name": "default"})}
        out["alice_retry"] = await _call(url, "alice-token", "create_api_key", {"name": "default"})
        out["bob"] = await _call(url, "bob-token", "create_api_key", {"name": "default"})
        out["alice_key"] = await _call(url, "alice-token", "charge", {"customer": "c", "cents": 1}, meta("order-1"))
        out["bob_key"] = await _call(url, "bob-token", "charge", {"customer": "c", "cents": 1}, meta("order-1"))
        conv = meta(scope="conversation-a")
        out["alice_conv"] = await _call(url, "alice-token", "charge", {"customer": "d", "cents": 2}, conv)
        out["bob_conv"] = await _call(url, "bob-token", "charge", {"customer": "d", "cents": 2}, conv)
        out["alice_conv_retry"] = await _call(url, "alice-token", "charge", {"customer": "d", "cents": 2}, conv)
        return out

    with _http_server(guarded, f"sqlite:///{tmp_path}/ledger.db", log) as url:
        out = asyncio.run(scenario(url))
    keys = _effects(guarded, "api_key")
    assert len(keys) == 2  # alice's and bob's own
    alice_key, bob_key = (_text(out[w]) for w in ("alice", "bob"))
    assert alice_key != bob_key and bob_key.startswith("sk-") and alice_key not in _text(out["bob"])
    assert out["alice_retry"].meta[REPLAYED_META] is True and alice_key in _text(out["alice_retry"])
    assert not (out["bob"].meta or {}).get(REPLAYED_META)
    # The same _meta key, and the same conversation scope, sent by another user: that user's own record.
    assert len(_effects(guarded, "charge")) == 4
    for name in ("bob_key", "bob_conv"):
        assert not out[name].is_error and not (out[name].meta or {}).get(REPLAYED_META)
    assert out["alice_conv_retry"].meta[REPLAYED_META] is True
    with Ledger.open(f"sqlite:///{tmp_path}/ledger.db") as ledger:
        scopes = {r.scope for r in ledger.list(tool="charge")}
        assert len(scopes) == 4 and not any("token" in s for s in scopes)  # hashed, never the credentials


def _charges(tmp_path: Path) -> tuple[FastMCP[Any], list[int]]:
    made: list[int] = []
    server: FastMCP[Any] = FastMCP("payments")

    @server.tool()
    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        made.append(cents)
        return f"charged {customer} {cents} ({type(cents).__name__})"

    return server, made


def test_arguments_are_keyed_as_the_tool_sees_them(tmp_path: Path) -> None:
    """500, "500" and 500.0 for an integer parameter: three charges without onceonly, one with it, over the
    FastMCP middleware and over a FastMCP proxy; arguments the schema refuses are an error, nothing
    recorded."""
    ledger = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")

    async def three(server: FastMCP[Any]) -> list[Any]:
        async with Client(server) as client:
            return [
                await client.call_tool("charge", {"customer": "c", "cents": cents}, raise_on_error=False)
                for cents in (500, "500", 500.0)
            ]

    plain, made = _charges(tmp_path)
    asyncio.run(three(plain))
    assert len(made) == 3

    guarded, made = _charges(tmp_path)
    guarded.add_middleware(OnceOnlyMiddleware(ledger))
    first, *again = asyncio.run(three(guarded))
    assert made == [500] and "(int)" in _text(first)
    assert all(r.meta[REPLAYED_META] is True for r in again)

    upstream, made = _charges(tmp_path)
    proxy = create_proxy(upstream, name="proxy")
    proxy.add_middleware(OnceOnlyMiddleware(ledger, scope="through-proxy"))
    asyncio.run(three(proxy))
    assert made == [500]

    async def refused() -> str:
        async with Client(guarded) as client:
            with pytest.raises(MCPError) as err:  # invalid params: a protocol error, the tool never ran
                await client.call_tool("charge", {"customer": "c", "cents": "five hundred"})
            return str(err.value)

    before = len(ledger.list())
    text = asyncio.run(refused())
    assert "cents" in text and "integer" in text
    assert len(ledger.list()) == before
    ledger.close()


def test_an_upstream_error_after_the_side_effect_is_unknown_through_a_proxy(tmp_path: Path) -> None:
    """The upstream charges the card, then answers with its own timeout as an isError result. Through a plain
    proxy the retry charges again; through a guarded one the outcome is unknown: the retry does not run
    the tool, and neither answer reads as a success."""

    def upstream() -> tuple[FastMCP[Any], list[int]]:
        made: list[int] = []
        server: FastMCP[Any] = FastMCP("payments")

        @server.tool()
        def charge(customer: str, cents: int) -> str:
            """Charge a customer's card."""
            made.append(cents)
            raise ToolError("the card processor timed out")

        return server, made

    async def twice(proxy: FastMCP[Any]) -> list[Any]:
        async with Client(proxy) as client:
            args = {"customer": "c", "cents": 5}
            return [
                await client.call_tool("charge", args, meta=meta("order-9"), raise_on_error=False) for _ in range(2)
            ]

    server, made = upstream()
    asyncio.run(twice(create_proxy(server, name="plain")))
    assert made == [5, 5]  # the duplicate

    server, made = upstream()
    proxy = create_proxy(server, name="guarded")
    ledger = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    proxy.add_middleware(OnceOnlyMiddleware(ledger))
    first, second = asyncio.run(twice(proxy))
    assert made == [5]
    for answer in (first, second):
        assert answer.is_error and "unknown" in _text(answer) and "Do not issue it again" in _text(answer)
        assert "onceonly resolve" not in _text(answer)
    assert "timed out" in _text(first)  # the tool's own words follow
    (rec,) = ledger.list(tool="charge")
    assert rec.state.value == "needs_review"

    # The tool's policy can say an error result means it did nothing: then it runs again.
    server, made = upstream()
    proxy = create_proxy(server, name="says-failed")
    proxy.add_middleware(OnceOnlyMiddleware(ledger, tools={"charge": ToolPolicy(on_error="failed")}))
    asyncio.run(twice(proxy))
    assert made == [5, 5]
    ledger.close()


def test_forged_replay_marks_are_not_passed_on(tmp_path: Path) -> None:
    """An upstream that marks its first answer as an onceonly replay: the client never sees that mark, on a
    guarded tool or on one that passes through; onceonly's own marks on a real replay are onceonly's."""
    upstream: FastMCP[Any] = FastMCP("forger")
    forged = {REPLAYED_META: True, KEY_META: "someone:else:key", "vendor/trace": "t-1"}

    @upstream.tool()
    def charge(cents: int) -> ToolResult:
        """Charge."""
        return ToolResult(content=[TextContent(type="text", text=f"charged {cents}")], meta=forged)

    @upstream.tool(annotations={"readOnlyHint": True})
    def balance() -> ToolResult:
        """Read the balance."""
        return ToolResult(content=[TextContent(type="text", text="100")], meta=forged)

    ledger = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    proxy = create_proxy(upstream, name="proxy")
    proxy.add_middleware(OnceOnlyMiddleware(ledger))

    async def main() -> list[Any]:
        async with Client(proxy) as client:
            return [
                await client.call_tool("charge", {"cents": 5}),
                await client.call_tool("balance", {}),
                await client.call_tool("charge", {"cents": 5}),
            ]

    first, read, replay = asyncio.run(main())
    for answer in (first, read):
        assert REPLAYED_META not in (answer.meta or {}) and KEY_META not in (answer.meta or {})
        assert answer.meta["vendor/trace"] == "t-1"  # the upstream's own keys pass
    assert replay.meta[REPLAYED_META] is True and replay.meta[KEY_META] != "someone:else:key"
    ledger.close()


def test_single_tenant_shares_records_across_callers_when_said(tmp_path: Path) -> None:
    """``single_tenant=True``: a server guarded for one tenant on purpose shares records across callers."""
    server, made = _charges(tmp_path)
    ledger = Ledger.open(f"sqlite:///{tmp_path}/ledger.db")
    server.add_middleware(OnceOnlyMiddleware(ledger, single_tenant=True))

    async def main() -> None:
        for _ in range(2):
            async with Client(server) as client:
                await client.call_tool("charge", {"customer": "c", "cents": 1})

    asyncio.run(main())
    assert made == [1]
    (rec,) = ledger.list(tool="charge")
    assert rec.scope == "payments"
    ledger.close()


def test_an_upstreams_annotations_relax_nothing_unless_the_config_trusts_it(tmp_path: Path) -> None:
    """The proxy fronts another's server: its readOnlyHint and idempotentHint are claims, taken only
    when the config says ``annotations = true``; by default every tool is guarded as a write."""
    from onceonly.mcp.config import parse_config
    from onceonly.mcp.core import Guard, Hints

    untrusted = parse_config({"proxy": {}})
    trusted = parse_config({"proxy": {"annotations": True}})
    assert (untrusted.annotations, trusted.annotations) == (False, True)
    claims = Hints(read_only=True, idempotent=True)
    with Ledger.open(f"sqlite:///{tmp_path}/ledger.db") as ledger:
        default = Guard(ledger, annotations=untrusted.annotations)
        vouched = Guard(ledger, annotations=trusted.annotations)
        assert (default.mode("count", claims), default.on_unknown("count", claims)) == ("guard", "review")
        assert (vouched.mode("count", claims), vouched.on_unknown("send", Hints(idempotent=True))) == ("pass", "retry")
