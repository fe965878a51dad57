"""The attempt: run the tool once while this call holds the record's lease, and record what came of it.

A result confirms the record (or, on a record that moved on meanwhile, is counted as a late outcome);
an error is classified (``onceonly.policy.classify``) and recorded as unknown, failed, or not done
and due again after a backoff. Control flow (a framework's interrupt) gives the claim back; an
interrupt records the attempt before it goes on up.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

from onceonly import states as st
from onceonly.errors import OutcomeUnknown, StoreError
from onceonly.plan.actions import (
    Action,
    Call,
    Execute,
    Executed,
    Get,
    Outcome,
    Sleep,
    Swap,
    _outcome,
    encode_result,
    log,
)
from onceonly.plan.states import Loop, Step, _give_up
from onceonly.plan.texts import _TIMED_OUT, _err_text, _scheduled
from onceonly.plan.writes import _write
from onceonly.policy import Classification, Classifier, Verdict, classify
from onceonly.states import HELD, Record, State


def attempt(loop: Loop) -> Generator[Action, Any, Step]:
    """This call holds the lease on ``loop.rec``: run one attempt. Returns its outcome, or ``False`` when
    it failed and may be tried again (look at the record again)."""
    call = loop.call
    p = call.policy
    rec = loop.rec
    assert rec is not None and rec.state in HELD and rec.lease_owner == call.owner
    now = call.clock()
    if rec.lease_until is not None and rec.lease_until - now < p.lease / 2:
        # The claim took long to land (a stalled store, a paused process): another caller may
        # already have taken the lease over as expired. Renew it first, and run only if the
        # record is still ours; a fast claim never pays this write.
        fresh = st.extend_lease(rec, now=now, lease_seconds=p.lease)
        ok, loop.rec = yield from _write(rec, fresh, call)
        if not ok:
            return False
        rec = fresh
    call.ran = True
    call.created_at = rec.created_at
    ran = yield Execute(rec)
    rec = ran.record or rec
    if ran.error is None and not ran.timed_out:
        return (yield from _settle_success(rec, call, ran.value))
    if ran.released:
        assert ran.error is not None
        yield from _release(rec, call, ran.error)
        raise ran.error
    if ran.interrupted:
        assert ran.error is not None
        yield from _interrupted(rec, call, ran.error)
        raise ran.error
    return (yield from _failed(loop, rec, ran))


def _failed(loop: Loop, rec: Record, ran: Executed) -> Generator[Action, Any, Step]:
    """The attempt raised or timed out: record it as its verdict says. Unknown (settled on the next
    look), a definite failure (re-raised), or not done (tried again after a backoff)."""
    call = loop.call
    now = call.clock()
    verdict, last_exc = _verdict(rec, ran, call.policy.classify)
    loop.last_exc = last_exc
    error = _err_text(last_exc)
    if verdict.verdict is Verdict.UNKNOWN:
        new = st.mark_unknown(rec, now=now, reason=verdict.reason or error, by=call.owner, error=error)
        _, loop.rec = yield from _write(rec, new, call)
        return False
    if verdict.verdict is Verdict.FAILED:
        new = st.fail(rec, error=error, now=now, retry_at=None, ttl=call.policy.ttl, by=call.owner)
        yield from _write(rec, new, call)
        raise last_exc
    return (yield from _not_done(loop, rec, now, verdict, error, last_exc))


def _verdict(rec: Record, ran: Executed, classifier: Classifier | None) -> tuple[Classification, BaseException]:
    """What the attempt's end says about its side effect, and the error the call ends with if it does."""
    if ran.timed_out:
        verdict = Classification(Verdict.UNKNOWN, None, f"{_TIMED_OUT} (it runs on; a late result counts)")
        return verdict, TimeoutError(verdict.reason)
    assert ran.error is not None
    verdict = classify(ran.error, classifier)
    if rec.state is State.PENDING and verdict.verdict is Verdict.UNKNOWN:
        # The tool said it had not dispatched yet: nothing can have happened.
        verdict = Classification(Verdict.NOT_SENT, None, f"{verdict.reason} before dispatch")
    return verdict, ran.error


