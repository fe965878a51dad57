"""OpenTelemetry traces: each guarded call a span ``onceonly.call`` under the caller's current span, its
record's transitions as span events, and each reconciler pass a span ``onceonly.reconcile``.

    onceonly.otel.instrument(ledger)                  the global tracer provider's (set it when you will)
    onceonly.otel.instrument(ledger, tracer_provider=provider)

A span says which operation it was and how it ended, never with what: its attributes are the tool, the
scope, ``onceonly.key_hash`` (``events.short_key``: 16 hex digits of the key's SHA-256, since an explicit
key may hold an argument's value, such as an order id), the state, the attempt, whether the result was
replayed and how it was settled (``via``). No argument, result, key or error message is recorded: a
failed call's span has the error's type only. Transition events carry the states, the attempt and the
fence, not the reason (it may quote the tool's error).

Cost: a ledger that is not instrumented pays nothing; an instrumented one whose tracer provider is not
set (no ``trace.set_tracer_provider``) pays a clock read per call and makes no span; a provider set
later is picked up within a second. With a provider, the SDK's span is most of the cost.
"""

from __future__ import annotations

import time
import weakref
from types import TracebackType
from typing import TYPE_CHECKING, Any

try:
    from opentelemetry import context as otel_context
    from opentelemetry import trace
except ImportError as exc:  # pragma: no cover - the extra is missing
    from onceonly._install import install_hint

    raise ImportError(f"onceonly.otel needs opentelemetry-api: {install_hint('otel')}") from exc

from onceonly import __version__, events
from onceonly.errors import outcome_label
from onceonly.states import Record

if TYPE_CHECKING:
    from onceonly.ledger import Ledger
    from onceonly.plan import Call
    from onceonly.tools import ToolSpec

__all__ = ["CALL_SPAN", "RECONCILE_SPAN", "Tracing", "instrument"]

#: The name of a guarded call's span.
CALL_SPAN = "onceonly.call"
#: The name of a reconciler pass's span.
RECONCILE_SPAN = "onceonly.reconcile"
#: The name of a transition's span event.
TRANSITION_EVENT = "onceonly.transition"

_INTERNAL = trace.SpanKind.INTERNAL
_ERROR = trace.StatusCode.ERROR


class Tracing:
    """The spans of one instrumented ledger (``instrument``).

    .. versionadded:: 0.1
    """

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self.tracer_provider = tracer_provider
        self._tracer: trace.Tracer | None = None
        self._next_look = 0.0  # while no provider is set: when to look for the global one again
        if tracer_provider is not None:
            self._tracer = _tracer_of(tracer_provider)

    def tracer(self) -> trace.Tracer | None:
        """The tracer to use now, or ``None`` while no tracer provider is set (then no span is made).

        The global provider is looked up at most once a second while it is not set (the lookup reads
        the environment: microseconds a call), and never again once it is (it is set once a process)."""
        found = self._tracer
        if found is not None or self.tracer_provider is not None:
            return found
        now = time.monotonic()
        if now < self._next_look:
            return None
        self._next_look = now + 1.0
        self._tracer = _tracer_of(trace.get_tracer_provider())
        return self._tracer

    def call_span(self, spec: ToolSpec, call: Call) -> _CallSpan | _Off:
        """The context manager around one guarded call (``Runtime.observe_calls``)."""
        tracer = self.tracer()
        if tracer is None:
            return _OFF
        return _CallSpan(tracer, spec, call)

    def pass_span(self, scope: str | None) -> _PassSpan | _Off:
        """The context manager around one reconciler pass (``Runtime.observe_passes``)."""
        tracer = self.tracer()
        if tracer is None:
            return _OFF
        return _PassSpan(tracer, scope)

    def on_record(self, record: Record) -> None:
        """A transition this process wrote, as an event on the span it was written under (a ``Runtime.watch``
        watcher): the call's own span, or the reconciler pass's. Outside a recording span, nothing."""
        if self._tracer is None:
            return  # no provider: no span of ours can be current
        span = trace.get_current_span()
        if not span.is_recording():
            return
        attributes: dict[str, Any] = {
            "onceonly.to": record.state.value,
            "onceonly.attempt": record.attempts,
            "onceonly.fence": record.fence,
        }
        frm = events.moved_from(record)
        if frm is not None:
            attributes["onceonly.from"] = frm
        if record.via is not None:
            attributes["onceonly.via"] = record.via
        if record.conflicts:
            attributes["onceonly.conflicts"] = record.conflicts
        attributes["onceonly.key_hash"] = events.short_key(record.key)  # the pass's span holds many records
        span.add_event(TRANSITION_EVENT, attributes)


