"""onceonly.pydantic_ai: pydantic-ai tools that act once per conversation, run by the real Agent.

The model is pydantic-ai's own ``FunctionModel``: a script that decides each turn from the messages it
is given, which the tests keep, so they assert on what the model read. Side effects are rows in a SQLite
table of the test's own, so each test shows the duplicate without onceonly's guard and its absence with
it. The DBOS crash-and-recover tests are in tests/test_dbos.py (their agent is tests/_dbos_agent.py).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pydantic_ai")

from pydantic_ai import Agent, DeferredToolRequests, DeferredToolResults, RunContext, Tool
from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, ModelRetry
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    RetryPromptPart,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import FunctionToolset

from onceonly import Ledger, edge
from onceonly.pydantic_ai import PASSTHROUGH, SETTING, GuardedToolset, guard, guard_tools, guarded
from onceonly.states import State

UNKNOWN = "The outcome of this action is unknown"
NOT_REPEATED = "and was not repeated"


class Charges:
    """The side effect: one row per charge made, in a SQLite file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS charges (amount INTEGER)")

    def add(self, amount: int) -> None:
        with sqlite3.connect(self.path) as conn:
            conn.execute("INSERT INTO charges VALUES (?)", (amount,))

    def count(self) -> int:
        with sqlite3.connect(self.path) as conn:
            (n,) = conn.execute("SELECT count(*) FROM charges").fetchone()
        return int(n)


@pytest.fixture(name="loop", autouse=True)
def fixture_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """One event loop per test, closed after it: run_sync drives the thread's current loop and leaves it
    open, and a loop left for the garbage collector is an unclosed-socket warning in a later test."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()
    asyncio.set_event_loop(None)


@pytest.fixture(name="ledger")
def fixture_ledger(sqlite_url: str) -> Iterator[Ledger]:
    """A real SQLite ledger in the test's directory, on the real clock (calls in one turn run at once)."""
    ledger = Ledger.open(sqlite_url)
    yield ledger
    ledger.close()


@pytest.fixture(name="charges")
def fixture_charges(tmp_path: Path) -> Charges:
    return Charges(tmp_path / "effects.db")


class Script:
    """A FunctionModel script: each turn sends the next batch of tool calls, then a final text. Keeps
    every message list it was given and the tools it was shown."""

    def __init__(self, *turns: list[tuple[str, dict[str, Any]]]) -> None:
        self.turns = list(turns)
        self.seen: list[list[ModelMessage]] = []
        self.tools: list[Any] = []
        self.calls = 0

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        self.seen.append(list(messages))
        self.tools.append(info.function_tools)
        if self.calls < len(self.turns):
            turn = self.turns[self.calls]
            self.calls += 1
            return ModelResponse(
                parts=[
                    ToolCallPart(name, args, tool_call_id=f"call-{self.calls}-{i}")
                    for i, (name, args) in enumerate(turn)
                ]
            )
        return ModelResponse(parts=[TextPart("done")])

    def model(self) -> FunctionModel:
        return FunctionModel(self)

    def returns(self) -> list[ToolReturnPart]:
        """The tool results the model read last (every one of the run)."""
        parts = [p for m in self.seen[-1] if isinstance(m, ModelRequest) for p in m.parts]
        return [p for p in parts if isinstance(p, ToolReturnPart) and p.outcome != "retried"]

    def retries(self) -> list[Any]:
        """The retry prompts the model read (a ToolReturnPart marked ``retried``, or a RetryPromptPart)."""
        parts = [p for m in self.seen[-1] if isinstance(m, ModelRequest) for p in m.parts]
        return [p for p in parts if isinstance(p, RetryPromptPart) or getattr(p, "outcome", None) == "retried"]


def charge_tool(charges: Charges) -> Callable[..., str]:
    def charge(amount: int) -> str:
        """Charge the customer's card."""
        charges.add(amount)
        return f"charged {amount}"

    return charge


CHARGE_5 = [("charge", {"amount": 5})]


# --- the answer lost after the side effect ---------------------------------------------------------


def lost_answer_tool(charges: Charges) -> Callable[..., str]:
    def charge(amount: int) -> str:
        """Charge the customer's card."""
        charges.add(amount)  # committed
        raise TimeoutError("the card service did not answer")  # ... and the answer is lost

    return charge


