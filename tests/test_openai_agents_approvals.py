"""onceonly.openai_agents with ``approve=``: the SDK's own approval flow (``needs_approval``, its run
interrupted until ``RunState.approve``) asks a person only for a call that would start the operation
anew; its yes is recorded in the ledger, so the operation runs once and a replay asks no one. Run by the
real ``Runner`` with the SDK's scripted model; side effects are rows in a SQLite table."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("agents")

from agents import Agent, RunConfig, Runner
from agents.testing import ScriptedModel, assistant_message, function_call
from agents.tracing import set_trace_processors
from agents.tracing.processors import default_processor

from onceonly import ApprovalPending, Ledger, State
from onceonly import states as st
from onceonly.openai_agents import function_tool
from tests.conftest import empty_store_url
from tests.stores.conftest import fixture_redis_cluster_url  # noqa: F401 - the private Redis Cluster
from tests.test_openai_agents import Charges, told

REPLAYED = re.compile(r"This action was already done at .* and was not repeated\.")


@pytest.fixture(name="url", params=["sqlite", "redis", "redis-cluster", "postgres"])
def fixture_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return empty_store_url(request.param, request, tmp_path)


@pytest.fixture(name="charges")
def fixture_charges(tmp_path: Path) -> Charges:
    return Charges(tmp_path / "charges.db")


@pytest.fixture(name="ledger")
def fixture_ledger(url: str) -> Iterator[Ledger]:
    ledger = Ledger.open(url)
    yield ledger
    ledger.close()


def twice(**arguments: Any) -> ScriptedModel:
    """The model asks for the same charge twice, in two turns under two call ids, then ends."""
    return ScriptedModel(
        [
            [function_call("charge", arguments, call_id="call_A")],
            [function_call("charge", arguments, call_id="call_B")],
            [assistant_message("done")],
        ]
    )


@pytest.fixture(autouse=True)
def tracing_kept_here() -> Iterator[None]:
    """Tracing on, as by default, with no exporter: a run's trace carries its group_id, which is how the
    approval hook (handed the run's context without its RunConfig) knows the conversation."""
    set_trace_processors([])
    yield
    set_trace_processors([default_processor()])


def run_with_a_person(agent: Agent[Any], decide: bool = True, tracing: bool = True) -> tuple[Any, list[str]]:
    """Run to the end; each time the run stops for approvals, the person (this function) is asked about
    each and says ``decide``. Returns the result and the call ids the person was asked about."""
    config = RunConfig(group_id="conv-1", tracing_disabled=not tracing)
    asked: list[str] = []

    async def main() -> Any:
        result = await Runner.run(agent, "charge the customer", run_config=config)
        while result.interruptions:
            state = result.to_state()
            for item in result.interruptions:
                asked.append(item.raw_item.call_id)
                if decide:
                    state.approve(item)
                else:
                    state.reject(item)
            result = await Runner.run(agent, state, run_config=config)
        return result

    return asyncio.run(main()), asked


def test_a_person_is_asked_once_for_an_operation_the_model_calls_twice(
    ledger: Ledger, charges: Charges, tmp_path: Path
) -> None:
    """The first call stops the run for a person; their yes runs it once and is in the ledger's history;
    the model's second call of it replays without asking anyone."""

    @function_tool(ledger, approve=True)
    async def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    model = twice(customer="c1", cents=500)
    _, asked = run_with_a_person(Agent(name="billing", model=model, tools=[charge]))
    assert asked == ["call_A"]
    assert charges.count() == 1
    ran, replayed = told(model)[-2:]
    assert ran == "charge #1" and REPLAYED.match(replayed)
    (rec,) = ledger.list()
    assert rec.state is State.CONFIRMED
    approvals = [e for e in rec.history if st.APPROVED_BY in e]
    assert [(e["approved_by"], e["reason"]) for e in approvals] == [
        ("openai-agents", "approved in the Agents SDK run (call call_A)")
    ]


def one_call(call_id: str, **arguments: Any) -> ScriptedModel:
    return ScriptedModel([[function_call("charge", arguments, call_id=call_id)], [assistant_message("ok")]])


def request_elsewhere(url: str, customer: str, cents: int) -> str:
    """The same operation asked for by another process's plain guarded tool (same name, scope and
    arguments): its key, now awaiting approval."""
    other = Ledger.open(url)
    try:

        @other.tool(name="charge", approve=True)
        def charge(customer: str, cents: int) -> str:
            raise AssertionError("not approved: it must not run")

        with other.task("conv-1"), pytest.raises(ApprovalPending):
            charge(customer, cents)
        with other.task("conv-1"):
            return charge.key_for(customer, cents)
    finally:
        other.close()


def test_a_rejection_in_the_sdk_runs_nothing_and_the_next_call_asks_again(ledger: Ledger, charges: Charges) -> None:
    """The person says no in the SDK: the tool is not invoked, the ledger records nothing, and the
    model's next call of it is put to a person again."""

    @function_tool(ledger, approve=True)
    async def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    agent = Agent(name="billing", model=one_call("x", customer="c2", cents=5), tools=[charge])
    _, asked = run_with_a_person(agent, decide=False)
    assert asked == ["x"] and charges.count() == 0 and ledger.list() == []
    agent = Agent(name="billing", model=one_call("y", customer="c2", cents=5), tools=[charge])
    _, asked = run_with_a_person(agent)
    assert asked == ["y"] and charges.count() == 1


def test_an_operation_approved_in_the_ledger_is_not_put_to_a_person(url: str, ledger: Ledger, charges: Charges) -> None:
    """Asked for elsewhere and approved with `onceonly approve` (ledger.approve): the SDK asks no one,
    the call runs it once, and the model's second call replays."""

    @function_tool(ledger, approve=True)
    async def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    key = request_elsewhere(url, "c4", 40)
    ledger.approve(key, by="maria", reason="by phone")
    model = twice(customer="c4", cents=40)
    _, asked = run_with_a_person(Agent(name="billing", model=model, tools=[charge]))
    assert asked == [] and charges.count() == 1
    assert told(model)[-2] == "charge #1" and REPLAYED.match(told(model)[-1])


def test_a_denial_in_the_ledger_is_told_and_asks_no_one(url: str, ledger: Ledger, charges: Charges) -> None:
    """A person denied the operation in the ledger: the SDK asks no one, nothing runs, and the model
    reads that it was denied (never the person's reason)."""

    @function_tool(ledger, approve=True)
    async def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    ledger.deny(request_elsewhere(url, "c3", 9), by="maria", reason="fraud")
    model = one_call("z", customer="c3", cents=9)
    _, asked = run_with_a_person(Agent(name="billing", model=model, tools=[charge]))
    assert asked == [] and charges.count() == 0
    assert "a person denied it" in told(model)[-1] and "fraud" not in told(model)[-1]


def test_needs_approval_of_a_tool_without_approve_skips_replays(ledger: Ledger, charges: Charges) -> None:
    """The SDK's own needs_approval=True on a guarded tool: a person is asked for the call that runs,
    not for the model's second call, which replays."""

    @function_tool(ledger, needs_approval=True)
    async def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    model = twice(customer="c5", cents=1)
    _, asked = run_with_a_person(Agent(name="billing", model=model, tools=[charge]))
    assert asked == ["call_A"] and charges.count() == 1
    assert REPLAYED.match(told(model)[-1])


def test_with_tracing_off_a_run_finds_the_conversation_from_its_earlier_calls(
    url: str, ledger: Ledger, charges: Charges
) -> None:
    """Tracing off: the hook cannot read RunConfig.group_id, so the first call of a run is put to a
    person unless the run is inside ledger.task(conversation); a second call in the same run is known
    from the first call's scope and is not."""

    @function_tool(ledger, approve=True)
    async def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    model = twice(customer="c6", cents=3)
    _, asked = run_with_a_person(Agent(name="billing", model=model, tools=[charge]), tracing=False)
    assert asked == ["call_A"] and charges.count() == 1
    key = request_elsewhere(url, "c7", 3)
    ledger.approve(key, by="maria")
    model = one_call("w", customer="c7", cents=3)
    with ledger.task("conv-1"):
        _, asked = run_with_a_person(Agent(name="billing", model=model, tools=[charge]), tracing=False)
    assert asked == [] and charges.count() == 2
