"""onceonly.langchain with the real LangChain and LangGraph classes and scripted chat models.

No framework is mocked: the agents are LangChain's ``create_agent`` (and LangGraph's deprecated
``create_react_agent``), hand-built ``StateGraph``s with a ``ToolNode``, real checkpointers (SQLite where
it matters), and ``GenericFakeChatModel`` playing a model that follows a script and records what it
was sent. Side effects are rows in a SQLite table, counted there.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import closing
from pathlib import Path
from typing import Annotated, Any

import pytest
from langchain.agents import create_agent
from langchain.tools import ToolRuntime
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.tools import BaseTool, InjectedToolCallId, StructuredTool, Tool, ToolException, tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import InjectedState, ToolNode, tools_condition
from langgraph.types import Command, RetryPolicy, interrupt
from pydantic import Field

import onceonly
from onceonly import Ledger, OutcomeUnknown, State
from onceonly.langchain import GuardedTool, OnceOnlyMiddleware, guard, guard_tools, thread_scope

ROOT = Path(__file__).resolve().parent.parent


# --- the world: a ledger, a table of side effects, a scripted model -----------------------------------


@pytest.fixture(name="ledger")
def fixture_ledger(tmp_path: Path) -> Iterator[Ledger]:
    """A SQLite ledger of the test's own (the real clock: the flows here wait for nothing)."""
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    yield ledger
    ledger.close()


class Effects:
    """Side effects as rows of a SQLite table; a connection per call, since tool nodes run tools in threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with closing(sqlite3.connect(path)) as db, db:
            db.execute("CREATE TABLE effects (kind TEXT, value TEXT)")

    def add(self, kind: str, value: object = "") -> int:
        with closing(sqlite3.connect(self.path)) as db, db:
            db.execute("INSERT INTO effects VALUES (?, ?)", (kind, str(value)))
        return self.count(kind)

    def count(self, kind: str, value: object | None = None) -> int:
        with closing(sqlite3.connect(self.path)) as db:
            if value is None:
                row = db.execute("SELECT count(*) FROM effects WHERE kind = ?", (kind,)).fetchone()
            else:
                row = db.execute(
                    "SELECT count(*) FROM effects WHERE kind = ? AND value = ?", (kind, str(value))
                ).fetchone()
        return int(row[0])


@pytest.fixture(name="effects")
def fixture_effects(tmp_path: Path) -> Effects:
    """An empty table of side effects."""
    return Effects(tmp_path / "effects.db")


class Scripted(GenericFakeChatModel):
    """A chat model that answers from a script and records the messages it was sent."""

    seen: list[list[BaseMessage]] = Field(default_factory=list)
    bound: list[Any] = Field(default_factory=list)

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Scripted:  # type: ignore[override]
        self.bound = list(tools)
        return self

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> Any:
        self.seen.append(list(messages))
        return super()._generate(messages, *args, **kwargs)

    def told(self, turn: int) -> list[ToolMessage]:
        """The tool messages that came after the model's last message, as sent at ``turn`` (0-based)."""
        sent = self.seen[turn]
        last_ai = max(i for i, m in enumerate(sent) if isinstance(m, AIMessage))
        return [m for m in sent[last_ai + 1 :] if isinstance(m, ToolMessage)]


def calls(*specs: tuple[str, dict[str, Any], str]) -> AIMessage:
    """The model's message asking for tool calls: (name, args, id) each."""
    return AIMessage("", tool_calls=[{"name": n, "args": a, "id": i, "type": "tool_call"} for n, a, i in specs])


def scripted(*turns: AIMessage | str) -> Scripted:
    return Scripted(messages=iter([t if isinstance(t, AIMessage) else AIMessage(t) for t in turns]))


def is_replay(text: object, result: str) -> bool:
    """A replay as ``onceonly.tell_model`` words it for the model: done before, not repeated, its result."""
    return isinstance(text, str) and "already done at " in text and "not repeated" in text and text.endswith(result)


def thread(name: str) -> dict[str, Any]:
    return {"configurable": {"thread_id": name}}


def react_graph(model: Scripted, tools: Sequence[Any], checkpointer: Any, **tool_node: Any) -> Any:
    """model → tools → model, by hand: one ToolNode runs all of a message's calls in one step."""
    graph = StateGraph(MessagesState)
    graph.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    retry = tool_node.pop("retry_policy", None)
    graph.add_node("tools", ToolNode(tools, **tool_node), retry_policy=retry)
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=checkpointer)


# --- the failures onceonly prevents, each in the frameworks' own terms -------------------------------


def test_an_async_guarded_function_runs_as_a_langchain_tool(ledger: Ledger, effects: Effects) -> None:
    """``@tool`` over an ``async def`` guarded by the ledger awaits it: the side effect happens and the
    model reads the result, not ``<coroutine object …>``."""

    @ledger.tool(name="send")
    async def send(to: str) -> str:
        """Send an email."""
        return f"sent #{effects.add('email', to)}"

    as_tool = tool(send)
    first = asyncio.run(as_tool.ainvoke({"type": "tool_call", "name": "send", "args": {"to": "ada"}, "id": "c1"}))
    assert first.content == "sent #1"
    assert effects.count("email") == 1


def test_the_model_never_sees_idempotency_key(ledger: Ledger, effects: Effects) -> None:
    """No schema a model is shown names ``idempotency_key``: not LangChain's ``@tool`` over a guarded
    function, not ``guard()`` over a function or a ``@tool`` that takes one. The function gets the
    ledger's key; a key the model sends anyway is dropped."""
    got: list[str] = []

    @ledger.tool(name="create_ticket")
    def create_ticket(title: str, *, idempotency_key: str) -> str:
        """Create a ticket."""
        got.append(idempotency_key)
        return "ok"

    def book(room: str, *, idempotency_key: str) -> str:
        """Book a room."""
        got.append(idempotency_key)
        effects.add("booking", room)
        return "booked"

    @tool
    def pay(amount: int, idempotency_key: str) -> str:
        """Pay."""
        got.append(idempotency_key)
        return "paid"

    shown = [tool(create_ticket), guard(book, ledger), guard(pay, ledger)]
    for t in shown:
        assert "idempotency_key" not in str(convert_to_openai_tool(t))
        assert "idempotency_key" not in t.tool_call_schema.model_json_schema()["properties"]  # type: ignore[union-attr]
    booked = shown[1].invoke(
        {"type": "tool_call", "name": "book", "args": {"room": "a", "idempotency_key": "from-the-model"}, "id": "1"},
        thread("t1"),
    )
    assert booked.content == "booked"
    assert got == [ledger.list()[0].key]
    assert "from-the-model" not in got


