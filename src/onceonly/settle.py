"""Settling unknowns after the fact: the reconciler. Decisions are pure; ``reconcile`` does their I/O.

A guarded call settles its own unknown in-call (``onceonly.plan``: probe, resend, retry or review). What
remains unsettled is left for the reconciler: records that are ``unknown`` (a probe failed, the caller
gave up or died) and records whose holder died (``pending`` / ``in_flight`` with an expired lease).

Per record, ``decide`` says what to do; ``reconcile`` does it and reports:

    pending, lease expired ─────────────▶ failed        nothing was sent: a new call may run it
    in_flight, lease expired ───────────▶ unknown ──┐   it may have been sent (as a waiting caller does)
    unknown or needs_review, dispatched to a server with a key status endpoint (``probe="server"``) ─▶ ask it first:
             completed ─▶ confirmed (via reconcile-server)   404 ─▶ failed, nothing ran (a new call sends it)
             processing ─▶ waiting                            unknown / cannot ask ─▶ the tool's on_unknown
                                                              (needs_review: stays parked)
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
import contextvars
import dataclasses
import enum
import inspect
import json
import logging
import math
import os
import queue
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
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
    "probe_errors",
    "reconcile",
    "reconcile_forever",
    "rerun_problem",
]

log = logging.getLogger("onceonly.settle")

#: Seconds an unknown record that nothing can settle automatically waits before it is parked.
DEFAULT_REVIEW_AFTER = 300.0
#: Unknown records the reconciler looks at: unsettled, and held ones whose holder is gone.
_SCANNED = (State.UNKNOWN, State.NEEDS_REVIEW, State.IN_FLIGHT, State.PENDING)
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
        return _held(rec, policy, now=now, by=by)

    if rec.state is State.NEEDS_REVIEW:
        return _parked(rec, policy, server, now=now, by=by)
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


def _held(rec: Record, policy: Policy | None, *, now: float, by: str) -> Decision:
    """A held record: left while its lease lives; once it ran out, failed if nothing was sent, else unknown."""
    if not rec.lease_expired(now):
        return Leave(Settlement.SKIPPED, f"held by {rec.lease_owner}; its lease is alive")
    if st.approved_unclaimed(rec):  # nothing ran: its next call runs it (approve=)
        return Leave(Settlement.SKIPPED, "approved by a person; its next call runs it")
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


def _parked(rec: Record, policy: Policy | None, server: ServerSays | None, *, now: float, by: str) -> Decision:
    """A record parked for a person whose request went to a server that serves key statuses: the
    server may have come back since, and its word settles the record; anything else leaves it parked."""
    target = st.dispatch_target(rec)
    if target is None:
        return Leave(Settlement.SKIPPED, "waiting for a person")
    if server is None:
        return AskServer(target)
    told = _after_server(rec, policy, server, target, now=now, by=by)
    if isinstance(told, Write):
        return told
    return Leave(Settlement.SKIPPED, f"waiting for a person; its server cannot tell ({server.detail})")


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
    error: str | None = None  # the probe raised: its ``Type: message``, for a summary by distinct error

    def to_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "tool": self.tool,
            "before": self.before.value,
            "after": None if self.after is None else self.after.value,
            "settlement": self.settlement.value,
            "detail": self.detail,
            "due_at": self.due_at,
            "error": self.error,
        }


def probe_errors(lines: Iterable[ReconcileLine]) -> list[tuple[int, str, str, str]]:
    """The probes that raised, grouped by tool and error (its first line): ``(count, tool, error, a
    key)``, most frequent first. Pure. A flaky probe over 30 records is one line, not 30.

    .. versionadded:: 0.1
    """
    groups: dict[tuple[str, str], list[str]] = {}
    for ln in lines:
        if ln.error is not None:
            first = ln.error.strip().splitlines()[0] if ln.error.strip() else ln.error
            groups.setdefault((ln.tool, first[:300]), []).append(ln.key)
    rows = [(len(keys), tool, text, keys[0]) for (tool, text), keys in groups.items()]
    return sorted(rows, key=lambda row: (-row[0], row[1], row[2]))


@dataclass(slots=True)
class ReconcileReport:
    """What one reconciler run did: a line per record it looked at, and counts per settlement.

    .. versionadded:: 0.1
    """

    by: str = ""  # both set by the run: an empty report may be handed to ``reconcile(report=)``
    started_at: float = 0.0
    finished_at: float = 0.0
    lines: list[ReconcileLine] = field(default_factory=list)
    #: Whether the run read the held records (pending, in flight) for expired leases, and why. A store
    #: that knows its lease holders (SQLite) reads them only when one may have run out.
    read_held: bool = True
    read_held_why: list[str] = field(default_factory=list)
    #: Ctrl-C ended the run: ``lines`` are the records settled until then; the others were left as
    #: they were (a record whose probe was under way stays unknown).
    interrupted: bool = False

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
            "interrupted": self.interrupted,
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


class _Abandoned(Exception):
    """The run was interrupted before this record's first write: it is left as it was read."""


