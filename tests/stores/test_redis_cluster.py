"""The Redis store on a real 3-master Redis Cluster (``redis+cluster://``): what only a Cluster asks of it.
The contract itself runs there too, in test_conformance.py."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onceonly import Ledger
from onceonly import states as st
from onceonly.errors import StoreCorrupt, StoreError, StoreUnavailable
from onceonly.states import State
from onceonly.stores import Query, open_store
from tests._redis_server import PrivateRedisCluster
from tests.conftest import REDIS_URL, RUN_ID, _unavailable, join_url
from tests.stores._records import NOW, make

redis = pytest.importorskip("redis")
from onceonly.stores.redis import RedisStore, parse_redis_url  # noqa: E402

pytestmark = pytest.mark.redis


def _prefix() -> str:
    return f"onceonly-test-{RUN_ID}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(name="url")
def fixture_url(redis_cluster_url: str) -> str:
    """A fresh prefix on the run's private cluster."""
    return join_url(redis_cluster_url, prefix=_prefix())


@pytest.fixture(name="store")
def fixture_store(url: str) -> Iterator[RedisStore]:
    """An empty ledger on the cluster."""
    store = RedisStore(url)
    yield store
    store.close()


@pytest.fixture(name="nodes")
def fixture_nodes(redis_cluster_url: str) -> Iterator[Any]:
    """redis-py's cluster client on the same cluster, to look under the store."""
    client = redis.RedisCluster.from_url(redis_cluster_url.split("?", maxsplit=1)[0].replace("redis+cluster", "redis"))
    yield client
    client.close()


def test_the_cluster_url_forms() -> None:
    """redis+cluster:// and cluster=true both ask for the cluster client; what a cluster cannot be is refused."""
    client_url, opts = parse_redis_url("redis+cluster://h:7000/?prefix=app&socket_timeout=2")
    assert opts["cluster"] is True and client_url.startswith("redis://h:7000?")
    assert parse_redis_url("rediss+cluster://h:7000")[0].startswith("rediss://h:7000")
    assert parse_redis_url("redis://h:7000/0?cluster=true")[1]["cluster"] is True
    assert parse_redis_url("redis://h:7000/0")[1]["cluster"] is False
    with pytest.raises(ValueError, match="database 0 only"):
        parse_redis_url("redis+cluster://h:7000/3")
    with pytest.raises(ValueError, match="over TCP"):
        parse_redis_url("unix:///tmp/r.sock?cluster=true")
    with pytest.raises(ValueError, match="drop one of them"):
        parse_redis_url("redis+cluster://h:7000?cluster=false")
    with pytest.raises(ValueError, match="cluster=maybe"):
        parse_redis_url("redis://h:7000?cluster=maybe")


def test_records_spread_over_every_master(store: RedisStore, nodes: Any) -> None:
    """The shards' hash tags put the ledger on all three masters, and every record reads back from its own."""
    masters = {n.name for n in nodes.get_primaries()}
    assert len(masters) == 3
    homes = {nodes.get_node_from_key(tag).name for tag in store._tags}
    assert homes == masters, "16 shards should reach every master of a 3-master cluster"
    for i in range(64):
        assert store.claim(make(f"k{i}")) is None
    assert [store.get(f"k{i}") for i in range(64)] == [make(f"k{i}") for i in range(64)]
    assert len(store.scan(Query(limit=1000))) == 64
    assert store.count_by_state() == {State.IN_FLIGHT: 64}


def test_the_store_clock_is_one_node_s(store: RedisStore, nodes: Any) -> None:
    """The ledger's clock on a cluster is the TIME of the node that holds the metadata, whichever node
    the client would send a keyless command to."""
    import time as host_time

    assert abs(store.time() - host_time.time()) < 5
    node = nodes.get_node_from_key(store._meta_key)
    seconds, micros = nodes.execute_command("TIME", target_nodes=node)
    assert abs(store.time() - (int(seconds) + int(micros) / 1e6)) < 1


def test_a_ledger_runs_each_call_once(url: str) -> None:
    """The whole guard on the cluster: a call runs once, its replay is served from the ledger."""
    runs: list[int] = []
    ledger = Ledger.open(url)
    try:

        @ledger.tool(name="charge")
        def charge(amount: int) -> dict[str, int]:
            runs.append(amount)
            return {"charged": amount}

        for _ in range(3):
            assert charge.using(key="order-1")(amount=5) == {"charged": 5}
        assert runs == [5]
    finally:
        ledger.close()


