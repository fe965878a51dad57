"""The texts of the plan's errors: what went wrong, on which key and in which state, and what to do next.

Each names the record (key, state, attempt) and the next step a person or a model can take. Pure.
"""

from __future__ import annotations

import contextlib
import datetime
from typing import TYPE_CHECKING

from onceonly import states as st
from onceonly.errors import (
    ApprovalDenied,
    ApprovalPending,
    AttemptsExhausted,
    InProgress,
    KeyConflict,
    OutcomeUnknown,
    ReentrantCall,
    RetryScheduled,
    StoreCorrupt,
)
from onceonly.states import Record, State

if TYPE_CHECKING:
    from onceonly.plan.actions import Call


def _err_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


#: How the plan's reason for a timed-out attempt begins.
_TIMED_OUT = "attempt timed out"


def _message(rec: Record, what: str, nxt: str) -> str:
    return f"{what} (key {rec.key!r}, state {rec.state.value}, attempt {rec.attempts}): {nxt}"


def _cause(rec: Record) -> str:
    """Why the outcome of ``rec`` is unknown, for a message: `` because …`` from the reason recorded when
    the record became unknown, or ``""`` when its history has none."""
    with contextlib.suppress(StoreCorrupt):  # a damaged history: the message does without it
        for entry in reversed(rec.history):
            if entry.get("to") == State.UNKNOWN.value:
                reason = str(entry.get("reason") or "")
                return f" because {_cause_of(reason, rec.error)}" if reason else ""
    return ""


def _cause_of(reason: str, error: str | None) -> str:
    """A reason the guard or the reconciler records on the way to unknown, as the cause a reader needs."""
    if reason.startswith("lease of ") and reason.endswith(" expired"):
        holder = reason[len("lease of ") : -len(" expired")]
        return (
            f"the lease of {holder} ran out before it recorded an outcome (that caller was stopped, killed or "
            "cut off from the store while its tool ran)"
        )
    if reason.startswith(_TIMED_OUT):
        return "the attempt timed out (it runs on, and a late result still counts)"
    if reason.startswith("interrupted "):
        return f"the attempt was {reason}"
    if reason.startswith("HTTP 5"):
        return f"of an upstream error (the other side answered {reason.partition(' in ')[0]}, and may have acted first)"
    if error and error.startswith(reason):  # classified by the error's type: no answer said what happened
        return f"its answer was lost (the attempt ended with {error[:300]}, after the request may have left)"
    return f"of {reason}"


def _when(at: float) -> str:
    """A time for a message: ISO 8601 in UTC, to the second."""
    try:
        return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, OSError, ValueError):  # beyond what datetime can show
        return f"{at:.0f} (seconds since the epoch)"


def _due(what: str, due: float, now: float, wait: float) -> str:
    return f"{what} is due at {_when(due)} (in {due - now:.0f} s), later than this call waits (wait={wait:g} s)"


def _scheduled(rec: Record, due: float, now: float, wait: float) -> RetryScheduled:
    """The call ends here: the next attempt of ``rec`` is due after this call's ``wait``."""
    return RetryScheduled(
        _message(
            rec,
            _due("the next attempt of this operation", due, now, wait),
            f"nothing ran now; call again after that time (the last attempt: {rec.error or 'no error recorded'})",
        ),
        key=rec.key,
        record=rec,
        retry_at=due,
    )


def _unsettled_until(rec: Record, what: str, due: float, now: float, wait: float) -> OutcomeUnknown:
    """The call ends here: settling ``rec`` (a probe, a re-send) is due after this call's ``wait``."""
    return OutcomeUnknown(
        _message(
            rec,
            f"the outcome is unknown{_cause(rec)}, and {_due(what, due, now, wait)}",
            "do not run it again: a call after that time settles it, or the reconciler (onceonly reconcile) does",
        ),
        key=rec.key,
        record=rec,
    )


# --- the errors a look at the record ends with -----------------------------------------------------


def _conflict(rec: Record, key: str, fingerprint: str) -> KeyConflict:
    """The key of this call was used before with other arguments, and its tool raises on that."""
    return KeyConflict(
        _message(
            rec,
            "this key was used before with other arguments",
            "the earlier arguments are in the record's args; if the new call is a "
            "different operation, give it another key or occurrence; if it is the same "
            "operation re-worded, use on_conflict='replay' or a normaliser",
        ),
        key=key,
        record=rec,
        fingerprint=fingerprint,
    )


def _in_progress(rec: Record, key: str, now: float) -> InProgress:
    """Another caller holds the record for the whole of this call's ``wait``."""
    return InProgress(
        _message(
            rec,
            f"another caller ({rec.lease_owner}) is running this operation",
            f"its lease runs {max(0.0, (rec.lease_until or now) - now):.1f}s more; call "
            "again later to get its result (it will not run twice)",
        ),
        key=key,
        record=rec,
    )


def _resolve_hint(key: str) -> str:
    """The operator's next step for an outcome only a person can settle."""
    return f"check whether it happened, then: onceonly resolve '{key}' --confirmed JSON | --failed REASON"


