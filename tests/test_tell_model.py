"""``@ledger.tool(tell_model=True)``: for a framework with no integration, the plain guarded function returns
what the model should read for every state but a fresh result, instead of raising an outcome error whose
text (the key, ``onceonly resolve …``) the framework would show the model."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from typing import Any

import pytest

from onceonly import InProgress, KeyConflict, Ledger, OutcomeUnknown, tell_model

UNKNOWN = "The outcome of this action is unknown"
NOT_REPEATED = "and was not repeated"


def test_a_fresh_result_is_returned_as_it_is_and_a_replay_says_it_was_not_repeated(ledger: Ledger) -> None:
    made: list[str] = []

    @ledger.tool(tell_model=True)
    def create_ticket(title: str) -> dict[str, Any]:
        made.append(title)
        return {"id": len(made)}

    assert create_ticket("toner") == {"id": 1}
    again = create_ticket("toner")
    assert isinstance(again, str) and NOT_REPEATED in again and '{"id":1}' in again
    assert made == ["toner"]
    assert create_ticket.outcome("toner").result == {"id": 1}  # .outcome() is unchanged


def test_an_unknown_outcome_returns_the_models_text_and_logs_the_operators(
    ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    made: list[str] = []

    @ledger.tool(tell_model=True)
    def create_ticket(title: str) -> str:
        made.append(title)
        raise TimeoutError("no answer")

    with caplog.at_level(logging.WARNING, logger="onceonly"):
        first, second = create_ticket("toner"), create_ticket("toner")
    assert first == second == tell_model(OutcomeUnknown("x", key="k"))
    assert first.startswith(UNKNOWN) and "onceonly resolve" not in first and "default:" not in first
    assert "onceonly resolve" in caplog.text  # the operator's next step, in the log
    assert made == ["toner"]
    with pytest.raises(OutcomeUnknown):
        create_ticket.outcome("toner")


def test_the_tools_own_error_is_raised_as_it_is(ledger: Ledger) -> None:
    @ledger.tool(tell_model=True)
    def create_ticket(title: str) -> str:
        raise ValueError("title too long")

    with pytest.raises(ValueError, match="title too long"):
        create_ticket("toner")


def test_using_a_chosen_key_answers_the_same_way(ledger: Ledger) -> None:
    """``.using(key=...)(...)`` is the plain call with a key: it returns the model's text too."""
    made: list[str] = []

    @ledger.tool(tell_model=True, key=("title",))
    def create_ticket(title: str, body: str) -> str:
        made.append(body)
        return "ticket 1"

    assert create_ticket.using(key="t-1")("toner", "a") == "ticket 1"
    assert NOT_REPEATED in create_ticket.using(key="t-1")("toner", "a")
    conflict = create_ticket.using(key="t-1")("toner", "b")  # the same key, other details
    assert isinstance(conflict, str) and "other details" in conflict
    assert made == ["a"]
    with pytest.raises(KeyConflict):
        create_ticket.using(key="t-1").outcome("toner", "b")


def test_an_async_tool_returns_the_text_and_stays_a_coroutine_function(ledger: Ledger) -> None:
    made: list[str] = []

    @ledger.tool(tell_model=True)
    async def create_ticket(title: str) -> str:
        made.append(title)
        raise TimeoutError("no answer")

    @ledger.tool(tell_model=True)
    async def send(to: str) -> str:
        return f"sent to {to}"

    assert inspect.iscoroutinefunction(create_ticket)
    assert inspect.signature(create_ticket) == inspect.signature(create_ticket.spec.fn)

    async def run() -> tuple[Any, ...]:
        unknown = await create_ticket("toner")
        chosen = await create_ticket.using(key="t-1")("toner")
        return unknown, chosen, await send("a"), await send("a")

    unknown, chosen, fresh, replay = asyncio.run(run())
    assert unknown.startswith(UNKNOWN) and chosen.startswith(UNKNOWN)
    assert fresh == "sent to a" and NOT_REPEATED in replay


def test_in_progress_elsewhere_is_told_not_raised(ledger: Ledger) -> None:
    """A call that finds the operation running in another call is told so, and does not run it."""
    started, release = threading.Event(), threading.Event()
    runs: list[str] = []

    @ledger.tool(tell_model=True, wait=0)
    def create_ticket(title: str) -> str:
        runs.append(title)
        started.set()
        release.wait(10)
        return "ticket 1"

    first: list[Any] = []
    worker = threading.Thread(target=lambda: first.append(create_ticket("toner")))
    worker.start()
    assert started.wait(10)
    try:
        out = create_ticket("toner")
    finally:
        release.set()
        worker.join(10)
    assert out == tell_model(InProgress("x", key="k"))
    assert first == ["ticket 1"] and runs == ["toner"]