def test_a_waiter_wakes_on_a_change_made_on_another_node(store: RedisStore, nodes: Any) -> None:
    """Waiting is pub/sub, and a Cluster carries a PUBLISH from any node to a subscriber on any other:
    waiters of records on every master wake on the change instead of sleeping out their timeout."""
    by_node: dict[str, str] = {}
    i = 0
    while len(by_node) < 3:
        by_node.setdefault(nodes.get_node_from_key(store._keys(f"w{i}")[0]).name, f"w{i}")
        i += 1
    for key in by_node.values():
        rec = make(key)
        assert store.claim(rec) is None
        woken = threading.Event()

        def wait(key: str = key, version: int = rec.version, woken: threading.Event = woken) -> None:
            store.wait_for_change(key, version, 60)
            woken.set()

        waiter = threading.Thread(target=wait)
        waiter.start()
        hub = store._change_hub()
        assert hub is not None and hub.subscribed.wait(20), "the listener never subscribed"
        assert store.swap(st.confirm(rec, result_json="1", now=NOW + 1, ttl=None, via="run", by="a"), rec)
        waiter.join(30)
        assert woken.is_set(), f"a waiter of {key!r} was not woken by its change"


def test_async_face_on_the_cluster(url: str) -> None:
    """The async face opens redis-py's asyncio cluster client: claim, read, swap and scan."""
    store = RedisStore(url)

    async def run() -> None:
        rec = make("a1")
        assert await store.aclaim(rec) is None
        assert await store.aclaim(rec) == rec
        assert await store.aget("a1") == rec
        done = st.confirm(rec, result_json="1", now=NOW + 1, ttl=None, via="run", by="a")
        assert await store.aswap(done, rec)
        assert not await store.aswap(done, rec)
        assert [r.key for r in await store.ascan(Query(limit=10))] == ["a1"]
        await store.aclose()

    asyncio.run(run())


def test_scripts_lost_on_every_node_are_loaded_again(store: RedisStore, nodes: Any) -> None:
    """After SCRIPT FLUSH on every master (what a failover to a node without them does), every write still
    runs exactly once: NOSCRIPT ran nothing, the store loads the script on the nodes and runs it."""
    keys = [f"s{i}" for i in range(12)]
    for key in keys[:6]:
        assert store.claim(make(key)) is None
    nodes.script_flush()  # on every primary
    assert [store.claim(make(key)) for key in keys] == [make(key) for key in keys[:6]] + [None] * 6
    nodes.script_flush()  # on every primary
    done = st.confirm(make("s0"), result_json="1", now=NOW + 1, ttl=None, via="run", by="a")
    assert store.swap(done, make("s0"))
    nodes.script_flush()  # on every primary
    assert asyncio.run(store.aclaim(make("s99"))) is None
    assert store.count_by_state() == {State.IN_FLIGHT: 12, State.CONFIRMED: 1}
    assert store.reruns == 0


def test_records_without_their_metadata_are_refused(url: str, nodes: Any) -> None:
    """Records whose metadata key is gone are refused on a cluster too, where the one-script look over
    every shard is not allowed (its keys are on several nodes): the store pipelines the same look."""
    store = RedisStore(url)
    try:
        assert store.claim(make("k1")) is None
    finally:
        store.close()
    nodes.delete(f"{parse_redis_url(url)[1]['prefix']}:meta")
    with pytest.raises(StoreCorrupt, match=r"metadata .* is gone"):
        RedisStore(url)


def test_a_master_that_evicts_is_refused(url: str, nodes: Any) -> None:
    """Each master holds records, so each one's maxmemory-policy is checked: one that evicts is refused."""
    evicting = nodes.get_primaries()[1]
    nodes.config_set("maxmemory-policy", "allkeys-lru", target_nodes=evicting)
    try:
        with pytest.raises(StoreError, match=f"Cluster node {evicting.name}.*allkeys-lru"):
            RedisStore(url)
    finally:
        nodes.config_set("maxmemory-policy", "noeviction", target_nodes=evicting)


