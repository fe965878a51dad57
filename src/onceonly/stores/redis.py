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
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import heapq
import json
import logging
import os
import threading
import time
import weakref
import zlib
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar
from urllib.parse import SplitResult, parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis
import redis.asyncio
import redis.sentinel
from redis.backoff import NoBackoff
from redis.exceptions import AskError, NoScriptError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:  # redis-py's own packer wraps it in ~2 µs of Python per command (argument splitting, a copy)
    from hiredis import pack_command as _pack_command
except ImportError:  # pragma: no cover - the redis extra installs hiredis
    _pack_command = None  # type: ignore[assignment]

from onceonly.errors import StoreCorrupt, StoreError, StoreUnavailable
from onceonly.similar import Candidate
from onceonly.states import HELD, Record, State, misplaced
from onceonly.stores._url import redact_url
from onceonly.stores.base import Query

__all__ = ["SCHEMA_VERSION", "RedisStore", "parse_redis_url"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Version of the key layout and record encoding; kept in ``P:meta``.
SCHEMA_VERSION = 1
DEFAULT_PREFIX = "onceonly"
DEFAULT_SHARDS = 16
MAX_SHARDS = 4096

_STATES = {s.value: s for s in State}
_VALUE = {s: s.value for s in State}  # Enum.value is a descriptor call: precomputed for the hot path
_OPEN = frozenset({State.UNKNOWN, State.NEEDS_REVIEW})
_TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError)
# What a failed command raises: redis-py's cluster client raises some of its own (no node reachable,
# a slot no node serves) outside RedisError.
_FAILURES = (RedisError, RedisClusterException)
#: Seconds a store opened through Sentinel waits for the sentinels to name the new master after a failover.
_SENTINEL_SETTLE = 10.0


class _Undurable(RedisError):
    """A write (``replicas=N``) that fewer than N replicas acknowledged within the timeout: it is on the
    master, and whether it survives a failover is unknown."""


#: The store (its ``id``) whose last write in this thread or task was not acknowledged by its replicas:
#: its next read there must prove what it reads is on them too (``RedisStore.get``). A context variable,
#: so that a doubt follows the call that raised it (a thread, an asyncio task), not the connection.
_DOUBT: contextvars.ContextVar[int] = contextvars.ContextVar("onceonly_redis_doubt", default=0)
_fork_generation = 0


def _after_fork() -> None:
    global _fork_generation
    _fork_generation += 1


os.register_at_fork(after_in_child=_after_fork)
# One encoder, made once (json.dumps with these options makes a new one per call).
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False).encode
_loads = json.loads

# --- the scripts ------------------------------------------------------------------------------------

# KEYS, the same for every write script: 1 record, 2 all keys, 3 open (unknown/needs_review),
# 4 held by lease_until, 5 expiry, 6 counts per state. The channel is KEYS[2] with "c" for "k", and
# the ledger key is the rest of KEYS[1] after the shard's tag (KEYS[1] is "<tag>:r:<key>", KEYS[2]
# "<tag>:k"): deriving both instead of sending them keeps the arguments few (each one costs redis-py
# Python to pack, and the server a string to build).
_INDEX = """
local key = string.sub(KEYS[1], #KEYS[2] + 2)
local function reindex(old, new, lease, expiry)
  if old ~= new then
    if old then redis.call('HINCRBY', KEYS[6], old, -1) end
    redis.call('HINCRBY', KEYS[6], new, 1)
    local was_open = old == 'unknown' or old == 'needs_review'
    local is_open = new == 'unknown' or new == 'needs_review'
    if is_open and not was_open then
      redis.call('ZADD', KEYS[3], 0, key)
    elseif was_open and not is_open then
      redis.call('ZREM', KEYS[3], key)
    end
  end
  if lease ~= '' then
    redis.call('ZADD', KEYS[4], lease, key)
  elseif old == 'pending' or old == 'in_flight' then
    redis.call('ZREM', KEYS[4], key)
  end
  if expiry ~= '' then
    redis.call('ZADD', KEYS[5], expiry, key)
  elseif old then
    redis.call('ZREM', KEYS[5], key)
  end
end
local function changed(version)
  redis.call('PUBLISH', string.sub(KEYS[2], 1, -2) .. 'c', version .. ' ' .. key)
end
"""

# ARGV: 1 the head ("<version> <state> <lease score or nothing> <expiry score or nothing>", see
# `_head`) with the incarnation appended ("… <created_at>"), 2 d, 3 a. Returns 1 when written (the
# caller holds the record), else the stored {d, a}: one round trip for both a first call and a replay.
_CLAIM_TEMPLATE = (
    _INDEX
    + """
local cur = redis.call('HMGET', KEYS[1], 'd', 'a')
if cur[1] then
  %(existing)s
  return cur
end
local v, s, lease, expiry, inc = string.match(ARGV[1], '^(%%S+) (%%S+) (%%S*) (%%S*) (%%S+)$')
redis.call('HSET', KEYS[1], 'v', v, 's', s, 'i', inc, 'd', ARGV[2], 'a', ARGV[3])
redis.call('ZADD', KEYS[2], 0, key)
reindex(false, s, lease, expiry)
return 1
"""
)

# ARGV: 1 the head with the expected version and incarnation appended ("… <expected> <created_at>"),
# 2 d, 3 (only when the arguments changed) a. The incarnation tells a record lost and made again (a
# restart without persistence, a failover), which starts again at version 1, from the one the caller
# read. A record written before the incarnation was stored has none: its version decides, and it
# takes the incarnation now.
_SWAP_TEMPLATE = (
    _INDEX
    + """
local v, s, lease, expiry, expected, inc = string.match(ARGV[1], '^(%%S+) (%%S+) (%%S*) (%%S*) (%%S+) (%%S+)$')
local cur = redis.call('HMGET', KEYS[1], 'v', 's', 'i')
if cur[1] ~= expected or (cur[3] and cur[3] ~= inc) then
  %(mismatch)s
  return 0
end
if ARGV[3] then
  redis.call('HSET', KEYS[1], 'v', v, 's', s, 'd', ARGV[2], 'a', ARGV[3])
else
  redis.call('HSET', KEYS[1], 'v', v, 's', s, 'd', ARGV[2])
end
if not cur[3] then redis.call('HSET', KEYS[1], 'i', inc) end
reindex(cur[2], s, lease, expiry)
changed(v)
return 1
"""
)

