"""onceonly.otel with the OpenTelemetry SDK's in-memory exporter: a guarded call is a span under the
caller's, with its transitions as events and no argument, result or key in it; a failed call's span
has the error's type only; a reconciler pass is a span; nothing is traced without a tracer provider;
and in a LangGraph run the onceonly span sits under the tool's span."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import IN_CI

try:
    import opentelemetry.sdk  # noqa: F401
except ImportError:
    if IN_CI:  # the dev extra has it: CI must trace
        raise
    pytest.skip("opentelemetry-sdk is not installed: pip install -e '.[dev]'", allow_module_level=True)

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from onceonly import Ledger, OutcomeUnknown
from onceonly.events import short_key
from onceonly.otel import CALL_SPAN, RECONCILE_SPAN, instrument

ROOT = Path(__file__).resolve().parent.parent
SECRET_CARD = "4242-4242-4242-4242"
ORDER = "ord-17"


@pytest.fixture(name="traced")
def fixture_traced() -> tuple[TracerProvider, InMemorySpanExporter]:
    """A tracer provider of the test's own (the global one is set once per process), exporting to memory."""
    provider = TracerProvider()
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


@pytest.fixture(name="ledger")
def fixture_ledger(tmp_path: Path) -> Iterator[Ledger]:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    yield ledger
    ledger.close()


def _named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def _everything(spans: list[ReadableSpan]) -> str:
    """All that the spans would send: names, attributes, events, statuses."""
    return "\n".join(s.to_json() for s in spans)


def _moves(span: ReadableSpan) -> list[tuple[Any, Any]]:
    return [(e.attributes.get("onceonly.from"), e.attributes.get("onceonly.to")) for e in span.events]  # type: ignore[union-attr]


