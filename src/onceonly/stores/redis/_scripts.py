"""The Lua scripts: one per transition of a record, and the near-duplicate calls' three (``onceonly.Similar``)."""

from __future__ import annotations

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

CLAIM = _CLAIM_TEMPLATE % {"existing": ""}
SWAP = _SWAP_TEMPLATE % {"mismatch": ""}
# The "again" twins re-run a claim or swap whose reply was lost. The first run may have landed, so
# they tell the caller's own write apart from anyone else's: the stored ``d`` is byte for byte the
# one this call sent (it holds this call's owner and timestamps: no other writer produces it). A
# re-run then answers exactly what the first run did: written (1), or not (the stored record, 0),
# whichever way the connection failed — even if the first run is executed after the re-run.
CLAIM_AGAIN = _CLAIM_TEMPLATE % {"existing": "if cur[1] == ARGV[2] then return 1 end"}
SWAP_AGAIN = _SWAP_TEMPLATE % {
    "mismatch": "if cur[1] == v and redis.call('HGET', KEYS[1], 'd') == ARGV[2] then return 1 end"
}

# ARGV: 1 the expected version, 2 (optional) the expected incarnation.
DELETE = (
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
FIND_RECORDS = """
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
SIMILAR_LOCK = """
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
SIMILAR_FILE = """
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
SIMILAR_UNLOCK = """
local cur = redis.call('GET', KEYS[1])
if cur and string.match(cur, '^(.*)|%d+$') == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 1
"""


def scripts_for(shards: int) -> tuple[str, ...]:
    """The five write scripts (claim, claim again, swap, swap again, delete) of a ledger of ``shards``.

    Each names the shard count in a comment, so ledgers of different counts load different scripts:
    after a server lost them (a restart without persistence), a process that opened the prefix anew
    with another count does not load this one's, and this one's next write meets NOSCRIPT, which
    checks the restored metadata (``RedisStore._script``) before anything is written.
    """
    tail = f"\n-- an onceonly ledger of {shards} shards\n"
    return tuple(text + tail for text in (CLAIM, CLAIM_AGAIN, SWAP, SWAP_AGAIN, DELETE))
