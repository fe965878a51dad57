"""A bounded fault run (``make chaos``; its ``--short`` form runs in ``make test``): faults against SQLite,
Redis and PostgreSQL, and per cell what happened to the operations.

    python -m tests.chaos [--short] [--ops 200] [--stores sqlite,redis,postgres] [--faults race,kill,...]

Faults (each reuses the suite's machinery: tests/_workers.py's side-effect log, test_store_outage's
connection cutter, tests/_redis_server.py's and tests/_pg_server.py's private servers):

- ``race``: 4 threads ask for every operation at once (no fault: the baseline).
- ``lost-answer``: the tool does its work, then every third operation's first attempt raises a timeout
  (the answer lost after the work was committed); the tool's probe settles it.
- ``late-answer``: the tool runs with ``timeout=0.5``; every fifth operation answers 0.6-0.9 s after its
  side effect, when its caller has given up on it: the record becomes unknown and the probe (or the
  late answer, whichever lands first) settles it. Two callers, two threads each, ask for every operation.
- ``kill``: 3 worker processes work through the operations while one of them is SIGKILLed every
  0.1-0.3 s at whatever point it is (and replaced); then the survivors' leases run out and one pass
  settles what the dead left behind, through the probe.
- ``cut`` (Redis, PostgreSQL): the ledger's connections are cut every few milliseconds (``CLIENT
  KILL``, ``pg_terminate_backend``) during one pass; then a second pass on the healthy store.
- ``slow-tool``: the tool takes 2-4 leases (1-2 s; the lease is 0.5 s) before its side effect, while a
  second caller asks for the same operation: the holder's heartbeats must keep its lease, or a
  takeover must settle without running it twice. A tenth of the operations (at least 8), 2 callers of
  3 threads each.
- ``reconcilers``: one caller leaves every operation unknown (its first attempt times out, for even
  operations after the side effect, for odd ones before it; the caller does not wait for the probe),
  then 4 reconcilers start at once: 2 ``onceonly reconcile --app tests.chaos:chaos_app`` (the command's
  own code, in forked processes) and 2 ``ledger.reconcile()``; then a pass runs what the probes found
  had not happened.
- ``together``: lost answers, kills, cuts and reconcilers at once: 3 workers that lose every third
  first answer, one SIGKILLed every 0.1-0.3 s, 2 reconcilers (one the command with ``--every``)
  running all along, the connections of all of them cut every few milliseconds for 0.1 s of every
  0.4 s (Redis, PostgreSQL); then 4 reconcilers at once, then a settling pass.
- ``clock-jump``: two callers race every operation (the tool takes up to 40 ms); one caller's clock
  steps 10 minutes ahead just after its ledger opened (and measured its offset to the store's clock;
  on SQLite, ``store_clock=True`` makes that the host's clock); then a settling pass. The first reading
  after the step sees it (the clock against ``time.monotonic``) and measures the offset again before
  the caller compares a lease: a lease read 10 minutes off would be taken for run out, marked unknown
  and probed while the tool still runs, and a probe that finds nothing yet lets the operation run again.
- ``restart-aof`` / ``restart-no-aof`` (Redis): a private ``redis-server`` of the run's own, SIGKILLed
  and started again halfway through a pass, with ``appendonly yes`` and ``appendfsync always``, or
  persisting nothing; then a second pass. Without persistence the restart loses every record, and the
  operations before it run again on the second pass: that cell shows the duplicates it costs, and is
  expected not to be green (it does not fail the run).
- ``restart`` (PostgreSQL): a private PostgreSQL of the run's own (``initdb`` in a temporary
  directory, a free port, ``fsync=off``: the crash is the server's, not the host's) stopped in
  immediate mode (a crash: no checkpoint, every session cut) and started again halfway through a
  pass; then a second pass.
- ``failover`` (Redis): a private Redis Cluster, 3 masters with a replica each; the master of the
  first operation's slot SIGKILLed halfway through a pass; its replica is promoted; then a second pass.
  Replication is asynchronous: a write acknowledged by the master but not yet on its replica is lost
  with it, and a lost claim lets that operation run again. Allowed not to be green (it does not fail
  the run): the limit docs/redis.md states under "Failover".
- ``failover-replicas`` (Redis): the same with ``replicas=1`` in the URL: each write waits until the
  replica has it (``WAIT``), so the promoted replica holds every claim and result a caller was told of.
  The killed node is started again once its replica took over and follows it (until then the new
  master has no replica and the writes on its slots are refused, as ``StoreUnavailable``). Must be
  green.

``--short`` (the suite's tests/test_chaos.py): 30 operations per cell, and per store ``together`` and
``clock-jump``, plus ``restart-aof`` on Redis and ``restart`` on PostgreSQL.

Per cell: operations, side effects (rows in a log the tool writes outside the ledger), duplicates
(side effects beyond one per operation), lost (an operation that ran while its record says it did not
happen, or confirmed without running), unsettled (not confirmed at the end), and settle p99 (from an
operation's claim to its confirmation, by the record's own timestamps). A cell is green only with 0
duplicates, 0 lost and 0 unsettled; the run exits 1 when a cell that must be green is not, or could not
run. Redis and PostgreSQL come from ONCEONLY_TEST_REDIS_URL and ONCEONLY_TEST_POSTGRES_URL; the run
writes under a prefix and a database of its own and removes them, and stops its private servers.
"""

