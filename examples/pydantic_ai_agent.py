"""pydantic-ai: a charge whose answer is lost, and a model that asks again.

The payment provider records the charge, then the connection drops before its answer arrives. With
pydantic-ai alone the tool tells the model to try again (``ModelRetry``), the model re-issues the same
charge, and the customer is charged twice. With ``onceonly.pydantic_ai.guard_tools`` the model reads
that the outcome is unknown and must not be issued again (a failed tool result: the run goes on); the
model asks again anyway, and still nothing is charged twice. Then the provider answers normally and a
re-planned call is a replay, which the model is told.

Offline: the model is pydantic-ai's ``FunctionModel`` with a script, so no API key and no network are
needed. Run it:

    python examples/pydantic_ai_agent.py
"""

from __future__ import annotations

import sqlite3
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic_ai import Agent, ModelRetry, Tool
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

import onceonly
from onceonly.pydantic_ai import guard_tools


class Provider:
    """A payment provider: each charge is a row the moment it is asked for; ``drop`` loses the answer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.drop = True
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE charges (customer TEXT, cents INTEGER)")

    def charge(self, customer: str, cents: int) -> str:
        with sqlite3.connect(self.path) as conn:
            number = conn.execute("INSERT INTO charges VALUES (?, ?)", (customer, cents)).lastrowid
        if self.drop:
            raise ConnectionResetError("the connection dropped before the provider answered")
        return f"charged {customer} {cents} cents (charge #{number})"

    def count(self) -> int:
        with sqlite3.connect(self.path) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM charges").fetchone()[0])


def script(turns: int) -> Callable[[list[ModelMessage], AgentInfo], ModelResponse]:
    """The model: asks for the same charge ``turns`` times, then says it is done."""
    asked = 0

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        nonlocal asked
        if asked < turns:
            asked += 1
            return ModelResponse(parts=[ToolCallPart("charge", {"customer": "c-42", "cents": 500})])
        return ModelResponse(parts=[TextPart("Done.")])

    return model


def run(tools: list[Any], turns: int, conversation: str = "conversation-42") -> None:
    seen: list[list[ModelMessage]] = []
    scripted = script(turns)

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append(list(messages))
        return scripted(messages, info)

    agent = Agent(FunctionModel(model), tools=tools)
    agent.run_sync("Charge customer c-42 five dollars.", conversation_id=conversation)
    for message in seen[-1]:
        for part in message.parts if isinstance(message, ModelRequest) else ():
            if isinstance(part, ToolReturnPart):
                print(f"  the model read ({part.outcome}): {part.content}")
            elif part.part_kind == "retry-prompt":
                print(f"  the model read (retry): {part.model_response().splitlines()[0]}")


def main() -> None:
    # The ledger is closed before the directory goes: the run leaves nothing behind.
    with tempfile.TemporaryDirectory(prefix="onceonly-pydantic-ai-") as tmp:
        plain = Provider(Path(tmp) / "plain.db")

        def charge(customer: str, cents: int) -> str:
            """Charge a customer's card."""
            try:
                return plain.charge(customer, cents)
            except ConnectionResetError as exc:
                raise ModelRetry(f"the charge failed ({exc}); try again") from exc

        run([Tool(charge, max_retries=3)], turns=2)
        print(f"without onceonly: {plain.count()} charges")

        provider = Provider(Path(tmp) / "guarded.db")
        with onceonly.Ledger.open(f"sqlite:///{Path(tmp) / 'ledger.db'}") as ledger:

            def charge_once(customer: str, cents: int) -> str:
                """Charge a customer's card."""
                return provider.charge(customer, cents)

            tools = guard_tools([Tool(charge_once, name="charge")], ledger)
            run(tools, turns=2)
            print(f"with onceonly: {provider.count()} charge")
            ledger.resolve(
                ledger.list()[0].key, confirmed="charged c-42 500 cents (charge #1)", why="seen in the provider"
            )
            run(tools, turns=1)
            print(f"after the operator settled it, asked again: {provider.count()} charge")
            for record in ledger.list():
                print(f"  ledger: {record.key} {record.state.value} (via {record.via})")


if __name__ == "__main__":
    main()
