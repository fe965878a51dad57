"""The application's response to one claimed request, passed on to the client and kept: stored (or the
key released) by the store mode (``_stored.StoredMode``) before the client can see its end."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from ._http import IdempotencyContext, Message, Send, StoredResponse

if TYPE_CHECKING:
    from ._stored import Held, StoredMode

__all__ = ["Capture"]

log = logging.getLogger("onceonly.server")


class Capture:
    """The application's response to one guarded request, passed on to the client and kept: stored
    (or the key released) before the client can see its end.

    A client that leaves must not stop a response this middleware will store: the app would return
    without one, the key would be released and the retry would run the handler again. So
    ``http.disconnect`` reaches the app (``unheard``) only once the response is complete or will not
    be kept.
    """

    def __init__(self, mode: StoredMode, held: Held, ctx: IdempotencyContext, send: Send) -> None:
        self.mode = mode
        self.held = held
        self.ctx = ctx
        self.client = send
        self.status = 0
        self.headers: Any = ()
        self.chunks: list[bytes] | None = []
        self.size = 0
        self.finished = False
        self.gone = False  # the client left: the app runs on to the end, unheard, so its response is stored
        self.unheard = asyncio.Event()

    def kept(self) -> bool:
        return self.chunks is not None and self.status not in self.mode.release_statuses

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            await self.start(message)
        elif kind == "http.response.body":
            await self.body(message)
        else:
            self.chunks = None  # trailers, pathsend, zero-copy: not a response this middleware can keep
            self.unheard.set()
        if self.gone:
            if not self.kept():
                # Not kept after all (grew past max_stored_body, trailers…): no one will read it, so the
                # app hears the disconnect the server reported, or an endless stream runs on.
                raise OSError("the client disconnected")
            return
        try:
            await self.client(message)
        except OSError:
            # ASGI 2.4: the client is gone. A response that is kept goes on to the store (a retry
            # replays it); one that is not has no reader left, so the app may stop.
            if not self.kept():
                raise
            self.gone = True
            log.debug("onceonly.server: the client of %s left; the response is still stored", self.ctx.store_key)
        if self.finished:
            self.unheard.set()

    async def start(self, message: Message) -> None:
        if self.status:
            await self.refuse("a second http.response.start")
        if not _is_status(message.get("status")):
            await self.refuse(f"http.response.start with status {message.get('status')!r}")
        self.status, self.headers = message["status"], message.get("headers", ())
        if self.status in self.mode.release_statuses:
            self.unheard.set()

    async def body(self, message: Message) -> None:
        if not self.status:
            await self.refuse("http.response.body before http.response.start")
        chunk = message.get("body", b"")
        if self.chunks is not None:
            self.size += len(chunk)
            if self.size > self.mode.max_stored_body:
                self.chunks = None
                self.unheard.set()
                log.warning(
                    "onceonly.server: the response to %s passes max_stored_body (%d bytes): "
                    "not stored, the key is released and a retry runs again",
                    self.ctx.store_key,
                    self.mode.max_stored_body,
                )
            else:
                self.chunks.append(chunk)
        if not message.get("more_body", False) and not self.finished:
            # Store (or release) before the client can see the end of the response.
            self.finished = True
            if self.chunks is None or self.status in self.mode.release_statuses:
                why = f"HTTP {self.status}" if self.chunks is not None else "response too large"
                await self.mode.release(self.held, why)
            else:
                stored = StoredResponse.build(
                    self.status, self.headers, b"".join(self.chunks), self.mode.replay_headers
                )
                await self.mode.complete(self.held, stored)

    async def refuse(self, what: str) -> None:
        """A response the server cannot send is no response to keep: release the key and fail the
        application here, so the server answers 500 (or drops the connection) and a retry runs."""
        self.unheard.set()
        if not self.finished:
            self.finished = True
            await self.mode.release(self.held, f"ASGI protocol error: {what}")
        raise RuntimeError(
            f"ASGI protocol error: the application sent {what}; IdempotencyMiddleware stored nothing "
            f"and released the key {self.ctx.key!r}"
        )


def _is_status(value: object) -> bool:
    """Whether an ``http.response.start`` status is one a server can send (100-599, an int)."""
    return type(value) is int and 100 <= value <= 599
