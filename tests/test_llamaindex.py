"""onceonly.llamaindex: LlamaIndex function tools that act once per conversation, run by the real
FunctionAgent on llama-index-workflows.

LlamaIndex's own ``MockFunctionCallingLLM``, given a scripted response generator, stands in for a real
model: no API key, no network; the generator keeps every chat it is sent and the tools it is shown. Side
effects are rows in a SQLite table of the test's own, so each test can show the duplicate without
onceonly's guard and its absence with it.

Written without ``from __future__ import annotations``: LlamaIndex finds a ``ctx: Context`` parameter by
its annotation object, as in an application's own module.
"""

import asyncio
import pickle
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.agent.workflow import AgentWorkflow, FunctionAgent
from llama_index.core.base.llms.types import ToolCallBlock
from llama_index.core.llms import ChatMessage, MessageRole
from llama_index.core.llms.mock import MockFunctionCallingLLM
from llama_index.core.tools import FunctionTool, ToolOutput
from llama_index.core.workflow import Context, HumanResponseEvent, InputRequiredEvent

from onceonly import Ledger, Retry, edge
from onceonly.llamaindex import SETTING, GuardedTool, Told, guard, guard_tools
from tests._tickets import Tickets

# The workflow collects an agent's steps with inspect.getmembers, which reads the deprecated attributes
# of the agent's pydantic model.
pytestmark = pytest.mark.filterwarnings("ignore::pydantic.warnings.PydanticDeprecationWarning")

ROOT = Path(__file__).resolve().parent.parent
UNKNOWN = "The outcome of this action is unknown"
NOT_REPEATED = "and was not repeated"

Reply = str | list[tuple[str, dict[str, Any]]]


class Script:
    """The response generator of a ``MockFunctionCallingLLM``: each chat is answered with the next
    scripted reply (a text, or tool calls); every chat's messages and the tools shown are kept."""

    def __init__(self, *replies: Reply) -> None:
        self.replies = list(replies)
        self.seen: list[list[ChatMessage]] = []
        self.shown: list[list[dict[str, Any]]] = []
        self.calls = 0

    def __call__(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatMessage:
        self.seen.append(list(messages))
        self.shown.append([t.metadata.to_openai_tool() for t in kwargs.get("tools") or ()])
        reply = self.replies.pop(0) if self.replies else "done"
        if isinstance(reply, str):
            return ChatMessage(role=MessageRole.ASSISTANT, content=reply)
        blocks = []
        for name, args in reply:
            self.calls += 1
            blocks.append(ToolCallBlock(tool_call_id=f"call_{self.calls}", tool_name=name, tool_kwargs=args))
        return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks)

    def tool_results(self) -> list[str]:
        """The tool results in the last chat the model was sent (it holds the run's history), in order."""
        return [m.content or "" for m in self.seen[-1] if m.role == MessageRole.TOOL]


def ticket(title: str = "printer out of toner") -> list[tuple[str, dict[str, Any]]]:
    return [("create_ticket", {"title": title})]


def run(script: Script, tools: list[Any], text: str = "toner") -> Any:
    agent = FunctionAgent(tools=tools, llm=MockFunctionCallingLLM(response_generator=script))
    return asyncio.run(_run(agent, text))


async def _run(agent: FunctionAgent, text: str) -> Any:
    return await agent.run(text)


def outputs(result: Any) -> list[ToolOutput]:
    """The tool outputs of a run, as LlamaIndex reported them."""
    return [c.tool_output for c in result.tool_calls]


@pytest.fixture(name="ledger")
def fixture_ledger(sqlite_url: str) -> Iterator[Ledger]:
    ledger = Ledger.open(sqlite_url)
    yield ledger
    ledger.close()


@pytest.fixture(name="tickets")
def fixture_tickets(tmp_path: Path) -> Tickets:
    return Tickets(tmp_path / "tickets.db")


def create_ticket_of(tickets: Tickets) -> Any:
    def create_ticket(title: str) -> dict[str, Any]:
        """Open a support ticket."""
        return {"id": tickets.add(title), "title": title}

    return create_ticket


