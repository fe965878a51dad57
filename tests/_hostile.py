"""The settings every hostile-input test shares: how many examples per store, and how they are drawn.

Few examples per store, for the suite's time budget. Under ``CI=true`` they are derandomized (a red
build names an example that fails again on the next run, on any machine) and no example database is
written; locally each run draws new examples and keeps the failing ones in ``.hypothesis/``, to try
them first next time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings

from onceonly import Ledger
from tests._raw import RawRecords
from tests.conftest import IN_CI

__all__ = ["EXAMPLES", "hostile", "plant_sentinel", "store_kind"]

#: Examples per test and store: SQLite is cheap, the networked stores pay round trips. A longer hunt:
#: ONCEONLY_HOSTILE_SCALE=20 draws twenty times as many.
EXAMPLES = {"sqlite": 60, "redis": 30, "postgres": 30}
SCALE = float(os.environ.get("ONCEONLY_HOSTILE_SCALE", "1"))


def hostile(kind: str, scale: float = 1.0) -> Callable[[Callable[..., Any]], Any]:
    """The settings of a hostile-input test on store ``kind``: few examples, no deadline (a store round
    trip varies), derandomized under CI."""
    return settings(
        max_examples=max(1, int(EXAMPLES[kind] * scale * SCALE)),
        deadline=None,
        derandomize=IN_CI,
        database=None if IN_CI else settings.default.database,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def store_kind(ledger: Ledger) -> str:
    """``"sqlite"``, ``"redis"`` or ``"postgres"``: the store a ledger is on."""
    return ledger.url.split(":", 1)[0].split("+")[0].replace("postgresql", "postgres")


def plant_sentinel(ledger: Ledger) -> Callable[[], None]:
    """Write a record before any hostile input; the check returned asserts it kept every stored byte."""

    @ledger.tool(name="sentinel")
    def keep(order: str) -> dict[str, str]:
        return {"order": order}

    key = keep.outcome("o-1").key
    raw = RawRecords(ledger.store.url)
    before = raw.read(key)
    assert before is not None

    def check() -> None:
        assert raw.read(key) == before, "hostile input changed another record"

    return check
