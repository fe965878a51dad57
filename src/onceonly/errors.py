"""The error tree. Every error onceonly raises is an ``OnceOnlyError``.

    OnceOnlyError
    ├── InProgress             another caller holds the operation; its outcome is not known yet
    │   └── RetryScheduled     its next attempt is due later than the call may wait
    ├── OutcomeUnknown         the operation may have happened; a probe or a person must settle it
    ├── KeyConflict            the same key was used with other arguments
    ├── SimilarCall            a call much like this one was made earlier (on_similar="raise")
    ├── AttemptsExhausted      the persisted attempt limit was reached
    ├── ReentrantCall          the operation was called again inside its own running call
    ├── ApprovalPending        the operation waits for a person's approval; it has not run
    ├── Refused                a guardrail stopped the call before it ran; no attempt was recorded
    │   ├── Paused             an operator paused calls like this one (onceonly pause)
    │   ├── BudgetExceeded     its amount would take its budget's window past the limit
    │   └── ApprovalDenied     a person denied the operation
    ├── InvalidKey             a key, scope or tool name that cannot be stored (also ValueError)
    ├── NotSerializable        an argument or result that has no canonical JSON form (also TypeError)
    └── StoreError             the ledger's store failed (infrastructure, not an outcome)
        ├── StoreUnavailable   the store could not be reached; what was written is unknown
        └── StoreCorrupt       the store's data is not an onceonly ledger, or is damaged

The first four are outcomes a caller must handle; ``StoreError`` is infrastructure. A tool's own
exception for a definite failure is re-raised unchanged, never wrapped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from onceonly.states import Record

__all__ = [
    "ApprovalDenied",
    "ApprovalPending",
    "AttemptsExhausted",
    "BudgetExceeded",
    "InProgress",
    "InvalidKey",
    "KeyConflict",
    "NotSerializable",
    "OnceOnlyError",
    "OutcomeUnknown",
    "Paused",
    "ReentrantCall",
    "Refused",
    "RetryScheduled",
    "SimilarCall",
    "StoreCorrupt",
    "StoreError",
    "StoreUnavailable",
    "outcome_label",
]


def _rebuild(cls: type[OnceOnlyError], args: tuple[Any, ...], state: dict[str, Any]) -> OnceOnlyError:
    """Unpickle an error without calling its ``__init__`` (whose keyword-only fields pickle cannot pass)."""
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class OnceOnlyError(Exception):
    """Root of every onceonly error.

    Every one pickles with its message and attributes: durable engines (DBOS), task queues (Celery),
    ``multiprocessing`` and Ray carry a failed step's exception to another process.

    .. versionadded:: 0.1
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, self.__dict__))


