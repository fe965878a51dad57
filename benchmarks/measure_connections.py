"""PostgreSQL: how many server connections a process's ledger holds while it works, for ``max_connections``.

    python benchmarks/measure_connections.py                        # 4 processes, 4 threads each
    python benchmarks/measure_connections.py --threads 1 --no-async  # one of each, sync only

Makes its own database (``onceonly_conns_<random>``) on the server of ONCEONLY_BENCH_POSTGRES_URL
(default postgresql://127.0.0.1:5432/postgres) and drops it. Each process opens one ledger and keeps
everything busy at once: in each thread a tool call that outlives a third of its lease (so heartbeats
renew it), a second call of the same key from another thread (it waits, so the store LISTENs), fresh
calls in a loop, and ``asyncio.run`` of an async tool (the async face's own connections). Meanwhile
this process counts the rows of ``pg_stat_activity`` whose ``application_name`` is ``onceonly`` in
that database, every 50 ms, and prints the most seen, per process.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import threading
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

import psycopg

import onceonly

SERVER_URL = os.environ.get("ONCEONLY_BENCH_POSTGRES_URL", "postgresql://127.0.0.1:5432/postgres")


def worker(url: str, threads: int, seconds: float, use_async: bool, start: Any) -> int:
    """One process's ledger, busy for ``seconds``: its guarded calls, counted."""
    ledger = onceonly.Ledger.open(url)
    done = [0]
    lock = threading.Lock()

    @ledger.tool(name="slow", lease=1.0, wait=30.0)
    def slow(n: str) -> str:
        time.sleep(seconds / 2)  # longer than a third of the lease: heartbeats renew it
        return n

    @ledger.tool(name="quick")
    def quick(n: str) -> str:
        return n

    @ledger.tool(name="aquick")
    async def aquick(n: str) -> str:
        await asyncio.sleep(0.01)
        return n

    def holder(i: int) -> None:
        slow(f"{os.getpid()}-{i}")

    def waiter(i: int) -> None:
        time.sleep(0.2)  # after the holder's claim: this call waits on it
        slow(f"{os.getpid()}-{i}")

    def busy(i: int) -> None:
        deadline = time.monotonic() + seconds
        n = 0
        while time.monotonic() < deadline:
            quick(f"{os.getpid()}-{i}-{n}")
            if use_async:
                asyncio.run(aquick(f"{os.getpid()}-{i}-{n}"))
            n += 1
        with lock:
            done[0] += n

    start.wait(60)
    pool = [threading.Thread(target=f, args=(i,)) for i in range(threads) for f in (holder, waiter, busy)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    ledger.close()
    return done[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--threads", type=int, default=4, help="threads per process, each a holder, waiter and caller")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--no-async", action="store_true", help="the callers make no async calls")
    args = parser.parse_args()

    name = f"onceonly_conns_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(SERVER_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        url = urlsplit(SERVER_URL)._replace(path=f"/{name}").geturl() + "?warn_durability=false"
        try:
            ctx = multiprocessing.get_context("spawn")
            with ctx.Manager() as manager:
                start = manager.Barrier(args.processes + 1)
                with ctx.Pool(args.processes) as pool:
                    pending = pool.starmap_async(
                        worker,
                        [(url, args.threads, args.seconds, not args.no_async, start) for _ in range(args.processes)],
                    )
                    start.wait(60)
                    most, kinds = 0, ""
                    while not pending.ready():
                        rows = admin.execute(
                            "SELECT state, count(*) FROM pg_stat_activity WHERE datname = %s "
                            "AND application_name = 'onceonly' GROUP BY state ORDER BY state",
                            (name,),
                        ).fetchall()
                        seen = sum(n for _, n in rows)
                        if seen > most:
                            most, kinds = seen, ", ".join(f"{n} {s}" for s, n in rows)
                        time.sleep(0.05)
                    calls = sum(pending.get())
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    print(f"{args.processes} processes x {args.threads} threads (holder, waiter, caller each), {calls} calls")
    print(f"most server connections seen at once: {most} ({kinds})")
    print(f"per process: {most / args.processes:.2f}")


if __name__ == "__main__":
    main()