def test_a_langchain_tool_object_is_refused_by_ledger_tool_with_the_way_in(ledger: Ledger) -> None:
    """``@ledger.tool`` over a LangChain tool object is a ``TypeError`` that names the integration."""

    @tool
    def charge(amount: int) -> str:
        """Charge."""
        return "ok"

    with pytest.raises(TypeError, match=r"onceonly\.langchain"):
        ledger.tool(charge)  # type: ignore[call-overload]


def test_an_interrupt_inside_a_guarded_tool_pauses_without_an_attempt(ledger: Ledger, effects: Effects) -> None:
    """``interrupt()`` inside the guarded body is control flow: each resume runs the body again, three
    pauses use no attempt, and the side effect after the last answer happens once."""

    @tool
    def wire(amount: int) -> str:
        """Wire money after three approvals."""
        answers = [interrupt(f"approval {n} of 3 for {amount}?") for n in (1, 2, 3)]
        return f"wired #{effects.add('wire', amount)} with {answers}"

    model = scripted(calls(("wire", {"amount": 9}, "c1")), "done")
    agent = create_agent(model, [guard(wire, ledger)], checkpointer=InMemorySaver())
    cfg = thread("t1")
    agent.invoke({"messages": [("user", "wire 9")]}, cfg)
    for answer in ("yes", "sure", "ok"):
        state = agent.invoke(Command(resume=answer), cfg)
    assert effects.count("wire") == 1
    assert state["messages"][-2].content == "wired #1 with ['yes', 'sure', 'ok']"
    (record,) = ledger.list()
    assert record.state is State.CONFIRMED and record.attempts == 1


def test_a_replay_and_an_unknown_reach_the_model_in_its_own_words(
    ledger: Ledger, effects: Effects, caplog: pytest.LogCaptureFixture
) -> None:
    """A re-planned call is told it was already done and not repeated, with the result; a lost answer
    under ``on_unknown="review"`` is told the outcome is unknown and not to issue it again, as an error
    message; the graph runs to its end, and the operator's ``onceonly resolve`` goes to the log only."""
    lose = {"refund"}

    @tool
    def charge(amount: int) -> str:
        """Charge a card."""
        effects.add("charge", amount)
        return f"charged {amount}"

    @tool
    def refund(amount: int) -> str:
        """Refund a card."""
        effects.add("refund", amount)
        if "refund" in lose:
            raise TimeoutError("the answer was lost")
        return "refunded"

    model = scripted(
        calls(("charge", {"amount": 5}, "c1"), ("refund", {"amount": 2}, "c2")),
        calls(("charge", {"amount": 5}, "c3"), ("refund", {"amount": 2}, "c4")),
        "done",
    )
    agent = create_agent(model, guard_tools([charge, refund], ledger), checkpointer=InMemorySaver())
    with caplog.at_level(logging.WARNING, logger="onceonly"):
        agent.invoke({"messages": [("user", "charge 5, refund 2")]}, thread("t1"))
    replayed, unknown = model.told(2)
    assert replayed.tool_call_id == "c3" and replayed.status == "success"
    assert is_replay(replayed.content, "charged 5")
    assert unknown.tool_call_id == "c4" and unknown.status == "error"
    assert unknown.content == onceonly.tell_model(OutcomeUnknown("lost", key="k"))
    assert "Do not issue it again" in unknown.content
    assert all("onceonly resolve" not in str(m.content) for turn in model.seen for m in turn)
    assert "onceonly resolve" in caplog.text
    assert (effects.count("charge"), effects.count("refund")) == (1, 1)


# --- prebuilt graphs with a checkpointer: lost answers, re-plans, retries ----------------------------


def _lost_then_replanned(effects: Effects) -> tuple[Any, Any, Any]:
    """A sync and an async ``charge`` whose first answer is lost after the charge, and the probe that
    finds a charge in the table."""
    lost: list[bool] = [True]

    def happen(amount: int) -> str:
        n = effects.add("charge", amount)
        if lost.pop() if lost else False:
            raise TimeoutError("the answer was lost after the charge")
        return f"charge #{n}"

    @tool
    def charge(amount: int) -> str:
        """Charge a card."""
        return happen(amount)

    @tool("charge")
    async def acharge(amount: int) -> str:
        """Charge a card."""
        await asyncio.sleep(0)
        return happen(amount)

    def probe(args: dict[str, Any], key: str) -> Any:
        return f"charge of {args['amount']} found" if effects.count("charge", args["amount"]) else onceonly.NOT_FOUND

    return charge, acharge, probe


def _assert_one_charge_and_told(model: Scripted, effects: Effects) -> None:
    assert effects.count("charge") == 1
    (first,) = model.told(1)  # the lost answer, settled by the probe
    (second,) = model.told(2)  # the re-plan: a new id, the same arguments
    assert first.tool_call_id == "c1" and second.tool_call_id == "c2"
    for message in (first, second):
        assert is_replay(message.content, "charge of 5 found")


def test_a_paused_tool_tells_the_model_it_is_paused_and_runs_nothing(ledger: Ledger, effects: Effects) -> None:
    """An operator's pause (``ledger.pause``): the agent's call is refused before it claims; the model
    reads the paused text as an error (never the operator's reason), nothing runs or is recorded, and
    after ``resume`` the same call runs once."""

    @tool
    def charge(amount: int) -> str:
        """Charge a card."""
        effects.add("charge", amount)
        return f"charged {amount}"

    ledger.pause(tool="charge", reason="card provider incident 4411", by="ops")
    model = scripted(calls(("charge", {"amount": 5}, "c1")), "stopped", calls(("charge", {"amount": 5}, "c2")), "done")
    agent = create_agent(model, guard_tools([charge], ledger), checkpointer=InMemorySaver())
    agent.invoke({"messages": [("user", "charge 5")]}, thread("t1"))
    (told,) = model.told(1)
    assert told.tool_call_id == "c1" and told.status == "error"
    assert told.content == onceonly.tell_model(onceonly.Paused("x", key="k", reason="r"))
    assert "paused by an operator" in told.content and "4411" not in told.content
    assert effects.count("charge") == 0 and ledger.list() == []

    assert ledger.resume(tool="charge") == 1
    agent.invoke({"messages": [("user", "charge 5 again")]}, thread("t1"))
    (ran,) = model.told(3)
    assert ran.tool_call_id == "c2" and ran.status == "success" and ran.content == "charged 5"
    assert effects.count("charge", 5) == 1 and [r.attempts for r in ledger.list()] == [1]


