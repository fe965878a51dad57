"""onceonly.autogen: AutoGen function tools that act once per conversation, run by the real AssistantAgent.

A scripted model client (a real ``ChatCompletionClient`` subclass that answers from a script) stands in
for a real model: no API key, no network. Side effects are rows in a SQLite table of the test's own, so
each test can show the duplicate without onceonly's guard and its absence with it.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("autogen_agentchat")

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.messages import ToolCallExecutionEvent
from autogen_core import CancellationToken, FunctionCall
from autogen_core.models import (
    ChatCompletionClient,
    CreateResult,
    FunctionExecutionResultMessage,
    LLMMessage,
    ModelCapabilities,  # type: ignore[attr-defined]
    ModelInfo,
    RequestUsage,
)
from autogen_core.tools import FunctionTool, Tool, ToolSchema

from onceonly import Ledger, edge
from onceonly.autogen import SETTING, Told, guard, guard_tools
from tests._tickets import Tickets

UNKNOWN = "The outcome of this action is unknown"
NOT_REPEATED = "and was not repeated"


class ScriptedClient(ChatCompletionClient):
    """A model client that answers each ``create`` with the next scripted reply (a text, or tool calls),
    and keeps what it was sent."""

    def __init__(self, *replies: str | list[FunctionCall]) -> None:
        self.replies = list(replies)
        self.seen: list[list[LLMMessage]] = []

    async def create(
        self,
        messages: Sequence[LLMMessage],
        *,
        tools: Sequence[Tool | ToolSchema] = (),
        tool_choice: Any = "auto",
        json_output: Any = None,
        extra_create_args: Mapping[str, Any] = {},
        cancellation_token: CancellationToken | None = None,
    ) -> CreateResult:
        self.seen.append(list(messages))
        reply = self.replies.pop(0) if self.replies else "done"
        reason = "function_calls" if isinstance(reply, list) else "stop"
        return CreateResult(finish_reason=reason, content=reply, usage=RequestUsage(0, 0), cached=False)

    def create_stream(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the scripted client does not stream")

    async def close(self) -> None:
        return None

    def actual_usage(self) -> RequestUsage:
        return RequestUsage(0, 0)

    def total_usage(self) -> RequestUsage:
        return RequestUsage(0, 0)

    def count_tokens(self, messages: Sequence[LLMMessage], *, tools: Sequence[Tool | ToolSchema] = ()) -> int:
        return 0

    def remaining_tokens(self, messages: Sequence[LLMMessage], *, tools: Sequence[Tool | ToolSchema] = ()) -> int:
        return 100_000

    @property
    def capabilities(self) -> ModelCapabilities:
        return ModelCapabilities(vision=False, function_calling=True, json_output=False)

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(
            vision=False, function_calling=True, json_output=False, family="unknown", structured_output=False
        )

    def tool_results(self) -> list[str]:
        """Every tool result the model was sent, in order (each once)."""
        out: list[str] = []
        for messages in self.seen:
            for m in messages:
                if isinstance(m, FunctionExecutionResultMessage):
                    out += [r.content for r in m.content if r.content not in out]
        return out


def ticket_call(call_id: str, title: str = "printer out of toner") -> list[FunctionCall]:
    return [FunctionCall(id=call_id, name="create_ticket", arguments=json.dumps({"title": title}))]


def agent(client: ScriptedClient, tools: list[Any], iterations: int = 1) -> AssistantAgent:
    return AssistantAgent("helpdesk", model_client=client, tools=tools, max_tool_iterations=iterations)


def executed(result: Any) -> list[Any]:
    """The tool results of a run, as AutoGen reported them (content, is_error)."""
    return [r for m in result.messages if isinstance(m, ToolCallExecutionEvent) for r in m.content]


@pytest.fixture(name="tickets")
def fixture_tickets(tmp_path: Path) -> Tickets:
    return Tickets(tmp_path / "tickets.db")


def create_ticket_of(tickets: Tickets) -> Any:
    def create_ticket(title: str) -> dict[str, Any]:
        """Open a support ticket."""
        return {"id": tickets.add(title), "title": title}

    return create_ticket


# --- the scope travels with the call ---------------------------------------------------------------


def test_a_plain_function_tool_runs_a_sync_guarded_function_outside_the_conversation(
    sqlite_url: str, tickets: Tickets
) -> None:
    """What guard() is for: AutoGen runs a sync tool with run_in_executor, whose thread does not see the
    ledger.task() around the run, so the second conversation is silently handed the first's ticket."""
    ledger = Ledger.open(sqlite_url)
    plain = FunctionTool(ledger.tool()(create_ticket_of(tickets)), description="Open a support ticket.")

    async def conversation(name: str) -> Any:
        with ledger.task(name):
            return await agent(ScriptedClient(ticket_call("call_0")), [plain]).run(task="toner")

    first, second = asyncio.run(conversation("conv-a")), asyncio.run(conversation("conv-b"))
    assert tickets.count() == 1  # the duplicate-suppression went to the wrong caller
    assert tickets.scopes == ["default"]
    assert executed(first)[0].content == executed(second)[0].content
    ledger.close()


