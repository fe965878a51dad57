"""LlamaIndex: a ticket whose answer is lost, and a model that opens it again.

The ticket service records the ticket, then the connection drops: the tool raises a timeout. The
FunctionAgent tells the model, and the model asks for the same ticket again. With LlamaIndex's plain
``FunctionTool`` that is a second ticket. With ``onceonly.llamaindex.guard_tools`` the model reads that the
outcome is unknown and must not be issued again, and the second call makes nothing: one ticket.

Offline: the model is LlamaIndex's own ``MockFunctionCallingLLM`` with a scripted response generator, so no
API key and no network are needed. Run it:

    python examples/llamaindex_agent.py
"""

import asyncio
import logging
import sqlite3
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llama_index.core.agent.workflow import FunctionAgent
from llama_index.core.base.llms.types import ToolCallBlock
from llama_index.core.llms import ChatMessage, MessageRole
from llama_index.core.llms.mock import MockFunctionCallingLLM
from llama_index.core.tools import FunctionTool

import onceonly
from onceonly.llamaindex import guard_tools


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


class Model:
    """The model's script: open the ticket, open it again when told it failed, then answer."""

    def __init__(self) -> None:
        self.turn = 0
        self.read: list[str] = []

    def __call__(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatMessage:
        self.turn += 1
        self.read = [m.content or "" for m in messages if m.role == MessageRole.TOOL]
        if self.turn <= 2:
            call = ToolCallBlock(
                tool_call_id=f"call_{self.turn}", tool_name="create_ticket", tool_kwargs={"title": "toner"}
            )
            return ChatMessage(role=MessageRole.ASSISTANT, blocks=[call])
        return ChatMessage(role=MessageRole.ASSISTANT, content="I reported it.")


async def run(tools: list[Any]) -> Model:
    model = Model()
    agent = FunctionAgent(tools=tools, llm=MockFunctionCallingLLM(response_generator=model))
    await agent.run("The printer on floor 3 is out of toner.")
    return model


async def main() -> None:
    logging.getLogger("onceonly").setLevel(logging.ERROR)  # the operator's log, not this page
    with tempfile.TemporaryDirectory() as tmp:
        plain = Service(Path(tmp) / "plain.db")
        await run([FunctionTool.from_defaults(fn=plain.create_ticket)])
        print(f"without onceonly: {plain.count()} tickets")

        guarded = Service(Path(tmp) / "guarded.db")
        ledger = onceonly.Ledger.open(f"sqlite:///{Path(tmp) / 'ledger.db'}")
        with ledger.task("conversation-42"):
            model = await run(guard_tools([guarded.create_ticket], ledger))
        print(f"with onceonly: {guarded.count()} ticket")
        for text in model.read:
            print(f"  the model read: {text}")
        ledger.close()


if __name__ == "__main__":
    asyncio.run(main())
