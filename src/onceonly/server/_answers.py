"""What ``IdempotencyMiddleware`` answers in both of its modes: problem details (RFC 9457) with the
documentation link and ``Retry-After`` it was configured with, and the ASGI plumbing around them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from onceonly.errors import KeyConflict, StoreCorrupt, StoreError
from onceonly.events import key_conflict, short_key

from ._http import IdempotencyContext, Message, Receive, Scope, Send, problem_messages

__all__ = ["TOOL", "Problems", "replaying", "send_all"]

log = logging.getLogger("onceonly.server")

#: The tool name of the middleware's records and alerts.
TOOL = "http"


class Problems:
    """The problem responses of one middleware: ``docs`` is its ``problem_docs``, ``retry_after`` the
    seconds a 409 or 503 tells the client to wait."""

    __slots__ = ("docs", "retry_after")

    def __init__(self, docs: str | None, retry_after: int) -> None:
        self.docs = docs
        self.retry_after = retry_after

    def problem(
        self,
        status: int,
        title: str,
        detail: str,
        *,
        slug: str,
        headers: Sequence[tuple[bytes, bytes]] = (),
        extra: dict[str, Any] | None = None,
    ) -> tuple[Message, Message]:
        return problem_messages(status, title, detail, slug=slug, headers=headers, extra=extra, docs=self.docs)

    def conflict(
        self, scope: Scope, ctx: IdempotencyContext, exc: KeyConflict | None = None
    ) -> tuple[Message, Message]:
        # The alert names the request by route and a hash of the client's key (which may hold anything
        # the client chose); never the body, the query or the client's identity.
        key_conflict(
            exc,
            f"{scope['method'].upper()} {scope['path']}: an Idempotency-Key was reused with another request (422)",
            source="server",
            key=short_key(ctx.key),
            tool=TOOL,
            route=f"{scope['method'].upper()} {scope['path']}",
            client=ctx.client[:12],
        )
        return self.problem(
            422,
            "Idempotency-Key reused",
            "this key was already used with another request (method, path, query or body differ): "
            "use a new key for a new operation",
            slug="key-reused",
            extra={"key": ctx.key},
        )

    def store_failed(self, exc: StoreError, where: str, key: str) -> tuple[Message, Message]:
        if isinstance(exc, StoreCorrupt):
            # Not an outage to wait out: a Retry-After would make clients retry for ever.
            log.exception("onceonly.server: the record %s cannot be read", where)
            return self.unreadable(key, "unreadable", "the server's record of this key cannot be read")
        log.exception("onceonly.server: the idempotency store failed on %s", where)
        return self.problem(
            503,
            "Idempotency store unavailable",
            "the server could not record the key, so the request was not run: retry later with the same key",
            slug="store-unavailable",
            headers=[(b"retry-after", str(self.retry_after).encode())],
        )

    def unreadable(self, key: str, state: str, what: str) -> tuple[Message, Message]:
        return self.problem(
            500,
            "Idempotency record unreadable",
            f"{what}, so the request was not run (again): a retry gets this answer until the server's "
            "operator repairs or removes the record",
            slug="record-unreadable",
            extra={"key": key, "state": state},
        )

    def in_flight(self, ctx: IdempotencyContext) -> tuple[Message, Message]:
        return self.problem(
            409,
            "Request in progress",
            "a request with this key is still being processed: retry after Retry-After seconds with the same key",
            slug="in-progress",
            headers=[(b"retry-after", str(self.retry_after).encode())],
            extra={"key": ctx.key},
        )


async def send_all(send: Send, messages: tuple[Message, Message]) -> None:
    for message in messages:
        await send(message)


def replaying(body: bytes, receive: Receive, until: asyncio.Event | None = None) -> Receive:
    """A ``receive`` that gives the application the body already read, then the real channel (once
    ``until`` is set, when given)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if until is not None:
            await until.wait()
        return await receive()

    return replay
