"""States and transitions: the table is enforced, history is bounded, late outcomes are never dropped."""

from __future__ import annotations

from pathlib import Path

import pytest

from onceonly import states as st
from onceonly.states import ALLOWED, HISTORY_LIMIT, IllegalTransition, State
from tests._clock import NOW


def held(fence: int = 1) -> st.Record:
    rec = st.new_record(
        key="k", scope="s", tool="t", fingerprint="f" * 64, args_json="{}", state=State.IN_FLIGHT,
        owner="o", now=NOW, lease_seconds=30,
    )  # fmt: skip
    for _ in range(fence - 1):
        rec = st.claim_again(
            st.mark_unknown(rec, now=NOW, reason="x", by=None),
            state=State.IN_FLIGHT, owner="o", now=NOW, lease_seconds=30, reason="again",
        )  # fmt: skip
    return rec


def test_table_is_enforced() -> None:
    """A transition outside ALLOWED is refused, whatever the caller."""
    done = st.confirm(held(), result_json="1", now=NOW, ttl=None, via="run", by=None)
    with pytest.raises(IllegalTransition, match="confirmed → unknown"):
        st.mark_unknown(done, now=NOW, reason="x", by=None)
    with pytest.raises(IllegalTransition, match="only claimed again after it expired"):
        st.renew(done, state=State.IN_FLIGHT, owner="o", now=NOW, lease_seconds=30, reason="x")
    with pytest.raises(IllegalTransition):
        st.new_record(
            key="k", scope="s", tool="t", fingerprint="f", args_json="{}", state=State.CONFIRMED,
            owner="o", now=NOW, lease_seconds=1,
        )  # fmt: skip


def test_every_transition_bumps_version_and_writes_history() -> None:
    """Version rises by one per transition; each history entry says from, to, fence and why."""
    rec = held()
    unknown = st.mark_unknown(rec, now=NOW + 1, reason="timeout", by="me")
    assert unknown.version == rec.version + 1
    assert unknown.history[-1] == {"at": NOW + 1, "from": "in_flight", "to": "unknown", "fence": 1,
                                   "reason": "timeout", "by": "me"}  # fmt: skip


def test_history_is_bounded() -> None:
    """A record keeps its last HISTORY_LIMIT transitions, no more."""
    rec = held()
    for i in range(HISTORY_LIMIT * 2):
        rec = st.transition(rec, State.IN_FLIGHT, now=NOW + i, reason=f"n{i}")
    assert len(rec.history) == HISTORY_LIMIT
    assert rec.history[-1]["reason"] == f"n{HISTORY_LIMIT * 2 - 1}"


def test_late_success_rules() -> None:
    """A late success confirms an open record, is a no-op for its own confirmed attempt, and is counted
    as a conflict where the record was settled otherwise."""
    rec = held(fence=1)
    assert st.late_success(rec, fence=1, result_json="1", now=NOW, ttl=None, by=None).via == "run"
    unknown = st.mark_unknown(rec, now=NOW, reason="x", by=None)
    late = st.late_success(unknown, fence=1, result_json="1", now=NOW, ttl=None, by=None)
    assert (late.state, late.via, late.conflicts) == (State.CONFIRMED, "late:1", 0)
    assert st.late_success(late, fence=1, result_json="1", now=NOW, ttl=None, by=None) is late
    second = st.confirm(held(fence=2), result_json="2", now=NOW, ttl=None, via="run", by=None)
    dup = st.late_success(second, fence=1, result_json="1", now=NOW, ttl=None, by=None)
    assert (dup.state, dup.result, dup.conflicts) == (State.CONFIRMED, 2, 1)
    failed = st.fail(held(fence=2), error="refused", now=NOW, retry_at=None, ttl=None, by=None)
    truth = st.late_success(failed, fence=1, result_json="1", now=NOW, ttl=None, by=None)
    assert (truth.state, truth.result, truth.conflicts) == (State.CONFIRMED, 1, 1)


