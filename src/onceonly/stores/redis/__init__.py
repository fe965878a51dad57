"""The Redis store: one Lua script per transition, hash-tagged shards that Redis Cluster accepts.

Key layout (``P`` is the ``prefix`` URL option, ``S`` a shard number, ``K`` the ledger key)::

    P:meta                   hash: schema and shard count, checked at open (a changed shard count
                             would file existing keys under other shards: refused)
    P:{P:S}:r:K              hash of one record: v (version), s (state), i (the incarnation: its
                             created_at), d (the record as one JSON array, without key and args),
                             a (the arguments' JSON)
    P:{P:S}:k                sorted set, score 0: every key of the shard (lexicographic order)
    P:{P:S}:o                sorted set, score 0: keys in unknown or needs_review (the review queue)
    P:{P:S}:h                sorted set: keys held (pending, in_flight), scored by lease_until
    P:{P:S}:e                sorted set: keys with an expiry, scored by expires_at (purge)
    P:{P:S}:n                hash: state → number of records (count_by_state in O(shards))
    P:{P:S}:c                pub/sub channel: "<version> <key>" after every change (waiters)
    P:{P:S}:gs:G             sorted set: the keys filed in group G of near-duplicate calls
                             (``onceonly.Similar``), scored by their claim time; ``S`` is then
                             ``crc32(G) % shards``, so a group's keys share a slot of their own
    P:{P:S}:ga:G             hash: key → its arguments' JSON, for G's members (scored without
                             reading the records, which live in other slots)
    P:{P:S}:gl:G             string: G's lock, "<token>|<window in ms>", with a PX expiry
                             (a claim is made in its record's slot while the lock is held, then
                             filed here: Redis Cluster runs no script across slots)

``S`` is ``crc32(K) % shards``. Every key a script touches carries the hash tag ``{P:S}``, which is
the first ``{…}`` of the name because the prefix may not contain braces: whatever braces the ledger
key holds, a record and its shard's indexes share one hash slot, so each script is legal on Redis
Cluster and every script declares all the keys it touches. ``redis+cluster://`` (or ``cluster=true``)
opens redis-py's cluster client, which sends each command to the node of its keys' slot. Keys,
members and channels are binary safe: a ledger key may hold ``:``, ``*``, ``?``, ``[``, ``{``, quotes
and any Unicode. ``scan`` reads the indexes (``ZRANGEBYLEX``, ``ZRANGEBYSCORE``) and never ``KEYS`` or a
pattern ``SCAN``.

Retries: the clients are built with redis-py's retries off. A blindly re-run script is not a no-op:
a claim whose reply was lost would, run again, find its own record and report it as someone else's
(the caller would then wait on itself until its lease ran out), and a re-run swap would report "not
written" for its own write. So a claim or swap whose connection fails is re-run (at most twice) by
an "again" twin of its script, which recognises the caller's own earlier write byte for byte and
answers exactly what the first run did, whether or not it landed, and even if the first run is
executed after the re-run. Timeouts are not re-run (they have already waited ``socket_timeout``).
What still fails surfaces as ``StoreUnavailable``, and the guard re-reads the record to learn
whether its write landed. Reads (``get``, ``scan``, ``count_by_state``) are retried once: they
change nothing.

The package's parts, each importing only those listed before it: ``_layout`` (constants), ``_scripts``
(the Lua), ``_codec`` (the record as stored), ``_url`` (the URL), ``_plans`` (the read plans, sans I/O),
``_notify`` (change notifications), ``_setup``, ``_similar``, ``_budgets`` and ``_async`` (the opening
checks, the near-duplicate calls, the budgets and the async primitives of ``RedisStore``), and ``store``
(``RedisStore``).
"""

from __future__ import annotations

from onceonly.stores.redis._codec import claim_args, encode, matches, swap_args
from onceonly.stores.redis._layout import DEFAULT_PREFIX as DEFAULT_PREFIX
from onceonly.stores.redis._layout import DEFAULT_SHARDS as DEFAULT_SHARDS
from onceonly.stores.redis._layout import MAX_SHARDS as MAX_SHARDS
from onceonly.stores.redis._layout import SCHEMA_VERSION
from onceonly.stores.redis._scripts import CLAIM, SWAP
from onceonly.stores.redis._url import DEFAULT_REPLICAS_TIMEOUT as DEFAULT_REPLICAS_TIMEOUT
from onceonly.stores.redis._url import SentinelTarget as SentinelTarget
from onceonly.stores.redis._url import parse_redis_url
from onceonly.stores.redis.store import RERUNS, RedisStore

__all__ = ["SCHEMA_VERSION", "RedisStore", "parse_redis_url"]

# Public classes and functions name the module users import them from (in reprs, tracebacks and
# pickles), not the part that defines them.
for _public in (RedisStore, SentinelTarget, parse_redis_url):
    _public.__module__ = __name__
del _public

# What the benchmarks and the store's tests read, under the names it has always had here.
_CLAIM, _SWAP, _RERUNS = CLAIM, SWAP, RERUNS
_claim_args, _encode, _matches, _swap_args = claim_args, encode, matches, swap_args
