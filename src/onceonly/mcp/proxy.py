"""``onceonly mcp-proxy``: a guarded MCP proxy in front of any MCP server (needs the ``mcp`` extra).

The proxy is FastMCP's ``create_proxy`` with ``OnceOnlyMiddleware``: tools, resources and prompts are
forwarded, and every ``tools/call`` goes through the ledger as the middleware decides.

    onceonly mcp-proxy --url sqlite:///ledger.db --config proxy.toml -- python ticket_server.py
    onceonly mcp-proxy --upstream http://127.0.0.1:9000/mcp --listen 127.0.0.1:8800

It serves stdio (stdout is the protocol: the proxy logs to stderr), or streamable HTTP at ``/mcp`` with
``--listen HOST:PORT``, behind a front door (``onceonly.mcp.front``): loopback ``Host``/``Origin`` only
unless configured, and a bearer token (``--token``) required beyond loopback. A stdio upstream gets the
MCP SDK's safe environment (``PATH``, ``HOME``…) plus the variables the config names (``env = [...]``),
never the proxy's whole environment (which holds ``$ONCEONLY_URL`` with its password).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from pathlib import PurePath
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import click

from onceonly._cli import printable, url_option
from onceonly._install import install_hint
from onceonly.ledger import Ledger
from onceonly.mcp.config import ProxyConfig, load_config
from onceonly.mcp.front import FrontDoor, check_listen, is_loopback

if TYPE_CHECKING:
    from fastmcp import FastMCP

__all__ = ["COMMANDS", "build_proxy", "upstream_name"]

_log = logging.getLogger("onceonly")
_NOT_NAME = re.compile(r"[^A-Za-z0-9._:@/-]+")


def upstream_name(upstream: str | Sequence[str]) -> str:
    """The default scope of a proxy's keys: the upstream's name, stable across restarts.

    A URL gives its host, port and path (``127.0.0.1:9000/mcp``); a command its last word that is not an
    option, without directory or extension (``python ticket_server.py`` → ``ticket_server``).
    """
    if isinstance(upstream, str):
        parts = urlsplit(upstream)
        text = f"{parts.netloc}{parts.path}".rstrip("/") or upstream
    else:
        words = [w for w in upstream if not w.startswith("-")] or list(upstream)
        path = PurePath(words[-1])
        text = path.stem or path.name
    return _NOT_NAME.sub("-", text).strip("-")[:64] or "mcp-upstream"


def build_proxy(
    upstream: str | Sequence[str],
    ledger: Ledger,
    config: ProxyConfig | None = None,
    *,
    scope: str | None = None,
    name: str = "onceonly-proxy",
) -> FastMCP[Any]:
    """A FastMCP proxy of ``upstream`` (a streamable-HTTP URL, or a stdio command and its arguments)
    whose ``tools/call`` requests go through ``ledger``.

    .. versionadded:: 0.1
    """
    from fastmcp.server import create_proxy

    from onceonly.mcp.middleware import OnceOnlyMiddleware

    config = config or ProxyConfig()
    if isinstance(upstream, str):
        target: Any = upstream
    else:
        if not upstream:
            raise ValueError("no upstream: give a command after --, or --upstream URL")
        server = {"command": upstream[0], "args": list(upstream[1:]), "env": upstream_environment(config.env)}
        target = {"mcpServers": {"upstream": server}}
    proxy = create_proxy(target, name=name)
    proxy.add_middleware(
        OnceOnlyMiddleware(
            ledger,
            meta_key=config.meta_key,
            scope=scope or config.scope or upstream_name(upstream),
            tools=config.tools,
            annotations=config.annotations,
            tell_model=config.tell_model,
            single_tenant=config.single_tenant,
        )
    )
    return proxy


def upstream_environment(names: Sequence[str] = ()) -> dict[str, str]:
    """The environment of a stdio upstream: the MCP SDK's safe list (``PATH``, ``HOME``, ``USER``…) plus the
    variables ``names`` (those set), never the proxy's own secrets unless named."""
    from mcp.client.stdio import get_default_environment

    env = get_default_environment()
    env.update({name: os.environ[name] for name in names if name in os.environ})
    return env


def _listen(value: str | None) -> tuple[str, int] | None:
    if value is None:
        return None
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{value!r}: give HOST:PORT, such as 127.0.0.1:8800", param_hint="--listen")
    return host.strip("[]"), int(port)


@click.command("mcp-proxy", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@url_option()
@click.option("--config", "config_path", default=None, type=click.Path(dir_okay=False), help="A TOML file.")
@click.option("--upstream", default=None, help="A streamable-HTTP upstream URL (instead of a command after --).")
@click.option("--listen", default=None, help="Serve streamable HTTP at HOST:PORT/mcp instead of stdio.")
@click.option("--scope", default=None, help="The server's part of every key's scope [default: upstream's name].")
@click.option(
    "--token",
    envvar="ONCEONLY_PROXY_TOKEN",
    default=None,
    help="--listen: every request must send Authorization: Bearer TOKEN (required beyond loopback).",
)
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def mcp_proxy(
    url: str,
    config_path: str | None,
    upstream: str | None,
    listen: str | None,
    scope: str | None,
    token: str | None,
    command: tuple[str, ...],
) -> None:
    """Serve a guarded proxy of an MCP server: -- COMMAND … (stdio), or --upstream URL."""
    if (upstream is None) == (not command):
        raise click.UsageError("give the upstream as a command after -- (stdio), or as --upstream URL; not both")
    if upstream is not None and urlsplit(upstream).scheme not in ("http", "https"):
        raise click.BadParameter(f"{upstream!r}: give an http:// or https:// URL", param_hint="--upstream")
    address = _listen(listen)
    if address is not None:
        try:
            check_listen(address[0], token)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--listen") from None
    try:
        import fastmcp  # noqa: F401
    except ImportError as exc:
        raise click.ClickException(f"mcp-proxy needs the mcp extra: {install_hint('mcp')} ({exc})") from exc
    try:
        config = load_config(config_path) if config_path else ProxyConfig()
    except (OSError, ValueError) as exc:
        raise click.ClickException(printable(exc)) from exc
    try:
        ledger = Ledger.open(url)
        proxy = build_proxy(upstream or list(command), ledger, config, scope=scope)
    except (ValueError, ImportError) as exc:
        raise click.ClickException(printable(exc)) from exc
    try:
        if address is None:
            proxy.run(transport="stdio", show_banner=False)
        else:
            from starlette.middleware import Middleware

            if token is None and is_loopback(address[0]):
                _log.warning(
                    "onceonly mcp-proxy: listening on %s with no token: only this machine can call it, and its "
                    "clients are told apart only by the Authorization header they send (none: one local caller)",
                    address[0],
                )
            door = Middleware(FrontDoor, token=token, allowed_hosts=config.allowed_hosts)
            proxy.run(
                transport="http", host=address[0], port=address[1], path="/mcp", show_banner=False, middleware=[door]
            )
    finally:
        ledger.close()


COMMANDS = [mcp_proxy]
