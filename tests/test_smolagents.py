"""smolagents has no onceonly integration: ``@ledger.tool(tell_model=True)`` under its ``@tool`` decorator,
run by the real ToolCallingAgent.

smolagents puts a tool's return value into the model's next input as an observation, and an exception as
``Error executing tool …: {type}: {str(exception)}`` followed by "Please try again or use another tool".
A scripted model (a real ``smolagents.Model`` subclass that answers with scripted tool calls) keeps every
input it was given, so each test reads exactly what the model read.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("smolagents")

from smolagents import Model, Tool, ToolCallingAgent, tool
from smolagents.models import ChatMessage, ChatMessageToolCall, ChatMessageToolCallFunction, MessageRole

import onceonly
from onceonly import Ledger
from tests._tickets import Tickets

UNKNOWN = "The outcome of this action is unknown"
REPLAYED = re.compile(r"This action was already done at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ and was not repeated\.")


class ScriptedModel(Model):
    """Answers each step with the next scripted list of tool calls; keeps every input it was given."""

    def __init__(self, *steps: list[tuple[str, dict[str, Any]]]) -> None:
        super().__init__(model_id="scripted")
        self.steps = list(steps)
        self.inputs: list[list[Any]] = []

    def generate(self, messages: list[Any], *args: Any, **kwargs: Any) -> ChatMessage:
        self.inputs.append(list(messages))
        calls = self.steps.pop(0) if self.steps else [("final_answer", {"answer": "done"})]
        n = len(self.inputs)
        return ChatMessage(
            role=MessageRole.ASSISTANT,
            content="",
            tool_calls=[
                ChatMessageToolCall(
                    id=f"call_{n}_{i}",
                    type="function",
                    function=ChatMessageToolCallFunction(name=name, arguments=arguments),
                )
                for i, (name, arguments) in enumerate(calls)
            ],
        )

    def read(self, step: int) -> str:
        """The text of the model's input at ``step`` (0-based), all its messages."""
        parts: list[str] = []
        for m in self.inputs[step]:
            content = m.content if isinstance(m, ChatMessage) else m["content"]
            for block in content if isinstance(content, list) else [{"text": content}]:
                parts.append(str(block.get("text", "")))
        return "\n".join(parts)

    def observations(self) -> list[str]:
        """The observation or error the model read after each tool step, in order."""
        out = []
        for step in range(1, len(self.inputs)):
            new = self.read(step)[len(self.read(step - 1)) :]
            out.append(new)
        return out


TICKET = ("create_ticket", {"title": "printer out of toner"})
DONE = ("final_answer", {"answer": "done"})


@pytest.fixture(name="tickets")
def fixture_tickets(tmp_path: Path) -> Tickets:
    return Tickets(tmp_path / "tickets.db")


@pytest.fixture(name="release")
def fixture_release() -> Iterator[threading.Event]:
    """Lets a slow tool's body finish at the end of the test (it keeps running after its timeout)."""
    event = threading.Event()
    yield event
    event.set()


def slow_ticket_tool(ledger: Ledger, tickets: Tickets, release: threading.Event, **settings: Any) -> Any:
    """A ticket tool whose side effect happens, then whose answer is lost: it times out after 0.2 s."""

    @ledger.tool(timeout=0.2, **settings)
    def create_ticket(title: str) -> str:
        """Open a support ticket.

        Args:
            title: what the ticket is about.
        """
        number = tickets.add(title)
        release.wait(10)
        return f"ticket {number}"

    return create_ticket


def answer_late(ledger: Ledger, key: str, release: threading.Event) -> None:
    """Let the timed-out body finish, and wait until its late result has confirmed the record."""
    release.set()
    deadline = time.monotonic() + 10
    while (rec := ledger.get(key)) is not None and rec.state.value != "confirmed" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rec is not None and rec.state.value == "confirmed"


def run(model: ScriptedModel, fn: Any) -> Any:
    agent = ToolCallingAgent(tools=[tool(fn)], model=model, max_steps=5, verbosity_level=0)
    return agent.run("The printer on floor 3 is out of toner: open a ticket.")


# --- what the model reads -------------------------------------------------------------------------


