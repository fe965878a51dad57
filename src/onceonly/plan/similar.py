"""Near-duplicate calls (``similar=``): the first claim of such a tool, taken under its group's lock.

Scoring and choosing are ``onceonly.similar``'s (pure); this is the plan's side: lock the group, read
its recent calls, claim this call's key only if none is alike, else take this call for that one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from dataclasses import replace
from typing import Any, Literal

from onceonly import states as st
from onceonly.errors import InProgress, OnceOnlyError, OutcomeUnknown, SimilarCall, StoreError
from onceonly.plan.actions import (
    Action,
    Call,
    Get,
    SimilarClaim,
    SimilarLock,
    SimilarUnlock,
    Sleep,
    _outcome,
    landed,
)
from onceonly.plan.texts import _message
from onceonly.plan.writes import _refused
from onceonly.similar import Candidate, Match, best_match
from onceonly.states import Record, State

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
                raise _group_busy(call)
            yield Sleep(min(pause, max(deadline - now, 0.0)) + 0.0005)
            pause = min(pause * 2, 0.05)
            continue
        try:
            match = best_match(sim, look.texts, found, call.key)
        except BaseException:
            yield SimilarUnlock(look.group, call.owner)  # a score function that failed: free the group
            raise
        if not (yield from _reading_holds(call, found, now)):
            lost = _lock_lost(call, lost, started)
            continue
        if match is None or match.key == call.key:
            claimed = yield from _group_claim(call, first)
            if not isinstance(claimed, str):
                return (first, True) if claimed[0] else (claimed[1], False)
        else:
            look.joined, look.score, look.earlier = match.key, match.score, match.args
            if look.on_similar != "review":
                return (yield from _take_for(call, match))
            claimed = yield from _park_beside(call, first, match)
            if not isinstance(claimed, str):
                return claimed[1], False  # our own key was made meanwhile: that record decides
        lost = _lock_lost(call, lost, started) if claimed == "lost" else lost


def _said(match: Match) -> str:
    return f"similar to {match.key!r} (score {match.score:.2f})"


def _group_busy(call: Call) -> InProgress:
    look = call.similar
    assert look is not None
    return InProgress(
        f"another call of the group {look.group!r} held its similar-calls lock for the whole "
        f"wait ({call.policy.wait:g} s): call again shortly (nothing ran)",
        key=call.key,
    )


def _reading_holds(call: Call, found: list[Candidate], now: float) -> Generator[Action, Any, bool]:
    """Whether the group's lock, taken at ``now``, still holds the candidates ``found`` it was scored on.
    Scoring that took long (a slow score function) renews the lock first; lost meanwhile, or the group
    changed under it, another call went ahead and the group is read again."""
    look = call.similar
    assert look is not None
    taken = call.clock()
    if taken - now <= SIMILAR_LOCK_SECONDS / 2:
        return True
    sim = look.similar
    again = yield SimilarLock(
        look.group, call.owner, taken, taken + SIMILAR_LOCK_SECONDS, taken - sim.window, sim.candidates
    )
    return again is not None and {c.key for c in again} == {c.key for c in found}


def _park_beside(
    call: Call, first: Record, match: Match
) -> Generator[Action, Any, tuple[bool, Record | None] | Literal["lost", "refused"]]:
    """``on_similar="review"``: this call's own record, parked beside the earlier one, so that a person
    says whether it is the same; the call ends with ``OutcomeUnknown`` once it is. Returns what the
    group claim answered when the record was not parked (our own key was made meanwhile, or the group
    is to be read again)."""
    look = call.similar
    assert look is not None
    said = _said(match)
    now = call.clock()
    unsure = st.transition(
        first, State.UNKNOWN, now=now, reason=f"not run: {said}", by=call.owner, similar_to=match.key,
        lease_owner=None, lease_until=None,
    )  # fmt: skip
    parked = st.park(unsure, now=now, reason="on_similar='review': a person decides", by=call.owner)
    claimed = yield from _group_claim(call, parked)
    if isinstance(claimed, str):
        return claimed
    look.joined = None  # this call keeps its own key
    if not claimed[0]:
        return claimed
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


def _take_for(call: Call, match: Match) -> Generator[Action, Any, tuple[Record | None, bool]]:
    """Take this call for the earlier one it is alike to (``on_similar`` "replay"), or raise
    ``SimilarCall`` ("raise"). The group's lock is freed first: nothing of this call is written."""
    look = call.similar
    assert look is not None
    yield SimilarUnlock(look.group, call.owner)
    earlier: Record | None = yield Get(match.key)
    if look.on_similar == "raise":
        raise SimilarCall(
            f"a call {_said(match)} was made earlier (its state: "
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
