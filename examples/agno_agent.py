"""Agno: a ticket whose answer is lost, and a model that opens it again.

The ticket service records the ticket, then the connection drops: the tool raises a timeout. Agno tells the
model, and the model asks for the same ticket again. With the plain function as an Agno tool that is a second
ticket. With ``onceonly.agno.guard_tools`` the model reads that the outcome is unknown and must not be issued
again, and the second call makes nothing: one ticket.

Offline: the model is a scripted ``agno.models.base.Model`` subclass, so no API key and no network are
needed. Run it:

    python examples/agno_agent.py
"""

import json
import logging
import sqlite3
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agno.agent import Agent
from agno.models.base import Model
from agno.models.message import Message
from agno.models.response import ModelResponse

import onceonly
from onceonly.agno import guard_tools


class Service:
    """The ticket service: a row per ticket, committed before the answer is lost."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE tickets (title TEXT)")

    def create_ticket(self, title: str) -> str:
        """Open a support ticket."""
        with sqlite3.connect(self.path) as conn:
            conn.execute("INSERT INTO tickets VALUES (?)", (title,))
        raise TimeoutError("the ticket service did not answer")

    def count(self) -> int:
        with sqlite3.connect(self.path) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM tickets").fetchone()[0])


@dataclass
class Scripted(Model):
    """The model's script: open the ticket, open it again when told it failed, then answer."""

    id: str = "scripted"
    turn: int = 0
    read: list[str] = field(default_factory=list)

    def invoke(self, messages: list[Message], *args: Any, **kwargs: Any) -> ModelResponse:
        self.turn += 1
        self.read = [str(m.content) for m in messages if m.role == "tool"]
        if self.turn <= 2:
            arguments = json.dumps({"title": "toner"})
            call = {
                "id": f"call_{self.turn}",
                "type": "function",
                "function": {"name": "create_ticket", "arguments": arguments},
            }
            return ModelResponse(role="assistant", tool_calls=[call])
        return ModelResponse(role="assistant", content="I reported it.")

    async def ainvoke(self, *args: Any, **kwargs: Any) -> ModelResponse:
        return self.invoke(*args, **kwargs)

    def invoke_stream(self, *args: Any, **kwargs: Any) -> Iterator[ModelResponse]:
        yield self.invoke(*args, **kwargs)

    async def ainvoke_stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[ModelResponse]:  # type: ignore[override]
        yield self.invoke(*args, **kwargs)

    def _parse_provider_response(self, response: Any, **kwargs: Any) -> ModelResponse:
        return response  # type: ignore[no-any-return]

    def _parse_provider_response_delta(self, response: Any) -> ModelResponse:
        return response  # type: ignore[no-any-return]


def run(tools: list[Any]) -> Scripted:
    model = Scripted()
    Agent(model=model, tools=tools).run("The printer on floor 3 is out of toner.", session_id="conversation-42")
    return model


def main() -> None:
    logging.getLogger("onceonly").setLevel(logging.ERROR)  # the operator's log, not this page
    logging.getLogger("agno").disabled = True  # Agno logs the unguarded tool's traceback
    with tempfile.TemporaryDirectory() as tmp:
        plain = Service(Path(tmp) / "plain.db")
        run([plain.create_ticket])
        print(f"without onceonly: {plain.count()} tickets")

        guarded = Service(Path(tmp) / "guarded.db")
        ledger = onceonly.Ledger.open(f"sqlite:///{Path(tmp) / 'ledger.db'}")
        model = run(guard_tools([guarded.create_ticket], ledger))
        print(f"with onceonly: {guarded.count()} ticket")
        for text in model.read:
            print(f"  the model read: {text}")
        ledger.close()


if __name__ == "__main__":
    main()
