"""``onceonly demo``: its workload, its counting, and its own numbers under real injected faults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from onceonly.cli import cli
from onceonly.demo import DemoConfig, make_workload, run_demo
from onceonly.demo.run import count, percentile, run_strategy
from onceonly.demo.strategies import Naive

# Smaller than the defaults so that the suite stays fast; the faults are the real ones.
SMALL = {"agents": 6, "ops": 36}


def test_workload_is_the_same_for_the_same_seed() -> None:
    """One seed, one workload: every strategy gets the same asks in the same order."""
    a = make_workload(seed=3, agents=4, operations=50)
    b = make_workload(seed=3, agents=4, operations=50)
    c = make_workload(seed=4, agents=4, operations=50)
    assert a == b and a != c
    assert a.operations == 50 and len(a.keys()) == 50 and len(set(a.keys())) == 50


def test_workload_asks_again_by_re_plan_and_by_a_second_agent() -> None:
    """Re-plans come from the same agent with a re-worded body; shared asks from the partner agent."""
    w = make_workload(seed=1, agents=4, operations=200, replan_rate=0.2, shared_rate=0.2)
    kinds = [ask.kind for agent in w.agents for ask in agent]
    assert kinds.count("first") == 200
    assert 20 < kinds.count("replan") < 60 and 20 < kinds.count("shared") < 60
    assert w.asks == len(kinds)
    for n, agent in enumerate(w.agents):
        for ask in agent:
            owner = ask.op % 4
            if ask.kind == "shared":
                assert owner == n ^ 1  # the partner of the agent that owns the operation
            else:
                assert owner == n
            if ask.kind == "replan":
                assert "Re-planned" in ask.body
        # A re-plan comes after the first ask of its operation.
        seen: set[int] = set()
        for ask in agent:
            if ask.kind == "replan":
                assert ask.op in seen
            seen.add(ask.op)
    with pytest.raises(ValueError, match="at least one"):
        make_workload(seed=1, agents=0, operations=1)


def test_count_duplicates_missing_unsettled() -> None:
    """Duplicates are extra tickets; missing is no ticket unless reported failed; unsettled is not known."""
    ops = [("s", "a"), ("s", "b"), ("s", "c"), ("s", "d"), ("s", "e")]
    tickets = {("s", "a"): 1, ("s", "b"): 3, ("s", "e"): 1}
    statuses = {0: "done", 1: "done", 2: "done", 3: "failed", 4: "unsettled"}
    row = count("x", ops, tickets, statuses, [10.0, 20.0, 30.0], {1: 2})
    assert (row.asked, row.created, row.duplicates, row.missing, row.unsettled) == (5, 5, 2, 1, 1)
    assert row.duplicates_reasked == 2 and row.calls == 3
    assert row.to_dict() == {
        "name": "x", "asked": 5, "created": 5, "duplicates": 2, "missing": 1, "unsettled": 1,
        "p50_ms": 20.0, "p99_ms": 30.0, "calls": 3, "duplicates_reasked": 2, "faults": {}, "seconds": 0.0,
        "reconciled": {}, "settled": {},
    }  # fmt: skip


def test_percentile_by_nearest_rank() -> None:
    """p50 and p99 by nearest rank; none for no values."""
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50 and percentile(values, 99) == 99 and percentile(values, 100) == 100
    assert percentile([], 50) == 0 and percentile([7.0], 99) == 7


def test_demo_command_replaces_the_placeholder() -> None:
    """`onceonly demo --help` is this demo, with its knobs."""
    result = CliRunner().invoke(cli, ["demo", "--help"])
    assert result.exit_code == 0
    for option in ("--agents", "--ops", "--fault-rate", "--seed", "--url", "--json"):
        assert option in result.output


@pytest.mark.slow
def test_demo_json_numbers_at_the_default_fault_rate() -> None:
    """The real command, --json: the exact shape; naive duplicates (the faults are real); onceonly none."""
    result = CliRunner().invoke(cli, ["demo", "--json", "--agents", "6", "--ops", "36", "--seed", "1"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["seed"] == 1
    assert data["settings"]["agents"] == 6 and data["settings"]["ops"] == 36 and data["settings"]["url"] is None
    assert [s["name"] for s in data["strategies"]] == ["naive", "key-only", "onceonly"]
    keys = {"name", "asked", "created", "duplicates", "missing", "unsettled", "p50_ms", "p99_ms", "calls"}
    keys |= {"duplicates_reasked", "faults", "seconds", "reconciled", "settled"}
    assert all(set(s) == keys for s in data["strategies"])
    assert all(s["calls"] >= s["asked"] and sum(s["faults"].values()) > 0 for s in data["strategies"])
    naive, key_only, onceonly = data["strategies"]
    # Re-plans and second agents duplicate under both (each makes a new key, or none); only the faults
    # make naive's retries duplicate on top: more duplicates than key-only means the faults bit.
    assert key_only["duplicates"] > 0
    assert naive["duplicates"] > key_only["duplicates"], "the fault injection did not bite"
    assert (onceonly["duplicates"], onceonly["missing"], onceonly["unsettled"]) == (0, 0, 0)
    assert onceonly["created"] == onceonly["asked"] == 36
    # How each operation was settled: every one confirmed, most by running, the rest by a probe or late.
    assert sum(onceonly["settled"].values()) == 36
    assert set(onceonly["settled"]) <= {"run", "probe", "late", "reconcile-probe"}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [2, 3, 4, 5])
def test_onceonly_has_no_duplicate_and_nothing_missing(seed: int) -> None:
    """Across seeds (with seed 1 above: five), at a high fault rate: exactly one ticket per operation."""
    result = run_demo(DemoConfig(**SMALL, seed=seed, fault_rate=0.3, strategies=("onceonly",)))  # type: ignore[arg-type]
    row = result["onceonly"]
    assert sum(row.faults.values()) > 0
    assert (row.duplicates, row.missing, row.unsettled) == (0, 0, 0), row
    assert row.created == row.asked == SMALL["ops"]


@pytest.mark.slow
def test_onceonly_on_every_store(store_url: str) -> None:
    """--url puts the onceonly ledger on any store: the same result on Redis and PostgreSQL."""
    config = DemoConfig(agents=4, ops=20, seed=11, fault_rate=0.3, url=store_url, strategies=("onceonly",))
    row = run_demo(config)["onceonly"]
    assert (row.duplicates, row.missing, row.unsettled, row.created) == (0, 0, 0, 20), row


def test_an_agent_that_cannot_start_stops_the_run(tmp_path: Path) -> None:
    """An agent whose warm-up fails releases the others from the start line: the run raises its
    error instead of waiting forever."""

    class Broken(Naive):
        calls = 0

        def warm(self) -> None:
            with self._lock:
                Broken.calls += 1
                first = Broken.calls == 1
            if first:  # one agent fails, the others reach the start line and wait there
                raise RuntimeError("cannot reach the service")
            super().warm()

    config = DemoConfig(agents=3, ops=3, fault_rate=0.0, strategies=("naive",))
    workload = make_workload(seed=1, agents=3, operations=3)
    with pytest.raises(RuntimeError, match="cannot reach"):
        run_strategy(Broken(timeout=0.5), workload, config, tmp_path)
