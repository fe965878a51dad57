"""``plan()``: one guarded call's decisions, a loop that looks at the record and takes the step its state asks.

The steps are in ``onceonly.plan.states`` (what a call does with the record it finds) and
``onceonly.plan.attempt`` (running the tool while holding the lease).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from onceonly.plan import approval
from onceonly.plan.actions import Action, Call, Outcome, Plan, _outcome
from onceonly.plan.attempt import attempt
from onceonly.plan.states import (
    Loop,
    Step,
    abandoned,
    absent,
    expired,
    failed,
    first_claim,
    held,
    replay_other_args,
    unknown,
)
from onceonly.plan.texts import _awaiting_review, _conflict
from onceonly.states import HELD, Record, State

__all__ = ["plan"]


def plan(call: Call) -> Plan:
    """Decide one guarded call. Yields actions; returns an ``Outcome`` or raises.

    .. versionadded:: 0.1
    """
    p = call.policy
    loop = Loop(call, State.PENDING if p.reports_dispatch else State.IN_FLIGHT, call.clock() + p.wait)
    claimed = yield from first_claim(loop)
    while True:
        now = call.clock()
        rec = loop.rec
        step: Step
        if claimed:
            claimed = False
            step = True
        elif rec is None:
            step = yield from absent(loop, now)
        elif rec.state is State.CONFIRMED and rec.is_expired(now):
            step = yield from expired(loop, rec, now)
        else:
            step = yield from _existing(loop, rec, now)
        if step is True:  # this call holds the lease on loop.rec: run one attempt
            step = yield from attempt(loop)
        if isinstance(step, Outcome):
            return step


def _existing(loop: Loop, rec: Record, now: float) -> Generator[Action, Any, Step]:
    """A record holds the key: is it this operation (the same arguments)? Then its state decides."""
    call = loop.call
    if rec.fingerprint != call.fingerprint:
        if call.policy.on_conflict == "raise":
            raise _conflict(rec, call.key, call.fingerprint)
        loop.conflict = True
        if rec.state is State.CONFIRMED:
            return (yield from replay_other_args(loop, rec, now))
    state = rec.state
    if state is State.CONFIRMED:
        return _outcome(rec, replayed=True, conflict=loop.conflict)
    if state is not State.IN_FLIGHT:  # approve=: awaiting, denied, approved for other arguments
        approval.refuse(rec, call, loop.conflict)
        if approval.must_ask(call, rec, now):
            loop.rec = yield from approval.ask_again(call, rec, now)
            return False
    if state in HELD:
        return (yield from held(loop, rec, now))
    if state is State.UNKNOWN:
        return (yield from unknown(loop, rec, now))
    if state is State.FAILED:
        return (yield from failed(loop, rec, now))
    if state is State.NEEDS_REVIEW:
        raise _awaiting_review(rec, call.key) from loop.last_exc
    return (yield from abandoned(loop, rec, now))
