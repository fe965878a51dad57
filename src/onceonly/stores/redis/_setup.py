"""Opening a Redis ledger: what the server must be (a master, one that evicts nothing and, unless told
otherwise, persists), and what the prefix must hold (this schema and shard count, or nothing yet)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import ResponseError

from onceonly.errors import StoreCorrupt, StoreError, StoreUnavailable
from onceonly.stores.redis._layout import FAILURES, MAX_SHARDS, SCHEMA_VERSION, log
from onceonly.stores.redis._scripts import FIND_RECORDS

#: Seconds a store opened through Sentinel waits for the sentinels to name the new master after a failover.
_SENTINEL_SETTLE = 10.0


def _is_replica(answer: Any) -> bool:
    """Whether a ``ROLE`` answer says a replica."""
    if isinstance(answer, Exception) or not isinstance(answer, list) or not answer:
        return False
    return (answer[0].decode() if isinstance(answer[0], bytes) else str(answer[0])) in ("slave", "replica")


class Opening:
    """The checks ``RedisStore`` makes when it opens, and after the server lost its scripts."""

    if TYPE_CHECKING:  # the store's, set in RedisStore.__init__
        prefix: str
        shards: int
        cluster: bool
        replicas: int
        _where: str
        _meta_key: str
        _client: Any
        _sentinel: Any
        _wait: tuple[int, int] | None
        _scripts: tuple[str, ...]
        _claim: Any
        _claim_again: Any
        _swap: Any
        _swap_again: Any
        _delete: Any

        def _unavailable(self, exc: BaseException, what: str, writing: bool = False) -> Exception: ...

    def _open(self, *, warn: bool, allow_eviction: bool) -> None:
        meta = self._meta_key
        scripts = (self._claim, self._claim_again, self._swap, self._swap_again, self._delete)
        if self.cluster:
            self._open_cluster(warn=warn, allow_eviction=allow_eviction)
            return
        # Through Sentinel, the server named as master can still be the old one, demoted a moment ago:
        # the sentinels' view lags a failover by a few seconds, so it is asked again before refusing.
        deadline = time.monotonic() + (_SENTINEL_SETTLE if self._sentinel is not None else 0.0)
        while True:
            try:
                pipe = self._client.pipeline(transaction=False)
                pipe.hgetall(meta)
                for script in scripts:
                    pipe.script_load(script.script)
                pipe.config_get("appendonly")
                pipe.config_get("save")
                pipe.config_get("maxmemory-policy")
                pipe.execute_command("ROLE")
                answers = pipe.execute(raise_on_error=False)
            except FAILURES as exc:
                raise self._unavailable(exc, "opening the ledger") from exc
            if not _is_replica(answers[9]) or time.monotonic() >= deadline:
                break
            self._client.connection_pool.disconnect()
            time.sleep(0.2)
        self._check_role(answers[9])
        stored = self._meta(answers[0])
        for answer in answers[1:6]:
            if isinstance(answer, Exception):
                raise self._unavailable(answer, "loading the ledger's scripts")
        self._check_eviction(answers[8], allow_eviction)
        if warn:
            self._check_persistence(answers[6], answers[7])
        self._check_meta(stored)

    def _open_cluster(self, *, warn: bool, allow_eviction: bool) -> None:
        """``_open`` on a Cluster: the scripts go to every primary (a record may live on any of them),
        and each primary's eviction policy and persistence are checked, since each holds records."""
        client = self._client
        try:
            try:
                answer: Any = client.hgetall(self._meta_key)
            except ResponseError as exc:
                answer = exc
            stored = self._meta(answer)
            for text in self._scripts:
                client.script_load(text)  # SCRIPT LOAD goes to every primary
            settings: dict[str, dict[str, Any]] = {}
            for name in ("maxmemory-policy", "appendonly", "save"):
                try:
                    settings[name] = client.config_get(name, target_nodes=redis.RedisCluster.PRIMARIES)
                except ResponseError as exc:  # CONFIG disabled: every node's answer is that error
                    settings[name] = {node.name: exc for node in client.get_primaries()}
            for node in client.get_primaries():
                self._check_eviction(settings["maxmemory-policy"].get(node.name), allow_eviction, node)
                if warn:
                    self._check_persistence(
                        settings["appendonly"].get(node.name), settings["save"].get(node.name), node
                    )
        except FAILURES as exc:
            raise self._unavailable(exc, "opening the ledger") from exc
        self._check_meta(stored)

    def _check_role(self, answer: Any) -> None:
        """Refuse a read-only replica (every write would fail), and, with ``replicas=N``, a master with
        fewer than N replicas connected (every write would wait, then fail). ``answer``: ``ROLE``'s."""
        if isinstance(answer, Exception) or not isinstance(answer, list) or not answer:
            log.info("onceonly: the Redis server at %s did not say its role (%s)", self._where, answer)
            return
        role = answer[0].decode() if isinstance(answer[0], bytes) else str(answer[0])
        if role in ("slave", "replica"):
            host, port = (x.decode() if isinstance(x, bytes) else str(x) for x in answer[1:3])
            if self._sentinel is not None:
                raise StoreUnavailable(
                    f"the sentinels at {self._where} still name a server that is now a read-only replica (of "
                    f"{host}:{port}), {_SENTINEL_SETTLE:g} s after it was first asked: a failover is under way "
                    "or the sentinels disagree. Try again once they agree (SENTINEL MASTERS on each shows "
                    "their view)"
                )
            raise StoreError(
                f"the Redis server at {self._where} is a read-only replica (of the master at {host}:{port}): the "
                "ledger writes every call, so it needs the master. Give the master's URL, or "
                "redis+sentinel://sentinel1:26379,sentinel2:26379/<master name>/0 so that the master is found "
                "and followed across failovers"
            )
        connected = len(answer[2]) if role == "master" and len(answer) > 2 else None
        if self._wait is not None and connected is not None and connected < self.replicas:
            raise StoreUnavailable(
                f"the Redis master at {self._where} has {connected} replica(s) connected, and this URL says "
                f"replicas={self.replicas}: every write would wait for replicas that are not there. Start or "
                "reconnect the replicas, or give a smaller replicas="
            )

    def _check_meta(self, stored: dict[bytes, bytes]) -> None:
        """The prefix's metadata (written now if the prefix has none) must say this schema and shard count."""
        meta = self._meta_key
        if b"schema" not in stored or b"shards" not in stored:
            stored = self._claim_prefix(meta)
        schema = int(stored.get(b"schema", 0))
        shards = int(stored.get(b"shards", 0))
        if schema != SCHEMA_VERSION:
            raise StoreCorrupt(
                f"{self._where}: the ledger under prefix {self.prefix!r} has schema {schema}, this onceonly "
                f"reads schema {SCHEMA_VERSION}: upgrade onceonly, or use another prefix"
            )
        if shards != self.shards:
            raise ValueError(
                f"the ledger under prefix {self.prefix!r} at {self._where} was made with shards={shards}; "
                f"this URL says shards={self.shards}. A different shard count would not find the existing "
                f"records (and could run their operations again): open it with shards={shards}"
            )

    def _meta(self, answer: Any) -> dict[bytes, bytes]:
        """The ledger's metadata hash as read (empty when there is none)."""
        if isinstance(answer, Exception):
            if "WRONGTYPE" in str(answer):
                raise StoreCorrupt(
                    f"{self._where}: {self.prefix}:meta is not an onceonly ledger's metadata. Nothing was "
                    "changed: use another prefix= in the URL"
                )
            raise self._unavailable(answer, "opening the ledger")
        stored: dict[bytes, bytes] = answer
        return stored

    def _claim_prefix(self, meta: str) -> dict[bytes, bytes]:
        """Write the metadata of a prefix that has none, and return it as stored (another process may
        have written it first).

        A prefix without metadata must hold no records: records whose metadata was deleted (or evicted,
        or lost in a restart while a process kept writing) may be filed under another shard count, and
        accepting this URL's count would look them up in the wrong shards and run their calls again.
        """
        found = self._first_shard_with_records()
        if found is not None and not self._made_meanwhile(meta):
            raise StoreCorrupt(
                f"{self._where}: the ledger under prefix {self.prefix!r} holds records (shard {found} has some) "
                f"but its metadata {meta} is gone (deleted, evicted, or lost in a restart while a process kept "
                "writing), so the shard count they are filed under cannot be checked. Nothing was changed: "
                f"restore it with HSET {meta} schema {SCHEMA_VERSION} shards N, N being the shards= the ledger "
                f"was made with (16 unless its URL said otherwise; more than {found} here), then open it again"
            )
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.hsetnx(meta, "schema", SCHEMA_VERSION)
            pipe.hsetnx(meta, "shards", self.shards)
            pipe.hgetall(meta)
            answers = pipe.execute(raise_on_error=False)
        except FAILURES as exc:
            raise self._unavailable(exc, "opening the ledger") from exc
        return self._meta(answers[2])

    def _made_meanwhile(self, meta: str) -> bool:
        """Whether another process opening the new prefix at the same time wrote its metadata (and then its
        first records) since this one read it: the records found are then filed under that metadata."""
        try:
            stored = self._meta(self._client.hgetall(meta))
        except FAILURES as exc:
            raise self._unavailable(exc, "opening the ledger") from exc
        return b"schema" in stored and b"shards" in stored

    def _first_shard_with_records(self) -> int | None:
        """The first shard, under any shard count the prefix may have had, whose all-keys index holds a
        key; ``None`` when none does. One Lua loop over the ``MAX_SHARDS`` possible indexes (a few
        milliseconds, only when a prefix has no metadata); a server that refuses a script touching
        keys it was not given (Redis Cluster) answers the same ``EXISTS`` in one pipeline instead.
        """
        base = f"{self.prefix}:{{{self.prefix}:"
        if not self.cluster:
            try:
                found = self._client.eval(FIND_RECORDS, 0, base, MAX_SHARDS)
                return None if int(found) < 0 else int(found)
            except ResponseError:
                pass
            except FAILURES as exc:
                raise self._unavailable(exc, "opening the ledger") from exc
        try:
            pipe = self._client.pipeline(transaction=False)
            for shard in range(MAX_SHARDS):
                pipe.exists(f"{base}{shard}}}:k")
            answers = pipe.execute()
        except FAILURES as exc:
            raise self._unavailable(exc, "opening the ledger") from exc
        return next((shard for shard, n in enumerate(answers) if n), None)

    def _check_eviction(self, answer: Any, allow: bool, node: Any = None) -> None:
        """Refuse a server that evicts keys when its memory is full, unless ``allow``.

        ``CONFIG GET maxmemory-policy`` first; where CONFIG is disabled (managed services), ``INFO
        memory``; where neither answers, a warning. ``node``: the Cluster node the answer is from.
        """
        where = self._where if node is None else f"{self._where} (Cluster node {node.name})"
        policy = None
        if answer is not None and not isinstance(answer, Exception):
            policy = answer.get(b"maxmemory-policy") or answer.get("maxmemory-policy")
        if policy is None:
            try:
                on_node = {} if node is None else {"target_nodes": node}
                policy = self._client.info("memory", **on_node).get("maxmemory_policy")
            except FAILURES as exc:
                if not allow:
                    log.warning(
                        "onceonly: could not read the maxmemory-policy of the Redis server at %s (CONFIG: %s; "
                        "INFO: %s). Make sure it is noeviction: a server that evicts keys loses records, and "
                        "their calls run again",
                        where,
                        answer if isinstance(answer, Exception) else "no answer",
                        exc,
                    )
                return
        if isinstance(policy, bytes):
            policy = policy.decode()
        if policy is None:
            if not allow:
                log.warning(
                    "onceonly: the Redis server at %s did not say its maxmemory-policy. Make sure it is noeviction: "
                    "a server that evicts keys loses records, and their calls run again",
                    where,
                )
            return
        policy = str(policy).lower()
        if allow or not policy.startswith(("allkeys-", "volatile-")):
            return
        which = (
            "evicts any key when its memory is full"
            if policy.startswith("allkeys-")
            else "evicts keys that have a TTL when its memory is full (onceonly sets none on its keys, but one "
            "set by anything else makes them evictable)"
        )
        raise StoreError(
            f"the Redis server at {where} has maxmemory-policy {policy}, which {which}: an evicted record "
            "is a call that runs again, an evicted index loses records from listings and the reconciler. Set "
            "CONFIG SET maxmemory-policy noeviction (and maxmemory-policy noeviction in redis.conf: a full server "
            "then refuses writes, which the ledger reports as StoreUnavailable, rather than forgetting calls), "
            "or open the ledger with allow_eviction=true if losing records is acceptable"
        )

    def _check_persistence(self, appendonly: Any, save: Any, node: Any = None) -> None:
        where = self._where if node is None else f"{self._where} (Cluster node {node.name})"
        if appendonly is None or save is None or isinstance(appendonly, Exception) or isinstance(save, Exception):
            log.info("onceonly: could not read the persistence settings of %s (%s)", where, appendonly)
            return
        aof = (appendonly.get(b"appendonly") or appendonly.get("appendonly") or b"").lower()
        points = (save.get(b"save") or save.get("save") or b"").strip()
        if aof in (b"yes", "yes") or points:
            return
        log.warning(
            "onceonly: the Redis server at %s persists nothing (appendonly no, no save points): a restart "
            "would lose the ledger, and calls that already ran would run again. Turn on the append-only "
            "file (CONFIG SET appendonly yes; appendfsync everysec, or always for no loss at all) and set "
            "it in redis.conf; if this is intended, add warn_persistence=false to the ledger's URL "
            "(redis://host:6379/0?warn_persistence=false)",
            where,
        )

    def _check_restored(self, stored: dict[bytes, bytes]) -> None:
        """After the server lost its scripts: the metadata, restored by this store or by another one
        meanwhile, must still say this store's schema and shard count, or nothing is written."""
        schema, shards = int(stored.get(b"schema", 0)), int(stored.get(b"shards", 0))
        if (schema, shards) != (SCHEMA_VERSION, self.shards):
            raise StoreCorrupt(
                f"{self._where}: the server lost the ledger's scripts (a restart, a failover, SCRIPT FLUSH), and "
                f"its metadata {self._meta_key} now says schema {schema}, shards={shards}, where this process "
                f"opened it with schema {SCHEMA_VERSION}, shards={self.shards}: another process opened the "
                "prefix with another shard count after the server lost it. Nothing was written: open every "
                "process with the same shards="
            )
