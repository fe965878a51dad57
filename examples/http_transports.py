"""onceonly.http's transports and adapter, runnable: clients you do not own carry the ledger's key.

Against the reference ticket service, started in process, which loses the answer of the first
request of each step after committing its ticket (the network heals while the client backs off):

1. an httpx client built on ``onceonly.http.Transport()`` (what an SDK's ``http_client=`` takes),
   inside a guarded tool: the lost answer is sent again under the ledger's key and replayed;
2. the openai SDK on ``httpx2.Client(transport=Transport())``, the same (skipped without openai);
3. a ``requests.Session`` with ``RequestsAdapter`` mounted and ``hash_keys=True``: the service sees a
   hash of the key, never the scope or the tool's name in it;
4. a server that answers 409 to a key it has seen, instead of replaying: with
   ``conflict_means="exists"`` and a lookup the call is confirmed with the existing ticket.

One ticket per operation throughout. Run it:

    python examples/http_transports.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import httpx
import requests
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import onceonly
from onceonly.http import RequestsAdapter, Transport, hash_key, is_replayed
from onceonly.tickets import FaultInjector, FaultMiddleware, Faults, serve_in_thread


def used_key_server(made: list[dict[str, Any]]) -> Starlette:
    """A ticket API that answers 409 to a key it has seen (it keeps no response to replay), and
    finds a ticket by its key: ``GET /tickets/by-idempotency-key/{key}``."""
    by_key: dict[str, dict[str, Any]] = {}

    async def create(request: Request) -> JSONResponse:
        key = request.headers["idempotency-key"]
        if key in by_key:
            return JSONResponse({"error": "this idempotency key was used already"}, status_code=409)
        ticket = by_key[key] = {"id": len(made) + 1, **(await request.json())}
        made.append(ticket)
        return JSONResponse(ticket, status_code=201)

    async def find(request: Request) -> JSONResponse:
        found = by_key.get(request.path_params["key"])
        return JSONResponse(found) if found else JSONResponse({"error": "not found"}, status_code=404)

    return Starlette(
        routes=[Route("/tickets", create, methods=["POST"]), Route("/tickets/by-idempotency-key/{key}", find)]
    )


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, serve_in_thread(db_path=Path(tmp) / "tickets.db") as service:
        faults = service.app.state.faults

        def lose_next_answer() -> None:
            faults.configure(Faults(lost=1.0))

        def heal(_seconds: float) -> None:  # the network heals while the client backs off
            faults.configure(Faults())

        ledger = onceonly.Ledger.open(f"sqlite:///{Path(tmp) / 'ledger.db'}", scope="acme.thread-7")
        ticket = {"session_id": "s-1", "body": "on floor 2"}

        # 1. Any httpx client: the transport adds the ledger's key and re-sends under it.
        http = httpx.Client(base_url=service.url, transport=Transport(sleep=heal))

        @ledger.tool(key=("title",))
        def create_ticket(title: str) -> dict[str, Any]:
            response = http.post("/tickets", json={**ticket, "title": title})
            response.raise_for_status()
            print("1. httpx: replayed after the lost answer:", is_replayed(response))
            return dict(response.json())

        lose_next_answer()
        create_ticket("printer broken")
        http.close()

        # 2. An SDK that takes an http_client: the openai SDK, on httpx2.
        try:
            import httpx2
            import openai
        except ImportError:
            print("2. openai: not installed, skipped")
        else:
            sdk = openai.OpenAI(
                base_url=service.url, api_key="sk-none", http_client=httpx2.Client(transport=Transport(sleep=heal))
            )

            @ledger.tool(key=("title",))
            def sdk_ticket(title: str) -> dict[str, Any]:
                return dict(sdk.post("/tickets", body={**ticket, "title": title}, cast_to=dict))

            lose_next_answer()
            print("2. openai: ticket", sdk_ticket("projector dead")["id"])
            sdk.close()

        # 3. requests, and a hash of the key on the wire: the scope and the tool's name stay here.
        session = requests.Session()
        session.mount("http://", RequestsAdapter(sleep=heal, hash_keys=True))

        @ledger.tool(key=("title",))
        def requests_ticket(title: str) -> dict[str, Any]:
            response = session.post(f"{service.url}/tickets", json={**ticket, "title": title})
            response.raise_for_status()
            sent = response.request.headers["Idempotency-Key"]
            print("3. requests: the key sent is its hash:", sent == hash_key(requests_ticket.key_for(title)))
            print("   it names neither the scope nor the tool:", "acme" not in sent and "requests_ticket" not in sent)
            return dict(response.json())

        lose_next_answer()
        requests_ticket("coffee machine")
        session.close()
        print("tickets in the service:", service.app.state.db.count())

        # 4. A server whose 409 means "this key was used already": look the ticket up instead.
        made: list[dict[str, Any]] = []
        injector = FaultInjector(Faults(lost=1.0))  # the first answer is lost after the commit
        with serve_in_thread(FaultMiddleware(used_key_server(made), injector)) as api:
            transport = Transport(
                conflict_means="exists",
                lookup="/tickets/by-idempotency-key/{key}",
                sleep=lambda _s: injector.configure(Faults()),
            )
            with httpx.Client(base_url=api.url, transport=transport) as client:

                @ledger.tool(key=("title",))
                def used_key_ticket(title: str) -> dict[str, Any]:
                    response = client.post("/tickets", json={**ticket, "title": title})
                    response.raise_for_status()
                    return dict(response.json())

                outcome = used_key_ticket.outcome("lift stuck")
                print("4. 409 'used already': confirmed with the existing ticket:", outcome.result == made[0])
                print("   the ledger's record:", outcome.state.value)
                print("   tickets made:", len(made))
        ledger.close()


if __name__ == "__main__":
    main()
