"""The store contract, run against every store on its real server (SQLite, Redis, a 3-master Redis Cluster,
PostgreSQL)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest

from onceonly import states as st
from onceonly.states import State
from onceonly.stores import Query, Store, open_store
from tests.conftest import STORES, empty_store_url
from tests.stores._records import NOW, make

T = TypeVar("T")


@pytest.fixture(name="store_url", params=[*STORES, "redis-cluster"])
def fixture_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL of an empty ledger on each store, and on a real 3-master Redis Cluster (a fresh prefix)."""
    return empty_store_url(request.param, request, tmp_path)


@pytest.fixture(name="store")
def fixture_store(store_url: str) -> Iterator[Store]:
    """An empty store of each kind."""
    store = open_store(store_url)
    yield store
    store.close()


def _at_once(n: int, call: Callable[[int], T]) -> list[T]:
    """``call(0)`` … ``call(n - 1)``, each in a thread of its own, released together by a barrier: their
    results in that order. An error in any of them is raised here, not lost in its thread."""
    barrier = threading.Barrier(n)

    def run(i: int) -> T:
        barrier.wait(timeout=30)
        return call(i)

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(run, range(n)))


def test_is_a_store(store: Store) -> None:
    """Every store satisfies the runtime-checkable protocol."""
    assert isinstance(store, Store)


def test_get_missing_is_none(store: Store) -> None:
    """An absent key reads as None."""
    assert store.get("nope") is None


def test_insert_once(store: Store) -> None:
    """Insert writes only when the key is absent: the claim is one conditional write."""
    rec = make("k1")
    assert store.insert(rec) is True
    assert store.insert(make("k1", now=NOW + 1)) is False
    got = store.get("k1")
    assert got == rec


def test_round_trip_every_field(store: Store) -> None:
    """Every field comes back as written, None and floats included."""
    rec = st.confirm(make("k2"), result_json='{"id":7,"é":"ü"}', now=NOW + 1, ttl=60, via="run", by="me")
    rec = st.replace(rec, error="boom", next_attempt_at=NOW + 5, conflicts=2)
    assert store.insert(rec)
    assert store.get("k2") == rec


def test_swap_is_compare_and_set(store: Store) -> None:
    """A swap lands only on the version it expects; a stale one is refused and changes nothing."""
    rec = make("k3")
    store.insert(rec)
    done = st.confirm(rec, result_json="1", now=NOW + 1, ttl=None, via="run", by="a")
    assert store.swap(done, rec) is True
    stale = st.mark_unknown(rec, now=NOW + 2, reason="late", by="b")
    assert store.swap(stale, rec) is False
    assert store.get("k3") == done


def test_swap_of_missing_key_is_refused(store: Store) -> None:
    """A swap never creates a record."""
    rec = make("k4")
    assert store.swap(st.mark_unknown(rec, now=NOW, reason="x", by=None), rec) is False
    assert store.get("k4") is None


def test_swap_every_field(store: Store) -> None:
    """A swap that changes many fields at once writes all of them."""
    rec = make("k5")
    store.insert(rec)
    new = st.claim_again(
        st.fail(rec, error="refused", now=NOW + 1, retry_at=NOW + 3, ttl=10, by="a"),
        state=State.PENDING, owner="host:2:9", now=NOW + 4, lease_seconds=5, reason="retry",
    )  # fmt: skip
    new = st.replace_args(new, fingerprint="e" * 64, args_json='{"a":2}')
    assert store.swap(new, rec)
    assert store.get("k5") == new


def test_concurrent_swaps_one_wins(store_url: str) -> None:
    """Eight threads swap the same version: exactly one wins."""
    store = open_store(store_url)
    try:
        rec = make("race")
        store.insert(rec)
        wins = _at_once(8, lambda i: store.swap(st.mark_unknown(rec, now=NOW + i, reason=f"t{i}", by=f"t{i}"), rec))
        assert wins.count(True) == 1
    finally:
        store.close()


