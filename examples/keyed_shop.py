"""The server side, runnable: a shop whose orders and idempotency keys commit in one transaction.

``IdempotencyMiddleware(transactional=True)`` finds the key; the handler reads it with
``idempotency_context`` and records it on the order. Clients are told apart by an API-key header
(``client_identity=``), so two clients with the same key make two orders. After the requests, the
table is read from outside a request (``IdempotencyTable.get``) and cleaned (``purge(before=)``).
The database is in memory and the server runs in a thread: nothing is left behind. Run it:

    python examples/keyed_shop.py
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import MutableMapping
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response

from onceonly.server import IdempotencyMiddleware, IdempotencyTable, client_hash, idempotency_context, store_key
from onceonly.tickets import serve_in_thread  # uvicorn on 127.0.0.1 in a thread, for the example


def api_key(scope: MutableMapping[str, Any]) -> str:
    """Who is asking: the X-Api-Key header (the middleware keeps only its hash)."""
    return dict(scope["headers"]).get(b"x-api-key", b"").decode("latin-1")


def create_app(db: sqlite3.Connection, keys: IdempotencyTable) -> FastAPI:
    """The shop: ``POST /orders`` writes the order and its key's response in one transaction."""
    app = FastAPI()
    # The key of the client hash, kept in the shop's database: every server process agrees on it.
    secret = keys.client_secret(db)
    app.add_middleware(IdempotencyMiddleware, transactional=True, client_identity=api_key, client_secret=secret)

    @app.post("/orders", status_code=201)
    async def create_order(request: Request) -> Response:
        order = await request.json()
        ctx = idempotency_context(request)  # None only for a request the middleware let through
        assert ctx is not None
        db.execute("BEGIN IMMEDIATE")
        try:
            slot = keys.begin_request(db, ctx)  # a completed key raises Replay: the middleware answers
            cur = db.execute(
                "INSERT INTO orders (sku, client, idempotency_key) VALUES (?, ?, ?)",
                (order["sku"], ctx.client, ctx.key),
            )
            body = json.dumps({"id": cur.lastrowid, **order})
            slot.complete(201, body, {"content-type": "application/json"})
            db.execute("COMMIT")  # the order and its stored response, together
        except BaseException:
            db.execute("ROLLBACK")
            raise
        return Response(body, status_code=201, media_type="application/json")

    return app


def main() -> None:
    keys = IdempotencyTable()  # ttl 24 h
    db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    try:
        db.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, sku TEXT, client TEXT, idempotency_key TEXT)")
        keys.create(db)
        with serve_in_thread(create_app(db, keys)) as server, httpx.Client(base_url=server.url) as http:
            alice = {"X-Api-Key": "alice", "Idempotency-Key": "order-1"}
            first = http.post("/orders", json={"sku": "A1"}, headers=alice)
            again = http.post("/orders", json={"sku": "A1"}, headers=alice)
            bob = http.post("/orders", json={"sku": "A1"}, headers={"X-Api-Key": "bob", "Idempotency-Key": "order-1"})
        print(first.json(), again.headers["idempotent-replayed"], bob.json())
        # {'id': 1, 'sku': 'A1'} true {'id': 2, 'sku': 'A1'}: bob's "order-1" is another operation
        print(db.execute("SELECT id, idempotency_key FROM orders").fetchall())  # [(1, 'order-1'), (2, 'order-1')]

        # Outside a request: the stored response of alice's key, and the clean-up of expired rows.
        stored = keys.get(db, store_key("http", client_hash("alice", keys.client_secret(db)), "order-1"))
        assert stored is not None
        print(stored.status, stored.body)  # 201 b'{"id": 1, "sku": "A1"}'
        print(keys.purge(db))  # 0: nothing has expired (ttl 24 h)
        print(keys.purge(db, before=time.time() + 2 * 86400))  # 2: as if two days had passed
    finally:
        db.close()


if __name__ == "__main__":
    main()