from __future__ import annotations

import argparse
import importlib
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
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import onceonly
from onceonly import NOT_FOUND, Ledger
from onceonly.errors import OnceOnlyError, StoreError
from onceonly.states import State
from tests._workers import count_effects, effects_db
from tests.conftest import POSTGRES_URL, REDIS_URL

LEASE = 0.5
RUN = uuid.uuid4().hex[:8]
FORK = multiprocessing.get_context("fork")  # starts in milliseconds: the kills land in the work, not the start-up

#: Every fault, in the order of the matrix, and the stores it runs on.
FAULTS: dict[str, tuple[str, ...]] = {
    "race": ("sqlite", "redis", "postgres"),
    "lost-answer": ("sqlite", "redis", "postgres"),
    "late-answer": ("sqlite", "redis", "postgres"),
    "kill": ("sqlite", "redis", "postgres"),
    "cut": ("redis", "postgres"),  # SQLite has no connection to cut
    "slow-tool": ("sqlite", "redis", "postgres"),
    "reconcilers": ("sqlite", "redis", "postgres"),
    "together": ("sqlite", "redis", "postgres"),
    "clock-jump": ("sqlite", "redis", "postgres"),
    "restart-aof": ("redis",),
    "restart-no-aof": ("redis",),
    "restart": ("postgres",),
    "failover": ("redis",),
    "failover-replicas": ("redis",),
}
SHORT = ("together", "clock-jump", "restart-aof", "restart")


def _never(n: int) -> bool:
    return False


def _on_time(n: int) -> float:
    return 0.0


@dataclass(frozen=True)
class Faults:
    """What the tool does besides its side effect, per operation number ``n``."""

    lose: Callable[[int], bool] = _never  # the first run raises a timeout after the side effect
    lose_early: Callable[[int], bool] = _never  # this tool's first attempt raises a timeout before it
    pause: float = 0.0  # up to this many seconds before and after the side effect (where a kill lands)
    slow: float = 0.0  # this many seconds more before the side effect (past the lease)
    late: Callable[[int], float] = _on_time  # seconds after the side effect (past the caller's timeout)


def _tool(
    ledger: Ledger,
    effects: str,
    worker: str,
    faults: Faults = Faults(),
    *,
    wait: float = 30,
    settle: float = 0.0,
    timeout: float | None = None,
) -> Any:
    """The operation: one row in the side-effect log at ``effects``, and the ``faults``; settled by a probe
    of that log."""
    tried: set[int] = set()
    # A connection per thread: one shared by threads lets a write meet another thread's open read of an
    # older snapshot, and SQLite then refuses it at once ("database is locked") instead of waiting.
    local = threading.local()

    def log() -> Any:
        if not hasattr(local, "conn"):
            local.conn = effects_db(effects)
        return local.conn

    def probe(args: dict[str, Any], key: str) -> Any:
        row = log().execute("SELECT worker FROM effects WHERE op = ?", (str(args["n"]),)).fetchone()
        return NOT_FOUND if row is None else {"n": args["n"], "by": row[0]}

    @ledger.tool(
        name="chaos.op", on_unknown="probe", probe=probe, lease=LEASE, wait=wait, settle=settle, timeout=timeout
    )
    def op(n: int) -> dict[str, Any]:
        done = log().execute("SELECT count(*) FROM effects WHERE op = ?", (str(n),)).fetchone()[0]
        first = n not in tried
        tried.add(n)
        if first and faults.lose_early(n):
            raise TimeoutError("timed out before the request reached the other side")
        time.sleep(faults.slow + random.uniform(0, faults.pause))
        log().execute("INSERT INTO effects VALUES (?, ?, ?)", (str(n), worker, time.time()))
        time.sleep(faults.late(n) + random.uniform(0, faults.pause))
        if done == 0 and faults.lose(n):
            raise TimeoutError("the answer was lost after the work was committed")
        return {"n": n, "by": worker}

    return op


