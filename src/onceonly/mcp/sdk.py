"""The guard for the official MCP SDK's ``MCPServer``: a server middleware (needs the ``mcp`` extra).

``guard_server(server, ledger)`` adds it. It runs before the SDK validates a request, so it checks the
little it reads itself (a ``tools/call`` whose arguments are not an object is refused, nothing recorded).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import mcp_types as mt
from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel

from onceonly.mcp.core import META_KEY, BadRequest, Forwarded, Guard, Hints, Request, ToolPolicy, Transport

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


def transport_of(ctx: ServerRequestContext[Any, Any], session: str | None) -> Transport:
    """Who sent ``ctx``: its HTTP request (``Authorization``, peer, the authenticated user's token) when it
    came over HTTP; none for stdio and in-memory clients."""
    request = ctx.request
    headers = getattr(request, "headers", None)
    if request is None or headers is None:
        return Transport(network=False, session=session)
    from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
    from mcp.server.auth.provider import principal_components

    user = getattr(request, "scope", {}).get("user")
    principal = principal_components(user.access_token) if isinstance(user, AuthenticatedUser) else None
    client = getattr(request, "client", None)
    return Transport(
        network=True, principal=principal, authorization=headers.get("authorization"),
        peer=getattr(client, "host", None), session=session,
    )  # fmt: skip


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
        single_tenant: bool = False,
        client_secret: bytes | str | None = None,
    ) -> None:
        self.server = server
        self.guard = Guard(
            ledger, meta_key=meta_key, scope=scope, tools=tools, annotations=annotations, tell_model=tell_model,
            single_tenant=single_tenant, client_secret=client_secret,
        )  # fmt: skip

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

        async def call(args: dict[str, Any]) -> HandlerResult:
            if args == arguments:
                return await call_next(ctx)
            return await call_next(dataclasses.replace(ctx, params={**params, "arguments": args}))

        async def probe_call(probe: str, args: dict[str, Any]) -> dict[str, Any]:
            return to_wire(await self.server.call_tool(probe, args))

        req = Request(
            name=name, arguments=arguments, meta=ctx.meta or {}, transport=transport_of(ctx, session), hints=hints,
            call=call, to_wire=to_wire, probe_call=probe_call, schema=tool.input_schema,
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
    single_tenant: bool = False,
    client_secret: bytes | str | None = None,
) -> OnceOnlyServerMiddleware:
    """Guard every ``tools/call`` of an official-SDK ``MCPServer`` (adds ``OnceOnlyServerMiddleware`` to
    ``server.middleware``) and return the middleware.

    .. versionadded:: 0.1
    """
    mw = OnceOnlyServerMiddleware(
        ledger, server=server, meta_key=meta_key, scope=scope, tools=tools, annotations=annotations,
        tell_model=tell_model, single_tenant=single_tenant, client_secret=client_secret,
    )  # fmt: skip
    server.middleware.append(mw)
    return mw
