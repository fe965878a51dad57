"""The guard's decisions, as a generator of actions. No I/O: the drivers in ``ledger.py`` do it.

``plan()`` yields what it needs done (read a record, compare-and-set one, run the tool, run the
probe, sleep) and receives each answer; it returns the ``Outcome`` or raises. The sync driver and
the async driver are two short loops over the same plan, so both have exactly one semantics.

The shape of one call:

    read ──absent──▶ claim (insert) ──▶ run ──ok──▶ confirm ──▶ result
      │                                  │
      ├─confirmed──▶ replay              ├─not sent / not executed ─▶ failed, backoff ─▶ read…
      ├─held───────▶ wait ─lease gone─▶ unknown    ├─definite failure ─▶ failed, re-raise
      ├─unknown────▶ settle: probe | resend | retry | review     └─unknown ─▶ unknown ─▶ settle…
      ├─failed─────▶ reclaim while attempts remain, else abandoned
      └─needs_review / abandoned ─▶ raise
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from typing import Any, Literal

from onceonly import states as st
from onceonly.errors import (
    AttemptsExhausted,
    InProgress,
    KeyConflict,
    NotSerializable,
    OnceOnlyError,
    OutcomeUnknown,
    ReentrantCall,
    RetryScheduled,
    SimilarCall,
    StoreCorrupt,
    StoreError,
)
from onceonly.keys import canonical_json
from onceonly.policy import Classification, Policy, Verdict, classify
from onceonly.similar import Candidate, Lookup, best_match
from onceonly.states import HELD, Record, State

__all__ = [
    "NOT_FOUND",
    "Call",
    "Execute",
    "Executed",
    "Get",
    "Insert",
    "Outcome",
    "Probe",
    "Probed",
    "Running",
    "SimilarClaim",
    "SimilarLock",
    "SimilarUnlock",
    "Sleep",
    "Swap",
    "WaitChange",
    "landed",
    "late_outcome",
    "plan",
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


def _err_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]


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


#: How the guard's reason for a timed-out attempt begins.
_TIMED_OUT = "attempt timed out"

#: Pauses after the store refused a write (it failed, and the record read back unchanged); one more
#: refusal raises. About 1.3 s in all: enough for a flicker, not a spin on a store that refuses writes.
_REFUSAL_DELAYS = (0.05, 0.25, 1.0)


def _refused(call: Call, exc: StoreError, key: str) -> Generator[Action, Any, None]:
    """The store failed a write of ``call`` and the re-read shows the record unchanged: nothing was
    written. Pause before it is made again, or, past the bound, raise the store's error."""
    n = call.refusals
    if n < len(_REFUSAL_DELAYS):
        call.refusals = n + 1
        yield Sleep(_REFUSAL_DELAYS[n] * (0.5 + call.rng.random()))
        return
    if call.ran:
        what = (
            "this call ran the tool, and its outcome is not recorded: the record keeps its lease until it "
            "runs out, then turns unknown and is settled by a probe, the reconciler or onceonly resolve. "
            "Do not run the operation again by hand"
        )
    else:
        what = "nothing was recorded and this call did not run the tool: call again once the store takes writes"
    raise type(exc)(
        f"the ledger refused {n + 1} writes for {key!r} (each time the record read back unchanged): {exc} — {what}"
    ) from exc


def _write(old: Record, new: Record, call: Call | None) -> Generator[Action, Any, tuple[bool, Record | None]]:
    """Compare-and-set ``old`` → ``new``. Returns (written, the record as it now is).

    If the store fails mid-write the write may or may not have landed: re-read, never guess. A write
    the store refused (the record read back unchanged) is the same write still to make: after
    ``_refused``'s pause it is sent again, until ``call``'s bound raises.
    """
    while True:
        try:
            ok = yield Swap(new, old)
            break
        except StoreError as exc:
            now_rec = yield Get(new.key)
            if landed(new, now_rec):
                return True, new
            if (
                call is None
                or now_rec is None
                or now_rec.version != old.version
                or now_rec.created_at != old.created_at
            ):
                return False, now_rec  # moved on (or gone, or made again): the caller decides from what is there
            yield from _refused(call, exc, new.key)
    if ok:
        if call is not None and call.refusals:
            call.refusals = 0  # the bound is on refusals in a row: the store takes writes again
        return True, new
    current = yield Get(new.key)
    return False, current


