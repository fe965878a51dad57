"""What only the Redis store promises: one hash slot per script, consistent indexes, no KEYS or SCAN,
the persistence warning, waiting on pub/sub, and its URL. Each test runs on the real server."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import shutil
import subprocess
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onceonly import states as st
from onceonly.errors import StoreCorrupt, StoreError, StoreUnavailable
from onceonly.states import HELD, Record, State
from onceonly.stores import Query
from tests._redis_server import PrivateRedis, free_cluster_port
from tests.conftest import RUN_ID, join_url
from tests.stores._records import NOW, make

redis = pytest.importorskip("redis")
from onceonly.stores.redis import _RERUNS, RedisStore, parse_redis_url  # noqa: E402
from onceonly.stores.sqlite import SQLiteStore  # noqa: E402

pytestmark = pytest.mark.redis

AWKWARD = ["plain", "a{b}c", "{x}", "}{", "{", "glob*?[x]", "quo'te\"", "é-中文-🙂", "k" * 255, "::{}::"]


def _url(base: str, **options: str) -> str:
    """``base`` on a fresh prefix of this run, with ``options``."""
    return join_url(base, prefix=f"onceonly-test-{RUN_ID}-{uuid.uuid4().hex[:8]}", **options)


@pytest.fixture(name="url")
def fixture_url(redis_base_url: str) -> str:
    """A fresh prefix on the test Redis, removed at the end of the run with the rest."""
    return _url(redis_base_url, warn_persistence="false")


@pytest.fixture(name="store")
def fixture_store(url: str) -> Iterator[RedisStore]:
    """An empty Redis store."""
    store = RedisStore(url)
    yield store
    store.close()


@pytest.fixture(name="raw")
def fixture_raw(redis_base_url: str) -> Iterator[Any]:
    """A plain client on the same server, to look under the store."""
    client = redis.Redis.from_url(redis_base_url)
    yield client
    client.close()


# --- one hash slot per script ---------------------------------------------------------------------


@pytest.mark.parametrize("key", AWKWARD)
def test_every_key_of_a_script_is_in_one_slot(store: RedisStore, key: str) -> None:
    """The record and its shard's indexes share the hash tag, whatever braces the ledger key has."""
    from redis.crc import key_slot

    names = store._keys(key)
    assert len({key_slot(n.encode()) for n in names}) == 1
    assert names[0].endswith(f":r:{key}")
    assert all(n.startswith(f"{store.prefix}:{{{store.prefix}:") for n in names)


@pytest.fixture(name="cluster_url")
def fixture_cluster_url(tmp_path: Path) -> Iterator[str]:
    """A one-node Redis Cluster of our own (it owns all 16384 slots): it refuses cross-slot scripts."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed: cannot start a cluster-mode node")
    port = free_cluster_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes", "--cluster-config-file",
         str(tmp_path / "nodes.conf"), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        # No retries with backoff (redis-py's default would wait seconds per refused connection).
        client = redis.Redis(port=port, socket_timeout=5, retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0))
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, f"redis-server --cluster-enabled exited with {proc.returncode}"
                time.sleep(0.05)
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        for _ in range(100):
            if b"cluster_state:ok" in client.execute_command("CLUSTER", "INFO"):
                break
            time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0?warn_persistence=false"
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_cluster_node_accepts_every_script(cluster_url: str) -> None:
    """On a node in cluster mode (which checks slots), every transition and scan works, awkward keys too."""
    probe = redis.Redis.from_url(cluster_url.split("?", maxsplit=1)[0])
    try:
        # The control: this node does refuse a script whose keys span two slots.
        with pytest.raises(redis.ResponseError, match=r"CROSSSLOT|same slot"):
            probe.eval("return 1", 2, "a", "b")
    finally:
        probe.close()
    store = RedisStore(cluster_url)
    try:
        for key in AWKWARD:
            rec = make(key)
            assert store.claim(rec) is None
            assert store.claim(rec) == rec
            done = st.confirm(rec, result_json="1", now=NOW + 1, ttl=10, via="run", by=None)
            assert store.swap(done, rec)
            assert store.get(key) == done
        assert sorted(r.key for r in store.scan(Query(limit=100))) == sorted(AWKWARD)
        assert len(store.scan(Query(expires_before=NOW + 100))) == len(AWKWARD)
        assert store.count_by_state() == {State.CONFIRMED: len(AWKWARD)}
        for key in AWKWARD:
            assert store.delete(key, 2)
    finally:
        store.close()


def test_a_server_that_lost_the_scripts_gets_them_again(cluster_url: str) -> None:
    """After SCRIPT FLUSH (what a restart or a failover to a fresh node does) every write still runs,
    sync and async, exactly once: NOSCRIPT ran nothing, so the store loads the script and runs it.
    The node is this test's own, so flushing it disturbs nobody."""
    store = RedisStore(cluster_url)
    probe = redis.Redis.from_url(cluster_url.split("?", maxsplit=1)[0])
    try:
        assert store.claim(make("a")) is None
        probe.script_flush()
        assert store.claim(make("b")) is None
        probe.script_flush()
        assert store.claim(make("b")) == make("b")  # the replay: b was written once, not twice
        done = st.confirm(make("b"), result_json="1", now=NOW + 1, ttl=10, via="run", by=None)
        probe.script_flush()
        assert store.swap(done, make("b"))
        probe.script_flush()
        assert store.delete("a", 1)
        probe.script_flush()
        assert asyncio.run(store.aclaim(make("c"))) is None
        assert store.count_by_state() == {State.CONFIRMED: 1, State.IN_FLIGHT: 1}
        assert store.reruns == 0
    finally:
        probe.close()
        store.close()


