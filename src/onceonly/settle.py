"""Settling unknowns after the fact: the reconciler. Decisions are pure; ``reconcile`` does their I/O.

A guarded call settles its own unknown in-call (``onceonly.plan``: probe, resend, retry or review). What
remains unsettled is left for the reconciler: records that are ``unknown`` (a probe failed, the caller
gave up or died) and records whose holder died (``pending`` / ``in_flight`` with an expired lease).

Per record, ``decide`` says what to do; ``reconcile`` does it and reports:

    pending, lease expired ─────────────▶ failed        nothing was sent: a new call may run it
    in_flight, lease expired ───────────▶ unknown ──┐   it may have been sent (as a waiting caller does)
    unknown, dispatched to a server with a key status endpoint (``probe="server"``) ─▶ ask it first:
             completed ─▶ confirmed (via reconcile-server)   404 ─▶ failed, nothing ran (a new call sends it)
             processing ─▶ waiting                            unknown / cannot ask ─▶ the tool's on_unknown:
    unknown ─┬─ probe tool ── settle waited ─▶ probe ─┬─ found ──────▶ confirmed (via reconcile-probe)
             │                                        ├─ NOT_FOUND ──▶ failed (a new call may run it)
             │                                        └─ raised ─────▶ stays unknown, reported
             ├─ resend / retry tool ─ settle waited ─▶ re-send with the same key and the stored args
             │                                          (the guard's own plan, as one more caller)
             └─ otherwise (review, no tool rebuildable) ─ older than review_after ─▶ needs_review

Every write is a compare-and-set on the record's version: when several reconcilers (and the agents
themselves) race on one record, exactly one write lands and the others report ``skipped``.

Re-sending from stored arguments. A record keeps the canonical JSON of the call's arguments (the
``ignore=`` fields left out). The reconciler re-runs a tool only when the tool asks for it
(``on_unknown="resend"`` or ``"retry"``: the other side honours the key, or the tool is idempotent by
nature) and only when the stored arguments rebuild the call: no required field was left out by
``ignore=``, the tool is not a method (its receiver is not stored) and takes no ``*args``/``**kwargs``.
The tool then receives the JSON form of its arguments (a list for a tuple, an ISO string for a
datetime, a dict for a model): a tool that cannot take that form should settle unknowns with a probe
or by review. A record that cannot be rebuilt is parked for review instead, with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import inspect
import json
import logging
import math
import os
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from onceonly import states as st
from onceonly.budgets import free as free_budget
from onceonly.drivers import adrive, aprobe, drive, probe
from onceonly.errors import AttemptsExhausted, InProgress, KeyConflict, OutcomeUnknown, StoreError
from onceonly.keystatus import ServerSays, Told, read_status
from onceonly.plan import (
    NOT_FOUND,
    Action,
    Call,
    Claim,
    Execute,
    Get,
    Plan,
    Probed,
    Sleep,
    WaitChange,
    encode_result,
    plan,
)
from onceonly.policy import DEFAULT_TTL, Policy
from onceonly.runtime import swap_now
from onceonly.states import HELD, Record, State
from onceonly.stores.base import Query, SurveyingStore
from onceonly.tools import ToolSpec

if TYPE_CHECKING:
    from onceonly.ledger import Ledger

__all__ = [
    "DEFAULT_REVIEW_AFTER",
    "AskServer",
    "Leave",
    "ReconcileLine",
    "ReconcileReport",
    "Resend",
    "RunProbe",
    "Settlement",
    "Wait",
    "Write",
    "after_probe",
    "attempt_started",
    "decide",
    "default_owner",
    "reconcile",
    "reconcile_forever",
    "rerun_problem",
]

log = logging.getLogger("onceonly.settle")

#: Seconds an unknown record that nothing can settle automatically waits before it is parked.
DEFAULT_REVIEW_AFTER = 300.0
#: Unknown records the reconciler looks at: unsettled, and held ones whose holder is gone.
_SCANNED = (State.UNKNOWN, State.IN_FLIGHT, State.PENDING)
#: Seconds between passes that read every held record on a store that can tell when none can have
#: run out (SQLite: ``lease_survey``), as a backstop for what its holders' files cannot show.
DEFAULT_FULL_EVERY = 600.0


class Settlement(enum.Enum):
    """What the reconciler did with one record.

    .. versionadded:: 0.1
    """

    CONFIRMED = "confirmed"  # the probe found it, or the re-send was answered
    FAILED = "failed"  # it definitely did not happen: a new call may run it
    PARKED = "parked"  # moved to needs_review: a person settles it
    UNSETTLED = "unsettled"  # still unknown: the probe raised, or the re-send was unknown again
    WAITING = "waiting"  # not due yet (settle time, review age, backoff): a later run will look again
    SKIPPED = "skipped"  # someone else settled it or holds it (a lost compare-and-set)
    NO_TOOL = "no_tool"  # its tool is not in the registry: run with --app module:ledger


# --- decisions: pure ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Write:
    """Compare-and-set the record to ``new``. ``settlement`` is what it means once it lands; ``None``
    when the new record still needs settling (a lease expired: now it is unknown)."""

    new: Record
    settlement: Settlement | None
    detail: str


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do before ``until``."""

    until: float
    detail: str


