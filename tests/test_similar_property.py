"""Property: whatever the threshold and the score, a call is only ever taken for an earlier call of its own
group: the same scope, the same tool, the same exact key fields. Runs on every store, on a fake clock."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st_

from onceonly import Ledger, Similar
from tests._clock import FakeClock

TITLES = ["Printer on fire", "The printer is on fire!", "printer fire", "Email is down", "order 12", "order 13"]
CALLS = st_.lists(
    st_.tuples(
        st_.sampled_from(["scope-a", "scope-b"]),
        st_.sampled_from(["tool_one", "tool_two"]),
        st_.sampled_from(["s1", "s2"]),
        st_.sampled_from(TITLES),
    ),
    min_size=1,
    max_size=12,
)


def _always(a: str, b: str) -> float:
    """The most permissive score: every text is like every other."""
    return 1.0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=CALLS, threshold=st_.floats(min_value=0.01, max_value=1.0), permissive=st_.booleans())
def test_a_match_never_crosses_scope_tool_or_exact_key(
    store_url: str, calls: list[tuple[str, str, str, str]], threshold: float, permissive: bool
) -> None:
    """Every ``similar_to`` names a record of the call's scope, tool and session, or none at all."""
    clock = FakeClock()
    ledger = Ledger.open(store_url, clock=clock, sleep=clock.sleep)
    sim = Similar(fields=("title",), threshold=threshold, score=_always if permissive else None)
    tools: dict[str, Any] = {}
    for name in ("tool_one", "tool_two"):

        def body(session_id: str, title: str) -> str:
            return title

        tools[name] = ledger.tool(name=name, key=("session_id", "title"), similar=sim)(body)
    try:
        for scope, tool, session, title in calls:
            with ledger.task(scope):
                out = tools[tool].outcome(session, title)
            clock.now += 1
            if out.similar_to is None:
                continue
            earlier = ledger.get(out.similar_to)
            assert earlier is not None
            assert (earlier.scope, earlier.tool, earlier.args["session_id"]) == (scope, tool, session)
    finally:
        ledger.close()
