"""onceonly.openai_agents: SDK function tools that act once per conversation, run by the real Runner.

A scripted model (the SDK's own ``agents.testing.ScriptedModel``) stands in for a real one: no API key,
no network. Side effects are rows in a SQLite table of the test's own, so each test can show the
duplicate without onceonly and its absence with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import re
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest

pytest.importorskip("agents")

import agents
from agents import Agent, FunctionTool, RunConfig, RunContextWrapper, Runner, WebSearchTool
from agents.mcp import MCPServerStdio, MCPServerStdioParams
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call
from agents.tool_context import ToolContext

import onceonly
from onceonly import Ledger
from onceonly.openai_agents import conversation_scope, function_tool, guard, guard_tools, mcp_meta_resolver

ROOT = Path(__file__).resolve().parent.parent
UNKNOWN = "The outcome of this action is unknown"
REPLAYED = re.compile(r"This action was already done at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ and was not repeated\.")


class Charges:
    """The side effect: one row per charge that ran, in a SQLite file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS charges (customer TEXT, cents INTEGER)")

    def add(self, customer: str, cents: int) -> int:
        with sqlite3.connect(self.path) as conn:
            cur = conn.execute("INSERT INTO charges VALUES (?, ?)", (customer, cents))
        return int(cur.lastrowid or 0)

    def count(self) -> int:
        with sqlite3.connect(self.path) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM charges").fetchone()[0])


@pytest.fixture(name="charges")
def fixture_charges(tmp_path: Path) -> Charges:
    """An empty table of charges."""
    return Charges(tmp_path / "charges.db")


@pytest.fixture(name="sqlite_ledger")
def fixture_sqlite_ledger(tmp_path: Path) -> Iterator[Ledger]:
    """A fresh SQLite ledger on the real clock (the SDK runs on the event loop's real time)."""
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    yield ledger
    ledger.close()


def call(name: str, call_id: str, **arguments: Any) -> Any:
    return function_call(name, arguments, call_id=call_id)


def run(agent: Agent[Any], group_id: str | None = "conv-1", **kwargs: Any) -> Any:
    """``Runner.run`` with tracing off (no export), in a conversation."""
    config = RunConfig(group_id=group_id, tracing_disabled=True)
    return asyncio.run(Runner.run(agent, "charge the customer", run_config=config, **kwargs))


def told(model: ScriptedModel) -> list[str]:
    """What the model read back from its tool calls, in order (the input of its last turn)."""
    last = model.calls[-1].input
    return [
        str(item["output"]) for item in last if isinstance(item, dict) and item.get("type") == "function_call_output"
    ]


def replan_script(tool: str, **arguments: Any) -> ScriptedModel:
    """The model calls the tool, then the same call again under a new call id, then ends."""
    return ScriptedModel(
        [[call(tool, "call_A", **arguments)], [call(tool, "call_B", **arguments)], [assistant_message("done")]]
    )


# --- the schema the model sees ------------------------------------------------------------------------


def test_schema_is_the_sdks_without_idempotency_key_or_context(sqlite_ledger: Ledger, charges: Charges) -> None:
    """The tool the model is sent has the SDK's strict schema: no ``idempotency_key`` (the ledger fills it
    in: the function gets the call's key) and no ``ToolContext`` (the SDK passes it: never in the key)."""
    seen: dict[str, Any] = {}

    @function_tool(sqlite_ledger)
    async def charge(ctx: ToolContext[Any], customer: str, cents: int, *, idempotency_key: str) -> str:
        """Charge a customer's card.

        Args:
            customer: the customer id.
            cents: the amount.
        """
        seen.update(key=idempotency_key, call_id=ctx.tool_call_id)
        return f"charge #{charges.add(customer, cents)}"

    model = ScriptedModel([[call("charge", "call_A", customer="c1", cents=500)], [assistant_message("done")]])
    run(Agent(name="billing", model=model, tools=[charge]))
    [sent] = model.calls[0].tools
    assert isinstance(sent, FunctionTool) and sent.name == "charge" and sent.strict_json_schema
    assert sent.params_json_schema["required"] == ["customer", "cents"]
    assert sent.params_json_schema["additionalProperties"] is False
    assert "idempotency_key" not in json.dumps(sent.params_json_schema)
    assert sent.description == "Charge a customer's card."
    [record] = sqlite_ledger.list()
    assert seen == {"key": record.key, "call_id": "call_A"}
    assert record.scope == "conv-1" and json.loads(record.args_json) == {"cents": 500, "customer": "c1"}


