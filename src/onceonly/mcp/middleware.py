"""``OnceOnlyMiddleware``: the guard as a FastMCP middleware, for FastMCP servers and proxies (needs the
``mcp`` extra)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import mcp_types as mt
from fastmcp.server.middleware import CallNext, Middleware, MiddlewareContext
from fastmcp.tools.base import RawStructuredToolResult, ToolResult
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import TypeAdapter

from onceonly.mcp.core import META_KEY, BadRequest, Forwarded, Guard, Hints, Request, ToolPolicy, Transport
from onceonly.tools import ToolSpec

if TYPE_CHECKING:
    from fastmcp import FastMCP
    from fastmcp.tools.base import Tool

    from onceonly.ledger import Ledger

__all__ = ["OnceOnlyMiddleware", "to_wire"]

_BLOCKS: TypeAdapter[list[mt.ContentBlock]] = TypeAdapter(list[mt.ContentBlock])


def to_wire(result: ToolResult) -> dict[str, Any]:
    """A FastMCP ``ToolResult`` as the wire dict of a ``CallToolResult``."""
    wire: dict[str, Any] = {
        "content": [b.model_dump(by_alias=True, exclude_none=True, mode="json") for b in result.content],
        "isError": result.is_error,
    }
    if result.structured_content is not None:
        wire["structuredContent"] = result.structured_content
    if result.meta:
        wire["_meta"] = dict(result.meta)
    if type(result).__name__ == "InputRequiredToolResult":
        wire["resultType"] = "input_required"
    return wire


def from_wire(wire: Mapping[str, Any]) -> ToolResult:
    """A wire dict (a replay, an error made here) as a FastMCP ``ToolResult``."""
    content = _BLOCKS.validate_python(wire.get("content") or [])
    structured = wire.get("structuredContent")
    cls = ToolResult if structured is None or isinstance(structured, dict) else RawStructuredToolResult
    return cls(
        content=content, structured_content=structured, meta=wire.get("_meta"), is_error=bool(wire.get("isError"))
    )


def _hints(tool: Tool) -> Hints:
    a = tool.annotations
    if a is None:
        return Hints()
    return Hints(read_only=a.read_only_hint, idempotent=a.idempotent_hint)


def _already_guarded(tool: Tool) -> bool:
    """A tool made from ``@ledger.tool`` guards itself: guarding it again would hold two records."""
    return isinstance(getattr(getattr(tool, "fn", None), "spec", None), ToolSpec)


def transport_of(ctx: Any) -> Transport:
    """Who sent the current request, as FastMCP shows it: the HTTP request (its ``Authorization`` and
    peer) and the access token when there is one; none for stdio and in-memory clients."""
    from fastmcp.server.dependencies import get_access_token, get_http_request
    from mcp.server.auth.provider import principal_components

    try:
        request = get_http_request()
    except RuntimeError:
        return Transport(network=False)
    token = get_access_token()
    rc = ctx.request_context
    session = None
    if rc is not None and rc.protocol_version not in MODERN_PROTOCOL_VERSIONS:
        session = request.headers.get("mcp-session-id") or ctx.session_id
    client = request.client
    return Transport(
        network=True,
        principal=None if token is None else principal_components(token),
        authorization=request.headers.get("authorization"),
        peer=None if client is None else client.host,
        session=session,
    )


class OnceOnlyMiddleware(Middleware):
    """Guard the ``tools/call`` requests of a FastMCP server or proxy with a ledger.

    ``server.add_middleware(OnceOnlyMiddleware(ledger))``, or
    ``create_proxy(upstream).add_middleware(OnceOnlyMiddleware(ledger, tools={...}))``. Every key is
    within its caller's scope (the access token's principal, else the ``Authorization`` header, both
    hashed; the one client of stdio or memory; a handshake-era session; a loopback client), under
    ``scope`` (default: the server's name): the client's ``_meta[meta_key]``; else
    ``_meta["dev.onceonly/scope"]`` + tool + canonical arguments; else tool + canonical arguments, the
    arguments coerced by the tool's schema first. ``single_tenant=True`` shares records across callers.
    See ``onceonly.mcp.ToolPolicy`` for the per-tool options.

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        meta_key: str = META_KEY,
        scope: str | None = None,
        tools: Mapping[str, ToolPolicy | Mapping[str, Any]] | None = None,
        annotations: bool = True,
        tell_model: bool = True,
        single_tenant: bool = False,
        client_secret: bytes | str | None = None,
    ) -> None:
        self.guard = Guard(
            ledger, meta_key=meta_key, scope=scope, tools=tools, annotations=annotations, tell_model=tell_model,
            single_tenant=single_tenant, client_secret=client_secret,
        )  # fmt: skip

    async def on_call_tool(
        self,
        context: MiddlewareContext[mt.CallToolRequestParams],
        call_next: CallNext[mt.CallToolRequestParams, ToolResult],
    ) -> ToolResult:
        ctx = context.fastmcp_context
        msg = context.message
        if ctx is None:
            return await call_next(context)
        server: FastMCP[Any] = ctx.fastmcp
        tool = await server.get_tool(msg.name)
        if tool is None:
            # An unknown tool gets the server's own answer, and nothing is recorded.
            return await call_next(context)
        rc = ctx.request_context
        meta: Mapping[str, Any] = (rc.meta if rc is not None else None) or {}
        transport = transport_of(ctx)

        async def call(arguments: dict[str, Any]) -> ToolResult:
            if arguments == msg.arguments:
                return await call_next(context)
            return await call_next(context.copy(message=msg.model_copy(update={"arguments": arguments})))

        req = Request(
            name=msg.name, arguments=msg.arguments if msg.arguments is not None else {}, meta=meta,
            transport=transport, hints=_hints(tool), call=call, to_wire=to_wire, probe_call=None,
            schema=tool.parameters,
        )  # fmt: skip
        if _already_guarded(tool):
            # A tool made from @ledger.tool guards itself (guarding it again would hold two records): it
            # runs in its caller's scope, so that one caller's record never answers another's call.
            with self.guard.ledger.task(await self.guard.caller(req, server.name)):
                return await call_next(context)

        async def probe_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
            return to_wire(await server.call_tool(name, arguments, run_middleware=False))

        req.probe_call = probe_call
        try:
            answer = await self.guard.run(req, server.name)
        except BadRequest as exc:
            raise MCPError(mt.INVALID_PARAMS, str(exc)) from None
        if isinstance(answer, Forwarded):
            return answer.original  # type: ignore[no-any-return]
        return from_wire(answer.wire)
