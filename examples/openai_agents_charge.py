"""The OpenAI Agents SDK: a charge whose answer comes after the SDK's time limit, and a model that asks again.

The payment provider records the charge at once but answers late, after the tool's time limit
(the SDK's ``timeout=``). The SDK stops waiting and tells the model; the model re-issues the same
charge under a new call id. With the SDK's plain ``@function_tool`` the customer is charged twice.
With ``@onceonly.openai_agents.function_tool(ledger)`` the model reads that the outcome is unknown and
must not be issued again, the late answer is recorded, and the re-issued call is a replay: one charge,
and the model is told so.

Offline: the model is a scripted one (the SDK's ``agents.testing.ScriptedModel``), so no API key and no
network are needed. Run it:

    python examples/openai_agents_charge.py
"""

from __future__ import annotations

import asyncio
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

import agents
from agents import Agent, RunConfig, Runner
from agents.testing import ModelStep, ScriptedModel, assistant_message, function_call

import onceonly
from onceonly.openai_agents import function_tool

TIME_LIMIT = 0.5  # seconds: the SDK's limit per tool call; the provider answers only when released


class Provider:
    """A payment provider: each charge is a row the moment it is asked for; the answer waits."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.answer = asyncio.Event()
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE charges (customer TEXT, cents INTEGER)")

    async def charge(self, customer: str, cents: int) -> str:
        with sqlite3.connect(self.path) as conn:
            number = conn.execute("INSERT INTO charges VALUES (?, ?)", (customer, cents)).lastrowid
        await self.answer.wait()
        return f"charged {customer} {cents} cents (charge #{number})"

    def count(self) -> int:
        with sqlite3.connect(self.path) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM charges").fetchone()[0])


def script(provider: Provider) -> ScriptedModel:
    """The model: charge; on the time-out text, charge again (a new call id); then report what it read."""

    def again(_: Any) -> Any:
        provider.answer.set()  # the late answer arrives while the model thinks
        return [function_call("charge", {"customer": "c-42", "cents": 500}, call_id="call_B")]

    return ScriptedModel(
        [
            [function_call("charge", {"customer": "c-42", "cents": 500}, call_id="call_A")],
            ModelStep.respond(again),
            [assistant_message("Done.")],
        ]
    )


async def run(tool: Any, model: ScriptedModel) -> None:
    agent = Agent(name="billing", instructions="Charge the customer.", model=model, tools=[tool])
    config = RunConfig(group_id="conversation-42", tracing_disabled=True)
    await Runner.run(agent, "Charge customer c-42 five dollars.", run_config=config)
    for item in model.calls[-1].input:
        if isinstance(item, dict) and item.get("type") == "function_call_output":
            print(f"  the model read for {item['call_id']}: {item['output']}")


async def main() -> None:
    # The ledger is closed before the directory goes: the run leaves nothing behind.
    with tempfile.TemporaryDirectory(prefix="onceonly-agents-") as tmp:
        plain = Provider(Path(tmp) / "plain.db")

        async def charge(customer: str, cents: int) -> str:
            """Charge a customer's card.

            Args:
                customer: the customer id.
                cents: the amount, in cents.
            """
            return await plain.charge(customer, cents)

        await run(agents.function_tool(charge, timeout=TIME_LIMIT), script(plain))
        print(f"without onceonly: {plain.count()} charges")

        provider = Provider(Path(tmp) / "guarded.db")
        with onceonly.Ledger.open(f"sqlite:///{Path(tmp) / 'ledger.db'}") as ledger:

            @function_tool(ledger, tool_timeout=TIME_LIMIT, name_override="charge")
            async def charge_once(customer: str, cents: int) -> str:
                """Charge a customer's card.

                Args:
                    customer: the customer id.
                    cents: the amount, in cents.
                """
                return await provider.charge(customer, cents)

            await run(charge_once, script(provider))
            print(f"with onceonly: {provider.count()} charge")
            for record in ledger.list():
                print(f"  ledger: {record.key} {record.state.value} (via {record.via})")


if __name__ == "__main__":
    asyncio.run(main())