def test_ledger_tool_on_a_function_tool_names_this_integration(sqlite_ledger: Ledger) -> None:
    """``@ledger.tool`` over a ``FunctionTool`` is a TypeError pointing here, and the names it gives exist."""

    @agents.function_tool
    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return "charged"

    with pytest.raises(TypeError, match=r"onceonly\.openai_agents\.guard_tools\(\[tool\], ledger\)"):
        sqlite_ledger.tool(cast(Any, charge))
    assert callable(guard_tools) and callable(function_tool)
    with pytest.raises(TypeError, match="guard_tools"):
        function_tool(sqlite_ledger)(cast(Any, charge))


# --- a lost answer, a re-plan -------------------------------------------------------------------------


def test_sdk_timeout_then_replan_charges_once(store_url: str, charges: Charges) -> None:
    """The charge's answer comes after the SDK's time limit; the model is told the outcome is unknown,
    re-issues the call under a new call id, and reads that it was already done: one charge. The same
    script against the SDK's plain ``function_tool`` charges twice.

    The first call blocks until the model's next turn releases it, so the limit always passes; the model
    re-issues the call once the late answer is recorded, so the second call is one read of the ledger."""
    limit = 0.5
    release: asyncio.Event | None = None

    async def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        assert release is not None
        number = charges.add(customer, cents)
        await release.wait()  # the answer is late: the SDK stops waiting, the charge has happened
        return f"charge #{number}"

    def script(recorded: Callable[[], bool]) -> ScriptedModel:
        async def replan(_: Any) -> Any:
            assert release is not None
            release.set()  # the late answer arrives while the model thinks
            while not recorded():
                await asyncio.sleep(0.01)
            return [call("charge", "call_B", customer="c1", cents=500)]

        return ScriptedModel(
            [[call("charge", "call_A", customer="c1", cents=500)], ModelStep.respond(replan), [assistant_message("ok")]]
        )

    async def go(tool: Any, model: ScriptedModel) -> None:
        nonlocal release
        release = asyncio.Event()
        config = RunConfig(group_id="conv-1", tracing_disabled=True)
        await Runner.run(Agent(name="billing", model=model, tools=[tool]), "charge c1 $5", run_config=config)

    plain = script(lambda: True)
    asyncio.run(go(agents.function_tool(charge, timeout=limit), plain))
    assert charges.count() == 2  # without onceonly: charged twice
    assert told(plain)[0] == "Tool 'charge' timed out after 0.5 seconds."

    ledger = Ledger.open(store_url)  # each store: SQLite, Redis, PostgreSQL
    try:
        guarded = script(lambda: [r.state for r in ledger.list()] == [onceonly.State.CONFIRMED])
        asyncio.run(go(function_tool(ledger, tool_timeout=limit)(charge), guarded))
    finally:
        ledger.close()
    assert charges.count() == 3  # with onceonly: one more
    first, second = told(guarded)
    assert first.startswith(UNKNOWN) and "Do not issue it again" in first
    assert REPLAYED.match(second) and second.endswith("Its result: charge #3")


