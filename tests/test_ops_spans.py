"""What ``onceonly stats`` and the dashboard count as an attempt's duration: only what the attempt
itself ended, never a lease the reconciler found dead."""

from __future__ import annotations

from onceonly import ops
from onceonly import states as st
from onceonly.states import State
from tests._clock import NOW


def _claimed(state: State = State.PENDING) -> st.Record:
    return st.new_record(
        key="k", scope="s", tool="t", fingerprint="f", args_json="{}", state=state, owner="a", now=NOW, lease_seconds=5
    )


def test_an_attempt_that_ended_itself_is_a_span() -> None:
    done = st.fail(_claimed(), error="TimeoutError: no answer", now=NOW + 2, retry_at=None, ttl=None, by="a")
    assert ops.attempt_spans(done) == [(NOW, 2.0)]


def test_the_reconciler_failing_a_dead_pending_record_is_no_span() -> None:
    """A holder that died before dispatch: the reconciler fails the record long after the claim. That is
    the lease running out, not an attempt that took 123 s."""
    dead = st.fail(
        _claimed(),
        error="the lease of a expired before dispatch: nothing was sent",
        now=NOW + 123,
        retry_at=None,
        ttl=None,
        by="reconcile@host",
        effect=False,
    )
    assert ops.attempt_spans(dead) == []
    unknown = st.mark_unknown(_claimed(State.IN_FLIGHT), now=NOW + 123, reason="lease of a expired", by="reconcile")
    assert ops.attempt_spans(unknown) == []