def test_a_late_success_under_a_newer_holder_then_the_holders_own_is_a_counted_duplicate() -> None:
    """Attempt 1's late success confirms the record while attempt 2 holds it (the record keeps fence
    2); then attempt 2's own success arrives. Its side effect is a second one: counted, not taken for
    "this attempt, already confirmed" (which dropped it with conflicts=0)."""
    holder = held(fence=2)
    by_first = st.late_success(holder, fence=1, result_json="1", now=NOW, ttl=None, by=None)
    assert (by_first.state, by_first.fence, by_first.via) == (State.CONFIRMED, 2, "late:1")
    second = st.late_success(by_first, fence=2, result_json="2", now=NOW, ttl=None, by=None)
    assert (second.state, second.result, second.conflicts) == (State.CONFIRMED, 1, 1)
    assert "late outcome of attempt 2" in second.history[-1]["reason"]
    # The same attempt confirmed by itself or by its probe: nothing happened twice.
    for via in ("run", "probe", "reconcile-probe"):
        done = st.confirm(holder, result_json="2", now=NOW, ttl=None, via=via, by=None)
        assert st.late_success(done, fence=2, result_json="2", now=NOW, ttl=None, by=None) is done


def test_a_late_success_after_a_manual_resolve_is_kept_in_the_history() -> None:
    """An operator confirmed an attempt by hand with a guess; the attempt's real result arrives later.
    It is the same side effect (no conflict), and its result is kept beside the guess, not dropped."""
    unknown = st.mark_unknown(held(), now=NOW, reason="timeout", by=None)
    guessed = st.confirm(unknown, result_json='{"id":"guess"}', now=NOW, ttl=None, via="resolve", by="ops")
    real = st.late_success(guessed, fence=1, result_json='{"id":"real"}', now=NOW + 1, ttl=None, by=None)
    assert (real.state, real.result, real.conflicts, real.via) == (State.CONFIRMED, {"id": "guess"}, 0, "resolve")
    assert '{"id":"real"}' in real.history[-1]["reason"]
    assert st.late_success(guessed, fence=1, result_json='{"id":"guess"}', now=NOW, ttl=None, by=None) is guessed