def test_sync_tool_past_onceonlys_timeout_then_replan_charges_once(sqlite_ledger: Ledger, charges: Charges) -> None:
    """A sync tool (the SDK's time limit is for async ones only): onceonly's own ``timeout=`` passes while
    the charge waits for its answer. The model reads that the outcome is unknown; the answer, when it
    comes, is recorded; the model's re-issue under a new call id replays it: one charge."""
    release = threading.Event()

    @function_tool(sqlite_ledger, timeout=0.05)
    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        number = charges.add(customer, cents)
        release.wait(60)  # the answer is late (the bound only keeps a failing test from hanging)
        return f"charge #{number}"

    async def replan(_: Any) -> Any:
        release.set()
        while [r.state for r in sqlite_ledger.list()] != [onceonly.State.CONFIRMED]:
            await asyncio.sleep(0.01)
        return [call("charge", "call_B", customer="c1", cents=500)]

    model = ScriptedModel(
        [[call("charge", "call_A", customer="c1", cents=500)], ModelStep.respond(replan), [assistant_message("ok")]]
    )
    run(Agent(name="billing", model=model, tools=[charge]))
    assert charges.count() == 1
    first, second = told(model)
    assert first.startswith(UNKNOWN) and "Do not issue it again" in first
    assert REPLAYED.match(second) and second.endswith("Its result: charge #1")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_replan_with_a_new_call_id_replays(asynchronous: bool, sqlite_ledger: Ledger, charges: Charges) -> None:
    """Sync and async tools: the model issues the same call again under a new call id (it did not trust
    the answer): with onceonly one charge and the model reads the replay; without, two."""

    def charge_sync(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    async def charge_async(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    fn: Callable[..., Any] = charge_async if asynchronous else charge_sync
    run(
        Agent(
            name="billing", model=replan_script(fn.__name__, customer="c1", cents=500), tools=[agents.function_tool(fn)]
        )
    )
    assert charges.count() == 2

    model = replan_script(fn.__name__, customer="c1", cents=500)
    run(Agent(name="billing", model=model, tools=[function_tool(sqlite_ledger)(fn)]))
    assert charges.count() == 3
    first, second = told(model)
    assert first == "charge #3"
    assert REPLAYED.match(second) and second.endswith("Its result: charge #3")


@pytest.mark.parametrize("how", ["function_tool", "guard"])
def test_an_integer_sent_as_500_500_string_and_500_0_is_one_charge(
    how: str, sqlite_ledger: Ledger, charges: Charges
) -> None:
    """The key is made from the arguments as the tool sees them (the tool's own schema, coerced as
    pydantic does): ``500``, ``"500"`` and ``500.0`` are one operation. Without onceonly, three charges;
    arguments the schema refuses reach neither the tool nor the ledger."""

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)} of {cents!r}"

    def script() -> ScriptedModel:
        return ScriptedModel(
            [
                [call("charge", "call_A", customer="c1", cents=500)],
                [function_call("charge", '{"customer": "c1", "cents": "500"}', call_id="call_B")],
                [function_call("charge", '{"customer": "c1", "cents": 500.0}', call_id="call_C")],
                [function_call("charge", '{"customer": "c1", "cents": "lots"}', call_id="call_D")],
                [assistant_message("done")],
            ]
        )

    run(Agent(name="billing", model=script(), tools=[agents.function_tool(charge)]))
    assert charges.count() == 3  # the SDK coerces each to 500 and runs each

    if how == "function_tool":
        tool = function_tool(sqlite_ledger)(charge)
    else:
        tool = guard(agents.function_tool(charge), sqlite_ledger)
    model = script()
    run(Agent(name="billing", model=model, tools=[tool]))
    assert charges.count() == 4
    outs = told(model)
    assert outs[0] == "charge #4 of 500"
    assert all(REPLAYED.match(o) and o.endswith("charge #4 of 500") for o in outs[1:3]), outs
    assert outs[3].startswith("An error occurred")  # refused, as the SDK refuses it: nothing ran or was recorded
    assert [r.state.value for r in sqlite_ledger.list()] == ["confirmed"]


def test_the_same_call_twice_in_one_turn_runs_once(sqlite_ledger: Ledger, charges: Charges) -> None:
    """Two parallel calls with the same arguments in one model turn (the SDK runs them at once): the
    second waits for the first's outcome and replays it."""

    @function_tool(sqlite_ledger)
    async def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        await asyncio.sleep(0)
        return f"charge #{charges.add(customer, cents)}"

    model = ScriptedModel(
        [
            [call("charge", "call_A", customer="c1", cents=500), call("charge", "call_B", customer="c1", cents=500)],
            [assistant_message("done")],
        ]
    )
    run(Agent(name="billing", model=model, tools=[charge]))
    assert charges.count() == 1
    ran, replayed = sorted(told(model), key=lambda text: bool(REPLAYED.match(text)))  # either may claim first
    assert ran == "charge #1" and REPLAYED.match(replayed) and replayed.endswith("charge #1")