_CLAIM = _CLAIM_TEMPLATE % {"existing": ""}
_SWAP = _SWAP_TEMPLATE % {"mismatch": ""}
# The "again" twins re-run a claim or swap whose reply was lost. The first run may have landed, so
# they tell the caller's own write apart from anyone else's: the stored ``d`` is byte for byte the
# one this call sent (it holds this call's owner and timestamps: no other writer produces it). A
# re-run then answers exactly what the first run did: written (1), or not (the stored record, 0),
# whichever way the connection failed — even if the first run is executed after the re-run.
_CLAIM_AGAIN = _CLAIM_TEMPLATE % {"existing": "if cur[1] == ARGV[2] then return 1 end"}
_SWAP_AGAIN = _SWAP_TEMPLATE % {
    "mismatch": "if cur[1] == v and redis.call('HGET', KEYS[1], 'd') == ARGV[2] then return 1 end"
}

# ARGV: 1 the expected version, 2 (optional) the expected incarnation.
_DELETE = (
    _INDEX
    + """
local cur = redis.call('HMGET', KEYS[1], 'v', 's', 'i')
if cur[1] ~= ARGV[1] or (ARGV[2] and cur[3] and cur[3] ~= ARGV[2]) then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], key)
redis.call('ZREM', KEYS[3], key)
redis.call('ZREM', KEYS[4], key)
redis.call('ZREM', KEYS[5], key)
redis.call('HINCRBY', KEYS[6], cur[2], -1)
changed('0')
return 1
"""
)

# ARGV: 1 the shards' common name up to the shard number ("P:{P:"), 2 how many shards to look at.
# Returns the first shard whose all-keys index exists, else -1. It touches keys it is not given, which
# a standalone server allows and Redis Cluster refuses (the store then pipelines the same EXISTS).
_FIND_RECORDS = """
for s = 0, tonumber(ARGV[2]) - 1 do
  if redis.call('EXISTS', ARGV[1] .. s .. '}:k') == 1 then return s end
end
return -1
"""


