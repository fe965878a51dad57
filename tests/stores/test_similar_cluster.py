"""Near-duplicate calls (``similar=``) on a Redis Cluster of the run's own: every script of the group
lookup keeps to one hash slot, and racing reworded calls still run once."""

from __future__ import annotations

from pathlib import Path

import pytest

from onceonly import Ledger
from tests.conftest import empty_store_url
from tests.test_similar import _race, _runs, _ticket_tool, fixture_effects  # noqa: F401 (the fixture, by import)


@pytest.fixture(name="cluster_url")
def fixture_cluster_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty ledger's URL on the private Redis Cluster."""
    return empty_store_url("redis-cluster", request, tmp_path)


def test_reworded_replan_and_race_on_a_cluster(cluster_url: str, effects: Path) -> None:
    """A reworded re-plan replays, and four racing rewordings run once, with groups and records in
    other slots (the cluster refuses any script whose keys cross slots)."""
    ledger = Ledger.open(cluster_url)
    try:
        create = _ticket_tool(ledger, effects)
        first = create.outcome("s1", "Printer on fire")
        assert create.outcome("s1", "The printer is on fire!").similar_to == first.key
        create("s2", "Printer on fire")
    finally:
        ledger.close()
    titles = ["Laptop screen broken", "The laptop screen is broken", "laptop screen broken!", "Laptop screen is broken"]
    outs = _race(cluster_url, effects, titles, "race")
    assert not [o for o in outs if isinstance(o, BaseException)], outs
    assert _runs(effects) == 3