# --- a write whose reply is lost -------------------------------------------------------------------

LOST_KEY = "lost-{reply}-é"


def _where_indexed(raw: Any, store: RedisStore, key: str) -> dict[str, float | None]:
    """The scores of ``key`` in its shard's indexes, as stored (None: not a member)."""
    names = store._indexes[store._shard(key)][:4]
    return {label: raw.zscore(name, key) for label, name in zip(("all", "open", "held", "expiry"), names, strict=True)}


def _index_of(rec: Record) -> dict[str, float | None]:
    """Where ``rec`` belongs in the indexes, by the contract of the key layout (redis.py's docstring)."""
    lease = float("-inf") if rec.lease_until is None else rec.lease_until
    return {
        "all": 0.0,
        "open": 0.0 if rec.state in (State.UNKNOWN, State.NEEDS_REVIEW) else None,
        "held": lease if rec.state in HELD else None,
        "expiry": rec.expires_at,
    }


def _lost_write(store: RedisStore, op: str) -> tuple[Record, Record | None, dict[State, int]]:
    """The write under test: (the record it writes, the record it expects, the counts after it lands)."""
    old = make(LOST_KEY)
    if op == "claim":
        return old, None, {State.IN_FLIGHT: 1}
    assert store.claim(old) is None
    new = st.confirm(old, result_json='{"id":"中文-🙂"}', now=NOW + 1, ttl=60, via="run", by=None)
    return new, old, {State.CONFIRMED: 1}


def _write_through(
    store: RedisStore,
    face: str,
    rec: Record,
    expected: Record | None,
    fault: str,
    hit: list[tuple[Any, ...]],
    *,
    every: bool = False,
) -> Any:
    """Claim (``expected`` None) or swap through the sync face (``_write``) or the async one (``_awrite``),
    with the first EVALSHA's connection failing (``every``: each EVALSHA's): after the script ran
    (``fault="reply_lost"``), before it was sent (``"not_sent"``), or timing out before it was sent
    (``"timeout"``). The EVALSHA commands that failed are appended to ``hit``."""
    error = redis.TimeoutError if fault == "timeout" else redis.ConnectionError

    def first(command: tuple[Any, ...]) -> bool:
        if command[0] != "EVALSHA" or (hit and not every):
            return False
        hit.append(command)
        return True

    if face == "sync":
        send = store._command

        def command_path(*command: Any) -> Any:
            if not first(command):
                return send(*command)
            if fault == "reply_lost":
                send(*command)  # it runs on the server, and its reply is never read
            raise error(fault)

        store._command = command_path  # type: ignore[method-assign]
        try:
            return store.claim(rec) if expected is None else store.swap(rec, expected)
        finally:
            del store._command

    async def main() -> Any:
        client: Any = (await store._side()).client
        asend = client.execute_command

        async def acommand_path(*command: Any) -> Any:
            if not first(command):
                return await asend(*command)
            if fault == "reply_lost":
                await asend(*command)
            raise error(fault)

        client.execute_command = acommand_path
        try:
            return await (store.aclaim(rec) if expected is None else store.aswap(rec, expected))
        finally:
            del client.execute_command  # the loop's end closes this client (the store stays open)

    return asyncio.run(main())


def _rerun_once(
    store: RedisStore, face: str, op: str, fault: str
) -> tuple[Record, dict[State, int], list[tuple[Any, ...]]]:
    """Write ``op`` through ``fault`` once; check the write was re-run exactly once and answered as the
    first run would have (claim: held, None; swap: True). Returns the record written, the counts the
    ledger must show, and the commands the fault hit."""
    rec, expected, counts = _lost_write(store, op)
    hit: list[tuple[Any, ...]] = []
    got = _write_through(store, face, rec, expected, fault, hit)
    assert hit, "the fault never hit the write: the test proved nothing"
    assert got is (None if op == "claim" else True)
    assert store.reruns == 1
    return rec, counts, hit