def test_delete_needs_the_version(store: Store) -> None:
    """Delete is a compare-and-delete on the version."""
    rec = make("k6")
    store.insert(rec)
    assert store.delete("k6", rec.version + 1) is False
    assert store.delete("k6", rec.version) is True
    assert store.get("k6") is None
    assert store.delete("k6", rec.version) is False


def test_scan_filters(store: Store) -> None:
    """Scan filters by state, tool, scope and due times, in key order, paged by `after`."""
    a = make("a", tool="x")
    b = st.mark_unknown(make("b", tool="y"), now=NOW, reason="r", by=None)
    c = st.confirm(make("c", scope="other"), result_json="1", now=NOW, ttl=10, via="run", by=None)
    d = make("d", now=NOW - 100)  # in flight, lease long expired
    for r in (a, b, c, d):
        store.insert(r)
    keys = lambda q: [r.key for r in store.scan(q)]  # noqa: E731
    assert keys(Query()) == ["a", "b", "c", "d"]
    assert keys(Query(states=[State.UNKNOWN])) == ["b"]
    assert keys(Query(tool="x")) == ["a"]
    assert keys(Query(scope="other")) == ["c"]
    assert keys(Query(states=[State.UNKNOWN, State.IN_FLIGHT], lease_expired_before=NOW)) == ["b", "d"]
    assert keys(Query(expires_before=NOW + 11)) == ["c"]
    assert keys(Query(expires_before=NOW + 9)) == []
    assert keys(Query(after="b", limit=1)) == ["c"]
    assert keys(Query(states=[])) == []


def test_the_reconciler_and_review_queries_find_the_open_records_among_settled_ones(store: Store) -> None:
    """Unknown, in-review and expired held records spread among many settled ones: the reconciler's
    query finds exactly the unknown and the expired held ones (not the live lease, not in-review, not
    settled), `ls --state` finds each state, in key order and across pages, whatever index serves them."""
    kinds = {
        "unknown": lambda r: st.mark_unknown(r, now=NOW, reason="r", by=None),
        "review": lambda r: st.park(st.mark_unknown(r, now=NOW, reason="r", by=None), now=NOW, reason="p", by=None),
        "expired": lambda r: r,  # in flight, its lease ran out 70 s before NOW
        "pending": lambda r: r,  # pending, its lease ran out too
        "live": lambda r: r,  # in flight, its lease runs past NOW
    }
    wanted: dict[str, list[str]] = {kind: [] for kind in kinds}
    for i in range(60):
        key = f"k{i:03d}"
        kind = list(kinds)[i % 12] if i % 12 < len(kinds) else None
        if kind is None:
            rec = make(key)
            settled = st.confirm(rec, result_json="1", now=NOW, ttl=10, via="run", by=None)
            rec = settled if i % 2 else st.fail(rec, error="no", now=NOW, ttl=10, by=None, retry_at=None)
        else:
            rec = make(key, now=NOW - 100 if kind in ("expired", "pending") else NOW,
                       state=State.PENDING if kind == "pending" else State.IN_FLIGHT)  # fmt: skip
            rec = kinds[kind](rec)
            wanted[kind].append(key)
        store.insert(rec)

    def keys(query: Query) -> list[str]:
        got = store.scan(query)
        paged, after = [], query.after
        while True:  # the same records a page of 2 at a time
            page = store.scan(dataclasses.replace(query, after=after, limit=2))
            paged += [r.key for r in page]
            if len(page) < 2:
                break
            after = page[-1].key
        assert paged == [r.key for r in got]
        return [r.key for r in got]

    reconciler = Query(states=[State.UNKNOWN, State.IN_FLIGHT, State.PENDING], lease_expired_before=NOW)
    assert keys(reconciler) == sorted(wanted["unknown"] + wanted["expired"] + wanted["pending"])
    assert keys(Query(states=[State.UNKNOWN])) == wanted["unknown"]
    assert keys(Query(states=[State.NEEDS_REVIEW])) == wanted["review"]
    assert keys(Query(states=[State.NEEDS_REVIEW, State.UNKNOWN])) == sorted(wanted["unknown"] + wanted["review"])
    assert keys(Query(states=[State.UNKNOWN], after=wanted["unknown"][1])) == wanted["unknown"][2:]
    assert keys(Query(states=[State.IN_FLIGHT])) == sorted(wanted["expired"] + wanted["live"])