def test_two_conversations_charge_twice_and_each_once(sqlite_ledger: Ledger, charges: Charges) -> None:
    """The key is the conversation, the tool and the arguments: the same call in two ``group_id``s runs
    twice; run again in either conversation it replays. Arguments in another order are the same call."""

    @function_tool(sqlite_ledger)
    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    def once(group: str, arguments: str) -> list[str]:
        model = ScriptedModel([[function_call("charge", arguments, call_id="call_1")], [assistant_message("ok")]])
        run(Agent(name="billing", model=model, tools=[charge]), group_id=group)
        return told(model)

    assert once("conv-1", '{"customer": "c1", "cents": 500}') == ["charge #1"]
    assert once("conv-2", '{"customer": "c1", "cents": 500}') == ["charge #2"]
    again = once("conv-1", '{"cents":500,"customer":"c1"}')
    assert REPLAYED.match(again[0]) and again[0].endswith("charge #1")
    assert charges.count() == 2
    assert sorted(r.scope for r in sqlite_ledger.list()) == ["conv-1", "conv-2"]


def test_scope_falls_back_to_the_ledger_task_then_the_run(
    sqlite_ledger: Ledger, charges: Charges, caplog: pytest.LogCaptureFixture
) -> None:
    """No ``group_id``: the ``ledger.task()`` around the run is the conversation (a session's id, say),
    else the run's own scope, never the ledger's process-wide one."""
    from agents import SQLiteSession

    @function_tool(sqlite_ledger)
    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    session = SQLiteSession("session-7")
    with sqlite_ledger.task(session.session_id):
        run(
            Agent(name="b", model=replan_script("charge", customer="c1", cents=5), tools=[charge]),
            None,
            session=session,
        )
    with caplog.at_level(logging.WARNING, logger="onceonly"):
        run(Agent(name="b", model=replan_script("charge", customer="c1", cents=5), tools=[charge]), None)
    assert charges.count() == 2
    scopes = sorted(r.scope for r in sqlite_ledger.list())
    assert scopes[1] == "session-7" and scopes[0].startswith("r:") and "default" not in scopes