# Near-duplicate calls (onceonly.Similar), only for tools with similar=. KEYS, all in the group's slot:
# 1 the lock, 2 the members by claim time, 3 the members' arguments. A group's members leave it once
# older than the window (trimmed at each lock) and the group's keys expire a window after the last
# claim filed in it. Run with EVAL (the server caches them by digest): the hot scripts stay as they are.
#
# ARGV: 1 token, 2 the lock's life in ms, 3 since (the window's start), 4 limit, 5 the window in ms.
# Returns nil while another token holds the lock, else {key, at, args, key, at, args, ...}, newest first.
# The members' arguments come in one HMGET: a call from Lua per member cost more than the rest of the read.
_SIMILAR_LOCK = """
local cur = redis.call('GET', KEYS[1])
if cur and string.match(cur, '^(.*)|%d+$') ~= ARGV[1] then return false end
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. ARGV[5], 'PX', ARGV[2])
local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[3], 'LIMIT', 0, 500)
if #old > 0 then
  redis.call('ZREM', KEYS[2], unpack(old))
  redis.call('HDEL', KEYS[3], unpack(old))
end
local found = redis.call('ZREVRANGEBYSCORE', KEYS[2], '+inf', ARGV[3], 'WITHSCORES', 'LIMIT', 0, ARGV[4])
if #found == 0 then return {} end
local keys = {}
for i = 1, #found, 2 do keys[#keys + 1] = found[i] end
local args = redis.call('HMGET', KEYS[3], unpack(keys))
local out = {}
for i = 1, #keys do
  out[#out + 1] = keys[i]
  out[#out + 1] = found[2 * i]
  out[#out + 1] = args[i] or '{}'
end
return out
"""
# ARGV: 1 token, 2 key, 3 its claim time, 4 its arguments, 5 the group's life in ms should the lock be
# gone, 6 "free" (free the lock) or "keep" (a claim whose answer was lost: the caller reads and retries
# under the lock, which keeps other lookups out meanwhile). Run right after the record was claimed in
# its own slot, while the token still holds the lock (so no other call has looked at the group since):
# files the key and frees the lock. Returns 1, or 0 when the lock had run out (the key is filed all the
# same, for the calls after).
_SIMILAR_FILE = """
local cur = redis.call('GET', KEYS[1])
local token, keep = nil, nil
if cur then token, keep = string.match(cur, '^(.*)|(%d+)$') end
if token ~= ARGV[1] then keep = nil end
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[4])
if keep then
  redis.call('PEXPIRE', KEYS[2], keep)
  redis.call('PEXPIRE', KEYS[3], keep)
  if ARGV[6] == 'free' then redis.call('DEL', KEYS[1]) end
  return 1
end
redis.call('PEXPIRE', KEYS[2], ARGV[5])
redis.call('PEXPIRE', KEYS[3], ARGV[5])
return 0
"""
# ARGV: 1 token.
_SIMILAR_UNLOCK = """
local cur = redis.call('GET', KEYS[1])
if cur and string.match(cur, '^(.*)|%d+$') == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


def _one(command: tuple[Any, ...]) -> Generator[list[tuple[Any, ...]], list[Any], Any]:
    """A read plan (``RedisStore._run``) of one command: its answer."""
    answers = yield [command]
    return answers[0]


#: How long a group's keys last when a claim is filed after its lock ran out (the window is unknown
#: then): a day, longer than any window one would choose.
_FILED_MS = 86_400_000


def _lost(filed: Any, got: Record | None, key: str) -> None:
    """Say so when a claim was filed after its group's lock ran out: a similar call that looked at the
    group meanwhile did not see it (the claim took longer than the lock, onceonly.plan.similar.SIMILAR_LOCK_SECONDS)."""
    if got is None and filed != 1:
        log.warning(
            "onceonly %s: claimed after its similar-calls lock ran out; a similar call made meanwhile may have "
            "run too (check its group for a near-duplicate)",
            key,
        )


def _candidates(found: Any) -> list[Candidate] | None:
    if found is None:
        return None
    text = [x.decode() if isinstance(x, bytes) else str(x) for x in found]
    return [Candidate(text[i], float(text[i + 1]), text[i + 2]) for i in range(0, len(text), 3)]


def _scripts_for(shards: int) -> tuple[str, ...]:
    """The five write scripts (claim, claim again, swap, swap again, delete) of a ledger of ``shards``.

    Each names the shard count in a comment, so ledgers of different counts load different scripts:
    after a server lost them (a restart without persistence), a process that opened the prefix anew
    with another count does not load this one's, and this one's next write meets NOSCRIPT, which
    checks the restored metadata (``RedisStore._script``) before anything is written.
    """
    tail = f"\n-- an onceonly ledger of {shards} shards\n"
    return tuple(text + tail for text in (_CLAIM, _CLAIM_AGAIN, _SWAP, _SWAP_AGAIN, _DELETE))


#: How many times a claim or swap whose connection failed is re-run (with its "again" twin).
_RERUNS = 2


# --- the record as stored ---------------------------------------------------------------------------


def _encode(r: Record) -> str:
    """Every field but key and args, as one JSON array: one value to write, one to read and decode.

    Measured against a hash of 20 fields, the array costs about a third of the client's CPU per
    transition (redis-py packs and parses every field as a separate bulk string). The arguments
    are kept apart (field ``a``) so that a settle, which leaves them alone, does not send them again.
    """
    return _dumps(
        [
            r.scope, r.tool, r.fingerprint, _VALUE[r.state], r.attempts, r.fence, r.version, r.lease_owner,
            r.lease_until, r.next_attempt_at, r.expires_at, r.created_at, r.updated_at, r.result_json, r.error,
            r.history_json, r.via, r.conflicts,
        ]
    )  # fmt: skip


def _decode(key: str, d: bytes, a: bytes | None) -> Record:
    try:
        x = _loads(d)
        rec = Record(
            key, x[0], x[1], x[2], _STATES[x[3]], x[4], x[5], x[6], x[7], x[8], x[9], x[10], x[11], x[12], x[13],
            x[14], "{}" if a is None else a.decode(), x[15], x[16], x[17],
        )  # fmt: skip
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise StoreCorrupt(
            f"the Redis record of {key!r} is not an onceonly record of schema {SCHEMA_VERSION} ({exc!r}). "
            "Nothing was changed: check what else writes under this prefix, or use another prefix"
        ) from exc
    wrong = misplaced(rec)
    if wrong is not None:
        field, value = wrong
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise StoreCorrupt(
            f"the Redis record of {key!r} has {shown} ({type(value).__name__}) in its {field}, which is not what "
            "onceonly writes there. Nothing was changed: check what else writes under this prefix, or fix or "
            "delete the record"
        )
    return rec


def _head(r: Record) -> str:
    """Version, state and the record's scores in the held and expiry indexes, as one argument.

    ``"<version> <state> <lease> <expiry>"``, a score left empty when the record is not in that
    index. One string instead of four arguments: redis-py packs each argument in Python.
    """
    lease = ("-inf" if r.lease_until is None else repr(r.lease_until)) if r.state in HELD else ""
    return f"{r.version} {_VALUE[r.state]} {lease} {'' if r.expires_at is None else repr(r.expires_at)}"


def _claim_args(record: Record) -> tuple[str, ...]:
    """A claim script's ARGV: the head with the record's incarnation appended, ``d`` and ``a``."""
    return f"{_head(record)} {record.created_at!r}", _encode(record), record.args_json


def _swap_args(record: Record, expected: Record) -> tuple[str, ...]:
    """A swap script's ARGV: the head with the expected version and incarnation appended, ``d``, and ``a``
    only when the arguments changed (a settle leaves them alone: they are not sent again)."""
    head = f"{_head(record)} {expected.version} {expected.created_at!r}"
    if record.args_json == expected.args_json:
        return head, _encode(record)
    return head, _encode(record), record.args_json


def _matches(r: Record, q: Query, states: frozenset[State] | None) -> bool:
    """The full condition of ``q`` on one record (the indexes only narrow the candidates)."""
    if states is not None:
        if r.state not in states:
            return False
        if (
            r.state in HELD
            and q.lease_expired_before is not None
            and not (r.lease_until is None or r.lease_until < q.lease_expired_before)
        ):
            return False
    elif q.lease_expired_before is not None and (
        r.state not in HELD or not (r.lease_until is None or r.lease_until < q.lease_expired_before)
    ):
        return False
    if q.tool is not None and r.tool != q.tool:
        return False
    if q.scope is not None and r.scope != q.scope:
        return False
    if q.expires_before is not None and (r.expires_at is None or not r.expires_at < q.expires_before):
        return False
    return q.after is None or r.key > q.after


# --- the URL ------------------------------------------------------------------------------------------

_OURS = (
    "prefix", "shards", "warn_persistence", "allow_eviction", "cluster", "replicas", "replicas_timeout",
    "sentinel_username", "sentinel_password", "sentinel_ssl",
)  # fmt: skip
#: URL schemes that open a Redis Cluster client, and the scheme redis-py is given instead.
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
#: URL schemes that find the master through Redis Sentinel, and the scheme of the master's URL.
_SENTINEL_SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}
_SENTINEL_PORT = 26379
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
#: Seconds a write waits for its replicas (``replicas=N``) unless ``replicas_timeout`` says otherwise.
DEFAULT_REPLICAS_TIMEOUT = 1.0


@dataclass(frozen=True)
class SentinelTarget:
    """Where a ``redis+sentinel://`` URL finds its master: the sentinels, the name they monitor it
    under, and the options of the connections to the sentinels themselves (``sentinel_password`` …).

    .. versionadded:: 0.1
    """

    sentinels: tuple[tuple[str, int], ...]
    service: str
    options: dict[str, Any] = field(default_factory=dict)


def _sentinel_hosts(netloc: str, shown: str) -> tuple[str, tuple[tuple[str, int], ...]]:
    """The user part and the ``host:port`` pairs of a sentinel URL's ``host1:26379,host2:26379``."""
    userinfo, at, hosts = netloc.rpartition("@")
    found: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, port = item.strip(), str(_SENTINEL_PORT)
        if host.startswith("["):  # [::1]:26379
            host, _, rest = host[1:].partition("]")
            if rest:
                port = rest.removeprefix(":")
        elif host.count(":") == 1:
            host, port = host.split(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"sentinel {item.strip()!r} in {shown!r}: give each sentinel as host:port, separated by commas "
                "(redis+sentinel://host1:26379,host2:26379,host3:26379/mymaster/0)"
            )
        found.append((host, int(port)))
    return (userinfo + at), tuple(found)


