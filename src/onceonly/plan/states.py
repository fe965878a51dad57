"""One step of the plan per state of the record a call finds: each reads the record, decides, and writes.

Every step is a generator of actions (as the plan is) that leaves the record as it last saw it in
``Loop.rec`` and returns what the plan does next: ``True`` (this call holds the lease: run an
attempt, ``onceonly.plan.attempt``), ``False`` (look at the record again), or the call's ``Outcome``.
A step that ends the call raises. ``onceonly.plan.call`` picks the step by the record's state.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from onceonly import states as st
from onceonly.errors import StoreError
from onceonly.plan import approval
from onceonly.plan.actions import (
    NOT_FOUND,
    Action,
    Call,
    Claim,
    Get,
    Insert,
    Outcome,
    Probe,
    Running,
    Sleep,
    WaitChange,
    _outcome,
    encode_result,
    landed,
)
from onceonly.plan.similar import _claim_similar
from onceonly.plan.texts import (
    _all_unknown,
    _gave_up,
    _in_progress,
    _probe_failed,
    _reentered,
    _scheduled,
    _settled_by_review,
    _unsettled_until,
    _used_up,
)
from onceonly.plan.writes import _refused, _write
from onceonly.states import Record, State

#: What a step returns: the call's outcome, ``True`` (run an attempt) or ``False`` (look again).
Step = Outcome | bool


@dataclass(slots=True)  # not frozen: one per call, changed as the plan goes
class Loop:
    """What the plan of one call carries from one look at its record to the next."""

    call: Call
    #: The state a claim by this call writes: pending while the tool has not reported its dispatch.
    held_state: State
    #: When waiting on another caller's lease ends (the policy's ``wait`` from the call's start).
    deadline: float
    #: The record as this call last read or wrote it (``None``: there is none).
    rec: Record | None = None
    #: The next pause while another caller holds the record: 2 ms, doubling up to 100 ms.
    poll: float = 0.002
    #: The error of this call's last attempt, the cause of what the call ends with.
    last_exc: BaseException | None = None
    #: The version of the unknown record whose settle or backoff wait this call already did.
    waited_version: int | None = None
    #: The last holder asked about (``Running``): whether a wait is on another call, or on ours.
    asked: str | None = None
    #: Whether the record is another call's with other arguments, replayed (``on_conflict="replay"``).
    conflict: bool = False


def _new_record(loop: Loop, now: float) -> Record:
    call = loop.call
    if call.approve:
        return approval.first_request(call, now)
    return st.new_record(
        key=call.key, scope=call.scope, tool=call.tool, fingerprint=call.fingerprint,
        args_json=call.args_json, state=loop.held_state, owner=call.owner, now=now,
        lease_seconds=call.policy.lease,
    )  # fmt: skip


def first_claim(loop: Loop) -> Generator[Action, Any, bool]:
    """The call's first action: a claim, one round trip that either makes this call the holder of a new
    record or returns the existing one (a replay then costs exactly that one read). Returns whether this
    call holds the record."""
    call = loop.call
    first = _new_record(loop, call.clock())
    if call.similar is not None:
        loop.rec, claimed = yield from _claim_similar(call, first)  # call.key: the earlier call's, if taken for it
        if claimed and loop.rec is not None and loop.rec.state is State.AWAITING_APPROVAL:
            approval.asked(loop.rec)
        return claimed
    try:
        rec = yield Claim(first)
        claimed = rec is None
    except StoreError as exc:
        # Did the claim land before the store failed? Only the record can say: ours, someone
        # else's, or none at all (then the plan inserts it; we must not run without one).
        rec = yield Get(call.key)
        claimed = landed(first, rec)
        if rec is None:
            yield from _refused(call, exc, call.key)
    loop.rec = first if claimed else rec
    if claimed and call.approve:
        approval.asked(first)
    return claimed


def absent(loop: Loop, now: float) -> Generator[Action, Any, Step]:
    """No record holds the key (it was deleted, or an earlier write of it did not land): insert one."""
    call = loop.call
    new = _new_record(loop, now)
    try:
        inserted = yield Insert(new)
    except StoreError as exc:
        # Did the insert land before the store failed? Only the record can say.
        cur = yield Get(call.key)
        inserted = landed(new, cur)
        if cur is None:
            yield from _refused(call, exc, call.key)
    if not inserted:
        loop.rec = yield Get(call.key)
        return False
    call.refusals = 0
    loop.rec = new
    if call.approve:
        approval.asked(new)
    return True


def expired(loop: Loop, rec: Record, now: float) -> Generator[Action, Any, Step]:
    """A confirmed record past its ``ttl``: the key is claimed again, for a call of its own (an
    operation that needs approval asks for it anew)."""
    call = loop.call
    if approval.must_ask(call, rec, now):
        loop.rec = yield from approval.ask_again(call, rec, now)
        return False
    new = st.renew(
        rec,
        state=loop.held_state,
        owner=call.owner,
        now=now,
        lease_seconds=call.policy.lease,
        reason="expired record claimed again",
    )
    new = st.replace_args(new, fingerprint=call.fingerprint, args_json=call.args_json)
    ok, loop.rec = yield from _write(rec, new, call)
    return ok


def replay_other_args(loop: Loop, rec: Record, now: float) -> Generator[Action, Any, Step]:
    """A confirmed record made with other arguments, replayed to this call (``on_conflict="replay"``, or
    a similar call): this call's arguments are noted in the record's history first."""
    call = loop.call
    look = call.similar
    why = "other arguments" if look is None else f"a similar call (score {look.score:.2f})"
    noted = st.transition(
        rec, rec.state, now=now, reason=f"replayed for {why}: {call.args_json[:500]}", by=call.owner,
    )  # fmt: skip
    ok, cur = yield from _write(rec, noted, call)
    if not ok:
        loop.rec = cur
        return False
    return _outcome(rec, replayed=True, conflict=True)


def held(loop: Loop, rec: Record, now: float) -> Generator[Action, Any, Step]:
    """Another caller holds the record. While its lease lasts, wait for it; once the lease ran out, a
    record never dispatched is claimed again, and one that may have been becomes unknown."""
    if not rec.lease_expired(now):
        return (yield from _wait_for_holder(loop, rec, now))
    call = loop.call
    if rec.state is State.PENDING:
        # Nothing was sent: the holder died before dispatch. Safe to run again.
        if rec.attempts >= call.policy.retry.attempts:
            yield from _give_up(rec, call.owner, now, "attempts exhausted before dispatch", loop.last_exc)
        if st.approved_unclaimed(rec):  # a person approved it: this call runs it
            return (yield from _claim_again(loop, rec, now, "run as approved"))
        return (yield from _claim_again(loop, rec, now, f"lease of {rec.lease_owner} expired before dispatch"))
    # The holder may have sent it and died: the outcome is unknown now, and this
    # caller settles it rather than waiting on a dead holder.
    new = st.mark_unknown(rec, now=now, reason=f"lease of {rec.lease_owner} expired", by=call.owner)
    _, loop.rec = yield from _write(rec, new, call)
    return False


def _wait_for_holder(loop: Loop, rec: Record, now: float) -> Generator[Action, Any, Step]:
    """Wait for the record to change while its holder runs, up to the call's ``wait``; never on a call
    this one runs inside (it would wait on itself)."""
    call = loop.call
    if rec.lease_owner != loop.asked:
        loop.asked = rec.lease_owner
        if (yield Running(loop.asked)):
            raise _reentered(rec, call)
    if now >= loop.deadline:
        raise _in_progress(rec, call.key, now)
    pause = min(loop.poll, (rec.lease_until or now) - now, max(loop.deadline - now, 0.0)) + 0.0005
    loop.poll = min(loop.poll * 2, 0.1)
    yield WaitChange(call.key, rec.version, pause)
    loop.rec = yield Get(call.key)
    return False


def failed(loop: Loop, rec: Record, now: float) -> Generator[Action, Any, Step]:
    """A failed attempt: claim the record again once its next attempt is due, while attempts remain."""
    call = loop.call
    p = call.policy
    if rec.attempts >= p.retry.attempts:
        yield from _give_up(rec, call.owner, now, "attempts exhausted", loop.last_exc)
    if rec.next_attempt_at is not None and rec.next_attempt_at > now:
        if rec.next_attempt_at - now > p.wait:
            raise _scheduled(rec, rec.next_attempt_at, now, p.wait) from loop.last_exc
        yield Sleep(rec.next_attempt_at - now)
        loop.rec = yield Get(call.key)
        return False
    return (yield from _claim_again(loop, rec, now, "retry after failure"))


def abandoned(loop: Loop, rec: Record, now: float) -> Generator[Action, Any, Step]:
    """Attempts ran out. If none of them reached the other side, start afresh; else a person decides."""
    call = loop.call
    if st.may_have_happened(rec):
        raise _used_up(rec, call.key, loop.last_exc)
    new = st.restart(
        rec, state=loop.held_state, owner=call.owner, now=now, lease_seconds=call.policy.lease,
        reason="started afresh: none of the attempts before reached the other side",
    )  # fmt: skip
    if new.fingerprint != call.fingerprint:
        new = st.replace_args(new, fingerprint=call.fingerprint, args_json=call.args_json)
    ok, loop.rec = yield from _write(rec, new, call)
    return ok


# --- unknown: settled per the tool's on_unknown -------------------------------------------------


def unknown(loop: Loop, rec: Record, now: float) -> Generator[Action, Any, Step]:
    """The outcome of the record's last attempt is unknown: settle it per ``on_unknown`` (by review, by
    the probe, or by running it again: ``resend`` when the other side honours the key, ``retry`` when
    the tool is idempotent by nature)."""
    strategy = loop.call.policy.on_unknown
    if strategy == "review":
        return (yield from _by_review(loop, rec, now))
    if strategy == "probe":
        return (yield from _by_probe(loop, rec, now))
    return (yield from _by_running_again(loop, rec, now))


def _by_review(loop: Loop, rec: Record, now: float) -> Generator[Action, Any, Step]:
    call = loop.call
    parked = st.park(rec, now=now, reason="outcome unknown; on_unknown='review'", by=call.owner)
    ok, cur = yield from _write(rec, parked, call)
    if not ok:
        loop.rec = cur  # someone else moved it: look again
        return False
    raise _settled_by_review(rec, parked) from loop.last_exc


def _by_probe(loop: Loop, rec: Record, now: float) -> Generator[Action, Any, Step]:
    call = loop.call
    p = call.policy
    due = rec.updated_at + p.settle
    if loop.waited_version != rec.version and due > now:
        # Give the other side time to finish what it may still be doing before asking it.
        if due - now > p.wait:
            raise _unsettled_until(rec, "its probe", due, now, p.wait) from loop.last_exc
        return (yield from _pause(loop, rec, due - now))
    probed = yield Probe(rec)
    now = call.clock()
    if probed.error is not None:
        raise _probe_failed(rec, probed.error) from probed.error
    if probed.value is not NOT_FOUND:
        done = st.confirm(
            rec, result_json=encode_result(probed.value, rec.key), now=now, ttl=p.ttl, via="probe", by=call.owner
        )
        ok, cur = yield from _write(rec, done, call)
        if ok:
            return _outcome(done, replayed=True)
        loop.rec = cur
        return False
    # Not found: it did not happen. Run it again while attempts remain.
    if rec.attempts >= p.retry.attempts:
        gone = st.fail(rec, error="probe: not found", now=now, retry_at=None, ttl=p.ttl, by=call.owner)
        ok, cur = yield from _write(rec, gone, call)
        if not ok:
            loop.rec = cur
            return False
        yield from _give_up(gone, call.owner, now, "attempts exhausted; the probe found nothing", loop.last_exc)
    return (yield from _claim_again(loop, rec, now, "probe: not found"))


def _by_running_again(loop: Loop, rec: Record, now: float) -> Generator[Action, Any, Step]:
    call = loop.call
    p = call.policy
    strategy = p.on_unknown
    if rec.attempts >= p.retry.attempts:
        parked = st.park(
            rec, now=now, reason=f"attempts exhausted with the outcome unknown ({strategy})", by=call.owner
        )
        ok, cur = yield from _write(rec, parked, call)
        if not ok:
            loop.rec = cur
            return False
        raise _all_unknown(rec, parked) from loop.last_exc
    if loop.waited_version != rec.version:
        due = rec.updated_at + p.retry.backoff(rec.attempts, call.rng)
        if due > now:
            if due - now > p.wait:
                raise _unsettled_until(rec, f"its {strategy}", due, now, p.wait) from loop.last_exc
            return (yield from _pause(loop, rec, due - now))
    return (yield from _claim_again(loop, rec, now, f"{strategy} after unknown outcome"))


def _pause(loop: Loop, rec: Record, seconds: float) -> Generator[Action, Any, Step]:
    """Wait out the settle or backoff delay of the unknown ``rec``, then read it again (that version's
    wait is done: it is settled at once)."""
    yield Sleep(seconds)
    loop.waited_version = rec.version
    loop.rec = yield Get(loop.call.key)
    return False


# --- shared by the steps ------------------------------------------------------------------------


def _claim_again(loop: Loop, rec: Record, now: float, reason: str) -> Generator[Action, Any, Step]:
    """Take the lease on ``rec`` for this call's next attempt (``True``: it is ours)."""
    call = loop.call
    new = _reclaim(rec, call, loop.held_state, now, reason)
    ok, loop.rec = yield from _write(rec, new, call)
    return ok


def _reclaim(rec: Record, call: Call, state: State, now: float, reason: str) -> Record:
    new = st.claim_again(rec, state=state, owner=call.owner, now=now, lease_seconds=call.policy.lease, reason=reason)
    if new.fingerprint != call.fingerprint:
        new = st.replace_args(new, fingerprint=call.fingerprint, args_json=call.args_json)
    return new


def _give_up(
    rec: Record | None, owner: str, now: float, reason: str, last_exc: BaseException | None
) -> Generator[Action, Any, None]:
    """Move a failed (or never-dispatched) record to ``abandoned`` and raise ``AttemptsExhausted``."""
    if rec is not None and rec.state in (State.FAILED, State.PENDING):
        new = st.abandon(rec, now=now, reason=reason, by=owner)
        ok, cur = yield from _write(rec, new, None)
        rec = new if ok else cur
    assert rec is not None
    raise _gave_up(rec, last_exc) from last_exc
