"""A Claude agent whose charge tool loses its answer, and the model issues the charge again.

The charge goes through, then the payment service's answer is lost (a timeout). Without onceonly, the
model's second try charges the customer again. With onceonly.claude_agent_sdk, the second try is not
run, and the model reads that the first one's outcome is unknown and must not be issued again. A
charge that did answer, issued again, is replayed: the model reads that it was done and not repeated.

The real Claude Code CLI that the SDK bundles runs the agent; offline, it talks to a local stand-in
for the Anthropic Messages API (tests/_fake_messages_api.py, from this repository) that answers from
a script and keeps what the model was sent. Run it from a checkout: python examples/claude_agent_sdk_agent.py
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's fake Messages API

import claude_agent_sdk as sdk
from claude_agent_sdk import ClaudeAgentOptions, ClaudeSDKClient
from tests._fake_messages_api import FakeMessagesApi, claude_env, text, tool_results, tool_use

import onceonly
from onceonly.claude_agent_sdk import create_sdk_mcp_server, session_hooks

CHARGE = "mcp__billing__charge"


def model(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The scripted model: it charges ada what the prompt says, charges again whatever it was told, then
    stops."""
    turns = sum(1 for m in body["messages"] if m["role"] == "assistant")
    if turns < 2:
        cents = int(str(body["messages"][0]["content"]).split("cents:")[1].split()[0].strip("'\"]}"))
        return [tool_use(CHARGE, {"customer": "ada", "cents": cents})]
    return [text("done")]


async def run(api: FakeMessagesApi, home: Path, server: Any, cents: int) -> list[str]:
    """One Claude session; what the model read from each charge."""
    options = ClaudeAgentOptions(
        mcp_servers={"billing": server},
        allowed_tools=[CHARGE],
        hooks=session_hooks(),  # type: ignore[arg-type]
        env=claude_env(api.url, home),
        cwd=str(home),
        model="claude-sonnet-4-5",
        setting_sources=[],
    )
    async with ClaudeSDKClient(options) as client:
        await client.query(f"Charge ada, cents: {cents} ")
        async for _ in client.receive_response():
            pass
    return [r["text"].split("\n\n<system-reminder>")[0] for r in tool_results(api.requests[-1])]


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="onceonly-claude-") as tmp:
        root = Path(tmp)
        db = root / "payments.db"
        with sqlite3.connect(db) as conn:
            conn.execute("CREATE TABLE charges (customer TEXT, cents INTEGER)")

        def count() -> int:
            with sqlite3.connect(db) as conn:
                return int(conn.execute("SELECT COUNT(*) FROM charges").fetchone()[0])

        def charge(customer: str, cents: int) -> str:
            """Charge a customer's card."""
            with sqlite3.connect(db) as conn:
                conn.execute("INSERT INTO charges VALUES (?, ?)", (customer, cents))
            if cents == 500:  # the charge went through; its answer is lost
                raise TimeoutError("the payment service did not answer")
            return f"charged {customer} {cents} cents"

        @sdk.tool("charge", "Charge a customer's card.", {"customer": str, "cents": int})
        async def unguarded(args: dict[str, Any]) -> dict[str, Any]:
            try:
                return {"content": [{"type": "text", "text": charge(args["customer"], args["cents"])}]}
            except TimeoutError as exc:
                return {"content": [{"type": "text", "text": str(exc)}], "is_error": True}

        def home(name: str) -> Path:
            made = root / name
            made.mkdir()
            return made

        with FakeMessagesApi(model) as api:
            asyncio.run(run(api, home("plain"), sdk.create_sdk_mcp_server("billing", tools=[unguarded]), 500))
            print(f"without onceonly, a lost answer: charges made: {count()}")

            ledger = onceonly.Ledger.open(f"sqlite:///{root / 'ledger.db'}")
            server = create_sdk_mcp_server("billing", [charge], ledger)
            for story, cents in (("a lost answer", 500), ("an answer", 700)):
                before = count()
                told = asyncio.run(run(api, home(f"guarded-{cents}"), server, cents))
                print(f"with onceonly, {story}: charges made: {count() - before}")
                for i, said in enumerate(told, 1):
                    print(f"  the model read after charge {i}: {said}")
            ledger.close()


if __name__ == "__main__":
    main()