def test_a_lost_answer_and_a_replan_charge_once_sync(ledger: Ledger, effects: Effects, tmp_path: Path) -> None:
    """create_agent, a sync tool, a SQLite checkpointer: the charge's answer is lost, the probe finds
    it, the model re-plans the same charge under a new id: one charge, and the model reads the replay."""
    charge, _, probe = _lost_then_replanned(effects)
    model = scripted(calls(("charge", {"amount": 5}, "c1")), calls(("charge", {"amount": 5}, "c2")), "done")
    with SqliteSaver.from_conn_string(str(tmp_path / "checkpoints.db")) as saver:
        agent = create_agent(model, [guard(charge, ledger, on_unknown="probe", probe=probe)], checkpointer=saver)
        agent.invoke({"messages": [("user", "charge 5")]}, thread("t1"))
    _assert_one_charge_and_told(model, effects)


def test_a_lost_answer_and_a_replan_charge_once_async(ledger: Ledger, effects: Effects, tmp_path: Path) -> None:
    """The same with an async tool, ``ainvoke`` and the async SQLite checkpointer."""
    _, acharge, probe = _lost_then_replanned(effects)
    model = scripted(calls(("charge", {"amount": 5}, "c1")), calls(("charge", {"amount": 5}, "c2")), "done")

    async def run() -> None:
        async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "checkpoints.db")) as saver:
            tools = [guard(acharge, ledger, on_unknown="probe", probe=probe)]
            agent = create_agent(model, tools, checkpointer=saver)
            await agent.ainvoke({"messages": [("user", "charge 5")]}, thread("t1"))

    asyncio.run(run())
    _assert_one_charge_and_told(model, effects)


@pytest.mark.filterwarnings("ignore::langgraph.warnings.LangGraphDeprecatedSinceV10")
def test_create_react_agent_takes_guarded_tools(ledger: Ledger, effects: Effects) -> None:
    """LangGraph's prebuilt ``create_react_agent`` (deprecated for ``create_agent``, still shipped)
    runs guarded tools: a re-planned call replays."""
    from langgraph.prebuilt import create_react_agent

    charge, _, probe = _lost_then_replanned(effects)
    model = scripted(calls(("charge", {"amount": 5}, "c1")), calls(("charge", {"amount": 5}, "c2")), "done")
    agent = create_react_agent(
        model, [guard(charge, ledger, on_unknown="probe", probe=probe)], checkpointer=InMemorySaver()
    )
    agent.invoke({"messages": [("user", "charge 5")]}, thread("t1"))
    _assert_one_charge_and_told(model, effects)


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_a_node_retried_by_langgraph_charges_once(ledger: Ledger, effects: Effects, guarded: bool) -> None:
    """LangGraph retries a tool node (``RetryPolicy``) whose other call failed: the charge that had
    succeeded in the failed step runs again without onceonly, and replays with it."""
    failures = [ValueError("the inventory service said no")]

    @tool
    def charge(amount: int) -> str:
        """Charge a card."""
        return f"charge #{effects.add('charge', amount)}"

    @tool
    def reserve(sku: str) -> str:
        """Reserve stock."""
        if failures:
            raise failures.pop()
        return f"reserved {sku}"

    tools: list[Any] = guard_tools([charge, reserve], ledger) if guarded else [charge, reserve]
    model = scripted(calls(("charge", {"amount": 5}, "c1"), ("reserve", {"sku": "A1"}, "c2")), "done")
    retry = RetryPolicy(max_attempts=2, initial_interval=0.01, jitter=False, retry_on=ValueError)
    graph = react_graph(model, tools, InMemorySaver(), handle_tool_errors=False, retry_policy=retry)
    graph.invoke({"messages": [("user", "charge and reserve")]}, thread("t1"))
    assert effects.count("charge") == (1 if guarded else 2)
    charged, reserved = model.told(1)
    assert reserved.content == "reserved A1"
    if guarded:  # the model never read the first run's answer; it is told the charge happened before
        assert is_replay(charged.content, "charge #1")
    else:
        assert charged.content == "charge #2"


# --- interrupts ---------------------------------------------------------------------------------------


def _email_and_approval(effects: Effects) -> tuple[BaseTool, BaseTool, BaseTool]:
    @tool
    def send_email(to: str) -> str:
        """Send an email."""
        return f"email #{effects.add('email', to)} to {to}"

    @tool("send_email")
    async def asend_email(to: str) -> str:
        """Send an email."""
        return f"email #{effects.add('email', to)} to {to}"

    @tool
    def approve(what: str) -> str:
        """Ask a person to approve."""
        return f"{what}: {interrupt(f'approve {what}?')}"

    return send_email, asend_email, approve


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "unguarded"])
def test_a_sibling_of_an_interrupted_call_runs_once(
    ledger: Ledger, effects: Effects, guarded: bool, asynchronous: bool
) -> None:
    """Two calls in one ToolNode step, one interrupting: on resume LangGraph runs the whole step again,
    so the sibling's email leaves twice without onceonly, once with it."""
    send_email, asend_email, approve = _email_and_approval(effects)
    tools = [asend_email if asynchronous else send_email, approve]
    model = scripted(calls(("send_email", {"to": "ada"}, "c1"), ("approve", {"what": "refund"}, "c2")), "done")
    graph = react_graph(model, guard_tools(tools, ledger) if guarded else tools, InMemorySaver())
    cfg = thread("t1")
    if asynchronous:

        async def run() -> None:
            await graph.ainvoke({"messages": [("user", "email ada, refund")]}, cfg)
            await graph.ainvoke(Command(resume="approved"), cfg)

        asyncio.run(run())
    else:
        graph.invoke({"messages": [("user", "email ada, refund")]}, cfg)
        graph.invoke(Command(resume="approved"), cfg)
    assert effects.count("email") == (1 if guarded else 2)
    email, approval = model.told(1)
    assert approval.content == "refund: approved"
    assert email.tool_call_id == "c1"
    assert ("email #1 to ada" in email.content) is guarded


