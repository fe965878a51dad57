"""Change notifications: the pub/sub listener that wakes the waiters of a key when its record changes."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import RedisClusterException, RedisError, ResponseError

from onceonly.stores.redis._layout import log

Notify = Callable[[], None]


class ChangeHub:
    """One pub/sub listener thread per store and process; sync and async waiters register with it.

    Every script that changes a record publishes ``"<version> <key>"`` on its shard's channel. The
    listener wakes the waiters of that key whose version differs, and remembers the last version
    it saw per key, so that a waiter who registers after the change (it read the record, then the
    change came, then it registered) returns at once instead of sleeping out its timeout. While
    the listener is not subscribed (starting, or the connection dropped), waiters just sleep their
    timeout: the guard reads again after each wait, so a missed message costs time, never
    correctness. Every (re)subscription wakes all waiters, since messages may have been missed.
    The thread stops after ``idle_seconds`` without waiters, so a process that waited once does
    not keep receiving every change of the ledger.
    """

    def __init__(self, client: Any, channels: Sequence[str], *, idle_seconds: float = 5.0) -> None:
        self._client: Any = client  # redis-py's pubsub() is untyped
        self._channels = list(channels)
        self._idle = idle_seconds
        self._lock = threading.Lock()
        self._waiters: dict[str, list[tuple[int, Notify]]] = {}
        self._seen: dict[str, int] = {}
        self._thread: threading.Thread | None = None
        self._last_waiter = time.monotonic()
        self._closed = False
        self.subscribed = threading.Event()
        self._warned = False

    def register(self, key: str, version: int, notify: Notify) -> bool:
        """Add a waiter; ``False`` when the key already changed past ``version`` (do not wait)."""
        with self._lock:
            if self._closed:
                return False
            seen = self._seen.get(key)
            if seen is not None and seen != version:
                return False
            self._waiters.setdefault(key, []).append((version, notify))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="onceonly-redis-changes", daemon=True)
                self._thread.start()
        return True

    def unregister(self, key: str, notify: Notify) -> None:
        with self._lock:
            waiting = self._waiters.get(key)
            if waiting is None:
                return
            waiting[:] = [w for w in waiting if w[1] is not notify]
            if not waiting:
                del self._waiters[key]
            if not self._waiters:
                self._last_waiter = time.monotonic()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)

    def _wake_all(self) -> None:
        with self._lock:
            notifies = [n for waiting in self._waiters.values() for _, n in waiting]
        for notify in notifies:
            notify()

    def _should_stop(self) -> bool:
        with self._lock:
            if self._closed or (not self._waiters and time.monotonic() - self._last_waiter > self._idle):
                self._thread = None
                self._seen.clear()
                self.subscribed.clear()
                return True
            return False

    def _run(self) -> None:
        backoff = 0.05
        while not self._should_stop():
            pubsub = self._client.pubsub()
            try:
                pubsub.subscribe(*self._channels)
                confirmed = 0
                while not self._should_stop():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg is None:
                        continue
                    if msg["type"] == "subscribe":
                        confirmed += 1
                        if confirmed == len(self._channels):
                            self.subscribed.set()
                            backoff = 0.05
                            self._wake_all()
                    elif msg["type"] == "message":
                        self._dispatch(msg["data"])
            except (RedisError, RedisClusterException, OSError, ValueError) as exc:
                self.subscribed.clear()
                with self._lock:
                    self._seen.clear()  # what changed while we were away is unknown
                if isinstance(exc, ResponseError) and not self._warned:
                    self._warned = True
                    log.warning("onceonly: Redis refused SUBSCRIBE (%s); waiters fall back to polling", exc)
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                with contextlib.suppress(RedisError, OSError):  # closing a broken connection
                    pubsub.close()

    def _dispatch(self, data: bytes) -> None:
        raw_version, _, raw_key = data.partition(b" ")
        key = raw_key.decode("utf-8", "replace")
        version = int(raw_version)
        with self._lock:
            if len(self._seen) > 100_000:
                self._seen.clear()  # a bound on memory; forgetting only costs a waiter its timeout
            self._seen[key] = version
            waiting = self._waiters.get(key)
            notifies = [n for v, n in waiting if v != version] if waiting else []
        for notify in notifies:
            notify()


def set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
