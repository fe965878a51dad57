"""A bounded fault run (``make chaos``, not part of ``make test``): one kind of fault at a time, against
SQLite, Redis and PostgreSQL, and per cell what happened to the operations.

    python -m tests.chaos [--ops 200] [--stores sqlite,redis,postgres] [--faults race,lost-answer,kill,cut,...]

Faults (each reuses the suite's machinery: tests/_workers.py's side-effect log, test_store_outage's
connection cutter):

- ``race``: 4 threads ask for every operation at once (no fault: the baseline).
- ``lost-answer``: the tool does its work, then every third operation's first attempt raises a timeout
  (the answer lost after the work was committed); the tool's probe settles it.
- ``kill``: 3 worker processes work through the operations while one of them is SIGKILLed every
  0.1-0.3 s at whatever point it is (and replaced); then the survivors' leases run out and one pass
  settles what the dead left behind, through the probe.
- ``cut`` (Redis, PostgreSQL): the ledger's connections are cut every few milliseconds (``CLIENT
  KILL``, ``pg_terminate_backend``) during one pass; then a second pass on the healthy store.
- ``clock-jump``: two callers race every operation (the tool takes up to 40 ms); one caller's clock
  steps 10 minutes ahead just after its ledger opened (and measured its offset to the store's clock,
  which it measures again only every minute); then a settling pass. Until the offset is measured
  again, the caller ahead takes the other's live leases for run out, marks them unknown and probes
  while the tool still runs: a probe that finds nothing yet lets the operation run again. Allowed not
  to be green (it does not fail the run): the limit docs/reliability.md states under "Clocks".
- ``restart-aof`` / ``restart-no-aof`` (Redis): a private ``redis-server`` of the run's own, SIGKILLed
  and started again halfway through a pass, with ``appendonly yes`` and ``appendfsync always``, or
  persisting nothing; then a second pass. Without persistence the restart loses every record, and the
  operations before it run again on the second pass: that cell shows the duplicates it costs, and is
  expected not to be green (it does not fail the run).

Per cell: operations, side effects (rows in a log the tool writes outside the ledger), duplicates
(side effects beyond one per operation), lost (an operation that ran while its record says it did not
happen, or confirmed without running), unsettled (not confirmed at the end), and settle p99 (from an
operation's claim to its confirmation, by the record's own timestamps). A cell is green only with 0
duplicates, 0 lost and 0 unsettled. Redis and PostgreSQL come from ONCEONLY_TEST_REDIS_URL and
ONCEONLY_TEST_POSTGRES_URL; the run writes under a prefix and a database of its own and removes them.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import onceonly
from onceonly import NOT_FOUND, Ledger
from onceonly.errors import OnceOnlyError
from onceonly.states import State
from tests._workers import count_effects, effects_db
from tests.conftest import POSTGRES_URL, REDIS_URL

LEASE = 0.5
RUN = uuid.uuid4().hex[:8]


def _tool(
    ledger: Ledger,
    log: Any,
    worker: str,
    fail_first: Callable[[int], bool] = lambda n: False,
    pause: float = 0.0,
    wait: float = 30,
) -> Any:
    """The operation: one row in the side-effect log, then (maybe) a lost answer; settled by a probe.
    ``pause``: up to that many seconds before and after the side effect (where a kill should land)."""

    def probe(args: dict[str, Any], key: str) -> Any:
        row = log.execute("SELECT worker FROM effects WHERE op = ?", (str(args["n"]),)).fetchone()
        return NOT_FOUND if row is None else {"n": args["n"], "by": row[0]}

    @ledger.tool(name="chaos.op", on_unknown="probe", probe=probe, lease=LEASE, wait=wait)
    def op(n: int) -> dict[str, Any]:
        done = log.execute("SELECT count(*) FROM effects WHERE op = ?", (str(n),)).fetchone()[0]
        time.sleep(random.uniform(0, pause))
        log.execute("INSERT INTO effects VALUES (?, ?, ?)", (str(n), worker, time.time()))
        time.sleep(random.uniform(0, pause))
        if done == 0 and fail_first(n):
            raise TimeoutError("the answer was lost after the work was committed")
        return {"n": n, "by": worker}

    return op


def _ask_all(tool: Any, ops: list[int]) -> None:
    """Call every operation once; an error a fault causes is expected here (the cell counts the result)."""
    for n in ops:
        with suppress(OnceOnlyError, OSError):
            tool(n)


def kill_worker(url: str, effects: str, ops: int, seed: int) -> None:
    """A worker process: every operation in a shuffled order, again and again, until it is killed."""
    ledger = Ledger.open(url)
    tool = _tool(ledger, effects_db(effects), f"w{os.getpid()}", pause=0.02)
    rng = random.Random(seed)
    order = list(range(ops))
    while True:
        rng.shuffle(order)
        _ask_all(tool, order)


# --- the cells -------------------------------------------------------------------------------------


def _race(url: str, effects: str, ops: int) -> dict[str, Any]:
    ledgers = [Ledger.open(url) for _ in range(4)]  # four callers, each with its own ledger
    tools = [_tool(ledger, effects_db(effects), f"t{i}") for i, ledger in enumerate(ledgers)]
    threads = [threading.Thread(target=_ask_all, args=(t, random.Random(i).sample(range(ops), ops))) for i, t in
               enumerate(tools)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for ledger in ledgers:
        ledger.close()
    return {}


def _lost_answer(url: str, effects: str, ops: int) -> dict[str, Any]:
    ledger = Ledger.open(url)
    _ask_all(_tool(ledger, effects_db(effects), "main", fail_first=lambda n: n % 3 == 0), list(range(ops)))
    ledger.close()
    return {"answers lost": (ops + 2) // 3}


def _kill(url: str, effects: str, ops: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("fork")  # starts in milliseconds: the kills land in the work, not the start-up
    rng = random.Random(7)
    procs = [ctx.Process(target=kill_worker, args=(url, effects, ops, i)) for i in range(3)]
    for p in procs:
        p.start()
    kills, deadline = 0, time.monotonic() + max(3.0, ops / 60)
    while time.monotonic() < deadline:
        time.sleep(rng.uniform(0.1, 0.3))
        victim = rng.randrange(len(procs))
        os.kill(procs[victim].pid or 0, signal.SIGKILL)
        procs[victim].join()
        kills += 1
        procs[victim] = ctx.Process(target=kill_worker, args=(url, effects, ops, 100 + kills))
        procs[victim].start()
    for p in procs:
        os.kill(p.pid or 0, signal.SIGKILL)
        p.join()
    time.sleep(LEASE + 0.3)  # the dead workers' leases run out
    ledger = Ledger.open(url)
    _ask_all(_tool(ledger, effects_db(effects), "settler"), list(range(ops)))
    ledger.close()
    return {"kills": kills + len(procs)}


def _cut(url: str, effects: str, ops: int, kind: str, server: str, name: str) -> dict[str, Any]:
    from tests.test_store_outage import Cutter

    ledger = Ledger.open(url)
    tool = _tool(ledger, effects_db(effects), "main")
    with Cutter(kind, server, name) as cutter:
        _ask_all(tool, list(range(ops)))
    time.sleep(LEASE + 0.3)
    _ask_all(tool, list(range(ops)))  # the healthy store: what was left open settles now
    ledger.close()
    return {"cuts": cutter.cuts}


def _clock_jump(url: str, effects: str, ops: int) -> dict[str, Any]:
    """Two callers race every operation; one's clock jumps 10 minutes ahead just after its ledger opened
    (and measured its offset to the store's clock). Then a settling pass."""
    right = Ledger.open(url)
    jumped = threading.Event()
    ahead = Ledger.open(url, clock=lambda: time.time() + (600 if jumped.is_set() else 0), store_clock=True)
    jumped.set()
    tools = [
        _tool(ledger, effects_db(effects), name, pause=0.02, wait=1)
        for ledger, name in ((right, "right"), (ahead, "ahead"))
    ]
    threads = [threading.Thread(target=_ask_all, args=(t, random.Random(i).sample(range(ops), ops))) for i, t in
               enumerate(tools)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ahead.close()
    time.sleep(LEASE + 0.3)
    _ask_all(tools[0], list(range(ops)))
    right.close()
    return {"expected not green": "a clock stepped 10 minutes"}


def _restart(workdir: Path, effects: str, ops: int, aof: bool) -> dict[str, Any]:
    """A private Redis killed and started again halfway through a pass: measured before it is stopped."""
    from tests._redis_server import PrivateRedis

    persistence = ("--appendonly", "yes", "--appendfsync", "always") if aof else ()
    server = PrivateRedis(workdir / ("aof" if aof else "no-aof"), *persistence)
    server.workdir.mkdir()
    server.start()
    try:
        url = f"{server.url}?prefix=chaos&warn_persistence=false"
        ledger = Ledger.open(url)
        tool = _tool(ledger, effects_db(effects), "main")
        first = threading.Thread(target=_ask_all, args=(tool, list(range(ops))))
        first.start()
        while sum(count_effects(effects).values()) < ops // 2 and first.is_alive():
            time.sleep(0.005)
        assert server.proc is not None
        server.proc.kill()  # a crash: no shutdown, no last write
        server.proc.wait(10)
        server.start()
        first.join()
        time.sleep(LEASE + 0.3)
        _ask_all(tool, list(range(ops)))
        ledger.close()
        cell = _measure(url, effects, ops)
        if not aof:
            cell["expected not green"] = "persists nothing"
        return cell
    finally:
        server.stop()


# --- stores and the report -------------------------------------------------------------------------


@contextmanager
def _store(kind: str, workdir: Path) -> Iterator[Callable[[str], tuple[str, str, str]]]:
    """Yields ``url_for(cell)`` → (ledger URL, server URL, connection name); removes what the run wrote."""
    if kind == "sqlite":
        yield lambda cell: (f"sqlite:///{workdir / f'{cell}.db'}", "", "")
        return
    if kind == "redis":
        import redis

        def redis_url(cell: str) -> tuple[str, str, str]:
            name = f"onceonly-chaos-{RUN}-{cell}"
            sep = "&" if "?" in REDIS_URL else "?"
            return f"{REDIS_URL}{sep}prefix={name}&warn_persistence=false&client_name={name}", REDIS_URL, name

        try:
            yield redis_url
        finally:
            client = redis.Redis.from_url(REDIS_URL)
            for key in client.scan_iter(match=f"onceonly-chaos-{RUN}-*", count=1000):
                client.delete(key)
            client.close()
        return
    import psycopg

    database = f"onceonly_chaos_{RUN}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    base = POSTGRES_URL.rsplit("/", 1)[0] + f"/{database}"

    def postgres_url(cell: str) -> tuple[str, str, str]:
        name = f"onceonly-chaos-{RUN}-{cell}"
        return f"{base}?schema=c_{cell.replace('-', '_')}&application_name={name}", base, name

    try:
        yield postgres_url
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def _measure(url: str, effects: str, ops: int) -> dict[str, Any]:
    runs = count_effects(effects)
    ledger = Ledger.open(url)
    keys = _tool(ledger, None, "")  # the same tool as the cell's: the same keys
    records = {n: ledger.get(keys.key_for(n)) for n in range(ops)}
    ledger.close()
    lost = unsettled = probed = 0
    settle: list[float] = []
    for n, rec in records.items():
        ran = runs.get(str(n), 0)
        if rec is None or rec.state is not State.CONFIRMED:
            unsettled += 1
        else:
            settle.append(rec.updated_at - rec.created_at)
            probed += rec.via != "run"
        if (ran and (rec is None or rec.state in (State.FAILED, State.ABANDONED))) or (
            not ran and rec is not None and rec.state is State.CONFIRMED
        ):
            lost += 1
    p99 = statistics.quantiles(settle, n=100)[98] if len(settle) >= 2 else (settle[0] if settle else 0.0)
    return {
        "operations": ops,
        "side effects": sum(runs.values()),
        "duplicates": sum(c - 1 for c in runs.values() if c > 1),
        "lost": lost,
        "unsettled": unsettled,
        "settle p99 ms": round(p99 * 1000, 1),
        "settled by probe": probed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=200, help="operations per cell")
    parser.add_argument("--stores", default="sqlite,redis,postgres")
    parser.add_argument("--faults", default="race,lost-answer,kill,cut,clock-jump,restart-aof,restart-no-aof")
    args = parser.parse_args()
    # What the faults make the guard and the pool log (each cut connection, each result kept for a person)
    # would bury the progress lines: the cells count what those lines report.
    logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL)
    logging.getLogger("onceonly").setLevel(logging.CRITICAL)
    started = time.monotonic()
    rows: list[tuple[str, str, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="onceonly-chaos-") as tmp:
        workdir = Path(tmp)
        for kind in args.stores.split(","):
            try:
                store = _store(kind, workdir)
                url_for = store.__enter__()
            except Exception as exc:  # an unreachable server: the cell says so, the run goes on
                rows.append((kind, "*", {"skipped": f"{type(exc).__name__}: {exc}"}))
                continue
            try:
                for fault in args.faults.split(","):
                    if (fault == "cut" and kind == "sqlite") or (fault.startswith("restart") and kind != "redis"):
                        continue  # no connection to cut; a private server to restart only for Redis
                    url, server, name = url_for(fault)
                    effects = str(workdir / f"{kind}-{fault}-effects.db")
                    effects_db(effects).close()
                    t0 = time.monotonic()
                    if fault == "race":
                        extra = _race(url, effects, args.ops)
                    elif fault == "lost-answer":
                        extra = _lost_answer(url, effects, args.ops)
                    elif fault == "kill":
                        extra = _kill(url, effects, args.ops)
                    elif fault == "cut":
                        extra = _cut(url, effects, args.ops, kind, server, name)
                    elif fault == "clock-jump":
                        extra = _clock_jump(url, effects, args.ops)
                    elif fault in ("restart-aof", "restart-no-aof"):
                        extra = _restart(workdir, effects, args.ops, aof=fault == "restart-aof")
                    else:
                        raise SystemExit(
                            f"unknown fault {fault!r}: use race, lost-answer, kill, cut, clock-jump, restart-aof or "
                            "restart-no-aof"
                        )
                    cell = extra if "operations" in extra else {**_measure(url, effects, args.ops), **extra}
                    cell["seconds"] = round(time.monotonic() - t0, 1)
                    rows.append((kind, fault, cell))
                    print(f"{kind:8} {fault:12} {cell}", file=sys.stderr, flush=True)
            finally:
                store.__exit__(None, None, None)
    columns = ["operations", "side effects", "duplicates", "lost", "unsettled", "settle p99 ms", "settled by probe"]
    print(f"| store | fault | {' | '.join(columns)} | green |")
    print(f"|{'---|' * (len(columns) + 3)}")
    red = False
    for kind, fault, cell in rows:
        if "skipped" in cell:
            print(f"| {kind} | {fault} | skipped: {cell['skipped']} |")
            red = True
            continue
        green = cell["duplicates"] == 0 and cell["lost"] == 0 and cell["unsettled"] == 0
        expected = cell.get("expected not green")
        red = red or (not green and not expected)
        verdict = "yes" if green else f"no ({expected}: expected)" if expected else "NO"
        print(f"| {kind} | {fault} | {' | '.join(str(cell[c]) for c in columns)} | {verdict} |")
    print(f"\n{len(rows)} cells in {time.monotonic() - started:.0f} s; onceonly {onceonly.__version__}")
    return 1 if red else 0


if __name__ == "__main__":
    sys.exit(main())