def _tracer_of(provider: trace.TracerProvider) -> trace.Tracer | None:
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None  # not set (or set to do nothing)
    return provider.get_tracer("onceonly", __version__)


class _Off:
    """No tracer provider: the call runs with nothing around it (one instance for all; what is set on it
    is dropped, so that it holds no call's outcome)."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:
        return None

    def __enter__(self) -> _Off:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        return None


_OFF = _Off()


class _CallSpan:
    """One guarded call's span, current while the call runs (so that the tool's own spans, an HTTP
    client's say, are its children)."""

    __slots__ = ("control_flow", "outcome", "span", "token")

    def __init__(self, tracer: trace.Tracer, spec: ToolSpec, call: Call) -> None:
        self.outcome: Any = None
        self.control_flow = spec.is_control_flow
        self.span = tracer.start_span(
            CALL_SPAN,
            kind=_INTERNAL,
            attributes={
                "onceonly.tool": spec.name,
                "onceonly.scope": call.scope,
                "onceonly.key_hash": events.short_key(call.key),
            },
        )

    def __enter__(self) -> _CallSpan:
        self.token = otel_context.attach(trace.set_span_in_context(self.span))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        span = self.span
        try:
            out = self.outcome if exc is None else None
            if exc is not None and self.control_flow(exc):
                span.set_attribute("onceonly.outcome", "passthrough")  # a framework's interrupt: no error
                return
            interrupted = exc is not None and not isinstance(exc, Exception)
            span.set_attribute("onceonly.outcome", "interrupted" if interrupted else outcome_label(out, exc))
            if out is not None:
                span.set_attribute("onceonly.state", out.state.value)
                span.set_attribute("onceonly.attempt", out.attempts)
                span.set_attribute("onceonly.replayed", out.replayed)
                if out.via is not None:
                    span.set_attribute("onceonly.settled_by", out.via)
            else:
                rec = getattr(exc, "record", None)
                if isinstance(rec, Record):
                    span.set_attribute("onceonly.state", rec.state.value)
                    span.set_attribute("onceonly.attempt", rec.attempts)
                    span.set_attribute("onceonly.replayed", False)
                    if rec.via is not None:
                        span.set_attribute("onceonly.settled_by", rec.via)
                # The type only: an error's message may quote the tool's arguments.
                name = type(exc).__qualname__
                span.set_attribute("error.type", f"{type(exc).__module__}.{name}")
                span.set_status(_ERROR, name)
        finally:
            otel_context.detach(self.token)
            span.end()


class _PassSpan:
    """One reconciler pass's span: its records' transitions are its events; its counts its attributes."""

    __slots__ = ("outcome", "report", "span", "token")

    def __init__(self, tracer: trace.Tracer, scope: str | None) -> None:
        self.report: Any = None
        attributes = {} if scope is None else {"onceonly.scope": scope}
        self.span = tracer.start_span(RECONCILE_SPAN, kind=_INTERNAL, attributes=attributes)

    def __enter__(self) -> _PassSpan:
        self.token = otel_context.attach(trace.set_span_in_context(self.span))
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        span = self.span
        try:
            report = self.report
            if report is not None:
                span.set_attribute("onceonly.records", len(report.lines))
                for settlement, n in report.counts.items():
                    if n:
                        span.set_attribute(f"onceonly.{getattr(settlement, 'value', settlement)}", n)
            if exc is not None:
                span.set_attribute("error.type", f"{type(exc).__module__}.{type(exc).__qualname__}")
                span.set_status(_ERROR, type(exc).__qualname__)
        finally:
            otel_context.detach(self.token)
            span.end()


# The ledgers instrumented (held weakly: a dropped ledger goes), each with its tracing.
_instrumented: weakref.WeakKeyDictionary[Ledger, Tracing] = weakref.WeakKeyDictionary()


def instrument(ledger: Ledger, *, tracer_provider: trace.TracerProvider | None = None) -> Tracing:
    """Trace ``ledger``'s guarded calls and reconciler passes: a span per call (``onceonly.call``) and per
    pass (``onceonly.reconcile``), each under the current span, with the transitions as span events.
    Once per ledger; again returns the same ``Tracing``.

    Args:
        ledger: the ledger to trace.
        tracer_provider: the provider of the tracer; default: the global one (``trace.set_tracer_provider``),
            looked up at each call, so that it may be set after this. While none is set, no span is made.

    .. versionadded:: 0.1
    """
    known = _instrumented.get(ledger)
    if known is not None:
        return known
    tracing = _instrumented[ledger] = Tracing(tracer_provider)
    runtime = ledger.runtime
    runtime.observe_calls(tracing.call_span)
    runtime.observe_passes(tracing.pass_span)
    runtime.watch(tracing.on_record)
    return tracing