@dataclass(frozen=True, slots=True)
class Leave:
    """Nothing to do in this run."""

    settlement: Settlement
    detail: str


@dataclass(frozen=True, slots=True)
class RunProbe:
    """Ask the other side with the tool's probe; then ``after_probe``."""


@dataclass(frozen=True, slots=True)
class Resend:
    """Run the tool again with the same key and the stored arguments (the guard's plan drives it)."""


@dataclass(frozen=True, slots=True)
class AskServer:
    """Ask the server the record's request went to what happened to its key (``target``: the
    dispatch's ``states.dispatch_target``); then ``decide`` again with its answer."""

    target: dict[str, str]


Decision = Write | Wait | Leave | RunProbe | Resend | AskServer


def decide(
    rec: Record,
    policy: Policy | None,
    *,
    now: float,
    review_after: float,
    by: str,
    rerun_blocked: str | None = None,
    server: ServerSays | None = None,
) -> Decision:
    """What the reconciler does with ``rec`` now. Pure.

    Args:
        rec: the record as read.
        policy: its tool's policy, or ``None`` when the tool is not registered.
        now: the current time.
        review_after: seconds an unknown record that nothing can settle waits, from the start of its
            last attempt (``attempt_started``), before it is parked.
        by: who decides (written in the history).
        rerun_blocked: why the stored arguments cannot rebuild the call (``rerun_problem``), if so.
        server: what the server of the record's request said of its key (after ``AskServer``). Its
            word settles the record before the tool's ``on_unknown`` is consulted; that applies only
            when the server cannot tell (it says unknown, has no such endpoint, or cannot be asked).

    .. versionadded:: 0.1
    """
    if rec.state in HELD:
        if not rec.lease_expired(now):
            return Leave(Settlement.SKIPPED, f"held by {rec.lease_owner}; its lease is alive")
        if rec.state is State.PENDING:
            # The tool reports its dispatch and had not: nothing left this process.
            return Write(
                st.fail(
                    rec,
                    error=f"the lease of {rec.lease_owner} expired before dispatch: nothing was sent",
                    now=now,
                    retry_at=None,
                    ttl=DEFAULT_TTL if policy is None else policy.ttl,
                    by=by,
                    effect=False,
                ),
                Settlement.FAILED,
                "nothing was sent (its holder died before dispatch); a new call may run it",
            )
        # It may have been sent before its holder died: unknown, as a waiting caller would mark it.
        return Write(st.mark_unknown(rec, now=now, reason=f"lease of {rec.lease_owner} expired", by=by), None, "")

    if rec.state is not State.UNKNOWN:
        return Leave(Settlement.SKIPPED, f"already {rec.state.value}")
    target = st.dispatch_target(rec)
    if target is not None:
        if server is None:
            return AskServer(target)
        told = _after_server(rec, policy, server, target, now=now, by=by)
        if told is not None:
            return told
    if policy is None:
        return Leave(Settlement.NO_TOOL, f"tool {rec.tool!r} is not among the reconciler's tools")

    strategy = policy.on_unknown
    if strategy == "probe" and policy.has_probe:
        # As in-call: give the other side time to finish what it may still be doing before asking.
        due = rec.updated_at + policy.settle
        if now < due:
            return Wait(due, f"probe after the settle time ({policy.settle:g}s)")
        return RunProbe()
    if strategy in ("resend", "retry") and rerun_blocked is None:
        due = rec.updated_at + policy.settle
        if now < due:
            return Wait(due, f"{strategy} after the settle time ({policy.settle:g}s)")
        return Resend()

    if strategy in ("resend", "retry"):
        why = f"on_unknown={strategy!r} but {rerun_blocked}"
    elif strategy == "probe":
        why = "on_unknown='probe' without a probe"
    else:
        why = "on_unknown='review'"
    # The age counts from the start of the attempt whose outcome is open: a dead holder's record has
    # been open since its claim, not since a reconciler noticed its lease had expired.
    due = attempt_started(rec) + review_after
    if now < due:
        return Wait(due, f"parked for review after {review_after:g}s ({why})")
    return Write(
        st.park(rec, now=now, reason=f"reconcile: outcome unknown; {why}", by=by),
        Settlement.PARKED,
        f"waiting for a person ({why}): onceonly resolve KEY --confirmed JSON | --failed REASON",
    )


