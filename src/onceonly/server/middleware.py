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
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

from onceonly import states as st
from onceonly.errors import InProgress, KeyConflict, StoreCorrupt, StoreError, StoreUnavailable
from onceonly.events import key_conflict, short_key
from onceonly.keys import canonical_json
from onceonly.plan import landed
from onceonly.states import HELD, Record, State
from onceonly.stores import open_store
from onceonly.stores.base import AsyncStore, InlineStore, Store

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
    Replay,
    Scope,
    Send,
    StoredResponse,
    authorization_identity,
    check_client_secret,
    check_problem_docs,
    fingerprint_start,
    problem_messages,
    request_key,
    store_key,
)

__all__ = ["DEFAULT_RELEASE_STATUSES", "IdempotencyMiddleware"]

log = logging.getLogger("onceonly.server")

#: Statuses after which the key is released instead of stored, so a retry runs again: every 5xx
#: (the handler failed), 408 and 429 (the request was refused before it ran).
DEFAULT_RELEASE_STATUSES: frozenset[int] = frozenset({408, 429, *range(500, 600)})

_TOOL = "http"
#: Where the store mode keeps the client secret it made, after ``key_prefix:``.
_SECRET_KEY = "meta:client-secret"
#: Pauses between tries to store a response after the store failed the write (and the re-read shows
#: the claim still ours): about 0.8 s in all, enough for a blip, short enough to hold the last chunk.
_COMPLETE_DELAYS = (0.05, 0.2, 0.5)
_owner_counter = itertools.count(1)
_HOST = socket.gethostname()[:40]


