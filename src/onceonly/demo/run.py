"""Running the demo: for each strategy, a fresh ticket service on 127.0.0.1, its agents in threads, and
the count of what ended up in the service's database.

Counting, per strategy (docs/demo.md):

- ``asked``: operations (distinct tickets) the agents asked for; re-plans and second agents ask for
  an operation again, they are not new operations, nor is a re-plan in other words.
- ``created``: tickets in the service's database.
- ``duplicates``: tickets beyond the first of an operation, whatever their titles: a ticket counts
  to the operation its body's tag names (``workload.op_of``).
- ``missing``: operations with no ticket that the strategy did not report as definitely failed: it
  said "done", or it does not know.
- ``unsettled``: operations whose outcome the strategy does not know at the end (naive, key-only: no
  ask of it succeeded; onceonly: none of its ledger records is confirmed, and not all failed, after the
  reconciler).
- ``p50_ms`` / ``p99_ms``: the latency of one ask as its agent saw it, retries and waits included.
"""

from __future__ import annotations

import dataclasses
import math
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onceonly.demo.strategies import DONE, FAILED, STRATEGIES, UNSETTLED, Strategy, unavailable
from onceonly.demo.workload import Workload, make_workload, op_of
from onceonly.stores import redact_url

__all__ = ["DemoConfig", "DemoResult", "StrategyResult", "count", "percentile", "run_demo"]

#: How the fault rate is shared among the fault kinds of the ticket service.
FAULT_MIX = {"lost": 0.4, "delay": 0.3, "fail": 0.3}


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """The demo's knobs (``onceonly demo --help``).

    Attributes:
        agents: simulated agents, each a thread.
        ops: operations (distinct tickets) asked for, over all agents.
        fault_rate: probability that a ``POST /tickets`` meets a fault: its answer is lost after the
            commit, delayed past the client's timeout, or it fails before the commit (``FAULT_MIX``).
        seed: seeds the asks and the service's faults; the same seed gives the same counts, however
            the agents' threads interleave (the latencies vary; docs/demo.md).
        url: the onceonly ledger's store (default: a SQLite file in a temporary directory).
        timeout: the client's timeout per request, in seconds.
        delay_seconds: how long a delayed answer is held (past ``timeout``).
        settle: seconds the onceonly tool waits after an unknown outcome before it probes.
        replan_rate: share of operations that the same agent asks for again, the body re-worded.
        shared_rate: share of operations that the other agent of the session asks for too.
        reword_rate: share of operations that the same agent asks for again in other words, title and
            body (``workload.reword``): only ``onceonly+similar`` takes those for the same ticket.
        strategies: which to run, in order (one whose extra is not installed is skipped, and said so).

    .. versionadded:: 0.1
    """

    agents: int = 8
    ops: int = 200
    fault_rate: float = 0.2
    seed: int = 7
    url: str | None = None
    timeout: float = 0.5
    delay_seconds: float = 1.0
    settle: float = 1.0
    replan_rate: float = 0.1
    shared_rate: float = 0.1
    reword_rate: float = 0.1
    strategies: tuple[str, ...] = ("naive", "key-only", "onceonly", "onceonly+server", "onceonly+similar")

    def __post_init__(self) -> None:
        if self.agents < 1 or self.ops < 1:
            raise ValueError(f"--agents {self.agents} --ops {self.ops}: at least one of each")
        if not 0 <= self.fault_rate <= 1:
            raise ValueError(f"--fault-rate {self.fault_rate}: a probability between 0 and 1")
        if not 0 <= self.reword_rate <= 1:
            raise ValueError(f"--reword-rate {self.reword_rate}: a probability between 0 and 1")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown:
            raise ValueError(f"unknown strategies {unknown}: use {sorted(STRATEGIES)}")


