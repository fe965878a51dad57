"""onceonly.agno: Agno function tools that act once per conversation, run by the real Agent.

A scripted model (a real ``agno.models.base.Model`` subclass that answers from a script) stands in for a
real model: no API key, no network; it keeps every message list it is sent and the tools it is shown. Side
effects are rows in a SQLite table of the test's own, so each test can show the duplicate without onceonly's
guard and its absence with it.

Written without ``from __future__ import annotations``, as Agno's own examples are: Agno reads a tool's
annotations with ``get_type_hints`` and finds a ``RunContext`` parameter by its type.
"""

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("agno")

from agno.agent import Agent
from agno.db.sqlite import SqliteDb
from agno.exceptions import StopAgentRun
from agno.models.base import Model
from agno.models.message import Message
from agno.models.response import ModelResponse
from agno.run import RunContext
from agno.tools import Toolkit, tool

from onceonly import Ledger, Retry, edge
from onceonly.agno import SETTING, conversation_scope, guard, guard_tools
from tests._tickets import Tickets

ROOT = Path(__file__).resolve().parent.parent
UNKNOWN = "The outcome of this action is unknown"
NOT_REPEATED = "and was not repeated"

Reply = str | list[tuple[str, dict[str, Any]]]


@dataclass
class Scripted(Model):
    """A model that answers each request with the next scripted reply (a text, or tool calls), and keeps
    the messages and the tools it was sent."""

    id: str = "scripted"
    name: str = "Scripted"
    provider: str = "onceonly-tests"
    replies: list[Reply] = field(default_factory=list)
    seen: list[list[Message]] = field(default_factory=list)
    shown: list[list[dict[str, Any]]] = field(default_factory=list)
    calls: int = 0

    def _reply(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> ModelResponse:
        self.seen.append(list(messages))
        self.shown.append(list(tools or ()))
        reply = self.replies.pop(0) if self.replies else "done"
        if isinstance(reply, str):
            return ModelResponse(role="assistant", content=reply)
        calls = []
        for name, args in reply:
            self.calls += 1
            calls.append(
                {
                    "id": f"call_{self.calls}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(args)},
                }
            )
        return ModelResponse(role="assistant", tool_calls=calls)

    def invoke(self, messages: list[Message], assistant_message: Message, *args: Any, **kwargs: Any) -> ModelResponse:
        return self._reply(messages, kwargs.get("tools"))

    async def ainvoke(
        self, messages: list[Message], assistant_message: Message, *args: Any, **kwargs: Any
    ) -> ModelResponse:
        return self._reply(messages, kwargs.get("tools"))

    def invoke_stream(self, *args: Any, **kwargs: Any) -> Iterator[ModelResponse]:
        yield self.invoke(*args, **kwargs)

    async def ainvoke_stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[ModelResponse]:  # type: ignore[override]
        yield await self.ainvoke(*args, **kwargs)

    def _parse_provider_response(self, response: Any, **kwargs: Any) -> ModelResponse:
        return response  # type: ignore[no-any-return]

    def _parse_provider_response_delta(self, response: Any) -> ModelResponse:
        return response  # type: ignore[no-any-return]

    def tool_results(self) -> list[str]:
        """The tool results in the last request the model was sent (it holds the run's messages), in order."""
        return [str(m.content) for m in self.seen[-1] if m.role == "tool"]


def ticket(title: str = "printer out of toner") -> list[tuple[str, dict[str, Any]]]:
    return [("create_ticket", {"title": title})]


def agent(model: Scripted, tools: list[Any], **kwargs: Any) -> Agent:
    return Agent(model=model, tools=tools, **kwargs)


@pytest.fixture(name="ledger")
def fixture_ledger(sqlite_url: str) -> Iterator[Ledger]:
    ledger = Ledger.open(sqlite_url)
    yield ledger
    ledger.close()


@pytest.fixture(name="tickets")
def fixture_tickets(tmp_path: Path) -> Tickets:
    return Tickets(tmp_path / "tickets.db")


def create_ticket_of(tickets: Tickets) -> Any:
    def create_ticket(title: str) -> str:
        """Open a support ticket."""
        return f"ticket {tickets.add(title)}"

    return create_ticket


def lost_answer_of(tickets: Tickets) -> Any:
    def create_ticket(title: str) -> str:
        """Open a support ticket."""
        tickets.add(title)  # committed; then the answer is lost
        raise TimeoutError("the ticket service did not answer")

    return create_ticket


# --- a lost answer, a replay, parallel calls ---------------------------------------------------------


def test_a_lost_answer_retried_makes_two_tickets_without_onceonly(tickets: Tickets) -> None:
    model = Scripted(replies=[ticket(), ticket(), "It is pending."])
    agent(model, [lost_answer_of(tickets)]).run("toner", session_id="conv-a")
    assert tickets.count() == 2
    assert all("did not answer" in t for t in model.tool_results())


def test_a_lost_answer_retried_makes_one_ticket_and_the_model_reads_the_unknown_text(
    ledger: Ledger, tickets: Tickets, caplog: pytest.LogCaptureFixture
) -> None:
    """The tool timed out after its side effect: the model's next input holds the unknown text as the
    tool's result (the run goes on), never the operator's ``onceonly resolve``, which goes to the log; the
    model's retry makes no second ticket."""
    model = Scripted(replies=[ticket(), ticket(), "It is pending."])
    with caplog.at_level("WARNING", logger="onceonly"):
        result = agent(model, guard_tools([lost_answer_of(tickets)], ledger)).run("toner", session_id="conv-a")
    assert tickets.count() == 1
    assert result.content == "It is pending."
    read = model.tool_results()
    assert len(read) == 2 and all(t.startswith(UNKNOWN) and "onceonly resolve" not in t for t in read), read
    assert "onceonly resolve" in caplog.text


def test_a_replan_replays_and_the_model_reads_the_replay(ledger: Ledger, tickets: Tickets) -> None:
    model = Scripted(replies=[ticket(), ticket(), "Ticket opened."])
    agent(model, guard_tools([create_ticket_of(tickets)], ledger)).run("toner", session_id="conv-a")
    assert tickets.count() == 1
    first, second = model.tool_results()
    assert first == "ticket 1"
    assert NOT_REPEATED in second and "ticket 1" in second


def test_a_replan_makes_two_tickets_without_onceonly(tickets: Tickets) -> None:
    agent(Scripted(replies=[ticket(), ticket(), "ok"]), [create_ticket_of(tickets)]).run("t", session_id="conv-a")
    assert tickets.count() == 2


@pytest.mark.parametrize("guarded", [False, True])
def test_the_same_call_twice_in_one_turn(ledger: Ledger, tickets: Tickets, guarded: bool) -> None:
    """agent.arun() runs the calls of one response at once (asyncio.gather, a sync tool each in a worker
    thread): with the guard the second waits for the first and replays it."""
    tools = guard_tools([create_ticket_of(tickets)], ledger) if guarded else [create_ticket_of(tickets)]
    model = Scripted(replies=[[*ticket(), *ticket()], "ok"])
    asyncio.run(agent(model, tools).arun("toner", session_id="conv-a"))
    if not guarded:
        assert tickets.count() == 2
        return
    assert tickets.count() == 1
    read = model.tool_results()
    assert sorted(NOT_REPEATED in c for c in read) == [False, True], read
    assert all("ticket 1" in c for c in read)


# --- who is calling -------------------------------------------------------------------------------


def test_two_sessions_make_two_tickets_and_each_replays_its_own(ledger: Ledger, tickets: Tickets) -> None:
    tools = guard_tools([create_ticket_of(tickets)], ledger)
    for session in ("conv-a", "conv-b", "conv-a"):
        agent(Scripted(replies=[ticket()]), tools).run("toner", session_id=session)
    assert tickets.count() == 2
    assert tickets.scopes == ['c:[null,"conv-a"]', 'c:[null,"conv-b"]']


def test_the_same_session_again_makes_another_ticket_without_onceonly(tickets: Tickets) -> None:
    for session in ("conv-a", "conv-b", "conv-a"):
        agent(Scripted(replies=[ticket()]), [create_ticket_of(tickets)]).run("toner", session_id=session)
    assert tickets.count() == 3


def test_two_users_of_one_session_id_never_share(ledger: Ledger, tickets: Tickets) -> None:
    tools = guard_tools([create_ticket_of(tickets)], ledger)
    for user in ("alice", "bob", "alice"):
        agent(Scripted(replies=[ticket()]), tools).run("toner", session_id="s-1", user_id=user)
    assert tickets.count() == 2
    assert tickets.scopes == ['c:["alice","s-1"]', 'c:["bob","s-1"]']


def test_a_ledger_task_around_the_run_wins(ledger: Ledger, tickets: Tickets) -> None:
    tools = guard_tools([create_ticket_of(tickets)], ledger)
    with ledger.task("order-7"):
        agent(Scripted(replies=[ticket()]), tools).run("toner", session_id="s-1")
        agent(Scripted(replies=[ticket()]), tools).run("toner", session_id="s-2")
    assert tickets.count() == 1
    assert tickets.scopes == ["order-7"]


def test_a_session_kept_in_a_database_is_the_conversation(ledger: Ledger, tickets: Tickets, tmp_path: Path) -> None:
    """An agent with a database keeps its session across runs (the one it made up included): its runs
    are one conversation, and a re-run replays."""
    tools = guard_tools([create_ticket_of(tickets)], ledger)
    kept = agent(Scripted(replies=[ticket(), "ok", ticket()]), tools, db=SqliteDb(db_file=str(tmp_path / "agno.db")))
    kept.run("toner")
    kept.run("again")
    assert tickets.count() == 1
    assert tickets.scopes[0] == caller_scope_of(None, kept.session_id)


def caller_scope_of(user: str | None, session: str | None) -> str:
    return edge.caller_scope("c", json.dumps([user, session], separators=(",", ":")))


def test_runs_without_a_conversation_are_scoped_to_themselves_with_one_warning(
    ledger: Ledger, tickets: Tickets, caplog: pytest.LogCaptureFixture
) -> None:
    """No session given, no database, no user: the session id the agent made up for itself is every
    caller's of that agent, so each run is its own scope (its run_id): a re-plan in a run replays,
    another run makes its own ticket, and one warning names the setting."""
    edge._warned.discard(("agno", SETTING))  # the warning is once per process
    shared = agent(
        Scripted(replies=[ticket(), ticket(), "ok", ticket()]), guard_tools([create_ticket_of(tickets)], ledger)
    )
    with caplog.at_level("WARNING", logger="onceonly"):
        first = shared.run("toner")
        second = shared.run("toner")
    assert first.session_id == second.session_id  # Agno keeps the one it made up
    assert tickets.count() == 2
    assert len(set(tickets.scopes)) == 2 and all(s and s.startswith("r:") for s in tickets.scopes), tickets.scopes
    warnings = [r for r in caplog.records if "names no conversation" in r.getMessage()]
    assert len(warnings) == 1 and SETTING in warnings[0].getMessage()


def test_runs_without_a_conversation_make_a_ticket_per_call_without_onceonly(tickets: Tickets) -> None:
    shared = agent(Scripted(replies=[ticket(), ticket(), "ok", ticket()]), [create_ticket_of(tickets)])
    shared.run("toner")
    shared.run("toner")
    assert tickets.count() == 3


def test_runs_without_a_conversation_share_the_ledgers_scope_with_a_plain_guarded_function(
    ledger: Ledger, tickets: Tickets
) -> None:
    """Why the run scope: a plain @ledger.tool keys every run in the ledger's one scope, so the second
    run (maybe another user) is handed the first run's ticket."""
    plain = ledger.tool()(create_ticket_of(tickets))
    agent(Scripted(replies=[ticket()]), [plain]).run("toner")
    agent(Scripted(replies=[ticket()]), [plain]).run("toner")
    assert tickets.count() == 1
    assert tickets.scopes == ["default"]


@pytest.mark.parametrize("guarded", [False, True])
def test_an_async_tool(ledger: Ledger, tickets: Tickets, guarded: bool) -> None:
    async def create_ticket(title: str) -> str:
        """Open a support ticket."""
        await asyncio.sleep(0)
        return f"ticket {tickets.add(title)}"

    tools = guard_tools([create_ticket], ledger) if guarded else [create_ticket]
    for session in ("conv-a", "conv-b"):
        model = Scripted(replies=[ticket(), [*ticket(), *ticket()], "ok"])
        asyncio.run(agent(model, tools).arun("toner", session_id=session))
    assert tickets.count() == (2 if guarded else 6)
    if guarded:
        assert tickets.scopes == [caller_scope_of(None, "conv-a"), caller_scope_of(None, "conv-b")]


@pytest.mark.parametrize("guarded", [False, True])
def test_arguments_are_keyed_as_agno_validated_them(ledger: Ledger, guarded: bool) -> None:
    """Agno validates the model's JSON with the function's signature before the ledger keys it: 500,
    "500" and 500.0 for an int are one charge."""
    charged: list[Any] = []

    def charge(customer: str, cents: int) -> str:
        """Charge a customer."""
        charged.append(cents)
        return f"charged {cents}"

    tools = guard_tools([charge], ledger) if guarded else [charge]
    model = Scripted(replies=[*([("charge", {"customer": "c1", "cents": v})] for v in (500, "500", 500.0)), "ok"])
    agent(model, tools).run("charge", session_id="conv-a")
    assert charged == ([500] if guarded else [500, 500, 500])


# --- the tool as Agno and the model see it ---------------------------------------------------------------


def test_the_schema_the_model_is_shown_has_no_key_and_no_injected_parameter(ledger: Ledger, tickets: Tickets) -> None:
    """``run_context``, ``agent`` and a parameter typed ``RunContext`` reach the function (Agno injects
    them) and stay out of the key and the schema; ``idempotency_key`` is the ledger's, never the model's."""
    got: list[Any] = []

    def create_ticket(
        title: str, idempotency_key: str, run_context: RunContext, agent: Agent, ctx: RunContext, priority: int = 3
    ) -> str:
        """Open a support ticket."""
        got.append((run_context.session_id, type(agent).__name__, ctx is run_context, idempotency_key))
        return f"ticket {tickets.add(title)}/{priority}"

    model = Scripted(replies=[ticket(), ticket(), "ok"])
    Agent(model=model, tools=[guard(create_ticket, ledger)]).run("toner", session_id="conv-a")
    (shown,) = model.shown[0]
    params = shown["function"]["parameters"]
    assert sorted(params["properties"]) == ["priority", "title"], params
    assert params["required"] == ["title"]
    assert tickets.count() == 1
    session, owner, same, key = got[0]
    assert (session, owner, same) == ("conv-a", "Agent", True)
    assert key.startswith(caller_scope_of(None, "conv-a").replace(":", "%3A"))


def test_a_tool_decorated_function_keeps_its_name_description_and_settings(ledger: Ledger, tickets: Tickets) -> None:
    @tool(name="open_ticket", description="Open a ticket.", stop_after_tool_call=True, show_result=True)
    def create_ticket(title: str, idempotency_key: str) -> str:
        return f"ticket {tickets.add(title)}"

    guarded = guard(create_ticket, ledger)
    assert (guarded.name, guarded.description) == ("open_ticket", "Open a ticket.")
    assert guarded.stop_after_tool_call and guarded.show_result
    model = Scripted(replies=[[("open_ticket", {"title": "t"})]])
    agent(model, [guarded]).run("toner", session_id="conv-a")
    (shown,) = model.shown[0]
    assert sorted(shown["function"]["parameters"]["properties"]) == ["title"]
    assert ledger.list()[0].tool == "open_ticket"
    assert tickets.count() == 1


def test_a_toolkits_functions_are_guarded_each(ledger: Ledger, tickets: Tickets) -> None:
    class Helpdesk(Toolkit):
        def __init__(self) -> None:
            super().__init__(name="helpdesk", tools=[self.create_ticket])

        def create_ticket(self, title: str, priority: int = 3) -> str:
            """Open a support ticket."""
            return f"ticket {tickets.add(title)}/{priority}"

    tools = guard_tools([Helpdesk()], ledger)
    assert [t.name for t in tools] == ["create_ticket"]
    calls = [("create_ticket", {"title": "t", "priority": p}) for p in ("2", 2)]
    model = Scripted(replies=[[calls[0]], [calls[1]], "ok"])
    agent(model, tools).run("toner", session_id="conv-a")
    assert tickets.count() == 1
    assert NOT_REPEATED in model.tool_results()[1]


def test_a_guarded_function_is_taken_with_its_decorators_settings(ledger: Ledger, tickets: Tickets) -> None:
    fn = ledger.tool(name="tickets.create")(create_ticket_of(tickets))
    made = guard(fn, ledger)
    assert made.name == "create_ticket"
    agent(Scripted(replies=[ticket()]), [made]).run("toner", session_id="conv-a")
    assert [r.tool for r in ledger.list()] == ["tickets.create"]
    with pytest.raises(TypeError, match=r"already an @ledger\.tool function"):
        guard(fn, ledger, timeout=5)
    with pytest.raises(TypeError, match=r"guarded already"):
        guard(made, ledger)


def test_a_function_object_is_refused_by_the_decorator_with_the_way_in(ledger: Ledger, tickets: Tickets) -> None:
    with pytest.raises(TypeError, match=r"onceonly\.agno\.guard"):
        ledger.tool()(tool(create_ticket_of(tickets)))


def test_the_tools_own_error_reaches_the_model_as_agno_reports_it(ledger: Ledger) -> None:
    def create_ticket(title: str) -> str:
        """Open a support ticket."""
        raise ValueError("title too long")

    model = Scripted(replies=[ticket(), "ok"])
    agent(model, guard_tools([create_ticket], ledger)).run("toner", session_id="conv-a")
    assert model.tool_results() == ["title too long"]


def test_the_conversation_scope_of_a_run_context() -> None:
    assert conversation_scope(RunContext(run_id="r", session_id="s", user_id="u")) == 'c:["u","s"]'
    assert conversation_scope(RunContext(run_id="r", session_id="")) is None


# --- Agno's control flow passes through ----------------------------------------------------------------


@pytest.mark.parametrize("guarded", [False, True])
def test_stop_agent_run_gives_the_claim_back(ledger: Ledger, tickets: Tickets, guarded: bool) -> None:
    """A tool that raises StopAgentRun (Agno's "stop here") before its side effect: the guard gives the
    claim back without counting an attempt, so the call made in the next run runs. A plain @ledger.tool
    counts it as a failed attempt: with one attempt, the next run's ticket is never made."""
    stop = [True]

    def create_ticket(title: str) -> str:
        """Open a support ticket."""
        if stop.pop(0) if stop else False:
            raise StopAgentRun("a person must look first")
        return f"ticket {tickets.add(title)}"

    once = Retry(attempts=1)
    tools = [guard(create_ticket, ledger, retry=once)] if guarded else [ledger.tool(retry=once)(create_ticket)]
    with ledger.task("conv-a"):
        agent(Scripted(replies=[ticket()]), tools).run("toner", session_id="conv-a")
        assert tickets.count() == 0
        model = Scripted(replies=[ticket(), "ok"])
        agent(model, tools).run("toner", session_id="conv-a")
    if not guarded:
        assert tickets.count() == 0
        return
    assert tickets.count() == 1
    assert model.tool_results() == ["ticket 1"]
    (record,) = ledger.list()
    assert record.state.value == "confirmed" and record.attempts == 1


@pytest.mark.parametrize("guarded", [False, True])
def test_a_tool_that_requires_confirmation_runs_once_after_it(ledger: Ledger, tickets: Tickets, guarded: bool) -> None:
    """Agno pauses a tool that requires confirmation before calling it; the guard runs when Agno calls it,
    after the confirmation, in the run's session: once, and a re-plan after it replays."""

    @tool(requires_confirmation=True)
    def create_ticket(title: str) -> str:
        """Open a support ticket."""
        return f"ticket {tickets.add(title)}"

    model = Scripted(replies=[ticket(), ticket(), "ok"])
    helpdesk = agent(model, [guard(create_ticket, ledger) if guarded else create_ticket])
    paused = helpdesk.run("toner", session_id="conv-a", user_id="ada")
    for _ in range(2):
        assert paused.is_paused and tickets.count() <= 1
        for waiting in paused.tools_requiring_confirmation:
            waiting.confirmed = True
        paused = helpdesk.continue_run(run_response=paused)
    assert not paused.is_paused
    if not guarded:
        assert tickets.count() == 2
        return
    assert tickets.count() == 1
    assert tickets.scopes == [caller_scope_of("ada", "conv-a")]
    assert NOT_REPEATED in model.tool_results()[1]


# --- the package and the example ---------------------------------------------------------------------


def test_onceonly_does_not_import_agno() -> None:
    light = "import sys, onceonly; print([m for m in ('agno',) if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", light], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
    missing = "import sys; sys.modules['agno'] = None; import onceonly.agno"
    done = subprocess.run([sys.executable, "-c", missing], capture_output=True, text=True, check=False)
    assert "onceonly.agno needs agno: pip install 'onceonly[agno]" in done.stderr


def test_the_example_runs_offline(tmp_path: Path) -> None:
    """examples/agno_agent.py: two tickets without onceonly, one with, and what the model read."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agno_agent.py")],
        capture_output=True, text=True, check=False, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "without onceonly: 2 tickets" in done.stdout
    assert "with onceonly: 1 ticket" in done.stdout
    assert UNKNOWN in done.stdout and "onceonly resolve" not in done.stdout