def _ask_all(tool: Any, ops: list[int] | range, errors: list[int] | None = None) -> None:
    """Call every operation once; an error a fault causes is expected here (the cell counts the result,
    and ``errors``, if given, how many calls raised)."""
    for n in ops:
        try:
            tool(n)
        except (OnceOnlyError, OSError):
            if errors is not None:
                errors.append(n)


def _callers(tools: list[Any], ops: int, threads: int) -> None:
    """``threads`` threads per tool (per caller), each asking for every operation in an order of its own."""
    orders = [
        (t, random.Random(i * 100 + j).sample(range(ops), ops)) for i, t in enumerate(tools) for j in range(threads)
    ]
    running = [threading.Thread(target=_ask_all, args=order) for order in orders]
    for t in running:
        t.start()
    for t in running:
        t.join()


def _lost_every_third(n: int) -> bool:
    return n % 3 == 0


def _open(url: str) -> Ledger:
    """Ledger.open, again and again while the store is cut off (within 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return Ledger.open(url)
        except StoreError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def kill_worker(url: str, effects: str, ops: int, seed: int, lose: bool = False) -> None:
    """A worker process: every operation in a shuffled order, again and again, until it is killed."""
    ledger = _open(url)
    faults = Faults(pause=0.02, lose=_lost_every_third if lose else _never)
    tool = _tool(ledger, effects, f"w{os.getpid()}", faults)
    rng = random.Random(seed)
    order = list(range(ops))
    while True:
        rng.shuffle(order)
        _ask_all(tool, order)


def chaos_app() -> Ledger:
    """The ledger ``onceonly reconcile --app tests.chaos:chaos_app`` loads in a reconciler process: the
    cell's store ($ONCEONLY_CHAOS_URL) with the cell's tool, whose probe reads $ONCEONLY_CHAOS_EFFECTS."""
    ledger = _open(os.environ["ONCEONLY_CHAOS_URL"])
    _tool(ledger, os.environ["ONCEONLY_CHAOS_EFFECTS"], f"r{os.getpid()}")
    return ledger


def reconcile_worker(url: str, effects: str, ready: Barrier | None, every: float | None, command: bool) -> None:
    """A reconciler process: once all are ready, reconcile once (or every ``every`` s until killed),
    through ``onceonly reconcile`` (the command's own code) or through ``ledger.reconcile()``."""
    os.environ.update(ONCEONLY_CHAOS_URL=url, ONCEONLY_CHAOS_EFFECTS=effects)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)  # the command's report would mix into the matrix
    from onceonly.cli import cli

    importlib.import_module("tests.chaos")  # what --app imports, imported before the start: a fair race
    if ready is not None:
        ready.wait(30)
    if command:
        repeat = ["--every", f"{every}s"] if every else ["--once"]
        with suppress(SystemExit):
            cli.main(
                ["reconcile", "--app", "tests.chaos:chaos_app", "--wait", "1s", *repeat],
                prog_name="onceonly",
                standalone_mode=False,
            )
        return
    ledger = chaos_app()
    while True:
        with suppress(StoreError):
            ledger.reconcile(wait=1)
        if every is None:
            return
        time.sleep(every)


def _spawn(target: Callable[..., None], *args: Any) -> Any:
    """A forked process, started; a daemon, so that a cell that fails never leaves one behind."""
    proc = FORK.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _end(proc: Any) -> None:
    """SIGKILL, wherever it is (no shutdown); one that ended and was reaped is left alone (its PID may be
    another process's by now)."""
    if proc.exitcode is None:
        with suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    proc.join()


def _race_reconcilers(url: str, effects: str, count: int = 4) -> None:
    """``count`` reconcilers at once, half of them the command: each settles what it reads, racing."""
    ready = FORK.Barrier(count)
    procs = [_spawn(reconcile_worker, url, effects, ready, None, i % 2 == 0) for i in range(count)]
    try:
        for p in procs:
            p.join(120)
            assert p.exitcode == 0, f"a reconciler process ended with {p.exitcode}"
    finally:
        for p in procs:
            _end(p)