def test_a_lost_answer_re_issued_charges_once_and_the_model_reads_unknown(ledger: Ledger, charges: Charges) -> None:
    """The charge is committed, then the answer is lost; the model issues it again. One charge; the run
    goes on (no exception escapes) and the model reads, both times, that the outcome is unknown."""
    script = Script(CHARGE_5, CHARGE_5)
    agent = Agent(script.model(), tools=guard_tools([lost_answer_tool(charges)], ledger))
    result = agent.run_sync("charge me 5", conversation_id="conv-1")
    assert result.output == "done"
    assert charges.count() == 1
    returned = script.returns()
    assert len(returned) == 2
    for part in returned:
        assert UNKNOWN in str(part.content)
        assert part.outcome == "failed"  # ToolFailed: read by the model, no retry spent
        assert "onceonly resolve" not in str(part.content)
    assert not script.retries()


def test_without_onceonly_a_lost_answer_re_issued_charges_twice(charges: Charges) -> None:
    """The same flow with pydantic-ai alone (the lost answer told as ModelRetry, so that the run goes on):
    the model issues the call again and the customer is charged twice."""

    def charge(amount: int) -> str:
        """Charge the customer's card."""
        charges.add(amount)
        raise ModelRetry("the card service did not answer")

    script = Script(CHARGE_5, CHARGE_5)
    agent = Agent(script.model(), tools=[Tool(charge, max_retries=3)])
    agent.run_sync("charge me 5", conversation_id="conv-1")
    assert charges.count() == 2


def test_a_re_planned_call_replays_and_the_model_reads_the_replay(ledger: Ledger, charges: Charges) -> None:
    """The same call issued again in one conversation replays: one charge, and the model's next input
    holds the result marked as not repeated."""
    script = Script(CHARGE_5, CHARGE_5)
    agent = Agent(script.model(), tools=guard_tools([charge_tool(charges)], ledger))
    agent.run_sync("charge me 5", conversation_id="conv-1")
    assert charges.count() == 1
    first, second = script.returns()
    assert first.content == "charged 5" and first.outcome == "success"
    assert NOT_REPEATED in str(second.content) and "charged 5" in str(second.content)


def test_without_onceonly_a_re_planned_call_charges_twice(charges: Charges) -> None:
    script = Script(CHARGE_5, CHARGE_5)
    Agent(script.model(), tools=[charge_tool(charges)]).run_sync("charge me 5", conversation_id="conv-1")
    assert charges.count() == 2


def test_arguments_are_keyed_as_the_tool_sees_them(ledger: Ledger, charges: Charges) -> None:
    """pydantic-ai validates before the ledger keys: 5 and "5" are one charge."""
    script = Script([("charge", {"amount": 5})], [("charge", {"amount": "5"})])
    Agent(script.model(), tools=guard_tools([charge_tool(charges)], ledger)).run_sync("go", conversation_id="c")
    assert charges.count() == 1


# --- parallel calls, conversations, runs --------------------------------------------------------------


def test_two_parallel_identical_calls_in_one_turn_charge_once(ledger: Ledger, charges: Charges) -> None:
    script = Script(CHARGE_5 * 2)
    agent = Agent(script.model(), tools=guard_tools([charge_tool(charges)], ledger))
    agent.run_sync("charge me 5", conversation_id="conv-1")
    assert charges.count() == 1
    contents = [str(p.content) for p in script.returns()]
    assert contents.count("charged 5") == 1  # one ran, the other waited for it and replayed
    assert sum(NOT_REPEATED in c and "charged 5" in c for c in contents) == 1


def test_without_onceonly_two_parallel_identical_calls_charge_twice(charges: Charges) -> None:
    script = Script(CHARGE_5 * 2)
    Agent(script.model(), tools=[charge_tool(charges)]).run_sync("charge me 5", conversation_id="conv-1")
    assert charges.count() == 2


def test_two_conversations_with_the_same_arguments_each_charge(ledger: Ledger, charges: Charges) -> None:
    tools = guard_tools([charge_tool(charges)], ledger)
    Agent(Script(CHARGE_5).model(), tools=tools).run_sync("charge me 5", conversation_id="alice")
    Agent(Script(CHARGE_5).model(), tools=tools).run_sync("charge me 5", conversation_id="bob")
    assert charges.count() == 2


