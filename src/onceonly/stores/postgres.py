"""The PostgreSQL store: the durable choice for many hosts (psycopg 3 with ``psycopg_pool``).

One table, ``onceonly_records``, in the schema named by ``?schema=`` (default ``public``). Every
write is one autocommitted statement, so every transition is one transaction:

- claim: ``INSERT … ON CONFLICT (key) DO NOTHING``; only when it inserted nothing does a second
  statement read the stored row. A first call is then the floor's two writes (claim, settle) and no
  read; a replay costs two round trips;
- swap: ``UPDATE … WHERE key = $1 AND version = $2 AND created_at = $3``, writing only the columns
  that changed (``created_at`` tells a record lost and made again from the one the caller read);
- delete: ``DELETE … WHERE key = $1 AND version = $2`` (``AND created_at = $3`` when given).

The schema is created on first use under an advisory lock (many processes may start at once) and
carries a version table, ``onceonly_schema``, so a later release can migrate it; a schema newer than
this code, or tables of the same name that onceonly did not make, are refused with ``StoreCorrupt``
and left untouched.

Waiting without spinning: a waiter marks the row ``watched`` (an UPDATE that also checks the version
it read), and a trigger sends a NOTIFY only when a watched row changes. So the hot path (claim, settle)
never notifies unless someone waits on that very key: NOTIFY takes a database-wide lock at commit that
would otherwise serialise every settle. One LISTEN connection per store, in a daemon thread, wakes the
waiters of both faces; when it cannot listen, waiting falls back to polling.

The sync face uses a ``psycopg_pool.ConnectionPool``; the async face keeps its own idle connections
per event loop, made on first use in that loop (``_LoopConnections`` says why not an async pool).
docs/postgres.md has the URL options, the indexes and what they cost, and the measured figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.metadata
import logging
import operator
import os
import re
import select
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from itertools import compress
from typing import Any, Literal, TypeVar
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from onceonly.errors import StoreCorrupt, StoreError, StoreUnavailable
from onceonly.similar import Candidate
from onceonly.states import UNSETTLED, Record, State
from onceonly.stores import _pgwire as wire
from onceonly.stores._sql import (
    COLUMN_OF,
    COLUMNS,
    SWAP_FIELDS,
    counts_by_state,
    row_to_record,
    scan_sql,
    state_literals,
    swap_fields,
)
from onceonly.stores._url import redact_url, scrub
from onceonly.stores.base import Query

__all__ = ["SCHEMA_VERSION", "PostgresOptions", "PostgresStore", "parse_postgres_url"]

T = TypeVar("T")
_log = logging.getLogger("onceonly.stores.postgres")

#: The version of the tables this code writes; ``_migrations`` brings older ones up to it.
SCHEMA_VERSION = 1

_SCHEMES = ("postgres", "postgresql", "postgresql+psycopg")
_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
# Quoted in SQL, so any case is kept; limited to characters that need no escaping anywhere (psycopg
# reads % in a statement as a placeholder).
_SCHEMA_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")

# The states the open-records index holds, in the enum's order: the index's text stays the same
# from one run to the next (a frozenset's order may not).
_OPEN_STATES = tuple(s for s in State if s in UNSETTLED)
_SWAP_COLUMNS = tuple(COLUMN_OF.get(f, f) for f in SWAP_FIELDS)
_FIELD_AT = {f: i for i, f in enumerate(Record.__dataclass_fields__)}
_SWAP_TYPES = tuple(wire.COLUMN_TYPES[_FIELD_AT[f]] for f in SWAP_FIELDS)
_SWAP_ENCODERS = tuple(wire.FIELD_ENCODERS[_FIELD_AT[f]] for f in SWAP_FIELDS)
_ALL, _COUNT = 1, 2  # what _run returns of a statement: all its rows, or its row count
# A record's values in COLUMNS order (similar_claim inserts through psycopg's cursor, not _pgwire).
_record_values = operator.attrgetter(*Record.__dataclass_fields__)


def _installed_version() -> str:
    """This onceonly's version, for the schema's ``installed_by``: read from the installed package's
    metadata, not from ``onceonly/__init__.py``, which sits layers above the stores (docs/design.md#layers)."""
    try:
        return importlib.metadata.version("onceonly")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _channel(schema: str) -> str:
    """The NOTIFY channel of a schema's ledger; at most 63 bytes, PostgreSQL's limit."""
    name = f"onceonly.{schema}"
    if len(name) <= 63:
        return name
    return "onceonly." + hashlib.sha256(schema.encode()).hexdigest()[:40]


def _migrations(schema: str) -> dict[int, list[str]]:
    """version reached → the statements that reach it from the one before."""
    s = _ident(schema)
    t = f"{s}.onceonly_records"
    channel = _text(_channel(schema))
    v1 = [
        f"""CREATE TABLE {s}.onceonly_schema (
            version      integer PRIMARY KEY,
            installed_at timestamptz NOT NULL DEFAULT now(),
            installed_by text NOT NULL
        )""",
        # Times are epoch seconds in double precision, as in the Record: they round-trip exactly.
        # JSON is kept as text: the Record holds the exact text, and jsonb would reformat it.
        # key COLLATE "C": byte order, which is code point order in UTF-8, as Python sorts keys.
        f"""CREATE TABLE {t} (
            key             text COLLATE "C" PRIMARY KEY,
            scope           text NOT NULL,
            tool            text NOT NULL,
            fingerprint     text NOT NULL,
            state           text NOT NULL CHECK (state IN ({state_literals(list(State))})),
            attempts        integer NOT NULL,
            fence           bigint NOT NULL,
            version         bigint NOT NULL,
            lease_owner     text,
            lease_until     double precision,
            next_attempt_at double precision,
            expires_at      double precision,
            created_at      double precision NOT NULL,
            updated_at      double precision NOT NULL,
            result          text,
            error           text,
            args            text NOT NULL,
            history         text NOT NULL,
            via             text,
            conflicts       integer NOT NULL DEFAULT 0,
            watched         boolean NOT NULL DEFAULT false
        )""",
        # The reconciler's query (unknown, or held with an expired lease), in key order. Small: it
        # holds only the records that are open now. Purge's query: expired settled records.
        f"CREATE INDEX onceonly_records_open ON {t} (key) WHERE state IN ({state_literals(_OPEN_STATES)})",
        f"CREATE INDEX onceonly_records_expires ON {t} (expires_at) WHERE expires_at IS NOT NULL",
        # The payload is "<version> <key>" (version 0: deleted); waiters ignore a version they know.
        f"""CREATE FUNCTION {s}.onceonly_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_OP = 'DELETE' THEN
                PERFORM pg_notify(TG_ARGV[0], '0 ' || OLD.key);
            ELSE
                PERFORM pg_notify(TG_ARGV[0], NEW.version::text || ' ' || NEW.key);
            END IF;
            RETURN NULL;
        END
        $$""",
        f"""CREATE TRIGGER onceonly_records_changed AFTER UPDATE ON {t} FOR EACH ROW
            WHEN (OLD.watched AND NEW.version <> OLD.version)
            EXECUTE FUNCTION {s}.onceonly_notify({channel})""",
        f"""CREATE TRIGGER onceonly_records_deleted AFTER DELETE ON {t} FOR EACH ROW
            WHEN (OLD.watched) EXECUTE FUNCTION {s}.onceonly_notify({channel})""",
    ]
    return {1: v1}


# --- the URL -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PostgresOptions:
    """onceonly's own options of a PostgreSQL URL, and the connection string left for libpq.

    Args:
        conninfo: the URL without onceonly's options, as handed to psycopg.
        schema: the schema that holds the ledger's tables (created if missing).
        pool_min_size: connections the sync pool keeps open.
        pool_max_size: connections each pool may open.
        pool_timeout: seconds to wait for a connection before ``StoreUnavailable``.
        listen: wake waiters by LISTEN/NOTIFY (``False``: poll, e.g. behind a transaction pooler).
        warn_durability: log a warning at open when the server may lose acknowledged commits
            (``synchronous_commit=off``, ``fsync=off``).
        require_durability: refuse to open on such a server instead (``StoreError``).
        statement_timeout: PostgreSQL's ``statement_timeout`` for every statement of the store
            (``"5s"``, ``"500ms"``), set with ``SET LOCAL`` in the statement's own transaction, so that
            it works through a transaction pooler; ``None``: the server's.
        prepare: prepare the hot statements once per connection (``False``: send them unnamed, for
            a transaction pooler without prepared-statement support, PgBouncer before 1.21).

    .. versionadded:: 0.1
    .. versionchanged:: 0.2 ``warn_durability``, ``require_durability``, ``statement_timeout``, ``prepare``.
    """

    conninfo: str
    schema: str = "public"
    pool_min_size: int = 1
    pool_max_size: int = 10
    pool_timeout: float = 10.0
    listen: bool = True
    warn_durability: bool = True
    require_durability: bool = False
    statement_timeout: str | None = None
    prepare: bool = True


_OPTIONS = frozenset(
    {
        "schema",
        "pool_min_size",
        "pool_max_size",
        "pool_timeout",
        "listen",
        "warn_durability",
        "require_durability",
        "statement_timeout",
        "prepare",
    }
)
_FLAGS = (("listen", True), ("warn_durability", True), ("require_durability", False), ("prepare", True))
# PostgreSQL's own syntax for a time setting (a bare number is milliseconds): nothing else reaches SET.
_TIMEOUT = re.compile(r"\d{1,9}(\.\d{1,6})?\s?(us|ms|s|min|h|d)?")
# libpq defaults that suit a ledger: fail fast when the server is unreachable, and be recognisable
# in pg_stat_activity. Both can be overridden in the URL.
_LIBPQ_DEFAULTS = (("connect_timeout", "5"), ("application_name", "onceonly"))


def parse_postgres_url(url: str) -> PostgresOptions:
    """Split ``postgresql://…?schema=…&pool_max_size=…`` into onceonly's options and libpq's URL.

    Raises:
        ValueError: not a PostgreSQL URL, or an option with a bad value.

    .. versionadded:: 0.1
    """
    parts = urlsplit(url)
    if parts.scheme.lower() not in _SCHEMES:
        raise ValueError(f"not a PostgreSQL URL: {redact_url(url)!r} (use postgresql://host/dbname)")
    ours: dict[str, str] = {}
    rest: list[tuple[str, str]] = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name.lower() in _OPTIONS:
            ours[name.lower()] = value
        else:
            rest.append((name, value))
    given = {name for name, _ in rest}
    rest += [(name, value) for name, value in _LIBPQ_DEFAULTS if name not in given]
    # The hot statements send text as UTF-8 bytes (stores/_pgwire.py): the connections speak UTF-8,
    # whatever the database's encoding (the server converts).
    rest = [(name, value) for name, value in rest if name.lower() != "client_encoding"]
    rest.append(("client_encoding", "UTF8"))
    # quote, not quote_plus: libpq decodes %20 but leaves "+" as it is.
    conninfo = urlunsplit(("postgresql", parts.netloc, parts.path, urlencode(rest, quote_via=quote), ""))
    try:
        conninfo_to_dict(conninfo)
    except psycopg.Error as exc:
        raise ValueError(f"{redact_url(url)} is not a valid PostgreSQL URL: {scrub(str(exc), url)}") from None

    schema = ours.get("schema", "public")
    if not schema or len(schema) > 63 or not set(schema) <= _SCHEMA_CHARS or schema[0].isdigit():
        raise ValueError(
            f"schema={schema!r} in {redact_url(url)}: use 1-63 letters, digits and underscores, not starting "
            "with a digit (the name is used as written, case included)"
        )
    try:
        min_size = int(ours.get("pool_min_size", "1"))
        max_size = int(ours.get("pool_max_size", str(max(10, min_size))))
        timeout = float(ours.get("pool_timeout", "10"))
    except ValueError as exc:
        raise ValueError(
            f"{redact_url(url)}: pool_min_size and pool_max_size take integers, pool_timeout seconds ({exc})"
        ) from None
    if min_size < 0 or max_size < 1 or max_size < min_size:
        raise ValueError(f"{redact_url(url)}: need 0 <= pool_min_size <= pool_max_size and pool_max_size >= 1")
    if not timeout > 0:
        raise ValueError(f"{redact_url(url)}: pool_timeout={timeout} must be a positive number of seconds")
    flags: dict[str, bool] = {}
    for name, default in _FLAGS:
        flag = _BOOLEANS.get(ours.get(name, str(default)).lower())
        if flag is None:
            raise ValueError(f"{name}={ours[name]!r} in {redact_url(url)}: use true or false")
        flags[name] = flag
    statement_timeout = ours.get("statement_timeout")
    if statement_timeout is not None and not _TIMEOUT.fullmatch(statement_timeout):
        raise ValueError(
            f"statement_timeout={statement_timeout!r} in {redact_url(url)}: use PostgreSQL's form, e.g. 5s, "
            "500ms or 2min (a bare number is milliseconds, 0 turns it off)"
        )
    return PostgresOptions(conninfo, schema, min_size, max_size, timeout, statement_timeout=statement_timeout, **flags)


# --- rows ----------------------------------------------------------------------------------------


def _is_dead(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool | None:
    """True: closed. None: the idle socket has something to read, which needs a real check. False: fine.

    A backend that was terminated (``pg_terminate_backend``, a restart, a failover) leaves its last
    words ("terminating connection…") or an EOF on the socket of an idle connection. Polling it costs
    a system call, not a round trip, so every connection taken from a pool is looked at.
    """
    if conn.closed:
        return True
    try:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN)
        return None if poller.poll(0) else False
    except (OSError, ValueError, psycopg.Error):
        return True


# The pause before each rerun of a statement whose connection was lost: the first at once (another
# pooled connection is likely fine), then short ones for a pooler or a server that is reconnecting.
_RERUN_PAUSES = (0.0, 0.05, 0.2)

# How the store's pooled and async connections are opened. prepare_threshold=None: psycopg's cursor
# never prepares a statement by itself (by default it does after 5 runs, and then keeps using it:
# after a DEALLOCATE ALL or DISCARD ALL behind its back, as a transaction pooler sends, every later
# run of that statement on the connection fails with 26000). The hot statements are prepared by
# _pgwire, which prepares them again when the backend forgot them.
_CONNECT_KWARGS: dict[str, Any] = {"autocommit": True, "prepare_threshold": None}


# A forked child shares its parent's sockets: a statement sent on one by both processes gets the
# other's answer (a read of one key answered with another process's record), and closing one, even
# by the garbage collector at exit, sends Terminate and ends the parent's session. So every
# connection a ledger opens is listed here; in a child, each is pointed at /dev/null and kept, never
# used, and every store starts a pool of its own (``_after_fork_in_child``).
_opened: weakref.WeakSet[Any] = weakref.WeakSet()
_stores: weakref.WeakSet[PostgresStore] = weakref.WeakSet()
_inherited: list[object] = []


def _after_fork_in_child() -> None:
    inherited = list(_opened)
    _opened.clear()
    if inherited:
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for conn in inherited:
                with contextlib.suppress(Exception):  # a closed one has no socket left
                    os.dup2(null, conn.pgconn.socket)
        finally:
            os.close(null)
        _inherited.extend(inherited)
    for store in list(_stores):
        store._forget_inherited()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Connection(psycopg.Connection[Any]):
    """A pooled connection and what the store keeps on it: the names of the hot statements prepared
    on it (get, the claim's INSERT, the swaps' UPDATEs: ``_pgwire``, no cursor), and one binary cursor
    reused by the other statements (scan, count, delete, a waiter's mark), which are never prepared.
    """

    ledger_cursor: psycopg.Cursor[Any] | None = None
    ledger_prepared: set[bytes] | None = None  # names of the hot statements prepared on it (_pgwire)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _opened.add(self)


class _LifoPool(ConnectionPool[_Connection]):
    """A ``ConnectionPool`` that hands out the connection returned last (psycopg_pool's is FIFO).

    One caller making statement after statement then keeps talking to one warm backend instead of
    round-robin over every pooled one: replay 0.35 → 0.25 of the floor, first call 1.39 → 1.35
    (docs/benchmarks.md). The least recently used connections stay at the left end, where the pool's
    shrinking takes them. psycopg_pool has no public switch for this; if its internals change, the
    override steps aside and the pool stays FIFO (``tests/stores/test_postgres.py`` notices).
    """

    def _get_ready_connection(self, timeout: float | None) -> _Connection | None:
        # Called under the pool's lock. The base class takes from the left: rotating the newest there
        # first makes its popleft() a pop(), and leaves the others in their order.
        idle = getattr(self, "_pool", None)
        if isinstance(idle, deque) and len(idle) > 1:
            idle.rotate(1)
        return super()._get_ready_connection(timeout)


class _AsyncConnection(psycopg.AsyncConnection[Any]):
    """The async twin of ``_Connection``."""

    ledger_cursor: psycopg.AsyncCursor[Any] | None = None
    ledger_prepared: set[bytes] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _opened.add(self)


# --- waiting: one LISTEN connection per store ------------------------------------------------------


class _Waiter:
    """One call waiting for a key to leave ``version``: a threading event or an asyncio future."""

    __slots__ = ("event", "future", "loop", "version", "woken")

    def __init__(self, version: int, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.version = version
        self.woken = False
        self.loop = loop
        self.event: threading.Event | None = None if loop is not None else threading.Event()
        self.future: asyncio.Future[None] | None = loop.create_future() if loop is not None else None

    def wake(self) -> None:
        """Wake it (from the listener thread). Called under the listener's lock."""
        if self.woken:
            return
        self.woken = True
        if self.event is not None:
            self.event.set()
        elif self.loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop was closed: nobody waits any more
                self.loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result(None)


class _Listener:
    """A daemon thread that LISTENs on the ledger's channel and wakes the waiters of its keys.

    ``flagged`` remembers which keys this store has marked ``watched`` at which version and has not
    seen change since: a caller that waits on such a key again (the guard polls in short rounds)
    needs no write to mark it. Any notification for a key, or losing the connection, forgets it.
    """

    RETRY_AFTER = 2.0  # seconds after a failed connect before the next; meanwhile waiters poll
    FLAGGED_LIMIT = 4096

    def __init__(self, conninfo: str, channel: str) -> None:
        self.conninfo = conninfo
        self.channel = channel
        self.alive = False
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._waiters: dict[str, set[_Waiter]] = {}
        self._flagged: OrderedDict[str, int] = OrderedDict()
        self._thread: threading.Thread | None = None
        self._failed_at = -self.RETRY_AFTER
        self._closed = False

    def start(self) -> bool:
        """Listen now; ``False`` when that is not possible (the caller polls instead)."""
        if self.alive:
            return True
        with self._start_lock:
            if self.alive:
                return True
            if self._closed or time.monotonic() - self._failed_at < self.RETRY_AFTER:
                return False
            if self._thread is not None:  # the previous one is winding down
                self._thread.join(timeout=1.0)
            try:
                conn = psycopg.connect(self.conninfo, autocommit=True)
            except psycopg.Error:
                self._failed_at = time.monotonic()
                return False
            _opened.add(conn)
            try:
                # LISTEN is in force once it returns: changes committed from now on reach us.
                conn.execute(f"LISTEN {_ident(self.channel)}")
            except psycopg.Error:
                conn.close()
                self._failed_at = time.monotonic()
                return False
            with self._lock:
                self.alive = True
            self._thread = threading.Thread(
                target=self._run, args=(conn,), name=f"onceonly-listen[{self.channel}]", daemon=True
            )
            self._thread.start()
            return True

    def _run(self, conn: psycopg.Connection[Any]) -> None:
        try:
            while not self._closed:
                for note in conn.notifies(timeout=5.0):
                    if self._closed:
                        break
                    self._dispatch(note.payload)
        except psycopg.Error as exc:
            # The connection was lost: reconnect at the next wait (a failed connect then backs off).
            _log.info(
                "onceonly: lost the LISTEN connection of channel %s (%s); waiters poll until it is back",
                self.channel,
                exc,
            )
        except Exception:  # never let a surprise kill the thread silently: waiters would only poll
            _log.exception("onceonly: the LISTEN thread of channel %s failed", self.channel)
        finally:
            # Whatever happened while we were not listening is lost: forget what was flagged and
            # wake everyone, so each waiter reads its record again.
            with self._lock:
                self.alive = False
                self._flagged.clear()
                for waiters in self._waiters.values():
                    for waiter in waiters:
                        waiter.wake()
            conn.close()

    def _dispatch(self, payload: str) -> None:
        version_text, _, key = payload.partition(" ")
        try:
            version = int(version_text)
        except ValueError:  # a wake-up sent by close(), or someone else's message
            return
        with self._lock:
            self._flagged.pop(key, None)
            for waiter in self._waiters.get(key, ()):
                if waiter.version != version:
                    waiter.wake()

    def register(self, key: str, waiter: _Waiter) -> bool | None:
        """Add a waiter. ``None``: not listening (poll). ``True``: the row must be marked watched."""
        with self._lock:
            if not self.alive:
                return None
            self._waiters.setdefault(key, set()).add(waiter)
            return self._flagged.get(key) != waiter.version

    def flagged(self, key: str, waiter: _Waiter) -> None:
        """The row of ``key`` is now marked watched at the waiter's version."""
        with self._lock:
            # A waiter already woken saw a change or a lost connection: the mark is no longer known.
            if waiter.woken or not self.alive:
                return
            self._flagged[key] = waiter.version
            self._flagged.move_to_end(key)
            if len(self._flagged) > self.FLAGGED_LIMIT:
                self._flagged.popitem(last=False)

    def unregister(self, key: str, waiter: _Waiter) -> None:
        with self._lock:
            waiters = self._waiters.get(key)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[key]

    def stop(self, wake: psycopg.Connection[Any] | None) -> None:
        """Stop listening; ``wake`` (any connection) sends a NOTIFY so the thread ends at once."""
        self._closed = True
        thread = self._thread
        if thread is None:
            return
        if wake is not None:
            with contextlib.suppress(psycopg.Error):
                wake.execute("SELECT pg_notify(%s, '')", (self.channel,))
        thread.join(timeout=2.0)


# --- the async face's connections -------------------------------------------------------------------


class _LoopConnections:
    """The async face's connections in one event loop: the idle ones, and a bound on how many.

    Not a ``psycopg_pool.AsyncConnectionPool``: in psycopg_pool 3.3 (3.3.3 when this was written) its
    ``pool_async.py`` counts ``asyncio.CancelledError`` among ``CLIENT_EXCEPTIONS``, and catches those
    in ``_add_connection`` around ``_connect()`` (it logs "error connecting in '<pool>': " with an empty
    message and schedules another attempt) and in the maintenance ``worker`` around each task. When
    ``asyncio.run`` ends while a worker is connecting (a pool filling up to ``min_size``, or growing),
    it cancels the worker and waits for it; the worker swallows the cancellation and waits on its queue
    again, and ``asyncio.run`` never returns. To check a newer release: ``asyncio.run`` a coroutine that
    opens ``AsyncConnectionPool(url, min_size=4, open=False)`` with ``await pool.open(wait=False)``,
    sleeps 1 ms and returns; it hangs while the bug is there.

    This has no task of its own, so a loop may end at any moment: its keeper, an async generator the
    loop closes at shutdown, closes the idle connections.
    """

    def __init__(self, store: PostgresStore) -> None:
        self.store = store
        self.idle: list[_AsyncConnection] = []
        self.slots = asyncio.Semaphore(store.options.pool_max_size)
        self.closed = False
        self._keeper: AsyncGenerator[None, None] | None = None

    async def start(self) -> None:
        keeper = self._keep()
        await keeper.__anext__()  # from now on the loop closes it in shutdown_asyncgens()
        self._keeper = keeper

    async def _keep(self) -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            self.close_now()

    async def get(self) -> _AsyncConnection:
        store = self.store
        if self.closed:
            raise StoreUnavailable(f"{store._where} was closed")
        if self.slots.locked():
            try:
                await asyncio.wait_for(self.slots.acquire(), store.options.pool_timeout)
            except TimeoutError:
                raise StoreUnavailable(
                    f"{store._where}: all {store.options.pool_max_size} async connections stayed busy for "
                    f"{store.options.pool_timeout:g}s (raise pool_max_size or pool_timeout in the URL)"
                ) from None
        else:
            await self.slots.acquire()  # free: returns without suspending
        try:
            while self.idle:
                conn = self.idle.pop()
                dead = _is_dead(conn)
                if dead is None:
                    try:
                        await conn.execute("")
                        dead = False
                    except psycopg.Error:
                        dead = True
                if not dead:
                    return conn
                _close_now(conn)
            return await _AsyncConnection.connect(store._conninfo, **_CONNECT_KWARGS)
        except psycopg.Error as exc:
            self.slots.release()
            raise store._translate(exc) from exc
        except BaseException:
            self.slots.release()
            raise

    async def put(self, conn: _AsyncConnection) -> None:
        # Keep it only if it is healthy and idle (an error or a cancellation mid-statement may leave it
        # in a transaction or broken).
        if self.closed or conn.closed or conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            _close_now(conn)
        else:
            self.idle.append(conn)
        self.slots.release()

    def close_now(self) -> None:
        self.closed = True
        idle, self.idle = self.idle, []
        for conn in idle:
            _close_now(conn)


def _close_now(conn: psycopg.AsyncConnection[Any]) -> None:
    """Close an async connection without a loop: its ``close()`` never suspends, so run it to its end."""
    closing = conn.close()
    try:
        closing.send(None)
    except StopIteration:
        return
    except psycopg.Error:
        pass
    else:
        closing.close()  # it wanted to wait after all: drop it and close the socket below
    conn.pgconn.finish()


# --- the store -------------------------------------------------------------------------------------


class PostgresStore:
    """An onceonly ledger in a PostgreSQL database.

    Args:
        url: ``postgresql://user@host:5432/dbname`` (also ``postgres://``, ``postgresql+psycopg://``),
            with libpq's own options (``sslmode``, ``connect_timeout``, ``application_name``…) and
            onceonly's: ``schema`` (default ``public``), ``pool_min_size`` (1), ``pool_max_size``
            (10), ``pool_timeout`` (seconds, 10), ``listen`` (``true``: LISTEN/NOTIFY; ``false``:
            poll). The schema and tables are created on first use.

    Raises:
        StoreUnavailable: the server cannot be reached, or the user may not create the tables.
        StoreCorrupt: the schema holds tables of the same names that onceonly did not make, or a
            ledger of a newer schema version than this onceonly knows.

    .. versionadded:: 0.1
    """

    def __init__(self, url: str) -> None:
        self.url = url
        options = parse_postgres_url(url)
        self.options = options
        self.schema = options.schema
        self._where = f"the PostgreSQL ledger {redact_url(url)}"
        self._conninfo = options.conninfo
        t = f"{_ident(self.schema)}.onceonly_records"
        self._table = t
        select = f"SELECT {COLUMNS} FROM {t} WHERE key = %s"
        insert = f"INSERT INTO {t} ({COLUMNS}) VALUES ({', '.join(['%s'] * 20)}) ON CONFLICT (key) DO NOTHING"
        # The hot statements, prepared once per connection (_pgwire); named per table, so that two
        # stores on one server never mix theirs up.
        tag = hashlib.sha256(t.encode()).hexdigest()[:10]
        self._tag = tag
        self._stmt_get = wire.Statement(f"onceonly_{tag}_get", select, [wire.TEXT])
        self._stmt_insert = wire.Statement(f"onceonly_{tag}_insert", insert, wire.COLUMN_TYPES)
        self._sql_insert = insert
        self._similar_ready = False
        self._sql_delete = f"DELETE FROM {t} WHERE key = %s AND version = %s"
        self._sql_delete_at = f"DELETE FROM {t} WHERE key = %s AND version = %s AND created_at = %s"
        self._sql_watch = f"UPDATE {t} SET watched = true WHERE key = %s AND version = %s"
        self._sql_count = f"SELECT state, count(*) FROM {t} GROUP BY state"
        # clock_timestamp(), not now(): now() is the start of the transaction, and a pooled connection
        # may sit in one.
        self._sql_time = "SELECT extract(epoch FROM clock_timestamp())::float8"
        # A statement_timeout is set per statement, in the statement's own transaction (SET LOCAL), and
        # the hot statements then go unnamed, in one pipeline with it (_pgwire.run_unnamed).
        self._timeout = None if options.statement_timeout is None else options.statement_timeout.encode()
        self._unnamed = not options.prepare or self._timeout is not None
        #: Statements run a second time after their connection was lost (see ``_run``).
        self.reruns = 0
        # which fields changed → the prepared UPDATE that writes them, and their encoders
        self._updates: dict[tuple[bool, ...], tuple[wire.Statement, tuple[Any, ...]]] = {}
        self._closed = False
        self._lock = threading.Lock()
        self._aconnections: dict[asyncio.AbstractEventLoop, _LoopConnections] = {}
        self._listener = _Listener(self._conninfo, _channel(self.schema)) if options.listen else None

        self._ensure_schema()
        self._pool = self._new_pool()
        _stores.add(self)

    def _new_pool(self) -> ConnectionPool[_Connection]:
        options = self.options
        pool: ConnectionPool[_Connection] = _LifoPool(
            self._conninfo,
            connection_class=_Connection,
            min_size=options.pool_min_size,
            max_size=options.pool_max_size,
            timeout=options.pool_timeout,
            kwargs=_CONNECT_KWARGS,
            name=f"onceonly[{self.schema}]",
            open=False,
        )
        pool.open(wait=False)
        return pool

    def _forget_inherited(self) -> None:
        """In a forked child: the parent's pool, async connections and listener stay the parent's
        (set aside, their sockets already blinded); this process gets its own."""
        _inherited.append((self._pool, self._aconnections, self._listener))
        self._lock = threading.Lock()
        self._aconnections = {}
        self._listener = _Listener(self._conninfo, _channel(self.schema)) if self.options.listen else None
        if not self._closed:
            self._pool = self._new_pool()

    # --- schema ---------------------------------------------------------------------------------

    def _ensure_schema(self) -> None:
        """Create or migrate the tables, or check them; on a connection of its own, closed after."""
        try:
            conn = psycopg.connect(self._conninfo, autocommit=True)
        except psycopg.Error as exc:
            said = scrub(str(exc), self.url).strip()
            raise StoreUnavailable(
                f"cannot connect to {self._where}: {said}. Check that the server is up and the URL "
                "(host, port, database, user) is right"
            ) from exc
        try:
            with conn:
                self._check_server(conn)
                version, has_records = self._inspect(conn)
                if version != SCHEMA_VERSION or not has_records:
                    # Serialise the processes that start at once on a new schema: the first creates it,
                    # the others find it done. A transaction-level lock, released by the commit or the
                    # rollback whatever happens to this process: a session lock would stay held by a
                    # pooled backend behind a transaction pooler (PgBouncer), and block every later
                    # opening. _inspect reads the catalog tables with a snapshot taken after the wait.
                    with conn.transaction():
                        conn.execute("SELECT pg_advisory_xact_lock(%s)", (self._lock_id(),))
                        version, has_records = self._inspect(conn)
                        self._migrate(conn, version, has_records)
                self._check_columns(conn)
        except StoreError:
            raise
        except psycopg.Error as exc:
            if exc.sqlstate == "42501":  # insufficient_privilege
                raise StoreUnavailable(
                    f"{self._where}: not allowed to create the ledger's tables ({str(exc).strip()}). Create them "
                    f"as an owner once (open the ledger as that user), or grant CREATE on schema {self.schema}"
                ) from exc
            raise self._translate(exc) from exc

    def _check_server(self, conn: psycopg.Connection[Any]) -> None:
        """Refuse a server that cannot take the ledger's writes, and warn of (or refuse) one that may lose
        acknowledged ones. One query at open, on a connection opened as the pool's are, so the role's and
        the database's settings and the URL's ``options`` all count; nothing per call."""
        row = conn.execute(
            "SELECT pg_is_in_recovery(), current_setting('transaction_read_only'), "
            "current_setting('synchronous_commit'), current_setting('fsync')"
        ).fetchone()
        assert row is not None
        standby, read_only, synchronous_commit, fsync = bool(row[0]), row[1] == "on", row[2], row[3]
        if standby or read_only:
            if standby:
                what = "is a hot standby (pg_is_in_recovery() is true): it takes no writes"
            else:
                what = (
                    "accepts only read-only transactions (transaction_read_only is on: default_transaction_read_only "
                    "is set for this role, database or server)"
                )
            raise StoreUnavailable(
                f"{self._where} {what}, and every write of the ledger would fail. Give the primary's address, or "
                "list every host with target_session_attrs=read-write in the URL "
                "(postgresql://host1,host2/db?target_session_attrs=read-write) so that libpq picks the primary"
            )
        lossy = []
        if synchronous_commit == "off":
            lossy.append("synchronous_commit is off (a commit is acknowledged before it is flushed)")
        if fsync == "off":
            lossy.append("fsync is off (nothing is flushed to disk)")
        if not lossy:
            return
        what = (
            f"{self._where}: {' and '.join(lossy)}, so a crash of the server may lose writes it has already "
            "acknowledged: a lost claim or result is a call that runs again."
        )
        fix = (
            "Set synchronous_commit = on (and fsync = on) for the server, the database or the ledger's role "
            "(ALTER ROLE … SET synchronous_commit = on)"
        )
        if self.options.require_durability:
            raise StoreError(f"{what} {fix}, or open the ledger without require_durability=true")
        if self.options.warn_durability:
            _log.warning(
                "onceonly: %s %s, or open the ledger with warn_durability=false if this is intended", what, fix
            )

    def _lock_id(self) -> int:
        digest = hashlib.sha256(f"onceonly schema {self.schema}".encode()).digest()
        return int.from_bytes(digest[:8], "big", signed=True)

    def _inspect(self, conn: psycopg.Connection[Any]) -> tuple[int | None, bool]:
        """The schema version (None: no version table) and whether the records table exists."""
        s = _ident(self.schema)
        # A query on pg_class, not to_regclass(): that looks names up in this backend's catalog cache,
        # which may still hold "no such table" from before another process committed them.
        row = conn.execute(
            "SELECT bool_or(c.relname = 'onceonly_schema'), bool_or(c.relname = 'onceonly_records') "
            "FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname IN ('onceonly_schema', 'onceonly_records')",
            (self.schema,),
        ).fetchone()
        assert row is not None
        has_version, has_records = bool(row[0]), bool(row[1])
        if not has_version:
            return None, has_records
        try:
            found = conn.execute(f"SELECT max(version) FROM {s}.onceonly_schema").fetchone()
        except psycopg.errors.UndefinedColumn as exc:
            raise StoreCorrupt(
                f"{self._where}: the table {self.schema}.onceonly_schema was not made by onceonly. Nothing was "
                "changed: give the ledger a schema of its own (?schema=onceonly)"
            ) from exc
        version = found[0] if found else None
        if version is None or version < 1:
            # Not a state onceonly leaves (it writes the version row in the transaction that makes the
            # tables): a restore without its rows, or a hand edit. Migrating from 0 would fail half-way.
            held = "is empty" if version is None else f"holds version {version}, which onceonly never writes"
            if has_records:
                fix = (
                    "restore its rows, or insert the version the tables are at (this onceonly writes "
                    f"{SCHEMA_VERSION}) if you know it"
                )
            else:
                fix = "drop onceonly_schema to start anew"
            raise StoreCorrupt(
                f"{self._where}: the version table {self.schema}.onceonly_schema {held} and the table "
                f"onceonly_records {'exists' if has_records else 'is missing'}: it was changed by hand. Nothing "
                f"was changed: {fix}, or give the ledger a schema of its own"
            )
        return int(version), has_records

    def _migrate(self, conn: psycopg.Connection[Any], version: int | None, has_records: bool) -> None:
        where = f"{self._where}, schema {self.schema}"
        if version is None and has_records:
            raise StoreCorrupt(
                f"{where} has a table onceonly_records but no onceonly_schema version table: onceonly did not "
                "make it. Nothing was changed: give the ledger a schema of its own (?schema=onceonly)"
            )
        if version is not None and version > SCHEMA_VERSION:
            raise StoreCorrupt(
                f"{where} has ledger schema version {version}, newer than this onceonly knows "
                f"({SCHEMA_VERSION}). Nothing was changed: upgrade onceonly on this host"
            )
        if version == SCHEMA_VERSION and not has_records:
            raise StoreCorrupt(
                f"{where} is at schema version {version} but its table onceonly_records is missing: the ledger "
                "was dropped by hand. Nothing was changed: restore it, or drop onceonly_schema to start anew"
            )
        if version == SCHEMA_VERSION:
            return
        exists = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %s)", (self.schema,)
        ).fetchone()
        if not (exists and exists[0]):
            conn.execute(f"CREATE SCHEMA {_ident(self.schema)}")
        steps = _migrations(self.schema)
        for target in range((version or 0) + 1, SCHEMA_VERSION + 1):
            for statement in steps[target]:
                conn.execute(statement)
            conn.execute(
                f"INSERT INTO {_ident(self.schema)}.onceonly_schema (version, installed_by) VALUES (%s, %s)",
                (target, f"onceonly {_installed_version()}"),
            )

    def _check_columns(self, conn: psycopg.Connection[Any]) -> None:
        try:
            conn.execute(f"SELECT {COLUMNS}, watched FROM {self._table} LIMIT 0")
        except psycopg.errors.UndefinedColumn as exc:
            raise StoreCorrupt(
                f"{self._where}: {self.schema}.onceonly_records lacks columns of schema version {SCHEMA_VERSION} "
                f"({str(exc).strip()}): it was changed by hand. Nothing was changed"
            ) from exc

    # --- errors and connections -----------------------------------------------------------------------

    def _translate(self, exc: BaseException, cursor: bool = False) -> StoreError:
        """The store error for a driver error: connection trouble → unavailable, anything else → corrupt.

        ``cursor``: it came from a statement sent through psycopg's cursor (``_run``), not a hot one.
        """
        text = str(exc).strip() or type(exc).__name__
        if isinstance(exc, PoolClosed) or self._closed:
            return StoreUnavailable(f"{self._where} was closed")
        if isinstance(exc, PoolTimeout):
            return StoreUnavailable(
                f"{self._where}: no connection within {self.options.pool_timeout:g}s ({text}). Is the server "
                "up and reachable? (raise pool_max_size or pool_timeout in the URL if it is only busy)"
            )
        sqlstate = getattr(exc, "sqlstate", None)
        if sqlstate == "57014" and self.options.statement_timeout is not None and "statement timeout" in text:
            return StoreUnavailable(
                f"{self._where}: a statement ran longer than statement_timeout={self.options.statement_timeout} "
                f"and the server cancelled it ({text}). Whether the last write landed is unknown; the ledger "
                "reads the record again before it decides. If the server is only slow (a lock held long, a "
                "busy disk), raise statement_timeout in the URL"
            )
        if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError) or sqlstate == "25006":
            # 25006: read-only transaction, e.g. connected to a standby after a failover.
            return StoreUnavailable(
                f"{self._where} failed: {text}. Whether the last write landed is unknown; the ledger reads "
                "the record again before it decides"
            )
        if sqlstate == wire.NOT_PREPARED and cursor:
            # The store's connections never prepare these (prepare_threshold=None): not ours to prepare again.
            return StoreUnavailable(
                f"{self._where}: a statement sent through psycopg's cursor (a scan, count, delete or a waiter's "
                f"mark) met a prepared statement or portal that the backend did not know ({text}). The store "
                "never prepares those statements, so something else changed the connection's session, likely a "
                "pooler in transaction mode that hands it another backend: connect the ledger in session mode "
                "(or bypass the pooler). The statement ran nowhere"
            )
        if sqlstate == wire.NOT_PREPARED:
            return StoreUnavailable(
                f"{self._where}: one of the store's hot statements (a read by key, a claim's insert, a swap) "
                f"was unknown to the backend that was to run it ({text}), even right after the store prepared "
                "it again. The likely cause is a pooler in transaction mode without prepared-statement support, "
                "which sends the preparation and the execution to different backends: connect the ledger in "
                "session mode (or bypass the pooler), use PgBouncer 1.21 or newer with max_prepared_statements "
                "set, or open the ledger with prepare=false in the URL. The statement ran nowhere"
            )
        if sqlstate in ("42P01", "42703", "3F000"):  # undefined table, column, schema
            return StoreCorrupt(
                f"{self._where}: the ledger's tables are missing or changed ({text}); were they dropped by hand?"
            )
        return StoreCorrupt(f"{self._where}: unexpected database error: {text}")

    def _getconn(self) -> _Connection:
        pool = self._pool
        try:
            for _ in range(self.options.pool_max_size + 1):
                conn = pool.getconn()
                dead = _is_dead(conn)
                if dead is None:
                    try:
                        conn.execute("")
                        dead = False
                    except psycopg.Error:
                        dead = True
                if not dead:
                    return conn
                # Dead since it went idle: a closed connection handed back is replaced by the pool.
                conn.close()
                pool.putconn(conn)
            return pool.getconn()
        except psycopg.Error as exc:
            raise self._translate(exc) from exc

    async def _aconns(self) -> _LoopConnections:
        loop = asyncio.get_running_loop()
        conns = self._aconnections.get(loop)
        if conns is not None and not conns.closed:
            return conns
        with self._lock:
            if self._closed:
                raise StoreUnavailable(f"{self._where} was closed")
            # Loops that ended: their connections were closed by their keeper, or are closed here.
            for old in [lp for lp in self._aconnections if lp.is_closed()]:
                self._aconnections.pop(old).close_now()
            conns = self._aconnections[loop] = _LoopConnections(self)
        await conns.start()
        return conns

    def _update(self, record: Record, expected: Record) -> tuple[wire.Statement, list[bytes | None]]:
        # Write only the columns that changed: a settle leaves args and fingerprint alone. Every swap
        # clears "watched": a waiter marks the row again if it still waits. The diff runs in C (map,
        # compress).
        new = swap_fields(record)
        changed = tuple(map(operator.ne, new, swap_fields(expected)))
        plan = self._updates.get(changed)
        if plan is None:
            fields = list(compress(range(len(changed)), changed))
            sets = "".join(f", {_SWAP_COLUMNS[i]} = %s" for i in fields)
            sql = (
                f"UPDATE {self._table} SET version = %s, watched = false{sets} "
                "WHERE key = %s AND version = %s AND created_at = %s"
            )
            mask = sum(1 << i for i in fields)
            types = [wire.INT8, *(_SWAP_TYPES[i] for i in fields), wire.TEXT, wire.INT8, wire.FLOAT8]
            encoders = tuple(_SWAP_ENCODERS[i] for i in fields)
            plan = self._updates[changed] = (
                wire.Statement(f"onceonly_{self._tag}_update_{mask:x}", sql, types),
                encoders,
            )
        stmt, encoders = plan
        params: list[bytes | None] = [wire.int8(record.version)]
        params += [enc(v) for enc, v in zip(encoders, compress(new, changed), strict=True)]
        params.append(record.key.encode())
        params.append(wire.int8(expected.version))
        params.append(wire.float8(expected.created_at))
        return stmt, params

    def _scan_sql(self, query: Query) -> tuple[str, list[Any]] | None:
        return scan_sql(query, table=self._table, columns=COLUMNS, placeholder="%s")

    # --- the primitives, sync ---------------------------------------------------------------------------

    def _on_connection(
        self, op: Callable[[_Connection], T], rerun: bool = True, cursor: bool = False
    ) -> tuple[T, bool]:
        """Run ``op`` on a pooled connection: (its answer, whether it ran a second time).

        A statement whose connection was lost (the backend terminated, the network cut, a pooler's
        server connection cut under it) runs again on a fresh connection when ``rerun``, up to
        ``len(_RERUN_PAUSES)`` times: reads freely, writes only where the caller can tell its own earlier
        write from a rerun's answer (``claim``, ``insert``, ``swap``: a run that landed but whose answer
        was lost makes the rerun find the caller's own row). Any other error, or a loss past the bound,
        is translated and raised (``cursor``: ``op`` uses psycopg's cursor).
        """
        runs = 0
        while True:
            conn = self._getconn()
            try:
                return op(conn), runs > 0
            except psycopg.Error as exc:
                if not rerun or not conn.closed or runs >= len(_RERUN_PAUSES):  # closed: the connection was lost
                    raise self._translate(exc, cursor) from exc
                self.reruns += 1
            finally:
                self._pool.putconn(conn)
            if _RERUN_PAUSES[runs]:
                time.sleep(_RERUN_PAUSES[runs])
            runs += 1

    def _run(self, sql: str, params: Sequence[Any], fetch: int, rerun: bool = True) -> tuple[Any, bool]:
        """One statement through the connection's cursor: its rows or its row count."""

        timeout = self.options.statement_timeout

        def op(conn: _Connection) -> Any:
            cur = conn.ledger_cursor
            if cur is None:
                # Binary rows: float8 arrives as its eight bytes (exact, and cheaper to load than text).
                cur = conn.ledger_cursor = conn.cursor(binary=True)
            if timeout is None:
                cur.execute(sql, params)
            else:
                with conn.pipeline():  # one Sync: the SET LOCAL and the statement share a transaction
                    conn.execute(wire.SET_TIMEOUT, (timeout,))
                    cur.execute(sql, params)
            return cur.fetchall() if fetch == _ALL else cur.rowcount

        return self._on_connection(op, rerun, cursor=True)

    def _exec(self, stmt: wire.Statement, params: list[bytes | None]) -> tuple[pq.abc.PGresult, bool]:
        """One of the hot statements, prepared and binary (stores/_pgwire.py): its result."""

        if self._unnamed:
            timeout = self._timeout

            def unnamed(conn: _Connection) -> pq.abc.PGresult:
                return conn.wait(wire.run_unnamed(conn.pgconn, stmt, params, timeout))

            return self._on_connection(unnamed)

        def op(conn: _Connection) -> pq.abc.PGresult:
            prepared = conn.ledger_prepared
            if prepared is None:
                prepared = conn.ledger_prepared = set()
            return conn.wait(wire.run(conn.pgconn, prepared, stmt, params))

        return self._on_connection(op)

    def get(self, key: str) -> Record | None:
        res, _ = self._exec(self._stmt_get, [key.encode()])
        return wire.decode_record(res)

    def claim(self, record: Record) -> Record | None:
        # Insert first, read only on a conflict: a first call is then the floor's two statements. One
        # statement that inserts or returns the holder's row (a CTE) kept a replay to one round trip
        # but cost a first call 0.15-0.2x of the floor (docs/benchmarks.md); first calls are the rule.
        params = wire.record_params(record)
        while True:
            res, again = self._exec(self._stmt_insert, params)
            if res.command_tuples == 1:
                return None
            # A fresh statement, a fresh snapshot: it sees whichever insert beat ours, even one that
            # committed while our INSERT waited on its key. A purge may delete it again before we
            # read it: then claim again.
            found = self.get(record.key)
            if found is None:
                continue
            # A rerun finds the first run's row if that one landed: our own record, byte for byte (its
            # owner is unique to this call), which means we hold it.
            return None if again and found == record else found

    def insert(self, record: Record) -> bool:
        res, again = self._exec(self._stmt_insert, wire.record_params(record))
        return res.command_tuples == 1 or (again and self.get(record.key) == record)

    def swap(self, record: Record, expected: Record) -> bool:
        res, again = self._exec(*self._update(record, expected))
        return res.command_tuples == 1 or (again and self.get(record.key) == record)

    def _delete_sql(self, key: str, expected_version: int, created_at: float | None) -> tuple[str, tuple[Any, ...]]:
        if created_at is None:
            return self._sql_delete, (key, expected_version)
        return self._sql_delete_at, (key, expected_version, float(created_at))

    def delete(self, key: str, expected_version: int, created_at: float | None = None) -> bool:
        # Not rerun: after a lost connection nobody can tell whose delete removed the row.
        count, _ = self._run(*self._delete_sql(key, expected_version, created_at), _COUNT, rerun=False)
        return count == 1  # type: ignore[no-any-return]

    def scan(self, query: Query) -> list[Record]:
        built = self._scan_sql(query)
        if built is None:
            return []
        rows, _ = self._run(built[0], built[1], _ALL)
        return [row_to_record(r) for r in rows]

    def count_by_state(self) -> dict[State, int]:
        rows, _ = self._run(self._sql_count, (), _ALL)
        return counts_by_state(rows)

    def time(self) -> float:
        """The server's clock (``clock_timestamp()``), in seconds since the epoch: the ledger's time for
        every host (``onceonly.clock``)."""
        rows, _ = self._run(self._sql_time, (), _ALL)
        return float(rows[0][0])

    def _watch(self, key: str, version: int) -> bool:
        """Mark the row watched if it is still at ``version``; ``False``: it changed or is gone."""
        count, _ = self._run(self._sql_watch, (key, version), _COUNT, rerun=False)
        return count == 1  # type: ignore[no-any-return]

    def wait_for_change(self, key: str, version: int, timeout: float) -> None:
        if timeout <= 0:
            return
        listener = self._listener
        if listener is None or not listener.start():
            time.sleep(timeout)  # polling: the caller reads again after the pause
            return
        waiter = _Waiter(version)
        status = listener.register(key, waiter)
        if status is None:
            time.sleep(timeout)
            return
        try:
            if status:
                # Mark the row after LISTEN is in force, and check the version in the same statement:
                # a change before it fails the update, a change after it notifies us.
                try:
                    if not self._watch(key, version):
                        return
                except StoreError:
                    time.sleep(timeout)  # the caller's next read reports the outage
                    return
                listener.flagged(key, waiter)
            assert waiter.event is not None
            waiter.event.wait(timeout)
        finally:
            listener.unregister(key, waiter)

    # --- near-duplicate calls (onceonly.Similar): only tools with similar= come here -------------------

    def _similar_tables(self) -> tuple[str, str]:
        s = _ident(self.schema)
        return f"{s}.onceonly_similar", f"{s}.onceonly_similar_locks"

    def _ensure_similar(self) -> None:
        """Make the group tables on first use, so that a ledger without similar= tools never has them:
        members (key → group, claimed at; indexed by group and time) and group locks. A record's
        membership goes with it (a trigger on delete: purge); no trigger on update, so the other
        tools' writes cost what they did."""
        if self._similar_ready:
            return
        members, locks = self._similar_tables()
        s = _ident(self.schema)
        statements = [
            f"""CREATE TABLE IF NOT EXISTS {members} (
                key text COLLATE "C" PRIMARY KEY,
                grp text COLLATE "C" NOT NULL,
                at  double precision NOT NULL
            )""",
            f"CREATE INDEX IF NOT EXISTS onceonly_similar_group ON {members} (grp, at)",
            f"""CREATE TABLE IF NOT EXISTS {locks} (
                grp   text COLLATE "C" PRIMARY KEY,
                token text NOT NULL,
                until double precision NOT NULL
            )""",
            f"""CREATE OR REPLACE FUNCTION {s}.onceonly_similar_gone() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                DELETE FROM {members} WHERE key = OLD.key;
                RETURN NULL;
            END
            $$""",
            f"""CREATE TRIGGER onceonly_similar_gone AFTER DELETE ON {self._table} FOR EACH ROW
                EXECUTE FUNCTION {s}.onceonly_similar_gone()""",
        ]

        def op(conn: _Connection) -> None:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (self._lock_id(),))
                found = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (locks,)).fetchone()
                if not (found and found[0]):
                    for statement in statements:
                        conn.execute(statement)

        self._on_connection(op, cursor=True)
        self._similar_ready = True

    def _similar_lock_sql(self) -> tuple[str, str]:
        members, locks = self._similar_tables()
        lock = (
            f"INSERT INTO {locks} (grp, token, until) VALUES (%s, %s, %s) ON CONFLICT (grp) DO UPDATE "
            f"SET token = EXCLUDED.token, until = EXCLUDED.until WHERE {locks}.token = EXCLUDED.token "
            f"OR {locks}.until <= %s"
        )
        read = (
            f"SELECT m.key, m.at, r.args FROM {members} m JOIN {self._table} r ON r.key = m.key "
            f"WHERE m.grp = %s AND EXISTS (SELECT 1 FROM {locks} l WHERE l.grp = m.grp AND l.token = %s) "
            "AND m.at >= %s ORDER BY m.at DESC LIMIT %s"
        )
        return lock, read

    def _similar_claim_sql(self) -> str:
        """``similar_claim`` as one statement (one round trip, one transaction): free the lock if this
        token holds it, and only then insert the record and, if it was new, its membership. Answers
        (lock freed, record inserted)."""
        members, locks = self._similar_tables()
        return (
            f"WITH freed AS (DELETE FROM {locks} WHERE grp = %s AND token = %s RETURNING 1), "
            f"made AS (INSERT INTO {self._table} ({COLUMNS}) SELECT {', '.join(['%s'] * 20)} "
            "WHERE EXISTS (SELECT 1 FROM freed) ON CONFLICT (key) DO NOTHING RETURNING key, created_at), "
            f"filed AS (INSERT INTO {members} (key, grp, at) SELECT key, %s, created_at FROM made) "
            "SELECT (SELECT count(*) FROM freed), (SELECT count(*) FROM made)"
        )

    @staticmethod
    def _similar_claim_params(record: Record, group: str, token: str) -> tuple[Any, ...]:
        values = tuple(v.value if isinstance(v, State) else v for v in _record_values(record))
        return (group, token, *values, group)

    def similar_lock(
        self, group: str, token: str, now: float, until: float, since: float, limit: int
    ) -> list[Candidate] | None:
        self._ensure_similar()
        lock, read = self._similar_lock_sql()
        timeout = self.options.statement_timeout

        # Two statements, pipelined into one round trip: the read must see every claim committed before
        # the lock was taken, and a statement's snapshot is its start (the lock may wait for the last
        # holder), so it is a statement of its own.
        def op(conn: _Connection) -> tuple[int, list[Any]]:
            with conn.cursor() as taken, conn.cursor() as found:
                with conn.pipeline():
                    if timeout is not None:
                        conn.execute(wire.SET_TIMEOUT, (timeout,))
                    taken.execute(lock, (group, token, until, now))
                    found.execute(read, (group, token, since, limit))
                return taken.rowcount, found.fetchall()

        (count, rows), _ = self._on_connection(op, cursor=True)
        if count != 1:
            return None
        return [Candidate(k, float(at), args) for k, at, args in rows]

    def similar_claim(self, record: Record, group: str, token: str) -> Record | Literal[False] | None:
        rows, _ = self._run(self._similar_claim_sql(), self._similar_claim_params(record, group, token), _ALL, False)
        freed, made = rows[0]
        if not freed:
            return False
        return None if made else self.get(record.key)

    def similar_unlock(self, group: str, token: str) -> None:
        _, locks = self._similar_tables()
        self._run(f"DELETE FROM {locks} WHERE grp = %s AND token = %s", (group, token), _COUNT)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            aconnections, self._aconnections = self._aconnections, {}
        if self._listener is not None:
            wake = None
            with contextlib.suppress(psycopg.Error):
                wake = self._pool.getconn(timeout=1.0)
            try:
                self._listener.stop(wake)
            finally:
                if wake is not None:
                    self._pool.putconn(wake)
        self._pool.close()
        # Idle async connections are closed here, whatever their loop: closing one is a plain call.
        # Those in use are closed when handed back.
        for conns in aconnections.values():
            conns.close_now()

    # --- the primitives, async --------------------------------------------------------------------------

    async def _aon_connection(
        self, op: Callable[[_AsyncConnection], Awaitable[T]], rerun: bool = True, cursor: bool = False
    ) -> tuple[T, bool]:
        """``_on_connection``, awaited: the same bounded reruns after a lost connection."""
        runs = 0
        conns = await self._aconns()
        while True:
            conn = await conns.get()
            try:
                return await op(conn), runs > 0
            except psycopg.Error as exc:
                if not rerun or not conn.closed or runs >= len(_RERUN_PAUSES):  # closed: the connection was lost
                    raise self._translate(exc, cursor) from exc
                self.reruns += 1
            finally:
                await conns.put(conn)
            if _RERUN_PAUSES[runs]:
                await asyncio.sleep(_RERUN_PAUSES[runs])
            runs += 1

    async def _arun(self, sql: str, params: Sequence[Any], fetch: int, rerun: bool = True) -> tuple[Any, bool]:
        """``_run``, awaited."""

        timeout = self.options.statement_timeout

        async def op(conn: _AsyncConnection) -> Any:
            acur = conn.ledger_cursor
            if acur is None:
                acur = conn.ledger_cursor = conn.cursor(binary=True)
            if timeout is None:
                await acur.execute(sql, params)
            else:
                async with conn.pipeline():
                    await conn.execute(wire.SET_TIMEOUT, (timeout,))
                    await acur.execute(sql, params)
            return await acur.fetchall() if fetch == _ALL else acur.rowcount

        return await self._aon_connection(op, rerun, cursor=True)

    async def _aexec(self, stmt: wire.Statement, params: list[bytes | None]) -> tuple[pq.abc.PGresult, bool]:
        """``_exec``, awaited: the same generator, driven by the async connection."""

        if self._unnamed:
            timeout = self._timeout

            async def unnamed(conn: _AsyncConnection) -> pq.abc.PGresult:
                return await conn.wait(wire.run_unnamed(conn.pgconn, stmt, params, timeout))

            return await self._aon_connection(unnamed)

        async def op(conn: _AsyncConnection) -> pq.abc.PGresult:
            prepared = conn.ledger_prepared
            if prepared is None:
                prepared = conn.ledger_prepared = set()
            return await conn.wait(wire.run(conn.pgconn, prepared, stmt, params))

        return await self._aon_connection(op)

    async def aget(self, key: str) -> Record | None:
        res, _ = await self._aexec(self._stmt_get, [key.encode()])
        return wire.decode_record(res)

    async def aclaim(self, record: Record) -> Record | None:
        params = wire.record_params(record)
        while True:  # see claim()
            res, again = await self._aexec(self._stmt_insert, params)
            if res.command_tuples == 1:
                return None
            found = await self.aget(record.key)
            if found is None:
                continue
            return None if again and found == record else found

    async def ainsert(self, record: Record) -> bool:
        res, again = await self._aexec(self._stmt_insert, wire.record_params(record))
        return res.command_tuples == 1 or (again and await self.aget(record.key) == record)

    async def aswap(self, record: Record, expected: Record) -> bool:
        res, again = await self._aexec(*self._update(record, expected))
        return res.command_tuples == 1 or (again and await self.aget(record.key) == record)

    async def adelete(self, key: str, expected_version: int, created_at: float | None = None) -> bool:
        count, _ = await self._arun(*self._delete_sql(key, expected_version, created_at), _COUNT, rerun=False)
        return count == 1  # type: ignore[no-any-return]

    async def ascan(self, query: Query) -> list[Record]:
        built = self._scan_sql(query)
        if built is None:
            return []
        rows, _ = await self._arun(built[0], built[1], _ALL)
        return [row_to_record(r) for r in rows]

    async def await_for_change(self, key: str, version: int, timeout: float) -> None:
        if timeout <= 0:
            return
        listener = self._listener
        # Connecting the listener blocks: off the loop, once.
        if listener is None or not (listener.alive or await asyncio.to_thread(listener.start)):
            await asyncio.sleep(timeout)
            return
        waiter = _Waiter(version, asyncio.get_running_loop())
        status = listener.register(key, waiter)
        if status is None:
            await asyncio.sleep(timeout)
            return
        try:
            if status:
                try:
                    count, _ = await self._arun(self._sql_watch, (key, version), _COUNT, rerun=False)
                    if count != 1:
                        return
                except StoreError:
                    await asyncio.sleep(timeout)
                    return
                listener.flagged(key, waiter)
            assert waiter.future is not None
            await asyncio.wait((waiter.future,), timeout=timeout)
        finally:
            listener.unregister(key, waiter)

    async def asimilar_lock(
        self, group: str, token: str, now: float, until: float, since: float, limit: int
    ) -> list[Candidate] | None:
        if not self._similar_ready:
            await asyncio.to_thread(self._ensure_similar)  # once per store
        lock, read = self._similar_lock_sql()
        timeout = self.options.statement_timeout

        async def op(conn: _AsyncConnection) -> tuple[int, list[Any]]:
            async with conn.cursor() as taken, conn.cursor() as found:
                async with conn.pipeline():
                    if timeout is not None:
                        await conn.execute(wire.SET_TIMEOUT, (timeout,))
                    await taken.execute(lock, (group, token, until, now))
                    await found.execute(read, (group, token, since, limit))
                return taken.rowcount, await found.fetchall()

        (count, rows), _ = await self._aon_connection(op, cursor=True)
        if count != 1:
            return None
        return [Candidate(k, float(at), args) for k, at, args in rows]

    async def asimilar_claim(self, record: Record, group: str, token: str) -> Record | Literal[False] | None:
        params = self._similar_claim_params(record, group, token)
        rows, _ = await self._arun(self._similar_claim_sql(), params, _ALL, False)
        freed, made = rows[0]
        if not freed:
            return False
        return None if made else await self.aget(record.key)

    async def asimilar_unlock(self, group: str, token: str) -> None:
        _, locks = self._similar_tables()
        await self._arun(f"DELETE FROM {locks} WHERE grp = %s AND token = %s", (group, token), _COUNT)

    async def aclose(self) -> None:
        conns = self._aconnections.get(asyncio.get_running_loop())
        if conns is not None:
            conns.close_now()  # in its own loop's thread, before the rest is closed from a worker thread
        await asyncio.to_thread(self.close)

    def __repr__(self) -> str:
        return f"PostgresStore({redact_url(self.url)!r})"
