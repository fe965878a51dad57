"""Waiting without spinning: one LISTEN connection per store, in a daemon thread, wakes the waiters of
both faces (the trigger that sends the NOTIFY is in ``_schema``)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from onceonly.errors import StoreError
from onceonly.stores.postgres._names import ident, log
from onceonly.stores.postgres._pools import opened


class Waiter:
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


class Listener:
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
        self._waiters: dict[str, set[Waiter]] = {}
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
            opened.add(conn)
            try:
                # LISTEN is in force once it returns: changes committed from now on reach us.
                conn.execute(f"LISTEN {ident(self.channel)}")
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
            log.info(
                "onceonly: lost the LISTEN connection of channel %s (%s); waiters poll until it is back",
                self.channel,
                exc,
            )
        except Exception:  # never let a surprise kill the thread silently: waiters would only poll
            log.exception("onceonly: the LISTEN thread of channel %s failed", self.channel)
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

    def register(self, key: str, waiter: Waiter) -> bool | None:
        """Add a waiter. ``None``: not listening (poll). ``True``: the row must be marked watched."""
        with self._lock:
            if not self.alive:
                return None
            self._waiters.setdefault(key, set()).add(waiter)
            return self._flagged.get(key) != waiter.version

    def flagged(self, key: str, waiter: Waiter) -> None:
        """The row of ``key`` is now marked watched at the waiter's version."""
        with self._lock:
            # A waiter already woken saw a change or a lost connection: the mark is no longer known.
            if waiter.woken or not self.alive:
                return
            self._flagged[key] = waiter.version
            self._flagged.move_to_end(key)
            if len(self._flagged) > self.FLAGGED_LIMIT:
                self._flagged.popitem(last=False)

    def unregister(self, key: str, waiter: Waiter) -> None:
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


def wait_for_change(
    listener: Listener | None, key: str, version: int, timeout: float, watch: Callable[[str, int], bool]
) -> None:
    """A store's ``wait_for_change``: wait for a notification about ``key`` (``watch`` marks its row
    watched if it is still at ``version``), or poll when not listening."""
    if timeout <= 0:
        return
    if listener is None or not listener.start():
        time.sleep(timeout)  # polling: the caller reads again after the pause
        return
    waiter = Waiter(version)
    status = listener.register(key, waiter)
    if status is None:
        time.sleep(timeout)
        return
    try:
        if status:
            # Mark the row after LISTEN is in force, and check the version in the same statement:
            # a change before it fails the update, a change after it notifies us.
            try:
                if not watch(key, version):
                    return
            except StoreError:
                time.sleep(timeout)  # the caller's next read reports the outage
                return
            listener.flagged(key, waiter)
        assert waiter.event is not None
        waiter.event.wait(timeout)
    finally:
        listener.unregister(key, waiter)


async def await_for_change(
    listener: Listener | None,
    key: str,
    version: int,
    timeout: float,
    watch: Callable[[str, int], Awaitable[bool]],
) -> None:
    """``wait_for_change``, awaited."""
    if timeout <= 0:
        return
    # Connecting the listener blocks: off the loop, once.
    if listener is None or not (listener.alive or await asyncio.to_thread(listener.start)):
        await asyncio.sleep(timeout)
        return
    waiter = Waiter(version, asyncio.get_running_loop())
    status = listener.register(key, waiter)
    if status is None:
        await asyncio.sleep(timeout)
        return
    try:
        if status:
            try:
                if not await watch(key, version):
                    return
            except StoreError:
                await asyncio.sleep(timeout)
                return
            listener.flagged(key, waiter)
        assert waiter.future is not None
        await asyncio.wait((waiter.future,), timeout=timeout)
    finally:
        listener.unregister(key, waiter)
