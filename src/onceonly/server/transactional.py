"""Transactional mode: the idempotency row and the business write commit in one SQL transaction.

A crash anywhere before the commit leaves neither, so a retry runs again safely; after the commit
both are there, so a retry replays. No window in between, which the store mode (a separate store
written around the handler) cannot promise for a handler whose write is not itself idempotent.

    with engine.begin() as conn:                       # or a Session, or a DB-API connection
        slot = table.begin(conn, key, fingerprint)     # raises Replay / KeyConflict / InProgress
        conn.execute(insert(tickets).values(...))      # the business write
        slot.complete(201, body, [("content-type", "application/json")])
    # committed together: the ticket and its stored response

Works with SQLAlchemy 2 (``Session``, ``Connection``) and plain DB-API connections (``sqlite3``,
``psycopg``); the SQL is portable between SQLite (3.24+) and PostgreSQL (``ON CONFLICT DO NOTHING``).

While a transaction holds a key, its row is not committed: a concurrent request with the same key
waits on the database's lock (SQLite's write lock, PostgreSQL's unique-index lock) and then sees the
completed row and replays it. A lock that times out is reported as ``InProgress`` (409).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from onceonly.errors import InProgress, KeyConflict, StoreCorrupt

from ._answers import Problems, send_all
from ._http import (
    ASGIApp,
    IdempotencyContext,
    Message,
    Receive,
    Replay,
    Scope,
    Send,
    StoredResponse,
    idempotency_context,
)
from ._status import KeyStatus

__all__ = ["IdempotencyTable", "Slot"]

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}(\.[A-Za-z_][A-Za-z0-9_]{0,62})?")
_PLACEHOLDER = re.compile(r":([a-z_]+)")
_SECRET_KEY = "onceonly:meta:client-secret"
Executor = Callable[[str, Mapping[str, Any]], tuple[int, list[Any]]]

log = logging.getLogger("onceonly.server")


class IdempotencyTable:
    """An idempotency table in the application's own SQL database.

    Args:
        name: the table name (optionally ``schema.table``).
        ttl: seconds a completed response is replayed; after that the key may run again (``None``:
            forever).
        clock: seconds since the epoch (injectable for tests).

    .. versionadded:: 0.1
    """

    def __init__(
        self, name: str = "onceonly_idempotency", *, ttl: float | None = 86400.0, clock: Callable[[], float] = time.time
    ) -> None:
        if not _IDENTIFIER.fullmatch(name):
            raise ValueError(f"table name {name!r}: use letters, digits and _ (optionally schema.table)")
        self.name = name
        self.ttl = ttl
        self.clock = clock
        t = name
        self._sql = {
            "create": (
                f"CREATE TABLE IF NOT EXISTS {t} (key VARCHAR(300) PRIMARY KEY, "
                "fingerprint VARCHAR(64) NOT NULL, "
                "status VARCHAR(16) NOT NULL, response TEXT, created_at DOUBLE PRECISION NOT NULL, "
                "expires_at DOUBLE PRECISION)"
            ),
            # A processing row expires too: a transaction that commits it without complete() (an early
            # return inside the block) must not hold the key forever. complete() sets the real expiry.
            "insert": (
                f"INSERT INTO {t} (key, fingerprint, status, created_at, expires_at) "
                "VALUES (:key, :fingerprint, 'processing', :now, :expires) "
                "ON CONFLICT (key) DO NOTHING"
            ),
            "select": f"SELECT fingerprint, status, response, expires_at FROM {t} WHERE key = :key",
            "select_status": (
                f"SELECT fingerprint, status, response, created_at, expires_at FROM {t} WHERE key = :key"
            ),
            "drop_expired": (f"DELETE FROM {t} WHERE key = :key AND expires_at IS NOT NULL AND expires_at <= :now"),
            "complete": (
                f"UPDATE {t} SET status = 'completed', response = :response, expires_at = :expires "
                "WHERE key = :key AND status = 'processing'"
            ),
            "purge": f"DELETE FROM {t} WHERE expires_at IS NOT NULL AND expires_at <= :now",
            # The client secret: a row that never expires, under a key no client key can take (theirs
            # are PREFIX:<32 hex digits>:...).
            "insert_secret": (
                f"INSERT INTO {t} (key, fingerprint, status, response, created_at, expires_at) "
                "VALUES (:key, 'client-secret', 'secret', :secret, :now, NULL) ON CONFLICT (key) DO NOTHING"
            ),
        }

    def create(self, tx: Any) -> None:
        """Create the table if it does not exist (commit it yourself where DDL is transactional)."""
        _executor(tx)(self._sql["create"], {})

    def client_secret(self, tx: Any) -> bytes:
        """The secret that keys the client hash (``IdempotencyMiddleware(client_secret=...)``), kept in
        this table: made on first use inside ``tx`` (commit it), then the same for every caller, so all
        server processes on the database agree. Whoever reads the table reads it: give the middleware
        a secret from your configuration instead to keep hashes opaque to database readers too.

        .. versionadded:: 0.1
        """
        run = _executor(tx)
        params = {"key": _SECRET_KEY, "secret": secrets.token_hex(32), "now": self.clock()}
        run(self._sql["insert_secret"], params)
        _, rows = run(self._sql["select"], params)
        found: bytes | None = None
        if rows and rows[0][1] == "secret":
            with contextlib.suppress(TypeError, ValueError):
                found = bytes.fromhex(rows[0][2])
        if found is None or len(found) < 16:
            raise StoreCorrupt(
                f"{self.name} holds no readable client secret under {_SECRET_KEY!r}: something else wrote that "
                "row. Delete it (a new secret is then made) or give the middleware a client_secret= of yours"
            )
        return found

    def begin(self, tx: Any, key: str, fingerprint: str) -> Slot:
        """Take ``key`` inside the caller's transaction ``tx``, before the business write.

        Returns a ``Slot``: call ``slot.complete(...)`` with the response before committing.

        Raises:
            Replay: the key was completed (committed) before: answer with ``exc.response``.
            KeyConflict: the key was used with another fingerprint: answer 422.
            InProgress: the key is held and the lock wait timed out (or, on PostgreSQL above READ
                COMMITTED, the holder committed after this transaction's snapshot), or a committed row
                of the key was never completed (until its ``ttl`` passes): answer 409.

        .. versionadded:: 0.1
        """
        run = _executor(tx)
        now = self.clock()
        expires = None if self.ttl is None else now + self.ttl
        params = {"key": key, "fingerprint": fingerprint, "now": now, "expires": expires}
        try:
            inserted, _ = run(self._sql["insert"], params)
            if inserted == 1:
                return Slot(self, run, key)
            _, rows = run(self._sql["select"], params)
            if rows and rows[0][3] is not None and rows[0][3] <= now:
                # Expired: the key is free again. Delete and take it, all in this transaction.
                run(self._sql["drop_expired"], params)
                inserted, _ = run(self._sql["insert"], params)
                if inserted == 1:
                    return Slot(self, run, key)
                _, rows = run(self._sql["select"], params)
        except Exception as exc:
            if _is_lock_timeout(exc):
                raise InProgress(
                    f"{key!r} is held by another transaction (the lock wait timed out, or it committed after "
                    "this transaction's snapshot): retry with the same key",
                    key=key,
                ) from exc
            raise
        if not rows:  # deleted between our insert and our read: a purge; let the client retry
            raise InProgress(f"{key!r} changed while it was read: retry with the same key", key=key)
        stored_fp, status, response, _ = rows[0]
        if stored_fp != fingerprint:
            raise KeyConflict(
                f"{key!r} was already used with another request (fingerprint {stored_fp[:12]}…): use a new key",
                key=key,
                record=None,
                fingerprint=fingerprint,
            )
        if status == "completed" and response is not None:
            raise Replay(key, StoredResponse.from_json(response))
        raise InProgress(
            f"{key!r} has a committed row that was never completed (the transaction committed without "
            "slot.complete(), or begin and complete ran in two transactions): it is treated as in progress "
            "until its ttl passes",
            key=key,
        )

    def begin_request(self, tx: Any, request: Any) -> Slot:
        """``begin`` with the key and fingerprint ``IdempotencyMiddleware(transactional=True)`` found.

        ``request`` is a Starlette/FastAPI request, an ASGI scope, or an ``IdempotencyContext``.

        .. versionadded:: 0.1
        """
        ctx = request if isinstance(request, IdempotencyContext) else idempotency_context(request)
        if ctx is None:
            raise LookupError(
                "this request has no idempotency context: add the middleware inside the application with "
                "app.add_middleware(IdempotencyMiddleware, transactional=True) (not wrapped around a "
                "Starlette/FastAPI app, whose error middleware would answer Replay with a 500) and make sure "
                "its methods include this request's"
            )
        return self.begin(tx, ctx.store_key, ctx.fingerprint)

    def get(self, tx: Any, key: str) -> StoredResponse | None:
        """The completed response of ``key``, or ``None`` (absent, in progress or expired)."""
        _, rows = _executor(tx)(self._sql["select"], {"key": key})
        if not rows:
            return None
        _, status, response, expires_at = rows[0]
        if status != "completed" or response is None or (expires_at is not None and expires_at <= self.clock()):
            return None
        return StoredResponse.from_json(response)

    def status(self, tx: Any, key: str) -> KeyStatus:
        """What a retry of ``key`` (a store key: ``IdempotencyContext.store_key``) meets, for the
        middleware's status endpoint (``status_lookup=``). Reads only committed rows: a transaction that
        holds the key now is not seen, and a retry then waits on its lock and replays what it commits.

        .. versionadded:: 0.1
        """
        _, rows = _executor(tx)(self._sql["select_status"], {"key": key})
        if not rows or rows[0][1] == "secret":
            return KeyStatus("no-record", "runs")
        _, status, response, created_at, expires_at = rows[0]
        if expires_at is not None and expires_at <= self.clock():
            return KeyStatus("expired", "runs", expires_at=expires_at)
        if status != "completed" or response is None:
            # Committed without complete(): begin() answers 409 until its ttl passes, and whether the
            # business write of that transaction happened is not recorded.
            return KeyStatus("unknown", "waits", expires_at=expires_at)
        try:
            code: int | None = StoredResponse.from_json(response).status
        except ValueError:
            return KeyStatus("unknown", "refused", stored_at=created_at)
        return KeyStatus("completed", "replays", code, stored_at=created_at, expires_at=expires_at)

    def purge(self, tx: Any, *, before: float | None = None) -> int:
        """Delete rows whose ``ttl`` passed (a row committed without ``complete()`` too); returns how many."""
        count, _ = _executor(tx)(self._sql["purge"], {"now": self.clock() if before is None else before})
        return max(count, 0)


class Slot:
    """A key taken inside a transaction, waiting for its response.

    .. versionadded:: 0.1
    """

    __slots__ = ("_run", "key", "table")

    def __init__(self, table: IdempotencyTable, run: Executor, key: str) -> None:
        self.table = table
        self._run = run
        self.key = key

    def complete(
        self,
        status: int,
        body: bytes | str,
        headers: Mapping[str, str] | Iterable[tuple[str, str]] = (),
        *,
        replay_headers: Iterable[str] | None = None,
    ) -> StoredResponse:
        """Store the response in the same transaction. Commit after this, then send the same response.

        Args:
            status: the HTTP status the handler answers.
            body: the response body (``str`` is encoded as UTF-8).
            headers: the response headers a replay repeats (``content-type``, ``location``…). All of
                them are kept (names lower-cased): pass no ``Set-Cookie`` or other per-response header.
            replay_headers: if given, only these header names are kept (``DEFAULT_REPLAY_HEADERS``:
                the store mode's list). The middleware's own ``replay_headers=`` does not apply here.
        """
        raw = body.encode("utf-8") if isinstance(body, str) else bytes(body)
        pairs = headers.items() if isinstance(headers, Mapping) else headers
        allow = None if replay_headers is None else {h.lower() for h in replay_headers}
        stored = StoredResponse.build(status, pairs, raw, allow)
        expires = None if self.table.ttl is None else self.table.clock() + self.table.ttl
        count, _ = self._run(
            self.table._sql["complete"], {"key": self.key, "response": stored.to_json(), "expires": expires}
        )
        if count != 1:
            raise RuntimeError(f"{self.key!r}: complete() found no row in progress; was begin() rolled back?")
        return stored


# --- running SQL on whatever the caller holds ---------------------------------------------------


def _executor(tx: Any) -> Executor:
    """A function ``(sql with :name placeholders, params) -> (rowcount, rows)`` for ``tx``."""
    sa = sys.modules.get("sqlalchemy")
    if sa is not None:
        from sqlalchemy.engine import Connection
        from sqlalchemy.orm import Session

        if isinstance(tx, Session | Connection):

            def run_sa(sql: str, params: Mapping[str, Any]) -> tuple[int, list[Any]]:
                result: Any = tx.execute(sa.text(sql), dict(params))
                rows = [tuple(r) for r in result.fetchall()] if result.returns_rows else []
                return int(result.rowcount), rows

            return run_sa
    if inspect.iscoroutinefunction(getattr(tx, "execute", None)) or inspect.iscoroutinefunction(
        getattr(tx, "cursor", None)
    ):
        raise TypeError(
            f"{type(tx).__name__} is an async connection: IdempotencyTable runs its SQL synchronously inside "
            "your transaction. Pass a sync one (sqlite3.Connection, psycopg.Connection, a SQLAlchemy "
            "Session or Connection), from a def handler or through asyncio.to_thread"
        )
    if not hasattr(tx, "cursor"):
        raise TypeError(f"{type(tx).__name__} is neither a SQLAlchemy Session/Connection nor a DB-API connection")
    module = sys.modules.get(type(tx).__module__.split(".")[0])
    style = getattr(module, "paramstyle", "qmark")

    def run_dbapi(sql: str, params: Mapping[str, Any]) -> tuple[int, list[Any]]:
        converted, args = _convert(sql, params, style)
        cur = tx.cursor()
        try:
            cur.execute(converted, args)
            rows = cur.fetchall() if cur.description else []
            return int(cur.rowcount), [tuple(r) for r in rows]
        finally:
            cur.close()

    return run_dbapi


def _convert(sql: str, params: Mapping[str, Any], style: str) -> tuple[str, Any]:
    """``:name`` placeholders → the driver's paramstyle (PEP 249)."""
    if style == "named":
        return sql, dict(params)
    if style == "pyformat":
        return _PLACEHOLDER.sub(r"%(\1)s", sql), dict(params)
    names = _PLACEHOLDER.findall(sql)
    args = [params[n] for n in names]
    if style == "format":
        return _PLACEHOLDER.sub("%s", sql), args
    if style == "numeric":
        counter = iter(range(1, len(names) + 1))
        return _PLACEHOLDER.sub(lambda _m: f":{next(counter)}", sql), args
    return _PLACEHOLDER.sub("?", sql), args


def _is_lock_timeout(exc: BaseException) -> bool:
    """A wait on the key's holder that gave up: SQLite's "database is locked", PostgreSQL's
    lock_timeout, and PostgreSQL's serialization failure (REPEATABLE READ, SERIALIZABLE: the holder
    committed after this transaction's snapshot was taken; a retry in a new transaction replays)."""
    orig = getattr(exc, "orig", None) or exc  # SQLAlchemy wraps the driver's error
    # Looked up, not imported: an error of sqlite3 exists only once the application loaded it.
    sqlite = sys.modules.get("sqlite3")
    if sqlite is not None and isinstance(orig, sqlite.OperationalError):
        msg = str(orig).lower()
        return "locked" in msg or "busy" in msg
    psycopg_errors = sys.modules.get("psycopg.errors")
    if psycopg_errors is not None:
        return isinstance(orig, psycopg_errors.LockNotAvailable | psycopg_errors.SerializationFailure)
    return False


# --- the middleware's side: turning the table's exceptions into responses -----------------------


async def serve(
    app: ASGIApp, scope: Scope, receive: Receive, send: Send, ctx: IdempotencyContext, problems: Problems
) -> None:
    """Run one request with a key (``ctx``) through ``app`` for ``IdempotencyMiddleware(transactional=True)``:
    the handler's ``Replay``, ``KeyConflict`` and ``InProgress`` become the replay, 422 and 409."""
    started = False

    async def watch(message: Message) -> None:
        nonlocal started
        if message["type"] == "http.response.start":
            started = True
        await send(message)

    try:
        await app(scope, receive, watch)
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
            await send_all(send, exc.response.messages(replayed=True))
        elif isinstance(exc, KeyConflict):
            await send_all(send, problems.conflict(scope, ctx, exc))
        else:
            await send_all(send, problems.in_flight(ctx))


def _unwrap(exc: BaseException) -> BaseException:
    """The one exception inside nested single-member exception groups (anyio task groups wrap)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
