"""Budgets (``onceonly.Budget``; only tools with ``budget=`` come here): a window's total and its
reservations in one hash, so that the check-and-add is one Lua script on one key (one slot of a Redis
Cluster); an operation key's windows in a set of its own, for a release that knows only the key; the
current windows in a sorted set, for ``budget_usage``. Written in one pipeline: one round trip on one
server. Every step is idempotent, so a pipeline whose connection failed is simply run again."""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any, TypeVar

from onceonly.stores.base import BudgetUse, Reservation

T = TypeVar("T")

#: How long a window's hash outlives the window (ms): a release a little late still finds it.
_AFTER_MS = 60_000

# KEYS[1] the window's hash: field "k:<key>" per reservation (its amount), and used, limit, start, until.
# ARGV: 1 key, 2 amount, 3 limit, 4 start, 5 until, 6 when the hash expires (ms since the epoch).
# Returns {granted 0/1, the total (text), new 0/1}.
RESERVE = """
local f = 'k:' .. ARGV[1]
local used = redis.call('HGET', KEYS[1], 'used') or '0'
if redis.call('HEXISTS', KEYS[1], f) == 1 then return {1, used, 0} end
if tonumber(used) + tonumber(ARGV[2]) > tonumber(ARGV[3]) then return {0, used, 0} end
redis.call('HSET', KEYS[1], f, ARGV[2], 'limit', ARGV[3], 'start', ARGV[4], 'until', ARGV[5])
local total = redis.call('HINCRBYFLOAT', KEYS[1], 'used', ARGV[2])
redis.call('PEXPIREAT', KEYS[1], ARGV[6])
return {1, total, 1}
"""
# KEYS[1] a window's hash. ARGV: 1 key. Returns 1 when the key held an amount there (now freed). A hash
# that expired is not made again: nothing is written unless the key is in it.
RELEASE = """
local f = 'k:' .. ARGV[1]
local held = redis.call('HGET', KEYS[1], f)
if not held then return 0 end
redis.call('HDEL', KEYS[1], f)
local left = tonumber(redis.call('HINCRBYFLOAT', KEYS[1], 'used', -tonumber(held)))
if left < 0 then redis.call('HSET', KEYS[1], 'used', '0') end
return 1
"""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class BudgetCalls:
    """``RedisStore``'s budget primitives (``onceonly.stores.base.BudgetStore``)."""

    if TYPE_CHECKING:  # the store's
        prefix: str

        def _run(self, gen: Generator[list[tuple[Any, ...]], list[Any], T], what: str) -> T: ...

    def _budget_window(self, member: str) -> str:
        """The hash of the window ``member`` names (``"<budget>\\x1f<window>"``)."""
        budget, _, window = member.rpartition("\x1f")
        return f"{self.prefix}:bw:{budget}:{window}"

    def _budget_plan(
        self, budget: str, window: int, key: str, amount: float, limit: float, start: float, until: float
    ) -> Generator[list[tuple[Any, ...]], list[Any], Reservation]:
        member = f"{budget}\x1f{window}"
        ends = int(until * 1000) + _AFTER_MS
        index, listed = f"{self.prefix}:bk:{key}", f"{self.prefix}:budgets"
        # The key's index first: a process that dies after the script leaves an amount a release can find.
        answers = yield [
            ("SADD", index, member),
            ("PEXPIREAT", index, ends),
            ("ZADD", listed, repr(until), member),
            ("ZREMRANGEBYSCORE", listed, "-inf", f"({start!r}"),  # windows that ended before this one began
            ("EVAL", RESERVE, 1, self._budget_window(member), key, repr(amount), repr(limit), repr(start),
             repr(until), ends),
        ]  # fmt: skip
        granted, used, new = answers[-1]
        return Reservation(int(granted) == 1, float(_text(used)), int(new) == 1)

    def _release_plan(self, key: str) -> Generator[list[tuple[Any, ...]], list[Any], bool]:
        index = f"{self.prefix}:bk:{key}"
        (members,) = yield [("SMEMBERS", index)]
        if not members:
            return False
        freed = yield [
            *(("EVAL", RELEASE, 1, self._budget_window(_text(m)), key) for m in members),
            ("DEL", index),
        ]
        return any(int(n) == 1 for n in freed[:-1])

    def _usage_plan(self, now: float) -> Generator[list[tuple[Any, ...]], list[Any], list[BudgetUse]]:
        (members,) = yield [("ZRANGEBYSCORE", f"{self.prefix}:budgets", f"({now!r}", "+inf")]
        names = [_text(m) for m in members]
        if not names:
            return []
        rows = yield [("HMGET", self._budget_window(m), "used", "limit", "start", "until") for m in names]
        out = []
        for member, row in zip(names, rows, strict=True):
            if row[1] is None:  # expired, or refused before anything was held
                continue
            used, limit, start, until = (float(_text(v or b"0")) for v in row)
            if start <= now < until:
                out.append(BudgetUse(member.rpartition("\x1f")[0], start, until, used, limit))
        return out

    def budget_reserve(
        self, budget: str, window: int, key: str, amount: float, limit: float, start: float, until: float
    ) -> Reservation:
        plan = self._budget_plan(budget, window, key, amount, limit, start, until)
        return self._run(plan, f"reserving {amount:g} of budget {budget!r} for {key!r}")

    def budget_release(self, key: str) -> bool:
        return self._run(self._release_plan(key), f"freeing the budget amount of {key!r}")

    def budget_usage(self, now: float) -> list[BudgetUse]:
        return self._run(self._usage_plan(now), "reading the budgets")
