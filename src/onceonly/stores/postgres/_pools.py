"""The PostgreSQL store's connections: the sync pool (LIFO), the async face's connections per event
loop, and what a forked child does with the ones it inherited."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from onceonly.errors import StoreError, StoreUnavailable
from onceonly.stores.postgres._url import PostgresOptions


def is_dead(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool | None:
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


# How the store's pooled and async connections are opened. prepare_threshold=None: psycopg's cursor
# never prepares a statement by itself (by default it does after 5 runs, and then keeps using it:
# after a DEALLOCATE ALL or DISCARD ALL behind its back, as a transaction pooler sends, every later
# run of that statement on the connection fails with 26000). The hot statements are prepared by
# _pgwire, which prepares them again when the backend forgot them.
CONNECT_KWARGS: dict[str, Any] = {"autocommit": True, "prepare_threshold": None}


# A forked child shares its parent's sockets: a statement sent on one by both processes gets the
# other's answer (a read of one key answered with another process's record), and closing one, even
# by the garbage collector at exit, sends Terminate and ends the parent's session. So every
# connection a ledger opens is listed here; in a child, each is pointed at /dev/null and kept, never
# used (``blind_inherited``), and every store starts a pool of its own.
opened: weakref.WeakSet[Any] = weakref.WeakSet()
inherited: list[object] = []


def blind_inherited() -> None:
    """In a forked child: point every connection of the parent at /dev/null, and keep it in ``inherited``."""
    parents = list(opened)
    opened.clear()
    if parents:
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for conn in parents:
                with contextlib.suppress(Exception):  # a closed one has no socket left
                    os.dup2(null, conn.pgconn.socket)
        finally:
            os.close(null)
        inherited.extend(parents)


class Connection(psycopg.Connection[Any]):
    """A pooled connection and what the store keeps on it: the names of the hot statements prepared
    on it (get, the claim's INSERT, the swaps' UPDATEs: ``_pgwire``, no cursor), and one binary cursor
    reused by the other statements (scan, count, delete, a waiter's mark), which are never prepared.
    """

    ledger_cursor: psycopg.Cursor[Any] | None = None
    ledger_prepared: set[bytes] | None = None  # names of the hot statements prepared on it (_pgwire)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        opened.add(self)


class LifoPool(ConnectionPool[Connection]):
    """A ``ConnectionPool`` that hands out the connection returned last (psycopg_pool's is FIFO).

    One caller making statement after statement then keeps talking to one warm backend instead of
    round-robin over every pooled one: replay 0.35 → 0.25 of the floor, first call 1.39 → 1.35
    (docs/benchmarks.md). The least recently used connections stay at the left end, where the pool's
    shrinking takes them. psycopg_pool has no public switch for this; if its internals change, the
    override steps aside and the pool stays FIFO (``tests/stores/test_postgres.py`` notices).
    """

    def _get_ready_connection(self, timeout: float | None) -> Connection | None:
        # Called under the pool's lock. The base class takes from the left: rotating the newest there
        # first makes its popleft() a pop(), and leaves the others in their order.
        idle = getattr(self, "_pool", None)
        if isinstance(idle, deque) and len(idle) > 1:
            idle.rotate(1)
        return super()._get_ready_connection(timeout)


class AsyncConnection(psycopg.AsyncConnection[Any]):
    """The async twin of ``Connection``."""

    ledger_cursor: psycopg.AsyncCursor[Any] | None = None
    ledger_prepared: set[bytes] | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        opened.add(self)


class LoopConnections:
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

    def __init__(
        self, conninfo: str, options: PostgresOptions, where: str, translate: Callable[[BaseException], StoreError]
    ) -> None:
        # where: the ledger as errors name it; translate: the store's, which knows whether it was closed.
        self.conninfo = conninfo
        self.options = options
        self.where = where
        self.translate = translate
        self.idle: list[AsyncConnection] = []
        self.slots = asyncio.Semaphore(options.pool_max_size)
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

    async def get(self) -> AsyncConnection:
        options = self.options
        if self.closed:
            raise StoreUnavailable(f"{self.where} was closed")
        if self.slots.locked():
            try:
                await asyncio.wait_for(self.slots.acquire(), options.pool_timeout)
            except TimeoutError:
                raise StoreUnavailable(
                    f"{self.where}: all {options.pool_max_size} async connections stayed busy for "
                    f"{options.pool_timeout:g}s (raise pool_max_size or pool_timeout in the URL)"
                ) from None
        else:
            await self.slots.acquire()  # free: returns without suspending
        try:
            while self.idle:
                conn = self.idle.pop()
                dead = is_dead(conn)
                if dead is None:
                    try:
                        await conn.execute("")
                        dead = False
                    except psycopg.Error:
                        dead = True
                if not dead:
                    return conn
                _close_now(conn)
            return await AsyncConnection.connect(self.conninfo, **CONNECT_KWARGS)
        except psycopg.Error as exc:
            self.slots.release()
            raise self.translate(exc) from exc
        except BaseException:
            self.slots.release()
            raise

    async def put(self, conn: AsyncConnection) -> None:
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
