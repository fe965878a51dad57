"""Server: requests per second of POST /tickets with and without the idempotency middleware.

Three ticket services run side by side on 127.0.0.1, one process each, same code, same machine:
no middleware (``--no-idempotency``), the middleware in transactional mode (the key row in the
ticket's own SQLite transaction, the default) and in store mode (keys in a SQLite onceonly store).
An httpx load loop on loopback sends each a batch of POST /tickets, every one with a fresh key (the
cost of a first call: a replay is cheaper), round after round, interleaved so drift hits all alike.
Two load shapes: one request at a time (latency), and 8 in flight (throughput).

    python benchmarks/bench.py --stores server            # or: python benchmarks/bench_server.py
    python benchmarks/bench_server.py --rounds 60 --batch 50 --seconds 18

``bench(rounds, batch, workdir)`` takes about 30 s at most, whatever rounds and batch it is asked:
rounds are clamped to 3 to 60, batches to 20 to 50, and no round starts after ``--seconds`` (18) of
measuring.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import select
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

CONCURRENCY = 8
TIME_BUDGET = 18.0  # seconds of measuring, after the servers started
# httpx leaves Nagle on: its separate header and body writes would then wait for a delayed ACK
# (~40 ms a request on Linux loopback) and measure TCP, not the server.
NODELAY = [(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)]
BODY = {"session_id": "bench", "title": "printer broken", "body": "x" * 200}


class Service:
    """``python -m onceonly.tickets`` on a free port, with the given flags."""

    def __init__(self, name: str, workdir: Path, *flags: str) -> None:
        self.name = name
        slug = re.sub(r"\W+", "-", name)
        self.log = (workdir / f"{slug}.log").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "onceonly.tickets", "--port", "0", "--db", str(workdir / f"{slug}.db"),
             "--log-level", "warning", *flags],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
        )  # fmt: skip

    def wait_ready(self) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        found = re.search(r"serving on (\S+)", line)
        if found is None:
            raise RuntimeError(f"{self.name}: the ticket service did not start ({line!r}); see {self.log.name}")
        return found.group(1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


async def _measure(client: httpx.AsyncClient, n: int, workers: int) -> float:
    """Requests per second of ``n`` POST /tickets, each with a fresh key, ``workers`` in flight."""
    todo = iter(range(n))

    async def worker() -> None:
        for _ in todo:
            r = await client.post("/tickets", json=BODY, headers={"Idempotency-Key": uuid.uuid4().hex})
            if r.status_code != 201:
                raise RuntimeError(f"unexpected {r.status_code}: {r.text[:200]}")

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return n / (time.perf_counter() - start)


async def _run(
    names: list[str], urls: list[str], rounds: int, batch: int, budget: float
) -> dict[int, dict[str, list[float]]]:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    clients = [
        httpx.AsyncClient(
            base_url=u, timeout=30, transport=httpx.AsyncHTTPTransport(limits=limits, socket_options=NODELAY)
        )
        for u in urls
    ]
    results: dict[int, dict[str, list[float]]] = {w: {n: [] for n in names} for w in (1, CONCURRENCY)}
    try:
        for c in clients:
            await _measure(c, 50, CONCURRENCY)  # warm-up: imports, connections, SQLite caches
        deadline = time.monotonic() + budget
        for _ in range(rounds):
            for name, c in zip(names, clients, strict=True):
                for workers in (1, CONCURRENCY):
                    results[workers][name].append(await _measure(c, batch, workers))
            if time.monotonic() > deadline:
                break
    finally:
        for c in clients:
            await c.aclose()
    return results


async def _in_process(workdir: Path, n: int = 2000) -> dict[str, float]:
    """µs per request of the middleware itself around a trivial app, no network: its own cost."""
    from onceonly.server import IdempotencyMiddleware
    from onceonly.stores import open_store

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"id":1}'})

    store = open_store(f"sqlite:///{workdir / 'inproc-keys.db'}")
    variants = {
        "no middleware": app,
        "middleware, transactional": IdempotencyMiddleware(app, transactional=True, client_secret="b" * 32),
        "middleware, store sqlite": IdempotencyMiddleware(app, store=store),
    }

    async def one(target: object, key: str) -> None:
        scope = {"type": "http", "method": "POST", "path": "/tickets", "query_string": b"", "root_path": "",
                 "headers": [(b"idempotency-key", key.encode()), (b"authorization", b"Bearer bench")]}  # fmt: skip
        messages = [{"type": "http.request", "body": b'{"session_id":"bench"}', "more_body": False}]

        async def receive() -> dict[str, object]:
            return messages.pop() if messages else {"type": "http.disconnect"}

        async def send(message: object) -> None:
            pass

        await target(scope, receive, send)  # type: ignore[operator]

    out: dict[str, float] = {}
    try:
        for name, target in variants.items():
            for _ in range(200):
                await one(target, uuid.uuid4().hex)
            start = time.perf_counter()
            for _ in range(n):
                await one(target, uuid.uuid4().hex)
            out[name] = (time.perf_counter() - start) / n * 1e6
    finally:
        store.close()
    return out


def bench(rounds: int, batch: int, workdir: Path, budget: float = TIME_BUDGET) -> list[dict[str, object]]:
    """Measure; print a table; return rows (requests/s medians and the ratio to no middleware)."""
    # Small batches, many rounds: a burst of load from elsewhere on the machine then hits every
    # contender of a round alike, and the medians of per-round ratios stay comparable.
    rounds = max(3, min(rounds, 60))
    batch = max(20, min(batch, 50))
    specs = [
        ("no middleware", ("--no-idempotency",)),
        ("middleware, transactional", ()),
        ("middleware, store sqlite", ("--idempotency-store", f"sqlite:///{workdir / 'keys.db'}")),
    ]
    services = [Service(name, workdir, *flags) for name, flags in specs]
    try:
        urls = [s.wait_ready() for s in services]
        results = asyncio.run(_run([s.name for s in services], urls, rounds, batch, budget))
    finally:
        for s in services:
            s.stop()
    rows: list[dict[str, object]] = []
    for workers, data in results.items():
        shape = "1 at a time" if workers == 1 else f"{workers} in flight"
        base = data["no middleware"]
        for name, rps in data.items():
            ratios = [a / b for a, b in zip(rps, base, strict=True)]
            rows.append(
                {
                    "store": "server",
                    "what": f"{name} ({shape})",
                    "req_per_s": round(statistics.median(rps)),
                    "us_per_request": round(1e6 / statistics.median(rps), 1),
                    "x_without": round(statistics.median(ratios), 2),
                    "rounds": len(rps),
                }
            )
    for name, us in asyncio.run(_in_process(workdir)).items():
        rows.append(
            {"store": "server", "what": f"{name} (in-process, no network)", "req_per_s": round(1e6 / us),
             "us_per_request": round(us, 1), "x_without": None, "rounds": 1}
        )  # fmt: skip
    _print(rows, batch)
    return rows


def _print(rows: list[dict[str, object]], batch: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"POST /tickets on 127.0.0.1, {batch} requests per round (medians over interleaved rounds)")
    for col in ("what", "req/s", "µs / request", "ratio to none", "rounds"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for r in rows:
        ratio = "" if r["x_without"] is None else f"{r['x_without']:.2f}"
        table.add_row(str(r["what"]), str(r["req_per_s"]), str(r["us_per_request"]), ratio, str(r["rounds"]))
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=60, help="interleaved rounds (3-60)")
    parser.add_argument("--batch", type=int, default=50, help="requests per contender per round (20-50)")
    parser.add_argument("--seconds", type=float, default=TIME_BUDGET, help="stop starting rounds after this")
    args = parser.parse_args(argv)  # before any server starts: --help starts none
    with tempfile.TemporaryDirectory(prefix="onceonly-bench-server-") as tmp:
        bench(args.rounds, args.batch, Path(tmp), args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
