"""``PostgresStore`` and its primitives: one autocommitted statement per transition, the sync face on
a ``psycopg_pool`` pool, the async face on connections kept per event loop (the package's docstring
has the design; ``_pools``, ``_listen``, ``_schema`` the parts)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import operator
import os
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from itertools import compress
from typing import Any, Literal, TypeVar

import psycopg
from psycopg import pq
from psycopg_pool import ConnectionPool

from onceonly.errors import StoreError, StoreUnavailable
from onceonly.similar import Candidate
from onceonly.states import Record, State
from onceonly.stores import _pgwire as wire
from onceonly.stores._sql import (
    COLUMN_OF,
    COLUMNS,
    SWAP_FIELDS,
    counts_by_state,
    counts_by_tool,
    row_to_record,
    scan_sql,
    swap_fields,
)
from onceonly.stores._url import redact_url
from onceonly.stores.base import Query
from onceonly.stores.postgres._budgets import PostgresBudgets
from onceonly.stores.postgres._controls import Controls
from onceonly.stores.postgres._errors import translate
from onceonly.stores.postgres._listen import Listener, await_for_change, wait_for_change
from onceonly.stores.postgres._names import channel, ident
from onceonly.stores.postgres._pools import (
    CONNECT_KWARGS,
    AsyncConnection,
    Connection,
    LifoPool,
    LoopConnections,
    blind_inherited,
    inherited,
    is_dead,
)
from onceonly.stores.postgres._schema import ensure_schema, lock_id
from onceonly.stores.postgres._similar import (
    similar_claim_params,
    similar_claim_sql,
    similar_ddl,
    similar_lock_sql,
    similar_tables,
)
from onceonly.stores.postgres._url import parse_postgres_url

T = TypeVar("T")

_SWAP_COLUMNS = tuple(COLUMN_OF.get(f, f) for f in SWAP_FIELDS)
_FIELD_AT = {f: i for i, f in enumerate(Record.__dataclass_fields__)}
_SWAP_TYPES = tuple(wire.COLUMN_TYPES[_FIELD_AT[f]] for f in SWAP_FIELDS)
_SWAP_ENCODERS = tuple(wire.FIELD_ENCODERS[_FIELD_AT[f]] for f in SWAP_FIELDS)
_ALL, _COUNT = 1, 2  # what _run returns of a statement: all its rows, or its row count

# The pause before each rerun of a statement whose connection was lost: the first at once (another
# pooled connection is likely fine), then short ones for a pooler or a server that is reconnecting.
_RERUN_PAUSES = (0.0, 0.05, 0.2)

# The stores of this process: a forked child blinds the connections it inherited (``_pools``) and
# gives each store a pool of its own.
_stores: weakref.WeakSet[PostgresStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    blind_inherited()
    for store in list(_stores):
        store._forget_inherited()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _reads(sql: str) -> bool:
    """Whether a statement sent through the cursor only reads (a scan, a count, the clock)."""
    return sql.lstrip()[:6].upper() == "SELECT"


class PostgresStore(PostgresBudgets, Controls):
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
        t = f"{ident(self.schema)}.onceonly_records"
        self._table = t
        select = f"SELECT {COLUMNS} FROM {t} WHERE key = %s"
        insert = f"INSERT INTO {t} ({COLUMNS}) VALUES ({', '.join(['%s'] * 20)}) ON CONFLICT (key) DO NOTHING"
        # The hot statements, prepared once per connection (_pgwire); named per table, so that two
        # stores on one server never mix theirs up.
        tag = hashlib.sha256(t.encode()).hexdigest()[:10]
        self._tag = tag
        self._stmt_get = wire.Statement(f"onceonly_{tag}_get", select, [wire.TEXT])
        self._stmt_insert = wire.Statement(f"onceonly_{tag}_insert", insert, wire.COLUMN_TYPES)
        self._similar_ready = False
        self._sql_delete = f"DELETE FROM {t} WHERE key = %s AND version = %s"
        self._sql_delete_at = f"DELETE FROM {t} WHERE key = %s AND version = %s AND created_at = %s"
        self._sql_watch = f"UPDATE {t} SET watched = true WHERE key = %s AND version = %s"
        self._sql_count = f"SELECT state, count(*) FROM {t} GROUP BY state"
        self._sql_count_tools = f"SELECT tool, state, count(*) FROM {t} GROUP BY tool, state"
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
        self._aconnections: dict[asyncio.AbstractEventLoop, LoopConnections] = {}
        self._listener = Listener(self._conninfo, channel(self.schema)) if options.listen else None

        ensure_schema(url, options, self._where)
        self._pool = self._new_pool()
        _stores.add(self)

    def _new_pool(self) -> ConnectionPool[Connection]:
        options = self.options
        pool: ConnectionPool[Connection] = LifoPool(
            self._conninfo,
            connection_class=Connection,
            min_size=options.pool_min_size,
            max_size=options.pool_max_size,
            timeout=options.pool_timeout,
            kwargs=CONNECT_KWARGS,
            name=f"onceonly[{self.schema}]",
            open=False,
        )
        pool.open(wait=False)
        return pool

    def _forget_inherited(self) -> None:
        """In a forked child: the parent's pool, async connections and listener stay the parent's
        (set aside, their sockets already blinded); this process gets its own."""
        inherited.append((self._pool, self._aconnections, self._listener))
        self._lock = threading.Lock()
        self._aconnections = {}
        self._listener = Listener(self._conninfo, channel(self.schema)) if self.options.listen else None
        if not self._closed:
            self._pool = self._new_pool()

    # --- errors and connections -----------------------------------------------------------------------

    def _translate(self, exc: BaseException, cursor: bool = False, writing: bool = True) -> StoreError:
        """The store error for a driver error (``_errors.translate``); ``cursor``: it came from a
        statement sent through psycopg's cursor (``_run``), not a hot one; ``writing``: it writes."""
        return translate(exc, self._where, self.options, self._closed, cursor, writing)

    def _getconn(self) -> Connection:
        pool = self._pool
        try:
            for _ in range(self.options.pool_max_size + 1):
                conn = pool.getconn()
                dead = is_dead(conn)
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
            raise self._translate(exc, writing=False) from exc  # no statement was sent yet

    async def _aconns(self) -> LoopConnections:
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
            conns = self._aconnections[loop] = LoopConnections(
                self._conninfo, self.options, self._where, lambda exc: self._translate(exc, writing=False)
            )
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
        self, op: Callable[[Connection], T], rerun: bool = True, cursor: bool = False, writing: bool = True
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
                    raise self._translate(exc, cursor, writing) from exc
                self.reruns += 1
            finally:
                self._pool.putconn(conn)
            if _RERUN_PAUSES[runs]:
                time.sleep(_RERUN_PAUSES[runs])
            runs += 1

    def _run(self, sql: str, params: Sequence[Any], fetch: int, rerun: bool = True) -> tuple[Any, bool]:
        """One statement through the connection's cursor: its rows or its row count."""

        timeout = self.options.statement_timeout

        def op(conn: Connection) -> Any:
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

        return self._on_connection(op, rerun, cursor=True, writing=not _reads(sql))

    def _exec(self, stmt: wire.Statement, params: list[bytes | None]) -> tuple[pq.abc.PGresult, bool]:
        """One of the hot statements, prepared and binary (stores/_pgwire.py): its result."""

        if self._unnamed:
            timeout = self._timeout

            def unnamed(conn: Connection) -> pq.abc.PGresult:
                return conn.wait(wire.run_unnamed(conn.pgconn, stmt, params, timeout))

            return self._on_connection(unnamed, writing=stmt is not self._stmt_get)

        def op(conn: Connection) -> pq.abc.PGresult:
            prepared = conn.ledger_prepared
            if prepared is None:
                prepared = conn.ledger_prepared = set()
            return conn.wait(wire.run(conn.pgconn, prepared, stmt, params))

        return self._on_connection(op, writing=stmt is not self._stmt_get)

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

    def count_by_tool(self) -> dict[tuple[str, State], int]:
        """Records per (tool, state): the ``onceonly_records`` gauge's series, in one query."""
        rows, _ = self._run(self._sql_count_tools, (), _ALL)
        return counts_by_tool(rows)

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
        wait_for_change(self._listener, key, version, timeout, self._watch)

    # --- near-duplicate calls (onceonly.Similar): only tools with similar= come here -------------------

    def _ensure_similar(self) -> None:
        """Make the group tables on first use (``_similar.similar_ddl``), so that a ledger without
        similar= tools never has them."""
        if self._similar_ready:
            return
        _, locks = similar_tables(self.schema)
        statements = similar_ddl(self.schema, self._table)

        def op(conn: Connection) -> None:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_id(self.schema),))
                found = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (locks,)).fetchone()
                if not (found and found[0]):
                    for statement in statements:
                        conn.execute(statement)

        self._on_connection(op, cursor=True)
        self._similar_ready = True

    def similar_lock(
        self, group: str, token: str, now: float, until: float, since: float, limit: int
    ) -> list[Candidate] | None:
        self._ensure_similar()
        lock, read = similar_lock_sql(self.schema, self._table)
        timeout = self.options.statement_timeout

        # Two statements, pipelined into one round trip: the read must see every claim committed before
        # the lock was taken, and a statement's snapshot is its start (the lock may wait for the last
        # holder), so it is a statement of its own.
        def op(conn: Connection) -> tuple[int, list[Any]]:
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
        params = similar_claim_params(record, group, token)
        rows, _ = self._run(similar_claim_sql(self.schema, self._table), params, _ALL, False)
        freed, made = rows[0]
        if not freed:
            return False
        return None if made else self.get(record.key)

    def similar_unlock(self, group: str, token: str) -> None:
        _, locks = similar_tables(self.schema)
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
        self,
        op: Callable[[AsyncConnection], Awaitable[T]],
        rerun: bool = True,
        cursor: bool = False,
        writing: bool = True,
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
                    raise self._translate(exc, cursor, writing) from exc
                self.reruns += 1
            finally:
                await conns.put(conn)
            if _RERUN_PAUSES[runs]:
                await asyncio.sleep(_RERUN_PAUSES[runs])
            runs += 1

    async def _arun(self, sql: str, params: Sequence[Any], fetch: int, rerun: bool = True) -> tuple[Any, bool]:
        """``_run``, awaited."""

        timeout = self.options.statement_timeout

        async def op(conn: AsyncConnection) -> Any:
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

        return await self._aon_connection(op, rerun, cursor=True, writing=not _reads(sql))

    async def _aexec(self, stmt: wire.Statement, params: list[bytes | None]) -> tuple[pq.abc.PGresult, bool]:
        """``_exec``, awaited: the same generator, driven by the async connection."""

        if self._unnamed:
            timeout = self._timeout

            async def unnamed(conn: AsyncConnection) -> pq.abc.PGresult:
                return await conn.wait(wire.run_unnamed(conn.pgconn, stmt, params, timeout))

            return await self._aon_connection(unnamed, writing=stmt is not self._stmt_get)

        async def op(conn: AsyncConnection) -> pq.abc.PGresult:
            prepared = conn.ledger_prepared
            if prepared is None:
                prepared = conn.ledger_prepared = set()
            return await conn.wait(wire.run(conn.pgconn, prepared, stmt, params))

        return await self._aon_connection(op, writing=stmt is not self._stmt_get)

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

    async def _awatch(self, key: str, version: int) -> bool:
        """``_watch``, awaited."""
        count, _ = await self._arun(self._sql_watch, (key, version), _COUNT, rerun=False)
        return count == 1  # type: ignore[no-any-return]

    async def await_for_change(self, key: str, version: int, timeout: float) -> None:
        await await_for_change(self._listener, key, version, timeout, self._awatch)

    async def asimilar_lock(
        self, group: str, token: str, now: float, until: float, since: float, limit: int
    ) -> list[Candidate] | None:
        if not self._similar_ready:
            await asyncio.to_thread(self._ensure_similar)  # once per store
        lock, read = similar_lock_sql(self.schema, self._table)
        timeout = self.options.statement_timeout

        async def op(conn: AsyncConnection) -> tuple[int, list[Any]]:
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
        params = similar_claim_params(record, group, token)
        rows, _ = await self._arun(similar_claim_sql(self.schema, self._table), params, _ALL, False)
        freed, made = rows[0]
        if not freed:
            return False
        return None if made else await self.aget(record.key)

    async def asimilar_unlock(self, group: str, token: str) -> None:
        _, locks = similar_tables(self.schema)
        await self._arun(f"DELETE FROM {locks} WHERE grp = %s AND token = %s", (group, token), _COUNT)

    async def aclose(self) -> None:
        conns = self._aconnections.get(asyncio.get_running_loop())
        if conns is not None:
            conns.close_now()  # in its own loop's thread, before the rest is closed from a worker thread
        await asyncio.to_thread(self.close)

    def __repr__(self) -> str:
        return f"PostgresStore({redact_url(self.url)!r})"
