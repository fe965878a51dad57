"""Running an ASGI app under uvicorn on 127.0.0.1: in a thread (tests, the demo) or in the foreground.

The server speaks HTTP/1.1 through ``AbortableH11Protocol``, uvicorn's h11 protocol with one
addition: every request's scope carries ``scope["onceonly.abort"]``, a callable that resets the
connection. That is how the ``lost`` fault makes a client see a dropped connection and no response,
which a plain ASGI app cannot do (uvicorn answers 500 for an app that returns without responding).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from onceonly.server._http import ASGIApp, Receive, Scope, Send
from onceonly.tickets.faults import ABORT_KEY, abort_transport

__all__ = ["AbortableH11Protocol", "RunningServer", "bind", "serve", "serve_in_thread"]


class AbortableH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, with ``scope["onceonly.abort"]`` to reset the connection."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        inner: ASGIApp = self.app

        def abort() -> None:
            abort_transport(transport)

        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            scope[ABORT_KEY] = abort
            await inner(scope, receive, send)

        self.app = app


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one, chosen by the OS)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle off only on sockets that say they are TCP, and with
    # Nagle on every response waits ~40 ms for a delayed ACK between its header and body writes.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _config(app: ASGIApp, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        http=AbortableH11Protocol,
        log_level=log_level,
        access_log=False,
        lifespan="auto",
        timeout_graceful_shutdown=3,
    )


class RunningServer:
    """A uvicorn server running in a daemon thread. ``url`` is its base URL; ``stop()`` ends it.

    Use it as a context manager to stop it at the end of a block.

    .. versionadded:: 0.1
    """

    def __init__(
        self, server: uvicorn.Server, thread: threading.Thread, url: str, app: ASGIApp, *, owns_app: bool = False
    ) -> None:
        self.server = server
        self.thread = thread
        self.url = url
        self.app = app
        self._owns_app = owns_app

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, finish the requests running (up to a few seconds), join the thread.

        A ticket service made by ``serve_in_thread`` also closes its database connections.
        """
        self.server.should_exit = True
        self.thread.join(timeout)
        if self._owns_app:
            db = getattr(getattr(self.app, "state", None), "db", None)
            if db is not None:
                db.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"RunningServer({self.url!r})"


def serve_in_thread(
    app: ASGIApp | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    log_level: str = "warning",
    startup_timeout: float = 10.0,
    **create_app_kwargs: Any,
) -> RunningServer:
    """Serve ``app`` (default: ``create_app(**create_app_kwargs)``, the ticket service) in a thread.

    Returns when the server accepts connections, with its URL (``port=0``: a free port).

        with serve_in_thread(db_path="tickets.db", faults={"lost": 0.2}, seed=7) as server:
            httpx.post(f"{server.url}/tickets", ...)

    .. versionadded:: 0.1
    """
    owns_app = app is None
    if app is None:
        from onceonly.tickets.app import create_app

        app = create_app(**create_app_kwargs)
    elif create_app_kwargs:
        raise TypeError(f"serve_in_thread(app, ...) takes no create_app arguments: {sorted(create_app_kwargs)}")
    sock = bind(host, port)
    server = uvicorn.Server(_config(app, log_level))
    failure: list[BaseException] = []

    def run() -> None:
        try:
            server.run(sockets=[sock])
        except BaseException as exc:  # reported to the caller below
            failure.append(exc)
        finally:
            sock.close()

    thread = threading.Thread(target=run, name=f"onceonly-tickets-{sock.getsockname()[1]}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if failure or not thread.is_alive():
            raise RuntimeError(f"the server did not start: {failure[0] if failure else 'its thread ended'}")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server did not start within {startup_timeout} s")
        time.sleep(0.005)
    return RunningServer(server, thread, _url(sock), app, owns_app=owns_app)


def serve(
    app: ASGIApp,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve ``app`` in the foreground until Ctrl-C / SIGTERM; ``on_ready(url)`` once it listens."""
    sock = bind(host, port)
    server = uvicorn.Server(_config(app, log_level))
    if on_ready is not None:
        url = _url(sock)
        startup = server.startup

        async def announce(sockets: list[socket.socket] | None = None) -> None:
            await startup(sockets=sockets)
            on_ready(url)

        server.startup = announce  # type: ignore[method-assign]
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
