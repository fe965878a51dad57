"""Near-duplicate calls (``similar=``): what the group lookup adds to a guarded call, per store.

A guarded first call without ``similar=`` is the floor; next to it, a first call with ``similar=`` in a
group that holds ``--group`` earlier calls (every lookup reads and scores up to 100 of them), its two
parts timed alone (the store's lock and read of the group, then freeing it; the scoring of what it
read), and a reworded re-plan that is taken for one of them (a replay). ``--records`` records of another tool are in
the ledger first (default 2,000; ``--records 1000000`` for a large one): the lookup reads one group
through its index, so their number must not show. The store calls of one call of each kind are
counted and printed beside the times.

    python benchmarks/bench_similar.py [--stores sqlite,redis,postgres] [--records 2000] [--group 100]
                                       [--rounds 10] [--batch 50]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import string
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _harness import Contender, bench_records, interleave, report

import onceonly
from onceonly import states as st
from onceonly.similar import Candidate, best_match
from onceonly.stores.base import SimilarStore

#: Store methods a guarded call may use: counted per call kind.
_COUNTED = ("get", "claim", "insert", "swap", "similar_lock", "similar_claim", "similar_unlock")


def _words(rng: random.Random, n: int) -> str:
    """``n`` pseudo-words: titles that are unlike each other (so each lookup scores every candidate)."""
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(n))


def _preload(store: Any, records: int) -> None:
    """``records`` settled records of another tool, written through the store's own insert."""
    claimed, _ = bench_records()
    started = time.time()
    for i in range(records):
        store.insert(st.replace(claimed, key=f"preload:other:{i:032x}", scope="preload", tool="other"))
        if i and i % 100_000 == 0:
            print(f"  {i:,} records after {time.time() - started:.0f} s", file=sys.stderr)


def _counting(store: Any) -> Counter[str]:
    """Count the guard's calls of ``store``'s primitives from now on (instance attributes over its
    methods); a primitive that calls another (SQLite's claim inserts) counts once."""
    calls: Counter[str] = Counter()
    inside: list[str] = []
    for name in _COUNTED:
        method = getattr(store, name)

        def counted(*args: Any, _m: Callable[..., Any] = method, _n: str = name, **kw: Any) -> Any:
            if not inside:
                calls[_n] += 1
            inside.append(_n)
            try:
                return _m(*args, **kw)
            finally:
                inside.pop()

        setattr(store, name, counted)
    return calls


def bench_store(kind: str, url: str, records: int, group: int, rounds: int, batch: int) -> list[dict[str, object]]:
    rng = random.Random(7)
    with onceonly.Ledger.open(url) as ledger:
        _preload(ledger.store, records)
        sim = onceonly.Similar(fields=("title",), threshold=0.85, window=3600)

        @ledger.tool(name="plain_ticket", key=("session_id", "title"))
        def plain_ticket(session_id: str, title: str) -> dict[str, str]:
            return {"title": title}

        @ledger.tool(name="similar_ticket", key=("session_id", "title"), similar=sim)
        def similar_ticket(session_id: str, title: str) -> dict[str, str]:
            return {"title": title}

        titles = [_words(rng, 4) for _ in range(group)]
        for title in titles:  # two groups of `group` earlier calls: one grows with first calls, one is re-planned
            similar_ticket("hot", title)
            similar_ticket("replan", title)
        plain_ticket("warm", "warm up")
        hot = similar_ticket.spec.call(("hot", ""), {}, None, 1).similar
        assert hot is not None
        store = ledger.store
        assert isinstance(store, SimilarStore)

        def store_part(i: int) -> list[Candidate]:
            """The lookup's store calls alone: lock the hot group and read it, then free it."""
            now = time.time()
            found = store.similar_lock(hot.group, "bench", now, now + 10, now - sim.window, sim.candidates)
            store.similar_unlock(hot.group, "bench")
            assert found is not None  # nothing else holds the lock
            return found

        found = store_part(0)

        calls = _counting(ledger.store)
        counts: dict[str, dict[str, int]] = {}
        kinds: list[tuple[str, Callable[[], object]]] = [
            ("plain first call", lambda: plain_ticket("plain", _words(rng, 4))),
            ("similar first call", lambda: similar_ticket("hot", _words(rng, 4))),
            ("similar re-plan (replay)", lambda: similar_ticket("replan", "The " + titles[-1] + "!")),
        ]
        for what, do in kinds:
            calls.clear()
            do()
            counts[what] = dict(calls)

        contenders = [
            Contender("plain first call (the floor)", lambda i: plain_ticket("plain", f"{_words(rng, 3)} {i}")),
            Contender(f"similar first call, {group} in the group", lambda i: similar_ticket("hot", _words(rng, 4))),
            Contender("  its store calls alone (lock and read, free)", store_part),
            Contender(f"  its scoring alone ({len(found)} candidates)",
                      lambda i: best_match(sim, {"title": _words(rng, 4)}, found, "new")),
            Contender("similar re-plan taken for an earlier call",
                      lambda i: similar_ticket("replan", f"the {titles[i % group]}")),
        ]  # fmt: skip
        interleave(contenders, rounds, batch)
    rows = report(f"{kind}, {records:,} records", contenders, floor_name="plain")
    for what, used in counts.items():
        shown = ", ".join(f"{name} {n}" for name, n in sorted(used.items()))
        print(f"{kind}: {what}: {sum(used.values())} store calls ({shown})")
    return rows


@contextlib.contextmanager
def _url(kind: str, workdir: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{workdir / 'ledger.db'}"
    elif kind == "redis":
        from bench_redis import _run_prefix
        from bench_redis import _url as redis_url

        with _run_prefix() as prefix:
            yield redis_url(prefix)
    elif kind == "postgres":
        from bench_postgres import database

        with database() as url:
            yield url
    else:
        raise SystemExit(f"--stores: unknown store {kind!r} (sqlite, redis, postgres)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", default="sqlite,redis,postgres")
    parser.add_argument("--records", type=int, default=2000, help="records of another tool stored first")
    parser.add_argument("--group", type=int, default=100, help="earlier calls in the looked-up group")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batch", type=int, default=50)
    args = parser.parse_args(argv)
    for kind in args.stores.split(","):
        with tempfile.TemporaryDirectory(prefix="onceonly-bench-") as tmp, _url(kind.strip(), Path(tmp)) as url:
            bench_store(kind.strip(), url, args.records, args.group, args.rounds, args.batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
