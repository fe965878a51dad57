"""onceonly.crewai: CrewAI tools that act once per conversation, run by real crews.

A scripted model (a real ``crewai.llms.base_llm.BaseLLM`` subclass answering from a script, in ReAct text or
native function calls) stands in for a real model: no API key, no network. Side effects are rows in a
SQLite table of the test's own, so each test shows the duplicate without onceonly and its absence with it.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip(
    "crewai",
    reason="crewai cannot share .venv (it needs mcp<2, openai<3, pydantic<2.13); make test runs it in .venv-crewai",
)

# CrewAI reports usage and traces over the network unless told not to; this machine has none.
os.environ["CREWAI_DISABLE_TELEMETRY"] = "true"
os.environ["OTEL_SDK_DISABLED"] = "true"
os.environ["CREWAI_TRACING_ENABLED"] = "false"

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from crewai import Agent, Crew, Task
from crewai.flow.flow import Flow, start
from crewai.hooks.dispatch import HookAborted
from crewai.llms.base_llm import BaseLLM
from crewai.tools import BaseTool, tool
from pydantic import BaseModel

from onceonly import Ledger, edge
from onceonly.crewai import SETTING, GuardedTool, Told, guard, guard_tools, run_id
from tests._tickets import Tickets

# CrewAI warns about its own deprecated fields when it reads them itself (an agent's post-init does).
pytestmark = pytest.mark.filterwarnings(r"ignore::DeprecationWarning:crewai\.")

ROOT = Path(__file__).resolve().parents[3]
UNKNOWN = "The outcome of this action is unknown"
NOT_REPEATED = "and was not repeated"
FINAL = "Thought: I know the answer\nFinal Answer: done"


class ScriptedLLM(BaseLLM):
    """A model that answers each call with the next scripted reply (ReAct text, or a list of native tool
    calls when ``native``), and keeps every messages list it was sent."""

    def __init__(self, *replies: str | list[dict[str, Any]], native: bool = False) -> None:
        super().__init__(model="scripted")
        self._replies = list(replies)
        self._native = native
        self.seen: list[list[dict[str, Any]]] = []

    def call(
        self, messages: Any, tools: Any = None, callbacks: Any = None, available_functions: Any = None, **_: Any
    ) -> Any:
        self.seen.append(
            [{"role": "user", "content": messages}] if isinstance(messages, str) else [dict(m) for m in messages]
        )
        return self._replies.pop(0) if self._replies else FINAL

    async def acall(
        self, messages: Any, tools: Any = None, callbacks: Any = None, available_functions: Any = None, **_: Any
    ) -> Any:
        return self.call(messages, tools, callbacks, available_functions)

    def get_input_tokens_count(self, *args: Any, **kwargs: Any) -> int:
        return 0  # a scripted model counts nothing (CrewAI's estimate logs a warning per call)

    def supports_function_calling(self) -> bool:
        return self._native

    def observations(self) -> list[str]:
        """Every tool result the model was sent, in order, each once (ReAct observations, tool messages)."""
        out: list[str] = []
        for messages in self.seen:
            for m in messages:
                content = m.get("content")
                if not isinstance(content, str):
                    continue
                if m.get("role") == "tool":
                    parts = [content]
                elif m.get("role") != "assistant":  # the prompt shows the format ("Observation: the result...")
                    continue
                else:
                    parts = [p.split("\nThought:")[0] for p in content.split("Observation:")[1:]]
                out += [p.strip() for p in parts if p.strip() not in out]
        return out

    def read(self) -> str:
        """Everything the model was sent, as one text."""
        return "\n".join(str(m.get("content")) for messages in self.seen for m in messages)


def action(title: str = "printer out of toner") -> str:
    return f"Thought: I open a ticket\nAction: create_ticket\nAction Input: {json.dumps({'title': title})}"


def native_call(call_id: str, title: str = "printer out of toner") -> dict[str, Any]:
    arguments = json.dumps({"title": title})
    return {"id": call_id, "type": "function", "function": {"name": "create_ticket", "arguments": arguments}}


def crew(llm: ScriptedLLM, tools: list[Any], tasks: int = 1, cache: bool = False) -> Crew:
    """A crew of one agent and ``tasks`` tasks. CrewAI's own result cache is off unless asked for: it would
    hide the duplicate a test shows (test_crewai_cache_hands_one_conversation_another_s_result)."""
    agent = Agent(role="helpdesk", goal="open tickets", backstory="a helpdesk", llm=llm, tools=tools, max_iter=4)
    work = [
        Task(description=f"step {i}: the printer is out of toner", expected_output="a ticket", agent=agent)
        for i in range(tasks)
    ]
    return Crew(agents=[agent], tasks=work, cache=cache)


@pytest.fixture(name="tickets")
def fixture_tickets(tmp_path: Path) -> Tickets:
    return Tickets(tmp_path / "tickets.db")


@pytest.fixture(name="book")
def fixture_book(sqlite_url: str) -> Iterator[Ledger]:
    """A real SQLite ledger in tmp_path, on the real clock (single-flight waits in real threads)."""
    ledger = Ledger.open(sqlite_url)
    yield ledger
    ledger.close()


def lost_answer_tool(tickets: Tickets) -> Any:
    @tool("create_ticket")
    def create_ticket(title: str) -> str:
        """Open a support ticket."""
        tickets.add(title)  # committed: the ticket exists
        raise TimeoutError("read timed out")  # and the answer is lost

    return create_ticket


def ticket_tool(tickets: Tickets, delay: float = 0.0) -> Any:
    @tool("create_ticket")
    def create_ticket(title: str) -> str:
        """Open a support ticket."""
        time.sleep(delay)
        return json.dumps({"id": tickets.add(title), "title": title})

    return create_ticket


# --- CrewAI's own retry loop: the lost answer ---------------------------------------------------------


def test_crewai_retries_a_tool_whose_answer_was_lost(tickets: Tickets) -> None:
    """Without onceonly: one Action whose answer is lost after the side effect makes several tickets, as
    ToolUsage calls the tool again (twice per attempt, three attempts), and the model reads the error."""
    llm = ScriptedLLM(action(), FINAL)
    crew(llm, [lost_answer_tool(tickets)]).kickoff()
    assert tickets.count() == 6
    assert "I encountered an error while trying to use the tool" in llm.read()


def test_a_lost_answer_makes_one_ticket_and_the_model_reads_unknown(book: Ledger, tickets: Tickets) -> None:
    """With onceonly: the first lost answer is an unknown outcome, CrewAI reads its text as the result and
    does not retry; the model is told not to issue it again, and never reads the operator's step."""
    llm = ScriptedLLM(action(), FINAL)
    with book.task("conv-a"):
        crew(llm, guard_tools([lost_answer_tool(tickets)], book)).kickoff()
    assert tickets.count() == 1
    assert UNKNOWN in llm.observations()[0]
    assert "onceonly resolve" not in llm.read() and "I encountered an error" not in llm.read()
    # The model re-issues it in a later run of the conversation: still one ticket, still unknown.
    again = ScriptedLLM(action(), FINAL)
    with book.task("conv-a"):
        crew(again, guard_tools([lost_answer_tool(tickets)], book)).kickoff()
    assert tickets.count() == 1
    assert UNKNOWN in again.observations()[0]


