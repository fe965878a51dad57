"""AutoGen: a ticket whose answer is lost, and a model that asks again.

The helpdesk records the ticket at once, then its answer is lost (the tool times out). AutoGen hands the
model the error, and the model asks again: with a plain ``FunctionTool`` that is a second ticket. With
``onceonly.autogen.guard_tools`` the model reads that the outcome is unknown and must not be issued
again, the late answer is recorded, and a later call in the same conversation is a replay: one ticket.

Offline: the model is a scripted ``ChatCompletionClient``, so no API key and no network are needed:

    python examples/autogen_agent.py
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autogen_agentchat.agents import AssistantAgent
from autogen_core import FunctionCall
from autogen_core.models import ChatCompletionClient, CreateResult, LLMMessage, ModelInfo, RequestUsage
from autogen_core.tools import FunctionTool

import onceonly
from onceonly.autogen import guard_tools


class Helpdesk:
    """The side effect: one row per ticket the moment it is asked for; the answer waits for ``answer``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.answer = threading.Event()
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE tickets (title TEXT)")

    def tool(self, wait: float) -> Any:
        def create_ticket(title: str) -> str:
            """Open a support ticket."""
            with sqlite3.connect(self.path) as conn:
                number = conn.execute("INSERT INTO tickets VALUES (?)", (title,)).lastrowid
            if not self.answer.wait(wait):
                raise TimeoutError("the helpdesk did not answer")  # the ticket exists: its answer is lost
            return f"ticket {number}"

        return create_ticket

    def count(self) -> int:
        with sqlite3.connect(self.path) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM tickets").fetchone()[0])


class Scripted(ChatCompletionClient):
    """Asks for the ticket ``asks`` times (it does not trust an answer it cannot read), then answers; keeps
    the last tool result it read."""

    def __init__(self, asks: int) -> None:
        self.asks = asks
        self.read = ""

    async def create(self, messages: Sequence[LLMMessage], **kwargs: Any) -> CreateResult:
        last = messages[-1].content
        if isinstance(last, list) and last and hasattr(last[0], "content"):
            self.read = str(last[0].content)
        if self.asks == 0:
            return CreateResult(finish_reason="stop", content="done", usage=RequestUsage(0, 0), cached=False)
        self.asks -= 1
        call = FunctionCall(
            id=f"call_{self.asks}", name="create_ticket", arguments=json.dumps({"title": "printer out of toner"})
        )
        return CreateResult(finish_reason="function_calls", content=[call], usage=RequestUsage(0, 0), cached=False)

    def create_stream(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the scripted client does not stream")

    async def close(self) -> None:
        return None

    def actual_usage(self) -> RequestUsage:
        return RequestUsage(0, 0)

    def total_usage(self) -> RequestUsage:
        return RequestUsage(0, 0)

    def count_tokens(self, messages: Sequence[LLMMessage], **kwargs: Any) -> int:
        return 0

    def remaining_tokens(self, messages: Sequence[LLMMessage], **kwargs: Any) -> int:
        return 100_000

    @property
    def capabilities(self) -> Any:
        return {"vision": False, "function_calling": True, "json_output": False}

    @property
    def model_info(self) -> ModelInfo:
        return ModelInfo(
            vision=False, function_calling=True, json_output=False, family="unknown", structured_output=False
        )


async def run(client: Scripted, tools: list[Any]) -> None:
    agent = AssistantAgent("helpdesk", model_client=client, tools=tools, max_tool_iterations=3)
    await agent.run(task="The printer on floor 3 is out of toner: open a ticket.")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        plain = Helpdesk(Path(tmp) / "plain.db")
        asyncio.run(run(Scripted(asks=2), [FunctionTool(plain.tool(wait=0.3), description="Open a support ticket.")]))
        print(f"without onceonly: {plain.count()} tickets")

        desk = Helpdesk(Path(tmp) / "guarded.db")
        ledger = onceonly.Ledger.open(f"sqlite:///{tmp}/ledger.db")
        # The ledger stops waiting after 0.3 s (timeout=) and keeps the call running: its late answer is recorded.
        tools = guard_tools([desk.tool(wait=10)], ledger, timeout=0.3)
        client = Scripted(asks=2)
        with ledger.task("conversation-17"):  # the conversation's id: its runs share records
            asyncio.run(run(client, tools))
        print(f"with onceonly: {desk.count()} ticket")
        print(f"the model read: {client.read[:96]}…")

        desk.answer.set()  # the late answer arrives and is recorded
        [record] = ledger.list()
        while (now := ledger.get(record.key)) is not None and now.state.value != "confirmed":
            time.sleep(0.02)
        client = Scripted(asks=1)
        with ledger.task("conversation-17"):  # later, the same conversation asks again
            asyncio.run(run(client, tools))
        print(f"asked again after the late answer: {desk.count()} ticket")
        print(f"the model read: {client.read[:96]}…")
        ledger.close()


if __name__ == "__main__":
    main()