class _Gate:
    """The writes of one run. Once it is shut, a record that wrote nothing yet writes nothing (its
    probe's answer is dropped, its re-send is not claimed); ``shut`` waits for the records that did
    write until their lines are handed back, so that an interrupted run reports each write that landed."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._busy = 0  # records that wrote and whose line is not handed back yet
        self._mine = threading.local()  # whether this thread's record wrote
        self.closed = False

    def enter(self) -> None:
        """Before each write of a record (in the thread that settles it)."""
        with self._cond:
            if getattr(self._mine, "busy", False):
                return
            if self.closed:
                raise _Abandoned
            self._busy += 1
            self._mine.busy = True

    def leave(self) -> None:
        """The record's line is handed back (or its thread gave up on it)."""
        if getattr(self._mine, "busy", False):
            self._mine.busy = False
            with self._cond:
                self._busy -= 1
                self._cond.notify_all()

    def shut(self, grace: float) -> None:
        """No record starts writing from now on; wait up to ``grace`` s for those that did."""
        with self._cond:
            self.closed = True
            self._cond.wait_for(lambda: self._busy == 0, timeout=grace)


class _Reconciler:
    """The I/O of one run. Every write goes through ``_cas`` (a re-send through its claim), past the
    run's ``gate``."""

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
        gate: _Gate | None = None,
    ) -> None:
        self.gate = gate or _Gate()
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
        self.gate.enter()
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

        def line(
            settlement: Settlement,
            detail: str,
            after: Record | None,
            due: float | None = None,
            error: str | None = None,
        ) -> ReconcileLine:
            return ReconcileLine(
                rec.key, rec.tool, before, None if after is None else after.state, settlement, detail, due, error
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
                    err = probed.error
                    text = None if err is None else f"{type(err).__name__}: {err}"[:500]
                    return line(decision.settlement, decision.detail, rec, error=text)
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
        gen = _as_reconciler(plan(call), rec.version, self.sleep_budget, ledger.clock, self.gate.enter)
        kwargs = rec.args

        def line(settlement: Settlement, detail: str, due: float | None = None) -> ReconcileLine:
            cur = self.store.get(rec.key)
            return ReconcileLine(rec.key, rec.tool, before, None if cur is None else cur.state, settlement, detail, due)

        try:
            if tool.is_async:
                out = asyncio.run(adrive(ledger.runtime, gen, tool, call, (), kwargs))
            else:
                out = drive(ledger.runtime, gen, tool, call, (), kwargs)
        except _Abandoned:
            raise  # interrupted before its claim: nothing was sent
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


def _as_reconciler(
    gen: Plan,
    version: int,
    sleep_budget: Callable[[], float],
    clock: Callable[[], float],
    enter: Callable[[], None],
) -> Plan:
    """The guard's plan, run by the reconciler on the record it decided on (at ``version``).

    Four actions change meaning. The first claim only reads: the reconciler never creates a record,
    and stops when the record moved on since it decided (someone else acted), or, through ``enter``
    (the run's gate), when the run was interrupted (nothing is claimed). The plan's backoff
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
            try:
                enter()
            except _Abandoned:
                gen.close()
                raise
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
    concurrency: int = 1,
    progress: Callable[[int, int], None] | None = None,
    report: ReconcileReport | None = None,
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
        concurrency: records settled at once (their probes, re-sends and server questions), each in a
            thread of a bounded pool; ``1``: one after another in the caller's thread. Each record is
            still settled once: every write is a compare-and-set.
        progress: ``progress(done, handed)`` in the caller's thread after each record: how many were
            settled so far, of how many read so far (the pages are read as the pool answers).
        report: the report to fill (by, times, lines), so that a caller interrupted by Ctrl-C
            (``KeyboardInterrupt``) still has the records settled until then: its ``interrupted`` is
            true. After Ctrl-C no record starts writing; a record whose probe was under way is left as
            it was, and the writes under way get a few seconds to land and be reported.

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
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency!r}: settle 1 or more records at once")
    ledger.runtime.sync_clock()  # a reconciler that runs no tool has no heartbeat to do it
    report = ReconcileReport() if report is None else report
    options = _Options(
        tools=ledger.tools if tools is None else tools, scope=scope, review_after=review_after, wait=wait,
        batch=batch, by=by or default_owner(), sleep=sleep or ledger.sleep, full_every=full_every,
        server_headers=server_headers, concurrency=concurrency, progress=progress,
    )  # fmt: skip
    observers = ledger.runtime.pass_observers
    if not observers:
        _reconcile(ledger, report, options)
        return report
    with contextlib.ExitStack() as stack:
        seen = [observe(scope) for observe in observers]
        for cm in seen:
            stack.enter_context(cm)
        _reconcile(ledger, report, options)
        for cm in seen:
            cm.report = report  # type: ignore[attr-defined]
    return report


@dataclass(frozen=True, slots=True)
class _Options:
    """What one run was asked (``reconcile``'s arguments, defaults filled in)."""

    tools: Mapping[str, Any]
    scope: str | None
    review_after: float
    wait: float
    batch: int
    by: str
    sleep: Callable[[float], None]
    full_every: float | None
    server_headers: Mapping[str, str] | None
    concurrency: int
    progress: Callable[[int, int], None] | None


#: Seconds an interrupted run waits for the records that were writing (a re-send under way) to finish.
_GRACE = 5.0


def _reconcile(ledger: Ledger, report: ReconcileReport, options: _Options) -> None:
    clock = ledger.clock
    report.by = options.by
    report.started_at = started = clock()
    deadline = started + options.wait
    worker = _Reconciler(
        ledger,
        options.tools,
        review_after=options.review_after,
        by=options.by,
        sleep_budget=lambda: max(0.0, deadline - clock()),
        server_headers=options.server_headers,
    )
    run = _Pass(worker, options.concurrency, options.progress)
    try:
        _first_pass(ledger, run, report, scope=options.scope, batch=options.batch, full_every=options.full_every)
        _settle_due(ledger, run, deadline=deadline, sleep=options.sleep)
    except BaseException as exc:  # Ctrl-C, or the store failed: what was written is in the report
        report.interrupted = isinstance(exc, KeyboardInterrupt)
        run.interrupt(_GRACE)
        raise
    finally:
        run.close()
        report.lines = run.report_lines()
        report.finished_at = clock()
    counts = {k: v for k, v in report.counts.items() if v}
    if counts:
        log.info("onceonly reconcile by %s: %s", options.by, counts)


def _first_pass(
    ledger: Ledger,
    run: _Pass,
    report: ReconcileReport,
    *,
    scope: str | None,
    batch: int,
    full_every: float | None,
) -> None:
    """Read every record to settle, page by page, and settle each once (``run.lines``, by key)."""
    clock = ledger.clock
    after: str | None = None
    # A store that knows who holds its leases says whether any can have run out; if none can, the
    # pass reads only the unknown records (an index) instead of every record (SQLite has no index of
    # held ones: each claim would pay for it).
    store = ledger.store
    looked = store.lease_survey(clock(), full_every) if isinstance(store, SurveyingStore) else None
    states = _SCANNED if looked is None or looked.needed else (State.UNKNOWN, State.NEEDS_REVIEW)
    if looked is not None:
        report.read_held, report.read_held_why = looked.needed, looked.why
    while True:
        page = ledger.store.scan(
            Query(states=states, scope=scope, lease_expired_before=clock(), after=after, limit=batch)
        )
        for found in page:
            if found.state is State.NEEDS_REVIEW and st.dispatch_target(found) is None:
                continue  # a person's to settle: only a server that serves key statuses is asked again
            run.settle(found)
        if len(page) < batch:
            break
        after = page[-1].key
    run.finish()
    # Read to the end: a dead holder's file may go, unless a record was left held (a scope, a store error).
    if looked is not None and scope is None and not any(ln.after in HELD for ln in run.lines.values()):
        looked.done()


def _settle_due(ledger: Ledger, run: _Pass, *, deadline: float, sleep: Callable[[float], None]) -> None:
    """Records that become due within this run's budget: one sleep for all of them, then again."""
    clock = ledger.clock
    lines = run.lines
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
                run.keep(ReconcileLine(ln.key, ln.tool, ln.before, None, Settlement.SKIPPED, "the record is gone"))
                continue
            run.settle(rec)
        run.finish()


# --- the pool a run settles its records in ----------------------------------------------------------

#: A record's key and its line (``None``: left as it was, the run was interrupted), or what its settling raised.
_Done = tuple[str, ReconcileLine | None, BaseException | None]


class _Pass:
    """The records of one run, handed to a pool of ``concurrency`` threads (1: settled in the caller's
    thread). Their lines are taken back in the caller's thread: the counts need no lock."""

    def __init__(self, worker: _Reconciler, concurrency: int, progress: Callable[[int, int], None] | None) -> None:
        self.gate = worker.gate
        self.progress = progress
        self.lines: dict[str, ReconcileLine] = {}
        self.order: dict[str, int] = {}  # the order the records were read in, for the report
        self.handed = self.taken = 0
        self._pending: list[_Done] = []  # answers out of the pool, not taken yet (a Ctrl-C may come between)
        self.pool: _Inline | _Threads = (
            _Inline(worker.settle, self.gate) if concurrency == 1 else _Threads(worker.settle, self.gate, concurrency)
        )

    def settle(self, rec: Record) -> None:
        """Hand ``rec`` to the pool, once it has room (the pages are read as fast as it settles)."""
        while self.pool.full():
            self._pending.append(self.pool.next())
            self._take_pending()
        self.order.setdefault(rec.key, len(self.order))
        self.handed += 1
        self.pool.submit(rec)
        self._pending.extend(self.pool.ready())
        self._take_pending()

    def keep(self, line: ReconcileLine) -> None:
        """A line the run made without settling a record."""
        self.handed += 1
        self._pending.append((line.key, line, None))
        self._take_pending()

    def finish(self) -> None:
        """Wait for every record handed."""
        while self.pool.running:
            self._pending.append(self.pool.next())
            self._take_pending()

    def interrupt(self, grace: float) -> None:
        """The run ends early: no record starts writing; take the lines of those that wrote (waiting
        up to ``grace`` s for them)."""
        self.gate.shut(grace)
        self._pending.extend(self.pool.ready())
        while self._pending:
            with contextlib.suppress(Exception):  # a failure now cannot change what the run reports
                self._take_pending()

    def close(self) -> None:
        self.gate.closed = True  # a thread still in a probe (a hung one) writes nothing after the run
        self.pool.close()

    def report_lines(self) -> list[ReconcileLine]:
        return sorted(self.lines.values(), key=lambda ln: self.order.get(ln.key, 0))

    def _take_pending(self) -> None:
        while self._pending:
            self._take(self._pending.pop(0))

    def _take(self, done: _Done) -> None:
        key, line, failure = done
        self.taken += 1
        if failure is not None:
            raise failure
        if line is not None:
            earlier = self.lines.get(key)
            if earlier is not None:  # settled again once due: keep what the record was when first seen
                line = dataclasses.replace(line, before=earlier.before)
            self.lines[key] = line
        if self.progress is not None:
            self.progress(self.taken, self.handed)


class _Inline:
    """Concurrency 1: each record settled in the caller's thread as it is handed."""

    running = 0

    def __init__(self, settle: Callable[[Record], ReconcileLine], gate: _Gate) -> None:
        self._settle = settle
        self._gate = gate
        self._ready: list[_Done] = []

    def full(self) -> bool:
        return False

    def submit(self, rec: Record) -> None:
        try:
            line: ReconcileLine | None = self._settle(rec)
        except _Abandoned:
            line = None
        finally:
            self._gate.leave()
        self._ready.append((rec.key, line, None))

    def next(self) -> _Done:  # pragma: no cover - never full
        raise AssertionError("an inline pool is never full")

    def ready(self) -> list[_Done]:
        done, self._ready = self._ready, []
        return done

    def close(self) -> None:
        pass


class _Threads:
    """At most ``size`` records settled at once, in daemon threads started as needed: a probe that
    hangs holds up neither Ctrl-C nor the process's exit (an executor's threads are joined at exit)."""

    def __init__(self, settle: Callable[[Record], ReconcileLine], gate: _Gate, size: int) -> None:
        self._settle = settle
        self._gate = gate
        self._size = size
        self._todo: queue.SimpleQueue[Record | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[_Done] = queue.SimpleQueue()
        self._threads = 0
        self.running = 0  # handed, and not taken back

    def full(self) -> bool:
        return self.running >= self._size

    def submit(self, rec: Record) -> None:
        if self._threads <= self.running and self._threads < self._size:
            # Each thread runs in a copy of the caller's context: a tracing span of the pass stays the
            # parent of what its records do.
            context = contextvars.copy_context()
            threading.Thread(target=context.run, args=(self._work,), name="onceonly-reconcile", daemon=True).start()
            self._threads += 1
        self.running += 1
        self._todo.put(rec)

    def _work(self) -> None:
        while (rec := self._todo.get()) is not None:
            line: ReconcileLine | None = None
            failure: BaseException | None = None
            try:
                if not self._gate.closed:  # interrupted: the records not begun are left as they were
                    line = self._settle(rec)
            except _Abandoned:
                pass
            except BaseException as exc:  # handed to the caller's thread, which raises it
                failure = exc
            self._done.put((rec.key, line, failure))
            self._gate.leave()  # after the put: an interrupted run finds this line once the gate is clear

    def next(self) -> _Done:
        done = self._done.get()
        self.running -= 1
        return done

    def ready(self) -> list[_Done]:
        found: list[_Done] = []
        while self.running:
            try:
                found.append(self._done.get_nowait())
            except queue.Empty:
                break
            self.running -= 1
        return found

    def close(self) -> None:
        for _ in range(self._threads):
            self._todo.put(None)


def reconcile_forever(
    ledger: Ledger,
    *,
    every: float,
    on_report: Callable[[ReconcileReport], None] | None = None,
    stop: Callable[[], bool] = lambda: False,
    **kwargs: Any,
) -> None:
    """Run ``reconcile`` every ``every`` seconds until ``stop()`` is true.

    A store error ends that run only: it is logged and the next run tries again. Ctrl-C during a run
    hands its partial report (``interrupted`` true) to ``on_report``, then ``KeyboardInterrupt``
    propagates.

    .. versionadded:: 0.1
    """
    if every <= 0:
        raise ValueError(f"every={every}: give a positive number of seconds")
    while not stop():
        began = ledger.clock()
        report = ReconcileReport()
        try:
            reconcile(ledger, report=report, **kwargs)
        except StoreError as exc:
            log.warning("onceonly reconcile: the store failed (%s); trying again in %gs", exc, every)
        except KeyboardInterrupt:
            if on_report is not None and report.interrupted:
                on_report(report)
            raise
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
