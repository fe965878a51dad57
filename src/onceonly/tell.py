"""What a model reads about a guarded call: short text for a replay, an unknown, and the other errors.

An agent that is handed a replayed result as if the tool had just run, or a stack trace, or an
operator's instruction (``onceonly resolve …``), tends to issue the call again. These texts say what
happened and what not to do, in a line or two. Operator instructions stay in the exceptions and logs.
Pure: no I/O.
"""

from __future__ import annotations

import datetime as _dt
import json
from typing import Any

from onceonly.dryrun import DRY_VIA
from onceonly.errors import (
    ApprovalDenied,
    ApprovalPending,
    AttemptsExhausted,
    BudgetExceeded,
    InProgress,
    KeyConflict,
    OnceOnlyError,
    OutcomeUnknown,
    Paused,
    Refused,
    RetryScheduled,
    SimilarCall,
)
from onceonly.keys import canonical_json
from onceonly.plan import Outcome
from onceonly.states import Record, State

__all__ = ["TOLD", "result_text", "tell_model"]

#: The errors an integration turns into text for the model (``tell_model``) instead of raising: outcomes
#: of the operation, not faults of the program.
TOLD: tuple[type[OnceOnlyError], ...] = (
    OutcomeUnknown, InProgress, KeyConflict, AttemptsExhausted, SimilarCall, ApprovalPending, Refused
)  # fmt: skip

#: The longest result a model is shown in these texts; longer ones are cut, with a note.
MAX_RESULT_CHARS = 2000


def _when(at: float | None) -> str:
    if at is None:
        return "earlier"
    return "at " + _dt.datetime.fromtimestamp(at, _dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def result_text(value: Any) -> str:
    """A result as a model reads it: a string as is, anything else as JSON (cut at ``MAX_RESULT_CHARS``)."""
    if isinstance(value, str):
        text = value
    else:
        try:
            text = canonical_json(value, path="result")
        except Exception:  # a result with no JSON form: its repr is all there is
            text = repr(value)
    if len(text) > MAX_RESULT_CHARS:
        text = text[:MAX_RESULT_CHARS] + f"… ({len(text) - MAX_RESULT_CHARS} more characters)"
    return text


def _recorded(rec: Record | None) -> str | None:
    """The result a record holds, as text, or None when it holds none."""
    if rec is None or rec.result_json is None or rec.state is not State.CONFIRMED:
        return None
    return result_text(json.loads(rec.result_json))


def _earlier(args: dict[str, Any] | None) -> str:
    """What an earlier similar call asked for, as the model reads it: its arguments as JSON, cut."""
    if not args:
        return ""
    return f" (the earlier action: {result_text(args)})"


def _similar_done(settled_at: float | None, args: dict[str, Any] | None, result: str | None) -> str:
    done = f"Its result: {result}" if result is not None else "It is not finished yet or its outcome is not known."
    return (
        f"A similar action was already done {_when(settled_at)}{_earlier(args)}, so this one was not done again "
        f"(if this is really a different action, it needs clearly different details). {done}"
    )


def tell_model(what: Outcome | BaseException) -> str:
    """The text a model should read for a guarded call's outcome or error.

    - a replayed ``Outcome``: the action was already done (when), it was not repeated, and its result;
    - a fresh ``Outcome``: its result, as text;
    - ``OutcomeUnknown``: the outcome is being checked, do not issue it again;
    - ``RetryScheduled``: it has not happened; it may be issued again after the time given;
    - ``InProgress``: another call is doing it now;
    - ``KeyConflict``: done earlier with other details, and that result;
    - an ``Outcome`` with ``similar_to``, or ``SimilarCall``: a similar action was done, what it was, and
      its result;
    - ``AttemptsExhausted``: it failed and will not be retried automatically;
    - ``ApprovalPending``: it waits for a person's approval, do not issue it again;
    - ``Paused``, ``BudgetExceeded``, ``ApprovalDenied``: it was not done, and why in a few words (never
      the operator's own reason text);
    - any other exception: its type and message.

    Integrations (``onceonly.langchain``…) use it for what the model reads. It never contains an operator
    instruction such as ``onceonly resolve``: those are in the exception and the log.

    .. versionadded:: 0.1
    """
    if isinstance(what, Outcome):
        if what.similar_to is not None and what.replayed:
            return _similar_done(what.settled_at, what.similar_args, result_text(what.result))
        if not what.replayed:
            return str(what.result) if what.via == DRY_VIA else result_text(what.result)
        if what.conflict:
            return (
                f"This action was already done {_when(what.settled_at)} with other details, and was not repeated. "
                f"Result of the earlier action: {result_text(what.result)}"
            )
        return (
            f"This action was already done {_when(what.settled_at)} and was not repeated. "
            f"Its result: {result_text(what.result)}"
        )
    if isinstance(what, SimilarCall):
        rec = what.record
        return _similar_done(None if rec is None else rec.updated_at, None if rec is None else rec.args, _recorded(rec))
    if isinstance(what, OutcomeUnknown):
        return (
            "The outcome of this action is unknown: it may have happened, and it is being checked. "
            "Do not issue it again. Go on with other work, or tell the user it is pending confirmation."
        )
    if isinstance(what, RetryScheduled):
        # Before InProgress (its base): nobody is running it, so "its result will be recorded" is false.
        return (
            f"This action has not happened: the service asked to wait, and it may run {_when(what.retry_at)}. "
            "Issuing it again after that time runs it once; before then it will not run."
        )
    if isinstance(what, InProgress):
        return (
            "This action is already in progress in another call. Do not issue it again; "
            "its result will be recorded when it finishes."
        )
    if isinstance(what, KeyConflict):
        earlier = _recorded(what.record)
        done = (
            f"Result of the earlier action: {earlier}"
            if earlier is not None
            else "The earlier action is not finished or its outcome is not known yet."
        )
        return (
            "An action for the same operation was already issued with other details, and was not repeated. "
            f"{done} If this is really a different action, it needs different identifying details."
        )
    if isinstance(what, AttemptsExhausted):
        cause = what.last_exception
        error = f"{type(cause).__name__}: {cause}" if cause is not None else (what.record and what.record.error)
        why = f" The last error: {error}." if error else ""
        return (
            f"This action failed and will not be retried automatically.{why} Do not issue it again; "
            "tell the user it could not be done."
        )
    if isinstance(what, ApprovalPending):
        return (
            "This action is waiting for a person's approval and has not been done. Do not issue it again; "
            "tell the user it awaits approval."
        )
    if isinstance(what, Refused):
        return _refused(what)
    if isinstance(what, OnceOnlyError):
        return f"This action could not be completed ({type(what).__name__}). Do not issue it again for now."
    return f"Error: {type(what).__name__}: {what}"


def _amount(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _refused(what: Refused) -> str:
    """What a model reads for a call a guardrail refused: what stopped it, never the operator's reason."""
    if isinstance(what, Paused):
        return (
            "This action was not done: actions like it are paused by an operator for now. Do not issue it "
            "again; tell the user it is paused."
        )
    if isinstance(what, BudgetExceeded):
        return (
            f"This action was not done: it would exceed its limit ({_amount(what.used)} of {_amount(what.limit)} "
            f"used in this period; this action needs {_amount(what.amount)}). Do not issue it again before "
            f"{_when(what.resets_at)[3:]}; tell the user it is over the limit."
        )
    if isinstance(what, ApprovalDenied):
        return "This action was not done: a person denied it. Do not issue it again; tell the user it was denied."
    return "This action was not done: it was refused. Do not issue it again; tell the user."