@pytest.mark.parametrize("face", ["sync", "async"])
@pytest.mark.parametrize(("fault", "sent"), [("not_sent", 1 + _RERUNS), ("timeout", 1)])
def test_only_a_failed_connection_is_rerun_and_at_most_twice(
    store: RedisStore, face: str, fault: str, sent: int
) -> None:
    """Every EVALSHA of a claim fails. A failed connection is re-run by the "again" script at most
    _RERUNS times, then surfaces as StoreUnavailable; a timeout is not re-run at all (it has already
    waited socket_timeout). Nothing was written either way."""
    rec, expected, _ = _lost_write(store, "claim")
    hit: list[tuple[Any, ...]] = []
    with pytest.raises(StoreUnavailable):
        _write_through(store, face, rec, expected, fault, hit, every=True)
    assert len(hit) == sent
    assert store.reruns == sent - 1
    assert store.get(LOST_KEY) is None


@pytest.mark.parametrize("face", ["sync", "async"])
@pytest.mark.parametrize("op", ["claim", "swap"])
def test_a_write_whose_reply_is_lost_is_rerun_exactly(store: RedisStore, raw: Any, op: str, face: str) -> None:
    """The first EVALSHA runs on the server, then its connection fails before the reply arrives. The
    "again" script re-runs it and answers what the first run did (claim: held, None; swap: True), and
    the record, its indexes and the per-state counts hold one write: not two, nor one reported as
    someone else's."""
    rec, counts, _ = _rerun_once(store, face, op, "reply_lost")
    assert store.get(LOST_KEY) == rec
    assert _where_indexed(raw, store, LOST_KEY) == _index_of(rec)
    assert store.count_by_state() == counts


@pytest.mark.parametrize("face", ["sync", "async"])
@pytest.mark.parametrize("op", ["claim", "swap"])
def test_a_first_run_executed_after_its_rerun_changes_nothing(store: RedisStore, raw: Any, op: str, face: str) -> None:
    """The first EVALSHA's connection fails before it is sent; the "again" script lands the write; then
    the first run reaches the server after all (sent here by another client, as a delayed packet
    would be): it finds the write already made and changes nothing (record, indexes, counts)."""
    rec, counts, hit = _rerun_once(store, face, op, "not_sent")
    record_key = store._keys(LOST_KEY)[0]
    stored = raw.hgetall(record_key)

    late = raw.execute_command(*hit[0])  # the first run, executed after its rerun
    assert late == ([stored[b"d"], stored[b"a"]] if op == "claim" else 0)  # "taken" / "not written"
    assert raw.hgetall(record_key) == stored
    assert store.get(LOST_KEY) == rec
    assert _where_indexed(raw, store, LOST_KEY) == _index_of(rec)
    assert store.count_by_state() == counts


# --- the indexes ----------------------------------------------------------------------------------


def _random_walk(store: RedisStore, rng: random.Random, keys: list[str], steps: int) -> dict[str, Record]:
    """Drive records through random legal transitions (and deletes); return what should be stored."""
    model: dict[str, Record] = {}
    now = NOW
    for _ in range(steps):
        now += rng.random()
        key = rng.choice(keys)
        cur = model.get(key)
        if cur is None:
            rec = make(key, state=rng.choice([State.IN_FLIGHT, State.PENDING]), now=now)
            assert store.claim(rec) is None
            model[key] = rec
            continue
        allowed = st.ALLOWED[cur.state]
        moves = ["delete", "stale"]
        moves += [m for m, to in (("confirm", State.CONFIRMED), ("fail", State.FAILED), ("unknown", State.UNKNOWN),
                                  ("park", State.NEEDS_REVIEW)) if to in allowed]  # fmt: skip
        if cur.state in HELD:
            moves.append("beat")
        if State.IN_FLIGHT in allowed and cur.state is not State.CONFIRMED:
            moves.append("again")
        move = rng.choice(moves)
        if move == "confirm":
            new = st.confirm(cur, result_json='{"ok":1}', now=now, ttl=rng.choice([None, 50.0]), via="run", by=None)
        elif move == "fail":
            new = st.fail(cur, error="no", now=now, retry_at=now + 1, ttl=30, by=None)
        elif move == "unknown":
            new = st.mark_unknown(cur, now=now, reason="lost", by=None)
        elif move == "park":
            new = st.park(cur, now=now, reason="review", by=None)
        elif move == "beat":
            new = st.extend_lease(cur, now=now, lease_seconds=rng.choice([1.0, 100.0]))
        elif move == "again":
            new = st.claim_again(cur, state=State.IN_FLIGHT, owner="o", now=now, lease_seconds=5, reason="again")
            new = st.replace_args(new, fingerprint="e" * 64, args_json=f'{{"n":{rng.randrange(9)}}}')
        elif move == "delete":
            assert store.delete(key, cur.version)
            del model[key]
            continue
        else:
            # A stale swap is refused and changes nothing.
            stale = st.replace(cur, version=cur.version - 1)
            assert not store.swap(st.replace(cur, version=cur.version + 1, error="stale"), stale)
            continue
        assert store.swap(new, cur)
        model[key] = new
    return model