# --- replays and conversations ------------------------------------------------------------------------


def test_a_replan_in_one_run_replays_and_the_model_is_told(book: Ledger, tickets: Tickets) -> None:
    """Two tasks of one kickoff make the same call (a re-plan): without onceonly two tickets; with it one,
    and the second observation says it was not repeated, with the first result."""
    crew(ScriptedLLM(action(), FINAL, action(), FINAL), [ticket_tool(tickets)], tasks=2).kickoff()
    assert tickets.count() == 2

    llm = ScriptedLLM(action(), FINAL, action(), FINAL)
    with book.task("conv-a"):
        crew(llm, guard_tools([ticket_tool(tickets)], book), tasks=2).kickoff()
    assert tickets.count() == 3
    first, second = llm.observations()
    assert '"id": 3' in first and NOT_REPEATED not in first
    assert NOT_REPEATED in second and '"id": 3' in second


def test_two_conversations_make_two_tickets(book: Ledger, tickets: Tickets) -> None:
    """The same call in two conversations (two ledger.task ids, one Crew object): each runs its own."""
    team = crew(
        ScriptedLLM(action(), FINAL, action(), FINAL, action(), FINAL), guard_tools([ticket_tool(tickets)], book)
    )
    for conversation in ("conv-a", "conv-b"):
        with book.task(conversation):
            team.kickoff()
    assert tickets.count() == 2
    assert tickets.scopes == ["conv-a", "conv-b"]
    with book.task("conv-a"):  # the first conversation again: a replay
        team.kickoff()
    assert tickets.count() == 2


