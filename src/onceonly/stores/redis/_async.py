"""The async face: a client per event loop (``AsyncSide``) and the async primitives of ``RedisStore``."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Generator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import redis.asyncio
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, ResponseError

from onceonly.states import Record
from onceonly.stores.base import Query
from onceonly.stores.redis._codec import claim_args, decode, swap_args
from onceonly.stores.redis._layout import DOUBT, FAILURES, SCHEMA_VERSION, TRANSIENT
from onceonly.stores.redis._notify import ChangeHub, set_result
from onceonly.stores.redis._url import SentinelTarget, sentinel_kwargs

T = TypeVar("T")


class AsyncSide:
    """The async face's client and scripts for one event loop (redis.asyncio binds to its loop).

    The client must be closed on its own loop before that loop closes, or its sockets are reported
    as leaked. ``closer`` is an async generator started on the loop: a loop that shuts down the
    usual way (``asyncio.run``, any runner calling ``shutdown_asyncgens``) finalises it, and its
    ``finally`` closes the client there, even when nobody called ``aclose()``.
    """

    __slots__ = ("claim", "claim_again", "client", "closer", "delete", "sentinel", "swap", "swap_again")

    def __init__(self, url: str, scripts: Sequence[str], cluster: bool, sentinel: SentinelTarget | None) -> None:
        from redis.asyncio.retry import Retry as AsyncRetry

        # Retries off for the same reason as the sync client's (a blindly re-run script is not a no-op);
        # the cluster client still follows MOVED and ASK, which ran nothing.
        self.sentinel: Any = None
        if sentinel is not None:
            from redis.asyncio.connection import parse_url as async_parse_url
            from redis.asyncio.sentinel import Sentinel as AsyncSentinel

            kwargs, options = sentinel_kwargs(dict(async_parse_url(url)), sentinel)
            make: Any = AsyncSentinel  # untyped in redis-py
            self.sentinel = make(sentinel.sentinels, sentinel_kwargs=options, **kwargs)
            self.client: Any = self.sentinel.master_for(sentinel.service, retry=AsyncRetry(NoBackoff(), 0))
        else:
            kind: Any = redis.asyncio.RedisCluster if cluster else redis.asyncio.Redis
            self.client = kind.from_url(url, retry=AsyncRetry(NoBackoff(), 0))
        self.claim, self.claim_again, self.swap, self.swap_again, self.delete = (
            self.client.register_script(text) for text in scripts
        )
        self.closer = self._close_at_shutdown()

    async def _close_at_shutdown(self) -> AsyncGenerator[None, None]:
        try:
            yield
        finally:
            await self.client.aclose()
            if self.sentinel is not None:
                for client in self.sentinel.sentinels:
                    await client.aclose()


class AsyncPrimitives:
    """``RedisStore``'s async primitives (``onceonly.stores.base.AsyncStore``), on the running loop's client."""

    if TYPE_CHECKING:  # the store's, set in RedisStore.__init__ or defined there
        cluster: bool
        shards: int
        _async: dict[asyncio.AbstractEventLoop, AsyncSide]
        _client_url: str
        _scripts: tuple[str, ...]
        _target: SentinelTarget | None
        _wait: tuple[int, int] | None
        _meta_key: str
        _indexes: list[tuple[str, str, str, str, str]]
        _records: list[str]

        def _check_open(self) -> None: ...
        def _unavailable(self, exc: BaseException, what: str, writing: bool = False) -> Exception: ...
        def _shard(self, key: str) -> int: ...
        def _keys(self, key: str) -> list[str]: ...
        def _barrier(self, index: str) -> str: ...
        def _short(self, acked: Any) -> bool: ...
        def _check_acked(self, acked: Any) -> None: ...
        def _check_restored(self, stored: dict[bytes, bytes]) -> None: ...
        def _rerun_or_raise(self, exc: Exception, reruns: int, what: str) -> None: ...
        def _change_hub(self) -> ChangeHub | None: ...
        def _scan_plan(self, q: Query) -> Generator[list[tuple[Any, ...]], list[Any], list[Record]]: ...
        def close(self) -> None: ...

    async def _aevalsha(self, side: AsyncSide, script: Any, keys: list[str], args: tuple[Any, ...]) -> Any:
        if self._wait is None:
            return await side.client.evalsha(script.sha, len(keys), *keys, *args)
        return await self._awaited(side, keys[1], ("EVALSHA", script.sha, len(keys), *keys, *args))

    async def _awaited(self, side: AsyncSide, index: str, command: tuple[Any, ...]) -> Any:
        """``_waited`` awaited: the command, the barrier and ``WAIT`` in one pipeline (one connection);
        on a Cluster the barrier and ``WAIT`` on one connection of the command's node."""
        assert self._wait is not None
        n, ms = self._wait
        DOUBT.set(id(self))
        barrier = self._barrier(index)
        client: Any = side.client
        acked: Any
        if self.cluster:
            reply = await client.execute_command(*command)
            node = client.get_node_from_key(barrier)
            conn = node.acquire_connection()
            try:
                await conn.send_packed_command(conn.pack_commands([("SET", barrier, "1"), ("WAIT", n, ms)]))
                await conn.read_response()
                acked = await conn.read_response()
            except ResponseError as exc:
                await conn.disconnect()  # the other reply may be unread
                acked = exc
            except BaseException:
                await conn.disconnect()
                raise
            finally:
                node.release(conn)
        else:
            pipe = client.pipeline(transaction=False)
            pipe.execute_command(*command)
            pipe.execute_command("SET", barrier, "1")
            pipe.execute_command("WAIT", n, ms)
            reply, _, acked = await pipe.execute(raise_on_error=False)
            if isinstance(reply, Exception):
                raise reply
            if self._short(acked):  # as in _waited: connect anew (the pipeline's connection is idle now)
                await client.connection_pool.disconnect(inuse_connections=False)
        self._check_acked(acked)
        return reply

    async def _ascript(self, side: AsyncSide, script: Any, keys: list[str], args: tuple[Any, ...]) -> Any:
        """``_script`` awaited, on the event loop's client."""
        client: Any = side.client
        try:
            return await self._aevalsha(side, script, keys, args)
        except NoScriptError:
            meta = self._meta_key
            pipe = client.pipeline(transaction=False)
            pipe.hsetnx(meta, "schema", SCHEMA_VERSION)
            pipe.hsetnx(meta, "shards", self.shards)
            pipe.hgetall(meta)
            self._check_restored((await pipe.execute())[2])
            await client.script_load(script.script)
            return await self._aevalsha(side, script, keys, args)

    # --- the primitives, async --------------------------------------------------------------------

    async def _side(self) -> AsyncSide:
        loop = asyncio.get_running_loop()
        side = self._async.get(loop)
        if side is not None:
            return side
        self._check_open()
        # Forget the clients of loops that are gone (their shutdown closed them).
        self._async = {lp: sd for lp, sd in self._async.items() if not lp.is_closed()}
        side = self._async[loop] = AsyncSide(self._client_url, self._scripts, self.cluster, self._target)
        await side.closer.__anext__()  # started here, so this loop's shutdown finalises it
        return side

    async def aget(self, key: str) -> Record | None:
        self._check_open()
        shard = self._shard(key)
        rk = self._records[shard] + key
        side = await self._side()
        client: Any = side.client
        try:
            if self._wait is not None and DOUBT.get() == id(self):  # as in get()
                d, a = await self._awaited(side, self._indexes[shard][0], ("HMGET", rk, "d", "a"))
            else:
                try:
                    d, a = await client.execute_command("HMGET", rk, "d", "a")
                except TRANSIENT:
                    d, a = await client.execute_command("HMGET", rk, "d", "a")
        except FAILURES as exc:
            raise self._unavailable(exc, f"reading {key!r}") from exc
        return None if d is None else decode(key, d, a)

    async def _awrite(
        self, side: AsyncSide, script: Any, again: Any, keys: list[str], args: tuple[Any, ...], what: str
    ) -> Any:
        """``_write`` awaited: a write script, and its exact "again" twin if the connection fails."""
        run, reruns = script, 0
        while True:
            try:
                return await self._ascript(side, run, keys, args)
            except FAILURES as exc:
                self._rerun_or_raise(exc, reruns, what)
            run, reruns = again, reruns + 1

    async def aclaim(self, record: Record) -> Record | None:
        self._check_open()
        side = await self._side()
        args = claim_args(record)
        got = await self._awrite(
            side, side.claim, side.claim_again, self._keys(record.key), args, f"claiming {record.key!r}"
        )
        return None if got == 1 else decode(record.key, got[0], got[1])

    async def ainsert(self, record: Record) -> bool:
        return await self.aclaim(record) is None

    async def aswap(self, record: Record, expected: Record) -> bool:
        self._check_open()
        side = await self._side()
        args = swap_args(record, expected)
        written = await self._awrite(
            side, side.swap, side.swap_again, self._keys(record.key), args, f"writing {record.key!r}"
        )
        return bool(written == 1)

    async def adelete(self, key: str, expected_version: int, created_at: float | None = None) -> bool:
        self._check_open()
        args = (expected_version,) if created_at is None else (expected_version, repr(created_at))
        try:
            side = await self._side()
            return bool(await self._ascript(side, side.delete, self._keys(key), args) == 1)
        except FAILURES as exc:
            raise self._unavailable(exc, f"deleting {key!r}", writing=True) from exc

    async def _arun(self, gen: Generator[list[tuple[Any, ...]], list[Any], T], what: str) -> T:
        self._check_open()
        client: Any = (await self._side()).client
        try:
            batch = next(gen)
            while True:
                for attempt in (1, 2):
                    pipe = client.pipeline(transaction=False)
                    for command in batch:
                        pipe.execute_command(*command)
                    try:
                        answers = await pipe.execute()
                        break
                    except TRANSIENT:
                        if attempt == 2:
                            raise
                batch = gen.send(answers)
        except StopIteration as stop:
            result: T = stop.value
            return result
        except FAILURES as exc:
            raise self._unavailable(exc, what) from exc

    async def ascan(self, query: Query) -> list[Record]:
        return await self._arun(self._scan_plan(query), "scanning the ledger")

    async def await_for_change(self, key: str, version: int, timeout: float) -> None:
        if timeout <= 0:
            return
        hub = self._change_hub()
        if hub is None:
            await asyncio.sleep(timeout)
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def notify() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
                loop.call_soon_threadsafe(set_result, fut)

        if not hub.register(key, version, notify):
            return
        try:
            await asyncio.wait((fut,), timeout=timeout)
        finally:
            hub.unregister(key, notify)

    async def aclose(self) -> None:
        side = self._async.pop(asyncio.get_running_loop(), None)
        if side is not None:
            await side.closer.aclose()
        self.close()