def test_a_side_effect_before_an_interrupt_is_its_own_guarded_step(ledger: Ledger, effects: Effects) -> None:
    """The resumed tool runs from the top, so what it did before ``interrupt()`` would happen twice;
    as a ``@ledger.tool`` function of its own, called inside, it is scoped to the same conversation
    and the resumed run replays it."""

    @ledger.tool(name="hold_seat")
    def hold_seat(flight: str) -> str:
        return f"hold #{effects.add('hold', flight)}"

    @tool
    def book(flight: str) -> str:
        """Book a flight after approval."""
        hold = hold_seat(flight)
        answer = interrupt(f"book {flight} with {hold}?")
        return f"booking #{effects.add('booking', flight)} with {hold}: {answer}"

    model = scripted(calls(("book", {"flight": "LH400"}, "c1")), "done")
    agent = create_agent(model, [guard(book, ledger)], checkpointer=InMemorySaver())
    agent.invoke({"messages": [("user", "book LH400")]}, thread("t1"))
    agent.invoke(Command(resume="yes"), thread("t1"))
    assert (effects.count("hold"), effects.count("booking")) == (1, 1)
    assert model.told(1)[0].content == "booking #1 with hold #1: yes"
    assert sorted(r.scope for r in ledger.list()) == ["t1", "t1"]


def test_a_create_agent_middleware_pauses_and_resumes_once(ledger: Ledger, effects: Effects) -> None:
    """``OnceOnlyMiddleware`` on ``create_agent``: the interrupting tool pauses unrecorded, its resume
    runs it once; the email sent in the same message is not sent again."""
    send_email, _, approve = _email_and_approval(effects)

    @tool
    def refund(amount: int) -> str:
        """Refund after approval."""
        answer = interrupt(f"refund {amount}?")
        return f"refund #{effects.add('refund', amount)}: {answer}"

    model = scripted(calls(("send_email", {"to": "ada"}, "c1"), ("refund", {"amount": 3}, "c2")), "done")
    agent = create_agent(
        model, [send_email, refund, approve], middleware=[OnceOnlyMiddleware(ledger)], checkpointer=InMemorySaver()
    )
    cfg = thread("t1")
    agent.invoke({"messages": [("user", "email ada, refund 3")]}, cfg)
    agent.invoke(Command(resume="yes"), cfg)
    assert (effects.count("email"), effects.count("refund")) == (1, 1)
    assert sorted(m.content for m in model.told(1)) == ["email #1 to ada", "refund #1: yes"]


# --- conversations ------------------------------------------------------------------------------------


def test_the_same_call_runs_once_per_thread(ledger: Ledger, effects: Effects) -> None:
    """The same call in two threads is two operations; in one thread, one (a new message asking again
    replays it)."""

    @tool
    def charge(amount: int) -> str:
        """Charge a card."""
        return f"charge #{effects.add('charge', amount)}"

    model = scripted(*[m for _ in range(3) for m in (calls(("charge", {"amount": 5}, "call_0")), "done")])
    agent = create_agent(model, [guard(charge, ledger)], checkpointer=InMemorySaver())
    for name in ("alice", "bob", "alice"):
        agent.invoke({"messages": [("user", "charge 5")]}, thread(name))
    assert effects.count("charge") == 2
    assert sorted(r.scope for r in ledger.list()) == ["alice", "bob"]
    assert is_replay(model.told(5)[0].content, "charge #1")


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_runs_without_a_thread_id_are_each_their_own_scope(
    async_: bool, ledger: Ledger, effects: Effects, caplog: pytest.LogCaptureFixture
) -> None:
    """No ``thread_id`` (no checkpointer): two users' runs with the same arguments each charge once
    (before, the second replayed the first's charge from the scope ``default``); a re-plan inside a
    run replays; one warning names ``thread_id``; the ``ledger.task()`` around a run still wins."""

    @tool
    def charge(amount: int) -> str:
        """Charge a card."""
        return f"charge #{effects.add('charge', amount)}"

    def script() -> Scripted:
        return scripted(calls(("charge", {"amount": 5}, "c1")), calls(("charge", {"amount": 5}, "c2")), "done")

    def invoke(agent: Any) -> None:
        message = {"messages": [("user", "charge 5")]}
        asyncio.run(agent.ainvoke(message)) if async_ else agent.invoke(message)

    models = []
    with caplog.at_level(logging.WARNING, logger="onceonly"):
        for _user in ("alice", "bob"):
            models.append(script())
            invoke(create_agent(models[-1], [guard(charge, ledger)]))
    assert effects.count("charge") == 2, "the second user's run must charge, not replay the first's"
    for n, model in enumerate(models, start=1):
        assert model.told(1)[0].content == f"charge #{n}"
        assert is_replay(model.told(2)[0].content, f"charge #{n}")  # the re-plan, inside the run
    warned = [r.getMessage() for r in caplog.records if "names no conversation" in r.getMessage()]
    assert len(warned) <= 1 and all("thread_id" in w for w in warned)
    scopes = {r.scope for r in ledger.list()}
    assert len(scopes) == 2 and all(s.startswith("r:") for s in scopes)
    with ledger.task("session-7"):
        invoke(create_agent(script(), [guard(charge, ledger)]))
    assert effects.count("charge") == 3 and "session-7" in {r.scope for r in ledger.list()}