def test_indexes_match_the_records_after_many_transitions(store: RedisStore, raw: Any) -> None:
    """After a random walk, every index and counter agrees with the records as stored."""
    rng = random.Random(7)
    keys = [f"k{i}" for i in range(60)] + AWKWARD
    model = _random_walk(store, rng, keys, 1500)
    for key, rec in model.items():
        assert store.get(key) == rec
    expected_counts: dict[State, int] = {}
    for rec in model.values():
        expected_counts[rec.state] = expected_counts.get(rec.state, 0) + 1
    assert store.count_by_state() == expected_counts

    def members(name: str) -> dict[str, float]:
        return {m.decode(): s for m, s in raw.zrange(name, 0, -1, withscores=True)}

    for shard in range(store.shards):
        all_k, open_k, held_k, exp_k, _ = store._indexes[shard]
        mine = {k: r for k, r in model.items() if store._shard(k) == shard}
        assert set(members(all_k)) == set(mine)
        assert set(members(open_k)) == {k for k, r in mine.items() if r.state in (State.UNKNOWN, State.NEEDS_REVIEW)}
        assert members(held_k) == {
            k: (float("-inf") if r.lease_until is None else r.lease_until) for k, r in mine.items() if r.state in HELD
        }
        assert members(exp_k) == {k: r.expires_at for k, r in mine.items() if r.expires_at is not None}


def test_scan_pages_like_the_contract_over_many_shards(redis_base_url: str, tmp_path: Path) -> None:
    """Scans over 4 shards, with filters that drop most candidates and small pages, list exactly the
    records that SQLite's scan lists for the same records, in key order; paging with `after` visits each
    match once. SQLite is the oracle: its condition is SQL (stores/_sql.py), written apart from the
    Redis store's `_matches`, and the conformance suite pins it to the contract."""
    store = RedisStore(_url(redis_base_url, warn_persistence="false", shards="4"))
    oracle = SQLiteStore(f"sqlite:///{tmp_path / 'oracle.db'}")
    try:
        rng = random.Random(11)
        model: dict[str, Record] = {}
        for i in range(700):
            key = f"op-{i:04d}-{rng.choice(AWKWARD)[:20]}"
            rec = make(key, tool=rng.choice(["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"]), scope=rng.choice("xy"),
                       now=NOW - rng.choice([0, 100]))  # fmt: skip
            move = rng.randrange(5)
            if move == 1:
                rec = st.confirm(rec, result_json="1", now=NOW, ttl=rng.choice([10.0, 1000.0]), via="run", by=None)
            elif move == 2:
                rec = st.mark_unknown(rec, now=NOW, reason="r", by=None)
            elif move == 3:
                rec = st.park(st.mark_unknown(rec, now=NOW, reason="r", by=None), now=NOW, reason="r", by=None)
            assert store.insert(rec)
            assert oracle.insert(rec)
            model[key] = rec
        queries = [
            Query(limit=1000),
            Query(tool="c", limit=7),
            Query(tool="j", scope="y", limit=3),
            Query(states=[State.UNKNOWN], limit=10),
            Query(states=[State.UNKNOWN, State.NEEDS_REVIEW], scope="x", limit=25),
            Query(states=[State.UNKNOWN, State.IN_FLIGHT], lease_expired_before=NOW, limit=40),
            Query(lease_expired_before=NOW, limit=40),
            Query(states=[State.IN_FLIGHT], limit=40),
            Query(states=[State.CONFIRMED, State.FAILED], expires_before=NOW + 100, limit=30),
            Query(expires_before=NOW + 5000, tool="a", limit=5),
            Query(states=[State.CONFIRMED], tool="b", limit=9),
        ]
        for q in queries:
            pages: list[str] = []
            after = None
            while True:
                page = [r.key for r in store.scan(Query(**{**_fields(q), "after": after}))]
                pages += page
                if len(page) < q.limit:
                    break
                after = page[-1]
            everything = [r.key for r in oracle.scan(Query(**{**_fields(q), "limit": 10_000}))]
            assert everything, f"the oracle matches nothing for {q}: the comparison would prove nothing"
            assert pages == everything, q
            assert [r.key for r in store.scan(q)] == [r.key for r in oracle.scan(q)], q
            assert store.scan(q) == oracle.scan(q), q
            assert all(r == model[r.key] for r in store.scan(q))
    finally:
        oracle.close()
        store.close()


def _index_entries_read(store: RedisStore, query: Query) -> tuple[list[Record], int]:
    """``store.scan(query)`` and how many entries its index reads (ZRANGEBYLEX answers) returned."""
    read = 0
    plan = store._scan_plan

    def counted(q: Query) -> Any:
        nonlocal read
        gen = plan(q)
        try:
            batch = next(gen)
            while True:
                answers = yield batch
                read += sum(len(a) for c, a in zip(batch, answers, strict=True) if c[0] == "ZRANGEBYLEX")
                batch = gen.send(answers)
        except StopIteration as stop:
            return stop.value

    store._scan_plan = counted  # type: ignore[method-assign]
    try:
        return store.scan(query), read
    finally:
        del store._scan_plan


