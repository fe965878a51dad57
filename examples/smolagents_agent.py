"""smolagents: a ticket whose answer is lost, and a model that asks again in the same run.

The helpdesk records the ticket at once, then its answer is lost (the tool times out). smolagents tells
the model "Error executing tool … Please try again", and the model does: with the plain tool that is a
second ticket. With ``onceonly.smolagents.guard_agent`` the model reads that the outcome is unknown and
must not be issued again, the late answer is recorded, and a re-issued call is a replay: one ticket,
and the model is told so.

Offline: the model is a scripted ``smolagents.Model`` subclass, so no API key and no network are needed:

    python examples/smolagents_agent.py
"""

from __future__ import annotations

import sqlite3
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from smolagents import Model, ToolCallingAgent, tool
from smolagents.models import ChatMessage, ChatMessageToolCall, ChatMessageToolCallFunction, MessageRole

import onceonly
from onceonly.smolagents import guard_agent

TICKET = ("create_ticket", {"title": "printer out of toner"})
DONE = ("final_answer", {"answer": "done"})


class Helpdesk:
    """The side effect: one row per ticket the moment it is asked for; the answer waits for ``answer``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.answer = threading.Event()
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE tickets (title TEXT)")

    def tool(self, wait: float) -> Any:
        def create_ticket(title: str) -> str:
            """Open a support ticket.

            Args:
                title: what the ticket is about.
            """
            with sqlite3.connect(self.path) as conn:
                number = conn.execute("INSERT INTO tickets VALUES (?)", (title,)).lastrowid
            if not self.answer.wait(wait):
                raise TimeoutError("the helpdesk did not answer")  # the ticket exists: its answer is lost
            return f"ticket {number}"

        return create_ticket

    def count(self) -> int:
        with sqlite3.connect(self.path) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM tickets").fetchone()[0])


class Scripted(Model):
    """Calls create_ticket, then again (it did not trust the answer), then answers; keeps what it read."""

    def __init__(self, *turns: tuple[str, dict[str, Any]]) -> None:
        super().__init__(model_id="scripted")
        self.turns = list(turns)
        self.read: list[str] = []

    def generate(self, messages: list[Any], *args: Any, **kwargs: Any) -> ChatMessage:
        last = messages[-1].content
        self.read.append(" ".join(block.get("text", "") for block in last) if isinstance(last, list) else str(last))
        name, arguments = self.turns.pop(0)
        call = ChatMessageToolCall(
            id=f"c{len(self.read)}",
            type="function",
            function=ChatMessageToolCallFunction(name=name, arguments=arguments),
        )
        return ChatMessage(role=MessageRole.ASSISTANT, content="", tool_calls=[call])


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        plain = Helpdesk(Path(tmp) / "plain.db")
        ToolCallingAgent(
            tools=[tool(plain.tool(wait=0.3))], model=Scripted(TICKET, TICKET, DONE), verbosity_level=0
        ).run("Open a ticket.")
        print(f"without onceonly: {plain.count()} tickets")

        desk = Helpdesk(Path(tmp) / "guarded.db")
        ledger = onceonly.Ledger.open(f"sqlite:///{tmp}/ledger.db")
        model = Scripted(TICKET, TICKET, DONE)
        # The ledger stops waiting after 0.3 s (timeout=) and keeps the call running: its late answer is recorded.
        tools = [tool(desk.tool(wait=10))]
        agent = guard_agent(ToolCallingAgent(tools=tools, model=model, verbosity_level=0), ledger, timeout=0.3)
        with ledger.task("conversation-17"):  # the conversation's id: its runs share records
            agent.run("Open a ticket.")
        print(f"with onceonly: {desk.count()} ticket")
        print(f"the model read: {model.read[-1].split('Observation:')[-1].strip()[:96]}…")

        desk.answer.set()  # the late answer arrives and is recorded
        [record] = ledger.list()
        while (now := ledger.get(record.key)) is not None and now.state.value != "confirmed":
            time.sleep(0.02)
        agent.model = model = Scripted(TICKET, DONE)
        with ledger.task("conversation-17"):  # later, the same conversation asks again
            agent.run("Open a ticket.")
        print(f"asked again after the late answer: {desk.count()} ticket")
        print(f"the model read: {model.read[-1].split('Observation:')[-1].strip()[:96]}…")
        ledger.close()


if __name__ == "__main__":
    main()