@dataclass(frozen=True, slots=True)
class StrategyResult:
    """One strategy's row. ``to_dict`` is its JSON form (the shape ``onceonly demo --json`` prints).

    .. versionadded:: 0.1
    """

    name: str
    asked: int
    created: int
    duplicates: int
    missing: int
    unsettled: int
    p50_ms: float
    p99_ms: float
    calls: int = 0  # asks, re-plans and second agents included
    duplicates_reasked: int = 0  # of the duplicates, those of operations asked more than once
    duplicates_reworded: int = 0  # of those, the ones of operations asked again in other words
    faults: dict[str, int] = field(default_factory=dict)  # faults injected: the service's, and "reword" asks
    seconds: float = 0.0
    reconciled: dict[str, int] = field(default_factory=dict)  # onceonly: what its reconciler did
    settled: dict[str, int] = field(default_factory=dict)  # onceonly: operations by how they were settled
    similar_replayed: int = 0  # onceonly+similar: calls taken for an earlier, similar call

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "asked": self.asked,
            "created": self.created,
            "duplicates": self.duplicates,
            "missing": self.missing,
            "unsettled": self.unsettled,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "calls": self.calls,
            "duplicates_reasked": self.duplicates_reasked,
            "duplicates_reworded": self.duplicates_reworded,
            "faults": dict(self.faults),
            "seconds": self.seconds,
            "reconciled": dict(self.reconciled),
            "settled": dict(self.settled),
            "similar_replayed": self.similar_replayed,
        }


@dataclass(frozen=True, slots=True)
class DemoResult:
    """Every strategy's row, for one seed.

    .. versionadded:: 0.1
    """

    config: DemoConfig
    strategies: list[StrategyResult]
    #: strategies not run, and why (a missing extra: how to install it)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def seed(self) -> int:
        """The seed of the run (``config.seed``)."""
        return self.config.seed

    def to_dict(self) -> dict[str, Any]:
        c = self.config
        settings = {
            "agents": c.agents, "ops": c.ops, "fault_rate": c.fault_rate, "seed": c.seed,
            "url": None if c.url is None else redact_url(c.url), "timeout": c.timeout,
            "delay_seconds": c.delay_seconds, "settle": c.settle, "replan_rate": c.replan_rate,
            "shared_rate": c.shared_rate, "reword_rate": c.reword_rate,
        }  # fmt: skip
        rows = [s.to_dict() for s in self.strategies]
        return {"seed": self.seed, "settings": settings, "strategies": rows, "skipped": dict(self.skipped)}

    def __getitem__(self, name: str) -> StrategyResult:
        for row in self.strategies:
            if row.name == name:
                return row
        raise KeyError(name)


# --- counting: pure ----------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def count(
    name: str,
    operations: int,
    tickets: dict[int, int],
    statuses: dict[int, str],
    latencies_ms: Sequence[float],
    asks_per_op: dict[int, int] | None = None,
    reworded: Collection[int] = (),
) -> StrategyResult:
    """One strategy's row from what the service holds (``tickets``: how many per operation) and what
    the strategy reported (``statuses`` per operation). ``reworded``: the operations asked for again in
    other words."""
    created = duplicates = reasked = by_rewording = missing = unsettled = 0
    for op in range(operations):
        n = tickets.get(op, 0)
        status = statuses.get(op, UNSETTLED)
        created += n
        duplicates += max(0, n - 1)
        if asks_per_op is not None and asks_per_op.get(op, 1) > 1:
            reasked += max(0, n - 1)
        if op in reworded:
            by_rewording += max(0, n - 1)
        if n == 0 and status != FAILED:
            missing += 1
        if status == UNSETTLED:
            unsettled += 1
    return StrategyResult(
        name=name,
        asked=operations,
        created=created,
        duplicates=duplicates,
        missing=missing,
        unsettled=unsettled,
        p50_ms=round(percentile(latencies_ms, 50), 1),
        p99_ms=round(percentile(latencies_ms, 99), 1),
        calls=len(latencies_ms),
        duplicates_reasked=reasked,
        duplicates_reworded=by_rewording,
    )


def _merge(statuses: list[str]) -> str:
    """An operation asked several times: done if any ask was; else unknown if any was; else failed."""
    if DONE in statuses:
        return DONE
    return UNSETTLED if UNSETTLED in statuses or not statuses else FAILED


# --- running ---------------------------------------------------------------------------------------------


def _tickets(db_path: Path) -> dict[int, int]:
    """Tickets per operation, by the tag in their body: a reworded title counts to its operation."""
    conn = sqlite3.connect(db_path)
    try:
        found: dict[int, int] = {}
        for (body,) in conn.execute("SELECT body FROM tickets"):
            op = op_of(body)
            if op is None:
                raise ValueError(f"a ticket without an operation's tag in its body: {body!r}")
            found[op] = found.get(op, 0) + 1
        return found
    finally:
        conn.close()