def _sentinel_url(
    parts: SplitResult, ours: dict[str, str], flags: dict[str, bool], shown: str
) -> tuple[SplitResult, SentinelTarget]:
    """A ``redis+sentinel://[user:password@]host1:26379,host2:26379/service[/db]`` URL: the master's
    URL for redis-py (its host left for the sentinels to say) and where to ask for it."""
    if flags["cluster"]:
        raise ValueError(f"{shown!r}: Sentinel watches one master and its replicas, not a Cluster: drop cluster=true")
    userinfo, sentinels = _sentinel_hosts(parts.netloc, shown)
    service, _, db = parts.path.strip("/").partition("/")
    if not service or "/" in db or (db and not db.isdigit()):
        raise ValueError(
            f"{shown!r}: a Sentinel URL names the master's service and, optionally, a database: "
            "redis+sentinel://host1:26379,host2:26379/mymaster/0"
        )
    options: dict[str, Any] = {}
    if ours.get("sentinel_username"):
        options["username"] = ours["sentinel_username"]
    if ours.get("sentinel_password"):
        options["password"] = ours["sentinel_password"]
    ssl = ours.get("sentinel_ssl", "true" if parts.scheme.lower() == "rediss+sentinel" else "false").lower()
    if ssl not in _TRUE + _FALSE:
        raise ValueError(f"sentinel_ssl={ssl!r} in {shown!r}: use true or false")
    if ssl in _TRUE:
        options["ssl"] = True
    master = parts._replace(
        scheme=_SENTINEL_SCHEMES[parts.scheme.lower()], netloc=f"{userinfo}sentinel-master", path=f"/{db or 0}"
    )
    return master, SentinelTarget(sentinels, unquote(service), options)


def _replicas(ours: dict[str, str], theirs: list[tuple[str, str]], shown: str) -> tuple[int, float]:
    """``replicas=N`` and ``replicas_timeout`` (seconds): how many replicas each write waits for, how long."""
    try:
        replicas = int(ours.get("replicas", "0"))
    except ValueError:
        raise ValueError(f"replicas={ours['replicas']!r} in {shown!r}: give a whole number such as 1") from None
    if not 0 <= replicas <= 100:
        raise ValueError(f"replicas={replicas} in {shown!r}: use 0 (do not wait) to 100")
    try:
        timeout = float(ours.get("replicas_timeout", DEFAULT_REPLICAS_TIMEOUT))
    except ValueError:
        shown_timeout = ours["replicas_timeout"]
        raise ValueError(f"replicas_timeout={shown_timeout!r} in {shown!r}: give seconds, such as 1") from None
    try:
        socket_timeout = float(dict(theirs)["socket_timeout"])
    except ValueError:  # "none" or the like: redis-py reads it, and the connection never times out
        socket_timeout = float("inf")
    if replicas and not 0.001 <= timeout < socket_timeout:
        raise ValueError(
            f"replicas_timeout={timeout:g} in {shown!r}: give 0.001 s or more, and less than socket_timeout "
            f"({socket_timeout:g} s), or the connection times out before the replicas answer"
        )
    return replicas, timeout


