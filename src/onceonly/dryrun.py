"""A dry run: guarded calls run nothing and write nothing; each says what it would have done.

``with ledger.dry_run() as seen:`` (or ``ONCEONLY_DRY_RUN=1`` when the ledger is opened) makes every
guarded call of that ledger, in that context, return a ``DryRun`` instead of running, after one read of
its record (``Store.get``): never a claim, never a write. ``seen`` lists what was asked (``DryRunLog``),
for tests and for previews a person approves before the real run.
"""

from __future__ import annotations

import contextvars
import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from onceonly.plan import Call, Outcome
from onceonly.states import HELD, Record, State, approval_of, approved_unclaimed, denial_of

__all__ = ["DRY_VIA", "DryRun", "DryRunEntry", "DryRunLog", "DryRuns", "Would", "dry_outcome", "would_do"]

#: ``Outcome.via`` of a call that a dry run did not run.
DRY_VIA = "dry_run"

#: What a call would have done, read from its record as it is now:
#: ``run`` (no record, or one that may run again), ``replay`` (confirmed: its result is returned),
#: ``conflict`` (a record of other arguments, refused with ``KeyConflict``), ``wait`` (a caller holds it),
#: ``settle`` (its outcome is unknown: settled by the tool's ``on_unknown``), ``refuse`` (parked for
#: review, its attempts used up, denied, or over its budget: ``budget=``), ``ask`` (it would wait for
#: a person's approval: ``approve=``) and ``paused`` (an operator paused it: ``onceonly.pause``).
Would = Literal["run", "replay", "conflict", "wait", "settle", "refuse", "ask", "paused"]


@dataclass(frozen=True, slots=True)
class DryRun:
    """What a guarded call returns in a dry run, in place of its result; ``str()`` of it is what a model
    reads ("not run: dry run ...").

    Attributes:
        tool: the tool's name.
        arguments: the call's arguments, as they would be recorded.
        key: the ledger key the call would use.
        would: what it would have done (``Would``).

    .. versionadded:: 0.1
    """

    tool: str
    arguments: Mapping[str, Any]
    key: str
    would: Would

    def __str__(self) -> str:
        would = "be paused" if self.would == "paused" else self.would
        return f"not run: dry run ({self.tool} would {would}; nothing was done or recorded)"


#: One entry of a ``DryRunLog``: the same fields as the call's ``DryRun``.
DryRunEntry = DryRun


class DryRunLog(list[DryRun]):
    """The calls a dry run saw, in the order they were made (a list of ``DryRun``).

    .. versionadded:: 0.1
    """

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def add(self, entry: DryRun) -> None:
        with self._lock:  # calls from several threads of one dry run
            self.append(entry)


@dataclass(eq=False)
class DryRuns:
    """The dry runs of one ledger: one for the whole ledger (``always``, from ``ONCEONLY_DRY_RUN``), and
    those entered with ``ledger.dry_run()`` in some context. The runtime holds it only while one is on,
    so a plain call pays one attribute read."""

    always: DryRunLog | None = None
    entered: int = 0
    here: contextvars.ContextVar[DryRunLog | None] = field(
        default_factory=lambda: contextvars.ContextVar("onceonly_dry_run", default=None)
    )

    def log_here(self) -> DryRunLog | None:
        """The log of the dry run this context is in, else ``None`` (the call runs)."""
        got = self.here.get()  # an empty log is falsy: compared with None, not by truth
        return got if got is not None else self.always


def would_do(call: Call, rec: Record | None) -> Would:
    """What ``call`` would do against ``rec`` (its record as it is now), without doing it."""
    if rec is None:
        return "ask" if call.approve else "run"
    now = call.clock()
    if rec.fingerprint != call.fingerprint and call.policy.on_conflict == "raise":
        return "conflict"
    state = rec.state
    if state is State.AWAITING_APPROVAL:
        return "ask"
    if state is State.CONFIRMED:
        return ("ask" if call.approve else "run") if rec.is_expired(now) else "replay"
    if state in HELD:
        if approved_unclaimed(rec):  # a person approved it: the next call runs it
            return "run"
        return "settle" if rec.lease_expired(now) else "wait"
    if state is State.UNKNOWN:
        return "settle"
    if state is State.FAILED:
        if denial_of(rec) is not None or rec.attempts >= call.policy.retry.attempts:
            return "refuse"
        return "ask" if call.approve and approval_of(rec) is None else "run"
    return "refuse"  # needs_review, abandoned: a person's turn


def dry_outcome(
    call: Call, rec: Record | None, log: DryRunLog, *, over_budget: bool = False, paused: bool = False
) -> Outcome:
    """The ``Outcome`` of a call a dry run did not run (its result is the ``DryRun``), listed in ``log``;
    ``over_budget``: its amount would take its budget past the limit, so a call that would run is refused;
    ``paused``: an operator's pause would refuse it."""
    would: Would = "paused" if paused else would_do(call, rec)
    seen = DryRun(
        call.tool, json.loads(call.args_json), call.key, "refuse" if over_budget and would == "run" else would
    )
    log.add(seen)
    return Outcome(result=seen, key=call.key, state=State.PENDING, replayed=False, attempts=0, via=DRY_VIA)
