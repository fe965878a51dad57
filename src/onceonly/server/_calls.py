"""How the event loop calls the store (``IdempotencyMiddleware(store_calls=...)``): through its async
face, its sync face in a worker thread, or its sync face on the loop itself. The last is for a store
with the ``InlineStore`` capability (``stores.base``: SQLite without an fsync per commit), called
through connections that never wait on a lock; this module knows stores only by those protocols."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from onceonly.errors import StoreError, StoreUnavailable
from onceonly.plan import landed
from onceonly.states import Record
from onceonly.stores.base import AsyncStore, InlineStore, Store

__all__ = ["StoreCalls", "resolve_store_calls"]

CallMode = Literal["async", "thread", "inline"]


def resolve_store_calls(store: Store | None, store_calls: str) -> CallMode:
    """``store_calls`` with ``"auto"`` made concrete for ``store``; ``ValueError`` for an unknown mode."""
    if store_calls == "auto":
        if isinstance(store, InlineStore) and store.writes_inline():
            return "inline"  # without an fsync per commit, a write takes microseconds
        return "async" if isinstance(store, AsyncStore) else "thread"
    if store_calls not in ("async", "thread", "inline"):
        raise ValueError(f"store_calls={store_calls!r}: use 'auto', 'async', 'thread' or 'inline'")
    return store_calls  # type: ignore[return-value]


class StoreCalls:
    """The store of one middleware and the way its calls are made (``mode``: a resolved ``store_calls``).

    ``store`` is ``None`` once ``aclose`` closed a store the middleware opened itself.
    """

    __slots__ = ("_nowait", "mode", "store")

    def __init__(self, store: Store, mode: CallMode) -> None:
        self.store: Store | None = store
        self.mode = mode
        self._nowait: Store | None = None  # see _nowait_store

    async def call(self, op: str, *args: Any) -> Any:
        """``store.op(*args)`` (``aop`` with the async face), made the way ``mode`` says."""
        store = self.store
        assert store is not None
        if self.mode == "inline":
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
        if self.mode == "async":
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

    async def swap_now(self, new: Record, old: Record) -> tuple[bool, Record | None]:
        """``onceonly.runtime.swap_now``'s rule, awaited through ``call``: on a failed write, re-read; it
        landed exactly when the stored record is the one written. Returns (written, the record as it now
        is). Not ``runtime.swap_now`` itself: that one calls the sync face, which would hold the loop for
        the round trip, or leave the async face's connections (which belong to the loop) unused."""
        try:
            ok = await self.call("swap", new, old)
        except StoreError:
            current = await self.call("get", new.key)
            return landed(new, current), current
        return (True, new) if ok else (False, await self.call("get", new.key))

    async def aclose(self, *, owned: bool) -> None:
        """Close the connections opened for calls on the loop, and the store too when ``owned``."""
        nowait, self._nowait = self._nowait, None
        if nowait is not None:
            nowait.close()
        if not owned or self.store is None:
            return
        store, self.store = self.store, None
        closer = getattr(store, "aclose", None)
        if closer is not None:
            await closer()  # the async face's connections belong to this loop: close them on it
        store.close()