def _outcome(
    rec: Record, *, replayed: bool, value: Any = None, use_value: bool = False, conflict: bool = False
) -> Outcome:
    result = value if use_value else rec.result
    return Outcome(result, rec.key, rec.state, replayed, rec.attempts, rec.via, rec.fence, conflict, rec.updated_at)


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


#: Seconds a group lock of near-duplicate calls holds (``SimilarLock``): reading, scoring and claiming
#: take far less; a holder that died frees its group after this long.
SIMILAR_LOCK_SECONDS = 10.0


def _group_claim(
    call: Call, record: Record
) -> Generator[Action, Any, tuple[bool, Record | None] | Literal["lost", "refused"]]:
    """``SimilarClaim`` of ``record``: (claimed, the record as it is), or why to look again: the group's
    lock was ``"lost"`` (nothing written), or the store ``"refused"`` the write (after its pause)."""
    look = call.similar
    assert look is not None
    try:
        got = yield SimilarClaim(record, look.group, call.owner)
    except StoreError as exc:
        cur = yield Get(record.key)
        if cur is None:
            yield from _refused(call, exc, record.key)
            return "refused"  # the lock is still ours, or has run out: either way, take it again
        # The claim landed, or another call made the key: this call is done with the group (a lock
        # that cannot be freed now runs out by itself).
        with contextlib.suppress(StoreError):
            yield SimilarUnlock(look.group, call.owner)
        return landed(record, cur), cur
    if got is False:
        return "lost"
    call.refusals = 0
    return (True, record) if got is None else (False, got)


#: Group locks lost in a row (the lookup outlasted the lock) before a call gives up.
_LOCKS_LOST = 3


def _lock_lost(call: Call, lost: int, started: float) -> int:
    """The claim found the group lock gone (the lookup took longer than ``SIMILAR_LOCK_SECONDS``, or the
    store refused it): look again, a few times; then end the call, which ran nothing."""
    lost += 1
    if lost >= _LOCKS_LOST:
        raise OnceOnlyError(
            f"{call.key!r}: the similar-calls lookup lost its group lock {lost} times in "
            f"{call.clock() - started:.1f} s (the lock holds {SIMILAR_LOCK_SECONDS:g} s): nothing ran. Make "
            "Similar(score=...) faster or Similar(candidates=...) smaller, then call again"
        )
    return lost


