"""``IdempotencyMiddleware``: the server side of the Idempotency-Key header, as pure ASGI.

It follows the IETF HTTP API draft "The Idempotency-Key HTTP Header Field" and Stripe's documented
behaviour. One request with a key, in the default (store) mode:

    parse key ──bad──▶ 400        read body, fingerprint, claim http:CLIENT:k:KEY in the store
       │ absent ─▶ 400                │
       ▼                              ├─ held by a live request ─────────────▶ 409 + Retry-After
    claim ──we hold it──▶ run app     ├─ other fingerprint ────────────────────▶ 422
                            │         └─ completed ────────────────────────────▶ replay, Idempotent-Replayed
                            ├─ 2xx-4xx, body ≤ limit ─▶ store (confirm) ─▶ then send the last chunk
                            └─ exception, 5xx, 408, 429, too big, no response ─▶ release (delete) the key

The response is stored *before* its last body chunk goes out, so a client that saw the complete
answer always finds it stored, and one whose answer was lost on the way finds it on retry.

In transactional mode (``transactional=True``) the middleware keeps no table: it parses, scopes and
fingerprints the key, and the application stores the response in its own database transaction with
``onceonly.server.IdempotencyTable`` (see ``transactional.py``).

This module parses the options and the request (key, client, fingerprint) and hands the request to
one of the two: ``_stored.py`` (claim, replay, capture, store or release, renewals; its store calls in
``_calls.py``) or ``transactional.serve``.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable
from typing import Literal

from onceonly.errors import StoreError
from onceonly.stores import open_store
from onceonly.stores.base import Store

from . import transactional
from ._answers import Problems, replaying, send_all
from ._calls import StoreCalls, resolve_store_calls
from ._http import (
    CONTEXT_KEY,
    DEFAULT_PROBLEM_DOCS,
    DEFAULT_REPLAY_HEADERS,
    ASGIApp,
    BadKey,
    ClientHasher,
    IdempotencyContext,
    Message,
    Receive,
    Scope,
    Send,
    authorization_identity,
    check_client_secret,
    check_problem_docs,
    fingerprint_start,
    request_key,
    store_key,
)
from ._status import DEFAULT_STATUS_PATH, KeyStatus, check_status_path, key_of, status_messages
from ._stored import StoredMode

__all__ = ["DEFAULT_RELEASE_STATUSES", "DEFAULT_STATUS_PATH", "IdempotencyMiddleware"]

#: Statuses after which the key is released instead of stored, so a retry runs again: every 5xx
#: (the handler failed), 408 and 429 (the request was refused before it ran).
DEFAULT_RELEASE_STATUSES: frozenset[int] = frozenset({408, 429, *range(500, 600)})


class _TooLarge(Exception):
    pass


class _Disconnected(Exception):
    pass


class IdempotencyMiddleware:
    """Make POST and PATCH requests with an ``Idempotency-Key`` run once, and replay their response.

    Args:
        app: the ASGI application (Starlette, FastAPI or any ASGI 3 app).
        store: where keys and responses are kept: an onceonly ``Store`` or a URL for
            ``onceonly.open_store`` (``sqlite:///…``, ``redis://…``, ``postgresql://…``). Not with
            ``transactional=True``.
        transactional: the application stores responses itself, in its own database transaction,
            with ``IdempotencyTable``; the middleware parses, scopes and fingerprints the key and
            turns ``Replay``, ``KeyConflict`` and ``InProgress`` from the handler into responses.
        methods: the methods that take a key; others pass through untouched.
        require_key: answer 400 to a request of those methods without a key. With ``False`` such a
            request runs as if there were no middleware.
        client_identity: ``scope -> str``: who is asking. Keys are scoped by its hash, so one client
            can never replay another's response. Default: the ``Authorization`` header.
        client_secret: the key of that hash (HMAC-SHA256; bytes or text, 16 bytes or more), the same
            in every server process, so that a stored or logged hash cannot be matched against
            guessed credentials. Store mode without it: made on first use and kept in the store (the
            record ``KEY_PREFIX:meta:client-secret``). Transactional mode needs it: keep one in your
            database with ``IdempotencyTable.client_secret(conn)``, or give one from your configuration.
        processing_timeout: seconds a claim holds. While the application runs, the claim is renewed
            every third of it, so only a server that stopped (crash, kill, lost store) lets a claim
            go stale; a retry after that runs the request again (see docs/server.md).
        ttl: seconds a completed response is replayed; after that the key is free again.
        max_stored_body: the largest response body kept (bytes). A larger response is passed
            through, not stored, and its key released: a retry runs again.
        max_request_body: the largest request body read for the fingerprint; larger → 413.
        replay_headers: response header names (lower case) a replay repeats.
        release_statuses: statuses after which the key is released instead of stored.
        retry_after: seconds sent in ``Retry-After`` with a 409 (and a 503 when the store is down): a
            whole number, 1 or more.
        key_prefix: the first part of every key in the store.
        problem_docs: the http(s) URL of the page that documents these rules for your clients: each
            problem the middleware answers has ``type`` ``problem_docs#name`` (``#missing-key``,
            ``#key-reused``…) and a ``Link: <…>; rel="describedby"`` header, as the Idempotency-Key
            draft asks. Default ``None``: ``urn:onceonly:problem:name`` types and no Link header
            (docs/server.md's "Problem types" is written to be published as that page).
        store_calls: how the event loop calls the store. ``"async"``: its async face (Redis,
            PostgreSQL; SQLite's runs each call in a worker thread). ``"thread"``: its sync face in a
            worker thread. ``"inline"``: for SQLite, its sync face on the loop through a connection
            that never waits for a lock: a call that finds the file locked by another connection
            (another process, an ``onceonly`` command) moves to a worker thread and waits there, so
            the loop never stops for a lock, while the usual call costs tens of microseconds instead
            of a thread hop's hundreds; for other stores, the sync call on the loop (which blocks it
            for the round trip). ``"auto"``: inline for SQLite (async with ``synchronous=full``,
            whose fsync per commit would hold the loop), else async if the store has an async face,
            else thread.
        status_path: serve ``GET {status_path}/{key}`` (``DEFAULT_STATUS_PATH`` is
            ``"/idempotency-keys"``): what the server knows of one key of the calling client, scoped
            like the guarded requests (another client's key is not found), without the stored body:
            ``state`` (``processing``, ``completed``, ``unknown``), the stored ``status``, ``stored_at``,
            ``expires_at`` and whether a retry is replayed; 404 problem+json when there is no record
            (a retry runs). Default ``None``: no endpoint. See docs/server.md, "The key status endpoint".
        status_lookup: transactional mode with ``status_path``: ``store_key -> KeyStatus``, a function
            (called in a worker thread) that opens a connection to the application's database and
            returns ``IdempotencyTable.status(conn, store_key)``.
        clock: seconds since the epoch (injectable for tests).

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        app: ASGIApp,
        store: Store | str | None = None,
        *,
        transactional: bool = False,
        methods: Iterable[str] = ("POST", "PATCH"),
        require_key: bool = True,
        client_identity: Callable[[Scope], str] = authorization_identity,
        client_secret: bytes | str | None = None,
        processing_timeout: float = 30.0,
        ttl: float = 86400.0,
        max_stored_body: int = 1 << 20,
        max_request_body: int = 10 << 20,
        replay_headers: Iterable[str] = DEFAULT_REPLAY_HEADERS,
        release_statuses: Iterable[int] = DEFAULT_RELEASE_STATUSES,
        retry_after: int = 1,
        key_prefix: str = "http",
        problem_docs: str | None = DEFAULT_PROBLEM_DOCS,
        store_calls: Literal["auto", "async", "thread", "inline"] = "auto",
        status_path: str | None = None,
        status_lookup: Callable[[str], KeyStatus] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if transactional == (store is not None):
            raise ValueError(
                "IdempotencyMiddleware needs either store= (a Store or a URL such as sqlite:///idem.db) "
                "or transactional=True (the application stores responses with IdempotencyTable), not both"
            )
        _check_seconds(processing_timeout, ttl, retry_after)
        docs = check_problem_docs(problem_docs)
        secret = None if client_secret is None else check_client_secret(client_secret)
        if transactional and secret is None:
            raise ValueError(
                "IdempotencyMiddleware(transactional=True) needs client_secret=: the key of the hash that scopes "
                "idempotency keys per client, the same in every server process. Keep one in your database with "
                "client_secret=IdempotencyTable.client_secret(conn), or give one from your configuration "
                "(16 bytes or more, such as secrets.token_hex(32))"
            )
        self.status_path = check_status_path(status_path)
        if transactional and self.status_path is not None and not callable(status_lookup):
            raise ValueError(
                "IdempotencyMiddleware(transactional=True, status_path=...) needs status_lookup=: a function "
                "store_key -> KeyStatus that opens a connection to your database and returns "
                "IdempotencyTable.status(conn, store_key) (see docs/server.md)"
            )
        if status_lookup is not None and not transactional:
            raise ValueError("status_lookup= is for transactional=True; the store mode reads its own store")
        self.status_lookup = status_lookup
        # The one test a request pays when the endpoint is off: ``_status_prefix is not None``.
        self._status_prefix = None if self.status_path is None else self.status_path + "/"
        self.app = app
        opened = open_store(store) if isinstance(store, str) else store
        self._owns_store = isinstance(store, str)
        self.store_calls = resolve_store_calls(opened, store_calls)
        self.transactional = transactional
        self.methods = frozenset(m.upper() for m in methods)
        self.require_key = require_key
        self.client_identity = client_identity
        # Store mode without client_secret=: read from the store on first use.
        self._hasher = None if secret is None else ClientHasher(secret)
        self.processing_timeout = float(processing_timeout)
        self.ttl = float(ttl)
        self.max_stored_body = int(max_stored_body)
        self.max_request_body = int(max_request_body)
        self.replay_headers = frozenset(h.lower() for h in replay_headers)
        self.release_statuses = frozenset(release_statuses)
        self.retry_after = int(retry_after)
        self.key_prefix = key_prefix
        self.problem_docs = docs
        self.clock = clock
        self._problems = Problems(docs, self.retry_after)
        self._stored: StoredMode | None = None
        if opened is not None:
            self._stored = StoredMode(
                app, StoreCalls(opened, self.store_calls), self._problems, key_prefix=key_prefix,
                processing_timeout=self.processing_timeout, ttl=self.ttl, max_stored_body=self.max_stored_body,
                replay_headers=self.replay_headers, release_statuses=self.release_statuses, clock=clock,
            )  # fmt: skip

    @property
    def store(self) -> Store | None:
        """The store of the store mode (``None`` in transactional mode, and once ``aclose`` closed a
        store the middleware opened from a URL)."""
        return None if self._stored is None else self._stored.calls.store

    # --- the ASGI entry point -------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" and self.store is not None:
            await self.app(scope, self._closing_at_shutdown(receive), send)
            return
        prefix = self._status_prefix
        if prefix is not None and scope["type"] == "http" and scope["path"].startswith(prefix):
            await self._answer_status(scope, receive, send, prefix)
            return
        # Without case: a server may pass "post", and an app may take it as POST (Django does).
        if scope["type"] != "http" or scope["method"].upper() not in self.methods:
            await self.app(scope, receive, send)
            return
        problem = self._problems.problem
        try:
            key = request_key(scope)
        except BadKey as exc:
            await send_all(send, problem(400, "Invalid Idempotency-Key", str(exc), slug="invalid-key"))
            return
        if key is None:
            if self.require_key:
                await send_all(
                    send,
                    problem(
                        400,
                        "Idempotency-Key is missing",
                        f"{scope['method']} {scope['path']} runs once per key: send an Idempotency-Key header "
                        "(a fresh UUID per operation, the same one on every retry of it)",
                        slug="missing-key",
                    ),
                )
                return
            await self.app(scope, receive, send)
            return
        try:
            body, digest = await self._read_body(scope, receive)
        except _TooLarge:
            await send_all(
                send,
                problem(
                    413,
                    "Request body too large",
                    f"the body passes {self.max_request_body} bytes, the most this server fingerprints",
                    slug="body-too-large",
                ),
            )
            return
        except _Disconnected:
            return  # the client left before sending its body: nothing was claimed, nothing to answer
        stored = self._stored
        hasher = self._hasher
        if hasher is None:
            assert stored is not None  # transactional mode always has a client secret
            try:
                hasher = self._hasher = await stored.client_hasher()
            except StoreError as exc:
                await send_all(send, self._problems.store_failed(exc, stored.secret_key, key))
                return
        client = hasher(self.client_identity(scope))
        ctx = IdempotencyContext(key, client, store_key(self.key_prefix, client, key), digest)
        scope[CONTEXT_KEY] = ctx
        if stored is None:
            await transactional.serve(self.app, scope, replaying(body, receive), send, ctx, self._problems)
        else:
            await stored.run(scope, body, receive, send, ctx)

    async def _answer_status(self, scope: Scope, receive: Receive, send: Send, prefix: str) -> None:
        """``GET {status_path}/{key}``: the status of the calling client's key. Reads, never writes."""
        problem = self._problems.problem
        if scope["method"].upper() != "GET":
            await send_all(
                send,
                problem(
                    405,
                    "Method not allowed",
                    f"{prefix}{{key}} answers GET only: it tells what the server knows of a key",
                    slug="status-method",
                    headers=[(b"allow", b"GET")],
                ),
            )
            return
        try:
            key = key_of(scope["path"], prefix)
        except BadKey as exc:
            await send_all(send, problem(400, "Invalid Idempotency-Key", str(exc), slug="invalid-key"))
            return
        stored = self._stored
        hasher = self._hasher
        try:
            if hasher is None:
                assert stored is not None  # transactional mode always has a client secret
                hasher = self._hasher = await stored.kept_client_hasher()
        except StoreError as exc:
            assert stored is not None
            await send_all(send, self._problems.store_failed(exc, stored.secret_key, key))
            return
        if hasher is None:  # no secret made yet: no key was ever stored
            await send_all(send, status_messages(key, KeyStatus("no-record", "runs"), self._problems))
            return
        where = store_key(self.key_prefix, hasher(self.client_identity(scope)), key)
        try:
            if stored is not None:
                found = await stored.status(where)
            else:
                assert self.status_lookup is not None
                found = await asyncio.to_thread(self.status_lookup, where)
        except StoreError as exc:
            await send_all(send, self._problems.store_failed(exc, where, key))
            return
        await send_all(send, status_messages(key, found, self._problems))

    async def _read_body(self, scope: Scope, receive: Receive) -> tuple[bytes, str]:
        digest = fingerprint_start(
            scope["method"].upper(), scope.get("root_path", "") + scope["path"], scope["query_string"]
        )
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > self.max_request_body:
                    raise _TooLarge
                digest.update(chunk)
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks), digest.hexdigest()

    # --- closing -------------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the store, if the middleware opened it from a URL (a ``Store`` you passed is yours),
        and the SQLite connections the middleware opened for itself (see ``store_calls``).

        Runs by itself at the application's lifespan shutdown, when the server sends lifespan events.
        """
        if self._stored is not None:
            await self._stored.calls.aclose(owned=self._owns_store)

    def _closing_at_shutdown(self, receive: Receive) -> Receive:
        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.aclose()
            return message

        return wrapped


def _check_seconds(processing_timeout: float, ttl: float, retry_after: int) -> None:
    if not (math.isfinite(processing_timeout) and processing_timeout > 0):
        raise ValueError(f"processing_timeout={processing_timeout}: give a positive number of seconds")
    if not (math.isfinite(ttl) and ttl > 0):
        raise ValueError(f"ttl={ttl}: give a positive number of seconds a completed response is replayed")
    if not isinstance(retry_after, int | float):
        raise TypeError(
            f"retry_after={retry_after!r}: Retry-After is a whole number of seconds, 1 or more: give an int"
        )
    if not (math.isfinite(retry_after) and retry_after >= 1 and int(retry_after) == retry_after):
        raise ValueError(f"retry_after={retry_after!r}: Retry-After is a whole number of seconds, 1 or more")