def test_the_design_pages_transition_table_is_allowed() -> None:
    """docs/design.md#states shows the transitions a reader can check; they must be ALLOWED's, exactly."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text(encoding="utf-8")
    table = page[page.index("### Transitions") : page.index("A state moving to itself")]
    shown: dict[State, frozenset[State]] = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`"):
            targets = frozenset(State(t.strip(" `")) for t in cells[1].split(","))
            shown[State(cells[0].strip("`"))] = targets
    assert shown == dict(ALLOWED)


def test_a_failed_record_waiting_for_its_retry_outlives_its_backoff() -> None:
    """A failure scheduled for a retry later than its ttl is kept until ttl after that retry: purge
    must not delete it during the backoff (the caller would then start again at attempt 1, and with
    a short ttl the attempt limit would never be reached)."""
    failed = st.fail(held(), error="503", now=NOW, retry_at=NOW + 60, ttl=5, by=None)
    assert failed.expires_at == NOW + 65
    final = st.fail(held(), error="400", now=NOW, retry_at=None, ttl=5, by=None)
    assert final.expires_at == NOW + 5


def test_a_late_success_of_an_earlier_incarnation_is_always_counted() -> None:
    """A record lost and made again restarts at fence 1: a late success of fence 1 that names another
    ``created_at`` is another record's attempt. It never passes for the new record's own (no-op) nor
    confirms a live attempt's record: counted beside a held or confirmed record, and confirming (and
    counted) where the outcome is open."""
    earlier = NOW - 60
    rec = held(fence=1)
    on_held = st.late_success(rec, fence=1, result_json="1", now=NOW, ttl=None, by=None, created_at=earlier)
    assert (on_held.state, on_held.lease_owner, on_held.conflicts) == (State.IN_FLIGHT, "o", 1)
    assert "earlier record" in on_held.history[-1]["reason"]
    done = st.confirm(rec, result_json="2", now=NOW, ttl=None, via="run", by=None)
    on_done = st.late_success(done, fence=1, result_json="1", now=NOW, ttl=None, by=None, created_at=earlier)
    assert (on_done.state, on_done.result, on_done.conflicts) == (State.CONFIRMED, 2, 1)
    unknown = st.mark_unknown(rec, now=NOW, reason="x", by=None)
    on_open = st.late_success(unknown, fence=1, result_json="1", now=NOW, ttl=None, by=None, created_at=earlier)
    assert (on_open.state, on_open.result, on_open.via, on_open.conflicts) == (State.CONFIRMED, 1, "late:1", 1)
    # The same incarnation: the rules above, unchanged.
    assert st.late_success(done, fence=1, result_json="2", now=NOW, ttl=None, by=None, created_at=NOW) is done


def test_a_long_history_that_is_not_json_is_store_corrupt() -> None:
    """A record past HISTORY_LIMIT transitions has its history decoded to trim it: a damaged one raises
    StoreCorrupt naming the key, not a bare JSONDecodeError in the middle of a transition."""
    from onceonly.errors import StoreCorrupt

    rec = st.replace(held(), version=HISTORY_LIMIT, history_json="[{broken")
    with pytest.raises(StoreCorrupt, match=r"'k'.*history"):
        st.mark_unknown(rec, now=NOW, reason="x", by=None)
    assert st.misplaced(rec) is None
    assert st.misplaced(st.replace(rec, attempts="2")) == ("attempts", "2")
    assert st.misplaced(st.replace(rec, created_at=5)) is None  # JSON keeps 5.0 as 5


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan"), 1e308 * 10])
def test_a_record_never_holds_a_time_that_is_not_finite(bad: float) -> None:
    """``Infinity`` reached a store as ``next_attempt_at`` and every later call tripped over it: the
    transitions refuse a time that is not finite, whichever field and whoever computed it."""
    rec = held()
    with pytest.raises(IllegalTransition, match=r"next_attempt_at=.* is not a finite time"):
        st.fail(rec, error="503", now=NOW, retry_at=bad, ttl=60, by=None)
    with pytest.raises(IllegalTransition, match="not a finite time"):
        st.fail(rec, error="503", now=bad, retry_at=None, ttl=60, by=None)
    with pytest.raises(IllegalTransition, match="not a finite time"):
        st.confirm(rec, result_json="1", now=bad, ttl=60, via="run", by=None)
    with pytest.raises(IllegalTransition, match="not a finite time"):
        st.confirm(rec, result_json="1", now=NOW, ttl=bad, via="run", by=None)
    with pytest.raises(IllegalTransition, match="not a finite time"):
        st.extend_lease(rec, now=NOW, lease_seconds=bad)
    with pytest.raises(IllegalTransition, match="not a finite time"):
        st.new_record(
            key="k", scope="s", tool="t", fingerprint="f", args_json="{}", state=State.IN_FLIGHT, owner="o",
            now=bad, lease_seconds=30,
        )  # fmt: skip
    with pytest.raises(IllegalTransition, match=r"lease_until=.* is not a finite time"):
        st.transition(rec, State.IN_FLIGHT, now=NOW, lease_until=bad)


def _exhausted(*ends: str) -> st.Record:
    """A record through one attempt per entry of ``ends`` (``not_sent``, ``unknown``, ``failed``,
    ``pending``), then abandoned."""
    rec = st.new_record(
        key="k", scope="s", tool="t", fingerprint="f", args_json="{}", state=State.IN_FLIGHT, owner="o",
        now=NOW, lease_seconds=30,
    )  # fmt: skip
    for i, end in enumerate(ends):
        if i:
            rec = st.claim_again(rec, state=State.IN_FLIGHT, owner="o", now=NOW, lease_seconds=30, reason="again")
        if end == "not_sent":
            rec = st.fail(rec, error="refused", now=NOW, retry_at=None, ttl=60, by="o", effect=False)
        elif end == "failed":
            rec = st.fail(rec, error="ValueError", now=NOW, retry_at=None, ttl=60, by="o")
        elif end == "unknown":
            rec = st.mark_unknown(rec, now=NOW, reason="timeout", by="o")
        else:  # still pending when its holder went away: reclaimed from pending
            rec = st.replace(rec, state=State.PENDING)
    if rec.state is State.UNKNOWN:
        rec = st.fail(rec, error="probe: not found", now=NOW, retry_at=None, ttl=60, by="o")
    return st.abandon(rec, now=NOW, reason="attempts exhausted", by="o")


def test_may_have_happened_reads_the_attempts_that_count() -> None:
    """Only attempts that never reached the other side leave nothing behind; one unknown, one definite
    failure, or a history trimmed past the first counted attempt makes the answer the cautious one."""
    assert not st.may_have_happened(_exhausted("not_sent", "not_sent", "not_sent"))
    assert not st.may_have_happened(_exhausted("pending", "not_sent"))
    assert st.may_have_happened(_exhausted("unknown", "not_sent", "not_sent"))
    assert st.may_have_happened(_exhausted("not_sent", "failed", "not_sent"))
    # A reset (attempts back to 0) leaves the attempts before it out of the count.
    rec = _exhausted("unknown", "not_sent")
    reset = st.transition(rec, State.FAILED, now=NOW, reason="resolved", attempts=0)
    again = st.claim_again(reset, state=State.IN_FLIGHT, owner="o", now=NOW, lease_seconds=30, reason="after reset")
    again = st.fail(again, error="refused", now=NOW, retry_at=None, ttl=60, by="o", effect=False)
    assert not st.may_have_happened(st.abandon(again, now=NOW, reason="exhausted", by="o"))
    # Trimmed: 20 not-sent attempts leave the first claim out of the last HISTORY_LIMIT entries.
    many = _exhausted(*["not_sent"] * 20)
    assert many.attempts == 20 and st.may_have_happened(many)


def test_restart_gives_an_abandoned_record_of_no_effect_a_new_budget() -> None:
    """Restarting: attempts at 1, fence rising; refused for a record whose attempts may have happened."""
    fresh = st.restart(
        _exhausted("not_sent", "not_sent"), state=State.IN_FLIGHT, owner="o2", now=NOW, lease_seconds=30, reason="r"
    )
    assert (fresh.state, fresh.attempts, fresh.fence, fresh.lease_owner) == (State.IN_FLIGHT, 1, 3, "o2")
    with pytest.raises(IllegalTransition):
        st.restart(_exhausted("unknown", "not_sent"), state=State.IN_FLIGHT, owner="o", now=NOW, lease_seconds=30,
                   reason="r")  # fmt: skip


def test_may_have_happened_skips_an_attempt_given_back_as_control_flow() -> None:
    """A claim given back for control flow (an interrupt) is not counted, so the counted attempts are
    not the last ``attempts`` fences: the unknown first attempt must still be found."""
    rec = st.new_record(
        key="k", scope="s", tool="t", fingerprint="f", args_json="{}", state=State.IN_FLIGHT, owner="o",
        now=NOW, lease_seconds=30,
    )  # fmt: skip
    rec = st.mark_unknown(rec, now=NOW, reason="timeout", by="o")
    rec = st.claim_again(rec, state=State.IN_FLIGHT, owner="o", now=NOW, lease_seconds=30, reason="retry")
    rec = st.transition(rec, State.FAILED, now=NOW, reason=f"{st.RELEASED} GraphInterrupt is control flow",
                        attempts=rec.attempts - 1, lease_owner=None, lease_until=None)  # fmt: skip
    rec = st.claim_again(rec, state=State.IN_FLIGHT, owner="o", now=NOW, lease_seconds=30, reason="resumed")
    rec = st.fail(rec, error="refused", now=NOW, retry_at=None, ttl=60, by="o", effect=False)
    rec = st.abandon(rec, now=NOW, reason="exhausted", by="o")
    assert (rec.attempts, rec.fence) == (2, 3)
    assert st.may_have_happened(rec)
    # Not sent, given back, not sent: nothing happened, and the release is not taken for an effect.
    clean = st.new_record(
        key="k", scope="s", tool="t", fingerprint="f", args_json="{}", state=State.IN_FLIGHT, owner="o",
        now=NOW, lease_seconds=30,
    )  # fmt: skip
    clean = st.fail(clean, error="refused", now=NOW, retry_at=None, ttl=60, by="o", effect=False)
    clean = st.claim_again(clean, state=State.IN_FLIGHT, owner="o", now=NOW, lease_seconds=30, reason="retry")
    clean = st.transition(clean, State.FAILED, now=NOW, reason=f"{st.RELEASED} GraphInterrupt is control flow",
                          attempts=clean.attempts - 1, lease_owner=None, lease_until=None)  # fmt: skip
    clean = st.claim_again(clean, state=State.IN_FLIGHT, owner="o", now=NOW, lease_seconds=30, reason="resumed")
    clean = st.fail(clean, error="refused", now=NOW, retry_at=None, ttl=60, by="o", effect=False)
    assert not st.may_have_happened(st.abandon(clean, now=NOW, reason="exhausted", by="o"))