def test_a_conversation_continued_in_a_later_run_replays(ledger: Ledger, charges: Charges) -> None:
    """The second run continues the first's message history, so pydantic-ai gives it the same
    conversation_id: the same charge asked again replays."""
    tools = guard_tools([charge_tool(charges)], ledger)
    first = Agent(Script(CHARGE_5).model(), tools=tools).run_sync("charge me 5")
    script = Script(CHARGE_5)
    Agent(script.model(), tools=tools).run_sync("again", message_history=first.all_messages())
    assert charges.count() == 1
    assert NOT_REPEATED in str(script.returns()[-1].content)


def test_runs_of_no_given_conversation_are_each_their_own(ledger: Ledger, charges: Charges) -> None:
    """pydantic-ai gives a run without conversation_id or history a fresh one: two such runs are two
    conversations (another user, maybe), and each charges."""
    tools = guard_tools([charge_tool(charges)], ledger)
    for _ in range(2):
        Agent(Script(CHARGE_5, CHARGE_5).model(), tools=tools).run_sync("charge me 5")
    assert charges.count() == 2  # one per run: the re-plan inside each replayed


def test_a_context_without_a_conversation_is_scoped_to_its_run_with_a_warning(
    ledger: Ledger, charges: Charges, caplog: pytest.LogCaptureFixture
) -> None:
    """A scope function that finds no conversation: the run's own run_id, with one warning naming the
    setting. A re-plan inside the run replays; another run charges its own."""
    edge._warned.discard(("pydantic-ai", SETTING))  # the warning is once per process
    tools = guard_tools([charge_tool(charges)], ledger, scope=lambda ctx: None)
    with caplog.at_level("WARNING", logger="onceonly"):
        Agent(Script(CHARGE_5, CHARGE_5).model(), tools=tools).run_sync("charge me 5")
        assert charges.count() == 1
        Agent(Script(CHARGE_5).model(), tools=tools).run_sync("charge me 5")
    assert charges.count() == 2
    warnings = [r for r in caplog.records if "names no conversation" in r.getMessage()]
    assert len(warnings) == 1 and SETTING in warnings[0].getMessage()


def test_a_ledger_task_around_the_runs_wins(ledger: Ledger, charges: Charges) -> None:
    """Two runs of other conversation ids inside one ledger.task share its records."""
    tools = guard_tools([charge_tool(charges)], ledger)
    with ledger.task("order-7"):
        Agent(Script(CHARGE_5).model(), tools=tools).run_sync("charge", conversation_id="a")
        Agent(Script(CHARGE_5).model(), tools=tools).run_sync("charge", conversation_id="b")
    assert charges.count() == 1


# --- tool shapes ---------------------------------------------------------------------------------------


def test_an_async_tool_with_context_and_key_runs_once_and_its_schema_shows_neither(
    ledger: Ledger, charges: Charges, loop: asyncio.AbstractEventLoop
) -> None:
    seen: dict[str, Any] = {}

    async def charge(ctx: RunContext[None], amount: int, *, idempotency_key: str) -> str:
        """Charge the customer's card."""
        seen["key"], seen["conversation"] = idempotency_key, ctx.conversation_id
        await asyncio.sleep(0)
        charges.add(amount)
        return f"charged {amount}"

    script = Script(CHARGE_5, CHARGE_5)
    loop.run_until_complete(
        Agent(script.model(), tools=guard_tools([charge], ledger)).run("go", conversation_id="conv-1")
    )
    assert charges.count() == 1
    assert seen["conversation"] == "conv-1" and seen["key"].startswith("c%3Aconv-1:charge:")
    (tool_def,) = script.tools[0]
    assert tool_def.name == "charge" and tool_def.description == "Charge the customer's card."
    assert set(tool_def.parameters_json_schema["properties"]) == {"amount"}


def test_a_tool_object_keeps_its_name_and_settings(ledger: Ledger, charges: Charges) -> None:
    original = Tool(charge_tool(charges), name="pay", description="Pay.", max_retries=4)
    made = guard(original, ledger)
    assert made.name == "pay" and made.max_retries == 4 and made.description == "Pay."
    assert guard(original, ledger) is made  # guarded once per settings
    script = Script([("pay", {"amount": 5})], [("pay", {"amount": 5})])
    Agent(script.model(), tools=[made]).run_sync("go", conversation_id="c")
    assert charges.count() == 1
    with pytest.raises(TypeError, match="guarded already"):
        guard(made, ledger)


