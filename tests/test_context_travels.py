"""The scope of ``ledger.task()`` and the current call follow work into threads that copy the context
(``asyncio.to_thread``, ``contextvars.copy_context().run``), and are lost where nothing copies it
(``loop.run_in_executor``, a bare ``ThreadPoolExecutor.submit``): the cases docs/integrations.md states."""

from __future__ import annotations

import asyncio
import contextvars
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import onceonly
from onceonly import Ledger


def tools(ledger: Ledger) -> tuple[Any, list[str]]:
    scopes: list[str] = []

    @ledger.tool()
    def create_ticket(title: str) -> str:
        call = onceonly.current_call()
        assert call is not None
        scopes.append(call.scope)
        return f"ticket {len(scopes)}"

    return create_ticket, scopes


def test_asyncio_to_thread_carries_the_tasks_scope(ledger: Ledger) -> None:
    """Two conversations, each offloading the same sync call with asyncio.to_thread: two tickets."""
    create_ticket, scopes = tools(ledger)

    async def conversation(name: str) -> str:
        with ledger.task(name):
            return await asyncio.to_thread(create_ticket, "toner")

    async def both() -> list[str]:
        return list(await asyncio.gather(conversation("conv-a"), conversation("conv-b")))

    assert sorted(asyncio.run(both())) == ["ticket 1", "ticket 2"]
    assert sorted(scopes) == ["conv-a", "conv-b"]


def test_run_in_executor_drops_the_scope_and_copy_context_keeps_it(ledger: Ledger) -> None:
    """loop.run_in_executor copies nothing (AutoGen's sync tools run so: onceonly.autogen is the fix);
    passing ``contextvars.copy_context().run`` as the function carries the caller's context."""
    create_ticket, scopes = tools(ledger)

    async def offload(name: str, carry: bool) -> None:
        loop = asyncio.get_running_loop()
        with ledger.task(name):
            if carry:
                await loop.run_in_executor(None, contextvars.copy_context().run, create_ticket, "toner")
            else:
                await loop.run_in_executor(None, create_ticket, "toner")

    asyncio.run(offload("conv-a", carry=False))
    asyncio.run(offload("conv-b", carry=True))
    asyncio.run(offload("conv-c", carry=True))
    assert scopes == [ledger.scope, "conv-b", "conv-c"]


def test_the_current_call_reaches_a_thread_the_tool_starts_with_the_context(ledger: Ledger) -> None:
    """A tool that sends its request from a worker thread: with the context copied, the worker sees
    the call's key (what onceonly.http sends as Idempotency-Key); without, it sees no call."""
    seen: dict[str, Any] = {}

    @ledger.tool()
    def create_ticket(title: str) -> str:
        def send() -> str | None:
            call = onceonly.current_call()
            return None if call is None else call.key

        with ThreadPoolExecutor(1) as pool:
            seen["copied"] = pool.submit(contextvars.copy_context().run, send).result()
            seen["bare"] = pool.submit(send).result()
        return "ticket 1"

    with ledger.task("conv-a"):
        create_ticket("toner")
        key = create_ticket.key_for("toner")
    assert seen == {"copied": key, "bare": None}
    assert key.startswith("conv-a:")


def test_an_async_tool_offloading_its_work_keeps_its_call(ledger: Ledger) -> None:
    keys: list[str | None] = []

    @ledger.tool()
    async def create_ticket(title: str) -> str:
        def send() -> None:
            call = onceonly.current_call()
            keys.append(None if call is None else call.key)

        await asyncio.to_thread(send)
        return "ticket 1"

    async def run() -> str:
        with ledger.task("conv-a"):
            await create_ticket("toner")
            return create_ticket.key_for("toner")

    key = asyncio.run(run())
    assert keys == [key]