def test_two_conversations_make_two_tickets(ledger: Ledger, tickets: Tickets) -> None:
    """The same call in two conversations (two ledger.task ids): each runs its own, in its own scope."""
    tools = guard_tools([create_ticket_of(tickets)], ledger)

    async def conversation(name: str) -> Any:
        with ledger.task(name):
            return await agent(ScriptedClient(ticket_call("call_0")), tools).run(task="toner")

    first, second = asyncio.run(conversation("conv-a")), asyncio.run(conversation("conv-b"))
    assert tickets.count() == 2
    assert tickets.scopes == ["conv-a", "conv-b"]
    assert executed(first)[0].content != executed(second)[0].content
    # The same conversation again (a retry, a resumed run): a replay, and the model is told so.
    again = asyncio.run(conversation("conv-a"))
    assert tickets.count() == 2
    assert NOT_REPEATED in executed(again)[0].content
    assert '"id":1' in executed(again)[0].content


def test_a_replan_inside_one_conversation_makes_one_ticket(ledger: Ledger, tickets: Tickets) -> None:
    """The model calls the tool again under a new call id (a re-plan): the first ticket is replayed."""
    client = ScriptedClient(ticket_call("call_0"), ticket_call("call_1"), "Ticket opened.")
    with ledger.task("conv-a"):
        result = asyncio.run(agent(client, guard_tools([create_ticket_of(tickets)], ledger), 3).run(task="toner"))
    assert tickets.count() == 1
    first, second = executed(result)
    assert not first.is_error and not second.is_error
    assert NOT_REPEATED in second.content
    assert NOT_REPEATED in client.tool_results()[1]  # what the model read


def test_runs_without_a_conversation_are_scoped_to_themselves_with_one_warning(
    sqlite_url: str, tickets: Tickets, caplog: pytest.LogCaptureFixture
) -> None:
    """No ledger.task(): each agent.run() is its own scope (its CancellationToken, shared by its tool
    calls), never the ledger's process-wide one: two runs make two tickets, a re-plan in one replays,
    and one warning names the setting."""
    ledger = Ledger.open(sqlite_url)
    edge._warned.discard(("autogen", SETTING))  # the warning is once per process
    tools = guard_tools([create_ticket_of(tickets)], ledger)
    with caplog.at_level("WARNING", logger="onceonly"):
        asyncio.run(agent(ScriptedClient(ticket_call("call_0"), ticket_call("call_1")), tools, 2).run(task="a"))
        asyncio.run(agent(ScriptedClient(ticket_call("call_0")), tools).run(task="b"))
    assert tickets.count() == 2  # one per run: the re-plan of the first run replayed
    assert len(set(tickets.scopes)) == 2 and all(s and s.startswith("r:") for s in tickets.scopes), tickets.scopes
    warnings = [r for r in caplog.records if "names no conversation" in r.getMessage()]
    assert len(warnings) == 1 and SETTING in warnings[0].getMessage()
    ledger.close()


def test_an_async_tool_is_scoped_by_its_conversation(ledger: Ledger, tickets: Tickets) -> None:
    async def create_ticket(title: str) -> dict[str, Any]:
        """Open a support ticket."""
        await asyncio.sleep(0)
        return {"id": tickets.add(title)}

    tools = guard_tools([create_ticket], ledger)

    async def conversation(name: str) -> Any:
        with ledger.task(name):
            return await agent(ScriptedClient(ticket_call("call_0"), ticket_call("call_1")), tools, 2).run(task="t")

    asyncio.run(conversation("conv-a"))
    asyncio.run(conversation("conv-b"))
    assert tickets.count() == 2
    assert tickets.scopes == ["conv-a", "conv-b"]


def test_arguments_are_keyed_as_autogen_validated_them(ledger: Ledger, tmp_path: Path) -> None:
    """AutoGen validates the model's JSON with the tool's schema before the ledger keys it: 500, "500"
    and 500.0 for an int are one charge."""
    charged: list[int] = []

    def charge(customer: str, cents: int) -> str:
        """Charge a customer."""
        charged.append(cents)
        return f"charged {cents}"

    calls = [
        FunctionCall(id=f"call_{i}", name="charge", arguments=json.dumps({"customer": "c1", "cents": v}))
        for i, v in enumerate([500, "500", 500.0])
    ]
    client = ScriptedClient([calls[0]], [calls[1]], [calls[2]], "ok")
    with ledger.task("conv-a"):
        asyncio.run(agent(client, guard_tools([charge], ledger), 4).run(task="charge"))
    assert charged == [500]


