"""onceonly for MCP: guarded MCP servers, and a proxy in front of any MCP server.

- ``OnceOnlyMiddleware(ledger, ...)``: a FastMCP middleware for servers and proxies (``create_proxy``).
- ``guard_server(server, ledger, ...)``: the same for the official SDK's ``MCPServer``.
- ``meta(key)`` / ``meta(scope=...)``: the ``_meta`` of a call that carries the client's own key.
- ``onceonly mcp-proxy -- <upstream command …>``: the proxy (``onceonly.mcp.proxy``).

The middlewares need the ``mcp`` extra (see ``docs/mcp.md`` for installing it) and are imported when first
used; ``meta`` and the policy types need nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from onceonly._install import install_hint
from onceonly.mcp.core import KEY_META, META_KEY, REPLAYED_META, SCOPE_META_KEY, ProbeTool, ToolPolicy, meta

if TYPE_CHECKING:
    from onceonly.mcp.middleware import OnceOnlyMiddleware
    from onceonly.mcp.sdk import OnceOnlyServerMiddleware, guard_server

__all__ = [
    "KEY_META",
    "META_KEY",
    "REPLAYED_META",
    "SCOPE_META_KEY",
    "OnceOnlyMiddleware",
    "OnceOnlyServerMiddleware",
    "ProbeTool",
    "ToolPolicy",
    "guard_server",
    "meta",
]

_LAZY = {
    "OnceOnlyMiddleware": "onceonly.mcp.middleware",
    "OnceOnlyServerMiddleware": "onceonly.mcp.sdk",
    "guard_server": "onceonly.mcp.sdk",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'onceonly.mcp' has no attribute {name!r}")
    import importlib

    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"onceonly.mcp.{name} needs the mcp extra: {install_hint('mcp')} ({exc})") from exc
    return getattr(mod, name)
