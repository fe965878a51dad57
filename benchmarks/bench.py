"""`make bench`: per-call overhead of the guard next to each store's own floor, measured in one run.

The floor of a store is what any exactly-once ledger pays there: two raw writes per call (a claim and
a settle) doing the same work, with the same settings. Rounds interleave every contender, and the
table gives medians of per-call times and of per-round ratios to the floor, so drift hits all alike.

    python benchmarks/bench.py [--stores sqlite,redis,postgres,server,langchain] [--rounds 30] [--batch 200] [--json]
    python benchmarks/bench.py --scale 1000000 [--stores sqlite,redis,postgres]   # bench_scale.py

"server" is the ticket service's POST /tickets with and without the idempotency middleware; "langchain"
a guarded LangChain tool's invoke next to the same tool unguarded (SQLite ledger).

One module per store (bench_<store>.py) with ``bench(rounds, batch, workdir) -> rows``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path


def _unreachable() -> tuple[type[BaseException], ...]:
    """The errors of a server that is not there: those skip their store; any other fails the run."""
    from onceonly.errors import StoreUnavailable

    kinds: list[type[BaseException]] = [OSError, StoreUnavailable]
    try:  # each driver only if installed: a store without one is a missing module above
        import redis

        kinds.append(redis.exceptions.ConnectionError)
    except ImportError:
        pass
    try:
        import psycopg

        kinds.append(psycopg.OperationalError)
    except ImportError:
        pass
    return tuple(kinds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", default="sqlite,redis,postgres,server,langchain")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="also print all rows as JSON")
    parser.add_argument(
        "--scale", type=int, metavar="RECORDS", help="scale mode (bench_scale.py): operations and per-call cost "
        "with RECORDS settled records stored, per store; --rounds and --batch default to 10 and 100 there"
    )  # fmt: skip
    args = parser.parse_args(argv)
    rows: list[dict[str, object]] = []
    if args.scale is not None:
        import bench_scale

        given = argv if argv is not None else sys.argv[1:]
        rounds = args.rounds if "--rounds" in given else 10
        batch = args.batch if "--batch" in given else 100
        for store in (s for s in args.stores.split(",") if s in bench_scale.SETUPS):
            try:
                rows += bench_scale.run(
                    [store],
                    [args.scale],
                    rounds=rounds,
                    batch=batch,
                    repeat=3,
                    processes=0,
                    seconds=0,
                    throughput_rounds=0,
                    workdir=Path(tempfile.gettempdir()),
                )
            except _unreachable() as exc:
                print(f"{store}: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
        if args.json:
            print(json.dumps(rows, indent=2))
        return 0
    with tempfile.TemporaryDirectory(prefix="onceonly-bench-") as tmp:
        for store in args.stores.split(","):
            try:
                module = importlib.import_module(f"bench_{store}")
            except ModuleNotFoundError as exc:
                print(f"{store}: no benchmark module ({exc})", file=sys.stderr)
                continue
            try:
                rows += module.bench(args.rounds, args.batch, Path(tmp))
            except _unreachable() as exc:  # an unreachable server skips its store, visibly
                print(f"{store}: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