def test_without_the_setting_the_model_reads_the_operators_text(
    sqlite_url: str, tickets: Tickets, release: threading.Event
) -> None:
    """What tell_model=True is for: the OutcomeUnknown's message reaches the model — the ledger key and
    ``onceonly resolve … --confirmed JSON | --failed REASON`` — followed by smolagents' "Please try again"."""
    ledger = Ledger.open(sqlite_url)
    model = ScriptedModel([TICKET], [TICKET], [DONE])
    fn = slow_ticket_tool(ledger, tickets, release)
    run(model, fn)
    key = fn.key_for("printer out of toner")
    first, second = model.observations()
    for read in (first, second):
        assert "onceonly resolve" in read and "--confirmed JSON" in read and key in read
        assert "Please try again" in read
    assert tickets.count() == 1  # the ledger held: the leak is in what the model reads
    answer_late(ledger, key, release)
    ledger.close()


def test_an_unknown_outcome_reads_as_unknown_and_never_as_operator_text(
    ledger: Ledger, tickets: Tickets, release: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    """With tell_model=True the model reads the unknown text as the tool's observation, and its retry
    reads it again without making a second ticket; the operator's text is in the log."""
    model = ScriptedModel([TICKET], [TICKET], [DONE])
    fn = slow_ticket_tool(ledger, tickets, release, tell_model=True)
    with caplog.at_level("WARNING", logger="onceonly"):
        run(model, fn)
    first, second = model.observations()
    for read in (first, second):
        assert UNKNOWN in read and "Do not issue it again" in read
        assert "onceonly resolve" not in read and fn.key_for("printer out of toner") not in read
        assert "Error executing tool" not in read and "Please try again" not in read
    assert tickets.count() == 1
    assert "onceonly resolve" in caplog.text
    answer_late(ledger, fn.key_for("printer out of toner"), release)


def test_a_replay_says_it_was_not_repeated(ledger: Ledger, tickets: Tickets) -> None:
    """A second run of the same task (a retry, a restarted agent): the model reads that the ticket was
    already made and not repeated, and which one, instead of a result that looks fresh."""

    @ledger.tool(tell_model=True)
    def create_ticket(title: str) -> str:
        """Open a support ticket.

        Args:
            title: what the ticket is about.
        """
        return f"ticket {tickets.add(title)}"

    first, second = ScriptedModel([TICKET], [DONE]), ScriptedModel([TICKET], [DONE])
    run(first, create_ticket)
    run(second, create_ticket)
    assert "ticket 1" in first.observations()[0] and not REPLAYED.search(first.observations()[0])
    replayed = second.observations()[0]
    assert REPLAYED.search(replayed) and "Its result: ticket 1" in replayed
    assert tickets.count() == 1


def test_without_the_setting_a_replay_reads_like_a_fresh_result(ledger: Ledger, tickets: Tickets) -> None:
    @ledger.tool()
    def create_ticket(title: str) -> str:
        """Open a support ticket.

        Args:
            title: what the ticket is about.
        """
        return f"ticket {tickets.add(title)}"

    first, second = ScriptedModel([TICKET], [DONE]), ScriptedModel([TICKET], [DONE])
    run(first, create_ticket)
    run(second, create_ticket)
    assert first.observations()[0] == second.observations()[0]  # nothing says it was not done now


def test_a_late_answer_confirms_it_and_the_model_then_reads_the_replay(
    sqlite_url: str, tickets: Tickets, release: threading.Event
) -> None:
    """The timed-out call finishes after all: its result confirms the record, and the next call reads
    a replay of it."""
    ledger = Ledger.open(sqlite_url)
    fn = slow_ticket_tool(ledger, tickets, release, tell_model=True)
    model = ScriptedModel([TICKET], [DONE])
    run(model, fn)
    assert UNKNOWN in model.observations()[0]
    answer_late(ledger, fn.key_for("printer out of toner"), release)
    later = ScriptedModel([TICKET], [DONE])
    run(later, fn)
    assert REPLAYED.search(later.observations()[0]) and "ticket 1" in later.observations()[0]
    assert tickets.count() == 1
    ledger.close()


# --- the scope travels with the call ---------------------------------------------------------------


def test_parallel_tool_calls_run_in_threads_under_the_conversations_scope(ledger: Ledger, tickets: Tickets) -> None:
    """smolagents runs the calls of one step in a thread pool, each in a copy of the context: the
    ledger.task() around the run reaches them, so two identical calls make one ticket, and another
    conversation makes its own."""

    @ledger.tool(tell_model=True)
    def create_ticket(title: str) -> str:
        """Open a support ticket.

        Args:
            title: what the ticket is about.
        """
        time.sleep(0.05)
        return f"ticket {tickets.add(title)}"

    for conversation in ("conv-a", "conv-b"):
        with ledger.task(conversation):
            run(ScriptedModel([TICKET, TICKET], [DONE]), create_ticket)
    assert tickets.count() == 2
    assert tickets.scopes == ["conv-a", "conv-b"]


def test_smolagents_takes_the_guarded_functions_signature_and_docstring(ledger: Ledger) -> None:
    def create_ticket(title: str, priority: int = 3) -> str:
        """Open a support ticket.

        Args:
            title: what the ticket is about.
            priority: 1 (urgent) to 5.
        """
        return title

    plain, guarded = tool(create_ticket), tool(ledger.tool(tell_model=True)(create_ticket))
    assert (guarded.name, guarded.description, guarded.inputs, guarded.output_type) == (
        plain.name,
        plain.description,
        plain.inputs,
        plain.output_type,
    )


# --- onceonly.smolagents: guard_agent scopes each run ------------------------------------------------

from onceonly.smolagents import GuardedTool, guard, guard_agent  # noqa: E402


def plain_ticket_tool(tickets: Tickets, release: threading.Event | None = None, pause: float = 0.0) -> Any:
    """The undecorated side effect: a ticket row, then (with ``release``) an answer that may be lost."""

    def create_ticket(title: str) -> str:
        """Open a support ticket.

        Args:
            title: what the ticket is about.
        """
        number = tickets.add(title)
        if pause:
            time.sleep(pause)
        if release is not None:
            release.wait(10)
        return f"ticket {number}"

    return create_ticket


def agent_of(model: ScriptedModel, *tools: Any) -> ToolCallingAgent:
    return ToolCallingAgent(tools=list(tools), model=model, max_steps=5, verbosity_level=0)


TASK = "The printer on floor 3 is out of toner: open a ticket."


def test_without_onceonly_a_reissued_call_makes_a_second_ticket(tickets: Tickets) -> None:
    """The duplicate guard_agent stops: the model re-issues the call in the same run, and smolagents runs
    it again."""
    agent_of(ScriptedModel([TICKET], [TICKET], [DONE]), tool(plain_ticket_tool(tickets))).run(TASK)
    assert tickets.count() == 2


def test_a_lost_answer_reissued_in_the_run_makes_one_ticket_and_the_model_reads_unknown(
    ledger: Ledger, tickets: Tickets, release: threading.Event, caplog: pytest.LogCaptureFixture
) -> None:
    model = ScriptedModel([TICKET], [TICKET], [DONE])
    agent = guard_agent(agent_of(model, tool(plain_ticket_tool(tickets, release))), ledger, timeout=0.2)
    with caplog.at_level("WARNING", logger="onceonly"):
        agent.run(TASK)
    assert tickets.count() == 1
    first, second = model.observations()
    for read in (first, second):
        assert UNKNOWN in read and "Do not issue it again" in read
        assert "onceonly resolve" not in read and "Error executing tool" not in read and "Please try again" not in read
    assert "onceonly resolve" in caplog.text  # the operator's text goes to the log
    guarded = agent.tools["create_ticket"]
    assert isinstance(guarded, GuardedTool)
    [record] = ledger.list()
    answer_late(ledger, record.key, release)


def test_a_reissued_call_in_the_run_replays_and_says_so(ledger: Ledger, tickets: Tickets) -> None:
    model = ScriptedModel([TICKET], [TICKET], [DONE])
    guard_agent(agent_of(model, tool(plain_ticket_tool(tickets))), ledger).run(TASK)
    first, second = model.observations()
    assert "ticket 1" in first and not REPLAYED.search(first)
    assert REPLAYED.search(second) and "Its result: ticket 1" in second
    assert tickets.count() == 1


def test_two_runs_with_the_same_arguments_make_two_tickets(ledger: Ledger, tickets: Tickets) -> None:
    """No conversation named: each run is its own scope, so another run (maybe another user) is never
    handed the first one's result; reset=False continues the run, and replays."""
    model = ScriptedModel([TICKET], [DONE], [TICKET], [DONE], [TICKET], [DONE])
    agent = guard_agent(agent_of(model, tool(plain_ticket_tool(tickets))), ledger)
    agent.run(TASK)
    agent.run(TASK)
    assert tickets.count() == 2
    agent.run(TASK, reset=False)  # the same conversation, continued
    assert tickets.count() == 2
    assert len(set(tickets.scopes)) == 2


def test_a_ledger_task_around_the_runs_shares_records_across_them(ledger: Ledger, tickets: Tickets) -> None:
    agent = guard_agent(
        agent_of(ScriptedModel([TICKET], [DONE], [TICKET], [DONE]), tool(plain_ticket_tool(tickets))), ledger
    )
    with ledger.task("conv-17"):
        agent.run(TASK)
        agent.run(TASK)
    assert tickets.count() == 1 and tickets.scopes == ["conv-17"]


def test_two_identical_calls_in_one_step_make_one_ticket(ledger: Ledger, tickets: Tickets) -> None:
    """smolagents runs them in its thread pool, each in a copy of the run's context."""
    unguarded = Tickets(tickets.path.with_name("unguarded.db"))
    agent_of(ScriptedModel([TICKET, TICKET], [DONE]), tool(plain_ticket_tool(unguarded, pause=0.05))).run(TASK)
    assert unguarded.count() == 2  # without onceonly
    model = ScriptedModel([TICKET, TICKET], [DONE])
    guard_agent(agent_of(model, tool(plain_ticket_tool(tickets, pause=0.05))), ledger).run(TASK)
    assert tickets.count() == 1
    observed = model.observations()[0]
    assert "ticket 1" in observed and ("in progress" in observed.lower() or REPLAYED.search(observed))


def test_a_streamed_run_is_scoped_step_by_step(ledger: Ledger, tickets: Tickets) -> None:
    model = ScriptedModel([TICKET], [TICKET], [DONE])
    agent = guard_agent(agent_of(model, tool(plain_ticket_tool(tickets))), ledger)
    steps = list(agent.run(TASK, stream=True))
    assert steps and tickets.count() == 1
    assert onceonly.edge.task_scope() is None  # nothing of the run's scope is left behind


def test_a_tool_made_from_an_at_ledger_tool_function_is_guarded_once(ledger: Ledger, tickets: Tickets) -> None:
    fn = ledger.tool()(plain_ticket_tool(tickets))
    agent = guard_agent(agent_of(ScriptedModel([TICKET], [TICKET], [DONE]), tool(fn)), ledger)
    agent.run(TASK)
    assert tickets.count() == 1
    [record] = ledger.list()
    assert record.tool.endswith("create_ticket") and record.attempts == 1
    with pytest.raises(TypeError, match=r"already an @ledger\.tool"):
        guard(fn, ledger, timeout=1)


def test_a_tool_subclass_is_guarded_and_shows_the_model_the_same_inputs(ledger: Ledger, tickets: Tickets) -> None:
    class CreateTicket(Tool):
        name = "create_ticket"
        description = "Open a support ticket."
        inputs = {"title": {"type": "string", "description": "what the ticket is about"}}  # noqa: RUF012
        output_type = "string"

        def forward(self, title: str) -> str:
            return f"ticket {tickets.add(title)}"

    original = CreateTicket()
    guarded = guard(original, ledger)
    assert (guarded.name, guarded.description, guarded.inputs, guarded.output_type) == (
        original.name,
        original.description,
        original.inputs,
        original.output_type,
    )
    guard_agent(agent_of(ScriptedModel([TICKET], [TICKET], [DONE]), guarded), ledger).run(TASK)
    assert tickets.count() == 1


def test_the_model_is_never_shown_idempotency_key(ledger: Ledger) -> None:
    def create_ticket(title: str, idempotency_key: str = "") -> str:
        """Open a support ticket.

        Args:
            title: what the ticket is about.
            idempotency_key: filled in by the ledger.
        """
        return title

    assert set(guard(create_ticket, ledger).inputs) == {"title"}


def test_a_call_outside_any_run_is_its_own_scope(ledger: Ledger, tickets: Tickets) -> None:
    """A guarded tool called by hand, outside guard_agent and ledger.task, never replays another
    caller's result: it is scoped to itself."""
    guarded = guard(plain_ticket_tool(tickets), ledger)
    assert guarded(title="x") == "ticket 1"
    assert guarded(title="x") == "ticket 2"
    with ledger.task("conv-1"):
        assert guarded(title="x") == "ticket 3"
        assert REPLAYED.search(guarded(title="x"))


def test_a_managed_agent_runs_inside_its_managers_scope(ledger: Ledger, tickets: Tickets) -> None:
    helper_model = ScriptedModel([TICKET], [DONE], [TICKET], [DONE])
    helper = ToolCallingAgent(
        tools=[tool(plain_ticket_tool(tickets))],
        model=helper_model,
        max_steps=5,
        verbosity_level=0,
        name="helpdesk",
        description="Opens tickets.",
    )
    ask = ("helpdesk", {"task": "open a ticket for the printer"})
    manager = ToolCallingAgent(
        tools=[], model=ScriptedModel([ask], [ask], [DONE]), managed_agents=[helper], max_steps=5, verbosity_level=0
    )
    guard_agent(manager, ledger).run(TASK)
    assert tickets.count() == 1  # the manager asked twice in one run: the helper's second run replays
    assert isinstance(helper.tools["create_ticket"], GuardedTool)
