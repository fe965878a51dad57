"""A pydantic-ai agent under DBOS durability, run as its own process by tests/test_dbos.py.

    python tests/_dbos_agent.py run|recover DIR KEYING      (or main(...) in a child process)

``run`` starts the workflow ``order-1`` inside the caller's ``ledger.task("conv-1")``; the agent's scripted
model asks for ``charge(amount=5)``, the guarded tool writes the charge to DIR/effects.db and the process
dies at once (``os._exit``), before the tool returns and before DBOS records anything after it.
``recover`` launches DBOS on the same system database: DBOS recovers the pending workflow and runs it
again, the model step replays its recorded tool call, and the workflow's result (the model's last text,
which quotes the tool result it read) is written to DIR/result.json with the charges counted.

KEYING: ``dbos`` (``onceonly.dbos.install()``: keyed by the workflow; the recovered call finds the charge
with its probe), ``dbos-review`` (the same, no probe: the charge stays unknown), ``task`` (no install:
keyed by the caller's task, which recovery does not restore); ``pydantic`` and ``pydantic-review`` (the
same as ``dbos`` and ``dbos-review``, the tool a plain function guarded by ``onceonly.pydantic_ai.guard``),
``pydantic-toolset`` (as ``pydantic``, through ``onceonly.pydantic_ai.guarded(FunctionToolset(...))``).
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

from dbos import DBOS, DBOSConfig, SetWorkflowID
from pydantic_ai import Agent, Tool
from pydantic_ai.durable_exec.dbos import DBOSDurability
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import FunctionToolset

import onceonly
import onceonly.dbos
import onceonly.pydantic_ai
from onceonly import Ledger

WORKFLOW = "order-1"
CRASHED = 17


def main(mode: str, where: Path, keying: str) -> None:
    effects = sqlite3.connect(where / "effects.db", isolation_level=None, check_same_thread=False)
    effects.execute("CREATE TABLE IF NOT EXISTS charges (key TEXT, amount INTEGER)")
    ledger = Ledger.open(f"sqlite:///{where / 'ledger.db'}")
    if keying.startswith(("dbos", "pydantic")):
        onceonly.dbos.install()

    def find_charge(args: dict[str, Any], key: str) -> Any:
        row = effects.execute("SELECT amount FROM charges WHERE key = ?", (key,)).fetchone()
        return onceonly.NOT_FOUND if row is None else f"charged {row[0]}"

    # lease=1: the dead run's claim lapses a second after it died, and the recovered call settles it.
    review = keying.endswith("-review")
    probed: dict[str, Any] = {} if review else {"on_unknown": "probe", "probe": find_charge}

    def charge(amount: int, *, idempotency_key: str) -> str:
        """Charge the customer's card."""
        effects.execute("INSERT INTO charges VALUES (?, ?)", (idempotency_key, amount))
        if mode == "run":
            os._exit(CRASHED)  # killed after the charge, before the tool returns
        return f"charged {amount}"

    tools: dict[str, Any] = {}
    if keying == "pydantic-toolset":  # the toolset wrapper: its call_tool runs in workflow code, as the tools do

        def charge_card(amount: int) -> str:
            """Charge the customer's card."""
            running = onceonly.current_call()
            assert running is not None
            return charge(amount, idempotency_key=running.key)

        toolset = FunctionToolset([Tool(charge_card, name="charge")])
        tools["toolsets"] = [onceonly.pydantic_ai.guarded(toolset, ledger, lease=1.0, **probed)]
    elif keying.startswith("pydantic"):
        tools["tools"] = [onceonly.pydantic_ai.guard(charge, ledger, lease=1.0, **probed)]
    else:
        tools["tools"] = [ledger.tool(name="charge", tell_model=True, lease=1.0, **probed)(charge)]

    def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returned = [part for message in messages for part in message.parts if isinstance(part, ToolReturnPart)]
        if not returned:
            return ModelResponse(parts=[ToolCallPart("charge", {"amount": 5})])
        return ModelResponse(parts=[TextPart(f"the tool said: {returned[-1].content}")])

    agent = Agent(FunctionModel(script), name="shop", **tools, capabilities=[DBOSDurability()])

    @DBOS.workflow(name="order")
    async def order(prompt: str) -> str:
        result = await agent.run(prompt)
        return result.output

    config: DBOSConfig = {
        "name": "onceonly-dbos-test",
        "system_database_url": f"sqlite:///{where / 'dbos.sqlite'}",
    }
    DBOS(config=config)
    DBOS.launch()  # recovers the workflows this executor left pending
    try:
        if mode == "run":

            async def start() -> str:
                with ledger.task("conv-1"), SetWorkflowID(WORKFLOW):
                    return await order("charge me 5")

            asyncio.run(start())
            raise SystemExit("the tool should have ended the process")
        output = DBOS.retrieve_workflow(WORKFLOW).get_result()
        (count,) = effects.execute("SELECT count(*) FROM charges").fetchone()
        keys = [row[0] for row in effects.execute("SELECT key FROM charges")]
        result = {"output": output, "charges": count, "keys": keys}
        (where / "result.json").write_text(json.dumps(result))
    finally:
        DBOS.destroy()
        ledger.close()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
    print((Path(sys.argv[2]) / "result.json").read_text() if sys.argv[1] == "recover" else "")
