"""The benchmark harness: interleaved rounds, per-round ratios to the floor, one rich table."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from onceonly.states import Record


@dataclass
class Contender:
    """One thing measured: ``run(i)`` does one call for operation number ``i``."""

    name: str
    run: Callable[[int], object]
    per_call: list[float] = field(default_factory=list)


def tool_body(i: int) -> dict[str, object]:
    """The benchmarked tool: no work of its own, so what is measured is the guard and the store."""
    return {"ok": True, "i": i}


def bench_records(args_json: str = "{}", result_json: str = "{}") -> tuple[Record, Record]:
    """A record of the ledger's own shape, once claimed and once settled (for the floors' writes)."""
    from onceonly import states as st

    now = time.time()
    claimed = st.new_record(
        key="bench", scope="default", tool="bench.tool", fingerprint="f" * 64, args_json=args_json,
        state=st.State.IN_FLIGHT, owner="h:1:1", now=now, lease_seconds=30,
    )  # fmt: skip
    settled = st.confirm(claimed, result_json=result_json, now=now, ttl=86400, via="run", by="h:1:1")
    return claimed, settled


def floor_histories() -> tuple[str, str]:
    """The history JSON of a floor's record once claimed and once settled: the ledger's own shape."""
    claimed, settled = bench_records()
    return claimed.history_json, settled.history_json


def guarded_pair(call: Callable[[int], object], warm: int = 1) -> tuple[Contender, Contender]:
    """A guarded first call (a new operation each time) and a replay of one already done."""
    done: list[int] = []

    def first(i: int) -> None:
        call(i)
        done.append(i)

    def replay(i: int) -> None:
        call(done[i % len(done)])

    for i in range(-warm, 0):  # warm connections and prepared statements; seed the replay set
        first(i)
    return Contender("guarded first call", first), Contender("replay (from the store)", replay)


def interleave(contenders: list[Contender], rounds: int, batch: int) -> None:
    """Each round runs a batch of every contender back to back, so drift hits all alike."""
    counter = 0
    for _ in range(rounds):
        for c in contenders:
            start = time.perf_counter()
            for _ in range(batch):
                counter += 1
                c.run(counter)
            c.per_call.append((time.perf_counter() - start) / batch)


def report(store: str, contenders: list[Contender], floor_name: str = "floor") -> list[dict[str, object]]:
    """Print the table for one store; return its rows (µs per call, median ratio to the floor)."""
    floor = next(c for c in contenders if c.name.startswith(floor_name))
    rows = []
    for c in contenders:
        ratios = [a / b for a, b in zip(c.per_call, floor.per_call, strict=True)]
        rows.append(
            {
                "store": store,
                "what": c.name,
                "us_per_call": round(statistics.median(c.per_call) * 1e6, 1),
                "x_floor": round(statistics.median(ratios), 2),
            }
        )
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"onceonly per-call cost on {store} (medians over interleaved rounds)")
    table.add_column("store")
    table.add_column("what")
    table.add_column("µs / call", justify="right")
    table.add_column("x floor", justify="right")
    for r in rows:
        table.add_row(str(r["store"]), str(r["what"]), f"{r['us_per_call']:.1f}", f"{r['x_floor']:.2f}x")
    Console().print(table)
    return rows


# How long a worker may take to start (spawn, import, connect) before the round is given up.
START_TIMEOUT = 120.0
_BROKEN = "the start barrier broke (another worker failed or did not start in time)"


def _rate_worker(make: Callable[[str, int], Callable[[int], object]], kind: str, worker: int, seconds: float,
                 start: Any, out: Any) -> None:  # fmt: skip
    """Report exactly once on ``out``: ``(worker, calls, None)``, or ``(worker, 0, what went wrong)``."""
    import threading
    import traceback

    n = 0
    try:
        call = make(kind, worker)
        start.wait(timeout=START_TIMEOUT)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            call(worker * 10_000_000 + n)
            n += 1
    except threading.BrokenBarrierError:
        out.put((worker, 0, _BROKEN))
    except BaseException as exc:
        traceback.print_exc()  # the whole story on stderr; the parent's error names it
        out.put((worker, 0, f"{type(exc).__name__}: {exc}"))
        start.abort()  # the others stop waiting for this one at the barrier
    else:
        out.put((worker, n, None))


def _reports(out: Any, procs: list[Any], deadline: float) -> list[tuple[int, int, str | None]]:
    """One report per worker, or RuntimeError when they stop answering (died, hung)."""
    import queue

    got: list[tuple[int, int, str | None]] = []
    while len(got) < len(procs):
        try:
            got.append(out.get(timeout=0.5))
            continue
        except queue.Empty:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"rate: {len(procs) - len(got)} of {len(procs)} workers did not report in time")
        if not any(p.is_alive() for p in procs):
            try:  # a report may still be in the pipe after its sender exited
                got.append(out.get(timeout=1.0))
            except queue.Empty:
                codes = [p.exitcode for p in procs]
                raise RuntimeError(f"rate: workers exited without reporting (exit codes {codes})") from None
    return got


def spawn_rate(make: Callable[[str, int], Callable[[int], object]], kind: str, processes: int, seconds: float) -> float:
    """Total calls per second of ``processes`` spawned processes each running ``make(kind, worker)``.

    ``make`` runs in the worker process and returns its call; it must be importable (a module-level
    function) for the spawn start method. A worker that fails fails the whole measure (RuntimeError,
    with the worker's error); none is left running.
    """
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_rate_worker, args=(make, kind, w, seconds, start, out), daemon=True)
             for w in range(processes)]  # fmt: skip
    try:
        for p in procs:
            p.start()
        reports = _reports(out, procs, time.monotonic() + START_TIMEOUT + seconds + 60)
        failed = [(worker, error) for worker, _, error in reports if error is not None]
        if failed:
            # The failure itself, not a broken barrier, which only says that some other worker failed.
            worker, error = next(((w, e) for w, e in failed if e != _BROKEN), failed[0])
            raise RuntimeError(f"{kind} rate: worker {worker} of {processes} failed: {error}")
        for p in procs:
            p.join(timeout=10)
        return sum(n for _, n, _ in reports) / seconds
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            if p.pid is not None:
                p.join(timeout=5)


def throughput(
    rate: Callable[[str], float], store: str, processes: int, seconds: float, rounds: int
) -> dict[str, float]:
    """The floor's and the guard's calls/s, in alternating rounds (drift hits both alike); prints and
    returns the medians and the median of the per-round ratios."""
    rates: dict[str, list[float]] = {"floor": [], "guarded": []}
    for _ in range(rounds):
        for kind, got in rates.items():
            got.append(rate(kind))
    ratios = [g / f for g, f in zip(rates["guarded"], rates["floor"], strict=True)]
    result = {kind: statistics.median(r) for kind, r in rates.items()}
    result["ratio"] = statistics.median(ratios)
    print(
        f"{store}, {processes} processes, {rounds} alternating rounds of {seconds:g} s: floor {result['floor']:.0f} "
        f"calls/s, guarded {result['guarded']:.0f} calls/s, ratio {result['ratio']:.2f} "
        f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    return result


def store_main(
    argv: list[str] | None,
    doc: str | None,
    bench: Callable[[int, int, Path], object],
    throughput_table: Callable[[int, float, int], object],
    preload: Callable[[int, int, int], object],
    decompose: Callable[[int, int], object] | None = None,
    indexes: Callable[[int, int], object] | None = None,
) -> int:
    """The command line of a store's benchmark module: the table, --throughput N, --preload N or
    (where the store has them) --decompose and --indexes."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--throughput", type=int, metavar="PROCESSES", help="guarded vs floor calls/s")
    parser.add_argument("--seconds", type=float, default=3.0, help="length of one throughput round")
    parser.add_argument("--throughput-rounds", type=int, default=3, metavar="N", help="alternating rounds")
    parser.add_argument("--preload", type=int, metavar="RECORDS", help="per-call cost with RECORDS stored")
    if decompose is not None:
        parser.add_argument("--decompose", action="store_true", help="where a first call's time goes")
    if indexes is not None:
        parser.add_argument("--indexes", action="store_true", help="what each secondary index costs a call")
    args = parser.parse_args(argv)
    if decompose is not None and args.decompose:
        decompose(args.rounds, args.batch)
    elif indexes is not None and args.indexes:
        indexes(args.rounds, args.batch)
    elif args.throughput:
        throughput_table(args.throughput, args.seconds, args.throughput_rounds)
    elif args.preload:
        preload(args.preload, args.rounds, args.batch)
    else:
        with tempfile.TemporaryDirectory(prefix="onceonly-bench-") as tmp:
            bench(args.rounds, args.batch, Path(tmp))
    return 0