def lost_answer_of(tickets: Tickets) -> Any:
    def create_ticket(title: str) -> str:
        """Open a support ticket."""
        tickets.add(title)  # committed; then the answer is lost
        raise TimeoutError("the ticket service did not answer")

    return create_ticket


# --- a lost answer, a replay, parallel calls ---------------------------------------------------------


def test_a_lost_answer_retried_makes_two_tickets_without_onceonly(tickets: Tickets) -> None:
    script = Script(ticket(), ticket(), "It is pending.")
    run(script, [FunctionTool.from_defaults(fn=lost_answer_of(tickets))])
    assert tickets.count() == 2
    assert all("did not answer" in t for t in script.tool_results())


def test_a_lost_answer_retried_makes_one_ticket_and_the_model_reads_the_unknown_text(
    ledger: Ledger, tickets: Tickets, caplog: pytest.LogCaptureFixture
) -> None:
    """The tool timed out after its side effect: the model's next input holds the unknown text (an error
    result, the run goes on), never the operator's ``onceonly resolve``, which goes to the log; the
    model's retry makes no second ticket."""
    script = Script(ticket(), ticket(), "It is pending.")
    with caplog.at_level("WARNING", logger="onceonly"), ledger.task("conv-a"):
        result = run(script, guard_tools([lost_answer_of(tickets)], ledger))
    assert tickets.count() == 1
    assert str(result) == "It is pending."
    for out in outputs(result):
        assert out.is_error and out.content.startswith(UNKNOWN), out
    read = script.tool_results()
    assert len(read) == 2 and all(UNKNOWN in t and "onceonly resolve" not in t for t in read), read
    assert "onceonly resolve" in caplog.text


def test_a_replan_replays_and_the_model_reads_the_replay(ledger: Ledger, tickets: Tickets) -> None:
    script = Script(ticket(), ticket(), "Ticket opened.")
    with ledger.task("conv-a"):
        result = run(script, guard_tools([create_ticket_of(tickets)], ledger))
    assert tickets.count() == 1
    first, second = outputs(result)
    assert not first.is_error and not second.is_error
    assert NOT_REPEATED not in script.tool_results()[0]
    assert NOT_REPEATED in script.tool_results()[1] and '"id":1' in script.tool_results()[1]


def test_a_replan_makes_two_tickets_without_onceonly(tickets: Tickets) -> None:
    run(Script(ticket(), ticket(), "ok"), [FunctionTool.from_defaults(fn=create_ticket_of(tickets))])
    assert tickets.count() == 2


@pytest.mark.parametrize("guarded", [False, True])
def test_the_same_call_twice_in_one_turn(ledger: Ledger, tickets: Tickets, guarded: bool) -> None:
    """The workflow runs the calls of one response at once, a sync tool each in its own thread: with the
    guard the second waits for the first and replays it."""

    def create_ticket(title: str) -> str:
        """Open a support ticket."""
        return f"ticket {tickets.add(title)}"

    tools = guard_tools([create_ticket], ledger) if guarded else [FunctionTool.from_defaults(fn=create_ticket)]
    with ledger.task("conv-a"):
        result = run(Script([*ticket(), *ticket()]), tools)
    if not guarded:
        assert tickets.count() == 2
        return
    assert tickets.count() == 1
    contents = [o.content for o in outputs(result)]
    assert sorted(NOT_REPEATED in c for c in contents) == [False, True], contents
    assert all("ticket 1" in c for c in contents)


# --- who is calling -------------------------------------------------------------------------------


def test_two_conversations_make_two_tickets_and_each_replays_its_own(ledger: Ledger, tickets: Tickets) -> None:
    tools = guard_tools([create_ticket_of(tickets)], ledger)

    def conversation(name: str) -> Any:
        with ledger.task(name):
            return run(Script(ticket()), tools)

    first, second = conversation("conv-a"), conversation("conv-b")
    assert tickets.count() == 2
    assert tickets.scopes == ["conv-a", "conv-b"]
    assert outputs(first)[0].content != outputs(second)[0].content
    again = conversation("conv-a")  # a retried or resumed run of the first conversation
    assert tickets.count() == 2
    assert NOT_REPEATED in outputs(again)[0].content