def _after_server(
    rec: Record, policy: Policy | None, said: ServerSays, target: Mapping[str, str], *, now: float, by: str
) -> Write | Wait | None:
    """Settle ``rec`` on its server's word on the key; ``None`` when the server could not tell."""
    ttl = DEFAULT_TTL if policy is None else policy.ttl
    where = f"{target.get('method', '')} {target.get('url', '')}".strip()
    if said.told is Told.COMPLETED:
        result = {"status": said.status, "key": target.get("key"), "settled_by": "server"}
        return Write(
            st.confirm(rec, result_json=json.dumps(result), now=now, ttl=ttl, via="reconcile-server", by=by),
            Settlement.CONFIRMED,
            f"{where}: {said.detail}; a request with the key gets the stored response, replayed",
        )
    if said.told is Told.NOT_RUN:
        return Write(
            st.fail(
                rec,
                error=f"reconcile: {where}: {said.detail} (it did not run; a new call sends it with the same key)",
                now=now,
                retry_at=None,
                ttl=ttl,
                by=by,
                effect=False,
            ),
            Settlement.FAILED,
            f"{where}: {said.detail}: it did not run; a new call may send it",
        )
    if said.told is Told.PROCESSING:
        return Wait(now + (said.retry_after or 1.0), f"{where}: {said.detail}")
    return None


def after_probe(
    rec: Record, policy: Policy, *, value: Any = None, error: BaseException | None = None, now: float, by: str
) -> Write | Leave:
    """Settle ``rec`` on its probe's answer. Pure.

    Found: confirmed, with the probe's answer as the result. ``NOT_FOUND``: failed, since it definitely
    did not happen (a new call may run it; the reconciler does not run it on nobody's behalf). The
    probe raised: it stays unknown.

    .. versionadded:: 0.1
    """
    if error is not None:
        text = f"{type(error).__name__}: {error}"[:500]
        return Leave(Settlement.UNSETTLED, f"the probe raised ({text}); stays unknown")
    if value is NOT_FOUND:
        return Write(
            st.fail(
                rec,
                error="reconcile probe: not found (it did not happen; a new call may run it)",
                now=now,
                retry_at=None,
                ttl=policy.ttl,
                by=by,
            ),
            Settlement.FAILED,
            "the probe found nothing: it did not happen; a new call may run it",
        )
    result_json = encode_result(value, rec.key)
    return Write(
        st.confirm(rec, result_json=result_json, now=now, ttl=policy.ttl, via="reconcile-probe", by=by),
        Settlement.CONFIRMED,
        f"the probe found it: {result_json[:200]}",
    )


def attempt_started(rec: Record) -> float:
    """When the record's current attempt was claimed (its history), else when it last changed.

    .. versionadded:: 0.1
    """
    for entry in reversed(rec.history):
        if entry.get("to") in ("pending", "in_flight") and entry.get("fence") == rec.fence:
            return float(entry["at"])
    return rec.updated_at


