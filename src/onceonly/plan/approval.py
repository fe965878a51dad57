"""The plan's side of approvals (``approve=``): asking a person once, and what a call finds meanwhile.

The request is a record in ``awaiting_approval`` (``states.ask_approval``), made by the claim's own
insert-if-absent, so racing first calls make one. A call that finds it raises ``ApprovalPending`` and
writes nothing. An approved record is ``pending`` with its lease run out: the plan's usual take-over
(``onceonly.plan.states.held``) runs it once. A denied one raises ``ApprovalDenied``. Where a new
operation would start on a record whose approval is spent, the record asks again.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from onceonly import states as st
from onceonly.plan.actions import Action, Call
from onceonly.plan.texts import _awaiting_approval, _denied
from onceonly.plan.writes import _write
from onceonly.states import Record, State


def first_request(call: Call, now: float) -> Record:
    """The record the first call of an operation that needs approval claims: awaiting approval."""
    return st.ask_approval(
        key=call.key, scope=call.scope, tool=call.tool, fingerprint=call.fingerprint, args_json=call.args_json,
        by=call.owner, now=now,
    )  # fmt: skip


def asked(rec: Record) -> None:
    """This call made the request ``rec`` (it claimed or inserted it): nothing runs until a person approves."""
    raise _awaiting_approval(rec)


def refuse(rec: Record, call: Call, conflict: bool) -> None:
    """Raise what a call that finds ``rec`` must not go past: awaiting approval, denied, or approved for
    other arguments (``conflict``: this call's are not the record's). Else return: the state decides."""
    if rec.state is State.AWAITING_APPROVAL:
        raise _awaiting_approval(rec)
    if rec.state is State.FAILED:
        denial = st.denial_of(rec)
        if denial is not None:
            raise _denied(rec, denial)
    elif conflict and rec.state is State.PENDING and st.approved_unclaimed(rec):
        raise _awaiting_approval(rec, other_args=True)


def must_ask(call: Call, rec: Record, now: float) -> bool:
    """Whether ``call`` would start a new operation on ``rec`` without a standing approval: a failed run
    (attempts left), an abandoned one that may start afresh, or an expired confirmed record."""
    if not call.approve:
        return False
    if rec.state is State.FAILED:
        starts = rec.attempts < call.policy.retry.attempts
    elif rec.state is State.ABANDONED:
        starts = not st.may_have_happened(rec)
    else:
        starts = rec.state is State.CONFIRMED and rec.is_expired(now)
    return starts and st.approval_of(rec) is None


def ask_again(call: Call, rec: Record, now: float) -> Generator[Action, Any, Record | None]:
    """``rec`` asks for a new approval for ``call``'s arguments; raises ``ApprovalPending`` once written.
    Returns the record as it now is when another call moved it first (look again)."""
    fresh = rec.state is not State.FAILED
    why = {
        State.FAILED: "approval asked again: the approved run failed",
        State.ABANDONED: "approval asked again: started afresh, none of the attempts reached the other side",
        State.CONFIRMED: "approval asked again: the confirmed record expired",
    }[rec.state]
    new = st.ask_again(
        rec, now=now, by=call.owner, fingerprint=call.fingerprint, args_json=call.args_json, reason=why, fresh=fresh
    )
    ok, cur = yield from _write(rec, new, call)
    if ok:
        raise _awaiting_approval(new)
    return cur


def needs_person(rec: Record | None, now: float, attempts: int) -> bool:
    """Whether a call that finds ``rec`` would start its operation anew with no approval standing: the
    moment a framework's own approval flow should ask a person. Not for a replay, a call another
    caller holds or approved, an outcome the ledger settles itself (unknown, in review), a denial or
    attempts used up: those calls are answered without anyone asked. ``attempts``: the tool's limit.

    .. versionadded:: 0.1
    """
    if rec is None:
        return True
    state = rec.state
    if state is State.AWAITING_APPROVAL:
        return True
    if state is State.CONFIRMED:
        return rec.is_expired(now)
    if state is State.FAILED:
        return st.denial_of(rec) is None and rec.attempts < attempts and st.approval_of(rec) is None
    if state is State.ABANDONED:
        return not st.may_have_happened(rec) and st.approval_of(rec) is None
    return False  # held, unknown, in review
