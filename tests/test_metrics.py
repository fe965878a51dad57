"""onceonly.metrics on each real store: guarded calls with every kind of outcome, scraped over HTTP (the
ASGI app under uvicorn, and the ``onceonly metrics`` exporter) and parsed as Prometheus reads them; the
figures are the ledger's own."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.routing import Mount

import onceonly
from onceonly import NOT_FOUND, KeyConflict, Ledger, OutcomeUnknown, Retry, State, ops
from onceonly import states as st
from onceonly.errors import AttemptsExhausted, InProgress, OnceOnlyError, RetryScheduled, SimilarCall, StoreUnavailable
from onceonly.metrics import LedgerCollector, Metrics, asgi_app, call_outcome, instrument
from onceonly.stores.sqlite import SQLiteStore
from onceonly.tickets import serve_in_thread
from tests._clock import FakeClock

ROOT = Path(__file__).resolve().parent.parent
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


class _Crash(BaseException):
    """An interrupt mid-call (as KeyboardInterrupt): the attempt is recorded unknown at once."""


def _scrape(url: str) -> Samples:
    """GET ``url`` and parse it with prometheus_client's parser: sample name and labels → value."""
    answer = httpx.get(url, timeout=10.0, follow_redirects=True)
    assert answer.status_code == 200, answer.text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(answer.text)
        for s in family.samples
    }


def _samples(registry: CollectorRegistry) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value for family in registry.collect() for s in family.samples}


