"""async def tools: the same plan, driven by the async driver, on every store."""

from __future__ import annotations

import asyncio
import inspect
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

        assert inspect.iscoroutinefunction(acreate)
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
        started, finished = asyncio.Event(), asyncio.Event()

        @ledger.tool(name="acancel")
        async def acancel() -> str:
            started.set()
            await asyncio.sleep(0.2)
            finished.set()
            return "done"

        caller = asyncio.ensure_future(acancel())
        await asyncio.wait_for(started.wait(), 10)  # cancelled while the tool runs (not while it is claimed)
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


def test_tool_whose_own_task_is_cancelled_is_unknown(store_url: str) -> None:
    """A tool whose task is cancelled after its side effect (not its caller: the tool itself) may have
    done it: the outcome is unknown, parked for review, and a second call does not run it again."""

    async def main() -> None:
        ledger = Ledger.open(store_url)
        runs: list[int] = []

        @ledger.tool(name="acancelled")
        async def acancelled(n: int) -> int:
            runs.append(n)
            task = asyncio.current_task()
            assert task is not None
            task.cancel()
            await asyncio.sleep(1)
            return n

        for _ in range(2):
            with pytest.raises(OutcomeUnknown) as info:
                await acancelled(1)
            assert info.value.state == "needs_review"
        assert runs == [1]
        rec = ledger.get(acancelled.key_for(1))
        assert rec is not None and [h["to"] for h in rec.history] == ["in_flight", "unknown", "needs_review"]
        ledger.close()

    asyncio.run(main())


def test_tool_task_cancelled_before_dispatch_is_retried(store_url: str) -> None:
    """Cancelled before it reported its dispatch (mark_sent), a tool has sent nothing: the attempt is
    retried, not settled as unknown, and the side effect happens once."""

    async def main() -> None:
        ledger = Ledger.open(store_url)
        sent: list[int] = []
        tries: list[int] = []

        @ledger.tool(name="aearly", reports_dispatch=True, retry=onceonly.Retry(base=0.01))
        async def aearly(n: int) -> int:
            tries.append(n)
            if len(tries) == 1:
                task = asyncio.current_task()
                assert task is not None
                task.cancel()
                await asyncio.sleep(1)
            await onceonly.amark_sent()
            sent.append(n)
            return n

        out = await aearly.outcome(1)
        assert (out.result, out.attempts, out.replayed) == (1, 2, False)
        assert (tries, sent) == ([1, 1], [1])
        ledger.close()

    asyncio.run(main())


def test_task_group_timeout_is_unknown(store_url: str) -> None:
    """An asyncio.TaskGroup whose sub-request timed out after it was sent raises an ExceptionGroup
    holding a TimeoutError: unknown, like the TimeoutError alone, so the tool is not run again."""

    async def main() -> None:
        ledger = Ledger.open(store_url)
        sent: list[int] = []

        async def post(n: int) -> None:
            sent.append(n)  # it arrived...
            raise TimeoutError("read timeout")  # ...and its answer was lost

        @ledger.tool(name="anotify")
        async def anotify(n: int) -> str:
            async with asyncio.TaskGroup() as group:
                group.create_task(post(n))
            return "ok"

        for _ in range(2):
            with pytest.raises(OutcomeUnknown):
                await anotify(1)
        assert sent == [1]
        rec = ledger.get(anotify.key_for(1))
        assert rec is not None and rec.state is State.NEEDS_REVIEW
        assert "TimeoutError" in rec.history[1]["reason"]
        ledger.close()

    asyncio.run(main())