def test_a_page_reads_about_its_share_of_each_shards_keys(redis_base_url: str) -> None:
    """A page of 500 keys over 16 shards reads ~2x its share of each shard's all-keys index (~1,000
    entries), not 500 of each (8,000); a shard holding most of the page's keys is read on until the
    page is whole, in key order."""
    store = RedisStore(_url(redis_base_url, warn_persistence="false"))
    try:
        keys = [f"k{i:05d}" for i in range(2400)]  # ~150 in each shard
        for key in keys:
            assert store.insert(make(key))
        found, read = _index_entries_read(store, Query(limit=500))
        assert [r.key for r in found] == keys[:500]
        assert read <= 1100, read
        # 300 "c…" keys that sort first, all in shard 0: its cursor is refilled until they are read.
        crowded = [k for k in (f"c{i:05d}" for i in range(6000)) if store._shard(k) == 0][:300]
        for key in crowded:
            assert store.insert(make(key))
        found, _ = _index_entries_read(store, Query(limit=320))
        assert [r.key for r in found] == sorted(keys + crowded)[:320]
    finally:
        store.close()


def _fields(q: Query) -> dict[str, Any]:
    return {f: getattr(q, f) for f in Query.__dataclass_fields__}


def _monitor(redis_base_url: str, stop_token: str, seen: list[tuple[str, str]], ready: threading.Event) -> None:
    client = redis.Redis.from_url(redis_base_url)
    try:
        with client.monitor() as mon:
            ready.set()
            for cmd in mon.listen():
                seen.append((f"{cmd.get('client_address')}:{cmd.get('client_port')}", cmd["command"]))
                if stop_token in cmd["command"]:
                    return
    finally:
        client.close()


def test_scans_and_counts_never_use_keys_or_scan(redis_base_url: str) -> None:
    """Watched with MONITOR, the store's own connections send no KEYS and no SCAN of any kind while the
    reconciler's, purge's and the operations' queries run (they read the indexes instead)."""
    name = f"onceonly-probe-{uuid.uuid4().hex[:8]}"
    store = RedisStore(_url(redis_base_url, warn_persistence="false", client_name=name))
    seen: list[tuple[str, str]] = []
    ready = threading.Event()
    token = f"stop-{uuid.uuid4().hex}"
    watcher = threading.Thread(target=_monitor, args=(redis_base_url, token, seen, ready), daemon=True)
    try:
        for i in range(30):
            rec = make(f"k{i}", now=NOW - 100 * (i % 2))
            if i % 3 == 0:
                rec = st.confirm(rec, result_json="1", now=NOW, ttl=5, via="run", by=None)
            elif i % 3 == 1:
                rec = st.mark_unknown(rec, now=NOW, reason="r", by=None)
            store.insert(rec)
        watcher.start()
        assert ready.wait(10)
        store.scan(Query(states=[State.UNKNOWN, State.IN_FLIGHT, State.PENDING], lease_expired_before=NOW))
        store.scan(Query(states=[State.CONFIRMED, State.FAILED, State.ABANDONED], expires_before=NOW + 10))
        store.scan(Query(tool="t", scope="s", after="k1", limit=5))
        store.scan(Query(states=[State.NEEDS_REVIEW]))
        store.count_by_state()
        ours = {
            f"{c['addr'].rsplit(':', 1)[0]}:{c['addr'].rsplit(':', 1)[1]}"
            for c in store._client.client_list()
            if c.get("name") == name
        }
        store._client.echo(token)
        watcher.join(10)
    finally:
        store.close()
    mine = [cmd for addr, cmd in seen if addr in ours]
    assert any(cmd.startswith("ZRANGEBYSCORE") for cmd in mine), "the watch saw none of the store's reads"
    assert any(cmd.startswith("ZRANGEBYLEX") for cmd in mine)
    words = {cmd.split(" ", 1)[0].strip('"').upper() for cmd in mine}
    assert not words & {"KEYS", "SCAN", "HSCAN", "ZSCAN", "SSCAN"}, words


# --- the incarnation ----------------------------------------------------------------------------------


def test_a_record_without_an_incarnation_is_compared_on_its_version(store: RedisStore, raw: Any) -> None:
    """A record written before the incarnation (``i``) was stored has none: a swap compares its version,
    as before, and the record takes its ``i`` then, so the next swap compares both."""
    rec = make("old")
    assert store.claim(rec) is None
    name = store._keys("old")[0]
    assert raw.hget(name, "i") == repr(rec.created_at).encode()
    raw.hdel(name, "i")
    unknown = st.mark_unknown(rec, now=NOW + 1, reason="x", by=None)
    assert store.swap(unknown, rec)
    assert raw.hget(name, "i") == repr(rec.created_at).encode()
    other = st.replace(unknown, created_at=NOW - 5)
    assert store.swap(st.park(other, now=NOW + 2, reason="x", by=None), other) is False
    assert store.get("old") == unknown


