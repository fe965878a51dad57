"""What the plan yields and what it is answered: the actions, their answers, and a call's own data.

The drivers (``onceonly.drivers``) carry each action out against the store or the tool and send the
answer back. ``Call`` is one guarded call (who asks, for which key, with which arguments and
settings); ``Outcome`` is what it ends with. No I/O here.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from onceonly.errors import NotSerializable
from onceonly.keys import canonical_json
from onceonly.plan.texts import _err_text
from onceonly.policy import Policy
from onceonly.similar import Lookup
from onceonly.states import Record, State

__all__ = [
    "NOT_FOUND",
    "Action",
    "Call",
    "Claim",
    "Execute",
    "Executed",
    "Get",
    "Insert",
    "Outcome",
    "Plan",
    "Probe",
    "Probed",
    "Running",
    "SimilarClaim",
    "SimilarLock",
    "SimilarUnlock",
    "Sleep",
    "Swap",
    "WaitChange",
    "encode_result",
    "landed",
]

log = logging.getLogger("onceonly")


class _NotFound:
    """The probe's answer when the operation did not happen."""

    _instance: _NotFound | None = None

    def __new__(cls) -> _NotFound:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "onceonly.NOT_FOUND"

    def __bool__(self) -> bool:
        return False


#: What a probe returns when it finds no trace of the operation.
NOT_FOUND: Any = _NotFound()


# --- actions the plan yields, and what the drivers send back ----------------------------------


@dataclass(slots=True)  # not frozen: built on every call, and frozen init is slow
class Get:
    key: str


@dataclass(slots=True)  # not frozen: built on every call, and frozen init is slow
class Insert:
    record: Record


@dataclass(slots=True)  # not frozen: built on every call, and frozen init is slow
class Claim:
    """Insert ``record`` if its key is absent (answered ``None``: we hold it), else read the stored one."""

    record: Record


@dataclass(slots=True)  # not frozen: built on every call, and frozen init is slow
class Swap:
    record: Record
    expected: Record  # written only if the stored version is still expected.version


@dataclass(slots=True)  # not frozen: built on every call, and frozen init is slow
class Execute:
    """Run the tool while holding ``record``'s lease; answered with ``Executed``."""

    record: Record


@dataclass(slots=True)  # not frozen: built on every call, and frozen init is slow
class Executed:
    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    record: Record | None = None  # the held record as the driver last wrote it (heartbeats)
    released: bool = False  # ``error`` is control flow (a framework's interrupt), not an outcome
    interrupted: bool = False  # ``error`` stopped the call (KeyboardInterrupt, a cancelled caller): re-raise it


@dataclass(slots=True)  # not frozen: built on every call, and frozen init is slow
class Probe:
    record: Record


@dataclass(slots=True)  # not frozen: built on every call, and frozen init is slow
class Probed:
    value: Any = None
    error: BaseException | None = None


@dataclass(slots=True)  # not frozen: built on every call, and frozen init is slow
class Sleep:
    seconds: float


@dataclass(slots=True)  # not frozen: built on every call, and frozen init is slow
class WaitChange:
    key: str
    version: int
    seconds: float


@dataclass(slots=True)
class Running:
    """Whether ``owner`` is a call this one runs inside (a tool that calls itself): answered ``True`` or
    ``False``. Asked only of a record another call holds, before waiting on it."""

    owner: str | None


@dataclass(slots=True)
class SimilarLock:
    """Take the lock of a group of near-duplicate calls (``onceonly.Similar``) for ``token`` until
    ``until``, and read its candidates claimed since ``since`` (at most ``limit``, newest first).
    Answered with the candidates, or ``None`` while another call holds the lock."""

    group: str
    token: str
    now: float
    until: float
    since: float
    limit: int


@dataclass(slots=True)
class SimilarClaim:
    """``Claim`` of ``record`` that also files it in ``group`` and frees the group's lock, only while
    ``token`` holds that lock. Answered as ``Claim`` is, or ``False`` when the lock was lost (nothing
    written)."""

    record: Record
    group: str
    token: str


