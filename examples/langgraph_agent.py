"""A LangGraph agent that files one ticket, whatever happens on the way. Offline, SQLite everywhere.

    pip install 'onceonly[langchain] @ git+<repository URL>' langgraph-checkpoint-sqlite
    python examples/langgraph_agent.py

The model is LangChain's ``GenericFakeChatModel`` following a script (no API key, no network); the
agent is ``langchain.agents.create_agent`` with a ``SqliteSaver`` checkpointer; the ticket desk, the
ledger and the checkpoints are three SQLite files in a temporary directory. On the way:

1. The urgent ticket needs a person's approval: the tool pauses the graph (``interrupt()``), the
   process stops, a new one resumes it. The pause is not an attempt; the resumed tool runs again.
2. The desk commits the ticket and its answer is lost (a timeout after the side effect): the probe
   asks the desk, finds the ticket, and the model is told it was done.
3. The model re-plans anyway: a new tool-call id, the title re-cased, the body reworded. The key is
   the normalised title and ``on_conflict="replay"``: the first ticket is replayed, none is added.

The transcript shows every message the model was sent.
"""

from __future__ import annotations

import sqlite3
import tempfile
from contextlib import closing
from pathlib import Path
from typing import Any

from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.types import Command, interrupt

import onceonly
from onceonly.langchain import guard

THREAD = {"configurable": {"thread_id": "helpdesk-42"}}


class TicketDesk:
    """The other side: a table of tickets, and an answer that gets lost once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lose_next_answer = True
        with closing(sqlite3.connect(path)) as db, db:
            db.execute("CREATE TABLE tickets (id INTEGER PRIMARY KEY, title TEXT, body TEXT, priority TEXT)")
            db.execute("CREATE TABLE emails (id INTEGER PRIMARY KEY, recipient TEXT, subject TEXT)")

    def query(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        with closing(sqlite3.connect(self.path)) as db, db:
            return db.execute(sql, params).fetchall()

    def count(self, table: str) -> int:
        return int(self.query(f"SELECT count(*) FROM {table}")[0][0])


class ScriptedModel(GenericFakeChatModel):
    """A chat model that plays a script and ignores the tools it is given."""

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedModel:  # type: ignore[override]
        return self


def the_script() -> ScriptedModel:
    def call(name: str, call_id: str, **args: Any) -> AIMessage:
        return AIMessage("", tool_calls=[{"name": name, "args": args, "id": call_id, "type": "tool_call"}])

    return ScriptedModel(
        messages=iter(
            [
                call("create_ticket", "call_1", title="Printer on fire", body="The 3rd floor printer is on fire",
                     priority="urgent"),
                # The model re-plans: a new id, other words for the same ticket.
                call("create_ticket", "call_2", title="printer on fire ", body="Third-floor printer: flames!",
                     priority="urgent"),
                call("send_email", "call_3", to="facilities@example.com", subject="Printer on fire"),
                AIMessage("Ticket filed, facilities emailed."),
            ]
        )
    )  # fmt: skip


def make_agent(model: ScriptedModel, desk: TicketDesk, ledger: onceonly.Ledger, saver: SqliteSaver) -> Any:
    @tool
    def create_ticket(title: str, body: str, priority: str = "normal") -> dict[str, Any]:
        """File a ticket at the help desk."""
        if priority == "urgent":
            answer = interrupt(f"file an urgent ticket {title!r}?")
            if answer != "approved":
                return {"filed": False, "why": answer}
        (row,) = desk.query(
            "INSERT INTO tickets (title, body, priority) VALUES (?, ?, ?) RETURNING id", title, body, priority
        )
        if desk.lose_next_answer:  # committed above; the answer never comes back
            desk.lose_next_answer = False
            raise TimeoutError("the ticket desk did not answer in 5 s")
        return {"filed": True, "id": row[0], "title": title}

    def find_ticket(args: dict[str, Any], key: str) -> Any:
        """The probe: ask the desk whether the ticket is there."""
        rows = desk.query("SELECT id, title FROM tickets WHERE lower(trim(title)) = ?", args["title"].strip().lower())
        return {"filed": True, "id": rows[0][0], "title": rows[0][1]} if rows else onceonly.NOT_FOUND

    @tool
    def send_email(to: str, subject: str) -> str:
        """Send an email."""
        desk.query("INSERT INTO emails (recipient, subject) VALUES (?, ?)", to, subject)
        return f"sent to {to}"

    tools = [
        guard(
            create_ticket,
            ledger,
            key=("title",),  # the same title is the same ticket...
            normalize={"title": onceonly.normalize_text},  # ...whatever its case and spacing
            on_conflict="replay",  # a reworded body replays the ticket filed first
            on_unknown="probe",
            probe=find_ticket,
        ),
        guard(send_email, ledger),
    ]
    return create_agent(model, tools, checkpointer=saver)


def show(messages: list[Any]) -> None:
    for m in messages:
        if isinstance(m, AIMessage) and m.tool_calls:
            for c in m.tool_calls:
                print(f"  model -> {c['name']}({c['args']})  [{c['id']}]")
        elif isinstance(m, AIMessage):
            print(f"  model: {m.content}")
        elif isinstance(m, ToolMessage):
            print(f"  tool  [{m.tool_call_id}, {m.status}]: {m.content}")
        else:
            print(f"  user: {m.content}")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="onceonly-langgraph-") as tmp:
        work = Path(tmp)
        desk = TicketDesk(work / "desk.db")
        model = the_script()

        # The first process: the model asks for an urgent ticket; the tool waits for a person.
        with (
            onceonly.Ledger.open(f"sqlite:///{work / 'ledger.db'}") as ledger,
            SqliteSaver.from_conn_string(str(work / "checkpoints.db")) as saver,
        ):
            agent = make_agent(model, desk, ledger, saver)
            state = agent.invoke({"messages": [("user", "The 3rd floor printer is on fire!")]}, THREAD)
            (pause,) = state["__interrupt__"]
            print(f"paused: {pause.value} (tickets so far: {desk.count('tickets')})")

        # A new process, hours later: the person approves; the graph resumes from its checkpoint.
        with (
            onceonly.Ledger.open(f"sqlite:///{work / 'ledger.db'}") as ledger,
            SqliteSaver.from_conn_string(str(work / "checkpoints.db")) as saver,
        ):
            agent = make_agent(model, desk, ledger, saver)
            state = agent.invoke(Command(resume="approved"), THREAD)
            print("transcript (the tool lines are what the model was told):")
            show(state["messages"])
            (record,) = [r for r in ledger.list() if r.tool == "create_ticket"]
            print(f"ledger: {record.state.value} via {record.via}, attempts {record.attempts}")
        print(f"tickets created: {desk.count('tickets')}")
        print(f"emails sent: {desk.count('emails')}")


if __name__ == "__main__":
    main()
