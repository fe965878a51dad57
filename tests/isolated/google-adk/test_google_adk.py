"""onceonly.google_adk: ADK function tools that act once per session, run by ADK's real Runner.

A scripted model (a ``BaseLlm`` subclass: ADK's own model interface) stands in for a real one: it yields
the function calls it is given and records every ``LlmRequest``, so a test reads what the model was told.
Sessions are ADK's ``InMemorySessionService``. Side effects are rows in a SQLite table of the test's own,
so each test shows the duplicate without onceonly and its absence with it.
"""

from __future__ import annotations

import pytest

pytest.importorskip(
    "google.adk",
    reason="google-adk cannot share .venv (its opentelemetry-api cap); make test runs it in .venv-google-adk",
)

import asyncio
import contextlib
import json
import logging
import os
import re
import sqlite3
import subprocess
import sys
import threading
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from google.adk.agents import LlmAgent, RunConfig
from google.adk.agents.run_config import ToolThreadPoolConfig
from google.adk.apps import App
from google.adk.models.base_llm import BaseLlm
from google.adk.models.llm_request import LlmRequest
from google.adk.models.llm_response import LlmResponse
from google.adk.runners import Runner
from google.adk.sessions import InMemorySessionService
from google.adk.tools import BaseTool, FunctionTool, LongRunningFunctionTool, ToolContext
from google.adk.tools.base_toolset import BaseToolset
from google.genai import types
from pydantic import Field

import onceonly
from onceonly import Ledger
from onceonly.google_adk import OnceOnlyPlugin, guard, guard_tools, session_scope

ROOT = Path(__file__).resolve().parents[3]
UNKNOWN = "The outcome of this action is unknown"
REPLAYED = re.compile(r"This action was already done at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ and was not repeated\.")
APP = "shop"

Step = Sequence[types.Part] | Callable[[LlmRequest], Any]


class ScriptedModel(BaseLlm):
    """A model that answers each request with the next scripted step (parts, or a coroutine function of
    the request that returns them) and keeps every request it was sent."""

    model: str = "scripted"
    steps: list[Any] = Field(default_factory=list)
    requests: list[LlmRequest] = Field(default_factory=list)

    async def generate_content_async(
        self, llm_request: LlmRequest, stream: bool = False
    ) -> AsyncGenerator[LlmResponse, None]:
        self.requests.append(llm_request.model_copy(deep=True))
        step = self.steps.pop(0) if self.steps else [types.Part(text="done")]
        parts = await step(llm_request) if callable(step) else step
        usage = types.GenerateContentResponseUsageMetadata(prompt_token_count=1, candidates_token_count=1)
        yield LlmResponse(content=types.Content(role="model", parts=list(parts)), usage_metadata=usage)

    def told(self) -> list[dict[str, Any]]:
        """The function responses the model read, in order (the contents of its last request)."""
        last = self.requests[-1]
        return [
            dict(p.function_response.response or {})
            for c in last.contents
            for p in c.parts or ()
            if p.function_response is not None
        ]


def call(name: str, call_id: str, **args: Any) -> types.Part:
    return types.Part(function_call=types.FunctionCall(name=name, id=call_id, args=args))


def replan(tool: str, **args: Any) -> ScriptedModel:
    """The model calls the tool, then the same call again under a new call id, then ends."""
    return ScriptedModel(steps=[[call(tool, "call_A", **args)], [call(tool, "call_B", **args)]])


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
    return Charges(tmp_path / "charges.db")


@pytest.fixture(name="ledger")
def fixture_ledger(tmp_path: Path) -> Iterator[Ledger]:
    """A fresh SQLite ledger on the real clock (ADK runs on the event loop's real time)."""
    made = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    yield made
    made.close()