def _kill_some(url: str, effects: str, ops: int, lose: bool) -> int:
    """3 workers on the operations, one SIGKILLed every 0.1-0.3 s and replaced; then all killed.
    Returns the number of kills."""
    rng = random.Random(7)
    procs = [_spawn(kill_worker, url, effects, ops, i, lose) for i in range(3)]
    kills, deadline = 0, time.monotonic() + max(3.0, ops / 60)
    try:
        while time.monotonic() < deadline:
            time.sleep(rng.uniform(0.1, 0.3))
            victim = rng.randrange(len(procs))
            _end(procs[victim])
            kills += 1
            procs[victim] = _spawn(kill_worker, url, effects, ops, 100 + kills, lose)
    finally:
        for p in procs:
            _end(p)
    return kills + len(procs)


def _settling_pass(url: str, effects: str, ops: int) -> None:
    """Once every lease ran out: one caller asks for every operation (what is left open settles now)."""
    time.sleep(LEASE + 0.3)
    ledger = Ledger.open(url)
    _ask_all(_tool(ledger, effects, "settler"), range(ops))
    ledger.close()


# --- the cells -------------------------------------------------------------------------------------


def _race(url: str, effects: str, ops: int) -> dict[str, Any]:
    ledgers = [Ledger.open(url) for _ in range(4)]  # four callers, each with its own ledger
    _callers([_tool(ledger, effects, f"t{i}") for i, ledger in enumerate(ledgers)], ops, 1)
    for ledger in ledgers:
        ledger.close()
    return {}