def _reentered(rec: Record, call: Call) -> ReentrantCall:
    """``call`` met the claim of a call it runs inside: it would wait on itself."""
    return ReentrantCall(
        _message(
            rec,
            f"{call.tool!r} was called again with the same key inside its own running call (a tool that calls "
            "itself, or calls a tool that calls it back)",
            "this inner call was refused at once and ran nothing: give it a key of its own (other arguments, "
            "or tool.using(occurrence=2)), or call the function it guards directly",
        ),
        key=rec.key,
        record=rec,
    )


def _awaiting_review(rec: Record, key: str) -> OutcomeUnknown:
    """The record is parked for a person (``needs_review``)."""
    return OutcomeUnknown(
        _message(
            rec,
            f"this operation is waiting for a person to settle it: its outcome is unknown{_cause(rec)}",
            _resolve_hint(key),
        ),
        key=key,
        record=rec,
    )


def _used_up(rec: Record, key: str, last_exc: BaseException | None) -> AttemptsExhausted:
    """The record is abandoned after an attempt that may have had an effect: a person decides."""
    return AttemptsExhausted(
        _message(
            rec,
            "this operation used all its attempts",
            f"fix the cause ({rec.error or 'see the history'}), then reset it: "
            f"onceonly resolve '{key}' --failed REASON --reset",
        ),
        key=key,
        record=rec,
        last_exception=last_exc,
    )


def _gave_up(rec: Record, last_exc: BaseException | None) -> AttemptsExhausted:
    """This call moved ``rec`` to abandoned: its attempts ran out."""
    # This call may have no exception of its own (the attempts ran out in earlier calls): the record has it.
    last = _err_text(last_exc) if last_exc is not None else rec.error or "not recorded"
    if st.may_have_happened(rec):
        reset = f"onceonly resolve '{rec.key}' --failed REASON --reset"
        nxt = f"the last error was {last}; fix the cause, then reset it: {reset}"
    else:
        nxt = (
            f"none of them reached the other side (the last error was {last}), so nothing happened: fix the "
            "cause, and a later call starts afresh with a new attempt budget"
        )
    return AttemptsExhausted(
        _message(rec, f"gave up after {rec.attempts} attempts", nxt),
        key=rec.key,
        record=rec,
        last_exception=last_exc,
    )


# --- the errors settling an unknown ends with ------------------------------------------------------


def _settled_by_review(rec: Record, parked: Record) -> OutcomeUnknown:
    """``rec`` is unknown and its tool settles unknowns by review: ``parked`` waits for a person."""
    return OutcomeUnknown(
        _message(
            parked,
            f"the outcome is unknown{_cause(rec)}, and this tool settles unknowns by review",
            _resolve_hint(rec.key),
        ),
        key=rec.key,
        record=parked,
    )


def _probe_failed(rec: Record, error: BaseException) -> OutcomeUnknown:
    """The probe that was to settle ``rec`` raised ``error``."""
    return OutcomeUnknown(
        _message(
            rec,
            f"the outcome is unknown{_cause(rec)}, and the probe failed ({_err_text(error)})",
            "the record stays unknown; the reconciler (onceonly reconcile) will probe it again",
        ),
        key=rec.key,
        record=rec,
    )


def _all_unknown(rec: Record, parked: Record) -> OutcomeUnknown:
    """Every attempt of ``rec`` ended unknown (resend, retry): ``parked`` waits for a person."""
    return OutcomeUnknown(
        _message(
            parked,
            f"all attempts ended with an unknown outcome, the last{_cause(rec)}",
            _resolve_hint(rec.key),
        ),
        key=rec.key,
        record=parked,
    )


# --- the errors of a tool with approve= ------------------------------------------------------------


def _awaiting_approval(rec: Record, other_args: bool = False) -> ApprovalPending:
    """``rec`` awaits a person's approval (or was approved for other arguments): nothing ran."""
    asked = st.asked_at(rec)
    when = f" since {_when(asked)}" if asked is not None else ""
    if other_args:
        what = "this key's operation was approved for other arguments, and waits for its own call to run it"
    else:
        what = f"this operation waits for a person's approval{when}; nothing ran"
    return ApprovalPending(
        _message(
            rec,
            what,
            f"a person approves it (onceonly approve '{rec.key}' --by NAME [--reason TEXT]) or denies it "
            f"(onceonly deny '{rec.key}' --by NAME); the next call after an approval runs it once. Calling "
            "again before that asks no one twice",
        ),
        key=rec.key,
        record=rec,
        asked_at=asked,
    )


def _denied(rec: Record, entry: dict[str, object]) -> ApprovalDenied:
    """A person denied the operation of ``rec`` (``entry``: the denial in its history)."""
    by = str(entry.get(st.DENIED_BY) or "someone")
    reason = entry.get("reason")
    why = f" ({reason})" if isinstance(reason, str) and reason else ""
    at = entry.get("at")
    when = _when(at if isinstance(at, int | float) else rec.updated_at)
    return ApprovalDenied(
        _message(
            rec,
            f"{by} denied this operation{why} at {when}; it did not run",
            "it will not run with these arguments; a call with other arguments asks for its own approval",
        ),
        key=rec.key,
        record=rec,
        by=by,
        reason=reason if isinstance(reason, str) and reason else None,
    )
