"""The HTTP client, runnable: one key per operation, on every retry, inside and outside a guarded tool.

A small payments API behind ``IdempotencyMiddleware`` (store mode, a SQLite file in a temporary
directory) counts what it really does. Against it:

1. a guarded tool that makes two requests, a refund and a note: they go with the ledger's key and
   ``key#2``; the refund's first answer comes too late (the client's read timeout), the client sends
   it again with the same key and the server replays it. Called again, the tool is replayed by the
   ledger: nothing is sent;
2. outside a tool, a key given in the ``Idempotency-Key`` header (Stripe's habit) is the call's key:
   sent twice, one refund.

Run it:

    python examples/http_client.py
"""

from __future__ import annotations

import asyncio
import tempfile
from collections import Counter
from pathlib import Path

from fastapi import FastAPI, Request

import onceonly
from onceonly.http import Client, is_replayed
from onceonly.server import IdempotencyMiddleware
from onceonly.tickets import serve_in_thread  # uvicorn on 127.0.0.1 in a thread, for the example


def create_api(store_url: str, done: Counter[str], keys: list[str]) -> FastAPI:
    """``POST /refunds`` (slow the first time: its answer comes too late) and ``POST /notes``."""
    api = FastAPI()
    api.add_middleware(IdempotencyMiddleware, store=store_url)

    @api.post("/refunds", status_code=201)
    async def refund(request: Request) -> dict[str, object]:
        keys.append(request.headers["idempotency-key"])
        done["refunds"] += 1
        if done["refunds"] == 1:
            await asyncio.sleep(1.0)  # the work is done; the answer is late
        return {"refund": done["refunds"], **(await request.json())}

    @api.post("/notes", status_code=201)
    async def note(request: Request) -> dict[str, object]:
        keys.append(request.headers["idempotency-key"])
        done["notes"] += 1
        return {"note": done["notes"]}

    return api


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        done: Counter[str] = Counter()
        keys: list[str] = []
        api = create_api(f"sqlite:///{Path(tmp) / 'api-keys.db'}", done, keys)
        ledger = onceonly.Ledger.open(f"sqlite:///{Path(tmp) / 'ledger.db'}")
        with serve_in_thread(api) as server, Client(server.url, timeout=0.5) as client:

            @ledger.tool(key=("order",))
            def refund_and_note(order: str) -> dict[str, object]:
                refunded = client.post("/refunds", json={"order": order})  # <key>
                print("refund answered by a replay of the first run:", is_replayed(refunded))
                client.post("/notes", json={"order": order, "text": "refunded"})  # <key>#2
                return dict(refunded.json())

            print("tool:", refund_and_note("o-1"))
            print("called again, replayed by the ledger:", refund_and_note.outcome("o-1").replayed)

            # Outside a tool: the caller's own header is the key, on both calls.
            for _ in range(2):
                client.post("/refunds", json={"order": "o-42"}, headers={"Idempotency-Key": "order-42"})
            key = refund_and_note.key_for("o-1")
            print("handler runs, by key:", [k.replace(key, "<key>") for k in keys])
            print(f"refunds made: {done['refunds']}, notes made: {done['notes']}")
        ledger.close()


if __name__ == "__main__":
    main()