def _lost_answer(url: str, effects: str, ops: int) -> dict[str, Any]:
    ledger = Ledger.open(url)
    _ask_all(_tool(ledger, effects, "main", Faults(lose=_lost_every_third)), range(ops))
    ledger.close()
    return {"answers lost": (ops + 2) // 3}


def _late(n: int) -> float:
    return 0.6 + (n % 4) * 0.1 if n % 5 == 0 else 0.0


def _late_answer(url: str, effects: str, ops: int) -> dict[str, Any]:
    """Two callers of two threads each; every fifth operation answers past the timeout (0.5 s)."""
    ledgers = [Ledger.open(url) for _ in range(2)]
    tools = [
        _tool(ledger, effects, f"c{i}", Faults(late=_late), timeout=0.5, settle=0.2) for i, ledger in enumerate(ledgers)
    ]
    _callers(tools, ops, 2)
    time.sleep(1.0)  # the last late answers arrive (and are checked against the records)
    for ledger in ledgers:
        ledger.close()
    return {"answers late": (ops + 4) // 5}


def _kill(url: str, effects: str, ops: int) -> dict[str, Any]:
    kills = _kill_some(url, effects, ops, lose=False)
    _settling_pass(url, effects, ops)
    return {"kills": kills}


def _cutter(kind: str, server: str, name: str) -> AbstractContextManager[Any]:
    from tests.test_store_outage import Cutter

    return Cutter(kind, server, name)


def _cut(url: str, effects: str, ops: int, kind: str, server: str, name: str) -> dict[str, Any]:
    ledger = Ledger.open(url)
    tool = _tool(ledger, effects, "main")
    with _cutter(kind, server, name) as cutter:
        _ask_all(tool, range(ops))
    ledger.close()
    _settling_pass(url, effects, ops)  # the healthy store
    return {"cuts": cutter.cuts}


def _slow_tool(url: str, effects: str, ops: int) -> dict[str, Any]:
    """Two callers of three threads each; the tool sleeps 1-2 s (2-4 leases) before its side effect."""
    ops = max(8, ops // 10)
    ledgers = [Ledger.open(url) for _ in range(2)]
    faults = Faults(slow=2 * LEASE, pause=LEASE)
    _callers([_tool(ledger, effects, f"c{i}", faults) for i, ledger in enumerate(ledgers)], ops, 3)
    for ledger in ledgers:
        ledger.close()
    return {"ops": ops}


def _even(n: int) -> bool:
    return n % 2 == 0


def _odd(n: int) -> bool:
    return n % 2 == 1


def _reconcilers(url: str, effects: str, ops: int) -> dict[str, Any]:
    """Every operation left unknown by a caller that does not wait for the probe; 4 reconcilers at once;
    then a pass runs what their probes found had not happened (the odd operations)."""
    ledger = Ledger.open(url)
    faults = Faults(lose=_even, lose_early=_odd)
    _ask_all(_tool(ledger, effects, "caller", faults, wait=0, settle=LEASE), range(ops))
    ledger.close()
    time.sleep(LEASE)  # the probes are due
    _race_reconcilers(url, effects)
    _settling_pass(url, effects, ops)
    return {"reconcilers": 4}


@contextmanager
def _cut_in_bursts(kind: str, server: str, name: str) -> Iterator[list[int]]:
    """The connections cut every few milliseconds for 0.1 s of every 0.4 s (test_store_outage's Cutter,
    again and again), so that between bursts processes that start afresh can open their ledgers and
    work: under cuts without a pause no new PostgreSQL worker gets its ledger open. Yields [cuts]."""
    cuts = [0]
    if kind == "sqlite":  # no connection to cut
        yield cuts
        return
    stop = threading.Event()

    def bursts() -> None:
        while not stop.is_set():
            with _cutter(kind, server, name) as cutter:
                stop.wait(0.1)
            cuts[0] += cutter.cuts
            stop.wait(0.3)

    thread = threading.Thread(target=bursts, daemon=True)
    thread.start()
    try:
        yield cuts
    finally:
        stop.set()
        thread.join(10)


def _together(url: str, effects: str, ops: int, kind: str, server: str, name: str) -> dict[str, Any]:
    """Workers losing answers and being killed, reconcilers running all along, connections cut in
    bursts; then racing reconcilers and a settling pass."""
    with _cut_in_bursts(kind, server, name) as cuts:
        along = [_spawn(reconcile_worker, url, effects, None, 1.0 if cmd else 0.2, cmd) for cmd in (True, False)]
        try:
            kills = _kill_some(url, effects, ops, lose=True)
        finally:
            for p in along:
                _end(p)
    ran = sum(count_effects(effects).values())
    time.sleep(LEASE + 0.3)
    _race_reconcilers(url, effects)
    _settling_pass(url, effects, ops)
    return {"ran under the faults": ran, "kills": kills, "cuts": cuts[0]}


def _clock_jump(url: str, effects: str, ops: int) -> dict[str, Any]:
    """Two callers race every operation; one's clock jumps 10 minutes ahead just after its ledger opened
    (and measured its offset to the store's clock). Then a settling pass."""
    right = Ledger.open(url)
    jumped = threading.Event()
    ahead = Ledger.open(url, clock=lambda: time.time() + (600 if jumped.is_set() else 0), store_clock=True)
    jumped.set()
    tools = [
        _tool(ledger, effects, name, Faults(pause=0.02), wait=1)
        for ledger, name in ((right, "right"), (ahead, "ahead"))
    ]
    _callers(tools, ops, 1)
    offset = ahead.clock_offset
    ahead.close()
    right.close()
    _settling_pass(url, effects, ops)
    return {"offset after the step": round(offset)}


def _crash_halfway(url: str, effects: str, ops: int, crash: Callable[[], object], start: Callable[[], object]) -> int:
    """One pass with the server crashed and started again once half the operations ran; a second pass.
    Returns how many calls of the first pass raised (0 where the store rode the crash out)."""
    ledger = Ledger.open(url)
    tool = _tool(ledger, effects, "main")
    errors: list[int] = []
    first = threading.Thread(target=_ask_all, args=(tool, range(ops), errors))
    first.start()
    while sum(count_effects(effects).values()) < ops // 2 and first.is_alive():
        time.sleep(0.005)
    crash()
    start()
    first.join()
    ledger.close()
    _settling_pass(url, effects, ops)
    return len(errors)


def _restart_redis(workdir: Path, effects: str, ops: int, aof: bool) -> dict[str, Any]:
    """A private Redis killed and started again halfway through a pass: measured before it is stopped."""
    from tests._redis_server import PrivateRedis

    persistence = ("--appendonly", "yes", "--appendfsync", "always") if aof else ()
    server = PrivateRedis(workdir / ("aof" if aof else "no-aof"), *persistence)
    server.workdir.mkdir()
    server.start()

    def crash() -> None:  # SIGKILL: no shutdown, no last write
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait(10)

    try:
        url = f"{server.url}?prefix=chaos&warn_persistence=false"
        refused = _crash_halfway(url, effects, ops, crash, server.start)
        cell = {**_measure(url, effects, ops), "calls that raised": refused}
        if not aof:
            cell["expected not green"] = "persists nothing"
        return cell
    finally:
        server.stop()


def _restart_postgres(effects: str, ops: int) -> dict[str, Any]:
    """A private PostgreSQL stopped in immediate mode and started again halfway through a pass."""
    from tests._pg_server import PrivatePostgres

    # The crash is the server's, not the host's: what reached the OS survives it, fsync or not (a power
    # loss, what fsync guards against, is not injected). Without it, crash recovery takes seconds.
    server = PrivatePostgres("fsync=off")
    try:
        server.start()
        # fsync=off on purpose (above): the store's warning at open about it would only be noise here.
        url = f"{server.url}?application_name=onceonly-chaos&warn_durability=false"
        refused = _crash_halfway(url, effects, ops, server.crash, server.start)
        return {**_measure(url, effects, ops), "calls that raised": refused}
    finally:
        server.stop()


def _failover(workdir: Path, effects: str, ops: int, replicas: int = 0) -> dict[str, Any]:
    """A private 3+3-node Redis Cluster whose master of operation 0's slot is SIGKILLed halfway through
    a pass; once a replica took over, a second pass. ``replicas``: the URL's ``replicas=``; with it the
    killed node is started again once its replica took over, and follows it (until then the promoted
    master has no replica, and the writes on its slots are refused)."""
    import redis

    from tests._redis_server import PrivateRedisCluster

    home = workdir / f"cluster-{replicas}"
    home.mkdir()
    cluster = PrivateRedisCluster(home, masters=3, replicas=1).start()
    try:
        url = f"{cluster.url}?warn_persistence=false&prefix=chaos&socket_timeout=1&socket_connect_timeout=1"
        if replicas:
            url += f"&replicas={replicas}&replicas_timeout=0.5"  # below socket_timeout
        ledger = Ledger.open(url)
        tool = _tool(ledger, "", "")
        nodes = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
        store: Any = ledger.store
        victim = nodes.get_node_from_key(store._keys(tool.key_for(0))[0]).port
        nodes.close()
        ledger.close()
        survivors = [p for p in cluster.ports if p != victim]
        url = url.replace(f":{cluster.ports[0]}/", f":{survivors[0]}/")  # an entry node that stays up

        behind: list[int] = []

        def offset(port: int) -> int:  # how far into the replication stream a node is (a replica: applied)
            info = cluster._ask(port, "INFO", "replication")
            return int(info.split(b"master_repl_offset:", 1)[1].split(b"\r\n", 1)[0])

        def crash() -> None:  # noting how many bytes of the victim's stream its replica lacks then
            replica = next(
                p for p in survivors if f"master_port:{victim}".encode() in cluster._ask(p, "INFO", "replication")
            )
            ahead = offset(victim)
            cluster.kill(victim)
            behind.append(max(0, ahead - offset(replica)))

        def promoted() -> None:  # the victim's replica is a master, and every survivor serves all slots
            deadline = time.monotonic() + 30
            while sum(cluster._ask(p, "ROLE").startswith(b"master") for p in survivors) < 3 or not all(
                b"cluster_state:ok" in cluster._ask(p, "CLUSTER", "INFO") for p in survivors
            ):
                assert time.monotonic() < deadline, "no replica took over within 30 s"
                time.sleep(0.1)
            if replicas:
                cluster.rejoin(victim)

        refused = _crash_halfway(url, effects, ops, crash, promoted)
        cell = {**_measure(url, effects, ops), "calls that raised": refused, "replica behind at the kill": behind[0]}
        if not replicas:
            cell["expected not green"] = "replication is asynchronous"
        return cell
    finally:
        cluster.stop()


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
    keys = _tool(ledger, "", "")  # the same tool as the cell's: the same keys
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
    kept = [rec for rec in records.values() if rec is not None]
    # Who settled what: reconcilers write under reconcile@host:pid, one each (the racing ones too).
    reconcilers = {e["by"] for rec in kept for e in rec.history if str(e.get("by", "")).startswith("reconcile@")}
    p99 = statistics.quantiles(settle, n=100)[98] if len(settle) >= 2 else (settle[0] if settle else 0.0)
    return {
        "operations": ops,
        "side effects": sum(runs.values()),
        "duplicates": sum(c - 1 for c in runs.values() if c > 1),
        "lost": lost,
        "unsettled": unsettled,
        "settle p99 ms": round(p99 * 1000, 1),
        "settled by probe": probed,
        "conflicts counted": sum(rec.conflicts for rec in kept),
        "went unknown": sum(any(e.get("to") == "unknown" for e in rec.history) for rec in kept),
        "via": dict(Counter(str(rec.via) for rec in kept if rec.state is State.CONFIRMED)),
        "reconcilers that wrote": len(reconcilers),
    }


#: The cells that run on the store's URL with nothing more than their operations.
_ON_THE_STORE: dict[str, Callable[[str, str, int], dict[str, Any]]] = {
    "race": _race, "lost-answer": _lost_answer, "late-answer": _late_answer, "kill": _kill,
    "slow-tool": _slow_tool, "reconcilers": _reconcilers, "clock-jump": _clock_jump,
}  # fmt: skip


def _run_cell(
    fault: str, kind: str, url: str, server: str, name: str, workdir: Path, effects: str, ops: int
) -> dict[str, Any]:
    """One cell: the fault's run, then its measure (a cell on a private server measures before stopping it)."""
    if fault in ("restart-aof", "restart-no-aof"):
        return _restart_redis(workdir, effects, ops, aof=fault == "restart-aof")
    if fault == "restart":
        return _restart_postgres(effects, ops)
    if fault == "failover":
        return _failover(workdir, effects, ops)
    if fault == "failover-replicas":
        return _failover(workdir, effects, ops, replicas=1)
    if fault in ("cut", "together"):  # these cut the connections named ``name`` on ``server``
        extra = (_cut if fault == "cut" else _together)(url, effects, ops, kind, server, name)
    else:
        extra = _ON_THE_STORE[fault](url, effects, ops)
    return {**_measure(url, effects, extra.pop("ops", ops)), **extra}


COLUMNS = ["operations", "side effects", "duplicates", "lost", "unsettled", "settle p99 ms", "settled by probe"]


def _verdict(cell: dict[str, Any]) -> tuple[str, bool]:
    """The matrix's last column, and whether the cell fails the run (a cell that must be green is not)."""
    if "skipped" in cell:
        return f"could not run: {cell['skipped']}", True
    if cell["duplicates"] == 0 and cell["lost"] == 0 and cell["unsettled"] == 0:
        return "yes", False
    expected = cell.get("expected not green")
    return (f"no ({expected}: allowed)", False) if expected else ("NO", True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", action="store_true", help=f"30 operations per cell, faults {','.join(SHORT)}")
    parser.add_argument("--ops", type=int, default=None, help="operations per cell (default 200; 30 with --short)")
    parser.add_argument("--stores", default="sqlite,redis,postgres")
    parser.add_argument("--faults", default=None, help=f"default: {','.join(FAULTS)}")
    args = parser.parse_args(argv)
    ops = args.ops or (30 if args.short else 200)
    faults = (args.faults or ",".join(SHORT if args.short else FAULTS)).split(",")
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown fault {', '.join(unknown)}: use {', '.join(FAULTS)}")
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
                for fault in faults:
                    if kind not in FAULTS[fault]:
                        continue
                    url, server, name = url_for(fault)
                    effects = str(workdir / f"{kind}-{fault}-effects.db")
                    effects_db(effects).close()
                    t0 = time.monotonic()
                    try:
                        cell = _run_cell(fault, kind, url, server, name, workdir, effects, ops)
                    except Exception as exc:  # a private server that would not start: the cell says so
                        cell = {"skipped": f"{type(exc).__name__}: {exc}"}
                    cell["seconds"] = round(time.monotonic() - t0, 1)
                    rows.append((kind, fault, cell))
                    print(f"{kind:8} {fault:14} {cell}", file=sys.stderr, flush=True)
            finally:
                store.__exit__(None, None, None)
    print(f"| store | fault | {' | '.join(COLUMNS)} | green |")
    print(f"|{'---|' * (len(COLUMNS) + 3)}")
    red = False
    for kind, fault, cell in rows:
        verdict, fails = _verdict(cell)
        red = red or fails
        figures = " | ".join(str(cell.get(c, "")) for c in COLUMNS)
        print(f"| {kind} | {fault} | {figures} | {verdict} |")
    print(f"\n{len(rows)} cells in {time.monotonic() - started:.0f} s; onceonly {onceonly.__version__}")
    return 1 if red else 0


if __name__ == "__main__":
    sys.exit(main())