def rerun_problem(fn: Callable[..., Any], args: Mapping[str, Any]) -> str | None:
    """Why ``fn`` cannot be called again from its stored ``args``, or ``None`` when it can.

    .. versionadded:: 0.1
    """
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name != "idempotency_key"]
    first = params[0].name if params else None
    if first in ("self", "cls"):
        return "it is a method, and its receiver is not stored"
    kinds = {p.kind for p in params}
    if kinds & {
        inspect.Parameter.VAR_POSITIONAL,
        inspect.Parameter.VAR_KEYWORD,
        inspect.Parameter.POSITIONAL_ONLY,
    }:
        return "it takes *args, **kwargs or positional-only arguments, which the stored JSON cannot rebuild"
    try:
        sig.replace(parameters=params).bind(**args)
    except TypeError as exc:
        return f"the stored arguments do not rebuild the call ({exc}; was a required field left out by ignore=?)"
    return None


# --- the report -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReconcileLine:
    """What happened to one record.

    .. versionadded:: 0.1
    """

    key: str
    tool: str
    before: State
    after: State | None  # as the reconciler last saw it; None: the record is gone
    settlement: Settlement
    detail: str
    due_at: float | None = None  # for ``waiting``: when it is due

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "tool": self.tool,
            "before": self.before.value,
            "after": None if self.after is None else self.after.value,
            "settlement": self.settlement.value,
            "detail": self.detail,
            "due_at": self.due_at,
        }


@dataclass(slots=True)
class ReconcileReport:
    """What one reconciler run did: a line per record it looked at, and counts per settlement.

    .. versionadded:: 0.1
    """

    by: str
    started_at: float
    finished_at: float = 0.0
    lines: list[ReconcileLine] = field(default_factory=list)
    #: Whether the run read the held records (pending, in flight) for expired leases, and why. A store
    #: that knows its lease holders (SQLite) reads them only when one may have run out.
    read_held: bool = True
    read_held_why: list[str] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in Settlement}
        for line in self.lines:
            out[line.settlement.value] += 1
        return out

    @property
    def acted(self) -> list[ReconcileLine]:
        """The lines where something changed or needs attention (not ``waiting`` / ``skipped``)."""
        return [ln for ln in self.lines if ln.settlement not in (Settlement.WAITING, Settlement.SKIPPED)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "by": self.by,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "counts": self.counts,
            "read_held": self.read_held,
            "read_held_why": self.read_held_why,
            "records": [ln.to_dict() for ln in self.lines],
        }


# --- I/O: one record ------------------------------------------------------------------------------


class _Stop(Exception):
    """The guard's plan wants to wait or finds the record gone: stop, report this line."""

    def __init__(self, settlement: Settlement, detail: str, due_at: float | None = None) -> None:
        super().__init__(detail)
        self.settlement = settlement
        self.detail = detail
        self.due_at = due_at