def test_a_ledger_tool_function_uses_its_own_settings(ledger: Ledger, charges: Charges) -> None:
    @ledger.tool(name="charge", ignore=("ctx",), passthrough=PASSTHROUGH)
    def charge(ctx: RunContext[None], amount: int) -> str:
        """Charge the customer's card."""
        charges.add(amount)
        return f"charged {amount}"

    script = Script(CHARGE_5, CHARGE_5)
    Agent(script.model(), tools=guard_tools([charge], ledger)).run_sync("go", conversation_id="conv-1")
    assert charges.count() == 1
    assert NOT_REPEATED in str(script.returns()[1].content)
    assert set(script.tools[0][0].parameters_json_schema["properties"]) == {"amount"}


def test_a_ledger_tool_function_whose_context_is_in_its_key_is_refused(ledger: Ledger) -> None:
    @ledger.tool(name="charge")
    def charge(ctx: RunContext[None], amount: int) -> str:
        return "charged"

    with pytest.raises(TypeError, match=r"ignore=\('ctx',\)"):
        guard(charge, ledger)


def test_a_guarded_toolset_guards_the_named_tools_only(ledger: Ledger, charges: Charges) -> None:
    looked: list[int] = []

    def balance(account: int) -> str:
        """Read the balance."""
        looked.append(account)
        return "100"

    toolset = guarded(FunctionToolset([charge_tool(charges), balance]), ledger, tools=["charge"])
    assert isinstance(toolset, GuardedToolset)
    turn = [("charge", {"amount": 5}), ("balance", {"account": 1})]
    script = Script(turn, turn)
    Agent(script.model(), toolsets=[toolset]).run_sync("go", conversation_id="conv-1")
    assert charges.count() == 1
    assert looked == [1, 1]  # reads are not recorded
    assert any(NOT_REPEATED in str(p.content) for p in script.returns() if p.tool_name == "charge")


def test_a_guarded_toolset_tells_unknown_without_ending_the_run(ledger: Ledger, charges: Charges) -> None:
    script = Script(CHARGE_5, CHARGE_5)
    agent = Agent(script.model(), toolsets=[guarded(FunctionToolset([lost_answer_tool(charges)]), ledger)])
    assert agent.run_sync("go", conversation_id="conv-1").output == "done"
    assert charges.count() == 1
    assert all(UNKNOWN in str(p.content) for p in script.returns())


# --- control flow -------------------------------------------------------------------------------------


def approval_tool(charges: Charges) -> Callable[..., str]:
    def charge(ctx: RunContext[None], amount: int) -> str:
        """Charge the customer's card, once a person approved it."""
        if not ctx.tool_call_approved:
            raise ApprovalRequired({"amount": amount})
        charges.add(amount)
        return f"charged {amount}"

    return charge


@pytest.mark.parametrize("way", ["tool", "toolset"])
def test_approval_required_passes_through_and_the_approved_call_runs_once(
    ledger: Ledger, charges: Charges, way: str
) -> None:
    """ApprovalRequired is control flow: the run ends with the deferred request, nothing is recorded as
    failed or unknown, and the call approved later runs once (a re-plan after it replays)."""
    fn = approval_tool(charges)
    kw: dict[str, Any] = (
        {"tools": guard_tools([fn], ledger)}
        if way == "tool"
        else {"toolsets": [guarded(FunctionToolset([fn]), ledger)]}
    )
    agent = Agent(Script(CHARGE_5).model(), output_type=[str, DeferredToolRequests], **kw)
    first = agent.run_sync("charge me 5", conversation_id="conv-1")
    assert isinstance(first.output, DeferredToolRequests)
    (asked,) = first.output.approvals
    assert charges.count() == 0
    assert [r.state for r in ledger.list()] in ([], [State.FAILED])  # the claim given back, no attempt
    assert all(r.attempts == 0 for r in ledger.list())
    script = Script(CHARGE_5)
    agent = Agent(script.model(), output_type=[str, DeferredToolRequests], **kw)
    resumed = agent.run_sync(
        message_history=first.all_messages(),
        deferred_tool_results=DeferredToolResults(approvals={asked.tool_call_id: True}),
    )
    assert resumed.output == "done"
    assert charges.count() == 1
    assert NOT_REPEATED in str(script.returns()[-1].content)  # the model's own re-plan replayed