def test_masters_that_persist_nothing_are_warned_about(
    redis_cluster_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The persistence warning is given for each master that persists nothing, naming it."""
    url = join_url(redis_cluster_url.replace("warn_persistence=false", "warn_persistence=true"), prefix=_prefix())
    with caplog.at_level(logging.WARNING, logger="onceonly.stores.redis"):
        RedisStore(url).close()
    warned = {r.getMessage() for r in caplog.records if "persists nothing" in r.getMessage()}
    assert len(warned) == 3, "one warning per master, each naming its node"


def test_a_plain_url_on_a_cluster_node_says_to_use_the_cluster_url(redis_cluster_url: str, nodes: Any) -> None:
    """redis:// on a node that does not hold every slot is refused with the URL to use instead, not a bare MOVED."""
    first = redis_cluster_url.split("?", maxsplit=1)[0].replace("redis+cluster", "redis")
    prefix = _prefix()
    while nodes.get_node_from_key(f"{prefix}:meta").port == nodes.get_primaries()[0].port:
        prefix = _prefix()
    with pytest.raises(StoreError, match=r"redis\+cluster://"):
        open_store(join_url(first, prefix=prefix, warn_persistence="false"))


def test_the_cluster_option_on_a_standalone_server_is_refused(redis_base_url: str) -> None:
    """cluster=true on a server that is not in cluster mode says so."""
    with pytest.raises(StoreError, match="not in cluster mode"):
        RedisStore(join_url(redis_base_url, prefix=_prefix(), cluster="true"))


def test_the_cluster_benchmark_runs(redis_base_url: str, redis_cluster_url: str, nodes: Any) -> None:
    """benchmarks/bench_cluster.py (quoted by docs/benchmarks.md) runs, prints its rows and leaves no keys."""
    base = f"onceonly-test-{RUN_ID}-bench"
    env = {**os.environ, "ONCEONLY_BENCH_REDIS_URL": redis_base_url, "ONCEONLY_BENCH_PREFIX_BASE": base,
           "ONCEONLY_BENCH_CLUSTER_URL": redis_cluster_url.split("?", maxsplit=1)[0]}  # fmt: skip
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_cluster.py"
    out = subprocess.run(
        [sys.executable, str(script), "--rounds", "1", "--batch", "3"], env=env, capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for row in ("one Redis", "cluster", "ratio"):
        assert row in out.stdout
    single = redis.Redis.from_url(REDIS_URL)
    try:
        assert list(single.scan_iter(match=f"{base}*")) == []
        assert list(nodes.scan_iter(match=f"{base}*")) == []
    finally:
        single.close()


def test_a_failover_loses_nothing_replicated_and_the_store_goes_on(tmp_path: Path) -> None:
    """A master SIGKILLed on a cluster with one replica each: while the failover runs, calls on its slots
    get StoreUnavailable (never a wrong answer); once its replica is promoted, every record written and
    replicated before is there, a replay does not run the tool again, and new writes on those slots work
    (the promoted node may lack the scripts: NOSCRIPT, loaded again)."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        _unavailable("redis-server and redis-cli are needed to start a Redis Cluster")
    cluster = PrivateRedisCluster(tmp_path, masters=3, replicas=1).start()
    try:
        url = f"{cluster.url}?warn_persistence=false&prefix=failover&socket_timeout=1&socket_connect_timeout=1"
        ledger = Ledger.open(url)
        runs: list[str] = []

        @ledger.tool(name="charge")
        def charge(order: str) -> dict[str, str]:
            runs.append(order)
            return {"charged": order}

        orders = [f"o{i}" for i in range(30)]
        for order in orders:
            charge(order)
        nodes = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
        for primary in nodes.get_primaries():
            assert nodes.execute_command("WAIT", 1, 5000, target_nodes=primary) == 1  # replicated
        store: Any = ledger.store
        victim = nodes.get_node_from_key(store._keys(charge.key_for("o0"))[0])
        nodes.close()
        cluster.kill(victim.port)

        refused = 0
        deadline = time.monotonic() + 30
        while True:
            try:
                assert charge("o0") == {"charged": "o0"}
                break
            except StoreUnavailable:
                refused += 1
                assert time.monotonic() < deadline, "no replica took over within 30 s"
                time.sleep(0.2)
        assert refused > 0, "the failover was never seen: the test proved nothing"
        for order in orders:
            assert charge(order) == {"charged": order}
        assert sorted(runs) == sorted(orders), "a replay after the failover ran the tool again"
        for order in ("n1", "n2", "n3"):
            assert charge(order) == {"charged": order}  # new records, on the promoted master too
        assert store.count_by_state() == {State.CONFIRMED: 33}
        ledger.close()
    finally:
        cluster.stop()