def parse_redis_url(url: str) -> tuple[str, dict[str, Any]]:
    """Split ``url`` into the URL redis-py gets and onceonly's own options.

    Onceonly's options: ``prefix`` (key namespace, default ``onceonly``; no braces, no whitespace),
    ``shards`` (default 16), ``warn_persistence`` (default ``true``), ``allow_eviction`` (default
    ``false``: a server whose ``maxmemory-policy`` evicts keys is refused), ``cluster`` (default
    ``false``; ``true``, or the scheme ``redis+cluster://`` / ``rediss+cluster://``, opens a Redis
    Cluster client on the node of the URL, which finds the others), ``replicas`` (default 0: each
    write waits for that many replicas to acknowledge it, ``WAIT``, up to ``replicas_timeout``
    seconds, default 1). ``redis+sentinel://host1:26379,host2:26379/mymaster/0`` (``rediss+sentinel``
    for TLS) asks the sentinels for the master of ``mymaster``; ``sentinel_password``,
    ``sentinel_username`` and ``sentinel_ssl`` are for the sentinels, the URL's user part for the master
    (the returned options' ``sentinel`` then holds a ``SentinelTarget``, and the URL is the master's
    with a placeholder host). Every other query parameter is redis-py's (``socket_timeout``,
    ``socket_connect_timeout``, ``max_connections``, ``client_name``…); the two timeouts default to 5
    seconds here, so that a dead server is reported rather than waited on forever.

    .. versionadded:: 0.1
    """
    parts = urlsplit(url)
    shown = redact_url(url)
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "unix", *_CLUSTER_SCHEMES, *_SENTINEL_SCHEMES):
        raise ValueError(
            f"not a Redis URL: {shown!r}: use redis://host:6379/0, rediss://…, unix:///path.sock, "
            "redis+cluster://host:7000 for a Redis Cluster, or redis+sentinel://host1:26379,host2:26379/mymaster "
            "for a master that Redis Sentinel watches"
        )
    ours: dict[str, str] = {}
    theirs: list[tuple[str, str]] = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name.lower() in _OURS:
            ours[name.lower()] = value
        else:
            theirs.append((name, value))
    names = {n for n, _ in theirs}
    for name in ("socket_timeout", "socket_connect_timeout"):
        if name not in names:
            theirs.append((name, "5"))
    prefix = ours.get("prefix", DEFAULT_PREFIX)
    if not prefix or any(c in prefix for c in "{}") or not prefix.isprintable() or any(c.isspace() for c in prefix):
        raise ValueError(
            f"prefix={prefix!r} in {shown!r}: a prefix is a non-empty name without braces or whitespace "
            "(braces would move the hash tag that keeps a record and its indexes in one Cluster slot)"
        )
    try:
        shards = int(ours.get("shards", DEFAULT_SHARDS))
    except ValueError:
        raise ValueError(f"shards={ours['shards']!r} in {shown!r}: give a whole number such as 16") from None
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards={shards} in {shown!r}: use 1 to {MAX_SHARDS}")
    flags: dict[str, bool] = {}
    for name, default in (("warn_persistence", "true"), ("allow_eviction", "false"), ("cluster", "false")):
        flag = ours.get(name, default).lower()
        if flag not in _TRUE + _FALSE:
            raise ValueError(f"{name}={flag!r} in {shown!r}: use true or false")
        flags[name] = flag in _TRUE
    replicas, replicas_timeout = _replicas(ours, theirs, shown)
    sentinel: SentinelTarget | None = None
    if scheme in _SENTINEL_SCHEMES:
        parts, sentinel = _sentinel_url(parts, ours, flags, shown)
    elif any(name.startswith("sentinel_") for name in ours):
        raise ValueError(f"{shown!r}: sentinel_* options belong to a redis+sentinel:// URL")
    if scheme in _CLUSTER_SCHEMES:
        if "cluster" in ours and not flags["cluster"]:
            raise ValueError(f"{shown!r} says {scheme}:// and cluster=false: drop one of them")
        flags["cluster"] = True
        parts = parts._replace(scheme=_CLUSTER_SCHEMES[scheme])
    if flags["cluster"]:
        if scheme == "unix":
            raise ValueError(f"{shown!r}: a Redis Cluster is reached over TCP: use redis+cluster://host:port")
        if parts.path.strip("/") not in ("", "0"):
            raise ValueError(
                f"database {parts.path.strip('/')!r} in {shown!r}: a Redis Cluster has database 0 only; give "
                "another prefix= instead"
            )
        parts = parts._replace(path="")
    client_url = urlunsplit(parts._replace(query=urlencode(theirs)))
    return client_url, {
        "prefix": prefix,
        "shards": shards,
        **flags,
        "replicas": replicas,
        "replicas_timeout": replicas_timeout,
        "sentinel": sentinel,
    }


def _where(url: str) -> str:
    """The URL without credentials, for messages."""
    parts = urlsplit(url)
    if parts.scheme.lower() in _SENTINEL_SCHEMES:
        hosts = parts.netloc.rpartition("@")[2]
        return f"{parts.scheme}://{hosts}/{parts.path.strip('/').partition('/')[0]}"
    host = parts.hostname or parts.path or "?"
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}"


def _is_replica(answer: Any) -> bool:
    """Whether a ``ROLE`` answer says a replica."""
    if isinstance(answer, Exception) or not isinstance(answer, list) or not answer:
        return False
    return (answer[0].decode() if isinstance(answer[0], bytes) else str(answer[0])) in ("slave", "replica")


def _sentinel_kwargs(master: dict[str, Any], target: SentinelTarget) -> tuple[dict[str, Any], dict[str, Any]]:
    """redis-py's keywords for a Sentinel: the master's connections (``master``: the master URL's
    ``parse_url``, its placeholder host dropped) and the sentinels' own (their password, TLS, and the
    master's socket timeouts, so that a dead sentinel is reported as fast as a dead master)."""
    kwargs = {k: v for k, v in master.items() if k not in ("host", "port", "path")}
    if kwargs.pop("connection_class", None) is not None:  # rediss+sentinel: the master over TLS
        kwargs["ssl"] = True
    options = {k: v for k, v in kwargs.items() if k.startswith("socket_")} | target.options
    return kwargs, options


# --- change notifications ---------------------------------------------------------------------------

Notify = Callable[[], None]


class _ChangeHub:
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