@dataclass(slots=True)
class SimilarUnlock:
    group: str
    token: str


Action = (
    Get
    | Claim
    | Insert
    | Swap
    | Execute
    | Probe
    | Sleep
    | WaitChange
    | Running
    | SimilarLock
    | SimilarClaim
    | SimilarUnlock
)
Plan = Generator[Action, Any, "Outcome"]


@dataclass(slots=True)  # not frozen: one per call; treat it as immutable
class Outcome:
    """What a guarded call returns with ``.outcome(...)``.

    Attributes:
        result: the tool's result (on a replay: the recorded one, decoded from JSON).
        key: the ledger key of the operation.
        state: the record's state (``confirmed``).
        replayed: ``True`` when this call did not run the tool itself.
        attempts: attempts recorded for the operation.
        via: how the outcome was settled: ``run``, ``probe``, ``reconcile-probe``, ``resolve``, ``late:N``
            (attempt N's result arrived late), ``readonly``.
        fence: the fencing token of the attempt that produced it.
        conflict: ``True`` when other arguments were replayed (``on_conflict="replay"``, or a similar call).
        settled_at: when the record was last written (for a replay: when it was done).
        similar_to: the key of the earlier call this one was taken for (``similar=``), else ``None``.
        similar_args: that earlier call's arguments.

    .. versionadded:: 0.1
    """

    result: Any
    key: str
    state: State
    replayed: bool
    attempts: int
    via: str | None = None
    fence: int = 0
    conflict: bool = False
    settled_at: float | None = None
    similar_to: str | None = None
    similar_args: dict[str, Any] | None = None


@dataclass(slots=True)  # not frozen: built on every call, and frozen init is slow
class Call:
    """One guarded call: who asks, for which key, with which arguments."""

    key: str
    scope: str
    tool: str
    fingerprint: str
    args_json: str
    owner: str
    policy: Policy
    clock: Callable[[], float]
    rng: random.Random
    #: Writes the store refused so far (it failed and the record read back unchanged): bounded.
    refusals: int = 0
    #: Whether this call ran the tool (for what a refusal's error says).
    ran: bool = False
    #: ``created_at`` of the record this call last ran an attempt on. With the fence it names the attempt:
    #: a record lost from the store and made again by another caller starts again at fence 1.
    created_at: float | None = None
    #: The near-duplicate lookup of a tool with ``similar=`` (``None``: exact keys only).
    similar: Lookup | None = None
    #: Whether this call's operation needs a person's approval before it runs (``approve=``).
    approve: bool = False


def encode_result(value: Any, key: str) -> str:
    """The stored form of a result. One that has no JSON form is kept as a described marker, since the
    side effect happened: losing the record would be worse than losing the value's type."""
    try:
        return canonical_json(value, path="result")
    except NotSerializable as exc:
        log.warning("onceonly %s: result is not JSON-serialisable (%s); a description is recorded", key, exc)
        try:
            shown = repr(value)[:2000]
        except Exception as failed:  # a broken __repr__, an int too long to print: the type must do
            shown = f"<repr failed: {_err_text(failed)[:200]}>"
        return canonical_json({"$unserializable": type(value).__name__, "repr": shown})


def landed(written: Record, now_stored: Record | None) -> bool:
    """Whether a write whose answer was lost (the store failed mid-write) landed, judged from the record
    read afterwards: exactly when the stored record is the one written (same version and history, which
    holds this call's owner and timestamps: no other writer produces it). Never a guess.

    .. versionadded:: 0.1
    """
    return (
        now_stored is not None
        and now_stored.version == written.version
        and now_stored.history_json == written.history_json
    )


def _outcome(
    rec: Record, *, replayed: bool, value: Any = None, use_value: bool = False, conflict: bool = False
) -> Outcome:
    result = value if use_value else rec.result
    return Outcome(result, rec.key, rec.state, replayed, rec.attempts, rec.via, rec.fence, conflict, rec.updated_at)