def test_a_guarded_call_is_a_span_under_the_callers_without_its_arguments(
    ledger: Ledger, traced: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """The first call and its replay are each an ``onceonly.call`` span, children of the caller's span:
    tool, scope, the key's hash, state, attempt, replayed and how it was settled; the first call's
    transitions are its events, the replay wrote none. The card number, the order id (in the explicit
    key too), the result and the key appear nowhere in what is exported."""
    provider, exporter = traced
    instrument(ledger, tracer_provider=provider)
    assert instrument(ledger, tracer_provider=provider) is instrument(ledger)

    @ledger.tool(name="charge")
    def charge(order: str, card: str, amount: int) -> dict[str, str]:
        return {"receipt": f"receipt-for-{order}"}

    caller = provider.get_tracer("the-app")
    with caller.start_as_current_span("agent step") as step:
        first = charge.using(key=f"order-{ORDER}").outcome(ORDER, SECRET_CARD, 5)
        again = charge.using(key=f"order-{ORDER}").outcome(ORDER, SECRET_CARD, 5)
    assert not first.replayed and again.replayed

    spans = _named(exporter, CALL_SPAN)
    assert len(spans) == 2
    for span in spans:
        assert span.parent is not None and span.parent.span_id == step.get_span_context().span_id
        assert span.context.trace_id == step.get_span_context().trace_id
        assert span.attributes is not None
        assert span.attributes["onceonly.tool"] == "charge"
        assert span.attributes["onceonly.scope"] == "default"
        assert span.attributes["onceonly.key_hash"] == short_key(first.key)
        assert span.attributes["onceonly.state"] == "confirmed"
        assert span.attributes["onceonly.outcome"] == "confirmed"
        assert span.attributes["onceonly.attempt"] == 1
        assert span.attributes["onceonly.settled_by"] == "run"
        assert span.status.status_code is StatusCode.UNSET
    ran, replayed = spans
    assert ran.attributes["onceonly.replayed"] is False and replayed.attributes["onceonly.replayed"] is True  # type: ignore[index]
    assert _moves(ran) == [(None, "in_flight"), ("in_flight", "confirmed")]
    assert replayed.events == ()
    exported = _everything(exporter.get_finished_spans())
    for value in (SECRET_CARD, ORDER, "receipt-for", first.key):
        assert value not in exported, value


def test_a_failed_call_has_the_errors_type_and_not_its_message(
    ledger: Ledger, traced: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """The tool's own error: status ERROR, ``error.type``, outcome ``failed``, the record's state; the
    message (which quotes the card) is not exported."""
    provider, exporter = traced
    instrument(ledger, tracer_provider=provider)

    @ledger.tool(name="charge", retry=None)
    def charge(card: str) -> None:
        raise ValueError(f"card {card} declined")

    with pytest.raises(ValueError, match="declined"):
        charge(SECRET_CARD)
    (span,) = _named(exporter, CALL_SPAN)
    assert span.status.status_code is StatusCode.ERROR and span.status.description == "ValueError"
    assert span.attributes is not None
    assert span.attributes["error.type"] == "builtins.ValueError"
    assert span.attributes["onceonly.outcome"] == "failed"
    assert ("in_flight", "failed") in _moves(span)
    assert SECRET_CARD not in _everything([span]) and "declined" not in _everything([span])


def test_an_unknown_settled_by_the_reconciler_is_a_pass_span_with_its_transitions(
    ledger: Ledger, traced: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """A call whose outcome is unknown (the probe down): its span says ``unknown``. The reconciler's pass
    is an ``onceonly.reconcile`` span of its own, with the record's settle as its event and its counts."""
    provider, exporter = traced
    instrument(ledger, tracer_provider=provider)
    down = {"now": True}

    def probe(args: dict[str, object], key: str) -> object:
        if down["now"]:
            raise ConnectionError("the probe's service is down")
        return {"shipped": True}

    @ledger.tool(name="ship", on_unknown="probe", probe=probe)
    def ship(order: str) -> dict[str, bool]:
        raise TimeoutError("read timed out")

    with pytest.raises(OutcomeUnknown):
        ship(ORDER)
    (call,) = _named(exporter, CALL_SPAN)
    assert call.attributes is not None and call.attributes["onceonly.outcome"] == "unknown"
    assert call.attributes["onceonly.state"] == "unknown" and call.status.status_code is StatusCode.ERROR
    down["now"] = False
    report = ledger.reconcile()
    (passed,) = _named(exporter, RECONCILE_SPAN)
    assert passed.parent is None and passed.attributes is not None
    assert passed.attributes["onceonly.records"] == len(report.lines) == 1
    assert ("unknown", "confirmed") in _moves(passed)
    (event,) = [e for e in passed.events if e.attributes and e.attributes.get("onceonly.to") == "confirmed"]
    assert event.attributes is not None and event.attributes["onceonly.via"] == "reconcile-probe"
    assert event.attributes["onceonly.key_hash"] == short_key(ship.key_for(ORDER))
    assert ORDER not in _everything(exporter.get_finished_spans())


def test_without_a_tracer_provider_nothing_is_traced_until_one_is_set(tmp_path: Path) -> None:
    """In a process of its own (the global provider is set once per process): instrumented with no
    provider set, a call makes no span; once the app sets one, a call a second later is traced. Without
    opentelemetry installed, importing onceonly.otel names the extra."""
    code = f"""
import json, time
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
import onceonly, onceonly.otel
ledger = onceonly.Ledger.open({f"sqlite:///{tmp_path / 'l.db'}"!r})
tracing = onceonly.otel.instrument(ledger)
echo = ledger.tool(name="echo")(lambda x: x)
echo(1)
off = tracing.tracer() is None
provider = TracerProvider()
exporter = InMemorySpanExporter()
provider.add_span_processor(SimpleSpanProcessor(exporter))
before = len(exporter.get_finished_spans())
trace.set_tracer_provider(provider)
time.sleep(1.05)  # the global provider is looked for at most once a second while none is set
echo(2)
print(json.dumps({{"off": off, "before": before, "after": [s.name for s in exporter.get_finished_spans()]}}))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"off": True, "before": 0, "after": [CALL_SPAN]}

    missing = "import sys; sys.modules['opentelemetry'] = None; import onceonly.otel"
    done = subprocess.run([sys.executable, "-c", missing], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 1 and "onceonly[otel]" in done.stderr, done.stderr


def test_in_a_langgraph_run_the_onceonly_span_is_under_the_tools_span(
    ledger: Ledger, traced: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """A LangGraph agent (a scripted model, a ToolNode) calls a guarded LangChain tool. LangChain's own
    tracing is its callbacks (LangSmith), not OpenTelemetry, so the tool's span is an OTel span the app
    opens around each tool invoke (ToolNode's ``wrap_tool_call``): the ``onceonly.call`` span is its child,
    in the trace of the run's span."""
    from langchain_core.tools import tool
    from langgraph.checkpoint.memory import InMemorySaver

    from onceonly.langchain import guard
    from tests.test_langchain import calls, react_graph, scripted, thread

    provider, exporter = traced
    instrument(ledger, tracer_provider=provider)
    app = provider.get_tracer("the-app")

    @tool
    def refund(order: str, amount: int) -> str:
        """Refund an order."""
        return f"refunded {amount}"

    def tool_span(request: Any, execute: Any) -> Any:
        with app.start_as_current_span(f"tool {request.tool_call['name']}"):
            return execute(request)

    model = scripted(calls(("refund", {"order": ORDER, "amount": 5}, "c1")), "done")
    graph = react_graph(model, [guard(refund, ledger)], InMemorySaver(), wrap_tool_call=tool_span)
    with app.start_as_current_span("agent run") as run:
        graph.invoke({"messages": [("user", "refund ord-17")]}, thread("t1"))

    (call,) = _named(exporter, CALL_SPAN)
    (tool_run,) = _named(exporter, "tool refund")
    assert tool_run.parent is not None and tool_run.parent.span_id == run.get_span_context().span_id
    assert call.parent is not None and call.parent.span_id == tool_run.context.span_id
    assert call.attributes is not None and call.attributes["onceonly.tool"] == "refund"
    assert call.attributes["onceonly.scope"] != "default"  # the thread's scope
    assert call.attributes["onceonly.state"] == "confirmed"
    assert ORDER not in _everything([call])


def test_an_async_call_is_a_span_under_the_awaiting_tasks_span(
    ledger: Ledger, traced: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """An async tool's call: its span is the child of the span current in the awaiting task, and the
    tool's own spans (made inside it) are the onceonly span's children."""
    import asyncio

    provider, exporter = traced
    instrument(ledger, tracer_provider=provider)
    app = provider.get_tracer("the-app")

    @ledger.tool(name="notify")
    async def notify(who: str) -> str:
        with app.start_as_current_span("http POST"):
            await asyncio.sleep(0)
        return "told"

    async def main() -> None:
        with app.start_as_current_span("handler"):
            await asyncio.gather(notify("ann"), notify("bob"))

    asyncio.run(main())
    (handler,) = _named(exporter, "handler")
    spans = _named(exporter, CALL_SPAN)
    assert len(spans) == 2
    assert all(s.parent is not None and s.parent.span_id == handler.context.span_id for s in spans)
    posts = _named(exporter, "http POST")
    assert sorted(p.parent.span_id for p in posts if p.parent) == sorted(s.context.span_id for s in spans)