def test_no_conversation_scopes_each_kickoff_to_its_run(
    book: Ledger, tickets: Tickets, caplog: pytest.LogCaptureFixture
) -> None:
    """No ledger.task: the kickoff's execution id is the scope. A re-plan inside the run replays; another
    kickoff of the same Crew object runs its own; one warning names the setting."""
    llm = ScriptedLLM(*[action(), FINAL] * 4)
    team = crew(llm, guard_tools([ticket_tool(tickets)], book), tasks=2)
    edge._warned.discard(("crewai", SETTING))  # the warning is once per process
    with caplog.at_level("WARNING", logger="onceonly"):
        team.kickoff()
        team.kickoff()
    assert tickets.count() == 2
    assert len(set(tickets.scopes)) == 2 and all(s and s.startswith("r:") for s in tickets.scopes)
    assert sum(NOT_REPEATED in o for o in llm.observations()) == 2
    warnings = [r for r in caplog.records if "names no conversation" in r.getMessage()]
    assert len(warnings) == 1 and SETTING in warnings[0].getMessage()
    assert run_id() is None  # outside a kickoff


def test_a_flow_run_is_one_scope_for_the_crews_it_kicks_off(book: Ledger, tickets: Tickets) -> None:
    """Crews kicked off inside a flow inherit the flow run's execution id: the second crew's same call
    replays the first's (without onceonly: two tickets); another kickoff of the flow runs its own."""

    class Desk(Flow[dict[str, Any]]):
        tools: ClassVar[list[Any]] = []

        @start()
        def open_tickets(self) -> str:
            for _ in range(2):
                crew(ScriptedLLM(action(), FINAL), self.tools).kickoff()
            return "done"

    Desk.tools = [ticket_tool(tickets)]
    Desk().kickoff()
    assert tickets.count() == 2

    Desk.tools = guard_tools([ticket_tool(tickets)], book)
    Desk().kickoff()
    assert tickets.count() == 3
    Desk().kickoff()
    assert tickets.count() == 4
    assert len(set(tickets.scopes[2:])) == 2


def test_crewai_cache_hands_one_conversation_another_s_result(book: Ledger, tickets: Tickets) -> None:
    """CrewAI's result cache is keyed by tool name and input, per Crew object, across kickoffs: without
    onceonly the second conversation is handed the first one's ticket. A guarded tool is never cached."""
    plain = crew(ScriptedLLM(action(), FINAL, action(), FINAL), [ticket_tool(tickets)], cache=True)
    for conversation in ("conv-a", "conv-b"):
        with book.task(conversation):
            plain.kickoff()
    assert tickets.count() == 1

    guarded = crew(ScriptedLLM(action(), FINAL, action(), FINAL), guard_tools([ticket_tool(tickets)], book), cache=True)
    for conversation in ("conv-a", "conv-b"):
        with book.task(conversation):
            guarded.kickoff()
    assert tickets.count() == 3


# --- parallel calls, async, threads -----------------------------------------------------------------


def test_two_parallel_identical_calls_make_one_ticket(book: Ledger, tickets: Tickets) -> None:
    """Native function calling: two identical calls in one turn run in parallel threads. Without onceonly
    two tickets; with it one, the other call waits and replays it."""
    turn = [native_call("call_0"), native_call("call_1")]
    crew(ScriptedLLM(turn, "done", native=True), [ticket_tool(tickets, delay=0.3)]).kickoff()
    assert tickets.count() == 2

    llm = ScriptedLLM(turn, "done", native=True)
    with book.task("conv-a"):
        crew(llm, guard_tools([ticket_tool(tickets, delay=0.3)], book)).kickoff()
    assert tickets.count() == 3
    results = [m["content"] for m in llm.seen[1] if m.get("role") == "tool"]
    assert len(results) == 2 and sum(NOT_REPEATED in r for r in results) == 1