class _RecordError(OnceOnlyError):
    """An outcome error about one ledger record; carries the record as it was read."""

    def __init__(self, message: str, *, key: str, record: Record | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.record = record

    @property
    def state(self) -> str | None:
        return self.record.state.value if self.record is not None else None


class InProgress(_RecordError):
    """Another caller holds the lease on this key and did not finish within ``wait`` seconds.

    .. versionadded:: 0.1
    """


class RetryScheduled(InProgress):
    """The operation's next attempt is due later than this call may wait (its ``wait=``): the call ends
    without running it. Nothing ran now; a call after ``retry_at`` runs it (the attempt limit still holds).

    An ``InProgress`` because what a caller should do is the same: call again later, and the operation
    will not run twice. Raised when a backoff or a ``Retry-After`` (at most a day, see
    ``policy.MAX_RETRY_AFTER``) ends after ``wait`` seconds.

    Attributes:
        retry_at: when the next attempt may run, in seconds since the epoch (the ledger's clock).

    .. versionadded:: 0.1
    """

    def __init__(self, message: str, *, key: str, record: Record | None = None, retry_at: float) -> None:
        super().__init__(message, key=key, record=record)
        self.retry_at = retry_at


class OutcomeUnknown(_RecordError):
    """The operation may or may not have happened and could not be settled automatically.

    The record is ``unknown`` (a probe failed; the reconciler will retry) or ``needs_review``
    (parked for a person: ``onceonly resolve KEY --confirmed JSON | --failed REASON``).

    .. versionadded:: 0.1
    """


class KeyConflict(_RecordError):
    """The key matches an earlier call whose other arguments differ.

    Attributes:
        fingerprint: the fingerprint of the arguments of this call.
        conflicting_record: the earlier record (the same as ``record``).

    .. versionadded:: 0.1
    """

    def __init__(self, message: str, *, key: str, record: Record | None, fingerprint: str) -> None:
        super().__init__(message, key=key, record=record)
        self.fingerprint = fingerprint
        self.conflicting_record = record


class SimilarCall(_RecordError):
    """A call much like this one was made earlier in its group (``on_similar="raise"``): this one did
    not run. ``key`` and ``record`` are the earlier call's.

    Attributes:
        outcome: the earlier call's ``Outcome`` (its result when it is confirmed; ``None`` when its
            record could not be read).
        score: how similar the two calls are, 0..1.
        new_key: the key this call would have had.

    .. versionadded:: 0.1
    """

    def __init__(
        self, message: str, *, key: str, record: Record | None, outcome: Any, score: float, new_key: str
    ) -> None:
        super().__init__(message, key=key, record=record)
        self.outcome = outcome
        self.score = score
        self.new_key = new_key


class AttemptsExhausted(_RecordError):
    """The persisted attempt limit for this key was reached without a definite outcome.

    Attributes:
        last_exception: the exception of the last attempt, when this caller saw it.

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        message: str,
        *,
        key: str,
        record: Record | None = None,
        last_exception: BaseException | None = None,
    ) -> None:
        super().__init__(message, key=key, record=record)
        self.last_exception = last_exception


class ReentrantCall(_RecordError):
    """A guarded call made inside the running call of the same operation (a tool that calls itself, or
    calls a tool that calls it back, with the same key): it would wait on its own claim until ``wait``
    ran out. Refused at once; this call ran nothing. ``key`` and ``record`` are the running call's.

    A fault of the program, not an outcome: give the inner call a key of its own (other arguments, or
    ``tool.using(occurrence=2)``), or call the function it guards directly.

    .. versionadded:: 0.1
    """


class ApprovalPending(_RecordError):
    """The operation needs a person's approval (``@ledger.tool(approve=...)``) and has none yet: it did
    not run. The request is recorded once, bound to the key and the arguments' fingerprint; calls made
    while it waits raise this again and ask no one twice. After ``onceonly approve KEY``, the next call
    runs it exactly once.

    Attributes:
        asked_at: when the approval was first asked for (the ledger's clock), when known.

    .. versionadded:: 0.1
    """

    def __init__(self, message: str, *, key: str, record: Record | None = None, asked_at: float | None = None) -> None:
        super().__init__(message, key=key, record=record)
        self.asked_at = asked_at


class Refused(_RecordError):
    """A guardrail stopped this call before it ran: nothing was sent and no attempt was recorded. The
    subclass says which (``Paused``, ``BudgetExceeded``, ``ApprovalDenied``).

    .. versionadded:: 0.1
    """


class Paused(Refused):
    """An operator paused guarded calls that match this one (``onceonly pause``, ``ledger.pause()``):
    it was refused before it claimed anything. Calls already running when the pause was set finish as usual.

    Attributes:
        reason: the reason the operator gave (for logs and people, never for a model).
        tool: the paused tool, or None when the pause covers every tool.
        scope: the paused scope, or None when it covers every scope.

    .. versionadded:: 0.1
    """

    def __init__(
        self, message: str, *, key: str, reason: str, tool: str | None = None, scope: str | None = None
    ) -> None:
        super().__init__(message, key=key, record=None)
        self.reason = reason
        self.tool = tool
        self.scope = scope


class BudgetExceeded(Refused):
    """The call's amount would take its budget's current window past the limit (``budget=``): refused
    before it ran. The window's total counts confirmed, running, unknown and review-parked calls.

    Attributes:
        budget: the budget's name.
        limit: the window's limit.
        used: what the window holds already.
        amount: this call's amount.
        resets_at: when the window ends (the ledger's clock).

    .. versionadded:: 0.1
    """

    def __init__(
        self, message: str, *, key: str, budget: str, limit: float, used: float, amount: float, resets_at: float
    ) -> None:
        super().__init__(message, key=key, record=None)
        self.budget = budget
        self.limit = limit
        self.used = used
        self.amount = amount
        self.resets_at = resets_at


class ApprovalDenied(Refused):
    """A person denied this operation (``onceonly deny KEY``): it did not run, and will not for these
    arguments.

    Attributes:
        by: who denied it.
        reason: the reason they gave (for logs and people, never for a model).

    .. versionadded:: 0.1
    """

    def __init__(
        self, message: str, *, key: str, record: Record | None = None, by: str, reason: str | None = None
    ) -> None:
        super().__init__(message, key=key, record=record)
        self.by = by
        self.reason = reason


class InvalidKey(OnceOnlyError, ValueError):
    """A key, scope or tool name that is empty, too long, or has whitespace or control characters.

    .. versionadded:: 0.1
    """


class NotSerializable(OnceOnlyError, TypeError):
    """A value with no canonical JSON form. ``path`` names the field, as ``args.order.items[2]``.

    .. versionadded:: 0.1
    """

    def __init__(self, message: str, *, path: str, value: Any = None) -> None:
        super().__init__(message)
        self.path = path
        self.value_type = type(value).__name__


class StoreError(OnceOnlyError):
    """The ledger's store failed. Not an outcome of the operation.

    .. versionadded:: 0.1
    """


class StoreUnavailable(StoreError):
    """The store could not be reached, or timed out. After a write, whether it landed is unknown (the
    ledger reads the record again before it decides); after a read or an open, nothing changed.

    .. versionadded:: 0.1
    """


class StoreCorrupt(StoreError):
    """The store holds data that is not an onceonly ledger of a known schema, or is damaged.

    Nothing is changed in it: open another path, or move the file away.

    .. versionadded:: 0.1
    """


# What a guarded call raised, as its outcome: the first type that matches (a subclass before its base:
# RetryScheduled is an InProgress); anything else is the tool's own error, a failure.
_RAISED: tuple[tuple[type[BaseException], str], ...] = (
    (KeyConflict, "conflict"),
    (SimilarCall, "similar"),
    (RetryScheduled, "scheduled"),
    (InProgress, "in_progress"),
    (AttemptsExhausted, "abandoned"),
    (ApprovalPending, "awaiting_approval"),
    (Paused, "paused"),
    (BudgetExceeded, "over_budget"),
    (ApprovalDenied, "denied"),
    (StoreError, "store_error"),
    (OnceOnlyError, "error"),
)


def outcome_label(out: Any, exc: BaseException | None) -> str:
    """How a guarded call ended, as one word (the metrics' ``outcome`` label, the traces'
    ``onceonly.outcome``): the state of its ``Outcome`` ``out``, or what it raised: ``failed`` (the tool's
    own error), ``unknown``, ``needs_review``, ``in_progress``, ``scheduled``, ``conflict``, ``similar``,
    ``abandoned``, ``awaiting_approval``, ``paused``, ``over_budget``, ``denied``, ``store_error``, ``error``.

    .. versionadded:: 0.1
    """
    if out is not None:
        return str(out.state.value)
    if isinstance(exc, OutcomeUnknown):
        rec = exc.record
        return "needs_review" if rec is not None and rec.state.value == "needs_review" else "unknown"
    return next((label for kind, label in _RAISED if isinstance(exc, kind)), "failed")
