"""Async tools, dispatch reporting, transition events, decode= and readonly=, runnable as is.

An async "send an email" tool reports when the message leaves (``amark_sent()``): its first attempt
fails while resolving the mail server, before anything was sent, so it is retried at once, without a
probe. A listener prints every transition the ledger records. The replayed result comes back through
``decode=`` as the caller's own type, and a ``readonly=True`` lookup skips the ledger. Run it:

    python examples/async_dispatch_events.py
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onceonly


@dataclass
class Receipt:
    message_id: str
    to: str


async def main() -> None:
    # The ledger is closed before the directory goes: the run leaves nothing behind.
    with (
        tempfile.TemporaryDirectory(prefix="onceonly-async-") as tmp,
        onceonly.Ledger.open(f"sqlite:///{Path(tmp) / 'ledger.db'}") as ledger,
    ):
        await run(ledger)


async def run(ledger: onceonly.Ledger) -> None:
    outbox: list[str] = []  # what really left: the side effect, counted
    lookups = 0

    def show(event: onceonly.TransitionEvent) -> None:
        print(f"  event: {event.from_state} -> {event.to_state} (attempt {event.attempt}, {event.reason})")

    ledger.subscribe(show)

    @ledger.tool(
        reports_dispatch=True,
        retry=onceonly.Retry(attempts=3, base=0.01),
        decode=lambda stored: Receipt(**stored),  # a replay returns the JSON that was recorded
    )
    async def send_email(to: str, body: str) -> Receipt:
        info = onceonly.current_call()  # this attempt: its key, fence (fencing token), attempt number
        assert info is not None
        if info.attempt == 1:
            raise TimeoutError("MX lookup timed out")  # before dispatch: nothing can have been sent
        await onceonly.amark_sent()  # pending -> in_flight: from here on, an error is unknown
        outbox.append(to)
        return Receipt(message_id=f"msg-{info.fence}", to=to)

    @ledger.tool(readonly=True)
    async def mailbox_exists(to: str) -> bool:
        nonlocal lookups
        lookups += 1
        return to.endswith("@example.com")

    print("first call:")
    assert await mailbox_exists("ada@example.com")
    receipt = await send_email("ada@example.com", "Your ticket is open")
    print(f"  -> {receipt}")
    print("the same call again (a retry, a re-plan, another process):")
    again: Any = await send_email.outcome("ada@example.com", "Your ticket is open")
    print(f"  -> {again.result}, replayed={again.replayed}")
    print(f"emails that left: {len(outbox)}; readonly lookups (not recorded): {lookups}")


if __name__ == "__main__":
    asyncio.run(main())