class _Reconciler:
    """The I/O of one run. Every write goes through ``_cas``."""

    def __init__(
        self,
        ledger: Ledger,
        tools: Mapping[str, Any],
        *,
        review_after: float,
        by: str,
        sleep_budget: Callable[[], float],
        server_headers: Mapping[str, str] | None = None,
        server_timeout: float = 10.0,
    ) -> None:
        self.server_headers = dict(server_headers or {})
        self.server_timeout = server_timeout
        self.ledger = ledger
        self.store = ledger.store
        self.tools = {name: _spec_of(t) for name, t in tools.items()}
        self.review_after = review_after
        self.by = by
        self.sleep_budget = sleep_budget

    def _cas(self, new: Record, old: Record) -> tuple[bool, Record | None]:
        """Compare-and-set with the ledger's rule for a lost answer (``swap_now``); if the re-read fails
        too, the run ends and a later run reads the record."""
        ok, cur = swap_now(self.store, new, old)
        if ok:
            self.ledger.runtime.announce(new)  # also when the answer was lost but the write landed
        return ok, cur

    def settle(self, rec: Record) -> ReconcileLine:
        done = self._settle(rec)
        if done.settlement is Settlement.FAILED and done.after is State.FAILED:
            free_budget(self.ledger.store, rec.key)  # it did not happen: its budget amount is freed
        return done

    def _settle(self, rec: Record) -> ReconcileLine:
        before = rec.state
        tool = self.tools.get(rec.tool)
        policy = None if tool is None else tool.policy
        blocked = None
        if tool is not None and policy is not None and policy.on_unknown in ("resend", "retry"):
            blocked = rerun_problem(tool.fn, rec.args)

        def line(settlement: Settlement, detail: str, after: Record | None, due: float | None = None) -> ReconcileLine:
            return ReconcileLine(
                rec.key, rec.tool, before, None if after is None else after.state, settlement, detail, due
            )

        # Bounded: each round follows a write that landed (held → unknown), at most one of them.
        said: ServerSays | None = None
        for _ in range(4):
            now = self.ledger.clock()
            decision = decide(
                rec, policy, now=now, review_after=self.review_after, by=self.by, rerun_blocked=blocked, server=said
            )
            if isinstance(decision, AskServer):
                said = self._ask_server(decision.target)
                continue
            if isinstance(decision, Leave):
                return line(decision.settlement, decision.detail, rec)
            if isinstance(decision, Wait):
                return line(Settlement.WAITING, decision.detail, rec, decision.until)
            if isinstance(decision, RunProbe):
                assert tool is not None
                assert policy is not None
                probed = self._probe(tool, rec)
                decision = after_probe(
                    rec, policy, value=probed.value, error=probed.error, now=self.ledger.clock(), by=self.by
                )
                if isinstance(decision, Leave):
                    return line(decision.settlement, decision.detail, rec)
            if isinstance(decision, Resend):
                assert tool is not None
                return self._resend(tool, rec, before)
            ok, cur = self._cas(decision.new, rec)
            if not ok:
                state = "gone" if cur is None else cur.state.value
                return line(Settlement.SKIPPED, f"someone else settled it first (now {state})", cur)
            if decision.settlement is not None:
                return line(decision.settlement, decision.detail, decision.new)
            rec = decision.new
        return line(Settlement.UNSETTLED, "no decision after four rounds", rec)  # pragma: no cover

    def _ask_server(self, target: Mapping[str, str]) -> ServerSays:
        """``GET`` the key status URL the dispatch recorded, with the reconciler's ``server_headers``
        (the server scopes keys by the client's credentials, which records never hold)."""
        url = target.get("status", "")
        if not url.startswith(("http://", "https://")):
            return ServerSays(Told.NO_ANSWER, detail=f"no http(s) key status URL ({url[:80]!r})")
        request = urllib.request.Request(url, headers=dict(self.server_headers), method="GET")
        try:
            with urllib.request.urlopen(request, timeout=self.server_timeout) as answer:
                return read_status(answer.status, _lower(answer.headers.items()), answer.read(1 << 16))
        except urllib.error.HTTPError as exc:
            with exc:
                return read_status(exc.code, _lower(exc.headers.items()), exc.read(1 << 16))
        except (OSError, ValueError) as exc:  # refused, timed out, a bad URL
            return ServerSays(Told.NO_ANSWER, detail=f"the server could not be asked ({type(exc).__name__})")

    def _probe(self, tool: ToolSpec, rec: Record) -> Probed:
        """The ledger's own probe step; an async tool's probe runs on an event loop of its own."""
        if tool.is_async:
            return asyncio.run(aprobe(tool, rec))
        return probe(tool, rec)

    def _resend(self, tool: ToolSpec, rec: Record, before: State) -> ReconcileLine:
        """Run the guard's own plan for the stored call, as one more caller of the operation."""
        ledger = self.ledger
        # The plan's own bound on waits (the tool's wait=) is lifted: _as_reconciler bounds them by this
        # run's budget instead, and skips the backoff before the re-send.
        policy = dataclasses.replace(tool.policy, wait=math.inf)
        call = Call(
            key=rec.key, scope=rec.scope, tool=rec.tool, fingerprint=rec.fingerprint, args_json=rec.args_json,
            owner=f"reconcile@{ledger.runtime.new_owner()}", policy=policy, clock=ledger.clock, rng=ledger.rng,
        )  # fmt: skip
        gen = _as_reconciler(plan(call), rec.version, self.sleep_budget, ledger.clock)
        kwargs = rec.args

        def line(settlement: Settlement, detail: str, due: float | None = None) -> ReconcileLine:
            cur = self.store.get(rec.key)
            return ReconcileLine(rec.key, rec.tool, before, None if cur is None else cur.state, settlement, detail, due)

        try:
            if tool.is_async:
                out = asyncio.run(adrive(ledger.runtime, gen, tool, call, (), kwargs))
            else:
                out = drive(ledger.runtime, gen, tool, call, (), kwargs)
        except _Stop as stop:
            if stop.settlement is not Settlement.WAITING:
                return line(stop.settlement, stop.detail, stop.due_at)
            # Our own attempt ended and the plan would wait past this run's budget before the next.
            cur = self.store.get(rec.key)
            if cur is not None and cur.state is State.FAILED:
                detail = f"re-sent, not sent or refused ({cur.error}); a new call may run it"
                return line(Settlement.FAILED, detail[:500])
            return line(Settlement.UNSETTLED, f"re-sent, the outcome is unknown again; {stop.detail}", stop.due_at)
        except OutcomeUnknown as exc:
            parked = exc.record is not None and exc.record.state is State.NEEDS_REVIEW
            if parked:
                return line(Settlement.PARKED, f"re-sent until the attempts ran out: {exc}")
            return line(Settlement.UNSETTLED, str(exc))
        except AttemptsExhausted as exc:
            return line(Settlement.FAILED, str(exc))
        except (InProgress, KeyConflict) as exc:
            return line(Settlement.SKIPPED, str(exc))
        except StoreError:
            raise
        except Exception as exc:
            # The tool's own definite failure: the plan recorded the record as failed.
            return line(Settlement.FAILED, f"re-sent; the tool failed: {type(exc).__name__}: {exc}"[:500])
        if out.replayed:
            return line(Settlement.SKIPPED, f"someone else settled it first (via {out.via})")
        return line(Settlement.CONFIRMED, f"re-sent with the same key: {encode_result(out.result, rec.key)[:200]}")


