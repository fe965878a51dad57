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