def _get(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def _series(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name and v}


def _transitions_into_unknown(ledger: Ledger, tool: str) -> int:
    """How many times the records of ``tool`` became unknown, by their own histories."""
    return sum(
        1
        for rec in ledger.list(tool=tool, limit=1000)
        for entry in rec.history
        if entry["to"] == "unknown" and entry.get("from") != "unknown"
    )


def _make_calls(ledger: Ledger, clock: FakeClock) -> None:
    """One confirmed call and its replay, a conflict, a definite failure, an unknown settled by the
    probe, two parked for review (one then resolved by a person), an interrupted call, a dead holder's
    record whose lease a later caller takes over, and an async tool's call and replay."""
    crash = {"now": True}

    @ledger.tool(name="charge", key=["order"])
    def charge(order: str, amount: int) -> dict[str, int]:
        return {"charged": amount}

    @ledger.tool(name="flaky", retry=Retry(attempts=1))
    def flaky(order: str) -> None:
        raise ValueError("card declined")

    @ledger.tool(name="ship", on_unknown="probe", probe=lambda args, key: {"parcel": args["order"]})
    def ship(order: str) -> None:
        raise TimeoutError("read timed out")

    @ledger.tool(name="refund", on_unknown="review")
    def refund(order: str) -> None:
        raise TimeoutError("read timed out")

    @ledger.tool(name="deliver", lease=5.0, on_unknown="probe", probe=lambda args, key: {"delivered": True})
    def deliver(order: str) -> str:
        if crash["now"]:
            raise _Crash
        return "delivered"

    @ledger.tool(name="notify")
    async def notify(user: str) -> str:
        return f"told {user}"

    assert charge("o-1", 10) == {"charged": 10}
    assert charge("o-1", 10) == {"charged": 10}
    with pytest.raises(KeyConflict):
        charge("o-1", 20)
    with pytest.raises(ValueError, match="declined"):
        flaky("o-1")
    assert ship("o-1") == {"parcel": "o-1"}
    for order in ("o-1", "o-2"):
        with pytest.raises(OutcomeUnknown):
            refund(order)
    ledger.resolve(refund.key_for("o-2"), confirmed={"refunded": True}, by="ops")
    with pytest.raises(_Crash):
        deliver("o-0")
    crash["now"] = False
    # A process that died mid-call (no Python runs in a SIGKILLed one) left its record in flight.
    call = deliver.spec.call(("o-1",), {}, None, 1)
    left = st.new_record(
        key=call.key, scope=call.scope, tool=call.tool, fingerprint=call.fingerprint, args_json=call.args_json,
        state=State.IN_FLIGHT, owner="dead-host:1:1", now=clock.now, lease_seconds=5.0,
    )  # fmt: skip
    assert ledger.store.insert(left)
    clock.now += 6.0  # the lease ran out; the next caller takes the record over and probes
    assert deliver("o-1") == {"delivered": True}
    assert asyncio.run(notify("ann")) == asyncio.run(notify("ann")) == "told ann"


def test_scraped_counters_and_gauges_are_the_ledgers_own(store_url: str, clock: FakeClock) -> None:
    """A ledger instrumented into a fresh registry, scraped over HTTP from the ASGI app under uvicorn:
    each call counted once by outcome, replays, unknowns, settles by path, the takeover, the conflict,
    the store's latency per operation; and the gauges equal the ledger's counts by state. A ledger of
    the same process that is not instrumented is not counted."""
    registry = CollectorRegistry()
    with (
        Ledger.open(store_url, clock=clock, sleep=clock.sleep) as ledger,
        Ledger.open(store_url, clock=clock, sleep=clock.sleep) as other,
    ):
        instrument(ledger, registry=registry)
        assert instrument(ledger, registry=registry) is instrument(ledger, registry=registry)
        registry.register(LedgerCollector(ledger))
        # The same transitions decoded as events (Ledger.subscribe): the counts the watcher's fast path
        # must equal.
        decoded = CollectorRegistry()
        ledger.subscribe(Metrics(decoded).on_transition)
        _make_calls(ledger, clock)
        other.tool(name="quiet")(lambda x: x)(1)

        app = Starlette(routes=[Mount("/metrics", app=asgi_app(registry))])
        with serve_in_thread(app) as server:
            samples = _scrape(f"{server.url}/metrics")
        counts = ledger.stats()
        figures = ops.stats(ledger)
        (parked,) = ledger.list(state="needs_review")
        unknowns = {tool: _transitions_into_unknown(ledger, tool) for tool in ("ship", "refund", "deliver")}

    assert _series(samples, "onceonly_calls_total") == {
        frozenset({("tool", tool), ("outcome", outcome)}): n
        for tool, outcome, n in (
            ("charge", "confirmed", 2),
            ("charge", "conflict", 1),
            ("flaky", "failed", 1),
            ("ship", "confirmed", 1),
            ("refund", "needs_review", 2),
            ("deliver", "interrupted", 1),
            ("deliver", "confirmed", 1),
            ("notify", "confirmed", 2),
        )
    }
    # Outcome.replayed: the result came from the ledger, or from a probe, not from this call's tool run.
    assert _series(samples, "onceonly_replays_total") == {
        frozenset({("tool", tool)}): 1 for tool in ("charge", "notify", "ship", "deliver")
    }
    for tool, n in unknowns.items():
        assert _get(samples, "onceonly_unknowns_total", tool=tool) == n > 0, tool
    assert _series(samples, "onceonly_settles_total") == {
        frozenset({("tool", tool), ("via", via), ("state", "confirmed")}): 1
        for tool, via in (
            ("charge", "run"),
            ("ship", "probe"),
            ("refund", "resolve"),
            ("deliver", "probe"),
            ("notify", "run"),
        )
    }
    assert _series(samples, "onceonly_lease_takeovers_total") == {frozenset({("tool", "deliver")}): 1}
    for name in ("onceonly_unknowns_total", "onceonly_settles_total", "onceonly_lease_takeovers_total"):
        assert _series(samples, name) == _series(_samples(decoded), name), name
    assert _series(samples, "onceonly_conflicts_total") == {frozenset({("source", "guard"), ("tool", "charge")}): 1}
    assert _get(samples, "onceonly_alerts_total", event="ParkedForReview") == 2

    # Every guarded call starts with one claim; the async tool's are counted under the same name.
    kind = {"sqlite": "sqlite", "redis": "redis", "postgresql": "postgres"}[store_url.split(":", 1)[0]]
    calls = sum(_series(samples, "onceonly_calls_total").values())
    claims = _get(samples, "onceonly_store_operation_duration_seconds_count", store=kind, operation="claim")
    assert claims == calls == 11
    assert (_get(samples, "onceonly_store_operation_duration_seconds_sum", store=kind, operation="claim") or 0) > 0
    assert (_get(samples, "onceonly_store_operation_duration_seconds_count", store=kind, operation="swap") or 0) > 0

    # The gauges, read at the scrape, are the ledger's own counts: each tool's records by state (the
    # store's GROUP BY on SQL, every record read on Redis), summing to the counts by state.
    by_tool = {
        frozenset({("tool", t.tool), ("state", state)}): float(n)
        for t in figures.tools.values()
        for state, n in t.states.items()
        if n
    }
    assert _series(samples, "onceonly_records") == by_tool
    assert {("tool", "charge"), ("state", "confirmed")} in [set(labels) for labels in by_tool]
    for state, n in counts.items():
        assert sum(v for labels, v in by_tool.items() if ("state", state) in labels) == n, state
    assert _get(samples, "onceonly_build_info", version=onceonly.__version__) == 1
    assert counts == figures.states and counts["needs_review"] == 1 and counts["failed"] == 1
    assert _get(samples, "onceonly_unsettled_oldest_age_seconds") == pytest.approx(clock() - parked.created_at)
    assert _get(samples, "onceonly_ledger_up") == 1
    # The other ledger's call is not counted (its record is in the store, so in the gauge).
    assert not any(("tool", "quiet") in labels for name, labels in samples if name != "onceonly_records")


def test_an_uninstrumented_ledger_keeps_its_store_and_pays_nothing(sqlite_url: str) -> None:
    """Without ``instrument`` the ledger's store is the store itself and no call is wrapped; with it,
    the store is wrapped and still the same store underneath (its URL, its async face)."""
    with Ledger.open(sqlite_url) as ledger:
        assert type(ledger.store) is SQLiteStore and ledger.runtime.count_call is None
        instrument(ledger, registry=CollectorRegistry())
        assert type(ledger.store) is not SQLiteStore and ledger.runtime.count_call is not None
        assert ledger.store.url == sqlite_url and hasattr(ledger.store, "aclaim")
        with pytest.raises(ValueError, match="another registry"):
            instrument(ledger, registry=CollectorRegistry())


@pytest.fixture(name="exporter")
def fixture_exporter(store_url: str) -> Iterator[str]:
    """``onceonly metrics --url STORE --port 0`` in its own process: the URL it serves on. Stopped by PID."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceonly", "metrics", "--url", store_url, "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stderr is not None
        said = []  # what it wrote before it serves (a warning about the store, say)
        found = None
        for line in proc.stderr:
            said.append(line)
            found = re.search(r"on (http://127\.0\.0\.1:\d+/metrics)", line)
            if found:
                break
        assert found, "".join(said)
        yield found[1]
    finally:
        proc.terminate()
        proc.wait(10)
        if proc.stderr is not None:
            proc.stderr.close()


def test_the_exporter_serves_the_ledgers_counts(
    store_url: str, clock: FakeClock, request: pytest.FixtureRequest
) -> None:
    """``onceonly metrics`` (a separate, read-only process) serves the records by state and the oldest
    unsettled age of the ledger that another process wrote, as the ledger counts them."""
    with Ledger.open(store_url, clock=clock, sleep=clock.sleep) as ledger:
        _make_calls(ledger, clock)
        figures = ops.stats(ledger)
        url = request.getfixturevalue("exporter")
        samples = _scrape(url)
        assert _series(samples, "onceonly_records") == {
            frozenset({("tool", t.tool), ("state", state)}): float(n)
            for t in figures.tools.values()
            for state, n in t.states.items()
            if n
        }
        assert _get(samples, "onceonly_build_info", version=onceonly.__version__) == 1
        assert _get(samples, "onceonly_ledger_up") == 1
        assert (_get(samples, "onceonly_unsettled_oldest_age_seconds") or 0) >= 0
        assert not _series(samples, "onceonly_calls_total")  # the exporter makes no calls: it reads


def test_without_prometheus_client_the_error_names_the_extra(tmp_path: Path) -> None:
    """``import onceonly.metrics`` and ``onceonly metrics`` without prometheus-client say which extra to
    install, in the repository form."""
    hint = "pip install 'onceonly[metrics] @ git+"
    code = "import sys; sys.modules['prometheus_client'] = None; import onceonly.metrics"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert done.returncode != 0 and hint in done.stderr, done.stderr
    url = json.dumps(f"sqlite:///{tmp_path / 'l.db'}")
    code = (
        "import sys; sys.modules['prometheus_client'] = None; "
        f"sys.argv = ['onceonly', 'metrics', '--url', {url}]; from onceonly.cli import main; main()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 1 and hint in done.stderr, done.stderr
    assert not (tmp_path / "l.db").exists()


def test_late_outcomes_and_the_reconciler_are_counted_as_settles(sqlite_url: str) -> None:
    """A timed-out call parked for review whose late result then confirms it counts as settled ``via``
    ``late`` (not ``late:1``); an unknown the reconciler's probe finds never happened counts as
    ``reconcile-probe`` into ``failed``."""
    registry = CollectorRegistry()
    probe_down = {"now": True}

    def probe(args: dict[str, object], key: str) -> object:
        if probe_down["now"]:
            raise ConnectionError("the probe's service is down")
        return NOT_FOUND

    with Ledger.open(sqlite_url) as ledger:
        instrument(ledger, registry=registry)

        @ledger.tool(name="slow", timeout=0.1, on_unknown="review")
        def slow(order: str) -> str:
            time.sleep(0.4)
            return "done"

        @ledger.tool(name="maybe", on_unknown="probe", probe=probe)
        def maybe(order: str) -> None:
            raise TimeoutError("read timed out")

        with pytest.raises(OutcomeUnknown):
            slow("o-1")
        with pytest.raises(OutcomeUnknown):
            maybe("o-1")
        probe_down["now"] = False
        ledger.reconcile()
        deadline = time.monotonic() + 10
        while (rec := ledger.get(slow.key_for("o-1"))) is not None and rec.state is not State.CONFIRMED:
            assert time.monotonic() < deadline, rec
            time.sleep(0.05)
        assert rec is not None and rec.via == "late:1"
        assert ledger.stats()["failed"] == 1

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("onceonly_settles_total", tool="slow", via="late", state="confirmed") == 1
    assert value("onceonly_settles_total", tool="maybe", via="reconcile-probe", state="failed") == 1
    assert value("onceonly_calls_total", tool="slow", outcome="needs_review") == 1
    assert value("onceonly_calls_total", tool="maybe", outcome="unknown") == 1
    # The pass is counted and timed (wall clock: Prometheus compares it with time()).
    assert value("onceonly_reconcile_passes_total", store="sqlite", result="ok") == 1
    passed = value("onceonly_reconcile_last_pass_timestamp_seconds", store="sqlite") or 0
    assert time.time() - 60 < passed <= time.time()


def test_what_a_call_raised_names_its_outcome() -> None:
    """Each outcome error has its label (a subclass before its base), and any other exception is the
    tool's own failure."""
    raised = {
        "scheduled": RetryScheduled("due later", key="k", retry_at=0.0),
        "in_progress": InProgress("held", key="k"),
        "abandoned": AttemptsExhausted("no attempts left", key="k"),
        "store_error": StoreUnavailable("down"),
        "error": OnceOnlyError("misused"),
        "unknown": OutcomeUnknown("not known", key="k"),
        "conflict": KeyConflict("other arguments", key="k", record=None, fingerprint=""),
        "similar": SimilarCall("asked before", key="k", record=None, outcome=None, score=0.9, new_key="k2"),
        "failed": ValueError("card declined"),
    }
    assert {label: call_outcome(None, exc) for label, exc in raised.items()} == {k: k for k in raised}


def test_a_store_that_fails_is_counted_and_the_gauges_say_down(sqlite_url: str) -> None:
    """A store operation that raises ``StoreError`` counts as that operation's error (and is timed);
    a scrape whose store does not answer reports ``onceonly_ledger_up 0`` and no other gauge."""
    registry = CollectorRegistry()
    ledger = Ledger.open(sqlite_url)
    instrument(ledger, registry=registry)
    registry.register(LedgerCollector(ledger))
    ledger.tool(name="t")(lambda x: x)(1)
    assert registry.get_sample_value("onceonly_ledger_up") == 1
    ledger.close()  # every later operation raises StoreUnavailable
    with pytest.raises(StoreUnavailable):
        ledger.get("default:t:x")
    labels = {"store": "sqlite", "operation": "get"}
    assert registry.get_sample_value("onceonly_store_errors_total", labels) == 1
    assert registry.get_sample_value("onceonly_store_operation_duration_seconds_count", labels) == 1
    assert registry.get_sample_value("onceonly_ledger_up") == 0
    assert registry.get_sample_value("onceonly_records", {"tool": "t", "state": "confirmed"}) is None


def test_calls_a_guardrail_refused_are_counted_by_what_refused_them(sqlite_url: str) -> None:
    """A paused call and one over its budget ran nothing and wrote no record; each still counts as a
    call, its outcome ``paused`` or ``over_budget``, so an operator sees what a guardrail stopped."""
    registry = CollectorRegistry()
    with Ledger.open(sqlite_url) as ledger:
        instrument(ledger, registry=registry)

        @ledger.tool(name="send")
        def send(to: str) -> str:
            return to

        @ledger.tool(name="pay", budget=onceonly.Budget(amount="cents", limit=100, per="1d", by="tool"))
        def pay(order: str, cents: int) -> str:
            return order

        ledger.pause(tool="send", reason="provider incident")
        with pytest.raises(onceonly.Paused):
            send("ann")
        assert pay("o-1", 80) == "o-1"
        with pytest.raises(onceonly.BudgetExceeded):
            pay("o-2", 30)
        assert ledger.stats()["confirmed"] == 1  # the refused calls wrote nothing

    def value(**labels: str) -> float | None:
        return registry.get_sample_value("onceonly_calls_total", labels)

    assert value(tool="send", outcome="paused") == 1
    assert value(tool="pay", outcome="over_budget") == 1 and value(tool="pay", outcome="confirmed") == 1