@pytest.mark.parametrize("tracing", [False, True], ids=["tracing-off", "tracing-on"])
def test_two_sessions_without_group_id_charge_twice_and_each_replan_once(
    tracing: bool, sqlite_ledger: Ledger, charges: Charges, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK's own session tutorial: ``session=`` and no ``group_id``. Two users' runs with the same
    arguments each charge once (before, the second replayed the first's charge); a re-plan inside one
    run replays; one warning names the setting that shares records across a conversation's runs."""
    from agents import SQLiteSession, set_trace_processors

    @function_tool(sqlite_ledger)
    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    set_trace_processors([])  # tracing on, exported nowhere
    outputs = []
    with caplog.at_level(logging.WARNING, logger="onceonly"):
        for user in ("alice", "bob"):
            model = replan_script("charge", customer="c1", cents=500)
            config = RunConfig(tracing_disabled=not tracing)
            agent = Agent(name="billing", model=model, tools=[charge])
            asyncio.run(Runner.run(agent, "charge", run_config=config, session=SQLiteSession(user)))
            outputs.append(told(model))
    assert charges.count() == 2, "the second user's run must charge, not replay the first user's"
    for n, out in enumerate(outputs, start=1):
        assert out[0] == f"charge #{n}" and "not repeated" in out[1]  # the re-plan replayed, and said so
    warnings = [r.getMessage() for r in caplog.records if "names no conversation" in r.getMessage()]
    assert len(warnings) <= 1 and all("group_id" in w for w in warnings)
    assert len({r.scope for r in sqlite_ledger.list()}) == 2


def test_conversation_scope_reads_group_trace_and_hashes_long_ids() -> None:
    """``conversation_scope``: the run's ``group_id``, else the current trace's group; an id with
    whitespace or over 100 characters is hashed; nothing names the conversation: ``None``."""
    ctx = ToolContext(None, tool_name="t", tool_call_id="c", tool_arguments="{}", run_config=RunConfig(group_id="g-1"))
    assert conversation_scope(ctx) == "g-1"
    spaced = ToolContext(
        None, tool_name="t", tool_call_id="c", tool_arguments="{}", run_config=RunConfig(group_id="a b")
    )
    hashed = conversation_scope(spaced)
    assert hashed is not None and hashed.startswith("group-") and len(hashed) == 46
    assert conversation_scope(RunContextWrapper(None)) is None
    with agents.trace("workflow", group_id="thread-9", disabled=False):
        assert conversation_scope(RunContextWrapper(None)) == "thread-9"


# --- what the model is told ---------------------------------------------------------------------------


def test_unknown_outcome_tells_the_model_not_to_issue_it_again(sqlite_ledger: Ledger, charges: Charges) -> None:
    """The charge happens and then the connection times out: the outcome is unknown. Without onceonly the
    SDK says "please try again", the model does, and the customer is charged twice; with onceonly the model
    reads "do not issue it again", the run finishes, and its re-issue is refused the same way."""

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        charges.add(customer, cents)
        raise TimeoutError("read timed out")

    plain = replan_script("charge", customer="c1", cents=500)
    run(Agent(name="billing", model=plain, tools=[agents.function_tool(charge)]))
    assert told(plain) == ["An error occurred while running the tool. Please try again."] * 2
    assert charges.count() == 2

    model = replan_script("charge", customer="c1", cents=500)
    result = run(Agent(name="billing", model=model, tools=[function_tool(sqlite_ledger)(charge)]))
    assert result.final_output == "done"
    assert charges.count() == 3
    for text in told(model):
        assert text.startswith(UNKNOWN) and "Do not issue it again" in text and "onceonly" not in text
    [record] = sqlite_ledger.list()
    assert record.state is onceonly.State.NEEDS_REVIEW


def test_an_error_is_never_replayed(sqlite_ledger: Ledger, charges: Charges) -> None:
    """The tool fails before charging; the SDK's failure handler tells the model; the model tries again
    and the charge runs: the error text was not recorded as the result (the guard is below the handler)."""
    failures = [ValueError("card declined by a flaky check")]

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        if failures:
            raise failures.pop()
        return f"charge #{charges.add(customer, cents)}"

    model = replan_script("charge", customer="c1", cents=500)
    run(Agent(name="billing", model=model, tools=[function_tool(sqlite_ledger)(charge)]))
    assert told(model) == ["An error occurred while running the tool. Please try again.", "charge #1"]
    [record] = sqlite_ledger.list()
    assert record.state is onceonly.State.CONFIRMED and record.attempts == 2


def test_conflict_and_tell_model_false(sqlite_ledger: Ledger, charges: Charges) -> None:
    """``key=`` names the operation: the same customer with another amount is a conflict the model is
    told about (with the earlier result). With ``tell_model=False`` a replay reads as the original did."""

    @function_tool(sqlite_ledger, key=("order",), tell_model=False)
    def charge(order: str, cents: int) -> str:
        """Charge an order."""
        return f"charge #{charges.add(order, cents)}"

    model = ScriptedModel(
        [
            [call("charge", "call_A", order="o-1", cents=500)],
            [call("charge", "call_B", order="o-1", cents=500)],
            [call("charge", "call_C", order="o-1", cents=900)],
            [assistant_message("done")],
        ]
    )
    run(Agent(name="billing", model=model, tools=[charge]))
    first, replay, conflict = told(model)
    assert first == replay == "charge #1"
    assert "already issued with other details" in conflict and "charge #1" in conflict
    assert charges.count() == 1


def test_structured_output_replays_as_the_same_output(sqlite_ledger: Ledger, charges: Charges) -> None:
    """A tool that returns a ``ToolOutputText``: the model reads its text; a replay says so, with the text."""

    @function_tool(sqlite_ledger)
    def charge(customer: str, cents: int) -> agents.ToolOutputText:
        """Charge a customer's card."""
        return agents.ToolOutputText(text=f"charge #{charges.add(customer, cents)}")

    model = replan_script("charge", customer="c1", cents=500)
    run(Agent(name="billing", model=model, tools=[charge]))
    first, second = told(model)
    assert first == "[{'type': 'input_text', 'text': 'charge #1'}]"
    assert REPLAYED.match(second) and second.endswith("Its result: charge #1")
    [record] = sqlite_ledger.list()
    assert json.loads(record.result_json or "") == {"type": "text", "text": "charge #1"}


def test_an_output_with_no_stored_form_is_still_confirmed(sqlite_ledger: Ledger, charges: Charges) -> None:
    """The charge happened, and its output has no text (its ``__str__`` raises): the record is confirmed
    with a description, never a failed attempt that would charge again."""

    class Receipt:
        def __str__(self) -> str:
            raise RuntimeError("no text form")

    @function_tool(sqlite_ledger)
    def charge(customer: str) -> object:
        """Charge a customer's card."""
        charges.add(customer, 5)
        return Receipt()

    def invoke(call_id: str) -> Any:
        ctx = ToolContext(None, tool_name="charge", tool_call_id=call_id, tool_arguments='{"customer":"c1"}',
                          run_config=RunConfig(group_id="conv-1"))  # fmt: skip
        return asyncio.run(charge.on_invoke_tool(ctx, '{"customer":"c1"}'))

    assert isinstance(invoke("call_A"), Receipt)
    again = invoke("call_B")
    assert REPLAYED.match(again) and "$unstorable" in again and "Receipt" in again
    assert charges.count() == 1
    [record] = sqlite_ledger.list()
    assert record.state is onceonly.State.CONFIRMED


# --- guard_tools on existing tools --------------------------------------------------------------------


def test_guard_tools_keeps_raw_arguments_context_and_other_tools(sqlite_ledger: Ledger, charges: Charges) -> None:
    """``guard_tools`` guards the ``FunctionTool``s and passes a hosted tool as it is; the original invoker
    gets the model's JSON unchanged and the ``ToolContext``; guarding the same tool again gives the same
    guarded tool, and a second function under the same name is refused."""
    seen: list[tuple[str, str]] = []

    async def on_invoke(ctx: ToolContext[Any], args_json: str) -> str:
        seen.append((ctx.tool_call_id, args_json))
        return f"charge #{charges.add(json.loads(args_json)['customer'], 5)}"

    raw = FunctionTool(
        name="charge",
        description="Charge a customer's card.",
        params_json_schema={
            "type": "object",
            "properties": {"customer": {"type": "string"}},
            "required": ["customer"],
            "additionalProperties": False,
        },
        on_invoke_tool=on_invoke,
    )
    search = WebSearchTool()
    guarded, same_search = guard_tools([raw, search], sqlite_ledger)
    assert same_search is search and guarded is not raw and guarded.name == "charge"
    assert guard_tools([raw], sqlite_ledger)[0] is guarded
    assert guard_tools([guarded], sqlite_ledger)[0] is guarded

    model = ScriptedModel(
        [
            [function_call("charge", '{ "customer" : "c1" }', call_id="call_A")],
            [function_call("charge", '{"customer":"c1"}', call_id="call_B")],
            [assistant_message("done")],
        ]
    )
    run(Agent(name="billing", model=model, tools=[guarded]))
    assert seen == [("call_A", '{ "customer" : "c1" }')]
    assert charges.count() == 1

    async def other(ctx: ToolContext[Any], args_json: str) -> str:
        return "another operation"

    with pytest.raises(ValueError, match="another tool named 'charge'"):
        guard(FunctionTool(name="charge", description="", params_json_schema=raw.params_json_schema,
                           on_invoke_tool=other), sqlite_ledger)  # fmt: skip
    with pytest.raises(TypeError, match="guarded already"):
        guard(guarded, sqlite_ledger)

    # Arguments that are not a JSON object never reach a hand-made invoker (it might act on them).
    ctx = ToolContext(None, tool_name="charge", tool_call_id="call_C", tool_arguments='["c1"]')
    with pytest.raises(agents.ModelBehaviorError, match="expected a JSON object"):
        asyncio.run(guarded.on_invoke_tool(ctx, '["c1"]'))
    assert len(seen) == 1 and charges.count() == 1


def test_a_tool_built_again_from_the_same_function_shares_its_records(sqlite_ledger: Ledger, charges: Charges) -> None:
    """Tools made per request (``agents.function_tool(charge)`` each time, then guarded) are one tool to
    the ledger: the second one's call replays the first one's."""

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    outputs = []
    for call_id in ("call_A", "call_B"):
        [tool] = guard_tools([agents.function_tool(charge)], sqlite_ledger)
        model = ScriptedModel([[call("charge", call_id, customer="c1", cents=5)], [assistant_message("ok")]])
        run(Agent(name="billing", model=model, tools=[tool]))
        outputs += told(model)
    assert charges.count() == 1
    assert outputs[0] == "charge #1" and REPLAYED.match(outputs[1])


def test_bad_settings_say_what_to_do(sqlite_ledger: Ledger) -> None:
    """Unknown keywords, the SDK's timeout on a sync function, a key field that is not an argument and a
    schema that asks the model for the key are refused with the way out."""

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return "charged"

    with pytest.raises(TypeError, match="tool_timeout="):
        function_tool(sqlite_ledger, timeout_seconds=3)
    with pytest.raises(TypeError, match="make it async, or use timeout="):
        function_tool(sqlite_ledger, tool_timeout=3)(charge)
    with pytest.raises(TypeError, match=r"takes the fields \['customer', 'cents'\]"):
        function_tool(sqlite_ledger, key=("order",))(charge)

    def asks(customer: str, idempotency_key: str) -> str:
        """Charge."""
        return "charged"

    with pytest.raises(TypeError, match="model would choose keys"):
        guard(agents.function_tool(asks), sqlite_ledger)


# --- MCP ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("guarded", [False, True], ids=["plain-server", "onceonly"])
def test_mcp_meta_resolver_runs_the_upstream_call_once(guarded: bool, tmp_path: Path) -> None:
    """A real stdio MCP server process: the model calls its ``charge`` and re-plans the same call under a
    new call id, then another conversation makes the same call. The plain server charges for each call.
    Guarded by onceonly (``onceonly.mcp.guard_server``) and called with ``mcp_meta_resolver()``, the
    re-plan carries the first call's key and runs once, and the other conversation's key is its own."""
    charges_db = tmp_path / "upstream.db"
    ledger = [f"sqlite:///{tmp_path / 'upstream-ledger.db'}"] if guarded else []
    params: MCPServerStdioParams = {
        "command": sys.executable,
        "args": [str(ROOT / "tests" / "_mcp_charge_server.py"), str(charges_db), *ledger],
        "env": {"PYTHONPATH": str(ROOT / "src")},
    }

    async def go() -> list[str]:
        meta = mcp_meta_resolver() if guarded else None
        read: list[str] = []
        async with MCPServerStdio(params, tool_meta_resolver=meta, client_session_timeout_seconds=30) as server:
            for group, model in (
                ("conv-1", replan_script("charge", customer="c1", cents=500)),
                (
                    "conv-2",
                    ScriptedModel([[call("charge", "call_A", customer="c1", cents=500)], [assistant_message("ok")]]),
                ),
            ):
                agent = Agent(name="billing", model=model, mcp_servers=[server])
                await Runner.run(agent, "charge", run_config=RunConfig(group_id=group, tracing_disabled=True))
                read += told(model)
        return read

    first, again, other = asyncio.run(go())
    with sqlite3.connect(charges_db) as conn:
        ran = conn.execute("SELECT COUNT(*) FROM charges").fetchone()[0]
    assert "charge #1" in first
    if guarded:
        assert ran == 2
        assert "This action was already done at" in again and "charge #1" in again
        assert "charge #2" in other and "already done" not in other
    else:
        assert ran == 3 and "charge #2" in again and "charge #3" in other


def test_mcp_meta_resolver_key_is_the_conversation_tool_and_arguments(sqlite_ledger: Ledger) -> None:
    """The key does not change with the call id or the order of the arguments, and does with the
    conversation, the tool or an argument; with no conversation it comes from the ledger's task, or is
    left out."""
    from agents.mcp import MCPToolMetaContext

    def meta(group: str | None, tool: str, call_id: str, **arguments: Any) -> dict[str, Any] | None:
        ctx = ToolContext(None, tool_name=tool, tool_call_id=call_id, tool_arguments="{}",
                          run_config=RunConfig(group_id=group))  # fmt: skip
        return mcp_meta_resolver()(MCPToolMetaContext(ctx, "payments", tool, dict(arguments)))

    base = meta("conv-1", "charge", "call_A", customer="c1", cents=5)
    assert base is not None and base["dev.onceonly/scope"] == "conv-1"
    assert base == meta("conv-1", "charge", "call_B", cents=5, customer="c1")
    assert base != meta("conv-2", "charge", "call_A", customer="c1", cents=5)
    assert base != meta("conv-1", "refund", "call_A", customer="c1", cents=5)
    assert base != meta("conv-1", "charge", "call_A", customer="c1", cents=6)
    assert meta(None, "charge", "call_A") is None
    ctx = ToolContext(None, tool_name="charge", tool_call_id="c", tool_arguments="{}")
    with sqlite_ledger.task("session-7"):
        got = mcp_meta_resolver(sqlite_ledger)(MCPToolMetaContext(ctx, "payments", "charge", {}))
    assert got is not None and got["dev.onceonly/scope"] == "session-7"


def test_the_sdk_is_imported_only_by_the_integration() -> None:
    """``import onceonly`` loads no Agents SDK; ``import onceonly.openai_agents`` without it is an
    ImportError that names the extra to install."""
    light = "import sys, onceonly; print('agents' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", light], capture_output=True, text=True, check=True).stdout == "False\n"
    missing = "import sys; sys.modules['agents'] = None; import onceonly.openai_agents"
    done = subprocess.run([sys.executable, "-c", missing], capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "pip install 'onceonly[openai-agents] @ git+" in done.stderr


# --- the docs -----------------------------------------------------------------------------------------


def _doc_snippets() -> tuple[str, list[str]]:
    """docs/openai_agents.md: its set-up block, and every Python block after it that says what it prints."""
    text = (ROOT / "docs" / "openai_agents.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    setup = next(i for i, b in enumerate(blocks) if b.startswith("import asyncio\nimport re\n"))
    return blocks[setup], [b for b in blocks[setup + 1 :] if "# -> " in b]


@pytest.mark.parametrize("index", range(len(_doc_snippets()[1])))
def test_the_docs_snippets_run_and_print_what_they_say(
    index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each snippet of docs/openai_agents.md runs after its set-up block, in a directory of its own, and
    prints, line by line, what its ``# -> ...`` comments say."""
    setup, snippets = _doc_snippets()
    snippet = snippets[index]
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    namespace: dict[str, Any] = {"__name__": "snippet"}
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(setup + "\n" + snippet, "snippet.py", "exec"), namespace)
    finally:
        if "ledger" in namespace:
            namespace["ledger"].close()
    expected = [line.split("# -> ", 1)[1] for line in snippet.splitlines() if "# -> " in line]
    assert printed.getvalue().splitlines() == expected


# --- the example --------------------------------------------------------------------------------------


def test_example_charges_once_and_tells_the_model(tmp_path: Path) -> None:
    """examples/openai_agents_charge.py runs offline: two charges without onceonly, one with, and the
    model's re-issue read as a replay."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "openai_agents_charge.py")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "TMPDIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert "without onceonly: 2 charges" in out.stdout
    assert "with onceonly: 1 charge" in out.stdout
    assert "This action was already done at" in out.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []
