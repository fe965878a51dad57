"""One seed, one agent: the demo's table repeats. With one agent the requests reach the service in one
order, so its seeded fault draws fall on the same requests in every run (docs/demo.md says what
varies with several agents)."""

from __future__ import annotations

from onceonly.demo import DemoConfig, run_demo


def _table(seed: int) -> list[tuple[str, int, int, int, int, int]]:
    config = DemoConfig(agents=1, ops=12, fault_rate=0.4, seed=seed, strategies=("naive", "key-only", "onceonly"))
    result = run_demo(config)
    return [(s.name, s.asked, s.created, s.duplicates, s.missing, s.unsettled) for s in result.strategies]


def test_one_agent_and_one_seed_give_the_same_table() -> None:
    """Two runs with seed 3 count the same tickets, duplicates and missing, per strategy."""
    first = _table(3)
    assert first == _table(3)
    assert [row[3] for row in first if row[0] == "onceonly"] == [0]
