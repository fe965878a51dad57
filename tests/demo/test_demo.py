"""``onceonly demo``: its workload, its counting, and its own numbers under real injected faults."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from onceonly import Similar
from onceonly.cli import cli
from onceonly.demo import DemoConfig, make_workload, run_demo
from onceonly.demo.run import count, percentile, run_strategy
from onceonly.demo.strategies import Naive
from onceonly.demo.workload import _ENDINGS, _NUMBERED, _REWORDINGS, _TOPICS, op_of, reword

# Smaller than the defaults so that the suite stays fast; the faults are the real ones.
SMALL = {"agents": 6, "ops": 36}


def test_workload_is_the_same_for_the_same_seed() -> None:
    """One seed, one workload: every strategy gets the same asks in the same order."""
    a = make_workload(seed=3, agents=4, operations=50)
    b = make_workload(seed=3, agents=4, operations=50)
    c = make_workload(seed=4, agents=4, operations=50)
    assert a == b and a != c
    assert a.operations == 50 and len(a.keys()) == 50 and len(set(a.keys())) == 50


def test_workload_asks_again_by_re_plan_by_a_second_agent_and_in_other_words() -> None:
    """Re-plans come from the same agent with a re-worded body; shared asks from the partner agent;
    reworded asks from the same agent, after its first ask, with another title of the same number.
    Every body names its operation."""
    w = make_workload(seed=1, agents=4, operations=200, replan_rate=0.2, shared_rate=0.2, reword_rate=0.2)
    kinds = [ask.kind for agent in w.agents for ask in agent]
    assert kinds.count("first") == 200
    assert all(20 < kinds.count(kind) < 60 for kind in ("replan", "shared", "reword"))
    assert w.asks == len(kinds)
    first_title = dict(enumerate(w.keys()))
    for n, agent in enumerate(w.agents):
        for ask in agent:
            owner = ask.op % 4
            assert op_of(ask.body) == ask.op
            if ask.kind == "shared":
                assert owner == n ^ 1  # the partner of the agent that owns the operation
            else:
                assert owner == n
            if ask.kind == "replan":
                assert "Re-planned" in ask.body
            if ask.kind == "reword":
                assert ask.title != first_title[ask.op][1] and f"#{ask.op}" in ask.title
            else:
                assert ask.title == first_title[ask.op][1]
        # A re-plan, in the same words or in others, comes after the first ask of its operation.
        seen: set[int] = set()
        for ask in agent:
            if ask.kind in ("replan", "reword"):
                assert ask.op in seen
            seen.add(ask.op)
    assert w.reworded() == {a.op for agent in w.agents for a in agent if a.kind == "reword"}
    assert all(len(keys) == 1 + (op in w.reworded()) for op, keys in enumerate(w.titles()))
    with pytest.raises(ValueError, match="reword_rate"):
        make_workload(seed=1, agents=1, operations=1, reword_rate=2)
    with pytest.raises(ValueError, match="at least one"):
        make_workload(seed=1, agents=0, operations=1)


def test_every_rewording_is_one_the_default_similar_catches() -> None:
    """Each way the workload rewords a title keeps its number and scores at least the default threshold
    against the title (``Similar``'s default score): the onceonly+similar row can read 0 duplicates."""
    sim = Similar(fields=("title",))
    assert set(_REWORDINGS) == set(_TOPICS)
    for topic, rewordings in _REWORDINGS.items():
        for words in rewordings:
            for text in (words, words.lower()):
                for numbered in _NUMBERED:
                    for end in _ENDINGS:
                        again = numbered.format(text=text, n=12) + end
                        assert sim.field_score(f"{topic} #12", again) >= sim.threshold, (topic, again)
                        # The number is the ticket's: another number is never taken for it.
                        assert sim.field_score(f"{topic} #13", again) == 0, (topic, again)
    titles = {reword(7, op, "Printer on fire") for op in range(1, 60)}
    assert all(title.count("#") == 1 for title in titles) and len({t.split("#")[0] for t in titles}) > 5


def test_a_ticket_counts_to_its_operation_by_its_body() -> None:
    """The tag at the end of a body names the operation; a body without one names none."""
    assert op_of("Asked again by agent 1, in other words: the printer is on fire #12! [op 12]") == 12
    assert op_of("printer on fire #12") is None and op_of("[op 3] and then") is None


def test_count_duplicates_missing_unsettled() -> None:
    """Duplicates are extra tickets; missing is no ticket unless reported failed; unsettled is not known."""
    tickets = {0: 1, 1: 3, 4: 1}
    statuses = {0: "done", 1: "done", 2: "done", 3: "failed", 4: "unsettled"}
    row = count("x", 5, tickets, statuses, [10.0, 20.0, 30.0], {1: 2}, reworded={1, 2})
    assert (row.asked, row.created, row.duplicates, row.missing, row.unsettled) == (5, 5, 2, 1, 1)
    assert row.duplicates_reasked == 2 and row.duplicates_reworded == 2 and row.calls == 3
    assert row.to_dict() == {
        "name": "x", "asked": 5, "created": 5, "duplicates": 2, "missing": 1, "unsettled": 1,
        "p50_ms": 20.0, "p99_ms": 30.0, "calls": 3, "duplicates_reasked": 2, "duplicates_reworded": 2,
        "faults": {}, "seconds": 0.0, "reconciled": {}, "settled": {}, "similar_replayed": 0,
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
    for option in ("--agents", "--ops", "--fault-rate", "--reword-rate", "--seed", "--url", "--json"):
        assert option in result.output


def _only_reworded_duplicates(row: dict[str, Any]) -> None:
    """onceonly with an exact key: nothing missing or unknown, and a duplicate only where the agent
    asked again in other words (another title, another key)."""
    assert (row["missing"], row["unsettled"]) == (0, 0), row
    assert row["duplicates"] == row["duplicates_reworded"] and row["created"] == row["asked"] + row["duplicates"]


def _one_ticket_each(row: dict[str, Any]) -> None:
    """onceonly+similar: exactly one ticket per operation, every call in other words replayed."""
    assert (row["duplicates"], row["missing"], row["unsettled"]) == (0, 0, 0), row
    assert row["created"] == row["asked"] and row["similar_replayed"] == row["faults"].get("reword", 0)


@pytest.mark.slow
def test_demo_json_numbers_at_the_default_fault_rate() -> None:
    """The real command, --json: the exact shape; naive duplicates (the faults are real); key-only and
    onceonly duplicate what is asked again in other words; onceonly+similar makes none."""
    result = CliRunner().invoke(cli, ["demo", "--json", "--agents", "6", "--ops", "36", "--seed", "1"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["seed"] == 1 and data["skipped"] == {}
    settings = data["settings"]
    assert settings["agents"] == 6 and settings["ops"] == 36 and settings["url"] is None
    assert settings["reword_rate"] == 0.1
    names = ["naive", "key-only", "onceonly", "onceonly+server", "onceonly+similar"]
    assert [s["name"] for s in data["strategies"]] == names
    keys = {"name", "asked", "created", "duplicates", "missing", "unsettled", "p50_ms", "p99_ms", "calls"}
    keys |= {"duplicates_reasked", "duplicates_reworded", "faults", "seconds", "reconciled", "settled"}
    keys |= {"similar_replayed"}
    assert all(set(s) == keys for s in data["strategies"])
    assert all(s["calls"] >= s["asked"] and sum(s["faults"].values()) > 0 for s in data["strategies"])
    # The same reworded asks for every strategy.
    assert (
        len({s["faults"]["reword"] for s in data["strategies"]}) == 1 and data["strategies"][0]["faults"]["reword"] > 0
    )
    naive, key_only, onceonly, server, similar = data["strategies"]
    # Re-plans and second agents duplicate under both (each makes a new key, or none); only the faults
    # make naive's retries duplicate on top: more duplicates than key-only means the faults bit.
    assert key_only["duplicates"] > 0
    assert naive["duplicates"] > key_only["duplicates"], "the fault injection did not bite"
    assert key_only["duplicates_reworded"] > 0 and onceonly["duplicates_reworded"] > 0
    _only_reworded_duplicates(onceonly)
    _only_reworded_duplicates(server)
    _one_ticket_each(similar)
    assert similar["created"] == 36
    # How each operation was settled: every one confirmed, most by running, the rest by a probe or late.
    for row in (onceonly, similar):
        assert sum(row["settled"].values()) == 36
        assert set(row["settled"]) <= {"run", "probe", "late", "reconcile-probe"}
    # With no probe written: by running, or by the server's word on the key (in the call or reconciled).
    assert sum(server["settled"].values()) == 36
    assert set(server["settled"]) <= {"run", "server", "reconcile-server", "late"}


@pytest.mark.slow
@pytest.mark.parametrize(("seed", "name"), [(2, "onceonly+similar"), (3, "onceonly"), (4, "onceonly+similar")])
def test_onceonly_has_no_duplicate_and_nothing_missing(seed: int, name: str) -> None:
    """Across seeds (with seed 1 above: three for each), at a high fault rate: one ticket per operation,
    but for onceonly's exact key a second one of some asked again in other words."""
    result = run_demo(DemoConfig(**SMALL, seed=seed, fault_rate=0.3, strategies=(name,)))  # type: ignore[arg-type]
    row = result[name].to_dict()
    assert sum(n for kind, n in row["faults"].items() if kind != "reword") > 0
    if name == "onceonly":
        _only_reworded_duplicates(row)
    else:
        _one_ticket_each(row)
    assert row["asked"] == SMALL["ops"]


def test_asking_the_server_settles_lost_answers_with_no_probe_written() -> None:
    """onceonly+server: the tool has no probe; every lost or late answer is settled by the server's
    word on the key and its replay. Nothing missing, nothing left for a person, and a second ticket
    only for what was asked again in other words."""
    result = run_demo(DemoConfig(**SMALL, seed=3, fault_rate=0.3, strategies=("onceonly+server",)))  # type: ignore[arg-type]
    row = result["onceonly+server"].to_dict()
    assert row["faults"].get("lost", 0) + row["faults"].get("delay", 0) > 0, row["faults"]
    _only_reworded_duplicates(row)
    assert row["settled"].get("server", 0) + row["settled"].get("reconcile-server", 0) > 0, row["settled"]
    assert "needs_review" not in row["settled"] and row["asked"] == SMALL["ops"]


@pytest.mark.slow
def test_onceonly_on_every_store(store_url: str) -> None:
    """--url puts the onceonly ledger on any store: the same result on Redis and PostgreSQL, similar=
    (its group lock and lookup in the store) included."""
    config = DemoConfig(agents=4, ops=12, seed=11, fault_rate=0.3, url=store_url, strategies=("onceonly+similar",))
    row = run_demo(config)["onceonly+similar"].to_dict()
    assert row["faults"]["reword"] > 0
    _one_ticket_each(row)
    assert row["created"] == 12


def test_a_strategy_without_its_extra_is_skipped_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without rapidfuzz the demo runs the other strategies and says how to install what is missing."""
    monkeypatch.setitem(sys.modules, "rapidfuzz", None)  # what an environment without it has: no import
    result = run_demo(DemoConfig(agents=1, ops=2, fault_rate=0.0, strategies=("naive", "onceonly+similar")))
    assert [row.name for row in result.strategies] == ["naive"]
    assert "rapidfuzz" in result.skipped["onceonly+similar"] and "[similar]" in result.skipped["onceonly+similar"]
    assert result.to_dict()["skipped"] == result.skipped
    args = ["demo", "--agents", "1", "--ops", "2", "--fault-rate", "0", "--strategy", "naive"]
    printed = CliRunner().invoke(cli, [*args, "--strategy", "onceonly+similar"], terminal_width=200)
    assert printed.exit_code == 0, printed.output
    assert "onceonly+similar: not run: it needs rapidfuzz" in printed.output and "onceonly[similar]" in printed.output


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