def test_a_sync_tool_on_the_async_path_keeps_the_conversation(book: Ledger, tickets: Tickets) -> None:
    """CrewAI's async tool path (CrewStructuredTool.ainvoke, as ToolUsage.ause calls it) runs a sync function
    with run_in_executor, whose thread does not see ledger.task: a plain CrewAI tool over an @ledger.tool
    function files both conversations under the ledger's own scope, and the second is handed the first
    one's ticket. The guarded tool runs it in a thread that keeps the scope. (Crew.akickoff itself runs
    tools on its sync path, in threads that copy the context: both kinds keep it there.)"""
    guarded_fn = book.tool(name="plain_ticket")(lambda title: tickets.add(title))
    plain = tool("create_ticket")(_documented(guarded_fn)).to_structured_tool()

    async def conversation(name: str, structured: Any) -> Any:
        with book.task(name):
            return await structured.ainvoke({"title": "printer out of toner"})

    first, second = (asyncio.run(conversation(name, plain)) for name in ("conv-a", "conv-b"))
    assert tickets.count() == 1 and tickets.scopes == ["default"] and first == second

    guarded = guard(ticket_tool(tickets), book).to_structured_tool()
    for name in ("conv-a", "conv-b"):
        asyncio.run(conversation(name, guarded))
    assert tickets.count() == 3 and tickets.scopes[1:] == ["conv-a", "conv-b"]

    async def kickoff(name: str) -> None:
        with book.task(name):
            await crew(ScriptedLLM(action(), FINAL), guard_tools([ticket_tool(tickets)], book)).akickoff()

    for name in ("conv-c", "conv-d"):
        asyncio.run(kickoff(name))
    assert tickets.count() == 5 and tickets.scopes[3:] == ["conv-c", "conv-d"]


def _documented(fn: Any) -> Any:
    def create_ticket(title: str) -> int:
        """Open a support ticket."""
        return int(fn(title))

    return create_ticket


def test_an_async_tool_acts_once(book: Ledger, tickets: Tickets) -> None:
    """An async function, on the sync and the async kickoff: the lost answer is one ticket, the model reads
    the unknown; without onceonly CrewAI's retries make several."""

    async def create_ticket(title: str) -> str:
        """Open a support ticket."""
        await asyncio.sleep(0)
        tickets.add(title)
        raise TimeoutError("read timed out")

    crew(ScriptedLLM(action(), FINAL), [tool("create_ticket")(create_ticket)]).kickoff()
    assert tickets.count() > 1
    before = tickets.count()

    guarded = guard(create_ticket, book)
    assert isinstance(guarded, GuardedTool) and guarded.name == "create_ticket"
    llm = ScriptedLLM(action(), FINAL)
    with book.task("conv-a"):
        crew(llm, [guarded]).kickoff()
    later = ScriptedLLM(action(), FINAL)

    async def run() -> None:
        with book.task("conv-a"):
            await crew(later, [guarded]).akickoff()

    asyncio.run(run())
    assert tickets.count() == before + 1
    assert UNKNOWN in llm.observations()[0] and UNKNOWN in later.observations()[0]


def test_an_async_tool_called_by_sync_code_inside_a_running_loop_keeps_the_scope(
    book: Ledger, tickets: Tickets
) -> None:
    """BaseTool.run of an async guarded tool from a coroutine (a loop runs in this thread): it runs in a
    worker thread with this context, so the conversation's scope holds, and a second call replays."""

    async def create_ticket(title: str) -> str:
        """Open a support ticket."""
        return str(tickets.add(title))

    made = guard(create_ticket, book)

    async def caller() -> list[Any]:
        with book.task("conv-z"):
            return [made.run(title="toner"), made.run(title="toner")]

    first, second = asyncio.run(caller())
    assert first == "1" and NOT_REPEATED in second
    assert tickets.scopes == ["conv-z"]


# --- what the model is shown, and CrewAI's control flow ---------------------------------------------------


class Charge(BaseModel):
    customer: str
    cents: int


class ChargeTool(BaseTool):
    """A BaseTool subclass, as CrewAI's docs write one."""

    name: str = "Charge Card"
    description: str = "Charge a customer's card."
    args_schema: type[BaseModel] = Charge
    rows: Any = None

    def _run(self, customer: str, cents: int) -> str:
        self.rows.add(f"{customer}:{cents}")
        return f"charged {cents}"