def _lower(headers: Any) -> dict[str, str]:
    return {str(name).lower(): str(value) for name, value in headers}


def _as_reconciler(gen: Plan, version: int, sleep_budget: Callable[[], float], clock: Callable[[], float]) -> Plan:
    """The guard's plan, run by the reconciler on the record it decided on (at ``version``).

    Four actions change meaning. The first claim only reads: the reconciler never creates a record,
    and stops when the record moved on since it decided (someone else acted). The plan's backoff
    before the re-send is skipped: ``decide`` already waited the tool's settle time, and the
    reconciler's own schedule spaces its runs (a backoff after its own attempt is kept). A later
    wait past this run's budget stops it. A wait on a live holder stops it: someone settles it now.
    """
    send: Any = None
    error: BaseException | None = None
    skipped_backoff = executed = False
    while True:
        try:
            action: Action = gen.throw(error) if error is not None else gen.send(send)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        error = None
        if isinstance(action, Claim):
            current = yield Get(action.record.key)  # a store error here ends this record's run
            if current is None or current.version != version:
                gen.close()
                now = "gone" if current is None else current.state.value
                raise _Stop(Settlement.SKIPPED, f"someone else acted on it first (now {now})")
            send = current
            continue
        if isinstance(action, Sleep):
            if not (skipped_backoff or executed):
                skipped_backoff = True
                send = None
                continue
            if action.seconds > sleep_budget():
                gen.close()
                raise _Stop(Settlement.WAITING, f"backoff: due in {action.seconds:.1f}s", clock() + action.seconds)
        if isinstance(action, WaitChange):
            gen.close()
            raise _Stop(Settlement.SKIPPED, "another caller holds it now")
        executed = executed or isinstance(action, Execute)
        try:
            send = yield action
        except StoreError as exc:
            error = exc