def test_the_same_conversation_again_makes_another_ticket_without_onceonly(tickets: Tickets) -> None:
    tools = [FunctionTool.from_defaults(fn=create_ticket_of(tickets))]
    for _ in ("conv-a", "conv-b", "conv-a"):
        run(Script(ticket()), tools)
    assert tickets.count() == 3


def test_runs_without_a_conversation_are_scoped_to_themselves_with_one_warning(
    ledger: Ledger, tickets: Tickets, caplog: pytest.LogCaptureFixture
) -> None:
    """No ledger.task(): each agent.run() is its own scope (the workflow's run id, seen in every step and
    in the worker thread of a sync tool), never the ledger's process-wide one: a re-plan in a run
    replays, another run makes its own ticket, and one warning names the setting."""
    edge._warned.discard(("llamaindex", SETTING))  # the warning is once per process
    tools = guard_tools([create_ticket_of(tickets)], ledger)
    with caplog.at_level("WARNING", logger="onceonly"):
        run(Script(ticket(), ticket()), tools)
        run(Script(ticket()), tools)
    assert tickets.count() == 2
    assert len(set(tickets.scopes)) == 2 and all(s and s.startswith("r:") for s in tickets.scopes), tickets.scopes
    warnings = [r for r in caplog.records if "names no conversation" in r.getMessage()]
    assert len(warnings) == 1 and SETTING in warnings[0].getMessage()


def test_an_agent_workflow_run_is_its_own_scope(ledger: Ledger, tickets: Tickets) -> None:
    """An AgentWorkflow calls tools through its own step, under the same run id: a re-plan inside the run
    replays, the next run makes its own ticket."""
    tools = guard_tools([create_ticket_of(tickets)], ledger)

    async def one_run(script: Script) -> Any:
        helpdesk = FunctionAgent(name="helpdesk", tools=tools, llm=MockFunctionCallingLLM(response_generator=script))
        return await AgentWorkflow(agents=[helpdesk]).run(user_msg="toner")

    asyncio.run(one_run(Script(ticket(), ticket())))
    asyncio.run(one_run(Script(ticket())))
    assert tickets.count() == 2
    assert len(set(tickets.scopes)) == 2 and all(s and s.startswith("r:") for s in tickets.scopes)


def test_runs_without_a_conversation_share_the_ledgers_scope_with_a_plain_guarded_function(
    ledger: Ledger, tickets: Tickets
) -> None:
    """Why the run scope: a plain @ledger.tool under LlamaIndex's own FunctionTool keys every run in the
    ledger's one scope, so the second run (maybe another user) is handed the first run's ticket."""
    tools = [FunctionTool.from_defaults(fn=ledger.tool()(create_ticket_of(tickets)))]
    run(Script(ticket()), tools)
    run(Script(ticket()), tools)
    assert tickets.count() == 1
    assert tickets.scopes == ["default"]


def test_runs_without_a_conversation_make_a_ticket_per_call_without_onceonly(tickets: Tickets) -> None:
    tools = [FunctionTool.from_defaults(fn=create_ticket_of(tickets))]
    run(Script(ticket(), ticket()), tools)
    run(Script(ticket()), tools)
    assert tickets.count() == 3


@pytest.mark.parametrize("guarded", [False, True])
def test_an_async_tool(ledger: Ledger, tickets: Tickets, guarded: bool) -> None:
    async def create_ticket(title: str) -> dict[str, Any]:
        """Open a support ticket."""
        await asyncio.sleep(0)
        return {"id": tickets.add(title)}

    tools = guard_tools([create_ticket], ledger) if guarded else [FunctionTool.from_defaults(async_fn=create_ticket)]
    for name in ("conv-a", "conv-b"):
        with ledger.task(name):
            run(Script(ticket(), ticket(), [*ticket(), *ticket()]), tools)
    assert tickets.count() == (2 if guarded else 8)
    if guarded:
        assert tickets.scopes == ["conv-a", "conv-b"]