def test_a_subgraphs_calls_are_scoped_by_thread_and_subgraph(ledger: Ledger, effects: Effects) -> None:
    """A tool node inside a subgraph sees ``checkpoint_ns`` = ``agent:<task>|tools:<task>``; both task
    ids change (every step, every turn), the scope does not: ``<thread>|agent``. Three asks over two
    turns: one charge."""

    @tool
    def charge(amount: int) -> str:
        """Charge a card."""
        return f"charge #{effects.add('charge', amount)}"

    model = scripted(
        calls(("charge", {"amount": 5}, "a")), calls(("charge", {"amount": 5}, "b")), "done",
        calls(("charge", {"amount": 5}, "c")), "done again",
    )  # fmt: skip
    sub = create_agent(model, [guard(charge, ledger)])
    parent = StateGraph(MessagesState)
    parent.add_node("agent", sub)
    parent.add_edge(START, "agent")
    parent.add_edge("agent", END)
    app = parent.compile(checkpointer=InMemorySaver())
    app.invoke({"messages": [("user", "charge 5")]}, thread("t1"))
    app.invoke({"messages": [("user", "charge 5 again")]}, thread("t1"))
    assert effects.count("charge") == 1
    assert [r.scope for r in ledger.list()] == ["t1|agent"]


def test_thread_scope_reads_the_conversation_and_hashes_what_cannot_be_a_scope() -> None:
    """``thread_scope``: the thread; the subgraph path without task ids or the running node; ``None``
    outside a graph; a thread id with whitespace, or too long, hashed (the same one each time)."""
    assert thread_scope(None) is None
    assert thread_scope({"configurable": {}}) is None
    assert thread_scope(thread("user:42")) == "user:42"
    assert thread_scope({"configurable": {"thread_id": 7, "checkpoint_ns": "tools:9f2a"}}) == "7"
    deep = {"thread_id": "t", "checkpoint_ns": "outer:1a|2|inner:3b|tools:4c"}
    assert thread_scope({"configurable": deep}) == "t|outer|2|inner"
    spaced = thread_scope(thread("user 42"))
    assert spaced is not None and spaced.startswith("thread-") and spaced == thread_scope(thread("user 42"))
    long = thread_scope(thread("x" * 300))
    assert long is not None and len(long) < 100


def test_calls_outside_a_graph_use_the_ledgers_scope(ledger: Ledger, effects: Effects) -> None:
    """Called by code (no thread): the ledger's scope, or the ``ledger.task`` around the call; the
    replay is the recorded value itself; a tool call without a config still gets a ToolMessage."""

    @tool
    def charge(amount: int) -> dict[str, Any]:
        """Charge a card."""
        return {"n": effects.add("charge", amount), "amount": amount}

    guarded = guard(charge, ledger)
    assert guarded.invoke({"amount": 5}) == {"n": 1, "amount": 5}
    assert guarded.invoke({"amount": 5}) == {"n": 1, "amount": 5}
    with ledger.task("job-7"):
        assert guarded.invoke({"amount": 5}) == {"n": 2, "amount": 5}
    message = guarded.invoke({"type": "tool_call", "name": "charge", "args": {"amount": 5}, "id": "x"})
    assert isinstance(message, ToolMessage) and is_replay(message.content, '{"amount":5,"n":1}')
    assert sorted(r.scope for r in ledger.list()) == ["default", "job-7"]


# --- what the model reads ---------------------------------------------------------------------------


