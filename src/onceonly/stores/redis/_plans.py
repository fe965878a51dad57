"""The read plans, sans I/O: each yield is a batch of commands that the store runs as one pipeline
(``RedisStore._run``), and the plan is sent their answers."""

from __future__ import annotations

import heapq
from collections.abc import Generator, Sequence
from typing import Any

from onceonly.states import HELD, Record, State
from onceonly.stores.base import Query
from onceonly.stores.redis._codec import decode, matches
from onceonly.stores.redis._layout import OPEN, STATES


def one(command: tuple[Any, ...]) -> Generator[list[tuple[Any, ...]], list[Any], Any]:
    """A read plan (``RedisStore._run``) of one command: its answer."""
    answers = yield [command]
    return answers[0]


def count_plan(shards: Sequence[tuple[str, ...]]) -> Generator[list[tuple[Any, ...]], list[Any], dict[State, int]]:
    """The number of records per state, from each shard's counts (``shards``: each shard's indexes)."""
    answers = yield [("HGETALL", i[4]) for i in shards]
    counts: dict[State, int] = {}
    for answer in answers:
        for name, n in answer.items():
            state = STATES.get(name.decode())
            if state is not None and int(n) > 0:
                counts[state] = counts.get(state, 0) + int(n)
    return counts


def _sources(q: Query) -> list[tuple[int, str, str]]:
    """The indexes whose union holds every match of ``q``: (slot in the shard's indexes, lo, hi).

    Slot 0 and 1 are lexicographic (all keys, open), 2 and 3 scored (held, expiry). The narrowest
    superset is picked; ``matches`` then checks every condition on the records themselves.
    """
    if q.expires_before is not None:
        return [(3, "-inf", f"({q.expires_before!r}")]
    lease_hi = "+inf" if q.lease_expired_before is None else f"({q.lease_expired_before!r}"
    if q.states is not None:
        wanted = set(q.states)
        if wanted - OPEN - HELD:
            return [(0, "", "")]
        sources = []
        if wanted & OPEN:
            sources.append((1, "", ""))
        if wanted & HELD:
            sources.append((2, "-inf", lease_hi))
        return sources
    if q.lease_expired_before is not None:
        return [(2, "-inf", lease_hi)]
    return [(0, "", "")]


def scan_plan(
    q: Query, shards: Sequence[tuple[str, ...]], records: Sequence[str]
) -> Generator[list[tuple[Any, ...]], list[Any], list[Record]]:
    """The records that match ``q``, in key order: ``shards`` holds each shard's indexes (all keys, open,
    held, expiry, counts), ``records`` each shard's name of a record up to its key."""
    if q.limit <= 0 or (q.states is not None and not q.states):
        return []
    states = None if q.states is None else frozenset(q.states)
    sources = _sources(q)
    # Entries read per cursor and round trip. The merge takes ~limit/shards keys from each shard's
    # cursor, so a page of `limit` from every one read `shards` times (16 by default) more index
    # entries than the scan used; twice the even share, and a cursor that runs dry is refilled below.
    page = min(max(2 * q.limit // len(shards), 32), 1000)
    low = b"-" if q.after is None else b"(" + q.after.encode("utf-8", "surrogatepass")

    # One cursor per (shard, index): keys in order, the next key first. A lexicographic index is
    # read a page at a time from `after`; a scored one whole (its members are the due records:
    # held now, or expired), then sorted by key.
    buffers: list[list[bytes]] = []
    more: list[bytes | None] = []  # a lexicographic cursor's next low bound, None when exhausted
    names: list[str] = []
    shard_of: list[int] = []
    first: list[tuple[Any, ...]] = []
    for shard, indexes in enumerate(shards):
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
            ("HMGET", records[shard_of[i]].encode() + key, "d", "a") for key, i in wanted
        ]
        commands += [("ZRANGEBYLEX", names[i], more[i], b"+", "LIMIT", 0, page) for i in refill]
        answers = yield commands
        for (key, _), (d, a) in zip(wanted, answers, strict=False):
            if d is None:
                continue  # deleted since the index was read
            rec = decode(key.decode("utf-8", "surrogatepass"), d, a)
            if matches(rec, q, states):
                out.append(rec)
        for i, answer in zip(refill, answers[len(wanted) :], strict=True):
            keys = list(answer)
            more[i] = b"(" + keys[-1] if len(keys) == page else None
            keys.reverse()
            buffers[i] = keys
            if keys:
                heapq.heappush(heap, (keys.pop(), i))
    return out[: q.limit]