class Chat:
    """One ``Runner`` over ADK's in-memory sessions: ``say()`` runs one user message in a session."""

    def __init__(
        self, agent: LlmAgent, plugins: Sequence[Any] = (), sessions: InMemorySessionService | None = None
    ) -> None:
        self.sessions = sessions or InMemorySessionService()
        self.runner = Runner(app=App(name=APP, root_agent=agent, plugins=list(plugins)), session_service=self.sessions)
        self.run_config: RunConfig | None = None

    def say(self, text: str = "charge the customer", *, user: str = "alice", session: str = "s-1") -> None:
        asyncio.run(self.asay(text, user=user, session=session))

    async def asay(self, text: str, *, user: str, session: str, message: types.Content | None = None) -> None:
        if await self.sessions.get_session(app_name=APP, user_id=user, session_id=session) is None:
            await self.sessions.create_session(app_name=APP, user_id=user, session_id=session)
        content = message or types.Content(role="user", parts=[types.Part(text=text)])
        run = self.runner.run_async(user_id=user, session_id=session, new_message=content, run_config=self.run_config)
        async for _ in run:
            pass


def agent_of(chat: Chat) -> Any:
    return chat.runner.agent


def agent(model: ScriptedModel, tools: list[Any], **kwargs: Any) -> LlmAgent:
    return LlmAgent(name="billing", model=model, tools=tools, **kwargs)


def message(response: dict[str, Any]) -> str:
    assert set(response) == {"status", "message"}, response
    return str(response["message"])


# --- the schema the model sees ------------------------------------------------------------------------


def test_declaration_has_no_idempotency_key_or_tool_context(ledger: Ledger, charges: Charges) -> None:
    """The model is sent ADK's declaration of the original function: no ``tool_context`` (ADK injects it)
    and no ``idempotency_key`` (the ledger fills it in with the call's key). The record's scope is the
    session: app, user, session id."""
    seen: dict[str, Any] = {}

    def charge(customer: str, cents: int, tool_context: ToolContext, idempotency_key: str) -> str:
        """Charge a customer's card."""
        seen.update(key=idempotency_key, call_id=tool_context.function_call_id)
        return f"charge #{charges.add(customer, cents)}"

    model = ScriptedModel(steps=[[call("charge", "call_A", customer="c1", cents=500)]])
    Chat(agent(model, guard_tools([charge], ledger))).say()
    [declared] = [d for t in model.requests[0].config.tools or () for d in t.function_declarations or ()]
    assert declared.name == "charge" and declared.description == "Charge a customer's card."
    schema = json.dumps(declared.model_dump(mode="json", exclude_none=True))
    assert "idempotency_key" not in schema and "tool_context" not in schema
    assert set((declared.parameters_json_schema or {}).get("properties", {})) == {"customer", "cents"}
    [record] = ledger.list()
    assert seen == {"key": record.key, "call_id": "call_A"}
    assert record.scope == f"c:{APP}/alice/s-1"
    assert json.loads(record.args_json) == {"cents": 500, "customer": "c1"}


def test_the_same_function_guarded_again_is_the_same_tool(ledger: Ledger) -> None:
    """guard_tools keeps other tools and toolsets as they are; guarding again gives the same guarded tool;
    a guarded tool is not guarded twice; a second function under the same name is refused."""

    def charge(customer: str) -> str:
        """Charge."""
        return customer

    tool = FunctionTool(charge)
    [guarded] = guard_tools([tool], ledger)
    assert isinstance(guarded, FunctionTool) and guarded is not tool and guarded.name == "charge"
    assert guard_tools([tool], ledger) == [guarded]
    assert guard_tools([guarded], ledger) == [guarded]
    with pytest.raises(TypeError, match="guarded already"):
        guard(guarded, ledger)

    def other(customer: str) -> str:
        return customer * 2

    other.__name__ = "charge"
    with pytest.raises(ValueError, match="another tool named 'charge'"):
        guard(other, ledger)
    with pytest.raises(TypeError, match="FunctionTool or a function"):
        guard(object(), ledger)


# --- a lost answer, a re-plan -------------------------------------------------------------------------