def test_count_by_state(store: Store) -> None:
    """Counts per state."""
    store.insert(make("a"))
    store.insert(make("b"))
    store.insert(st.mark_unknown(make("c"), now=NOW, reason="r", by=None))
    counts = store.count_by_state()
    assert counts.get(State.IN_FLIGHT) == 2
    assert counts.get(State.UNKNOWN) == 1


KEYS = [
    "scope:tool:with:colons",
    "glob*chars?[x]{y}",
    "quotes'\"`back\\slash",
    "unicode-é-中文-🙂",
    "k" * 255,
    "percent%20and&amp;=",
]


@pytest.mark.parametrize("key", KEYS, ids=["colons", "glob", "quotes", "unicode", "255", "url-ish"])
def test_awkward_keys_round_trip(store: Store, key: str) -> None:
    """Keys with :, *, ?, [, {, quotes, unicode and 255 characters round-trip."""
    rec = make(key)
    assert store.insert(rec)
    assert store.get(key) == rec
    other = make(key[:-1] + "#")
    assert store.insert(other)
    assert store.get(key) == rec
    assert [r.key for r in store.scan(Query(limit=10))] == sorted([key, other.key])


def test_async_face(store_url: str) -> None:
    """The async face has the same semantics."""

    async def main() -> None:
        store = open_store(store_url)
        try:
            rec = make("ak")
            assert await store.aclaim(rec) is None  # type: ignore[attr-defined]
            assert await store.aclaim(rec) == rec  # type: ignore[attr-defined]
            assert await store.adelete("ak", rec.version) is True  # type: ignore[attr-defined]
            assert await store.ainsert(rec) is True  # type: ignore[attr-defined]
            assert await store.ainsert(rec) is False  # type: ignore[attr-defined]
            assert await store.aget("ak") == rec  # type: ignore[attr-defined]
            done = st.confirm(rec, result_json="2", now=NOW + 1, ttl=None, via="run", by=None)
            assert await store.aswap(done, rec) is True  # type: ignore[attr-defined]
            assert await store.aswap(done, rec) is False  # type: ignore[attr-defined]
            assert [r.key for r in await store.ascan(Query())] == ["ak"]  # type: ignore[attr-defined]
            start = time.monotonic()
            await store.await_for_change("ak", done.version, 0.05)  # type: ignore[attr-defined]
            assert time.monotonic() - start < 5
            assert await store.adelete("ak", done.version) is True  # type: ignore[attr-defined]
        finally:
            await store.aclose()  # type: ignore[attr-defined]

    asyncio.run(main())


def test_claim_inserts_or_returns_existing(store: Store) -> None:
    """Claim returns None when it wrote the record, else the stored record untouched."""
    rec = make("c1")
    assert store.claim(rec) is None
    assert store.get("c1") == rec
    assert store.claim(make("c1", now=NOW + 5)) == rec


def test_concurrent_claims_one_holder(store_url: str) -> None:
    """Eight threads claim one key at once: exactly one becomes the holder, the rest read its record."""
    store = open_store(store_url)
    try:
        results = _at_once(8, lambda i: store.claim(make("one", now=NOW + i)))
        assert results.count(None) == 1
        winner = store.get("one")
        assert all(r == winner for r in results if r is not None)
    finally:
        store.close()


def test_swap_that_changes_only_the_version(store: Store) -> None:
    """A swap whose record differs only in version still lands (a heartbeat at the same instant)."""
    rec = make("v1")
    store.insert(rec)
    same = st.extend_lease(rec, now=NOW, lease_seconds=30)
    assert same.lease_until == rec.lease_until and same.version == rec.version + 1
    assert store.swap(same, rec) is True
    assert store.get("v1") == same


def test_an_error_with_no_utf8_form_is_kept_escaped(store: Store) -> None:
    """An exception message may hold a lone surrogate (bytes decoded with surrogateescape), which no
    store can encode: the record keeps it as its \\udcxx escape, in the error and in the history."""
    rec = make("surrogate")
    assert store.insert(rec)
    failed = st.fail(rec, error="boom \udcff tail", now=NOW + 1, retry_at=None, ttl=60, by="me \udcfe")
    assert store.swap(failed, rec)
    got = store.get("surrogate")
    assert got is not None and got == failed
    assert got.error == "boom \\udcff tail"
    assert got.history[-1]["reason"] == "boom \\udcff tail" and got.history[-1]["by"] == "me \\udcfe"


def test_an_error_with_a_nul_character_is_kept(store: Store) -> None:
    """An exception message may hold NUL, which PostgreSQL text cannot: the record takes U+FFFD in its
    place on every store (states does it once, for all), the settle lands and keeps everything around it."""
    rec = make("nul")
    assert store.insert(rec)
    failed = st.fail(rec, error="boom\x00tail", now=NOW + 1, retry_at=None, ttl=60, by="me")
    assert store.swap(failed, rec)
    got = store.get("nul")
    assert got is not None and got.state is State.FAILED and got.version == failed.version
    assert got.error in ("boom\x00tail", "boom\ufffdtail")
    assert got == failed


def test_a_swap_on_a_record_made_again_is_refused(store: Store) -> None:
    """A record lost and made again starts again at version 1: a writer that read the lost one expects
    version 1 too. The swap also compares the incarnation (``created_at``), so the stale write is refused
    and the new record is left as it is."""
    lost = make("again")
    assert store.insert(lost)
    assert store.delete("again", lost.version)
    remade = st.replace(make("again", now=NOW + 5), lease_owner="host:2:2")
    assert store.insert(remade)
    assert remade.version == lost.version and remade.fence == lost.fence
    stale = st.confirm(lost, result_json='"stale"', now=NOW + 6, ttl=60, via="run", by="host:1:1")
    assert store.swap(stale, lost) is False
    assert store.get("again") == remade
    own = st.confirm(remade, result_json='"own"', now=NOW + 7, ttl=60, via="run", by="host:2:2")
    assert store.swap(own, remade) is True
    assert store.get("again") == own


def test_a_delete_of_a_record_made_again_is_refused(store: Store) -> None:
    """``delete`` given the incarnation it read (purge) leaves a record made again at the same version."""
    lost = make("gone")
    assert store.insert(lost)
    assert store.delete("gone", lost.version)
    remade = make("gone", now=NOW + 5)
    assert store.insert(remade)
    assert store.delete("gone", lost.version, created_at=lost.created_at) is False
    assert store.get("gone") == remade
    assert store.delete("gone", remade.version, created_at=remade.created_at) is True
    assert store.get("gone") is None


def test_the_async_face_refuses_a_stale_incarnation(store_url: str) -> None:
    """``aswap`` and ``adelete`` compare the incarnation like their sync twins."""

    async def main() -> None:
        store = open_store(store_url)
        try:
            lost = make("a-again")
            assert await store.ainsert(lost)  # type: ignore[attr-defined]
            assert await store.adelete("a-again", lost.version)  # type: ignore[attr-defined]
            remade = make("a-again", now=NOW + 5)
            assert await store.ainsert(remade)  # type: ignore[attr-defined]
            stale = st.confirm(lost, result_json="1", now=NOW + 6, ttl=60, via="run", by=None)
            assert await store.aswap(stale, lost) is False  # type: ignore[attr-defined]
            assert await store.adelete("a-again", 1, created_at=lost.created_at) is False  # type: ignore[attr-defined]
            assert await store.aget("a-again") == remade  # type: ignore[attr-defined]
        finally:
            await store.aclose()  # type: ignore[attr-defined]

    asyncio.run(main())