def test_call_deferred_passes_through_with_the_claim_given_back(ledger: Ledger, charges: Charges) -> None:
    def charge(amount: int) -> str:
        """Charge the card: done by another system."""
        raise CallDeferred({"amount": amount})

    agent = Agent(
        Script(CHARGE_5).model(), output_type=[str, DeferredToolRequests], tools=guard_tools([charge], ledger)
    )
    result = agent.run_sync("charge me 5", conversation_id="conv-1")
    assert isinstance(result.output, DeferredToolRequests) and len(result.output.calls) == 1
    assert all(r.attempts == 0 and r.state is State.FAILED for r in ledger.list())


def test_model_retry_from_the_tool_is_not_recorded_and_the_next_call_runs(ledger: Ledger, charges: Charges) -> None:
    """ModelRetry says the tool did not act: the claim is given back, the model reads pydantic-ai's
    retry prompt, and its next call runs (once)."""
    tries: list[int] = []

    def charge(amount: int) -> str:
        """Charge the customer's card."""
        tries.append(amount)
        if len(tries) == 1:
            raise ModelRetry("the card number was refused before anything was charged: ask again")
        charges.add(amount)
        return f"charged {amount}"

    script = Script(CHARGE_5, CHARGE_5, CHARGE_5)
    Agent(script.model(), tools=guard_tools([charge], ledger)).run_sync("go", conversation_id="conv-1")
    assert tries == [5, 5]
    assert charges.count() == 1
    (record,) = ledger.list()
    assert record.state is State.CONFIRMED and record.attempts == 1  # the refused call counted no attempt
    (retry,) = script.retries()
    assert "refused" in str(retry.content)
    assert NOT_REPEATED in str(script.returns()[-1].content)


# --- refusals --------------------------------------------------------------------------------------------


def test_a_toolset_tool_that_asks_for_the_key_is_refused(ledger: Ledger) -> None:
    def charge(amount: int, idempotency_key: str) -> str:
        return "charged"

    agent = Agent(Script(CHARGE_5).model(), toolsets=[guarded(FunctionToolset([charge]), ledger)])
    with pytest.raises(TypeError, match="idempotency_key"):
        agent.run_sync("go", conversation_id="c")


def test_guard_refuses_what_is_no_tool(ledger: Ledger) -> None:
    with pytest.raises(TypeError, match="takes a pydantic-ai Tool or a function"):
        guard(42, ledger)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="list of tool names"):
        guarded(FunctionToolset([]), ledger, tools="charge")


def test_pydantic_ais_own_timeout_leaves_the_call_running_and_the_retry_replays_it(
    ledger: Ledger, charges: Charges, loop: asyncio.AbstractEventLoop
) -> None:
    """The tool's pydantic-ai ``timeout=`` passes while the provider is still answering: the model is told
    to retry, the call runs on and its late answer is recorded, so the model's retry is a replay, not a
    second charge."""
    answered = asyncio.Event()

    async def charge(amount: int) -> str:
        """Charge the customer's card."""
        charges.add(amount)
        await answered.wait()
        return f"charged {amount}"

    class Late(Script):
        def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            # pydantic-ai runs a sync model function in a worker thread: the loop goes on meanwhile.
            if self.calls == 1:
                loop.call_soon_threadsafe(answered.set)  # the late answer arrives while the model thinks
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline and not any(r.state.value == "confirmed" for r in ledger.list()):
                    time.sleep(0.01)  # ... and is recorded before the model asks again
            return super().__call__(messages, info)

    script = Late(CHARGE_5, CHARGE_5)

    async def main() -> None:
        tools = guard_tools([Tool(charge, timeout=0.2, max_retries=2)], ledger)
        await Agent(script.model(), tools=tools).run("go", conversation_id="conv-1")
        await asyncio.sleep(0.1)  # the late outcome's write

    loop.run_until_complete(main())
    assert charges.count() == 1
    (retry,) = script.retries()
    assert "Timed out" in str(retry.content)
    assert NOT_REPEATED in str(script.returns()[-1].content)