@pytest.mark.parametrize("guarded", [False, True])
def test_arguments_are_keyed_as_the_tool_uses_them(ledger: Ledger, guarded: bool) -> None:
    """LlamaIndex hands the tool the model's JSON as it came; the guard coerces it by the tool's schema:
    500, "500" and 500.0 for an int are one charge."""
    charged: list[Any] = []

    def charge(customer: str, cents: int) -> str:
        """Charge a customer."""
        charged.append(cents)
        return f"charged {cents}"

    tools = guard_tools([charge], ledger) if guarded else [FunctionTool.from_defaults(fn=charge)]
    script = Script(*([("charge", {"customer": "c1", "cents": v})] for v in (500, "500", 500.0)), "ok")
    with ledger.task("conv-a"):
        run(script, tools)
    assert charged == ([500] if guarded else [500, "500", 500.0])


# --- the tool as LlamaIndex and the model see it -------------------------------------------------------


def test_the_schema_the_model_is_shown_has_no_key_and_no_context(ledger: Ledger, tickets: Tickets) -> None:
    """A ``ctx: Context`` parameter reaches the function (LlamaIndex injects it) and stays out of the key
    and the schema; ``idempotency_key`` is the ledger's, never the model's."""
    got: list[Any] = []

    def create_ticket(ctx: Context, title: str, idempotency_key: str, priority: int = 3) -> str:
        """Open a support ticket."""
        got.append((type(ctx).__name__, idempotency_key))
        return f"ticket {tickets.add(title)}/{priority}"

    tool = guard(create_ticket, ledger)
    script = Script(ticket(), ticket(), "ok")
    with ledger.task("conv-a"):
        run(script, [tool])
    (shown,) = script.shown[0]
    params = shown["function"]["parameters"]
    assert sorted(params["properties"]) == ["priority", "title"], params
    assert params["required"] == ["title"]
    assert "idempotency_key" not in shown["function"]["description"]
    assert "ctx" not in shown["function"]["description"]
    assert tickets.count() == 1
    assert got[0][0] == "Context" and got[0][1].startswith("conv-a:create_ticket:")


def test_a_guarded_function_tool_keeps_its_name_description_and_settings(ledger: Ledger, tickets: Tickets) -> None:
    def create_ticket(title: str, queue: str, priority: int = 3) -> str:
        return f"{title}/{queue}/{priority}"

    original = FunctionTool.from_defaults(
        fn=create_ticket, name="open_ticket", description="Open a ticket.", return_direct=True,
        partial_params={"queue": "it"},
    )  # fmt: skip
    guarded = guard(original, ledger)
    assert isinstance(guarded, GuardedTool)
    assert guarded.metadata.name == "open_ticket" and guarded.metadata.description == "Open a ticket."
    assert guarded.metadata.return_direct
    assert guarded.metadata.get_parameters_dict() == original.metadata.get_parameters_dict()
    with ledger.task("conv-a"):
        assert guarded.call(title="x").content == "x/it/3"
        again = asyncio.run(guarded.acall(title="x"))
    assert NOT_REPEATED in again.content
    (record,) = ledger.list(tool="open_ticket")
    assert record.state.value == "confirmed"


def test_a_guarded_function_is_taken_with_its_decorators_settings(ledger: Ledger, tickets: Tickets) -> None:
    fn = ledger.tool(name="tickets.create")(create_ticket_of(tickets))
    made = guard(fn, ledger)
    assert made.metadata.name == "create_ticket"
    with ledger.task("conv-a"):
        made.call(title="t")
    assert [r.tool for r in ledger.list()] == ["tickets.create"]
    with pytest.raises(TypeError, match=r"already an @ledger\.tool function"):
        guard(fn, ledger, timeout=5)
    with pytest.raises(TypeError, match=r"guarded already"):
        guard(made, ledger)


def test_a_function_tool_is_refused_by_the_decorator_with_the_way_in(ledger: Ledger, tickets: Tickets) -> None:
    with pytest.raises(TypeError, match=r"onceonly\.llamaindex\.guard"):
        ledger.tool()(FunctionTool.from_defaults(fn=create_ticket_of(tickets)))


def test_a_direct_call_that_is_told_returns_an_error_output(ledger: Ledger, tickets: Tickets) -> None:
    """Outside an agent, too, a call that is not an outcome is a ToolOutput with the model's text."""
    tool = guard(lost_answer_of(tickets), ledger)
    with ledger.task("conv-a"):
        first, second = tool.call(title="t"), asyncio.run(tool.acall(title="t"))
    assert tickets.count() == 1
    assert first.is_error and second.is_error and second.content.startswith(UNKNOWN)