def _not_done(
    loop: Loop, rec: Record, now: float, verdict: Classification, error: str, last_exc: BaseException
) -> Generator[Action, Any, Step]:
    """Not sent, or refused before execution: safe to try again after a backoff, while attempts last.
    Either way the attempt cannot have had an effect (effect=False): see st.may_have_happened."""
    call = loop.call
    p = call.policy
    if rec.attempts >= p.retry.attempts:
        failed = st.fail(rec, error=error, now=now, retry_at=None, ttl=p.ttl, by=call.owner, effect=False)
        ok, cur = yield from _write(rec, failed, call)
        if ok:
            yield from _give_up(failed, call.owner, now, f"attempts exhausted: {error}", last_exc)
        loop.rec = cur
        return False
    # The classification keeps a Retry-After within [0, MAX_RETRY_AFTER], so the due time is finite.
    wait = p.retry.backoff(rec.attempts, call.rng, floor=verdict.retry_after)
    new = st.fail(rec, error=error, now=now, retry_at=now + wait, ttl=p.ttl, by=call.owner, effect=False)
    ok, loop.rec = yield from _write(rec, new, call)
    if ok:
        if wait > p.wait:  # the due time is recorded; a later call (or this one's caller) takes it up
            raise _scheduled(new, now + wait, now, p.wait) from last_exc
        yield Sleep(wait)
        loop.rec = yield Get(call.key)
    return False


def _settle_success(rec: Record, call: Call, value: Any) -> Generator[Action, Any, Outcome]:
    """Record the result of our attempt. A record that moved on meanwhile takes it as a late outcome."""
    result_json = encode_result(value, rec.key)
    now = call.clock()
    new = st.confirm(rec, result_json=result_json, now=now, ttl=call.policy.ttl, via="run", by=call.owner)
    try:
        ok, cur = yield from _write(rec, new, call)
        if ok:
            return _outcome(new, replayed=False, value=value, use_value=True)
        while cur is not None:
            # Someone changed the record under us (our lease expired and a waiter marked it unknown, a
            # probe confirmed it…). The side effect did happen: hand it to the late-outcome rule.
            new = st.late_success(
                cur, fence=rec.fence, result_json=result_json, now=call.clock(), ttl=call.policy.ttl, by=call.owner,
                created_at=rec.created_at,
            )  # fmt: skip
            if new is cur:
                return _outcome(cur, replayed=True)
            ok, again = yield from _write(cur, new, call)
            if ok:
                if new.state is not State.CONFIRMED:
                    # Counted beside another caller's live attempt (the record was lost and made again):
                    # there is no recorded result yet, and this call's tool did return one.
                    return _outcome(new, replayed=False, value=value, use_value=True)
                mine = new.result_json == result_json
                return _outcome(new, replayed=not mine, value=value, use_value=mine)
            cur = again
    except StoreError:
        # The side effect happened and the store will not take its result: keep it where a person
        # settling the record by hand can find it.
        log.exception("onceonly %s: the tool ran and returned %s; the ledger could not record it", rec.key, result_json)
        raise
    raise OutcomeUnknown(
        f"the tool ran (key {rec.key!r}) but its record was deleted before the result was written; "
        "the side effect happened: check it before calling again",
        key=rec.key,
        record=None,
    )


def _release(rec: Record, call: Call, exc: BaseException) -> Generator[Action, Any, None]:
    """The tool stopped for control flow (a framework's interrupt or redirect): give the claim back
    without counting the attempt, so that the resumed call runs the body again. The record reads as
    failed (nothing settled) with one attempt fewer; a record that moved on meanwhile is left as it is."""
    now = call.clock()
    new = st.transition(
        rec, State.FAILED, now=now, reason=f"{st.RELEASED} {type(exc).__name__} is control flow, not an outcome",
        by=call.owner, attempts=max(rec.attempts - 1, 0), error=None, lease_owner=None, lease_until=None,
        next_attempt_at=None, expires_at=None if call.policy.ttl is None else now + call.policy.ttl,
    )  # fmt: skip
    yield from _write(rec, new, call)


def _interrupted(rec: Record, call: Call, exc: BaseException) -> Generator[Action, Any, None]:
    """An interrupt stopped the call while its tool ran (``KeyboardInterrupt``, ``SystemExit``, a cancelled
    async caller): record the attempt now rather than leave the lease to run out. Unknown (the
    interruption may have come after the send), or failed as not sent when the tool had not reported its
    dispatch. One write, best effort: the interrupt goes on up whatever the store answers, and a record
    that moved on meanwhile (a late result landed) is left as it is."""
    now = call.clock()
    why = f"interrupted by {type(exc).__name__} while the tool ran"
    if rec.state is State.PENDING:
        new = st.fail(
            rec, error=f"{why}, before its dispatch", now=now, retry_at=None, ttl=call.policy.ttl, by=call.owner,
            effect=False,
        )  # fmt: skip
    else:
        new = st.mark_unknown(rec, now=now, reason=why, by=call.owner, error=_err_text(exc))
    with contextlib.suppress(StoreError):
        yield Swap(new, rec)