def _set_result(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _AsyncSide:
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

            kwargs, options = _sentinel_kwargs(dict(async_parse_url(url)), sentinel)
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


# --- the store --------------------------------------------------------------------------------------


class RedisStore:
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
        self._where = _where(url)
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
            except _FAILURES as exc:
                raise self._unavailable(exc, "opening the ledger") from exc
        elif self._target is not None:
            # redis-py's Sentinel asks the sentinels for the master's address at every new connection,
            # and a connection to a master since demoted fails (READONLY) and connects anew.
            parse: Any = redis.connection.parse_url  # untyped in redis-py, like Sentinel
            kwargs, options = _sentinel_kwargs(parse(client_url), self._target)
            make: Any = redis.sentinel.Sentinel
            self._sentinel = make(self._target.sentinels, sentinel_kwargs=options, **kwargs)
            self._client = self._sentinel.master_for(self._target.service, retry=redis.retry.Retry(NoBackoff(), 0))
            self._pool = self._client.connection_pool
        else:
            self._pool = redis.ConnectionPool.from_url(client_url, retry=redis.retry.Retry(NoBackoff(), 0))
            self._client = redis.Redis(connection_pool=self._pool)
        self._local = threading.local()
        self._thread_clients: weakref.WeakSet[redis.Redis] = weakref.WeakSet()
        self._scripts = _scripts_for(self.shards)
        self._claim, self._claim_again, self._swap, self._swap_again, self._delete = (
            self._client.register_script(text) for text in self._scripts
        )
        self._meta_key = f"{self.prefix}:meta"
        self._tags = [f"{self.prefix}:{{{self.prefix}:{s}}}" for s in range(self.shards)]
        self._records = [f"{tag}:r:" for tag in self._tags]
        self._indexes = [(f"{t}:k", f"{t}:o", f"{t}:h", f"{t}:e", f"{t}:n") for t in self._tags]
        self._async: dict[asyncio.AbstractEventLoop, _AsyncSide] = {}
        self._hub: _ChangeHub | None = None
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

    # --- opening ----------------------------------------------------------------------------------

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
            except _FAILURES as exc:
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
        except _FAILURES as exc:
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
        if found is not None:
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
        except _FAILURES as exc:
            raise self._unavailable(exc, "opening the ledger") from exc
        return self._meta(answers[2])

    def _first_shard_with_records(self) -> int | None:
        """The first shard, under any shard count the prefix may have had, whose all-keys index holds a
        key; ``None`` when none does. One Lua loop over the ``MAX_SHARDS`` possible indexes (a few
        milliseconds, only when a prefix has no metadata); a server that refuses a script touching
        keys it was not given (Redis Cluster) answers the same ``EXISTS`` in one pipeline instead.
        """
        base = f"{self.prefix}:{{{self.prefix}:"
        if not self.cluster:
            try:
                found = self._client.eval(_FIND_RECORDS, 0, base, MAX_SHARDS)
                return None if int(found) < 0 else int(found)
            except ResponseError:
                pass
            except _FAILURES as exc:
                raise self._unavailable(exc, "opening the ledger") from exc
        try:
            pipe = self._client.pipeline(transaction=False)
            for shard in range(MAX_SHARDS):
                pipe.exists(f"{base}{shard}}}:k")
            answers = pipe.execute()
        except _FAILURES as exc:
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
            except _FAILURES as exc:
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
            "it in redis.conf, or open the ledger with warn_persistence=false if this is intended",
            where,
        )

    # --- errors -----------------------------------------------------------------------------------

    def _unavailable(self, exc: BaseException, what: str) -> Exception:
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
        return StoreUnavailable(
            f"the Redis ledger at {self._where} failed while {what}: {type(exc).__name__}: {exc}. Whether "
            "the last write landed is unknown; the ledger re-reads the record before it decides anything"
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
        except _TRANSIENT:
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
        _DOUBT.set(id(self))  # until the replicas say otherwise
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
            except _TRANSIENT:
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
        _DOUBT.set(0)

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

    async def _aevalsha(self, side: _AsyncSide, script: Any, keys: list[str], args: tuple[Any, ...]) -> Any:
        if self._wait is None:
            return await side.client.evalsha(script.sha, len(keys), *keys, *args)
        return await self._awaited(side, keys[1], ("EVALSHA", script.sha, len(keys), *keys, *args))

    async def _awaited(self, side: _AsyncSide, index: str, command: tuple[Any, ...]) -> Any:
        """``_waited`` awaited: the command, the barrier and ``WAIT`` in one pipeline (one connection);
        on a Cluster the barrier and ``WAIT`` on one connection of the command's node."""
        assert self._wait is not None
        n, ms = self._wait
        _DOUBT.set(id(self))
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

    async def _ascript(self, side: _AsyncSide, script: Any, keys: list[str], args: tuple[Any, ...]) -> Any:
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

    # --- the primitives, sync ---------------------------------------------------------------------

    def get(self, key: str) -> Record | None:
        self._check_open()
        shard = self._shard(key)
        rk = self._records[shard] + key
        try:
            if self._wait is not None and _DOUBT.get() == id(self):
                # The last write here was not acknowledged by the replicas: what this read finds (that
                # write, say) counts only once they have it too. Not retried: a new connection's WAIT
                # would not cover the read.
                d, a = self._waited(self._indexes[shard][0], ("HMGET", rk, "d", "a"))
            else:
                try:
                    d, a = self._command("HMGET", rk, "d", "a")
                except _TRANSIENT:
                    d, a = self._command("HMGET", rk, "d", "a")  # a read is safe to repeat
        except _FAILURES as exc:
            raise self._unavailable(exc, f"reading {key!r}") from exc
        return None if d is None else _decode(key, d, a)

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
        except _FAILURES as exc:
            raise self._unavailable(exc, "reading the server's clock") from exc
        return int(seconds) + int(micros) / 1e6

    def _rerun_or_raise(self, exc: Exception, reruns: int, what: str) -> None:
        """After a write script failed: return if its "again" twin should run now, else raise.

        Only a failed connection is re-run, at most _RERUNS times: a timeout has already waited
        socket_timeout, and any other error is the server's answer. What is raised is the store's error;
        the guard then re-reads the record to learn whether the write landed.
        """
        if not isinstance(exc, RedisConnectionError) or reruns == _RERUNS:
            raise self._unavailable(exc, what) from exc
        self.reruns += 1

    def _write(self, script: Any, again: Any, keys: list[str], args: tuple[Any, ...], what: str) -> Any:
        """Run a write script; if its connection fails, its "again" twin, which is exact, up to _RERUNS times."""
        run, reruns = script, 0
        while True:
            try:
                return self._script(run, keys, args)
            except _FAILURES as exc:
                self._rerun_or_raise(exc, reruns, what)
            run, reruns = again, reruns + 1

    def claim(self, record: Record) -> Record | None:
        self._check_open()
        args = _claim_args(record)
        got = self._write(self._claim, self._claim_again, self._keys(record.key), args, f"claiming {record.key!r}")
        return None if got == 1 else _decode(record.key, got[0], got[1])

    def insert(self, record: Record) -> bool:
        return self.claim(record) is None

    def swap(self, record: Record, expected: Record) -> bool:
        self._check_open()
        args = _swap_args(record, expected)
        return bool(
            self._write(self._swap, self._swap_again, self._keys(record.key), args, f"writing {record.key!r}") == 1
        )

    def delete(self, key: str, expected_version: int, created_at: float | None = None) -> bool:
        self._check_open()
        args = (expected_version,) if created_at is None else (expected_version, repr(created_at))
        try:
            return bool(self._script(self._delete, self._keys(key), args) == 1)
        except _FAILURES as exc:
            raise self._unavailable(exc, f"deleting {key!r}") from exc

    # --- near-duplicate calls (onceonly.Similar) --------------------------------------------------------

    def _group_keys(self, group: str) -> tuple[str, str, str]:
        """The lock, members and arguments of ``group``: one hash slot, the shard of the group's name."""
        tag = self._tags[self._shard(group)]
        return f"{tag}:gl:{group}", f"{tag}:gs:{group}", f"{tag}:ga:{group}"

    def _similar_lock_command(
        self, group: str, token: str, now: float, until: float, since: float, limit: int
    ) -> tuple[Any, ...]:
        life_ms = max(1, int((until - now) * 1000))
        window_ms = max(1, int((now - since) * 1000))
        return ("EVAL", _SIMILAR_LOCK, 3, *self._group_keys(group), token, life_ms, repr(since), limit, window_ms)

    def _similar_file_command(
        self, record: Record, group: str, token: str, *, keep_lock: bool = False
    ) -> tuple[Any, ...]:
        keys = self._group_keys(group)
        keep = _FILED_MS  # how long the group lasts when the lock (which carries the window) ran out
        args = (token, record.key, repr(record.created_at), record.args_json, keep, "keep" if keep_lock else "free")
        return ("EVAL", _SIMILAR_FILE, 3, *keys, *args)

    def _after_claim(self, record: Record, group: str, token: str, got: Record | None) -> tuple[Any, ...]:
        """File a record this call claimed and free the lock; only free it when the key was taken."""
        return self._similar_file_command(record, group, token) if got is None else self._unlock_command(group, token)

    def _unlock_command(self, group: str, token: str) -> tuple[Any, ...]:
        return ("EVAL", _SIMILAR_UNLOCK, 1, self._group_keys(group)[0], token)

    def similar_lock(
        self, group: str, token: str, now: float, until: float, since: float, limit: int
    ) -> list[Candidate] | None:
        command = self._similar_lock_command(group, token, now, until, since, limit)
        return _candidates(self._run(_one(command), f"looking up calls similar to group {group!r}"))

    def similar_claim(self, record: Record, group: str, token: str) -> Record | Literal[False] | None:
        # The record's slot and the group's differ: claim first, under the lock, then file and free.
        got = self.claim(record)
        command = (
            self._similar_file_command(record, group, token) if got is None else self._unlock_command(group, token)
        )
        _lost(self._run(_one(command), f"filing {record.key!r}"), got, record.key)
        return got

    def similar_unlock(self, group: str, token: str) -> None:
        self._run(_one(self._unlock_command(group, token)), f"freeing the group {group!r}")

    async def asimilar_lock(
        self, group: str, token: str, now: float, until: float, since: float, limit: int
    ) -> list[Candidate] | None:
        command = self._similar_lock_command(group, token, now, until, since, limit)
        return _candidates(await self._arun(_one(command), f"looking up calls similar to group {group!r}"))

    async def asimilar_claim(self, record: Record, group: str, token: str) -> Record | Literal[False] | None:
        got = await self.aclaim(record)
        command = (
            self._similar_file_command(record, group, token) if got is None else self._unlock_command(group, token)
        )
        _lost(await self._arun(_one(command), f"filing {record.key!r}"), got, record.key)
        return got

    async def asimilar_unlock(self, group: str, token: str) -> None:
        await self._arun(_one(self._unlock_command(group, token)), f"freeing the group {group!r}")

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
                    except _TRANSIENT:
                        if attempt == 2:
                            raise
                batch = gen.send(answers)
        except StopIteration as stop:
            result: T = stop.value
            return result
        except _FAILURES as exc:
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
        # The async clients close on their own loops (aclose(), or the loop's shutdown: _AsyncSide).
        self._async = {}

    # --- the primitives, async --------------------------------------------------------------------

    async def _side(self) -> _AsyncSide:
        loop = asyncio.get_running_loop()
        side = self._async.get(loop)
        if side is not None:
            return side
        self._check_open()
        # Forget the clients of loops that are gone (their shutdown closed them).
        self._async = {lp: sd for lp, sd in self._async.items() if not lp.is_closed()}
        side = self._async[loop] = _AsyncSide(self._client_url, self._scripts, self.cluster, self._target)
        await side.closer.__anext__()  # started here, so this loop's shutdown finalises it
        return side

    async def aget(self, key: str) -> Record | None:
        self._check_open()
        shard = self._shard(key)
        rk = self._records[shard] + key
        side = await self._side()
        client: Any = side.client
        try:
            if self._wait is not None and _DOUBT.get() == id(self):  # as in get()
                d, a = await self._awaited(side, self._indexes[shard][0], ("HMGET", rk, "d", "a"))
            else:
                try:
                    d, a = await client.execute_command("HMGET", rk, "d", "a")
                except _TRANSIENT:
                    d, a = await client.execute_command("HMGET", rk, "d", "a")
        except _FAILURES as exc:
            raise self._unavailable(exc, f"reading {key!r}") from exc
        return None if d is None else _decode(key, d, a)

    async def _awrite(
        self, side: _AsyncSide, script: Any, again: Any, keys: list[str], args: tuple[Any, ...], what: str
    ) -> Any:
        """``_write`` awaited: a write script, and its exact "again" twin if the connection fails."""
        run, reruns = script, 0
        while True:
            try:
                return await self._ascript(side, run, keys, args)
            except _FAILURES as exc:
                self._rerun_or_raise(exc, reruns, what)
            run, reruns = again, reruns + 1

    async def aclaim(self, record: Record) -> Record | None:
        self._check_open()
        side = await self._side()
        args = _claim_args(record)
        got = await self._awrite(
            side, side.claim, side.claim_again, self._keys(record.key), args, f"claiming {record.key!r}"
        )
        return None if got == 1 else _decode(record.key, got[0], got[1])

    async def ainsert(self, record: Record) -> bool:
        return await self.aclaim(record) is None

    async def aswap(self, record: Record, expected: Record) -> bool:
        self._check_open()
        side = await self._side()
        args = _swap_args(record, expected)
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
        except _FAILURES as exc:
            raise self._unavailable(exc, f"deleting {key!r}") from exc

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
                    except _TRANSIENT:
                        if attempt == 2:
                            raise
                batch = gen.send(answers)
        except StopIteration as stop:
            result: T = stop.value
            return result
        except _FAILURES as exc:
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
                loop.call_soon_threadsafe(_set_result, fut)

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

    # --- waiting ----------------------------------------------------------------------------------

    def _change_hub(self) -> _ChangeHub | None:
        if self._closed:
            return None
        pid = os.getpid()
        hub = self._hub
        if hub is not None and self._hub_pid == pid:
            return hub
        with self._hub_lock:
            if self._hub is None or self._hub_pid != pid:
                # After a fork the parent's listener thread does not exist here: start our own.
                self._hub = _ChangeHub(self._client, self.channels)
                self._hub_pid = pid
            return self._hub

    # --- read plans (sans I/O): each yield is a batch of commands run as one pipeline ---------------

    def _count_plan(self) -> Generator[list[tuple[Any, ...]], list[Any], dict[State, int]]:
        answers = yield [("HGETALL", i[4]) for i in self._indexes]
        counts: dict[State, int] = {}
        for answer in answers:
            for name, n in answer.items():
                state = _STATES.get(name.decode())
                if state is not None and int(n) > 0:
                    counts[state] = counts.get(state, 0) + int(n)
        return counts

    def _sources(self, q: Query) -> list[tuple[int, str, str]]:
        """The indexes whose union holds every match of ``q``: (slot in the shard's indexes, lo, hi).

        Slot 0 and 1 are lexicographic (all keys, open), 2 and 3 scored (held, expiry). The narrowest
        superset is picked; ``_matches`` then checks every condition on the records themselves.
        """
        if q.expires_before is not None:
            return [(3, "-inf", f"({q.expires_before!r}")]
        lease_hi = "+inf" if q.lease_expired_before is None else f"({q.lease_expired_before!r}"
        if q.states is not None:
            wanted = set(q.states)
            if wanted - _OPEN - HELD:
                return [(0, "", "")]
            sources = []
            if wanted & _OPEN:
                sources.append((1, "", ""))
            if wanted & HELD:
                sources.append((2, "-inf", lease_hi))
            return sources
        if q.lease_expired_before is not None:
            return [(2, "-inf", lease_hi)]
        return [(0, "", "")]

    def _scan_plan(self, q: Query) -> Generator[list[tuple[Any, ...]], list[Any], list[Record]]:
        if q.limit <= 0 or (q.states is not None and not q.states):
            return []
        states = None if q.states is None else frozenset(q.states)
        sources = self._sources(q)
        # Entries read per cursor and round trip. The merge takes ~limit/shards keys from each shard's
        # cursor, so a page of `limit` from every one read `shards` times (16 by default) more index
        # entries than the scan used; twice the even share, and a cursor that runs dry is refilled below.
        page = min(max(2 * q.limit // len(self._indexes), 32), 1000)
        low = b"-" if q.after is None else b"(" + q.after.encode("utf-8", "surrogatepass")

        # One cursor per (shard, index): keys in order, the next key first. A lexicographic index is
        # read a page at a time from `after`; a scored one whole (its members are the due records:
        # held now, or expired), then sorted by key.
        buffers: list[list[bytes]] = []
        more: list[bytes | None] = []  # a lexicographic cursor's next low bound, None when exhausted
        names: list[str] = []
        shard_of: list[int] = []
        first: list[tuple[Any, ...]] = []
        for shard, indexes in enumerate(self._indexes):
            for slot, lo, hi in sources:
                names.append(indexes[slot])
                shard_of.append(shard)
                if slot < 2:
                    first.append(("ZRANGEBYLEX", indexes[slot], low, b"+", "LIMIT", 0, page))
                else:
                    first.append(("ZRANGEBYSCORE", indexes[slot], lo, hi))
        answers = yield first
        after_b = None if q.after is None else q.after.encode("utf-8", "surrogatepass")
        for i, answer in enumerate(answers):
            lexical = first[i][0] == "ZRANGEBYLEX"
            keys = list(answer) if lexical else sorted(k for k in answer if after_b is None or k > after_b)
            keys.reverse()  # pop() from the end is the next key
            buffers.append(keys)
            more.append(b"(" + answer[-1] if lexical and len(answer) == page else None)

        heap: list[tuple[bytes, int]] = [(buf.pop(), i) for i, buf in enumerate(buffers) if buf]
        heapq.heapify(heap)
        out: list[Record] = []
        last: bytes | None = None
        while heap and len(out) < q.limit:
            # The next candidates in key order, as many as could still be needed.
            wanted: list[tuple[bytes, int]] = []
            refill: list[int] = []
            while heap and len(wanted) < q.limit - len(out):
                key, i = heapq.heappop(heap)
                if key != last:  # a key that moved between two indexes while we read them
                    wanted.append((key, i))
                    last = key
                if buffers[i]:
                    heapq.heappush(heap, (buffers[i].pop(), i))
                elif more[i] is not None:
                    refill.append(i)
                    break  # keys after this cursor's page are unknown until it is read again
            commands: list[tuple[Any, ...]] = [
                ("HMGET", self._records[shard_of[i]].encode() + key, "d", "a") for key, i in wanted
            ]
            commands += [("ZRANGEBYLEX", names[i], more[i], b"+", "LIMIT", 0, page) for i in refill]
            answers = yield commands
            for (key, _), (d, a) in zip(wanted, answers, strict=False):
                if d is None:
                    continue  # deleted since the index was read
                rec = _decode(key.decode("utf-8", "surrogatepass"), d, a)
                if _matches(rec, q, states):
                    out.append(rec)
            for i, answer in zip(refill, answers[len(wanted) :], strict=True):
                keys = list(answer)
                more[i] = b"(" + keys[-1] if len(keys) == page else None
                keys.reverse()
                buffers[i] = keys
                if keys:
                    heapq.heappush(heap, (keys.pop(), i))
        return out[: q.limit]

    def __repr__(self) -> str:
        return f"RedisStore({self._where!r}, prefix={self.prefix!r}, shards={self.shards})"
