"""`make bench`: per-call overhead of the guard next to each store's own floor, measured in one run.

The floor of a store is what any exactly-once ledger must pay there: two raw writes per call (a claim
insert and a settle update) on hashed keys of the ledger's row shape, with the same settings. Each
round runs a batch of every contender back to back, so machine drift hits all alike; the table
reports medians of per-call times and the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onceonly
from onceonly import states as st
from onceonly.stores.sqlite import SQLiteStore


@dataclass
class Contender:
    name: str
    run: Callable[[int], None]  # run one call with a fresh operation number
    per_call: list[float] = field(default_factory=list)


def _rounds(contenders: list[Contender], rounds: int, batch: int) -> None:
    counter = 0
    for _ in range(rounds):
        for c in contenders:
            start = time.perf_counter()
            for _ in range(batch):
                counter += 1
                c.run(counter)
            c.per_call.append((time.perf_counter() - start) / batch)


def _sqlite_floor(path: Path) -> Callable[[int], None]:
    """Two raw write transactions per call on the ledger's own table shape and pragmas."""
    store = SQLiteStore(f"sqlite:///{path}")
    conn = store._conn()
    history_1 = json.dumps([{"at": time.time(), "from": None, "to": "in_flight", "fence": 1, "reason": "claim", "by": "h:1:1"}])
    history_2 = history_1[:-1] + "," + history_1[1:]
    prefix = uuid.uuid4().hex

    def run(i: int) -> None:
        key = f"default:bench.tool:{hashlib.sha256(f'{prefix}{i}'.encode()).hexdigest()[:32]}"
        now = time.time()
        conn.execute(
            "INSERT INTO onceonly_records (key, scope, tool, fingerprint, state, attempts, fence, version, lease_owner, "
            "lease_until, created_at, updated_at, args, history, conflicts) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,0)",
            (key, "default", "bench.tool", key[-32:] * 2, "in_flight", 1, 1, 1, "h:1:1", now + 30, now, now,
             '{"i":%d,"title":"t"}' % i, history_1),
        )
        conn.execute(
            "UPDATE onceonly_records SET state=?, version=?, lease_owner=NULL, lease_until=NULL, result=?, via=?, "
            "expires_at=?, updated_at=?, history=? WHERE key=? AND version=?",
            ("confirmed", 2, '{"ok":true,"i":%d}' % i, "run", now + 86400, now, history_2, key, 1),
        )

    return run


def bench_sqlite(rounds: int, batch: int, workdir: Path) -> dict[str, float]:
    ledger = onceonly.Ledger.open(f"sqlite:///{workdir / 'ledger.db'}")
    floor = _sqlite_floor(workdir / "floor.db")

    def tool_body(i: int) -> dict[str, object]:
        return {"ok": True, "i": i}

    guarded = ledger.tool(name="bench.tool")(tool_body)
    replay_keys: list[int] = []

    def first(i: int) -> None:
        guarded(i)
        replay_keys.append(i)

    def replay(i: int) -> None:
        guarded(replay_keys[i % len(replay_keys)])

    bare = Contender("bare tool", tool_body)
    contenders = [bare, Contender("floor: 2 raw writes", floor), Contender("guarded first call", first)]
    first(0)
    contenders.append(Contender("replay", replay))
    _rounds(contenders, rounds, batch)
    ledger.close()
    return report("sqlite", contenders)


def report(store: str, contenders: list[Contender]) -> dict[str, float]:
    floor = next(c for c in contenders if c.name.startswith("floor"))
    out: dict[str, float] = {}
    rows = []
    for c in contenders:
        ratios = [a / b for a, b in zip(c.per_call, floor.per_call, strict=True)]
        med = statistics.median(c.per_call) * 1e6
        ratio = statistics.median(ratios)
        out[c.name] = ratio
        rows.append((store, c.name, med, ratio))
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"onceonly per-call cost, {store} (median of rounds)")
        for col in ("store", "what", "µs / call", "× floor"):
            table.add_column(col, justify="right" if col != "what" else "left")
        for s, name, med, ratio in rows:
            table.add_row(s, name, f"{med:.1f}", f"{ratio:.2f}")
        Console().print(table)
    except ImportError:  # pragma: no cover
        for s, name, med, ratio in rows:
            print(f"{s:8} {name:28} {med:9.1f} µs  {ratio:5.2f}× floor")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=200)
    parser.add_argument("--stores", default="sqlite")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="onceonly-bench-") as tmp:
        for store in args.stores.split(","):
            if store == "sqlite":
                results["sqlite"] = bench_sqlite(args.rounds, args.batch, Path(tmp))
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
