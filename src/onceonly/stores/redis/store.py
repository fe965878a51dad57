"""``RedisStore``: its clients, the keys of a record, errors, and the sync primitives."""

from __future__ import annotations

import asyncio
import os
import threading
import time
import weakref
import zlib
from collections.abc import Generator
from typing import Any, TypeVar

import redis
import redis.sentinel
from redis.backoff import NoBackoff
from redis.exceptions import AskError, NoScriptError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError

try:  # redis-py's own packer wraps it in ~2 µs of Python per command (argument splitting, a copy)
    from hiredis import pack_command as _pack_command
except ImportError:  # pragma: no cover - the redis extra installs hiredis
    _pack_command = None  # type: ignore[assignment]

from onceonly.errors import StoreCorrupt, StoreError, StoreUnavailable
from onceonly.states import Record, State
from onceonly.stores.base import Query
from onceonly.stores.redis._async import AsyncPrimitives, AsyncSide
from onceonly.stores.redis._budgets import BudgetCalls
from onceonly.stores.redis._codec import claim_args, decode, swap_args
from onceonly.stores.redis._controls import Controls
from onceonly.stores.redis._layout import DOUBT, FAILURES, SCHEMA_VERSION, TRANSIENT
from onceonly.stores.redis._notify import ChangeHub
from onceonly.stores.redis._plans import count_plan, scan_plan
from onceonly.stores.redis._scripts import scripts_for
from onceonly.stores.redis._setup import Opening
from onceonly.stores.redis._similar import SimilarCalls
from onceonly.stores.redis._url import SentinelTarget, parse_redis_url, sentinel_kwargs, where

T = TypeVar("T")


class _Undurable(RedisError):
    """A write (``replicas=N``) that fewer than N replicas acknowledged within the timeout: it is on the
    master, and whether it survives a failover is unknown."""


_fork_generation = 0


def _after_fork() -> None:
    global _fork_generation
    _fork_generation += 1


os.register_at_fork(after_in_child=_after_fork)

#: How many times a claim or swap whose connection failed is re-run (with its "again" twin).
RERUNS = 2