# --- I/O: one run -------------------------------------------------------------------------------------


def default_owner() -> str:
    """Who a reconciler is in histories: ``reconcile@host:pid``."""
    return f"reconcile@{socket.gethostname()[:40]}:{os.getpid()}"


def reconcile(
    ledger: Ledger,
    *,
    tools: Mapping[str, Any] | None = None,
    scope: str | None = None,
    review_after: float = DEFAULT_REVIEW_AFTER,
    wait: float = 0.0,
    batch: int = 200,
    by: str | None = None,
    sleep: Callable[[float], None] | None = None,
    full_every: float | None = DEFAULT_FULL_EVERY,
    server_headers: Mapping[str, str] | None = None,
) -> ReconcileReport:
    """Settle what the guarded calls left unsettled, once. Safe to run in several processes at once.

    Looks at every ``unknown`` record and every ``pending`` / ``in_flight`` record whose lease expired,
    and settles each through its tool (module docstring): probe, re-send, or park for review.

    Args:
        ledger: the ledger; its ``tools`` registry says how each tool settles.
        tools: another registry (tool name → tool), e.g. the tools of the same app on another ledger.
        scope: only the records of this scope (a task, a tenant); default: every record.
        review_after: seconds an unknown record that nothing can settle automatically waits (counted
            from the start of its last attempt) before it is parked as ``needs_review``.
        wait: seconds this run may sleep for records that become due soon (a probe's settle time, a
            backoff), so that one run settles them; ``0``: report them as ``waiting``.
        batch: records read per page.
        by: who reconciles, for the histories (default ``reconcile@host:pid``).
        sleep: injectable sleep (default: the ledger's).
        full_every: on SQLite, a pass reads the held records only when a lease may have run out (a
            holder died or stalled: see docs/sqlite.md), and at least once in this many seconds;
            ``None``: only then. Other stores find expired leases through an index on every pass.
        server_headers: headers sent when asking a server about a key its record was dispatched to
            (``onceonly.http``'s ``probe="server"``): the credentials the calls were made with (such as
            ``{"Authorization": "Bearer …"}``), since the server answers each client about its own keys
            and records never keep credentials.

    Returns:
        a ``ReconcileReport``: one line per record looked at, and counts per ``Settlement``.

    Raises:
        StoreError: the store failed; what was written before is settled and stays so.

    .. versionadded:: 0.1
    """
    if review_after < 0 or wait < 0:
        raise ValueError(f"review_after={review_after}, wait={wait}: seconds cannot be negative")
    if batch < 1:
        raise ValueError(f"batch={batch}: read at least one record per page")
    if full_every is not None and not full_every > 0:
        raise ValueError(f"full_every={full_every}: give a positive number of seconds, or None")
    ledger.runtime.sync_clock()  # a reconciler that runs no tool has no heartbeat to do it
    observers = ledger.runtime.pass_observers
    if not observers:
        return _reconcile(ledger, tools, scope, review_after, wait, batch, by, sleep, full_every, server_headers)
    with contextlib.ExitStack() as stack:
        seen = [observe(scope) for observe in observers]
        for cm in seen:
            stack.enter_context(cm)
        report = _reconcile(ledger, tools, scope, review_after, wait, batch, by, sleep, full_every, server_headers)
        for cm in seen:
            cm.report = report  # type: ignore[attr-defined]
    return report


def _reconcile(
    ledger: Ledger,
    tools: Mapping[str, Any] | None,
    scope: str | None,
    review_after: float,
    wait: float,
    batch: int,
    by: str | None,
    sleep: Callable[[float], None] | None,
    full_every: float | None,
    server_headers: Mapping[str, str] | None,
) -> ReconcileReport:
    clock = ledger.clock
    do_sleep = sleep or ledger.sleep
    who = by or default_owner()
    started = clock()
    deadline = started + wait
    report = ReconcileReport(by=who, started_at=started)
    worker = _Reconciler(
        ledger,
        ledger.tools if tools is None else tools,
        review_after=review_after,
        by=who,
        sleep_budget=lambda: max(0.0, deadline - clock()),
        server_headers=server_headers,
    )
    lines = _first_pass(ledger, worker, report, scope=scope, batch=batch, full_every=full_every)
    _settle_due(ledger, worker, lines, deadline=deadline, sleep=do_sleep)
    report.lines = list(lines.values())
    report.finished_at = clock()
    counts = {k: v for k, v in report.counts.items() if v}
    if counts:
        log.info("onceonly reconcile by %s: %s", who, counts)
    return report