def test_arguments_the_schema_refuses_are_an_error_output_and_nothing_runs(ledger: Ledger, tickets: Tickets) -> None:
    tool = guard(create_ticket_of(tickets), ledger)
    with ledger.task("conv-a"):
        out = tool.call(title=["not", "text"])
    assert out.is_error and "title" in out.content
    assert tickets.count() == 0 and ledger.list() == []


def test_the_tools_own_error_reaches_the_model_as_llamaindex_reports_it(ledger: Ledger) -> None:
    def create_ticket(title: str) -> str:
        """Open a support ticket."""
        raise ValueError("title too long")

    script = Script(ticket())
    with ledger.task("conv-a"):
        result = run(script, guard_tools([create_ticket], ledger))
    (out,) = outputs(result)
    assert out.is_error and out.content == "title too long"


def test_told_pickles_with_its_text_and_state() -> None:
    err = pickle.loads(pickle.dumps(Told("the text", "in_progress", "k:t:1")))
    assert (str(err), err.state, err.key) == ("the text", "in_progress", "k:t:1")


# --- the workflow's pause passes through -------------------------------------------------------------


@pytest.mark.parametrize("guarded", [False, True])
def test_a_tool_waiting_for_approval_runs_when_it_arrives(ledger: Ledger, tickets: Tickets, guarded: bool) -> None:
    """``ctx.wait_for_event`` raises the workflow's WaitingForEvent and the step runs again once the
    event arrives: the guard gives the claim back without counting an attempt, so the call made again
    runs. A plain @ledger.tool counts the pause as a failed attempt: with one attempt, the approved
    refund is never made."""

    async def refund(ctx: Context, order: str) -> str:
        """Refund an order, once a person approves."""
        ev = await ctx.wait_for_event(
            HumanResponseEvent, waiter_event=InputRequiredEvent(prefix=f"refund {order}?"), waiter_id=f"ok-{order}"
        )
        tickets.add(order)
        return f"refunded {order}: {ev.response}"

    once = Retry(attempts=1)
    if guarded:
        tool: Any = guard(refund, ledger, retry=once)
    else:
        tool = FunctionTool.from_defaults(async_fn=ledger.tool(ignore=("ctx",), retry=once)(refund))
    script = Script([("refund", {"order": "o-1"})], "ok")

    async def main() -> Any:
        agent = FunctionAgent(tools=[tool], llm=MockFunctionCallingLLM(response_generator=script))
        with ledger.task("conv-a"):
            handler = agent.run("refund o-1")
        async for ev in handler.stream_events():
            if isinstance(ev, InputRequiredEvent):
                handler.ctx.send_event(HumanResponseEvent(response="approved"))
        return await handler

    result = asyncio.run(main())
    (out,) = outputs(result)
    if not guarded:
        assert tickets.count() == 0 and out.is_error
        return
    assert tickets.count() == 1
    assert out.content == "refunded o-1: approved"
    (record,) = ledger.list()
    assert record.state.value == "confirmed" and record.attempts == 1


# --- the package and the example ---------------------------------------------------------------------


def test_onceonly_does_not_import_llamaindex() -> None:
    light = "import sys, onceonly; print([m for m in ('llama_index', 'workflows') if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", light], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    missing = "import sys; sys.modules['llama_index.core'] = None; import onceonly.llamaindex"
    done = subprocess.run([sys.executable, "-c", missing], capture_output=True, text=True, check=False)
    assert "onceonly.llamaindex needs llama-index-core: pip install 'onceonly[llamaindex]" in done.stderr


def test_the_example_runs_offline(tmp_path: Path) -> None:
    """examples/llamaindex_agent.py: two tickets without onceonly, one with, and what the model read."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "llamaindex_agent.py")],
        capture_output=True, text=True, check=False, timeout=120, cwd=tmp_path,
        env={**__import__("os").environ, "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "without onceonly: 2 tickets" in done.stdout
    assert "with onceonly: 1 ticket" in done.stdout
    assert UNKNOWN in done.stdout and "onceonly resolve" not in done.stdout