class RedisStore(Opening, SimilarCalls, BudgetCalls, Controls, AsyncPrimitives):
    """An onceonly ledger in Redis: one server, or a Redis Cluster.

    Args:
        url: ``redis://[user:password@]host:6379/0``, ``rediss://…`` (TLS) or ``unix:///path.sock``;
            ``redis+cluster://host:7000`` (or ``cluster=true``) for a Redis Cluster, naming any node,
            with onceonly's options in the query: ``prefix`` (key namespace, default ``onceonly``),
            ``shards`` (index shards, default 16; fixed for the life of a prefix),
            ``warn_persistence=false`` to silence the warning about a server that persists nothing, and
            ``allow_eviction=true`` to accept a server that evicts keys when its memory is full.
            Other query parameters go to redis-py (``socket_timeout=5``, ``max_connections``…).

    Opening checks the server: it must answer, the prefix must hold an onceonly ledger of this
    schema and shard count (or nothing yet: then no records either, since records without their
    metadata could be of another shard count), its ``maxmemory-policy`` must not evict keys (an evicted
    record is a call that runs again), and a server that persists nothing gets a warning logged on
    ``onceonly.stores.redis``, since a restart would lose the ledger. On a Cluster, every master's
    eviction policy and persistence are checked, and the scripts are loaded on every master.

    Raises:
        StoreUnavailable: the server cannot be reached.
        StoreCorrupt: the prefix holds something else, a ledger of another schema, or records whose
            metadata is gone.
        StoreError: the server evicts keys (``allow_eviction=true`` accepts it), or the URL's kind (one
            server, a Cluster) does not match the server's.
        ValueError: a bad URL, or another shard count than the ledger was made with.

    .. versionadded:: 0.1
    """

    def __init__(self, url: str) -> None:
        self.url = url
        client_url, opts = parse_redis_url(url)
        self._client_url = client_url
        self.prefix: str = opts["prefix"]
        self.shards: int = opts["shards"]
        self._where = where(url)
        #: A Redis Cluster client (``redis+cluster://`` or ``cluster=true``), else one endpoint's.
        self.cluster: bool = opts["cluster"]
        #: Where the sentinels are, for a ``redis+sentinel://`` URL.
        self._target: SentinelTarget | None = opts["sentinel"]
        #: ``replicas=N``: each write waits for N replicas (``WAIT N ms``); None when it waits for none.
        self.replicas: int = opts["replicas"]
        self._wait: tuple[int, int] | None = (
            (self.replicas, max(1, round(opts["replicas_timeout"] * 1000))) if self.replicas else None
        )
        self._sentinel: Any = None  # a redis.sentinel.Sentinel for redis+sentinel://
        # One pool. Pipelines, scans, the pub/sub listener and opening use it through `_client`; the
        # hot primitives use one single-connection client per thread on the same pool (`_thread`):
        # that skips the pool's check-out and its "has this idle connection data?" probe, about a
        # third of redis-py's own cost per command. A connection killed while idle then fails on its
        # next command instead: reads retry once, writes re-run exactly (`_write`).
        # On a Cluster, redis-py's cluster client routes every command by its keys' slot and follows
        # MOVED and ASK (which ran nothing); its own re-runs after a failed connection are off too.
        self._pool: redis.ConnectionPool | None = None
        self._client: Any  # redis.Redis or redis.RedisCluster
        if self.cluster:
            try:
                self._client = redis.RedisCluster.from_url(client_url, retry=redis.retry.Retry(NoBackoff(), 0))
            except FAILURES as exc:
                raise self._unavailable(exc, "opening the ledger") from exc
        elif self._target is not None:
            # redis-py's Sentinel asks the sentinels for the master's address at every new connection,
            # and a connection to a master since demoted fails (READONLY) and connects anew.
            parse: Any = redis.connection.parse_url  # untyped in redis-py, like Sentinel
            kwargs, options = sentinel_kwargs(parse(client_url), self._target)
            make: Any = redis.sentinel.Sentinel
            self._sentinel = make(self._target.sentinels, sentinel_kwargs=options, **kwargs)
            self._client = self._sentinel.master_for(self._target.service, retry=redis.retry.Retry(NoBackoff(), 0))
            self._pool = self._client.connection_pool
        else:
            self._pool = redis.ConnectionPool.from_url(client_url, retry=redis.retry.Retry(NoBackoff(), 0))
            self._client = redis.Redis(connection_pool=self._pool)
        self._local = threading.local()
        self._thread_clients: weakref.WeakSet[redis.Redis] = weakref.WeakSet()
        self._scripts = scripts_for(self.shards)
        self._claim, self._claim_again, self._swap, self._swap_again, self._delete = (
            self._client.register_script(text) for text in self._scripts
        )
        self._meta_key = f"{self.prefix}:meta"
        self._tags = [f"{self.prefix}:{{{self.prefix}:{s}}}" for s in range(self.shards)]
        self._records = [f"{tag}:r:" for tag in self._tags]
        self._indexes = [(f"{t}:k", f"{t}:o", f"{t}:h", f"{t}:e", f"{t}:n") for t in self._tags]
        self._async: dict[asyncio.AbstractEventLoop, AsyncSide] = {}
        self._hub: ChangeHub | None = None
        self._hub_pid = 0
        self._hub_lock = threading.Lock()
        self._closed = False
        #: Writes re-run (exactly, by their "again" twin) after their connection failed.
        self.reruns = 0
        try:
            self._open(warn=opts["warn_persistence"], allow_eviction=opts["allow_eviction"])
        except BaseException:
            self._client.close()
            if self._sentinel is not None:
                self._sentinel.close()
            raise

    # --- errors -----------------------------------------------------------------------------------

    def _unavailable(self, exc: BaseException, what: str, writing: bool = False) -> Exception:
        """The store error for a driver error while ``what``; ``writing``: a write was sent, so
        whether it landed is unknown (a read or an open changed nothing, and says so)."""
        if isinstance(exc, AskError) and not self.cluster:  # MOVED or ASK: the key's slot is on another node
            return StoreError(
                f"the Redis server at {self._where} is a node of a Redis Cluster that does not serve every slot "
                f"({exc}) while {what}: open the ledger with redis+cluster://host:port (or cluster=true), so "
                "that each command goes to the node that holds its keys"
            )
        if isinstance(exc, RedisClusterException) and "not enabled" in str(exc):
            return StoreError(
                f"the Redis server at {self._where} is not in cluster mode ({exc}): open it with redis:// and "
                "without cluster=true"
            )
        if isinstance(exc, ResponseError) and str(exc).startswith("WRONGTYPE"):
            return StoreCorrupt(
                f"{self._where}: a key under prefix {self.prefix!r} is not what onceonly wrote ({exc}) while "
                f"{what}. Nothing was changed: check what else writes under this prefix"
            )
        if isinstance(exc, _Undurable):
            assert self._wait is not None
            return StoreUnavailable(
                f"the Redis ledger at {self._where}, while {what}: fewer replicas than replicas={self.replicas} "
                f"acknowledged the write within {self._wait[1] / 1000:g} s ({exc}). The master has it, but whether "
                "it survives a failover is unknown, so it counts as not made: nothing runs on it. A replica is down "
                "or lagging, or a failover is under way: call again once the master has its replicas in sync"
            )
        # The driver's text may end with its own full stop; the sentences after it add theirs.
        text = str(exc).strip().rstrip(".").strip()
        landed = (
            "Whether the write landed is unknown; the ledger re-reads the record before it decides anything"
            if writing
            else "It was a read or an open, which changes nothing: try again once the server answers"
        )
        return StoreUnavailable(
            f"the Redis ledger at {self._where} failed while {what}: {type(exc).__name__}: {text}. {landed}"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise StoreUnavailable(f"the ledger {self._where} (prefix {self.prefix!r}) was closed")

    # --- keys -------------------------------------------------------------------------------------

    def _shard(self, key: str) -> int:
        return zlib.crc32(key.encode("utf-8", "surrogatepass")) % self.shards

    def _keys(self, key: str) -> list[str]:
        """Every Redis key a script touches for ``key``: one hash slot (tests check it)."""
        shard = self._shard(key)
        i = self._indexes[shard]
        return [self._records[shard] + key, i[0], i[1], i[2], i[3], i[4]]

    @property
    def channels(self) -> list[str]:
        """The pub/sub channels, one per shard."""
        return [f"{tag}:c" for tag in self._tags]

    def _thread(self) -> Any:
        """This thread's single-connection client (a new one after a fork: sockets are not shared)."""
        local = self._local
        client = getattr(local, "client", None)
        if client is None or local.generation != _fork_generation:
            self._check_open()
            client = redis.Redis(connection_pool=self._pool, single_connection_client=True)  # never on a Cluster
            local.client, local.conn, local.generation = client, client.connection, _fork_generation
            self._thread_clients.add(client)
        return client

    def _command(self, *args: Any) -> Any:
        """One command on this thread's connection, below redis-py's client layer.

        ``Redis.execute_command`` wraps every command in a retry object, a lock, timing and error
        callbacks, and a response-callback lookup: about 25 µs of Python per command here, a quarter of
        a loopback round trip, for nothing the hot primitives use (retries are off, the connection is
        this thread's alone, the replies of ``EVALSHA`` and ``HMGET`` need no callback). The
        connection itself still reconnects when its socket is gone, closes it on any error, and raises
        the same exceptions; the command is packed by hiredis directly when it is installed.
        """
        if self.cluster:  # routed by the keys' slot, following MOVED and ASK
            return self._client.execute_command(*args)
        local = self._local
        conn = getattr(local, "conn", None)
        if conn is None or local.generation != _fork_generation:
            self._thread()
            conn = local.conn
        conn.send_packed_command([_pack_command(args)] if _pack_command is not None else conn.pack_command(*args))
        try:
            return conn.read_response()
        except TRANSIENT:
            self._drop_connection(conn)
            raise

    def _drop_connection(self, conn: Any) -> None:
        """Close this thread's connection after a failure, and make the next command take a new one from
        the pool. A reply left unread would answer the next command (redis-py's own connection closes
        itself then; a Sentinel-managed one leaves it to the client layer), and only the pool's check-out
        asks the sentinels where the master is now: a connection that merely reconnects itself goes back
        to the address it had, a master since demoted."""
        conn.disconnect()
        local = self._local
        client = getattr(local, "client", None)
        local.client = local.conn = None
        if client is not None:
            client.close()

    def _evalsha(self, script: Any, keys: list[str], args: tuple[Any, ...]) -> Any:
        if self._wait is None:
            return self._command("EVALSHA", script.sha, len(keys), *keys, *args)
        return self._waited(keys[1], ("EVALSHA", script.sha, len(keys), *keys, *args))

    def _barrier(self, index: str) -> str:
        """The shard's barrier key, from its all-keys index ``<tag>:k``: written right before ``WAIT``."""
        return index[:-1] + "w"

    def _waited(self, index: str, command: tuple[Any, ...]) -> Any:
        """``command``, then a write of its shard's barrier key and ``WAIT replicas ms``, on one connection
        and in one packet (on a Cluster: the command, then the barrier and ``WAIT`` on its node).

        ``WAIT`` returns once that many replicas have everything the master did up to this connection's
        last write. The barrier (in the command's slot, so on its node) is that write: it comes after the
        command, and after anything anyone wrote on the record before, so the acknowledgement covers the
        record as the command left or found it, even when the command itself wrote nothing (an "again"
        re-run, a read). Raises ``_Undurable`` when fewer replicas answer in time.
        """
        assert self._wait is not None
        n, ms = self._wait
        DOUBT.set(id(self))  # until the replicas say otherwise
        barrier = self._barrier(index)
        if self.cluster:
            reply = self._client.execute_command(*command)
            node = self._client.get_redis_connection(self._client.get_node_from_key(barrier))
            pipe = node.pipeline(transaction=False)
            pipe.execute_command("SET", barrier, "1")
            pipe.execute_command("WAIT", n, ms)
            try:
                acked = pipe.execute()[1]
            except ResponseError as exc:  # a slot that moved, a node now a replica
                acked = exc
        else:
            local = self._local
            if getattr(local, "conn", None) is None or local.generation != _fork_generation:
                self._thread()
            conn = local.conn
            packed = [command, ("SET", barrier, "1"), ("WAIT", n, ms)]
            conn.send_packed_command(
                [_pack_command(c) for c in packed] if _pack_command is not None else conn.pack_commands(packed)
            )
            try:
                try:
                    reply = conn.read_response()
                except ResponseError as exc:  # the server's answer to the command: the other two follow
                    reply = exc
                conn.read_response()
                try:
                    acked = conn.read_response()
                except ResponseError as exc:  # WAIT refused (a replica now), or unblocked by a role change
                    acked = exc
            except TRANSIENT:
                self._drop_connection(conn)
                raise
            if isinstance(reply, Exception):
                raise reply
            if self._short(acked):
                # A master that lost its replicas may have lost its post too (a failover promoted one of
                # them): connect anew, which under Sentinel asks the sentinels where the master is now.
                self._drop_connection(conn)
        self._check_acked(acked)
        return reply

    def _short(self, acked: Any) -> bool:
        assert self._wait is not None
        return isinstance(acked, Exception) or int(acked) < self._wait[0]

    def _check_acked(self, acked: Any) -> None:
        assert self._wait is not None
        n, ms = self._wait
        if self._short(acked):
            got = f"the master answered {acked}" if isinstance(acked, Exception) else f"{acked} of {n} did"
            raise _Undurable(f"replicas={n}: WAIT {n} {ms} returned before enough replicas acknowledged ({got})")
        DOUBT.set(0)

    def _script(self, script: Any, keys: list[str], args: tuple[Any, ...]) -> Any:
        """``EVALSHA`` of one of our scripts; loaded again if the server lost it (restart, failover, FLUSH)."""
        try:
            return self._evalsha(script, keys, args)
        except NoScriptError:
            # NOSCRIPT ran nothing: loading the script and running it now is the first run. A server that
            # lost its scripts may have lost the ledger's metadata with them: restore it first.
            meta = self._meta_key
            self._command("HSETNX", meta, "schema", SCHEMA_VERSION)
            self._command("HSETNX", meta, "shards", self.shards)
            stored = self._command("HGETALL", meta)  # a map (RESP3) or a flat list (RESP2)
            if not isinstance(stored, dict):
                stored = dict(zip(stored[::2], stored[1::2], strict=True))
            self._check_restored(stored)
            self._command("SCRIPT", "LOAD", script.script)
            return self._evalsha(script, keys, args)

    # --- the primitives, sync ---------------------------------------------------------------------

    def get(self, key: str) -> Record | None:
        self._check_open()
        shard = self._shard(key)
        rk = self._records[shard] + key
        try:
            if self._wait is not None and DOUBT.get() == id(self):
                # The last write here was not acknowledged by the replicas: what this read finds (that
                # write, say) counts only once they have it too. Not retried: a new connection's WAIT
                # would not cover the read.
                d, a = self._waited(self._indexes[shard][0], ("HMGET", rk, "d", "a"))
            else:
                try:
                    d, a = self._command("HMGET", rk, "d", "a")
                except TRANSIENT:
                    d, a = self._command("HMGET", rk, "d", "a")  # a read is safe to repeat
        except FAILURES as exc:
            raise self._unavailable(exc, f"reading {key!r}") from exc
        return None if d is None else decode(key, d, a)

    def time(self) -> float:
        """The server's clock (``TIME``), in seconds since the epoch: the ledger's time for every host
        (``onceonly.clock``). On a Cluster, the clock of the node that holds the ledger's metadata, so
        that every process reads the same node's clock."""
        self._check_open()
        try:
            if self.cluster:
                node = self._client.get_node_from_key(self._meta_key)
                seconds, micros = self._client.execute_command("TIME", target_nodes=node)
            else:
                seconds, micros = self._command("TIME")
        except FAILURES as exc:
            raise self._unavailable(exc, "reading the server's clock") from exc
        return int(seconds) + int(micros) / 1e6

    def _rerun_or_raise(self, exc: Exception, reruns: int, what: str) -> None:
        """After a write script failed: return if its "again" twin should run now, else raise.

        Only a failed connection is re-run, at most RERUNS times: a timeout has already waited
        socket_timeout, and any other error is the server's answer. What is raised is the store's error;
        the guard then re-reads the record to learn whether the write landed.
        """
        if not isinstance(exc, RedisConnectionError) or reruns == RERUNS:
            raise self._unavailable(exc, what, writing=True) from exc
        self.reruns += 1

    def _write(self, script: Any, again: Any, keys: list[str], args: tuple[Any, ...], what: str) -> Any:
        """Run a write script; if its connection fails, its "again" twin, which is exact, up to RERUNS times."""
        run, reruns = script, 0
        while True:
            try:
                return self._script(run, keys, args)
            except FAILURES as exc:
                self._rerun_or_raise(exc, reruns, what)
            run, reruns = again, reruns + 1

    def claim(self, record: Record) -> Record | None:
        self._check_open()
        args = claim_args(record)
        got = self._write(self._claim, self._claim_again, self._keys(record.key), args, f"claiming {record.key!r}")
        return None if got == 1 else decode(record.key, got[0], got[1])

    def insert(self, record: Record) -> bool:
        return self.claim(record) is None

    def swap(self, record: Record, expected: Record) -> bool:
        self._check_open()
        args = swap_args(record, expected)
        return bool(
            self._write(self._swap, self._swap_again, self._keys(record.key), args, f"writing {record.key!r}") == 1
        )

    def delete(self, key: str, expected_version: int, created_at: float | None = None) -> bool:
        self._check_open()
        args = (expected_version,) if created_at is None else (expected_version, repr(created_at))
        try:
            return bool(self._script(self._delete, self._keys(key), args) == 1)
        except FAILURES as exc:
            raise self._unavailable(exc, f"deleting {key!r}", writing=True) from exc

    def _run(self, gen: Generator[list[tuple[Any, ...]], list[Any], T], what: str) -> T:
        """Drive a read plan: each batch of commands it yields is one pipeline, one round trip."""
        self._check_open()
        try:
            batch = next(gen)
            while True:
                for attempt in (1, 2):
                    pipe: Any = self._client.pipeline(transaction=False)
                    for command in batch:
                        pipe.execute_command(*command)
                    try:
                        answers = pipe.execute()
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

    def scan(self, query: Query) -> list[Record]:
        return self._run(self._scan_plan(query), "scanning the ledger")

    def count_by_state(self) -> dict[State, int]:
        return self._run(self._count_plan(), "counting records")

    def wait_for_change(self, key: str, version: int, timeout: float) -> None:
        if timeout <= 0:
            return
        hub = self._change_hub()
        if hub is None:
            time.sleep(timeout)
            return
        event = threading.Event()
        if not hub.register(key, version, event.set):
            return
        try:
            event.wait(timeout)
        finally:
            hub.unregister(key, event.set)

    def close(self) -> None:
        self._closed = True
        with self._hub_lock:
            hub, self._hub = self._hub, None
        if hub is not None:
            hub.close()
        for client in list(self._thread_clients):
            client.close()
        self._client.close()
        if self._pool is not None:
            self._pool.disconnect()
        if self._sentinel is not None:
            self._sentinel.close()
        # The async clients close on their own loops (aclose(), or the loop's shutdown: AsyncSide).
        self._async = {}

    # --- waiting ----------------------------------------------------------------------------------

    def _change_hub(self) -> ChangeHub | None:
        if self._closed:
            return None
        pid = os.getpid()
        hub = self._hub
        if hub is not None and self._hub_pid == pid:
            return hub
        with self._hub_lock:
            if self._hub is None or self._hub_pid != pid:
                # After a fork the parent's listener thread does not exist here: start our own.
                self._hub = ChangeHub(self._client, self.channels)
                self._hub_pid = pid
            return self._hub

    # --- read plans (sans I/O, ``_plans``): each yield is a batch of commands run as one pipeline ----

    def _count_plan(self) -> Generator[list[tuple[Any, ...]], list[Any], dict[State, int]]:
        return count_plan(self._indexes)

    def _scan_plan(self, q: Query) -> Generator[list[tuple[Any, ...]], list[Any], list[Record]]:
        return scan_plan(q, self._indexes, self._records)

    def __repr__(self) -> str:
        return f"RedisStore({self._where!r}, prefix={self.prefix!r}, shards={self.shards})"
