"""Redis Cluster: a guarded call's cost on a 3-master cluster next to the same call on one Redis.

    ONCEONLY_BENCH_CLUSTER_URL=redis+cluster://127.0.0.1:7000 python benchmarks/bench_cluster.py

Both ledgers run the same ``@ledger.tool`` (first call: claim script, tool, settle script; replay: one
claim script) in interleaved rounds, on the single server $ONCEONLY_BENCH_REDIS_URL (default
redis://127.0.0.1:6379/0) and on the cluster. Printed: the median µs per call of each and their
ratio. What separates them is redis-py's cluster client (routing by slot, its per-command policy
lookup), which the store goes through on a cluster instead of writing to the thread's connection.
Each run writes under a prefix of its own ($ONCEONLY_BENCH_PREFIX_BASE-<random>) and deletes it at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any

import redis

import onceonly

SINGLE = os.environ.get("ONCEONLY_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
CLUSTER = os.environ.get("ONCEONLY_BENCH_CLUSTER_URL", "")
PREFIX_BASE = os.environ.get("ONCEONLY_BENCH_PREFIX_BASE", "onceonly-bench")


def _with(url: str, prefix: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}prefix={prefix}&warn_persistence=false"


def _round(ledger: onceonly.Ledger, tool: Any, batch: int, tag: str) -> tuple[float, float]:
    """µs per first call and per replay over ``batch`` fresh keys."""
    keys = [f"{tag}-{i}" for i in range(batch)]
    t0 = time.perf_counter()
    for k in keys:
        tool.using(key=k)(n=1)
    t1 = time.perf_counter()
    for k in keys:
        tool.using(key=k)(n=1)
    t2 = time.perf_counter()
    return (t1 - t0) / batch * 1e6, (t2 - t1) / batch * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=200)
    args = parser.parse_args()
    if not CLUSTER:
        raise SystemExit("set ONCEONLY_BENCH_CLUSTER_URL=redis+cluster://host:port (any node of the cluster)")
    prefix = f"{PREFIX_BASE}-{uuid.uuid4().hex[:8]}"
    ledgers = {
        "one Redis": onceonly.Ledger.open(_with(SINGLE, prefix)),
        "cluster": onceonly.Ledger.open(_with(CLUSTER, prefix)),
    }
    tools = {}
    for name, ledger in ledgers.items():

        @ledger.tool(name="bench.tool")
        def tool(n: int) -> dict[str, int]:
            return {"ok": n}

        tools[name] = tool
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in ledgers}
    try:
        for r in range(args.rounds):
            for name in ledgers if r % 2 == 0 else reversed(list(ledgers)):
                samples[name].append(_round(ledgers[name], tools[name], args.batch, f"r{r}"))
        first = {n: statistics.median(s[0] for s in v) for n, v in samples.items()}
        replay = {n: statistics.median(s[1] for s in v) for n, v in samples.items()}
        print(f"{'':12} {'first call µs':>14} {'replay µs':>10}")
        for name in ledgers:
            print(f"{name:12} {first[name]:14.1f} {replay[name]:10.1f}")
        ratios = first["cluster"] / first["one Redis"], replay["cluster"] / replay["one Redis"]
        print(f"{'ratio':12} {ratios[0]:14.2f} {ratios[1]:10.2f}")
    finally:
        for ledger in ledgers.values():
            ledger.close()
        single = redis.Redis.from_url(SINGLE)
        cluster = redis.RedisCluster.from_url(CLUSTER.replace("+cluster", "", 1).split("?", maxsplit=1)[0])
        for client in (single, cluster):
            keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
            for key in keys:
                client.delete(key)
            client.close()


if __name__ == "__main__":
    main()