def _first_pass(
    ledger: Ledger,
    worker: _Reconciler,
    report: ReconcileReport,
    *,
    scope: str | None,
    batch: int,
    full_every: float | None,
) -> dict[str, ReconcileLine]:
    """Read every record to settle, page by page, and settle each once. Returns the lines by key."""
    clock = ledger.clock
    lines: dict[str, ReconcileLine] = {}
    after: str | None = None
    # A store that knows who holds its leases says whether any can have run out; if none can, the
    # pass reads only the unknown records (an index) instead of every record (SQLite has no index of
    # held ones: each claim would pay for it).
    store = ledger.store
    looked = store.lease_survey(clock(), full_every) if isinstance(store, SurveyingStore) else None
    states = _SCANNED if looked is None or looked.needed else (State.UNKNOWN,)
    if looked is not None:
        report.read_held, report.read_held_why = looked.needed, looked.why
    while True:
        page = ledger.store.scan(
            Query(states=states, scope=scope, lease_expired_before=clock(), after=after, limit=batch)
        )
        for found in page:
            lines[found.key] = worker.settle(found)
        if len(page) < batch:
            break
        after = page[-1].key
    # Read to the end: a dead holder's file may go, unless a record was left held (a scope, a store error).
    if looked is not None and scope is None and not any(ln.after in HELD for ln in lines.values()):
        looked.done()
    return lines


def _settle_due(
    ledger: Ledger,
    worker: _Reconciler,
    lines: dict[str, ReconcileLine],
    *,
    deadline: float,
    sleep: Callable[[float], None],
) -> None:
    """Records that become due within this run's budget: one sleep for all of them, then again."""
    clock = ledger.clock
    while True:
        now = clock()
        due = [
            ln for ln in lines.values()
            if ln.settlement is Settlement.WAITING and ln.due_at is not None and ln.due_at <= deadline
        ]  # fmt: skip
        if not due or now > deadline:
            return
        latest = max(ln.due_at or now for ln in due)
        if latest > now:
            sleep(latest - now)
        for ln in due:
            rec = ledger.store.get(ln.key)
            if rec is None:
                lines[ln.key] = ReconcileLine(
                    ln.key, ln.tool, ln.before, None, Settlement.SKIPPED, "the record is gone"
                )
                continue
            again = worker.settle(rec)
            # Keep what the record was when this run first saw it.
            lines[ln.key] = ReconcileLine(
                again.key, again.tool, ln.before, again.after, again.settlement, again.detail, again.due_at
            )


def reconcile_forever(
    ledger: Ledger,
    *,
    every: float,
    on_report: Callable[[ReconcileReport], None] | None = None,
    stop: Callable[[], bool] = lambda: False,
    **kwargs: Any,
) -> None:
    """Run ``reconcile`` every ``every`` seconds until ``stop()`` is true.

    A store error ends that run only: it is logged and the next run tries again.

    .. versionadded:: 0.1
    """
    if every <= 0:
        raise ValueError(f"every={every}: give a positive number of seconds")
    while not stop():
        began = ledger.clock()
        try:
            report = reconcile(ledger, **kwargs)
        except StoreError as exc:
            log.warning("onceonly reconcile: the store failed (%s); trying again in %gs", exc, every)
        else:
            if on_report is not None:
                on_report(report)
        # Short naps, so that a stop request (SIGTERM) ends the loop within a fraction of a second.
        while not stop():
            rest = every - (ledger.clock() - began)
            if rest <= 0:
                break
            ledger.sleep(min(rest, 0.25))


def _spec_of(tool: Any) -> ToolSpec:
    """A registry entry is a guarded function (its ``spec``) or a ``ToolSpec`` itself."""
    return tool if isinstance(tool, ToolSpec) else tool.spec
