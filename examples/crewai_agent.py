"""CrewAI: a ticket whose answer is lost, and CrewAI's own retry loop that asks again.

Runs in its own environment: crewai cannot share the project's .venv (it needs mcp<2, openai<3,
pydantic<2.13), so ``make test`` builds ``.venv-crewai`` for it:

    make .venv-crewai/.installed
    .venv-crewai/bin/python examples/crewai_agent.py

The helpdesk service records the ticket and then its answer is lost (a read timeout). CrewAI's
``ToolUsage`` retries a tool that raised, twice per attempt and up to three attempts: six tickets for one
``Action`` with a plain ``@tool``. With ``onceonly.crewai.guard_tools`` the lost answer is an unknown outcome
in the ledger, the model reads that it must not issue it again (as the tool's result, so CrewAI does not
retry), and there is one ticket.

Offline: the model is a scripted one (a ``crewai.llms.base_llm.BaseLLM`` subclass answering in ReAct
text), and CrewAI's telemetry and tracing are switched off, so no API key and no network are needed.
"""

from __future__ import annotations

import os

# Before crewai is imported: it reports usage and traces over the network unless told not to.
os.environ.setdefault("CREWAI_DISABLE_TELEMETRY", "true")
os.environ.setdefault("OTEL_SDK_DISABLED", "true")
os.environ.setdefault("CREWAI_TRACING_ENABLED", "false")

import json
import logging
import sqlite3
import tempfile
import warnings
from pathlib import Path
from typing import Any

from crewai import Agent, Crew, Task
from crewai.llms.base_llm import BaseLLM
from crewai.tools import tool

import onceonly
from onceonly.crewai import guard_tools

warnings.filterwarnings("ignore", category=DeprecationWarning)  # CrewAI reading its own deprecated fields
logging.getLogger("onceonly").setLevel(logging.ERROR)  # the operator's log, not this example's output

ACTION = 'Thought: I open a ticket\nAction: create_ticket\nAction Input: {"title": "printer out of toner"}'
FINAL = "Thought: I know the answer\nFinal Answer: the ticket is being checked"


class ScriptedLLM(BaseLLM):
    """A model that answers from a script and keeps the last messages it was sent."""

    def __init__(self, *replies: str) -> None:
        super().__init__(model="scripted")
        self._replies = list(replies)
        self.last: list[dict[str, Any]] = []

    def call(self, messages: Any, *args: Any, **kwargs: Any) -> Any:
        self.last = [{"role": "user", "content": messages}] if isinstance(messages, str) else list(messages)
        return self._replies.pop(0) if self._replies else FINAL

    def get_input_tokens_count(self, *args: Any, **kwargs: Any) -> int:
        return 0  # a scripted model counts nothing (CrewAI's estimate logs a warning per call)

    def observation(self) -> str:
        """The first tool result the model read."""
        for m in self.last:
            if m.get("role") == "assistant" and "Observation:" in str(m.get("content")):
                return str(m["content"]).split("Observation:", 1)[1].strip().splitlines()[0]
        return ""


class Helpdesk:
    """The side effect: one row per ticket, in a SQLite file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE tickets (title TEXT)")

    def count(self) -> int:
        with sqlite3.connect(self.path) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM tickets").fetchone()[0])

    def tool(self) -> Any:
        @tool("create_ticket")
        def create_ticket(title: str) -> str:
            """Open a support ticket."""
            with sqlite3.connect(self.path) as conn:
                conn.execute("INSERT INTO tickets VALUES (?)", (title,))  # committed
            raise TimeoutError("read timed out")  # and the answer is lost

        return create_ticket


def kickoff(tools: list[Any]) -> ScriptedLLM:
    llm = ScriptedLLM(ACTION, FINAL)
    agent = Agent(role="helpdesk", goal="open tickets", backstory="a helpdesk", llm=llm, tools=tools)
    task = Task(description="The printer on floor 3 is out of toner", expected_output="a ticket", agent=agent)
    Crew(agents=[agent], tasks=[task]).kickoff()
    return llm


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        plain = Helpdesk(Path(tmp) / "plain.db")
        llm = kickoff([plain.tool()])
        print(f"without onceonly: {plain.count()} tickets for one Action")
        print(f"  the model read: {llm.observation()}")

        guarded = Helpdesk(Path(tmp) / "guarded.db")
        ledger = onceonly.Ledger.open(f"sqlite:///{Path(tmp) / 'ledger.db'}")
        with ledger.task("conversation-42"):
            llm = kickoff(guard_tools([guarded.tool()], ledger))
        print(f"with onceonly: {guarded.count()} ticket")
        print(f"  the model read: {llm.observation()}")
        record = ledger.list()[0]
        print(f"  the ledger: {record.key} is {record.state.value}, for a person to settle")
        print(json.dumps({"without": plain.count(), "with": guarded.count()}))
        ledger.close()


if __name__ == "__main__":
    main()