# --- what the model reads -------------------------------------------------------------------------


def test_an_unknown_outcome_is_an_error_result_with_the_models_text(
    ledger: Ledger, tickets: Tickets, caplog: pytest.LogCaptureFixture
) -> None:
    """A tool that timed out after its side effect: the model reads the unknown text (is_error=True),
    never the operator's ``onceonly resolve``, which goes to the log; its retry makes no second ticket."""

    def create_ticket(title: str) -> str:
        """Open a support ticket."""
        tickets.add(title)
        raise TimeoutError("the ticket service did not answer")

    client = ScriptedClient(ticket_call("call_0"), ticket_call("call_1"), "It is pending.")
    with caplog.at_level("WARNING", logger="onceonly"), ledger.task("conv-a"):
        result = asyncio.run(agent(client, guard_tools([create_ticket], ledger), 3).run(task="toner"))
    assert tickets.count() == 1
    for r in executed(result):
        assert r.is_error and r.content.startswith(UNKNOWN), r
    read = client.tool_results()
    assert read and all(UNKNOWN in t and "onceonly resolve" not in t for t in read)
    assert "onceonly resolve" in caplog.text


def test_the_tools_own_error_reaches_the_model_as_autogen_reports_it(ledger: Ledger) -> None:
    def create_ticket(title: str) -> str:
        """Open a support ticket."""
        raise ValueError("title too long")

    with ledger.task("conv-a"):
        tools = guard_tools([create_ticket], ledger)
        result = asyncio.run(agent(ScriptedClient(ticket_call("call_0")), tools).run(task="t"))
    (r,) = executed(result)
    assert r.is_error and r.content == "title too long"


def test_told_pickles_with_its_text_and_state() -> None:
    err = pickle.loads(pickle.dumps(Told("the text", "in_progress", "k:t:1")))
    assert (str(err), err.state, err.key) == ("the text", "in_progress", "k:t:1")


# --- the tool as AutoGen sees it --------------------------------------------------------------------


def test_a_guarded_function_tool_keeps_its_name_description_and_schema(ledger: Ledger, tickets: Tickets) -> None:
    def create_ticket(title: str, priority: int = 3, cancellation_token: CancellationToken | None = None) -> str:
        return f"{title}/{priority}/{cancellation_token is not None}"

    original = FunctionTool(create_ticket, description="Open a ticket.", name="open_ticket", strict=False)
    guarded = guard(original, ledger)
    assert guarded.schema == original.schema
    assert guarded.name == "open_ticket" and guarded.description == "Open a ticket."
    token = CancellationToken()
    with ledger.task("conv-a"):
        out = asyncio.run(guarded.run_json({"title": "x"}, token))
    assert out == "x/3/True"  # the original still gets AutoGen's token (left out of the key)
    assert ledger.list(tool="open_ticket")[0].state.value == "confirmed"


def test_a_guarded_function_is_taken_with_its_decorators_settings(ledger: Ledger, tickets: Tickets) -> None:
    fn = ledger.tool(name="tickets.create")(create_ticket_of(tickets))
    made = guard(fn, ledger)
    assert made.name == "create_ticket"
    with pytest.raises(TypeError, match=r"already an @ledger\.tool function"):
        guard(fn, ledger, timeout=5)


def test_a_function_tool_is_refused_by_the_decorator_with_the_way_in(ledger: Ledger, tickets: Tickets) -> None:
    with pytest.raises(TypeError, match=r"onceonly\.autogen\.guard"):
        ledger.tool()(FunctionTool(create_ticket_of(tickets), description="x"))


def test_onceonly_does_not_import_autogen() -> None:
    light = "import sys, onceonly; print([m for m in ('autogen_core', 'autogen_agentchat') if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", light], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    missing = "import sys; sys.modules['autogen_core'] = None; import onceonly.autogen"
    done = subprocess.run([sys.executable, "-c", missing], capture_output=True, text=True, check=False)
    assert "onceonly.autogen needs autogen-core and autogen-agentchat: pip install 'onceonly[autogen]" in done.stderr


def test_the_same_call_twice_in_one_response_makes_one_ticket(ledger: Ledger, tickets: Tickets) -> None:
    """AutoGen runs the calls of one response at once (asyncio.gather): the second waits for the first
    and replays it."""

    def create_ticket(title: str) -> str:
        """Open a support ticket."""
        return f"ticket {tickets.add(title)}"

    both = [*ticket_call("call_0"), *ticket_call("call_1")]
    with ledger.task("conv-a"):
        result = asyncio.run(agent(ScriptedClient(both), guard_tools([create_ticket], ledger)).run(task="t"))
    assert tickets.count() == 1
    contents = [r.content for r in executed(result)]
    assert sorted(NOT_REPEATED in c for c in contents) == [False, True], contents
    assert all("ticket 1" in c for c in contents)