class _Held:
    """A claim this process holds while the application runs; ``record`` is the latest version written."""

    __slots__ = ("beat", "done", "lock", "record", "timer")

    def __init__(self, record: Record) -> None:
        self.record = record
        self.lock = asyncio.Lock()
        self.done = False
        self.timer: asyncio.TimerHandle | None = None
        self.beat: asyncio.Task[None] | None = None


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
        clock: Callable[[], float] = time.time,
    ) -> None:
        if transactional == (store is not None):
            raise ValueError(
                "IdempotencyMiddleware needs either store= (a Store or a URL such as sqlite:///idem.db) "
                "or transactional=True (the application stores responses with IdempotencyTable), not both"
            )
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
        docs = check_problem_docs(problem_docs)
        secret = None if client_secret is None else check_client_secret(client_secret)
        if transactional and secret is None:
            raise ValueError(
                "IdempotencyMiddleware(transactional=True) needs client_secret=: the key of the hash that scopes "
                "idempotency keys per client, the same in every server process. Keep one in your database with "
                "client_secret=IdempotencyTable.client_secret(conn), or give one from your configuration "
                "(16 bytes or more, such as secrets.token_hex(32))"
            )
        self.app = app
        self.store: Store | None = open_store(store) if isinstance(store, str) else store
        self._owns_store = isinstance(store, str)
        if store_calls == "auto":
            if isinstance(self.store, InlineStore) and self.store.writes_inline():
                store_calls = "inline"  # without an fsync per commit, a write takes microseconds
            else:
                store_calls = "async" if isinstance(self.store, AsyncStore) else "thread"
        if store_calls not in ("async", "thread", "inline"):
            raise ValueError(f"store_calls={store_calls!r}: use 'auto', 'async', 'thread' or 'inline'")
        self.store_calls = store_calls
        self._nowait: Store | None = None  # see _nowait_store
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

    # --- the ASGI entry point -------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan" and self.store is not None:
            await self.app(scope, self._closing_at_shutdown(receive), send)
            return
        # Without case: a server may pass "post", and an app may take it as POST (Django does).
        if scope["type"] != "http" or scope["method"].upper() not in self.methods:
            await self.app(scope, receive, send)
            return
        try:
            key = request_key(scope)
        except BadKey as exc:
            await _send(send, self._problem(400, "Invalid Idempotency-Key", str(exc), slug="invalid-key"))
            return
        if key is None:
            if self.require_key:
                await _send(
                    send,
                    self._problem(
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
            await _send(
                send,
                self._problem(
                    413,
                    "Request body too large",
                    f"the body passes {self.max_request_body} bytes, the most this server fingerprints",
                    slug="body-too-large",
                ),
            )
            return
        except _Disconnected:
            return  # the client left before sending its body: nothing was claimed, nothing to answer
        hasher = self._hasher
        if hasher is None:
            try:
                hasher = await self._stored_secret()
            except StoreError as exc:
                await _send(send, self._store_failed(exc, f"{self.key_prefix}:{_SECRET_KEY}", key))
                return
        client = hasher(self.client_identity(scope))
        ctx = IdempotencyContext(key, client, store_key(self.key_prefix, client, key), digest)
        scope[CONTEXT_KEY] = ctx
        if self.transactional:
            await self._run_transactional(scope, _replaying(body, receive), send, ctx)
        else:
            await self._run_stored(scope, body, receive, send, ctx)

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

    # --- transactional mode: the application's transaction holds the key ------------------------

    async def _run_transactional(self, scope: Scope, receive: Receive, send: Send, ctx: IdempotencyContext) -> None:
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except BaseException as raised:
            exc = _unwrap(raised)
            if not isinstance(exc, Replay | KeyConflict | InProgress):
                raise
            if started:
                log.exception(
                    "onceonly.server: %s reached IdempotencyMiddleware after a response had started (an error "
                    "middleware answered it first?): add the middleware inside the application, with "
                    "app.add_middleware(IdempotencyMiddleware, transactional=True), not wrapped around it",
                    type(exc).__name__,
                )
                raise
            if isinstance(exc, Replay):
                await _send(send, exc.response.messages(replayed=True))
            elif isinstance(exc, KeyConflict):
                await _send(send, self._conflict(scope, ctx, exc))
            else:
                await _send(send, self._in_flight(ctx))

    # --- store mode: claim, run, store or release -------------------------------------------------

    async def _run_stored(
        self, scope: Scope, body: bytes, receive: Receive, send: Send, ctx: IdempotencyContext
    ) -> None:
        try:
            got = await self._claim(scope, ctx)
        except StoreError as exc:
            await _send(send, self._store_failed(exc, ctx.store_key, ctx.key))
            return
        if not isinstance(got, _Held):
            await _send(send, got)
            return
        held = got
        loop = asyncio.get_running_loop()
        held.timer = loop.call_later(self.processing_timeout / 3, self._start_beat, held)
        response = _Capture(self, held, ctx, send)
        # Every way out stores or releases the key, and both stop the renewal timer and beats first.
        try:
            await self.app(scope, _replaying(body, receive, until=response.unheard), response.send)
        except BaseException:
            if not response.finished:
                response.finished = True
                await self._release(held, "the application raised")
            raise
        finally:
            response.unheard.set()
        if not response.finished:
            await self._release(held, "the application returned without a complete response")

    async def _claim(self, scope: Scope, ctx: IdempotencyContext) -> _Held | tuple[Message, Message]:
        now = self.clock()
        owner = f"{_HOST}:{os.getpid()}:{next(_owner_counter)}"
        args_json = canonical_json(
            {"method": scope["method"].upper(), "path": scope["path"], "query": scope["query_string"].decode("latin-1")}
        )
        fresh = st.new_record(
            key=ctx.store_key,
            scope=f"{self.key_prefix}:{ctx.client}",
            tool=_TOOL,
            fingerprint=ctx.fingerprint,
            args_json=args_json,
            state=State.IN_FLIGHT,
            owner=owner,
            now=now,
            lease_seconds=self.processing_timeout,
            reason="request",
        )
        for _ in range(8):  # compare-and-set rounds; each lost round means another request moved the key
            current = await self._call("claim", fresh)
            if current is None:
                return _Held(fresh)
            now = self.clock()
            if current.state is State.CONFIRMED and current.is_expired(now):
                new = st.renew(
                    current, state=State.IN_FLIGHT, owner=owner, now=now, lease_seconds=self.processing_timeout,
                    reason="expired",
                )  # fmt: skip
            elif current.fingerprint != ctx.fingerprint:
                return self._conflict(scope, ctx)
            elif current.state is State.CONFIRMED:
                try:
                    return StoredResponse.from_json(current.result_json or "").messages(replayed=True)
                except ValueError:
                    log.exception("onceonly.server: %s holds no readable response", ctx.store_key)
                    return self._unreadable(
                        ctx.key, "completed", "this key was completed but its stored response cannot be read"
                    )
            elif current.state in HELD and not current.lease_expired(now):
                return self._in_flight(ctx)
            elif current.state in (State.IN_FLIGHT, State.PENDING, State.FAILED, State.UNKNOWN):
                if current.state in HELD:
                    log.warning(
                        "onceonly.server: %s was held by %s whose claim went stale (the server stopped?): "
                        "running the request again",
                        ctx.store_key,
                        current.lease_owner,
                    )
                new = st.claim_again(
                    current,
                    state=State.IN_FLIGHT,
                    owner=owner,
                    now=now,
                    lease_seconds=self.processing_timeout,
                    reason="stale or released: claimed again",
                )
            else:
                # needs_review / abandoned: only a person puts an http key there; never run it blindly.
                return self._in_flight(ctx)
            new = st.replace_args(new, fingerprint=ctx.fingerprint, args_json=args_json)
            if await self._call("swap", new, current):
                return _Held(new)
        return self._in_flight(ctx)

    async def _stored_secret(self) -> ClientHasher:
        """The client secret kept in the store, made on first use: one conditional write, so that
        servers starting together keep the first one written and all hash clients alike."""
        key = f"{self.key_prefix}:{_SECRET_KEY}"
        now = self.clock()
        owner = f"{_HOST}:{os.getpid()}:{next(_owner_counter)}"
        made = st.new_record(
            key=key, scope=f"{self.key_prefix}:meta", tool=_TOOL, fingerprint=st.SECRET_FINGERPRINT, args_json="{}",
            state=State.IN_FLIGHT, owner=owner, now=now, lease_seconds=0.0, reason="client secret",
        )  # fmt: skip
        made = st.confirm(
            made, result_json=json.dumps({"client_secret": secrets.token_hex(32)}), now=now, ttl=None,
            via="made", by=owner,
        )  # fmt: skip
        kept = await self._call("claim", made) or made
        try:
            secret = check_client_secret(bytes.fromhex(json.loads(kept.result_json or "")["client_secret"]))
        except (ValueError, TypeError, KeyError) as exc:
            raise StoreCorrupt(
                f"{key} holds no client secret of IdempotencyMiddleware ({exc}): it was written by something "
                "else. Nothing was changed: delete that record (a new secret is then made) or pass client_secret="
            ) from exc
        hasher = self._hasher = ClientHasher(secret)
        return hasher

    async def _complete(self, held: _Held, stored: StoredResponse) -> None:
        await self._stop_beats(held)
        rec = held.record
        result_json = stored.to_json()
        # One write per version of the claim, sent again as is: an earlier try that landed unseen
        # (its answer and the read after it lost) is then exactly the record ``landed`` looks for.
        new = st.confirm(rec, result_json=result_json, now=self.clock(), ttl=self.ttl, via="run", by=rec.lease_owner)
        for pause in (*_COMPLETE_DELAYS, None):
            try:
                ok, current = await self._swap_now(new, rec)
            except StoreError:  # the write failed and so did the read after it
                current = rec
                if pause is None:
                    log.exception(
                        "onceonly.server: could not store the response of %s: its claim will go stale after "
                        "%.0f s and a retry will run the request again",
                        rec.key,
                        self.processing_timeout,
                    )
                    return
            else:
                if ok:
                    held.record = new
                    return
                if landed(new, current):
                    held.record = new  # an earlier try landed unseen: this one was refused by it
                    return
                if not _is_ours(current, rec):
                    log.warning(
                        "onceonly.server: the claim on %s was taken over while the request ran (it ran longer "
                        "than processing_timeout without renewal): the request may have run twice",
                        rec.key,
                    )
                    return
                if pause is None:
                    log.error(
                        "onceonly.server: the store kept refusing the response of %s: its claim will go stale "
                        "after %.0f s and a retry will run the request again",
                        rec.key,
                        self.processing_timeout,
                    )
                    return
            assert current is not None
            if current.version != rec.version:
                rec = held.record = current  # a renewal of ours landed unseen: write over it at once
                new = st.confirm(
                    rec, result_json=result_json, now=self.clock(), ttl=self.ttl, via="run", by=rec.lease_owner
                )
                continue
            await asyncio.sleep(pause)  # the write did not land: give the store a moment

    async def _release(self, held: _Held, why: str) -> None:
        await self._stop_beats(held)
        rec = held.record
        try:
            released = await self._call("delete", rec.key, rec.version)
            if not released:
                # A renewal of ours may have landed unseen: release the version that is there.
                current = await self._call("get", rec.key)
                if _is_ours(current, rec):
                    released = await self._call("delete", rec.key, current.version)
        except StoreError:
            log.exception(
                "onceonly.server: could not release %s after %s: retries get 409 until the claim goes stale (%.0f s)",
                rec.key,
                why,
                self.processing_timeout,
            )
            return
        if released:
            log.debug("onceonly.server: released %s: %s", rec.key, why)

    # --- renewing a claim while the application runs ----------------------------------------------

    def _start_beat(self, held: _Held) -> None:
        if not held.done:
            held.beat = asyncio.ensure_future(self._beat(held))

    async def _beat(self, held: _Held) -> None:
        pause = self.processing_timeout / 3
        while True:
            wait = pause
            async with held.lock:
                if held.done:
                    return
                rec = held.record
                new = st.extend_lease(rec, now=self.clock(), lease_seconds=self.processing_timeout)
                try:
                    ok, current = await self._swap_now(new, rec)
                except StoreError as exc:
                    log.warning("onceonly.server: could not renew the claim on %s: %s", rec.key, exc)
                else:
                    if ok:
                        held.record = new
                    elif _is_ours(current, rec):
                        # An earlier renewal landed unseen, or this one was refused: go on from the
                        # version that is there, and renew it now rather than at the next beat.
                        assert current is not None
                        wait = 0.0 if current.version != rec.version else min(pause, 0.5)
                        held.record = current
                    else:
                        log.warning("onceonly.server: the claim on %s was taken over by another request", rec.key)
                        return
            await asyncio.sleep(wait)

    async def _stop_beats(self, held: _Held) -> None:
        if held.timer is not None:
            held.timer.cancel()
        # The lock waits for a renewal that is writing right now, so its new version is the one we use.
        async with held.lock:
            held.done = True
        if held.beat is not None:
            held.beat.cancel()

    # --- closing -------------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the store, if the middleware opened it from a URL (a ``Store`` you passed is yours),
        and the SQLite connections the middleware opened for itself (see ``store_calls``).

        Runs by itself at the application's lifespan shutdown, when the server sends lifespan events.
        """
        nowait, self._nowait = self._nowait, None
        if nowait is not None:
            nowait.close()
        if not self._owns_store or self.store is None:
            return
        store, self.store = self.store, None
        closer = getattr(store, "aclose", None)
        if closer is not None:
            await closer()  # the async face's connections belong to this loop: close them on it
        store.close()

    def _closing_at_shutdown(self, receive: Receive) -> Receive:
        async def wrapped() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await self.aclose()
            return message

        return wrapped

    # --- helpers ------------------------------------------------------------------------------------

    async def _call(self, op: str, *args: Any) -> Any:
        store = self.store
        assert store is not None
        if self.store_calls == "inline":
            if not isinstance(store, InlineStore):
                return getattr(store, op)(*args)
            try:
                return getattr(self._nowait_store(store), op)(*args)
            except StoreUnavailable as exc:
                if not store.is_busy(exc):
                    raise
            # Another connection holds the write lock: wait for it in a worker thread (up to the store's
            # busy timeout), never on the loop. A refused statement wrote nothing: safe to redo.
            return await asyncio.to_thread(getattr(store, op), *args)
        if self.store_calls == "async":
            return await getattr(store, "a" + op)(*args)
        return await asyncio.to_thread(getattr(store, op), *args)

    def _nowait_store(self, store: InlineStore) -> Any:
        """The same store through connections that never wait on a lock, for calls on the loop: a lock
        held elsewhere fails such a call at once instead of stopping the loop. A store that was closed
        is returned as it is, so that its calls say so."""
        if store.closed:
            return store
        if self._nowait is None:
            self._nowait = store.nowait()
        return self._nowait

    async def _swap_now(self, new: Record, old: Record) -> tuple[bool, Record | None]:
        """``onceonly.ledger.swap_now`` through ``_call``: on a failed write, re-read; it landed exactly
        when the stored record is the one written. Returns (written, the record as it now is)."""
        try:
            ok = await self._call("swap", new, old)
        except StoreError:
            current = await self._call("get", new.key)
            return landed(new, current), current
        return (True, new) if ok else (False, await self._call("get", new.key))

    def _problem(
        self,
        status: int,
        title: str,
        detail: str,
        *,
        slug: str,
        headers: Sequence[tuple[bytes, bytes]] = (),
        extra: dict[str, Any] | None = None,
    ) -> tuple[Message, Message]:
        return problem_messages(status, title, detail, slug=slug, headers=headers, extra=extra, docs=self.problem_docs)

    def _conflict(
        self, scope: Scope, ctx: IdempotencyContext, exc: KeyConflict | None = None
    ) -> tuple[Message, Message]:
        # The alert names the request by route and a hash of the client's key (which may hold anything
        # the client chose); never the body, the query or the client's identity.
        key_conflict(
            exc,
            f"{scope['method'].upper()} {scope['path']}: an Idempotency-Key was reused with another request (422)",
            source="server",
            key=short_key(ctx.key),
            tool=_TOOL,
            route=f"{scope['method'].upper()} {scope['path']}",
            client=ctx.client[:12],
        )
        return self._problem(
            422,
            "Idempotency-Key reused",
            "this key was already used with another request (method, path, query or body differ): "
            "use a new key for a new operation",
            slug="key-reused",
            extra={"key": ctx.key},
        )

    def _store_failed(self, exc: StoreError, where: str, key: str) -> tuple[Message, Message]:
        if isinstance(exc, StoreCorrupt):
            # Not an outage to wait out: a Retry-After would make clients retry for ever.
            log.exception("onceonly.server: the record %s cannot be read", where)
            return self._unreadable(key, "unreadable", "the server's record of this key cannot be read")
        log.exception("onceonly.server: the idempotency store failed on %s", where)
        return self._problem(
            503,
            "Idempotency store unavailable",
            "the server could not record the key, so the request was not run: retry later with the same key",
            slug="store-unavailable",
            headers=[(b"retry-after", str(self.retry_after).encode())],
        )

    def _unreadable(self, key: str, state: str, what: str) -> tuple[Message, Message]:
        return self._problem(
            500,
            "Idempotency record unreadable",
            f"{what}, so the request was not run (again): a retry gets this answer until the server's "
            "operator repairs or removes the record",
            slug="record-unreadable",
            extra={"key": key, "state": state},
        )

    def _in_flight(self, ctx: IdempotencyContext) -> tuple[Message, Message]:
        return self._problem(
            409,
            "Request in progress",
            "a request with this key is still being processed: retry after Retry-After seconds with the same key",
            slug="in-progress",
            headers=[(b"retry-after", str(self.retry_after).encode())],
            extra={"key": ctx.key},
        )


class _Capture:
    """The application's response to one guarded request, passed on to the client and kept: stored
    (or the key released) before the client can see its end.

    A client that leaves must not stop a response this middleware will store: the app would return
    without one, the key would be released and the retry would run the handler again. So
    ``http.disconnect`` reaches the app (``unheard``) only once the response is complete or will not
    be kept.
    """

    def __init__(self, mw: IdempotencyMiddleware, held: _Held, ctx: IdempotencyContext, send: Send) -> None:
        self.mw = mw
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
        return self.chunks is not None and self.status not in self.mw.release_statuses

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
        if self.status in self.mw.release_statuses:
            self.unheard.set()

    async def body(self, message: Message) -> None:
        if not self.status:
            await self.refuse("http.response.body before http.response.start")
        chunk = message.get("body", b"")
        if self.chunks is not None:
            self.size += len(chunk)
            if self.size > self.mw.max_stored_body:
                self.chunks = None
                self.unheard.set()
                log.warning(
                    "onceonly.server: the response to %s passes max_stored_body (%d bytes): "
                    "not stored, the key is released and a retry runs again",
                    self.ctx.store_key,
                    self.mw.max_stored_body,
                )
            else:
                self.chunks.append(chunk)
        if not message.get("more_body", False) and not self.finished:
            # Store (or release) before the client can see the end of the response.
            self.finished = True
            if self.chunks is None or self.status in self.mw.release_statuses:
                why = f"HTTP {self.status}" if self.chunks is not None else "response too large"
                await self.mw._release(self.held, why)
            else:
                stored = StoredResponse.build(self.status, self.headers, b"".join(self.chunks), self.mw.replay_headers)
                await self.mw._complete(self.held, stored)

    async def refuse(self, what: str) -> None:
        """A response the server cannot send is no response to keep: release the key and fail the
        application here, so the server answers 500 (or drops the connection) and a retry runs."""
        self.unheard.set()
        if not self.finished:
            self.finished = True
            await self.mw._release(self.held, f"ASGI protocol error: {what}")
        raise RuntimeError(
            f"ASGI protocol error: the application sent {what}; IdempotencyMiddleware stored nothing "
            f"and released the key {self.ctx.key!r}"
        )


def _is_status(value: object) -> bool:
    """Whether an ``http.response.start`` status is one a server can send (100-599, an int)."""
    return type(value) is int and 100 <= value <= 599


def _is_ours(current: Record | None, held: Record) -> bool:
    """Whether the stored record is still the claim ``held`` made (its owner token is unique to it)."""
    return (
        current is not None
        and current.state is State.IN_FLIGHT
        and current.lease_owner == held.lease_owner
        and current.fence == held.fence
    )


def _replaying(body: bytes, receive: Receive, until: asyncio.Event | None = None) -> Receive:
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


async def _send(send: Send, messages: tuple[Message, Message]) -> None:
    for message in messages:
        await send(message)


def _unwrap(exc: BaseException) -> BaseException:
    """The one exception inside nested single-member exception groups (anyio task groups wrap)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
