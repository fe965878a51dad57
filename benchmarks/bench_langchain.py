"""LangChain: a guarded tool's ``invoke`` next to the same tool unguarded, on a SQLite ledger.

    python benchmarks/bench.py --stores langchain          # or: python benchmarks/bench_langchain.py

Each call is what a ``ToolNode`` sends: a tool call (name, arguments, id) with a config that names the
thread, and a ``ToolMessage`` back. The floor is the same LangChain tool without onceonly. The
bound is that floor plus the guard by itself (``@ledger.tool`` on the tool's function, a first call on
the same SQLite file), measured as one contender that does both: a guarded first call at most that
bound (``guarded / bound`` <= 1) adds no more than the SQLite first-call cost, no framework round trip.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from _harness import Contender, interleave, report
from langchain_core.tools import tool

import onceonly
from onceonly.langchain import guard

CONFIG: Any = {"configurable": {"thread_id": "bench-thread"}}


def charge(amount: int) -> str:
    """Charge a card (no work of its own: what is measured is LangChain and the guard)."""
    return f"charged {amount}"


def bench(rounds: int, batch: int, workdir: Path) -> list[dict[str, object]]:
    ledger = onceonly.Ledger.open(f"sqlite:///{workdir / 'langchain-ledger.db'}")
    bare = tool(charge)
    guarded = guard(tool(charge), ledger)
    plain = ledger.tool(name="bench.charge")(charge)
    done: list[int] = []

    def call(i: int) -> dict[str, Any]:
        return {"type": "tool_call", "name": "charge", "args": {"amount": i}, "id": f"call_{i}"}

    def unguarded(i: int) -> None:
        bare.invoke(call(i), CONFIG)

    def first(i: int) -> None:
        guarded.invoke(call(i), CONFIG)
        done.append(i)

    def replay(i: int) -> None:
        guarded.invoke(call(done[i % len(done)]), CONFIG)

    def bound(i: int) -> None:
        # Measured as one contender, not as the sum of two: what the two cost when they run together.
        unguarded(i)
        with ledger.task("bench-thread"):
            plain(i)

    for i in range(-50, 0):  # warm the connection, LangChain's caches; seed the replays
        first(i)
        bound(i - 1000)
    contenders = [
        Contender("floor: the same tool unguarded, invoke", unguarded),
        Contender("guarded tool invoke, first call", first),
        Contender("guarded tool invoke, replay", replay),
        Contender("bound: unguarded + @ledger.tool", bound),
    ]
    interleave(contenders, rounds, batch)
    ledger.close()
    rows = report("langchain", contenders)
    _, guarded_first, _, limit = contenders
    # Per round, like the table: the median of the per-round ratios.
    ratio = statistics.median(g / b for g, b in zip(guarded_first.per_call, limit.per_call, strict=True))
    print(f"langchain: guarded first call / bound = {ratio:.2f} (at most 1: no more than the guard's own cost)")
    rows.append({"store": "langchain", "what": "guarded first call / bound", "x_floor": round(ratio, 2)})
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=200)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="onceonly-bench-") as tmp:
        bench(args.rounds, args.batch, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