def _claim_similar(call: Call, first: Record) -> Generator[Action, Any, tuple[Record | None, bool]]:
    """The first claim of a tool with ``similar=``: under the lock of the call's group, score the
    group's recent calls and claim ``first`` only if none is alike; else take this call for that one
    (``on_similar``). Returns (the record, whether we claim it) for the plan's loop, whose key is then
    the earlier call's when this call was taken for it.

    The lock makes "no alike call exists, so claim" one step: two alike calls racing with different
    keys would each find nothing and both run. The second to take the lock finds the first's claim.
    """
    look = call.similar
    assert look is not None
    sim = look.similar
    started = call.clock()
    deadline = started + call.policy.wait
    pause = 0.002
    lost = 0
    while True:
        now = call.clock()
        found: list[Candidate] | None = yield SimilarLock(
            look.group, call.owner, now, now + SIMILAR_LOCK_SECONDS, now - sim.window, sim.candidates
        )
        if found is None:  # another call of this group is deciding: its claim may be the one we join
            if now >= deadline:
                raise InProgress(
                    f"another call of the group {look.group!r} held its similar-calls lock for the whole "
                    f"wait ({call.policy.wait:g} s): call again shortly (nothing ran)",
                    key=call.key,
                )
            yield Sleep(min(pause, max(deadline - now, 0.0)) + 0.0005)
            pause = min(pause * 2, 0.05)
            continue
        try:
            match = best_match(sim, look.texts, found, call.key)
        except BaseException:
            yield SimilarUnlock(look.group, call.owner)  # a score function that failed: free the group
            raise
        taken = call.clock()
        if taken - now > SIMILAR_LOCK_SECONDS / 2:
            # Scoring took long (a slow score function): renew the lock before deciding on its reading.
            # Lost meanwhile, or the group changed under it: another call went ahead; look again.
            again = yield SimilarLock(
                look.group, call.owner, taken, taken + SIMILAR_LOCK_SECONDS, taken - sim.window, sim.candidates
            )
            if again is None or {c.key for c in again} != {c.key for c in found}:
                lost = _lock_lost(call, lost, started)
                continue
        if match is None or match.key == call.key:
            claimed = yield from _group_claim(call, first)
            if isinstance(claimed, str):
                lost = _lock_lost(call, lost, started) if claimed == "lost" else lost
                continue
            return (first, True) if claimed[0] else (claimed[1], False)

        look.joined, look.score, look.earlier = match.key, match.score, match.args
        said = f"similar to {match.key!r} (score {match.score:.2f})"
        if look.on_similar == "review":
            # This call's own record, parked beside the earlier one: a person says whether it is the same.
            now = call.clock()
            unsure = st.transition(
                first, State.UNKNOWN, now=now, reason=f"not run: {said}", by=call.owner, similar_to=match.key,
                lease_owner=None, lease_until=None,
            )  # fmt: skip
            parked = st.park(unsure, now=now, reason="on_similar='review': a person decides", by=call.owner)
            claimed = yield from _group_claim(call, parked)
            if isinstance(claimed, str):
                lost = _lock_lost(call, lost, started) if claimed == "lost" else lost
                continue
            look.joined = None  # this call keeps its own key
            if not claimed[0]:
                return claimed[1], False  # our own key was made meanwhile: that record decides
            raise OutcomeUnknown(
                _message(
                    parked,
                    f"this call was not run: it is {said}, and this tool has on_similar='review'",
                    f"if it is the same operation: onceonly resolve '{call.key}' --confirmed JSON (the earlier "
                    f"result); if it is another one: onceonly resolve '{call.key}' --failed REASON --reset, and "
                    "call again",
                ),
                key=call.key,
                record=parked,
            )
        yield SimilarUnlock(look.group, call.owner)
        earlier: Record | None = yield Get(match.key)
        if look.on_similar == "raise":
            raise SimilarCall(
                f"a call {said} was made earlier (its state: "
                f"{'gone' if earlier is None else earlier.state.value}); this one was not run "
                "(on_similar='raise'): if it is really another operation, change its identifying details",
                key=match.key,
                record=earlier,
                outcome=None if earlier is None else _outcome(earlier, replayed=True),
                score=match.score,
                new_key=call.key,
            )
        # Replay: this call is that operation from here on; its other arguments are kept beside the
        # earlier ones in the record's history, as on_conflict="replay" keeps them.
        call.key = match.key
        call.policy = replace(call.policy, on_conflict="replay")
        return earlier, False