def run_strategy(
    strategy: Strategy,
    workload: Workload,
    config: DemoConfig,
    workdir: Path,
    progress: Callable[[str], None] | None = None,
) -> StrategyResult:
    """Serve a fresh ticket service, run every agent's asks through ``strategy``, count.

    .. versionadded:: 0.1
    """
    from onceonly.tickets import Faults, serve_in_thread

    workdir.mkdir(parents=True, exist_ok=True)
    faults = Faults(
        **{kind: share * config.fault_rate for kind, share in FAULT_MIX.items()},
        delay_seconds=config.delay_seconds,
        seed=config.seed,
    )
    db_path = workdir / "tickets.db"
    latencies: list[float] = []
    asked: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()
    started = time.perf_counter()
    server = serve_in_thread(db_path=db_path, idempotency=strategy.idempotency, faults=faults, admin=True)
    try:
        strategy.start(server.url, workdir)
        barrier = threading.Barrier(len(workload.agents))

        def agent(asks: Sequence[Any]) -> None:
            try:
                try:
                    strategy.warm()
                except BaseException:
                    barrier.abort()  # the other agents stop waiting for this one
                    raise
                barrier.wait()
                for ask in asks:
                    t0 = time.perf_counter()
                    status = strategy.ask(ask)
                    ms = (time.perf_counter() - t0) * 1000
                    with lock:
                        latencies.append(ms)
                        asked.setdefault(ask.op, []).append(status)
                    if progress is not None:
                        progress(strategy.name)
            except BaseException as exc:  # re-raised below, in the caller's thread
                errors.append(exc)

        threads = [
            threading.Thread(target=agent, args=(asks,), name=f"demo-{strategy.name}-agent-{n}", daemon=True)
            for n, asks in enumerate(workload.agents)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            # The cause, not the other agents' broken barrier.
            raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
        final = strategy.finish(workload)
        statuses = final if final is not None else {op: _merge(got) for op, got in asked.items()}
        injected = dict(server.app.state.faults.snapshot()["injected"])  # type: ignore[attr-defined]
    finally:
        strategy.close()
        server.stop()  # also closes the ticket database it made
    asks_per_op = {op: len(got) for op, got in asked.items()}
    reworded = workload.reworded()
    row = count(strategy.name, workload.operations, _tickets(db_path), statuses, latencies, asks_per_op, reworded)
    report = getattr(strategy, "report", None)
    reconciled = {k: v for k, v in report.counts.items() if v} if report is not None else {}
    # The agent's own fault: its re-plans in other words, as many for every strategy.
    rewords = sum(ask.kind == "reword" for asks in workload.agents for ask in asks)
    return dataclasses.replace(
        row,
        faults={k: v for k, v in {**injected, "reword": rewords}.items() if v},
        seconds=round(time.perf_counter() - started, 2),
        reconciled=reconciled,
        settled=dict(getattr(strategy, "settled", {})),
        similar_replayed=getattr(strategy, "similar_replayed", 0),
    )


def run_demo(config: DemoConfig | None = None, progress: Callable[[str], None] | None = None) -> DemoResult:
    """Run every strategy of ``config`` on the same seeded asks and faults; return their rows.

    Args:
        config: the knobs; default ``DemoConfig()``.
        progress: called with the strategy's name after each ask (a progress bar).

    A strategy whose extra is not installed (``onceonly+similar`` without rapidfuzz) is not run: the
    result's ``skipped`` says why.

    .. versionadded:: 0.1
    """
    config = config or DemoConfig()
    workload = _workload(config)
    rows = []
    skipped = {name: why for name in config.strategies if (why := unavailable(name)) is not None}
    with tempfile.TemporaryDirectory(prefix="onceonly-demo-") as tmp:
        for name in config.strategies:
            if name in skipped:
                continue
            strategy = STRATEGIES[name](timeout=config.timeout, url=config.url, settle=config.settle)
            rows.append(run_strategy(strategy, workload, config, Path(tmp) / name, progress))
    return DemoResult(config=config, strategies=rows, skipped=skipped)


def asks_of(config: DemoConfig) -> int:
    """How many asks one strategy makes under ``config`` (the progress bar's total)."""
    return _workload(config).asks


def _workload(config: DemoConfig) -> Workload:
    """The asks ``config`` draws: the same for every strategy of a run."""
    return make_workload(
        seed=config.seed,
        agents=config.agents,
        operations=config.ops,
        replan_rate=config.replan_rate,
        shared_rate=config.shared_rate,
        reword_rate=config.reword_rate,
    )
