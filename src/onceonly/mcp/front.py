"""The front door of ``onceonly mcp-proxy --listen``: what is refused before a request reaches the proxy.

- The ``Host`` header must name a loopback host (``127.0.0.1``, ``localhost``, ``[::1]``) or one of the
  configured ``allowed_hosts``, and an ``Origin``, when a browser sends one, too: a web page whose name
  was re-pointed at 127.0.0.1 (DNS rebinding) cannot call the upstream's tools.
- With a token, every request carries it (``Authorization: Bearer T``); serving on an address other
  machines reach needs one (``check_listen``).

A refused request never reaches the upstream: it is answered here, as ``application/problem+json``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

__all__ = ["MIN_TOKEN_LENGTH", "FrontDoor", "check_listen", "is_loopback"]

#: The shortest token accepted: a guessable one protects nothing.
MIN_TOKEN_LENGTH = 16


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, without a port) is this machine's loopback."""
    name = host.strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_listen(host: str, token: str | None) -> None:
    """Refuse to listen on ``host`` without a token unless it is a loopback address, and refuse a token
    too short to protect anything.

    Raises:
        ValueError: what is wrong, and what to give instead.
    """
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(
            f"the token has {len(token)} characters; give at least {MIN_TOKEN_LENGTH}, such as the output of "
            "python -c 'import secrets; print(secrets.token_urlsafe())'"
        )
    if token is None and not is_loopback(host):
        raise ValueError(
            f"--listen {host} is reachable from other machines: give a token (--token or $ONCEONLY_PROXY_TOKEN), "
            "which every client then sends as Authorization: Bearer TOKEN, or listen on 127.0.0.1"
        )


def _host_name(value: str) -> str:
    """The host of a ``Host`` header, without its port (``[::1]:8800`` gives ``::1``)."""
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class FrontDoor:
    """An ASGI middleware that answers refused requests itself (see the module's docstring)."""

    def __init__(self, app: Any, *, token: str | None = None, allowed_hosts: Iterable[str] = ()) -> None:
        self.app = app
        self.token = None if token is None else token.encode()
        self.allowed = frozenset(h.lower() for h in allowed_hosts)

    def _allowed(self, host: str) -> bool:
        return bool(host) and (is_loopback(host) or host.lower() in self.allowed)

    def refusal(self, headers: dict[bytes, bytes]) -> tuple[int, str] | None:
        host = _host_name(headers.get(b"host", b"").decode("latin-1"))
        if not self._allowed(host):
            return 403, f"this proxy answers only to a loopback Host or a configured allowed_hosts name, not {host!r}"
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1")
            if text != "null" and not self._allowed(urlsplit(text).hostname or ""):
                return 403, "a request from a web page of another origin is refused"
        if self.token is not None:
            presented = headers.get(b"authorization", b"")
            scheme, _, value = presented.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(value.strip(), self.token):
                return 401, "this proxy needs its token: send Authorization: Bearer TOKEN"
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self.refusal(dict(scope.get("headers") or ()))
        if refused is None:
            await self.app(scope, receive, send)
            return
        status, detail = refused
        body = json.dumps({"type": "about:blank", "title": "Refused", "status": status, "detail": detail}).encode()
        headers = [(b"content-type", b"application/problem+json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="onceonly-mcp-proxy"'))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
