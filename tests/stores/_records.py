"""Records for the store tests: one way to make them, shared by every store's tests."""

from __future__ import annotations

from onceonly import states as st
from onceonly.states import Record, State
from tests._clock import NOW  # a fixed "now" (2027-01-15), far from the real clock

__all__ = ["NOW", "make"]


def make(key: str, *, state: State = State.IN_FLIGHT, now: float = NOW, tool: str = "t", scope: str = "s") -> Record:
    """A freshly claimed record of ``key``, held by one fixed owner for 30 s from ``now``."""
    return st.new_record(
        key=key, scope=scope, tool=tool, fingerprint="f" * 64, args_json='{"a":1}', state=state,
        owner="host:1:1", now=now, lease_seconds=30,
    )  # fmt: skip
