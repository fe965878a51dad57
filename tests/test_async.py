"""async def tools: the same plan, driven by the async driver, on every store."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import onceonly
from onceonly import NOT_FOUND, Ledger, OutcomeUnknown, State


def test_async_first_call_and_replay(store_url: str) -> None:
    """An async tool runs once, then replays; the key is injected."""

    async def main() -> None:
        ledger = Ledger.open(store_url)
        runs: list[str] = []

        @ledger.tool(name="acreate")
        async def acreate(title: str, *, idempotency_key: str) -> dict[str, Any]:
            await asyncio.sleep(0)
            runs.append(idempotency_key)
            return {"title": title}

        assert isinstance(acreate, onceonly.AsyncTool)
        first = await acreate.outcome("t")
        again = await acreate.outcome("t")
        assert first.result == again.result == {"title": "t"}
        assert (first.replayed, again.replayed) == (False, True)
        assert runs == [first.key]
        ledger.close()

    asyncio.run(main())


def test_async_single_flight(store_url: str) -> None:
    """Ten concurrent tasks for one operation: one run, ten equal results."""

    async def main() -> None:
        ledger = Ledger.open(store_url)
        runs: list[int] = []

        @ledger.tool(name="aslow", wait=10)
        async def aslow(n: int) -> int:
            runs.append(n)
            await asyncio.sleep(0.2)
            return n * 2

        outs = await asyncio.gather(*(aslow.outcome(21) for _ in range(10)))
        assert runs == [21]
        assert {o.result for o in outs} == {42}
        assert sum(not o.replayed for o in outs) == 1
        ledger.close()

    asyncio.run(main())


def test_async_probe_and_async_probe_function(store_url: str) -> None:
    """An async probe settles a lost answer; the tool is not run again."""

    async def main() -> None:
        ledger = Ledger.open(store_url)
        done: dict[str, int] = {}

        async def find(args: dict[str, Any], key: str) -> Any:
            return {"id": done[args["t"]]} if args["t"] in done else NOT_FOUND

        @ledger.tool(name="amake", on_unknown="probe", probe=find)
        async def amake(t: str) -> dict[str, int]:
            done[t] = 1
            raise ConnectionResetError("lost")

        out = await amake.outcome("x")
        assert out.result == {"id": 1} and out.via == "probe"
        ledger.close()

    asyncio.run(main())


def test_async_timeout_late_result_confirms(store_url: str) -> None:
    """Past timeout= the caller gets OutcomeUnknown; the task runs on and its result confirms the record."""

    async def main() -> None:
        ledger = Ledger.open(store_url)

        @ledger.tool(name="alate", timeout=0.05)
        async def alate() -> str:
            await asyncio.sleep(0.3)
            return "late"

        with pytest.raises(OutcomeUnknown):
            await alate()
        for _ in range(100):
            await asyncio.sleep(0.05)
            rec = ledger.get(alate.key_for())
            if rec is not None and rec.state is State.CONFIRMED:
                break
        assert rec is not None and rec.state is State.CONFIRMED and rec.result == "late"
        ledger.close()

    asyncio.run(main())


def test_cancelled_caller_does_not_lose_the_outcome(store_url: str) -> None:
    """Cancelling the caller does not cancel the tool: its result still lands in the ledger."""

    async def main() -> None:
        ledger = Ledger.open(store_url)
        finished = asyncio.Event()

        @ledger.tool(name="acancel")
        async def acancel() -> str:
            await asyncio.sleep(0.2)
            finished.set()
            return "done"

        caller = asyncio.ensure_future(acancel())
        await asyncio.sleep(0.05)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        await asyncio.wait_for(finished.wait(), 5)
        for _ in range(100):
            await asyncio.sleep(0.02)
            rec = ledger.get(acancel.key_for())
            if rec is not None and rec.state is State.CONFIRMED:
                break
        assert rec is not None and rec.state is State.CONFIRMED
        assert (await acancel.outcome()).replayed
        ledger.close()

    asyncio.run(main())


def test_async_mark_sent(store_url: str) -> None:
    """amark_sent moves a pending claim to in_flight from inside an async tool."""

    async def main() -> None:
        ledger = Ledger.open(store_url)
        seen: list[str] = []

        @ledger.tool(name="adispatch", reports_dispatch=True)
        async def adispatch() -> str:
            info = onceonly.current_call()
            assert info is not None
            seen.append(ledger.get(info.key).state.value)  # type: ignore[union-attr]
            await onceonly.amark_sent()
            seen.append(ledger.get(info.key).state.value)  # type: ignore[union-attr]
            return "ok"

        assert await adispatch() == "ok"
        assert seen == ["pending", "in_flight"]
        ledger.close()

    asyncio.run(main())