def test_unknown_outcome_does_not_abort_the_run_and_is_not_repeated(ledger: Ledger, charges: Charges) -> None:
    """The charge happens, then the connection times out. Without onceonly the exception aborts ADK's run;
    the user says "try again" and the customer is charged twice. With onceonly the model reads that the
    outcome is unknown and must not be issued again, the run goes on, and its re-issue reads the same:
    one charge, parked for review, and never the operator's text."""

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        charges.add(customer, cents)
        raise TimeoutError("read timed out")

    plain = Chat(agent(ScriptedModel(steps=[[call("charge", "call_A", customer="c1", cents=500)]] * 2), [charge]))
    with pytest.raises(TimeoutError):
        plain.say()
    with pytest.raises(TimeoutError):
        plain.say("try again")
    assert charges.count() == 2  # without onceonly: charged twice

    model = replan("charge", customer="c1", cents=500)
    Chat(agent(model, guard_tools([charge], ledger))).say()
    assert charges.count() == 3  # with onceonly: one more
    told = model.told()
    assert [r["status"] for r in told] == ["unknown", "unknown"]
    for response in told:
        text = message(response)
        assert text.startswith(UNKNOWN) and "Do not issue it again" in text and "onceonly" not in text
    [record] = ledger.list()
    assert record.state is onceonly.State.NEEDS_REVIEW


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_replan_with_a_new_call_id_replays(asynchronous: bool, ledger: Ledger, charges: Charges) -> None:
    """Sync and async functions: the model issues the same call again under a new call id (it did not
    trust the answer): without onceonly two charges, with it one, and the model reads the replay."""

    def charge_sync(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    async def charge_async(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        await asyncio.sleep(0)
        return f"charge #{charges.add(customer, cents)}"

    fn: Callable[..., Any] = charge_async if asynchronous else charge_sync
    Chat(agent(replan(fn.__name__, customer="c1", cents=500), [fn])).say()
    assert charges.count() == 2

    model = replan(fn.__name__, customer="c1", cents=500)
    Chat(agent(model, guard_tools([fn], ledger))).say()
    assert charges.count() == 3
    first, second = model.told()
    assert first == {"result": "charge #3"}  # a fresh result as the tool returned it
    assert second["status"] == "replayed"
    assert REPLAYED.match(message(second)) and message(second).endswith("Its result: charge #3")


def test_a_dict_result_and_tell_model_false(ledger: Ledger, charges: Charges) -> None:
    """A tool that returns a dict: the model reads it as it is the first time; a replay reads the replay
    text with the dict in it, or with ``tell_model=False`` the recorded dict itself."""

    def charge(customer: str, cents: int) -> dict[str, Any]:
        """Charge a customer's card."""
        return {"charge": charges.add(customer, cents), "cents": cents}

    model = replan("charge", customer="c1", cents=500)
    Chat(agent(model, guard_tools([charge], ledger))).say()
    first, second = model.told()
    assert first == {"charge": 1, "cents": 500}
    assert message(second).endswith('Its result: {"cents":500,"charge":1}')

    model = replan("charge", customer="c2", cents=700)
    Chat(agent(model, [guard(charge, ledger, tell_model=False, name="charge_quiet")])).say()
    assert model.told() == [{"charge": 2, "cents": 700}] * 2
    assert charges.count() == 2


def test_the_same_call_twice_in_one_turn_runs_once(ledger: Ledger, charges: Charges) -> None:
    """Two identical calls in one model turn (ADK runs them at once): without onceonly two charges; with
    it the second waits for the first's outcome and replays it."""

    async def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        await asyncio.sleep(0.05)  # both calls are in flight together
        return f"charge #{charges.add(customer, cents)}"

    def both() -> ScriptedModel:
        return ScriptedModel(
            steps=[
                [call("charge", "call_A", customer="c1", cents=500), call("charge", "call_B", customer="c1", cents=500)]
            ]
        )

    Chat(agent(both(), [charge])).say()
    assert charges.count() == 2

    model = both()
    Chat(agent(model, guard_tools([charge], ledger))).say()
    assert charges.count() == 3
    ran, replayed = sorted(model.told(), key=lambda r: "status" in r)  # either may claim first
    assert ran == {"result": "charge #3"} and REPLAYED.match(message(replayed))


def test_sync_tools_on_adks_thread_pool_run_once_and_keep_the_task(ledger: Ledger, charges: Charges) -> None:
    """``RunConfig(tool_thread_pool_config=...)``: ADK runs sync functions on its thread pool, two identical
    calls of one turn at the same time. Without onceonly two charges; with it one, and the
    ``ledger.task(...)`` around the run reaches the worker threads (ADK copies the context)."""
    started = threading.Barrier(2, timeout=5)

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        with contextlib.suppress(threading.BrokenBarrierError):
            started.wait(0.5)  # both calls in flight at once (with onceonly the second waits on the ledger)
        return f"charge #{charges.add(customer, cents)}"

    def both() -> ScriptedModel:
        return ScriptedModel(
            steps=[
                [call("charge", "call_A", customer="c1", cents=500), call("charge", "call_B", customer="c1", cents=500)]
            ]
        )

    def chat(model: ScriptedModel, tools: list[Any]) -> Chat:
        made = Chat(agent(model, tools))
        made.run_config = RunConfig(tool_thread_pool_config=ToolThreadPoolConfig(max_workers=4))
        return made

    chat(both(), [charge]).say()
    assert charges.count() == 2

    model = both()
    started.reset()
    with ledger.task("order-7"):
        chat(model, guard_tools([charge], ledger)).say()
    assert charges.count() == 3
    assert sorted("status" in r for r in model.told()) == [False, True]
    assert [r.scope for r in ledger.list()] == ["order-7"]


def test_a_generator_function_is_refused(ledger: Ledger) -> None:
    """A generator tool streams its items: one recorded result per call does not fit it."""

    def progress(order: str) -> Iterator[str]:
        yield order

    with pytest.raises(TypeError, match="is a generator"):
        guard(progress, ledger)


# --- who is calling -----------------------------------------------------------------------------------


def test_two_sessions_and_two_users_charge_each_once(ledger: Ledger, charges: Charges) -> None:
    """The key is the session (app, user, session id), the tool and the arguments: the same call in two
    sessions runs twice, and so does it for two users whose sessions have the same id; a new message in
    a session replays its earlier charge."""

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    def once(user: str, session: str) -> dict[str, Any]:
        model = ScriptedModel(steps=[[call("charge", "call_1", customer="c1", cents=500)]])
        Chat(agent(model, guard_tools([charge], ledger)), sessions=sessions).say(user=user, session=session)
        [response] = model.told()[-1:]
        return response

    sessions = InMemorySessionService()
    assert once("alice", "s-1") == {"result": "charge #1"}
    assert once("alice", "s-2") == {"result": "charge #2"}
    assert once("bob", "s-1") == {"result": "charge #3"}  # another user, the same session id: not a replay
    again = once("alice", "s-1")
    assert again["status"] == "replayed" and message(again).endswith("charge #1")
    assert charges.count() == 3
    assert sorted(r.scope for r in ledger.list()) == [f"c:{APP}/alice/s-1", f"c:{APP}/alice/s-2", f"c:{APP}/bob/s-1"]


def test_without_onceonly_each_session_charges_each_time(charges: Charges) -> None:
    """The contrast: the same messages without onceonly charge four times."""

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    for user, session in (("alice", "s-1"), ("alice", "s-2"), ("bob", "s-1"), ("alice", "s-1")):
        model = ScriptedModel(steps=[[call("charge", "call_1", customer="c1", cents=500)]])
        Chat(agent(model, [charge])).say(user=user, session=session)
    assert charges.count() == 4


def test_ledger_task_around_the_run_wins(ledger: Ledger, charges: Charges) -> None:
    """A ``ledger.task(...)`` around the run is the scope (an order id the application keys by): two
    sessions inside the same task share one charge."""

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    outputs = []
    with ledger.task("order-42"):
        for session in ("s-1", "s-2"):
            model = ScriptedModel(steps=[[call("charge", "call_1", customer="c1", cents=500)]])
            Chat(agent(model, guard_tools([charge], ledger))).say(session=session)
            outputs.append(model.told()[-1])
    assert charges.count() == 1
    assert outputs[0] == {"result": "charge #1"} and outputs[1]["status"] == "replayed"
    assert [r.scope for r in ledger.list()] == ["order-42"]


def test_no_session_scope_falls_back_to_the_invocation(
    ledger: Ledger, charges: Charges, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``scope=`` that names nothing: the invocation (one user message) is the scope, with one warning
    naming the setting. A re-plan inside it replays; the next message runs its own. Without onceonly the
    re-plan charges again too."""

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    plain = Chat(agent(replan("charge", customer="c1", cents=5), [charge]))
    plain.say()
    assert charges.count() == 2

    tools = guard_tools([charge], ledger, scope=lambda ctx: None)
    with caplog.at_level(logging.WARNING, logger="onceonly"):
        first = replan("charge", customer="c1", cents=5)
        chat = Chat(agent(first, tools))
        chat.say()
        second = ScriptedModel(steps=[[call("charge", "call_C", customer="c1", cents=5)]])
        agent_of(chat).model = second  # the same session, a new message: a new invocation
        chat.say("and again")
    assert charges.count() == 4  # one per invocation
    ran, replayed = first.told()
    assert ran == {"result": "charge #3"} and replayed["status"] == "replayed"
    assert second.told()[-1] == {"result": "charge #4"}
    warnings = [r.getMessage() for r in caplog.records if "names no conversation" in r.getMessage()]
    assert len(warnings) <= 1 and all("session_scope" in w for w in warnings)
    assert all(r.scope.startswith("r:") for r in ledger.list())


def test_session_scope_reads_app_user_and_session() -> None:
    """``session_scope``: app, user and id of the context's session; ``None`` without a session id."""

    class Session:
        id, app_name, user_id = "s-9", "shop", "alice"

    class Context:
        session = Session()

    assert session_scope(Context()) == "c:shop/alice/s-9"
    assert session_scope(object()) is None


# --- pauses: long-running tools and confirmations -----------------------------------------------------


def test_long_running_tool_pending_releases_the_claim(ledger: Ledger, charges: Charges) -> None:
    """A ``LongRunningFunctionTool`` that starts an approval and returns nothing: ADK waits for the
    client's function response, and the ledger records nothing (the claim is given back). The client
    answers the call; the model goes on; a later request for approval runs (it is not replayed as done).
    Without the release the second request would replay a result that never came."""
    asked: list[str] = []

    def ask_approval(order: str) -> None:
        """Ask a manager to approve an order."""
        asked.append(order)

    tool = guard(LongRunningFunctionTool(ask_approval), ledger)
    assert isinstance(tool, LongRunningFunctionTool) and tool.is_long_running

    model = ScriptedModel(steps=[[call("ask_approval", "call_A", order="o-1")], [types.Part(text="waiting")]])
    chat = Chat(agent(model, [tool]))
    chat.say("get o-1 approved")
    assert asked == ["o-1"]
    assert [r.state for r in ledger.list()] == [onceonly.State.FAILED]  # released: no attempt counted
    [record] = ledger.list()
    assert record.attempts == 0

    # The client sends the approval's answer, as ADK's long-running flow has it, and the model asks again.
    model.steps = [[call("ask_approval", "call_B", order="o-1")], [types.Part(text="asked again")]]
    answer = types.Part(
        function_response=types.FunctionResponse(id="call_A", name="ask_approval", response={"status": "timed out"})
    )
    asyncio.run(chat.asay("", user="alice", session="s-1", message=types.Content(role="user", parts=[answer])))
    assert asked == ["o-1", "o-1"]  # the second request ran
    assert {"status": "timed out"} in [
        dict(p.function_response.response or {})
        for c in model.requests[1].contents
        for p in c.parts or ()
        if p.function_response
    ]


def test_a_confirmed_tool_runs_once_after_the_confirmation(ledger: Ledger, charges: Charges) -> None:
    """A tool that asks for a confirmation (``require_confirmation=True``): ADK pauses before the function
    runs, so nothing is recorded; the user confirms and it runs; the model's re-issue replays it."""

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    tool = guard(FunctionTool(charge, require_confirmation=True), ledger)
    model = ScriptedModel(steps=[[call("charge", "call_A", customer="c1", cents=500)]])
    chat = Chat(agent(model, [tool]))
    chat.say()
    assert charges.count() == 0 and ledger.list() == []

    session = asyncio.run(chat.sessions.get_session(app_name=APP, user_id="alice", session_id="s-1"))
    assert session is not None
    asked = [
        p.function_call
        for e in session.events
        for p in (e.content.parts if e.content else None) or ()
        if p.function_call and p.function_call.name == "adk_request_confirmation"
    ]
    assert len(asked) == 1
    yes = types.Part(
        function_response=types.FunctionResponse(
            id=asked[0].id, name="adk_request_confirmation", response={"confirmed": True}
        )
    )
    model.steps = [[types.Part(text="charged")], [call("charge", "call_B", customer="c1", cents=500)]]
    asyncio.run(chat.asay("", user="alice", session="s-1", message=types.Content(role="user", parts=[yes])))
    assert charges.count() == 1
    [record] = ledger.list()
    assert record.state is onceonly.State.CONFIRMED


def test_a_tool_that_asks_for_confirmation_itself_is_not_recorded(ledger: Ledger, charges: Charges) -> None:
    """A function that calls ``tool_context.request_confirmation()`` and returns: a pause, not its result;
    the claim is released, so the call made again once confirmed runs (and only then is recorded)."""

    def refund(order: str, tool_context: ToolContext) -> dict[str, Any]:
        """Refund an order."""
        if tool_context.tool_confirmation is None:
            tool_context.request_confirmation(hint="refund?")
            return {"status": "waiting for approval"}
        return {"refund": charges.add(order, -1)}

    model = ScriptedModel(steps=[[call("refund", "call_A", order="o-1")]])
    Chat(agent(model, guard_tools([refund], ledger))).say()
    [record] = ledger.list()
    assert record.state is onceonly.State.FAILED and record.attempts == 0  # released
    assert charges.count() == 0


# --- errors, @ledger.tool, the plugin ------------------------------------------------------------------


def test_the_tools_own_error_reaches_on_tool_error_callback_and_is_not_replayed(
    ledger: Ledger, charges: Charges
) -> None:
    """The tool fails before charging: the error reaches ADK's ``on_tool_error_callback`` as it is (not
    recorded as a result); the model tries again and the charge runs."""
    failures = [ValueError("card declined by a flaky check")]
    seen: list[str] = []

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        if failures:
            raise failures.pop()
        return f"charge #{charges.add(customer, cents)}"

    def on_error(tool: Any, args: dict[str, Any], tool_context: Any, error: Exception) -> dict[str, Any]:
        seen.append(f"{type(error).__name__}: {error}")
        return {"error": "the card check failed; try again"}

    model = replan("charge", customer="c1", cents=500)
    Chat(agent(model, guard_tools([charge], ledger), on_tool_error_callback=on_error)).say()
    assert seen == ["ValueError: card declined by a flaky check"]
    assert model.told() == [{"error": "the card check failed; try again"}, {"result": "charge #1"}]
    [record] = ledger.list()
    assert record.state is onceonly.State.CONFIRMED and record.attempts == 2


def test_an_ledger_tool_function_keeps_its_settings(ledger: Ledger, charges: Charges) -> None:
    """An ``@ledger.tool`` function: its decorator's settings apply (``key=``: the same order with another
    amount is a conflict the model is told about), the scope is the session's."""

    @ledger.tool(key=("order",))
    def charge(order: str, cents: int) -> str:
        """Charge an order."""
        return f"charge #{charges.add(order, cents)}"

    model = ScriptedModel(
        steps=[[call("charge", "call_A", order="o-1", cents=500)], [call("charge", "call_B", order="o-1", cents=900)]]
    )
    Chat(agent(model, guard_tools([charge], ledger))).say()
    first, conflict = model.told()
    assert first == {"result": "charge #1"}
    assert conflict["status"] == "conflict" and "already issued with other details" in message(conflict)
    assert charges.count() == 1
    [record] = ledger.list()
    assert record.scope == f"c:{APP}/alice/s-1"
    with pytest.raises(TypeError, match="its settings are its decorator's"):
        guard(charge, ledger, key=("order",))
    with pytest.raises(TypeError, match="in a LongRunningFunctionTool"):
        guard(LongRunningFunctionTool(charge), ledger)


def test_the_plugin_guards_every_agents_function_tools(ledger: Ledger, charges: Charges) -> None:
    """``OnceOnlyPlugin`` on the runner: the root agent's and a sub-agent's plain functions go through
    the ledger; a read-only tool left out with ``only=`` runs each time. Without the plugin the
    sub-agent's re-plan charges twice."""
    looked: list[str] = []

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    def lookup(customer: str) -> str:
        """Look a customer up."""
        looked.append(customer)
        return "ok"

    def team(model: ScriptedModel) -> LlmAgent:
        billing = LlmAgent(name="billing", model=model, tools=[charge], description="charges cards")
        return LlmAgent(name="front", model=model, tools=[lookup], sub_agents=[billing])

    def script() -> ScriptedModel:
        transfer = call("transfer_to_agent", "call_T", agent_name="billing")
        return ScriptedModel(
            steps=[
                [call("lookup", "call_L1", customer="c1")],
                [transfer],
                [call("charge", "call_A", customer="c1", cents=500)],
                [call("charge", "call_B", customer="c1", cents=500)],
            ]
        )

    Chat(team(script())).say()
    assert charges.count() == 2

    model = script()
    Chat(team(model), plugins=[OnceOnlyPlugin(ledger, only={"charge"})]).say()
    assert charges.count() == 3
    ran, replayed = model.told()[-2:]
    assert ran == {"result": "charge #3"} and replayed["status"] == "replayed"
    assert [r.tool for r in ledger.list()] == ["charge"]  # lookup was left out
    assert looked == ["c1", "c1"]


def test_the_plugin_guards_the_tools_a_toolset_gives(ledger: Ledger, charges: Charges) -> None:
    """A toolset's tools are made per request: the plugin guards them in the request the model answers
    (``before_model_callback``). Without the plugin the re-plan charges twice."""

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        return f"charge #{charges.add(customer, cents)}"

    class Payments(BaseToolset):
        async def get_tools(self, readonly_context: Any = None) -> list[BaseTool]:
            return [FunctionTool(charge)]

    Chat(agent(replan("charge", customer="c1", cents=500), [Payments()])).say()
    assert charges.count() == 2

    model = replan("charge", customer="c1", cents=500)
    Chat(agent(model, [Payments()]), plugins=[OnceOnlyPlugin(ledger)]).say()
    assert charges.count() == 3
    ran, replayed = model.told()
    assert ran == {"result": "charge #3"} and replayed["status"] == "replayed"


# --- the example ----------------------------------------------------------------------------------------


def test_example_runs_offline(tmp_path: Path) -> None:
    """examples/google_adk_agent.py (it runs in this environment, so it is run here rather than by
    tests/test_examples.py in .venv): two charges without onceonly, one with, what the model was told, and
    no file left behind."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "google_adk_agent.py")],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    assert list(tmp_path.iterdir()) == [], "the example left files behind"
    assert "without onceonly: 2 charges" in out.stdout
    assert "with onceonly: 1 charge" in out.stdout
    assert "Do not issue it again" in out.stdout


def test_without_google_adk_the_import_error_names_the_extra() -> None:
    """``import onceonly.google_adk`` without ADK is an ImportError naming the extra and how to install it."""
    code = "import sys; sys.modules['google.adk'] = None; import onceonly.google_adk"
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "onceonly.google_adk needs Google ADK" in out.stderr and "onceonly[google-adk]" in out.stderr


def test_arguments_are_keyed_as_the_functions_types_read_them(ledger: Ledger, charges: Charges) -> None:
    """ADK hands the model's JSON on unchecked: without onceonly "500" reaches an int parameter as a string.
    Guarded, the arguments are coerced by the function's own types before the key, so 500, "500" and 500.0
    are one charge, and the function gets an int."""
    got: list[Any] = []

    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        got.append(cents)
        return f"charge #{charges.add(customer, cents)}"

    steps = [[call("charge", f"call_{i}", customer="c1", cents=cents)] for i, cents in enumerate((500, "500", 500.0))]
    Chat(agent(ScriptedModel(steps=[list(s) for s in steps]), [charge])).say()
    assert got == [500, "500", 500.0] and charges.count() == 3  # without onceonly: three charges, one a str
    got.clear()
    Chat(agent(ScriptedModel(steps=steps), guard_tools([charge], ledger))).say()
    assert got == [500] and charges.count() == 4
    [record] = ledger.list()
    assert json.loads(record.args_json) == {"cents": 500, "customer": "c1"}