def test_tell_model_false_replays_exactly_what_the_model_read(ledger: Ledger, effects: Effects) -> None:
    """With ``tell_model=False`` a replay is the original's ToolMessage: the same text (keys in the
    tool's own order, not the ledger's sorted JSON), the same artifact, the new call's id."""

    @tool(response_format="content_and_artifact")
    def lookup(sku: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """Look up a product."""
        effects.add("lookup", sku)
        return {"sku": sku, "price": 3, "name": "Bolt"}, {"rows": [1, 2]}

    guarded = guard(lookup, ledger, tell_model=False)
    cfg = thread("t1")
    first = guarded.invoke({"type": "tool_call", "name": "lookup", "args": {"sku": "B1"}, "id": "c1"}, cfg)
    again = guarded.invoke({"type": "tool_call", "name": "lookup", "args": {"sku": "B1"}, "id": "c2"}, cfg)
    assert first.content == '{"sku": "B1", "price": 3, "name": "Bolt"}'
    assert (again.content, again.artifact, again.tool_call_id) == (first.content, first.artifact, "c2")
    assert effects.count("lookup") == 1

    @tool
    def rows(table: str) -> list[dict[str, Any]]:
        """Read rows."""
        return [{"z": effects.add("rows", table), "a": "é"}]

    guarded_rows = guard(rows, ledger, tell_model=False)
    first = guarded_rows.invoke({"type": "tool_call", "name": "rows", "args": {"table": "t"}, "id": "c3"}, cfg)
    again = guarded_rows.invoke({"type": "tool_call", "name": "rows", "args": {"table": "t"}, "id": "c4"}, cfg)
    assert first.content == again.content == '[{"z": 1, "a": "é"}]'
    assert guarded_rows.invoke({"table": "t"}) == [{"a": "é", "z": 2}]  # code, another scope: a run


def test_a_replayed_command_answers_the_new_call(ledger: Ledger, effects: Effects) -> None:
    """A tool that returns a ``Command`` with its own ToolMessage (``InjectedToolCallId``): the replay
    is the same update, its message re-targeted to the new call and saying it was a replay."""

    @tool
    def remember(fact: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
        """Remember a fact."""
        n = effects.add("fact", fact)
        return Command(update={"messages": [ToolMessage(f"noted #{n}", tool_call_id=tool_call_id)], "facts": [fact]})

    guarded = guard(remember, ledger)
    assert "tool_call_id" not in str(convert_to_openai_tool(guarded))
    cfg = thread("t1")
    first = guarded.invoke({"type": "tool_call", "name": "remember", "args": {"fact": "blue"}, "id": "c1"}, cfg)
    again = guarded.invoke({"type": "tool_call", "name": "remember", "args": {"fact": "blue"}, "id": "c2"}, cfg)
    assert isinstance(first, Command) and isinstance(again, Command)
    assert first.update["messages"][0].tool_call_id == "c1"  # type: ignore[index]
    (message,) = again.update["messages"]  # type: ignore[index]
    assert message.tool_call_id == "c2" and is_replay(message.content, "noted #1")
    assert again.update["facts"] == ["blue"]  # type: ignore[index]
    assert effects.count("fact") == 1


def test_injected_arguments_stay_out_of_the_key(ledger: Ledger, effects: Effects) -> None:
    """Injected state, runtime and call id change between the call and its re-plan; the key does not,
    so the re-plan replays (the tool still got them, on its one run)."""
    seen: list[tuple[int, str, str]] = []

    @tool
    def note(
        text: str,
        runtime: ToolRuntime,
        messages: Annotated[list[Any], InjectedState("messages")],
        call_id: Annotated[str, InjectedToolCallId],
    ) -> str:
        """Save a note."""
        seen.append((len(messages), call_id, runtime.tool_call_id or ""))
        return f"note #{effects.add('note', text)}"

    model = scripted(calls(("note", {"text": "hi"}, "c1")), calls(("note", {"text": "hi"}, "c2")), "done")
    agent = create_agent(model, [guard(note, ledger)], checkpointer=InMemorySaver())
    agent.invoke({"messages": [("user", "note hi")]}, thread("t1"))
    assert seen == [(2, "c1", "c1")]
    assert effects.count("note") == 1
    assert is_replay(model.told(2)[0].content, "note #1")


# --- errors: below the framework's error handling ----------------------------------------------------


def test_an_error_langchain_handles_is_a_failed_attempt_never_a_result(ledger: Ledger, effects: Effects) -> None:
    """``handle_tool_error``, the ToolNode's ``handle_tool_errors``, and an error ToolMessage the tool
    returns: each reaches the model as the framework makes it, is recorded failed, and the next call
    runs the tool again instead of replaying the error."""
    fail = {"charge", "refund", "void"}

    @tool
    def charge(amount: int) -> str:
        """Charge."""
        effects.add("charge", amount)
        if "charge" in fail:
            fail.discard("charge")
            raise ToolException("card declined")
        return "charged"

    charge.handle_tool_error = True

    @tool
    def refund(amount: int) -> str:
        """Refund."""
        effects.add("refund", amount)
        if "refund" in fail:
            fail.discard("refund")
            raise ValueError("no such payment")
        return "refunded"

    @tool
    def void(amount: int, tool_call_id: Annotated[str, InjectedToolCallId]) -> ToolMessage:
        """Void."""
        effects.add("void", amount)
        if "void" in fail:
            fail.discard("void")
            return ToolMessage("cannot void yet", tool_call_id=tool_call_id, status="error")
        return ToolMessage("voided", tool_call_id=tool_call_id)

    model = scripted(
        calls(("charge", {"amount": 1}, "a"), ("refund", {"amount": 1}, "b"), ("void", {"amount": 1}, "c")),
        calls(("charge", {"amount": 1}, "d"), ("refund", {"amount": 1}, "e"), ("void", {"amount": 1}, "f")),
        "done",
    )
    graph = react_graph(model, guard_tools([charge, refund, void], ledger), InMemorySaver(), handle_tool_errors=True)
    graph.invoke({"messages": [("user", "go")]}, thread("t1"))
    errors, results = model.told(1), model.told(2)
    assert [m.status for m in errors] == ["error"] * 3
    assert errors[0].content == "card declined" and "no such payment" in errors[1].content
    assert errors[2].content == "cannot void yet"
    assert [m.content for m in results] == ["charged", "refunded", "voided"]
    assert [m.status for m in results] == ["success"] * 3
    assert (effects.count("charge"), effects.count("refund"), effects.count("void")) == (2, 2, 2)
    assert {r.state for r in ledger.list()} == {State.CONFIRMED}
    assert {r.attempts for r in ledger.list()} == {2}


def test_a_conflict_is_told_with_the_earlier_result(ledger: Ledger, effects: Effects) -> None:
    """Keyed on the title, a re-plan with another body is a conflict: the model is told the ticket was
    made earlier with other details, and that ticket; with ``on_conflict="replay"`` it is a replay."""

    @tool
    def create_ticket(title: str, body: str) -> dict[str, Any]:
        """Create a ticket."""
        return {"id": effects.add("ticket", title), "title": title}

    model = scripted(
        calls(("create_ticket", {"title": "Printer on fire", "body": "3rd floor"}, "c1")),
        calls(("create_ticket", {"title": "printer on fire ", "body": "third floor, hurry"}, "c2")),
        "done",
    )
    norm = {"title": onceonly.normalize_text}
    agent = create_agent(
        model, [guard(create_ticket, ledger, key=("title",), normalize=norm)], checkpointer=InMemorySaver()
    )
    agent.invoke({"messages": [("user", "ticket")]}, thread("t1"))
    (told,) = model.told(2)
    assert told.status == "error" and "onceonly resolve" not in told.content
    assert "Printer on fire" in told.content and '"id"' in told.content and "$langchain" not in told.content
    assert effects.count("ticket") == 1


def test_in_progress_and_exhausted_are_told_as_errors(ledger: Ledger, effects: Effects) -> None:
    """The same call twice in one message, the first still running (``wait=0``): the second is told
    it is in progress. A call whose one attempt failed: asked again, the model is told the attempts
    are spent. Both as error messages, in the model's words."""

    @tool
    def slow(n: int) -> str:
        """Take a while."""
        time.sleep(0.5)
        return f"slow #{effects.add('slow', n)}"

    @tool
    def flaky(n: int) -> str:
        """Fail."""
        effects.add("flaky", n)
        raise ToolException("upstream refused")

    flaky.handle_tool_error = True
    tools = [guard(slow, ledger, wait=0.0), guard(flaky, ledger, retry=onceonly.Retry(attempts=1))]
    model = scripted(
        calls(("slow", {"n": 1}, "a"), ("slow", {"n": 1}, "b"), ("flaky", {"n": 1}, "c")),
        calls(("flaky", {"n": 1}, "d")),
        "done",
    )
    graph = react_graph(model, tools, InMemorySaver())
    graph.invoke({"messages": [("user", "go")]}, thread("t1"))
    first = {m.tool_call_id: m for m in model.told(1)}
    statuses = sorted((first["a"].status, first["b"].status))
    assert statuses == ["error", "success"] and effects.count("slow") == 1
    busy = first["a"] if first["a"].status == "error" else first["b"]
    assert "onceonly" not in busy.content and "progress" in busy.content
    assert (first["c"].status, first["c"].content) == ("error", "upstream refused")
    (spent,) = model.told(2)
    assert spent.status == "error" and "onceonly resolve" not in spent.content
    assert effects.count("flaky") == 1


def test_an_async_only_tool_called_sync_records_nothing(ledger: Ledger) -> None:
    """A tool with only an async implementation, invoked sync: LangChain's own NotImplementedError,
    and no record (nothing was attempted)."""

    @tool
    async def fetch(url: str) -> str:
        """Fetch."""
        return url

    guarded = guard(fetch, ledger)
    with pytest.raises(NotImplementedError, match="async"):
        guarded.invoke({"url": "x"})
    assert ledger.list() == []
    assert asyncio.run(guarded.ainvoke({"url": "x"})) == "x"


def test_guarding_a_tool_again_returns_the_same_guarded_tool(ledger: Ledger) -> None:
    """``guard`` twice with the same settings is one guarded tool (one definition in the ledger);
    guarding a guarded tool, or a function ``@ledger.tool`` guards already, is a TypeError."""

    @tool
    def charge(amount: int) -> str:
        """Charge."""
        return "ok"

    first = guard(charge, ledger)
    assert guard(charge, ledger) is first
    assert isinstance(first, GuardedTool) and first.name == "charge" and first.ledger is ledger
    with pytest.raises(TypeError, match="guarded already"):
        guard(first, ledger)

    @ledger.tool(name="refund")
    def refund(amount: int) -> str:
        """Refund."""
        return "ok"

    with pytest.raises(TypeError, match=r"guarded by @ledger\.tool already"):
        guard(refund, ledger)


def test_a_tool_made_again_is_the_same_operation_and_another_under_its_name_is_refused(
    ledger: Ledger, effects: Effects
) -> None:
    """A tool is the operation the model sees (name, description, arguments) under the guard's
    settings: the same tool made again (a factory per request, an MCP adapter per session) shares
    records; another tool under the same name is refused by the ledger, naming ``name=``."""

    def make() -> BaseTool:
        @tool
        def charge(amount: int) -> str:
            """Charge a card."""
            return f"charge #{effects.add('charge', amount)}"

        return charge

    first, second = guard(make(), ledger), guard(make(), ledger)
    assert first is not second
    call = {"type": "tool_call", "name": "charge", "args": {"amount": 5}, "id": "c1"}
    assert first.invoke(call, thread("t1")).content == "charge #1"
    assert is_replay(second.invoke({**call, "id": "c2"}, thread("t1")).content, "charge #1")

    @tool("charge")
    def other_charge(amount: int, currency: str) -> str:
        """Charge in a currency."""
        return "no"

    with pytest.raises(ValueError, match="name="):
        guard(other_charge, ledger)
    assert guard(other_charge, ledger, name="charge-in-currency").name == "charge"


def test_tools_of_every_kind_keep_their_schema_and_run_once(ledger: Ledger, effects: Effects) -> None:
    """A ``BaseTool`` subclass with no schema of its own, a single-input ``Tool``, and a JSON-schema
    tool with only a coroutine (what an MCP adapter makes): each shows the model the original's schema,
    gets its input as the original would, and runs once per call."""

    class Search(BaseTool):
        name: str = "search"
        description: str = "Search the web."

        def _run(self, query: str, limit: int = 3) -> str:
            return f"search #{effects.add('search', query)}"

    legacy = Tool(name="echo", description="Echo.", func=lambda text: f"echo #{effects.add('echo', text)}")

    async def create_issue(**arguments: Any) -> str:
        return f"issue #{effects.add('issue', arguments['title'])}"

    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}
    mcp_like = StructuredTool(name="create_issue", description="Issue.", args_schema=schema, coroutine=create_issue)
    search, echo, issue = guard(Search(), ledger), guard(legacy, ledger), guard(mcp_like, ledger, key=("title",))
    for guarded, original in ((search, Search()), (echo, legacy), (issue, mcp_like)):
        shown, meant = (convert_to_openai_tool(t)["function"]["parameters"] for t in (guarded, original))
        assert shown["properties"].keys() == meant["properties"].keys()
    cfg = thread("t1")

    def ask(tool_: BaseTool, args: dict[str, Any], id_: str) -> Any:
        return asyncio.run(tool_.ainvoke({"type": "tool_call", "name": tool_.name, "args": args, "id": id_}, cfg))

    assert ask(search, {"query": "q"}, "a").content == "search #1"
    again = search.invoke({"type": "tool_call", "name": "search", "args": {"query": "q", "limit": 3}, "id": "b"}, cfg)
    assert is_replay(again.content, "search #1")
    assert ask(echo, {"__arg1": "hi"}, "c").content == "echo #1"
    assert echo.invoke("hi") == "echo #2"  # code, the ledger's scope: another operation
    assert ask(issue, {"title": "Bug"}, "d").content == "issue #1"
    conflict = ask(issue, {"title": "Bug", "labels": ["x"]}, "e")  # keyed on the title, more arguments sent
    assert conflict.status == "error" and "with other details" in conflict.content and "issue #1" in conflict.content
    assert (effects.count("search"), effects.count("echo"), effects.count("issue")) == (1, 2, 1)


def test_a_tool_with_sync_and_async_code_is_one_operation(ledger: Ledger, effects: Effects) -> None:
    """A ``StructuredTool`` with both a function and a coroutine: ``invoke`` runs the one, ``ainvoke``
    the other, and the two share the records (one key, one definition in the ledger)."""

    def charge(amount: int) -> str:
        return f"sync charge #{effects.add('charge', amount)}"

    async def acharge(amount: int) -> str:
        return f"async charge #{effects.add('charge', amount)}"

    both = StructuredTool.from_function(func=charge, coroutine=acharge, name="charge", description="Charge.")
    guarded = guard(both, ledger)
    assert guarded.invoke({"amount": 1}) == "sync charge #1"
    assert asyncio.run(guarded.ainvoke({"amount": 1})) == "sync charge #1"
    assert asyncio.run(guarded.ainvoke({"amount": 2})) == "async charge #2"
    assert guarded.invoke({"amount": 2}) == "async charge #2"
    assert list(ledger.tools) == ["charge"]


def test_the_middleware_guards_only_the_tools_named(ledger: Ledger, effects: Effects) -> None:
    """``OnceOnlyMiddleware(tools=...)`` guards those; the others run each time; the model's schemas
    are the originals'."""

    @tool
    def charge(amount: int) -> str:
        """Charge."""
        return f"charge #{effects.add('charge', amount)}"

    @tool
    def search(query: str) -> str:
        """Search."""
        return f"search #{effects.add('search', query)}"

    model = scripted(
        calls(("charge", {"amount": 1}, "a"), ("search", {"query": "x"}, "b")),
        calls(("charge", {"amount": 1}, "c"), ("search", {"query": "x"}, "d")),
        "done",
    )
    middleware = OnceOnlyMiddleware(ledger, tools=["charge"])
    agent = create_agent(model, [charge, search], middleware=[middleware], checkpointer=InMemorySaver())
    agent.invoke({"messages": [("user", "go")]}, thread("t1"))
    assert (effects.count("charge"), effects.count("search")) == (1, 2)
    assert [convert_to_openai_tool(t) for t in model.bound] == [
        convert_to_openai_tool(charge),
        convert_to_openai_tool(search),
    ]


def test_the_middleware_shows_the_model_no_idempotency_key(ledger: Ledger, effects: Effects) -> None:
    """A tool that takes ``idempotency_key``, given to ``create_agent`` as it is: the middleware shows
    the model its schema without the key, and the tool gets the ledger's key (not the model's)."""
    keys: list[str] = []

    @tool
    def refund(amount: int, idempotency_key: str) -> str:
        """Refund."""
        keys.append(idempotency_key)
        return f"refund #{effects.add('refund', amount)}"

    model = scripted(calls(("refund", {"amount": 2, "idempotency_key": "mine"}, "a")), "done")
    agent = create_agent(model, [refund], middleware=[OnceOnlyMiddleware(ledger)], checkpointer=InMemorySaver())
    agent.invoke({"messages": [("user", "refund 2")]}, thread("t1"))
    (shown,) = model.bound
    assert "idempotency_key" not in str(convert_to_openai_tool(shown))
    assert keys == [ledger.list()[0].key]


def test_the_middleware_guards_async_tools(ledger: Ledger, effects: Effects) -> None:
    """``awrap_tool_call``: an async agent, an async tool, a re-plan replays."""

    @tool
    async def charge(amount: int) -> str:
        """Charge."""
        return f"charge #{effects.add('charge', amount)}"

    model = scripted(calls(("charge", {"amount": 1}, "a")), calls(("charge", {"amount": 1}, "b")), "done")
    agent = create_agent(model, [charge], middleware=[OnceOnlyMiddleware(ledger)], checkpointer=InMemorySaver())
    asyncio.run(agent.ainvoke({"messages": [("user", "go")]}, thread("t1")))
    assert effects.count("charge") == 1
    assert is_replay(model.told(2)[0].content, "charge #1")


# --- imported lazily ---------------------------------------------------------------------------------


def test_the_integration_is_imported_only_when_asked_for_and_names_its_extra() -> None:
    """``import onceonly`` loads no LangChain or LangGraph; ``import onceonly.langchain`` without them
    is an ImportError that names the extra to install."""
    light = "import sys, onceonly; print([m for m in ('langchain_core', 'langgraph', 'langchain') if m in sys.modules])"
    assert subprocess.run([sys.executable, "-c", light], capture_output=True, text=True, check=True).stdout == "[]\n"
    missing = "import sys; sys.modules['langchain_core'] = None; import onceonly.langchain"
    done = subprocess.run([sys.executable, "-c", missing], capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "pip install 'onceonly[langchain] @ git+" in done.stderr


# --- the docs and the example -------------------------------------------------------------------


def _doc_snippets() -> tuple[str, list[str]]:
    """docs/langchain.md: its set-up block, and every Python block after it."""
    text = (ROOT / "docs" / "langchain.md").read_text(encoding="utf-8")
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    setup = next(i for i, b in enumerate(blocks) if b.startswith("import re\n\nimport onceonly"))
    return blocks[setup], blocks[setup + 1 :]


@pytest.mark.parametrize("index", range(len(_doc_snippets()[1])))
def test_the_docs_snippets_run_and_print_what_they_say(index: int, tmp_path: Path) -> None:
    """Each snippet of docs/langchain.md runs after its set-up block, in a directory of its own, and
    prints, line by line, what its ``# -> …`` comments say."""
    setup, snippets = _doc_snippets()
    snippet = snippets[index]
    (tmp_path / "snippet.py").write_text(setup + "\n" + snippet, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "snippet.py"], check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    expected = [line.split("# -> ", 1)[1] for line in snippet.splitlines() if "# -> " in line]
    assert expected, "a snippet says what it prints"
    assert done.stdout.splitlines() == expected


# --- the example ------------------------------------------------------------------------------------


def test_the_langgraph_example_runs_offline() -> None:
    """examples/langgraph_agent.py: one ticket through a lost answer, a reworded re-plan and a paused
    approval; the transcript shows what the model was told."""
    with tempfile.TemporaryDirectory(prefix="onceonly-test-examples-") as tmp:
        done = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "langgraph_agent.py")],
            check=False, capture_output=True, text=True, timeout=120, cwd=tmp, env={**os.environ, "TMPDIR": tmp},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert sorted(p.name for p in Path(tmp).iterdir()) == [], "the example left files behind"
    out = done.stdout
    assert "paused: file an urgent ticket 'Printer on fire'? (tickets so far: 0)" in out
    told = [line for line in out.splitlines() if line.startswith("  tool  [call_")]
    assert len(told) == 3
    ticket = '{"filed":true,"id":1,"title":"Printer on fire"}'
    assert told[0].startswith("  tool  [call_1, success]: ") and is_replay(told[0], ticket)
    assert told[1].startswith("  tool  [call_2, success]: ") and "with other details" in told[1]
    assert told[1].endswith(ticket)
    assert "ledger: confirmed via probe, attempts 1" in out  # the pause was no attempt
    assert "tickets created: 1" in out
    assert "emails sent: 1" in out