def test_the_schema_the_model_sees_is_the_tools_own(book: Ledger, tickets: Tickets) -> None:
    """The guarded tool keeps name, description and argument schema; no idempotency_key (a function that
    takes one gets it from the ledger) reaches the prompt; CrewAI coerces "500" to 500 before the key."""

    def create_ticket(title: str, *, idempotency_key: str) -> str:
        """Open a support ticket."""
        return f"{tickets.add(title)}:{idempotency_key}"

    made = guard(create_ticket, book)
    assert list(made.args_schema.model_json_schema()["properties"]) == ["title"]
    assert made.description == "Open a support ticket."
    llm = ScriptedLLM(action(), FINAL)
    with book.task("conv-a"):
        crew(llm, [made]).kickoff()
    assert "idempotency_key" not in llm.read()
    with book.task("conv-a"):  # the function got the ledger's key
        assert tickets.count() == 1 and made.guarded.key_for(title="printer out of toner") in llm.observations()[0]

    charge = guard(ChargeTool(rows=tickets), book)
    assert (charge.name, charge.description, charge.args_schema) == ("Charge Card", "Charge a customer's card.", Charge)
    with book.task("conv-a"):
        assert charge.run(customer="ada", cents="500") == "charged 500"
        assert NOT_REPEATED in charge.run(customer="ada", cents=500)
    assert tickets.count() == 2


def test_crewai_control_flow_passes_through_with_the_claim_released(book: Ledger, tickets: Tickets) -> None:
    """A hook's abort (HookAborted) raised in the tool is control flow: it propagates, no attempt is
    counted and the claim is released, so the next call runs. An @ledger.tool without the pass-through
    records it as a failed attempt."""
    aborted: list[bool] = [True]

    def create_ticket(title: str) -> str:
        """Open a support ticket."""
        if aborted.pop(0) if aborted else False:
            raise HookAborted("a person must approve first")
        return str(tickets.add(title))

    made = guard(create_ticket, book)
    with book.task("conv-a"):
        with pytest.raises(HookAborted):
            made.run(title="toner")
        key = made.guarded.key_for(title="toner")
        assert made.run(title="toner") == "1"
    record = book.get(key)
    assert record is not None and record.state.value == "confirmed" and record.attempts == 1

    aborted.append(True)
    plain = book.tool(name="no_passthrough")(create_ticket)
    with book.task("conv-b"):
        with pytest.raises(HookAborted):
            plain(title="toner")
        failed = book.get(plain.key_for(title="toner"))
    assert failed is not None and failed.state.value == "failed" and failed.attempts == 1


def test_told_text_is_not_cached_and_guard_refuses_what_it_cannot_take(book: Ledger, tickets: Tickets) -> None:
    """The told string carries its state and key; a guarded tool refuses CrewAI's cache; guard() says what
    was wrong with a second guard, a function with no docstring, and @ledger.tool on a CrewAI tool."""
    told = Told("do not issue it again", "unknown", "k")
    assert (str(told), told.state, told.key) == ("do not issue it again", "unknown", "k")
    made = guard(ticket_tool(tickets), book)
    assert made.cache_function({"title": "x"}, "result") is False
    with pytest.raises(TypeError, match="guarded already"):
        guard(made, book)
    with pytest.raises(ValueError, match="no docstring"):
        guard(lambda title: title, book, name="undocumented")
    with pytest.raises(TypeError, match=r"onceonly\.crewai\.guard"):
        book.tool(ticket_tool(tickets))
    rebuilt = GuardedTool.model_validate(made.model_dump())  # as CrewAI restores a checkpoint's tools
    with pytest.raises(RuntimeError, match="rebuilt without its ledger"):
        rebuilt.run(title="x")


def test_the_example_runs(tmp_path: Path) -> None:
    """examples/crewai_agent.py, in this environment: six tickets without onceonly, one with it, and
    what the model read."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "crewai_agent.py")],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    assert "without onceonly: 6 tickets for one Action" in out.stdout
    assert "with onceonly: 1 ticket" in out.stdout
    assert UNKNOWN in out.stdout and "onceonly resolve" not in out.stdout
    # The example's files are gone; CrewAI keeps a lock file of its own in the temporary directory.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("crewai:")) == []
