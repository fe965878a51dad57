"""Google ADK: a charge whose answer is lost, and a model that asks again.

Runs in its own environment: google-adk cannot share the project's .venv (its opentelemetry-api cap),
so run it with the one ``make .venv-google-adk/.installed`` makes:

    .venv-google-adk/bin/python examples/google_adk_agent.py

The payment provider records the charge, then the connection times out before its answer arrives.
With a plain ADK function tool the exception aborts the run; the user says "try again" and the
customer is charged twice. With ``onceonly.google_adk.guard_tools`` the model reads that the outcome
is unknown and must not be issued again, the run goes on, and the model's re-issue is told the same:
one charge, waiting for a person to confirm it. Then the same session asks for a refund twice: one
refund, the second call told it was already done.

Offline: the model is a scripted ``BaseLlm`` (ADK's own model interface), the sessions ADK's
``InMemorySessionService``: no API key and no network.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import tempfile
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from google.adk.agents import LlmAgent
from google.adk.apps import App
from google.adk.models.base_llm import BaseLlm
from google.adk.models.llm_request import LlmRequest
from google.adk.models.llm_response import LlmResponse
from google.adk.runners import Runner
from google.adk.sessions import InMemorySessionService
from google.genai import types
from pydantic import Field

import onceonly
from onceonly.google_adk import guard_tools


class ScriptedModel(BaseLlm):
    """A model that answers each request with the next list of parts, and keeps what it was sent."""

    model: str = "scripted"
    steps: list[list[types.Part]] = Field(default_factory=list)
    requests: list[LlmRequest] = Field(default_factory=list)

    async def generate_content_async(
        self, llm_request: LlmRequest, stream: bool = False
    ) -> AsyncGenerator[LlmResponse, None]:
        self.requests.append(llm_request.model_copy(deep=True))
        parts = self.steps.pop(0) if self.steps else [types.Part(text="Done.")]
        usage = types.GenerateContentResponseUsageMetadata(prompt_token_count=1, candidates_token_count=1)
        yield LlmResponse(content=types.Content(role="model", parts=parts), usage_metadata=usage)

    def told(self) -> list[Any]:
        """The function responses the model read (the contents of its last request)."""
        return [
            p.function_response.response
            for c in self.requests[-1].contents
            for p in c.parts or ()
            if p.function_response is not None
        ]


def call(name: str, call_id: str, **args: Any) -> types.Part:
    return types.Part(function_call=types.FunctionCall(name=name, id=call_id, args=args))


class Provider:
    """A payment provider: each charge or refund is a row; the first charge's answer is lost."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE moves (kind TEXT, customer TEXT, cents INTEGER)")

    def add(self, kind: str, customer: str, cents: int) -> int:
        with sqlite3.connect(self.path) as conn:
            return int(conn.execute("INSERT INTO moves VALUES (?, ?, ?)", (kind, customer, cents)).lastrowid or 0)

    def count(self, kind: str) -> int:
        with sqlite3.connect(self.path) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM moves WHERE kind = ?", (kind,)).fetchone()[0])


def tools(provider: Provider) -> list[Any]:
    def charge(customer: str, cents: int) -> str:
        """Charge a customer's card."""
        provider.add("charge", customer, cents)
        raise TimeoutError("the provider's answer was lost")

    def refund(customer: str, cents: int) -> dict[str, Any]:
        """Refund a customer."""
        return {"refund": provider.add("refund", customer, cents), "cents": cents}

    return [charge, refund]


async def say(runner: Runner, text: str) -> None:
    message = types.Content(role="user", parts=[types.Part(text=text)])
    async for _ in runner.run_async(user_id="alice", session_id="s-1", new_message=message):
        pass


async def chat(agent_tools: list[Any], model: ScriptedModel) -> Runner:
    sessions = InMemorySessionService()
    await sessions.create_session(app_name="shop", user_id="alice", session_id="s-1")
    agent = LlmAgent(name="billing", model=model, instruction="Charge or refund the customer.", tools=agent_tools)
    return Runner(app=App(name="shop", root_agent=agent), session_service=sessions)


async def main() -> None:
    charge_c42 = [call("charge", "call_A", customer="c-42", cents=500)]
    with tempfile.TemporaryDirectory(prefix="onceonly-adk-") as tmp:
        plain = Provider(Path(tmp) / "plain.db")
        runner = await chat(tools(plain), ScriptedModel(steps=[charge_c42, charge_c42]))
        for text in ("Charge customer c-42 five dollars.", "Try again."):
            try:
                await say(runner, text)
            except TimeoutError as exc:
                print(f"  the run aborted: TimeoutError: {exc}")
        print(f"without onceonly: {plain.count('charge')} charges")

        provider = Provider(Path(tmp) / "guarded.db")
        with onceonly.Ledger.open(f"sqlite:///{Path(tmp) / 'ledger.db'}") as ledger:
            again = [call("charge", "call_B", customer="c-42", cents=500)]
            model = ScriptedModel(steps=[charge_c42, again])
            runner = await chat(guard_tools(tools(provider), ledger), model)
            await say(runner, "Charge customer c-42 five dollars.")
            print(f"with onceonly: {provider.count('charge')} charge")
            for response in model.told():
                print(f"  the model read: {response}")

            model.steps = [
                [call("refund", "call_C", customer="c-7", cents=300)],
                [call("refund", "call_D", customer="c-7", cents=300)],
            ]
            await say(runner, "Refund c-7 three dollars.")
            print(f"refunds made: {provider.count('refund')}")
            for response in model.told()[-2:]:
                print(f"  the model read: {response}")
            for record in ledger.list():
                print(f"  ledger: {record.tool} {record.state.value} (scope {record.scope})")


if __name__ == "__main__":
    logging.getLogger("onceonly").setLevel(logging.ERROR)  # the operator's lines; the model's are printed
    logging.getLogger("google_adk").setLevel(logging.CRITICAL)  # ADK logs the aborted runs' tracebacks
    asyncio.run(main())
