"""The guard for the official MCP SDK's ``MCPServer``: a server middleware (needs the ``mcp`` extra).

``guard_server(server, ledger)`` adds it. It runs before the SDK validates a request, so it checks the
little it reads itself (a ``tools/call`` whose arguments are not an object is refused, nothing recorded).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import mcp_types as mt
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel

from onceonly.mcp.core import META_KEY, BadRequest, Forwarded, Guard, Hints, Request, ToolPolicy

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer

    from onceonly.ledger import Ledger

__all__ = ["OnceOnlyServerMiddleware", "guard_server"]

# Where a handshake-era connection keeps the id the guard gave it (it has no session id on stdio).
_CONNECTION_ID = "dev.onceonly/connection"


def to_wire(result: Any) -> dict[str, Any]:
    """A handler's result (a model or a dict) as a wire dict."""
    if isinstance(result, BaseModel):
        return result.model_dump(by_alias=True, exclude_none=True, mode="json")
    return dict(result or {})


class OnceOnlyServerMiddleware:
    """Guard the ``tools/call`` requests of an ``MCPServer`` with a ledger (see ``guard_server``).

    The options are those of ``onceonly.mcp.OnceOnlyMiddleware``.

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        server: MCPServer[Any],
        meta_key: str = META_KEY,
        scope: str | None = None,
        tools: Mapping[str, ToolPolicy | Mapping[str, Any]] | None = None,
        annotations: bool = True,
        tell_model: bool = True,
    ) -> None:
        self.server = server
        self.guard = Guard(
            ledger, meta_key=meta_key, scope=scope, tools=tools, annotations=annotations, tell_model=tell_model
        )

    async def __call__(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        params = ctx.params
        if ctx.method != "tools/call" or ctx.request_id is None or not isinstance(params, Mapping):
            return await call_next(ctx)
        name = params.get("name")
        if not isinstance(name, str):
            return await call_next(ctx)  # the SDK's own validation answers it
        tool = next((t for t in await self.server.list_tools() if t.name == name), None)
        if tool is None:
            return await call_next(ctx)  # the server's own "unknown tool" answer; nothing recorded
        arguments = params.get("arguments")
        if arguments is None:
            arguments = {}
        if not isinstance(arguments, dict):
            raise MCPError(
                mt.INVALID_PARAMS,
                f"tools/call {name!r}: the arguments must be a JSON object, got {type(arguments).__name__}",
            )
        modern = ctx.protocol_version in MODERN_PROTOCOL_VERSIONS
        session = None
        if not modern:
            conn = ctx.session._connection
            session = conn.session_id or conn.state.setdefault(_CONNECTION_ID, uuid.uuid4().hex)
        hints = Hints()
        if tool.annotations is not None:
            hints = Hints(read_only=tool.annotations.read_only_hint, idempotent=tool.annotations.idempotent_hint)

        async def call() -> HandlerResult:
            return await call_next(ctx)

        async def probe_call(probe: str, args: dict[str, Any]) -> dict[str, Any]:
            return to_wire(await self.server.call_tool(probe, args))

        req = Request(
            name=name, arguments=arguments, meta=ctx.meta or {}, session=session, hints=hints, call=call,
            to_wire=to_wire, probe_call=probe_call,
        )  # fmt: skip
        try:
            answer = await self.guard.run(req, self.server.name)
        except BadRequest as exc:
            raise MCPError(mt.INVALID_PARAMS, str(exc)) from None
        if isinstance(answer, Forwarded):
            return answer.original  # type: ignore[no-any-return]
        wire = answer.wire
        if modern:
            wire["resultType"] = "complete"
        return wire


def guard_server(
    server: MCPServer[Any],
    ledger: Ledger,
    *,
    meta_key: str = META_KEY,
    scope: str | None = None,
    tools: Mapping[str, ToolPolicy | Mapping[str, Any]] | None = None,
    annotations: bool = True,
    tell_model: bool = True,
) -> OnceOnlyServerMiddleware:
    """Guard every ``tools/call`` of an official-SDK ``MCPServer`` (adds ``OnceOnlyServerMiddleware`` to
    ``server.middleware``) and return the middleware.

    .. versionadded:: 0.1
    """
    mw = OnceOnlyServerMiddleware(
        ledger, server=server, meta_key=meta_key, scope=scope, tools=tools, annotations=annotations,
        tell_model=tell_model,
    )  # fmt: skip
    server.middleware.append(mw)
    return mw