# --- opening ------------------------------------------------------------------------------------------


def _persists(raw: Any) -> bool:
    aof = raw.config_get("appendonly").get("appendonly")
    save = raw.config_get("save").get("save")
    return aof == "yes" or bool(save)


def test_warns_when_the_server_persists_nothing(
    redis_base_url: str, raw: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Opening a ledger on a Redis that persists nothing logs a warning saying a restart loses it."""
    with caplog.at_level(logging.WARNING, logger="onceonly.stores.redis"):
        RedisStore(_url(redis_base_url)).close()
    warned = [r for r in caplog.records if "persists nothing" in r.getMessage()]
    if _persists(raw):
        assert warned == []
    else:
        assert len(warned) == 1
        assert "a restart would lose the ledger" in warned[0].getMessage()
        assert "appendonly" in warned[0].getMessage()


def test_the_warning_can_be_turned_off(redis_base_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """warn_persistence=false: the user knows; no warning."""
    with caplog.at_level(logging.WARNING, logger="onceonly.stores.redis"):
        RedisStore(_url(redis_base_url, warn_persistence="false")).close()
    assert not [r for r in caplog.records if "persists nothing" in r.getMessage()]


def test_an_unreachable_server_is_store_unavailable() -> None:
    """Nothing listens there: opening says so as StoreUnavailable, with the address."""
    port = free_cluster_port()
    with pytest.raises(StoreUnavailable, match=f"127.0.0.1:{port}"):
        RedisStore(f"redis://127.0.0.1:{port}/0?socket_connect_timeout=1")


def test_the_shard_count_is_fixed_per_prefix(url: str) -> None:
    """Reopening a prefix with another shard count would lose its records: refused with the fix."""
    RedisStore(url).close()
    with pytest.raises(ValueError, match="shards=16"):
        RedisStore(join_url(url, shards="8"))


def test_records_whose_metadata_is_gone_are_refused_whatever_the_shard_count(url: str, raw: Any) -> None:
    """The metadata key gone (deleted, evicted) while records remain: the shard count they are filed under
    cannot be checked, so opening is refused (not re-made with this URL's count, which filed records
    under other shards and ran them again) with the HSET that restores it; restored, it opens."""
    store = RedisStore(url)
    try:
        for i in range(3):
            assert store.claim(make(f"k{i}")) is None
    finally:
        store.close()
    meta = f"{parse_redis_url(url)[1]['prefix']}:meta"
    raw.delete(meta)  # this test's own prefix
    for shards in ("8", "16"):
        with pytest.raises(StoreCorrupt, match=r"holds records .* metadata .* is gone") as refused:
            RedisStore(join_url(url, shards=shards))
        assert f"HSET {meta} schema 1 shards N" in str(refused.value)
        assert not raw.exists(meta), "a refused open wrote the metadata"
    raw.hset(meta, mapping={"schema": 1, "shards": 16})
    store = RedisStore(url)
    try:
        assert store.get("k1") == make("k1")
    finally:
        store.close()


def test_a_new_prefix_opened_by_two_processes_at_once_opens_for_both(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One opener reads no metadata; before it looks for records, another opens the new prefix (writing
    the metadata) and claims a record: the first finds the record filed under that metadata and opens,
    rather than taking it for records whose metadata was lost."""
    looked = RedisStore._first_shard_with_records
    other: list[RedisStore] = []
    first = [True]

    def meanwhile(self: RedisStore) -> int | None:
        if first[0]:
            first[0] = False
            other.append(RedisStore(url))  # the other process: metadata written, then a record
            assert other[0].claim(make("k")) is None
        return looked(self)

    monkeypatch.setattr(RedisStore, "_first_shard_with_records", meanwhile)
    store = RedisStore(url)
    try:
        assert other and store.get("k") == make("k")
    finally:
        store.close()
        other[0].close()


def test_a_cluster_node_refuses_records_without_metadata(cluster_url: str) -> None:
    """The same check on a node in cluster mode, which refuses the one-script look over every shard:
    the store asks the same question in one pipeline."""
    store = RedisStore(cluster_url)
    probe = redis.Redis.from_url(cluster_url.split("?", maxsplit=1)[0])
    try:
        assert store.claim(make("k")) is None
        probe.delete("onceonly:meta")
        with pytest.raises(StoreCorrupt, match="metadata onceonly:meta is gone"):
            RedisStore(join_url(cluster_url, shards="4"))
    finally:
        probe.close()
        store.close()


def test_a_restarted_server_gets_the_metadata_back_from_the_running_stores(tmp_path: Path) -> None:
    """A server restarted without persistence loses the metadata with everything else, and running
    processes write again: their first write (which meets NOSCRIPT) restores it, sync and async, so a
    process opened afterwards is not refused for records without metadata."""
    server = PrivateRedis(tmp_path).start()
    url = f"{server.url}?warn_persistence=false"
    store = RedisStore(url)
    try:
        assert store.claim(make("before")) is None
        server.restart()
        assert store.get("before") is None  # lost with the restart
        assert store.claim(make("after")) is None
        RedisStore(url).close()
        server.restart()
        assert asyncio.run(store.aclaim(make("async"))) is None
        RedisStore(url).close()
    finally:
        store.close()
        server.stop()


def test_a_running_store_writes_nothing_under_another_shard_count_after_a_restart(tmp_path: Path) -> None:
    """The server restarted empty and a process opened the prefix first with another shard count: a
    store opened before the restart refuses to write rather than file records under its own."""
    server = PrivateRedis(tmp_path).start()
    url = f"{server.url}?warn_persistence=false"
    store = RedisStore(url)
    try:
        assert store.claim(make("before")) is None
        server.restart()
        RedisStore(join_url(url, shards="8")).close()
        assert store.get("before") is None  # reconnects (a read is retried once) after the restart
        with pytest.raises(StoreCorrupt, match="shards=8, where this process opened it with schema 1, shards=16"):
            store.claim(make("after"))
        assert store._client.exists(store._keys("after")[0]) == 0
    finally:
        store.close()
        server.stop()


@pytest.fixture(name="evicting")
def fixture_evicting(tmp_path: Path) -> Iterator[PrivateRedis]:
    """A private Redis with 2 MB of memory that evicts any key when full (allkeys-lru)."""
    server = PrivateRedis(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru").start()
    yield server
    server.stop()


def test_a_server_that_evicts_keys_is_refused(evicting: PrivateRedis) -> None:
    """allkeys-* and volatile-* policies drop keys when memory is full: an evicted record is a call
    that runs again. Refused, with the CONFIG SET that fixes it; noeviction opens; allow_eviction=true
    accepts the risk."""
    url = f"{evicting.url}?warn_persistence=false"
    with pytest.raises(StoreError, match="maxmemory-policy allkeys-lru") as refused:
        RedisStore(url)
    assert not isinstance(refused.value, (StoreCorrupt, StoreUnavailable))
    assert "CONFIG SET maxmemory-policy noeviction" in str(refused.value)
    assert "allow_eviction=true" in str(refused.value)
    RedisStore(f"{url}&allow_eviction=true").close()
    admin = redis.Redis.from_url(evicting.url)
    try:
        admin.config_set("maxmemory-policy", "volatile-lru")
        with pytest.raises(StoreError, match="maxmemory-policy volatile-lru"):
            RedisStore(url)
        admin.config_set("maxmemory-policy", "noeviction")
        RedisStore(url).close()
    finally:
        admin.close()


def test_eviction_is_checked_through_info_where_config_is_disabled(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Managed services disable CONFIG: the policy is read from INFO memory instead and refused the
    same; where INFO is disabled too, opening works and logs a warning to check the policy."""
    no_config = PrivateRedis(
        tmp_path,
        "--maxmemory",
        "2mb",
        "--maxmemory-policy",
        "allkeys-lru",
        "--rename-command",
        "CONFIG",
        "hidden-config",
    ).start()
    try:
        with pytest.raises(StoreError, match="maxmemory-policy allkeys-lru"):
            RedisStore(f"{no_config.url}?warn_persistence=false")
    finally:
        no_config.stop()
    blind = PrivateRedis(
        tmp_path, "--maxmemory-policy", "allkeys-lru", "--rename-command", "CONFIG", "hidden-config",
        "--rename-command", "INFO", "hidden-info",
    ).start()  # fmt: skip
    try:
        with caplog.at_level(logging.WARNING, logger="onceonly.stores.redis"):
            store = RedisStore(f"{blind.url}?warn_persistence=false")
        try:
            assert store.claim(make("k")) is None
        finally:
            store.close()
        warned = [r.getMessage() for r in caplog.records if "maxmemory-policy" in r.getMessage()]
        assert len(warned) == 1 and "Make sure it is noeviction" in warned[0], warned
    finally:
        blind.stop()


def test_url_options() -> None:
    """Onceonly's options are taken out of the URL; redis-py's stay; bad values are explained."""
    client_url, opts = parse_redis_url("redis://h:1/2?prefix=app&shards=4&socket_timeout=2&client_name=x")
    assert opts == {
        "prefix": "app",
        "shards": 4,
        "warn_persistence": True,
        "allow_eviction": False,
        "cluster": False,
        "replicas": 0,
        "replicas_timeout": 1.0,
        "sentinel": None,
    }
    assert parse_redis_url("redis://h/0?allow_eviction=yes")[1]["allow_eviction"] is True
    assert "prefix" not in client_url and "socket_timeout=2" in client_url and "client_name=x" in client_url
    assert "socket_connect_timeout=5" in client_url
    with pytest.raises(ValueError, match="braces"):
        parse_redis_url("redis://h/0?prefix=a{b}")
    with pytest.raises(ValueError, match="shards"):
        parse_redis_url("redis://h/0?shards=0")
    with pytest.raises(ValueError, match="warn_persistence"):
        parse_redis_url("redis://h/0?warn_persistence=maybe")
    with pytest.raises(ValueError, match="allow_eviction"):
        parse_redis_url("redis://h/0?allow_eviction=perhaps")


def test_foreign_data_under_the_prefix_is_store_corrupt(store: RedisStore, raw: Any) -> None:
    """A key of another type where a record belongs reads as StoreCorrupt, and nothing is changed."""
    raw.set(store._keys("k")[0], "not a hash")
    with pytest.raises(StoreCorrupt):
        store.get("k")
    with pytest.raises(StoreCorrupt):
        store.claim(make("k"))
    assert raw.get(store._keys("k")[0]) == b"not a hash"
    raw.hset(store._keys("j")[0], mapping={"v": "1", "s": "in_flight", "d": "[1,2]"})
    with pytest.raises(StoreCorrupt, match="not an onceonly record"):
        store.get("j")


def test_a_lost_connection_is_store_unavailable_then_recovers(store: RedisStore, raw: Any) -> None:
    """A connection killed under the store: the call that was on it fails as StoreUnavailable (or
    succeeds on a fresh one); the store then works without being reopened."""
    store.insert(make("a"))
    raw.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    try:
        assert store.get("a") == make("a")
    except StoreUnavailable:
        assert store.get("a") == make("a")
    assert store.claim(make("b")) is None


# --- waiting --------------------------------------------------------------------------------------


def _started_hub(store: RedisStore) -> None:
    """Start the listener and wait until it is subscribed (the first wait starts it)."""
    store.wait_for_change("warm-up", 1, 0.01)
    hub = store._change_hub()
    assert hub is not None and hub.subscribed.wait(10)


def test_wait_for_change_wakes_on_a_change(store: RedisStore) -> None:
    """A waiter with a 30 s timeout returns once another thread swaps the record, not at the timeout."""
    rec = make("w")
    store.insert(rec)
    _started_hub(store)
    returned: list[float] = []

    def wait() -> None:
        store.wait_for_change("w", rec.version, 30.0)
        returned.append(time.monotonic())

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.1)
    swapped_at = time.monotonic()
    assert store.swap(st.confirm(rec, result_json="1", now=NOW, ttl=None, via="run", by=None), rec)
    waiter.join(20)
    assert not waiter.is_alive(), "the waiter slept on although the record changed"
    assert returned[0] >= swapped_at


def test_a_change_before_the_wait_returns_at_once(store: RedisStore) -> None:
    """Read, then the record changes, then the wait starts: the wait returns without sleeping its timeout."""
    rec = make("w2")
    store.insert(rec)
    _started_hub(store)
    assert store.swap(st.mark_unknown(rec, now=NOW, reason="x", by=None), rec)
    hub = store._change_hub()
    assert hub is not None
    deadline = time.monotonic() + 10
    while hub._seen.get("w2") != rec.version + 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # the listener has the message once it is in its memory
    done = threading.Event()
    threading.Thread(target=lambda: (store.wait_for_change("w2", rec.version, 30.0), done.set()), daemon=True).start()
    assert done.wait(10)


def test_await_for_change_wakes_on_a_change(store: RedisStore) -> None:
    """The async face waits on the same notifications: a swap from a thread ends a 30 s wait."""
    rec = make("aw")
    store.insert(rec)
    _started_hub(store)

    async def main() -> bool:
        timer = threading.Timer(
            0.1, lambda: store.swap(st.confirm(rec, result_json="1", now=NOW, ttl=None, via="run", by=None), rec)
        )
        timer.start()
        try:
            await asyncio.wait_for(store.await_for_change("aw", rec.version, 30.0), 20)
        finally:
            timer.join()
        return (await store.aget("aw")) is not None and (await store.aget("aw")).state is State.CONFIRMED  # type: ignore[union-attr]

    assert asyncio.run(main())


def test_async_clients_close_with_their_loop(url: str) -> None:
    """A loop that ends without aclose() still closes the store's async connections: no leak warnings."""
    store = RedisStore(url)
    try:

        async def write() -> None:
            assert await store.aclaim(make("x")) is None

        async def read() -> None:
            assert await store.aget("x") == make("x")

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            asyncio.run(write())
            asyncio.run(read())  # a second loop: a second client, the first one's loop is gone
            gc.collect()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    finally:
        store.close()