def plan(call: Call) -> Plan:
    """Decide one guarded call. Yields actions; returns an ``Outcome`` or raises.

    .. versionadded:: 0.1
    """
    p = call.policy
    key = call.key
    owner = call.owner
    deadline = call.clock() + p.wait
    poll = 0.002
    last_exc: BaseException | None = None
    waited_version: int | None = None  # the unknown record whose settle/backoff wait we already did
    asked: str | None = None  # the last holder asked about (Running): a wait is on another call, or on ours
    conflict = False
    held_state = State.PENDING if p.reports_dispatch else State.IN_FLIGHT

    # The first action is a claim: one round trip that either makes us the holder of a new record or
    # returns the existing one (a replay then costs exactly that one read).
    first = st.new_record(
        key=key, scope=call.scope, tool=call.tool, fingerprint=call.fingerprint,
        args_json=call.args_json, state=held_state, owner=owner, now=call.clock(), lease_seconds=p.lease,
    )  # fmt: skip
    if call.similar is not None:
        rec, claimed = yield from _claim_similar(call, first)
        key, p = call.key, call.policy  # the earlier call's key, when this one was taken for it
    else:
        try:
            rec = yield Claim(first)
            claimed = rec is None
        except StoreError as exc:
            # Did the claim land before the store failed? Only the record can say: ours, someone
            # else's, or none at all (then the loop below inserts it; we must not run without one).
            rec = yield Get(key)
            claimed = landed(first, rec)
            if rec is None:
                yield from _refused(call, exc, key)
        rec = first if claimed else rec
    while True:
        now = call.clock()

        # --- claim a key nobody holds --------------------------------------------------------
        if claimed:
            claimed = False
        elif rec is None:
            new = st.new_record(
                key=key, scope=call.scope, tool=call.tool, fingerprint=call.fingerprint,
                args_json=call.args_json, state=held_state, owner=owner, now=now, lease_seconds=p.lease,
            )  # fmt: skip
            try:
                inserted = yield Insert(new)
            except StoreError as exc:
                # Did the insert land before the store failed? Only the record can say.
                cur = yield Get(key)
                inserted = landed(new, cur)
                if cur is None:
                    yield from _refused(call, exc, key)
            if not inserted:
                rec = yield Get(key)
                continue
            call.refusals = 0
            rec = new
        elif rec.state is State.CONFIRMED and rec.is_expired(now):
            new = st.renew(
                rec,
                state=held_state,
                owner=owner,
                now=now,
                lease_seconds=p.lease,
                reason="expired record claimed again",
            )
            new = st.replace_args(new, fingerprint=call.fingerprint, args_json=call.args_json)
            ok, rec = yield from _write(rec, new, call)
            if not ok:
                continue
        else:
            # --- an existing record: same operation? -------------------------------------------
            if rec.fingerprint != call.fingerprint:
                if p.on_conflict == "raise":
                    raise KeyConflict(
                        _message(
                            rec,
                            "this key was used before with other arguments",
                            "the earlier arguments are in the record's args; if the new call is a "
                            "different operation, give it another key or occurrence; if it is the same "
                            "operation re-worded, use on_conflict='replay' or a normaliser",
                        ),
                        key=key,
                        record=rec,
                        fingerprint=call.fingerprint,
                    )
                conflict = True
                if rec.state is State.CONFIRMED:
                    look = call.similar
                    why = "other arguments" if look is None else f"a similar call (score {look.score:.2f})"
                    noted = st.transition(
                        rec, rec.state, now=now, reason=f"replayed for {why}: {call.args_json[:500]}", by=owner,
                    )  # fmt: skip
                    ok, cur = yield from _write(rec, noted, call)
                    if not ok:
                        rec = cur
                        continue
                    return _outcome(rec, replayed=True, conflict=True)

            state = rec.state
            if state is State.CONFIRMED:
                return _outcome(rec, replayed=True, conflict=conflict)

            if state in HELD:
                if not rec.lease_expired(now):
                    if rec.lease_owner != asked:
                        asked = rec.lease_owner
                        if (yield Running(asked)):
                            raise _reentered(rec, call)
                    if now >= deadline:
                        raise InProgress(
                            _message(
                                rec,
                                f"another caller ({rec.lease_owner}) is running this operation",
                                f"its lease runs {max(0.0, (rec.lease_until or now) - now):.1f}s more; call "
                                "again later to get its result (it will not run twice)",
                            ),
                            key=key,
                            record=rec,
                        )
                    pause = min(poll, (rec.lease_until or now) - now, max(deadline - now, 0.0)) + 0.0005
                    poll = min(poll * 2, 0.1)
                    yield WaitChange(key, rec.version, pause)
                    rec = yield Get(key)
                    continue
                if state is State.PENDING:
                    # Nothing was sent: the holder died before dispatch. Safe to run again.
                    if rec.attempts >= p.retry.attempts:
                        yield from _give_up(rec, owner, now, "attempts exhausted before dispatch", last_exc)
                    new = _reclaim(rec, call, held_state, now, f"lease of {rec.lease_owner} expired before dispatch")
                    ok, rec = yield from _write(rec, new, call)
                    if not ok:
                        continue
                else:
                    # The holder may have sent it and died: the outcome is unknown now, and this
                    # caller settles it rather than waiting on a dead holder.
                    new = st.mark_unknown(rec, now=now, reason=f"lease of {rec.lease_owner} expired", by=owner)
                    _, rec = yield from _write(rec, new, call)
                    continue

            elif state is State.UNKNOWN:
                settled = yield from _settle(rec, call, now, waited_version, last_exc, held_state)
                if isinstance(settled, Outcome):
                    return settled
                if isinstance(settled, int):  # we waited; read again and settle this version
                    waited_version = settled
                    rec = yield Get(key)
                    continue
                ok, rec = settled
                if not ok:
                    continue

            elif state is State.FAILED:
                if rec.attempts >= p.retry.attempts:
                    yield from _give_up(rec, owner, now, "attempts exhausted", last_exc)
                if rec.next_attempt_at is not None and rec.next_attempt_at > now:
                    if rec.next_attempt_at - now > p.wait:
                        raise _scheduled(rec, rec.next_attempt_at, now, p.wait) from last_exc
                    yield Sleep(rec.next_attempt_at - now)
                    rec = yield Get(key)
                    continue
                new = _reclaim(rec, call, held_state, now, "retry after failure")
                ok, rec = yield from _write(rec, new, call)
                if not ok:
                    continue

            elif state is State.NEEDS_REVIEW:
                raise OutcomeUnknown(
                    _message(
                        rec,
                        f"this operation is waiting for a person to settle it: its outcome is unknown{_cause(rec)}",
                        f"check whether it happened, then: onceonly resolve '{key}' --confirmed JSON | --failed REASON",
                    ),
                    key=key,
                    record=rec,
                ) from last_exc

            elif not st.may_have_happened(rec):  # ABANDONED, and none of its attempts left: start afresh
                new = st.restart(
                    rec, state=held_state, owner=owner, now=now, lease_seconds=p.lease,
                    reason="started afresh: none of the attempts before reached the other side",
                )  # fmt: skip
                if new.fingerprint != call.fingerprint:
                    new = st.replace_args(new, fingerprint=call.fingerprint, args_json=call.args_json)
                ok, rec = yield from _write(rec, new, call)
                if not ok:
                    continue

            else:  # ABANDONED after an attempt that may have had an effect: a person decides
                raise AttemptsExhausted(
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

        # --- we hold the lease on rec: run one attempt ----------------------------------------
        assert rec is not None and rec.state in HELD and rec.lease_owner == owner
        now = call.clock()
        if rec.lease_until is not None and rec.lease_until - now < p.lease / 2:
            # The claim took long to land (a stalled store, a paused process): another caller may
            # already have taken the lease over as expired. Renew it first, and run only if the
            # record is still ours; a fast claim never pays this write.
            fresh = st.extend_lease(rec, now=now, lease_seconds=p.lease)
            ok, rec = yield from _write(rec, fresh, call)
            if not ok:
                continue
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

        now = call.clock()
        if ran.timed_out:
            verdict = Classification(Verdict.UNKNOWN, None, f"{_TIMED_OUT} (it runs on; a late result counts)")
            last_exc = TimeoutError(verdict.reason)
        else:
            assert ran.error is not None
            last_exc = ran.error
            verdict = classify(ran.error, p.classify)
            if rec.state is State.PENDING and verdict.verdict is Verdict.UNKNOWN:
                # The tool said it had not dispatched yet: nothing can have happened.
                verdict = Classification(Verdict.NOT_SENT, None, f"{verdict.reason} before dispatch")

        if verdict.verdict is Verdict.UNKNOWN:
            error = _err_text(last_exc)
            new = st.mark_unknown(rec, now=now, reason=verdict.reason or error, by=owner, error=error)
            _, rec = yield from _write(rec, new, call)
            continue

        error = _err_text(last_exc)
        if verdict.verdict is Verdict.FAILED:
            new = st.fail(rec, error=error, now=now, retry_at=None, ttl=p.ttl, by=owner)
            yield from _write(rec, new, call)
            raise last_exc

        # Not sent, or refused before execution: safe to try again after a backoff, while attempts last.
        # Either way the attempt cannot have had an effect (effect=False): see st.may_have_happened.
        if rec.attempts >= p.retry.attempts:
            failed = st.fail(rec, error=error, now=now, retry_at=None, ttl=p.ttl, by=owner, effect=False)
            ok, cur = yield from _write(rec, failed, call)
            if ok:
                yield from _give_up(failed, owner, now, f"attempts exhausted: {error}", last_exc)
            rec = cur
            continue
        # The classification keeps a Retry-After within [0, MAX_RETRY_AFTER], so the due time is finite.
        wait = p.retry.backoff(rec.attempts, call.rng, floor=verdict.retry_after)
        new = st.fail(rec, error=error, now=now, retry_at=now + wait, ttl=p.ttl, by=owner, effect=False)
        ok, rec = yield from _write(rec, new, call)
        if ok:
            if wait > p.wait:  # the due time is recorded; a later call (or this one's caller) takes it up
                raise _scheduled(new, now + wait, now, p.wait) from last_exc
            yield Sleep(wait)
            rec = yield Get(key)


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
    raise AttemptsExhausted(
        _message(rec, f"gave up after {rec.attempts} attempts", nxt),
        key=rec.key,
        record=rec,
        last_exception=last_exc,
    ) from last_exc


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


def _settle(
    rec: Record,
    call: Call,
    now: float,
    waited_version: int | None,
    last_exc: BaseException | None,
    held_state: State,
) -> Generator[Action, Any, Outcome | int | tuple[bool, Record | None]]:
    """Settle an ``unknown`` record per ``on_unknown``. Returns an Outcome, a version we waited on
    (read again), or the result of writing a reclaim (then run the attempt)."""
    p = call.policy
    owner = call.owner
    strategy = p.on_unknown

    if strategy == "review":
        parked = st.park(rec, now=now, reason="outcome unknown; on_unknown='review'", by=owner)
        ok, cur = yield from _write(rec, parked, call)
        if not ok:
            return (False, cur)  # someone else moved it: look again
        raise OutcomeUnknown(
            _message(
                parked,
                f"the outcome is unknown{_cause(rec)}, and this tool settles unknowns by review",
                f"check whether it happened, then: onceonly resolve '{rec.key}' --confirmed JSON | --failed REASON",
            ),
            key=rec.key,
            record=parked,
        ) from last_exc

    if strategy == "probe":
        due = rec.updated_at + p.settle
        if waited_version != rec.version and due > now:
            # Give the other side time to finish what it may still be doing before asking it.
            if due - now > p.wait:
                raise _unsettled_until(rec, "its probe", due, now, p.wait) from last_exc
            yield Sleep(due - now)
            return rec.version
        probed = yield Probe(rec)
        now = call.clock()
        if probed.error is not None:
            raise OutcomeUnknown(
                _message(
                    rec,
                    f"the outcome is unknown{_cause(rec)}, and the probe failed ({_err_text(probed.error)})",
                    "the record stays unknown; the reconciler (onceonly reconcile) will probe it again",
                ),
                key=rec.key,
                record=rec,
            ) from probed.error
        if probed.value is not NOT_FOUND:
            done = st.confirm(
                rec, result_json=encode_result(probed.value, rec.key), now=now, ttl=p.ttl, via="probe", by=owner
            )
            ok, cur = yield from _write(rec, done, call)
            if ok:
                return _outcome(done, replayed=True)
            return (False, cur)
        # Not found: it did not happen. Run it again while attempts remain.
        if rec.attempts >= p.retry.attempts:
            failed = st.fail(rec, error="probe: not found", now=now, retry_at=None, ttl=p.ttl, by=owner)
            ok, cur = yield from _write(rec, failed, call)
            if not ok:
                return (False, cur)
            yield from _give_up(failed, owner, now, "attempts exhausted; the probe found nothing", last_exc)
        new = _reclaim(rec, call, held_state, now, "probe: not found")
        return (yield from _write(rec, new, call))

    # resend (the other side honours the key) or retry (the tool is idempotent by nature).
    if rec.attempts >= p.retry.attempts:
        parked = st.park(rec, now=now, reason=f"attempts exhausted with the outcome unknown ({strategy})", by=owner)
        ok, cur = yield from _write(rec, parked, call)
        if not ok:
            return (False, cur)
        raise OutcomeUnknown(
            _message(
                parked,
                f"all attempts ended with an unknown outcome, the last{_cause(rec)}",
                f"check whether it happened, then: onceonly resolve '{rec.key}' --confirmed JSON | --failed REASON",
            ),
            key=rec.key,
            record=parked,
        ) from last_exc
    if waited_version != rec.version:
        due = rec.updated_at + p.retry.backoff(rec.attempts, call.rng)
        if due > now:
            if due - now > p.wait:
                raise _unsettled_until(rec, f"its {strategy}", due, now, p.wait) from last_exc
            yield Sleep(due - now)
            return rec.version
    new = _reclaim(rec, call, held_state, now, f"{strategy} after unknown outcome")
    return (yield from _write(rec, new, call))


#: Pauses before reading again when recording a late outcome meets a store error (about 3 s in all).
_LATE_RETRY_DELAYS = (0.1, 0.2, 0.4, 0.8, 1.6)


def late_outcome(
    call: Call, fence: int, value: Any = None, error: BaseException | None = None
) -> Generator[Action, Any, Record | None]:
    """The outcome of attempt ``fence`` that arrived after its caller stopped waiting (a timeout, a
    cancelled caller). A success is never dropped: it confirms the record, or is counted as a
    conflict on a record settled otherwise. A definite failure settles the record only while it is
    still the unknown of that very attempt. The attempt is ``fence`` of the record ``call`` last ran
    an attempt on (``call.created_at``): on a record made again since, it is another record's.

    .. versionadded:: 0.1
    """
    result_json = None if error is not None else encode_result(value, call.key)
    failures = 0
    while True:
        try:
            rec: Record | None = yield Get(call.key)
            if rec is None:
                log.warning("onceonly %s: late outcome of attempt %d for a record that is gone", call.key, fence)
                return None
            now = call.clock()
            if error is None:
                new = st.late_success(
                    rec, fence=fence, result_json=result_json, now=now, ttl=call.policy.ttl, by=call.owner,
                    created_at=call.created_at,
                )  # fmt: skip
                if new is rec:
                    return rec
            else:
                verdict = classify(error, call.policy.classify)
                same_attempt = (
                    rec.fence == fence
                    and rec.state in (State.UNKNOWN, *HELD)
                    and (call.created_at is None or rec.created_at == call.created_at)
                )
                if verdict.verdict is Verdict.UNKNOWN or not same_attempt:
                    return rec
                new = st.fail(rec, error=_err_text(error), now=now, retry_at=None, ttl=call.policy.ttl, by=call.owner)
            # _write tells a write whose answer was lost but that landed from one that did not: read
            # afresh, this late outcome would be taken for another attempt's (a counted duplicate).
            ok, _ = yield from _write(rec, new, call)
        except StoreError:
            # A store down for a moment (the read, or the write and the read after it): read again.
            failures += 1
            if failures > len(_LATE_RETRY_DELAYS):
                raise
            yield Sleep(_LATE_RETRY_DELAYS[failures - 1])
            continue
        if ok:
            return new
