"""Prometheus metrics: what guarded calls did (counters, histograms) and what a ledger holds (gauges read
at scrape time).

    instrument(ledger)        this ledger's calls, transitions and store latency, in the default REGISTRY
    enable()                  the alerts of this process only (a server with the middleware and no ledger)
    asgi_app()                /metrics for a Starlette or FastAPI app
    start_http_server(9464)   /metrics from a thread, for a worker process
    LedgerCollector(ledger)   records by state and the oldest unsettled age, read when scraped
                              (``onceonly metrics --url STORE`` serves it)

Counters are fed by what the ledger already announces: transition events (``Ledger.subscribe``) and
alerts (``onceonly.events``); a guarded call's outcome and duration by one context manager around it, and
the store's latency by a thin wrapper around the ledger's store. All three exist only on an instrumented
ledger: one that is not pays one attribute read per call. Counters are per process, as Prometheus
clients' always are; see docs/operations.md for several processes.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

try:
    import prometheus_client
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - the extra is missing
    from onceonly._install import install_hint

    raise ImportError(f"onceonly.metrics needs prometheus-client: {install_hint('metrics')}") from exc

from onceonly import __version__, events, ops
from onceonly._metricvalues import CounterFamily, HistogramFamily
from onceonly.errors import StoreError, outcome_label
from onceonly.events import TransitionEvent
from onceonly.states import UNSETTLED, Record, State
from onceonly.stores.base import Query, Store

if TYPE_CHECKING:
    from onceonly.ledger import Ledger
    from onceonly.plan import Call, Outcome
    from onceonly.tools import ToolSpec

__all__ = [
    "LedgerCollector",
    "Metrics",
    "asgi_app",
    "build_info",
    "call_outcome",
    "enable",
    "instrument",
    "settle_path",
    "start_http_server",
    "store_kind",
]

#: Seconds: SQLite answers in tens of microseconds, a remote store in milliseconds.
STORE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)
#: Seconds: a guarded call is a replay (one read) up to a slow tool's whole run.
CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

# The store operations that are timed: each sync one and its async twin (``aget`` is ``get``).
_TIMED = ("get", "claim", "insert", "swap", "delete", "scan", "count_by_state")


# --- decisions: pure, on events and outcomes --------------------------------------------------------


def call_outcome(out: Outcome | None, exc: BaseException | None) -> str:
    """The ``outcome`` label of a guarded call: the state it ended in (``confirmed``, also for a replay),
    or what it raised: ``failed`` (the tool's own error), ``unknown``, ``needs_review``, ``in_progress``,
    ``scheduled`` (its retry is due later), ``conflict``, ``similar`` (refused as a near-duplicate,
    ``on_similar="raise"``), ``abandoned``, ``awaiting_approval``, ``denied``, ``paused``, ``over_budget``,
    ``store_error``, ``error`` (``errors.outcome_label``).

    .. versionadded:: 0.1
    """
    return outcome_label(out, exc)


def settle_path(event: TransitionEvent) -> str | None:
    """How the transition settled its record, as the ``via`` label (``late:N`` becomes ``late``, so that
    the label's values stay few), or ``None`` when it settled nothing.

    A settle is a move into ``confirmed`` (``run``, ``probe``, ``late``, ``reconcile-probe``,
    ``resolve``), or a record that was unknown or parked settled as not having happened (``failed`` by
    ``probe``, ``reconcile-probe`` or ``resolve``).

    .. versionadded:: 0.1
    """
    to, frm, reason = event.to_state, event.from_state, event.reason
    if to == "confirmed" and frm != "confirmed":
        via = event.via or "run"
        return "late" if via.startswith("late:") else via
    if to == "failed":
        if reason.startswith("resolved by "):
            return "resolve"
        if frm in ("unknown", "needs_review"):
            if reason.startswith("reconcile probe"):
                return "reconcile-probe"
            if reason.startswith("probe"):
                return "probe"
    return None


def _is_takeover(event: TransitionEvent) -> bool:
    """A caller or the reconciler took a record from a holder whose lease ran out (onceonly.plan, settle.py:
    "lease of OWNER expired", "the lease of OWNER expired before dispatch")."""
    return event.from_state in ("pending", "in_flight") and "lease of " in event.reason and " expired" in event.reason


def store_kind(store: object) -> str:
    """The ``store`` label: ``sqlite``, ``redis``, ``postgres``, or a custom store's class name.

    .. versionadded:: 0.1
    """
    name = type(store).__name__
    known = {"SQLiteStore": "sqlite", "RedisStore": "redis", "PostgresStore": "postgres"}
    return known.get(name, name.removesuffix("Store").lower() or name.lower())


def build_info(registry: CollectorRegistry) -> Gauge:
    """``onceonly_build_info{version}`` (always 1) in ``registry``: which onceonly each process runs.
    ``enable`` makes it; the exporter (``onceonly metrics``) too.

    .. versionadded:: 0.1
    """
    help_text = "The onceonly version of this process (always 1)."
    gauge = Gauge("onceonly_build_info", help_text, ["version"], registry=registry)
    gauge.labels(__version__).set(1)
    return gauge


# --- the metrics of one registry -----------------------------------------------------------------------


class Metrics:
    """The onceonly metrics in one Prometheus registry. Made by ``enable``; one per registry.

    .. versionadded:: 0.1
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        # The series every guarded call writes: kept behind one lock per value (_metricvalues).
        self.calls = CounterFamily(
            "onceonly_calls", "Guarded calls by tool and outcome (a replay counts as confirmed).",
            ["tool", "outcome"], r,
        )  # fmt: skip
        self.call_seconds = HistogramFamily(
            "onceonly_call_duration_seconds", "Guarded calls' duration, replays included.", ["tool"], r,
            buckets=CALL_BUCKETS,
        )  # fmt: skip
        self.replays = CounterFamily(
            "onceonly_replays",
            "Calls whose result is not their own run's (Outcome.replayed): the ledger's or a probe's.",
            ["tool"],
            r,
        )
        self.unknowns = Counter(
            "onceonly_unknowns", "Records that became unknown: sent, outcome not known.", ["tool"], registry=r
        )
        self.settles = CounterFamily(
            "onceonly_settles", "Records settled, by how (via) and into which state.", ["tool", "via", "state"], r
        )
        self.takeovers = Counter(
            "onceonly_lease_takeovers", "Records taken from a holder whose lease ran out.", ["tool"], registry=r
        )
        self.conflicts = Counter(
            "onceonly_conflicts", "KeyConflict: a key reused with other arguments, by where it was seen.",
            ["source", "tool"], registry=r,
        )  # fmt: skip
        self.audit_disagreements = Counter(
            "onceonly_audit_disagreements", "Settled records the tool's probe contradicts.", ["tool"], registry=r
        )
        self.alerts = Counter("onceonly_alerts", "Alerts logged on onceonly.alerts, by name.", ["event"], registry=r)
        self.store_seconds = HistogramFamily(
            "onceonly_store_operation_duration_seconds", "Store operations' latency.", ["store", "operation"], r,
            buckets=STORE_BUCKETS,
        )  # fmt: skip
        self.store_errors = Counter(
            "onceonly_store_errors", "Store operations that failed.", ["store", "operation"], registry=r
        )
        self.build_info = build_info(r)
        # Labelled by store, so that a process that runs no reconciler exports no series (absent()).
        self.reconciled_at = Gauge(
            "onceonly_reconcile_last_pass_timestamp_seconds",
            "When this process's reconciler last finished a pass over the ledger (Unix time).",
            ["store"],
            registry=r,
        )
        self.reconcile_passes = Counter(
            "onceonly_reconcile_passes", "Reconciler passes this process ran, by result (ok, failed).",
            ["store", "result"], registry=r,
        )  # fmt: skip
        self._children: dict[tuple[Any, ...], Any] = {}
        self._tools: dict[str, _ToolMetrics] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, kept: ``labels()`` validates and locks on every call, and a guarded
        call counts several times."""
        key = (metric, *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def on_alert(self, event: str, fields: dict[str, Any]) -> None:
        """Count an alert (an ``onceonly.events`` alert listener)."""
        self.child(self.alerts, event).inc()
        tool = str(fields.get("tool") or "")
        if event == "KeyConflict":
            self.child(self.conflicts, str(fields.get("source") or "guard"), tool).inc()
        elif event == "AuditDisagreement":
            self.child(self.audit_disagreements, tool).inc()

    def on_transition(self, event: TransitionEvent) -> None:
        """Count a transition (a ``Ledger.subscribe`` listener)."""
        if event.to_state == "unknown" and event.from_state != "unknown":
            self.child(self.unknowns, event.tool).inc()
        via = settle_path(event)
        if via is not None:
            self.child(self.settles, event.tool, via, event.to_state).inc()
        if _is_takeover(event):
            self.child(self.takeovers, event.tool).inc()

    def on_record(self, record: Record) -> None:
        """Count the transition that produced ``record`` (a ``Runtime.watch`` watcher): as
        ``on_transition``, with the two transitions of every first call told apart from the rest
        without decoding an event (a claim counts nothing; a run's confirm is one settle)."""
        state = record.state
        if record.version <= 2:  # a first call's two writes, told by the version alone (the common case)
            if state is _CONFIRMED and record.version == 2 and record.via == "run":
                self.tool(record.tool).settled_run.inc()  # version 1 was its claim: no takeover, no replay
                return
            if record.version == 1 and (state is _PENDING or state is _IN_FLIGHT):
                return  # a claim of a new record (only an insert makes version 1): nothing counted
        if state is _CONFIRMED:
            if record.via == "run":
                frm = events.moved_from(record)
                if frm is not None and frm != "confirmed" and not _maybe_takeover(record):
                    self.tool(record.tool).settled_run.inc()
                    return
        elif (state is _PENDING or state is _IN_FLIGHT) and events.moved_from(record) is None:
            return  # a claim of a new record: nothing counted
        self.on_transition(events.event_of(record))

    def pass_counter(self, store: str) -> Callable[[str | None], _Pass]:
        """The ``Runtime.observe_passes`` observer of a ledger on ``store`` (a ``store_kind``)."""
        return lambda scope: _Pass(self, store)

    def tool(self, name: str) -> _ToolMetrics:
        """The children of one tool's per-call series, made once."""
        found = self._tools.get(name)
        if found is None:
            found = self._tools[name] = _ToolMetrics(self, name)
        return found

    def count_call(self, spec: ToolSpec, call: Call | None = None) -> _Call:
        """The context manager around one guarded call of ``spec`` (``Runtime.observe_calls``)."""
        tool = self._tools.get(spec.name) or self.tool(spec.name)
        return _Call(tool, spec.is_control_flow)


_CONFIRMED, _PENDING, _IN_FLIGHT = State.CONFIRMED, State.PENDING, State.IN_FLIGHT


def _maybe_takeover(record: Record) -> bool:
    """Whether the last entry's reason may name an expired lease (then the full event decides)."""
    h = record.history_json
    return h.find("lease of ", h.rfind('{"at":')) >= 0


class _Pass:
    """One reconciler pass: its end is the last pass's time; a store error ends it as ``failed``."""

    __slots__ = ("metrics", "report", "store")

    def __init__(self, metrics: Metrics, store: str) -> None:
        self.metrics, self.store = metrics, store
        self.report: Any = None

    def __enter__(self) -> _Pass:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        m = self.metrics
        if exc is None:
            m.child(m.reconciled_at, self.store).set(time.time())
        m.child(m.reconcile_passes, self.store, "ok" if exc is None else "failed").inc()


class _ToolMetrics:
    """One tool's children of the per-call series, bound once: a call then pays no label lookup."""

    __slots__ = ("by_outcome", "by_state", "metrics", "name", "replays", "seconds", "settled_run")

    def __init__(self, metrics: Metrics, name: str) -> None:
        self.metrics, self.name = metrics, name
        self.seconds = metrics.call_seconds.labels(name)
        self.replays = metrics.replays.labels(name)
        self.settled_run = metrics.settles.labels(name, "run", "confirmed")
        self.by_outcome: dict[str, Any] = {}
        #: The outcome counters of the states a call ends in, by State (its value is the label).
        self.by_state: dict[State, Any] = {}

    def ended(self, state: State) -> Any:
        found = self.by_state.get(state)
        if found is None:
            found = self.by_state[state] = self.outcome(state.value)
        return found

    def outcome(self, label: str) -> Any:
        found = self.by_outcome.get(label)
        if found is None:
            found = self.by_outcome[label] = self.metrics.calls.labels(self.name, label)
        return found


class _Call:
    """One guarded call being counted: its outcome, or what it raised, and how long it took."""

    __slots__ = ("control_flow", "outcome", "started", "tool")

    def __init__(self, tool: _ToolMetrics, control_flow: Callable[[BaseException], bool]) -> None:
        self.tool, self.control_flow = tool, control_flow
        self.outcome: Any = None

    def __enter__(self) -> _Call:
        self.started = time.perf_counter()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        t = self.tool
        t.seconds.observe(time.perf_counter() - self.started)
        if exc is None:
            out = self.outcome
            t.ended(out.state).inc()
            if out.replayed:
                t.replays.inc()
            return
        if self.control_flow(exc):
            label = "passthrough"  # an interrupt is not an outcome
        elif not isinstance(exc, Exception):
            label = "interrupted"  # cancelled, KeyboardInterrupt: the record settles later
        else:
            label = call_outcome(None, exc)
        t.outcome(label).inc()


# Every Metrics made, by its registry (held weakly: a test's registry goes away with its metrics).
_made: weakref.WeakKeyDictionary[CollectorRegistry, Metrics] = weakref.WeakKeyDictionary()
_listening = False


def _on_alert(event: str, fields: dict[str, Any]) -> None:
    for m in list(_made.values()):
        m.on_alert(event, fields)


def enable(registry: CollectorRegistry | None = None) -> Metrics:
    """Make the onceonly metrics in ``registry`` (default: prometheus_client's ``REGISTRY``) and count
    this process's alerts in them: key conflicts (guard, server middleware, ``onceonly.http``), late
    duplicates, records parked for review, audit disagreements. Calling it again returns the same metrics.

    ``instrument(ledger)`` calls it; call it alone where there is no ledger (a server with
    ``IdempotencyMiddleware``).

    .. versionadded:: 0.1
    """
    global _listening
    reg = REGISTRY if registry is None else registry
    m = _made.get(reg)
    if m is None:
        m = _made[reg] = Metrics(reg)
    if not _listening:
        events.listen_alerts(_on_alert)
        _listening = True
    return m


def instrument(ledger: Ledger, *, registry: CollectorRegistry | None = None) -> Metrics:
    """Count ``ledger``'s guarded calls, transitions and store latency in ``registry`` (default
    ``REGISTRY``), with ``enable(registry)``'s alerts. Once per ledger; again is a no-op.

    Args:
        ledger: the ledger to count. Its ``store`` becomes a timing wrapper around the same store.
        registry: the Prometheus registry (a ``CollectorRegistry``) the metrics live in.

    Raises:
        ValueError: the ledger is already counted in another registry.

    .. versionadded:: 0.1
    """
    m = enable(registry)
    known = _instrumented.get(ledger)
    if known is not None:
        if known is not m:
            raise ValueError(f"{ledger!r} is already counted in another registry: instrument it once")
        return m
    _instrumented[ledger] = m
    ledger.runtime.watch(m.on_record)
    ledger.runtime.observe_calls(m.count_call)
    ledger.runtime.observe_passes(m.pass_counter(store_kind(ledger.store)))
    ledger.runtime.write_through(cast(Store, _TimedStore(ledger.store, m)))  # calls and heartbeats alike
    return m


# The ledgers instrumented, each with its metrics (held weakly: a dropped ledger goes).
_instrumented: weakref.WeakKeyDictionary[Ledger, Metrics] = weakref.WeakKeyDictionary()


# --- the store's latency ---------------------------------------------------------------------------------


class _TimedStore:
    """The ledger's store, each operation timed into ``onceonly_store_operation_duration_seconds``.

    Only the operations the store has are wrapped (an async twin only where there is one, so that the
    wrapper is an ``AsyncStore`` exactly when the store is); everything else is the store's own.
    """

    def __init__(self, inner: Any, metrics: Metrics) -> None:
        self._inner = inner
        kind = store_kind(inner)
        for op in _TIMED:
            for name in (op, f"a{op}"):
                fn = getattr(inner, name, None)
                if fn is None:
                    continue
                observe = metrics.store_seconds.labels(kind, op).observe
                failed = metrics.store_errors.labels(kind, op).inc
                maker = _timed_async if name != op else _timed
                setattr(self, name, maker(fn, observe, failed))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"<timed {self._inner!r}>"


def _timed(fn: Callable[..., Any], observe: Callable[[float], None], failed: Callable[[], None]) -> Any:
    clock = time.perf_counter

    def call(*args: Any) -> Any:
        started = clock()
        try:
            done = fn(*args)
        except BaseException as exc:
            observe(clock() - started)
            if isinstance(exc, StoreError):
                failed()
            raise
        observe(clock() - started)
        return done

    return call


def _timed_async(fn: Callable[..., Any], observe: Callable[[float], None], failed: Callable[[], None]) -> Any:
    clock = time.perf_counter

    async def call(*args: Any) -> Any:
        started = clock()
        try:
            done = await fn(*args)
        except BaseException as exc:
            observe(clock() - started)
            if isinstance(exc, StoreError):
                failed()
            raise
        observe(clock() - started)
        return done

    return call


# --- what a ledger holds, read at scrape time --------------------------------------------------------


class LedgerCollector(Collector):
    """Gauges of what ``ledger`` holds, read from the store at each scrape (reads only):
    ``onceonly_records{tool,state}`` (the records of each tool by state), ``onceonly_unsettled_oldest_age_seconds``
    (the oldest pending, in-flight, unknown or parked record; 0 when there is none) and ``onceonly_ledger_up``
    (0 when the store could not be read, and then no other gauge).

    SQLite and PostgreSQL count records per tool in one query; another store (Redis) is read record by
    record at each scrape, in pages: on a large ledger there, scrape the exporter less often.

    Register one per ledger, in one process only (the exporter, ``onceonly metrics``): the figures are
    the ledger's, the same from every process.

    .. versionadded:: 0.1
    """

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def describe(self) -> Iterator[Any]:
        # Named without reading the store, so that registering never waits for it.
        yield GaugeMetricFamily("onceonly_ledger_up", _UP_HELP)
        yield GaugeMetricFamily("onceonly_records", _RECORDS_HELP, labels=["tool", "state"])
        yield GaugeMetricFamily("onceonly_unsettled_oldest_age_seconds", _OLDEST_HELP)

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily("onceonly_ledger_up", _UP_HELP)
        try:
            counts = self._counts()
            age = self._oldest_unsettled_age()
        except StoreError:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        records = GaugeMetricFamily("onceonly_records", _RECORDS_HELP, labels=["tool", "state"])
        for (tool, state), n in sorted(counts.items(), key=lambda kv: (kv[0][0], kv[0][1].value)):
            records.add_metric([tool, state.value], n)
        yield records
        oldest = GaugeMetricFamily("onceonly_unsettled_oldest_age_seconds", _OLDEST_HELP)
        oldest.add_metric([], age)
        yield oldest

    def _counts(self) -> dict[tuple[str, State], int]:
        """Records per (tool, state): the store's own count where it has one, else every record read."""
        count = getattr(self.ledger.store, "count_by_tool", None)
        if count is not None:
            found: dict[tuple[str, State], int] = count()
            return found
        counts: dict[tuple[str, State], int] = {}
        for rec in ops._walk(self.ledger, Query(), lambda r: True):
            counts[rec.tool, rec.state] = counts.get((rec.tool, rec.state), 0) + 1
        return counts

    def _oldest_unsettled_age(self) -> float:
        """Seconds since the oldest unsettled record was made (as ``onceonly stats`` reads it): only the
        unsettled records are read, usually few."""
        states = sorted(UNSETTLED, key=list(State).index)
        first = min((r.created_at for r in ops._walk(self.ledger, Query(states=states), lambda r: True)), default=None)
        return 0.0 if first is None else max(0.0, self.ledger.clock() - first)


_UP_HELP = "1 when the ledger's store answered the scrape."
_RECORDS_HELP = "Records in the ledger, by tool and state."
_OLDEST_HELP = "Age of the oldest unsettled record."


# --- serving /metrics --------------------------------------------------------------------------------------


def asgi_app(registry: CollectorRegistry | None = None) -> Any:
    """An ASGI app that serves ``registry`` (default ``REGISTRY``) in Prometheus' text format: mount it,
    ``app.mount("/metrics", onceonly.metrics.asgi_app())``.

    .. versionadded:: 0.1
    """
    return prometheus_client.make_asgi_app(REGISTRY if registry is None else registry)


def start_http_server(
    port: int, addr: str = "127.0.0.1", *, registry: CollectorRegistry | None = None
) -> tuple[Any, Any]:
    """Serve ``registry`` (default ``REGISTRY``) on ``http://addr:port/metrics`` from a daemon thread, for
    a worker process with no web app. On 127.0.0.1 by default: give ``addr="0.0.0.0"`` for a scraper on
    another host. Returns the server and its thread (``server.shutdown()`` stops it).

    .. versionadded:: 0.1
    """
    server, thread = prometheus_client.start_http_server(
        port, addr=addr, registry=REGISTRY if registry is None else registry
    )
    return server, thread
