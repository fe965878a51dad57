"""A small ASGI app that counts what its handlers ran, served by uvicorn on 127.0.0.1 behind the
idempotency middleware, on each store (the ``store_url`` fixture of tests/conftest.py)."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from onceonly.server import IdempotencyMiddleware
from onceonly.stores import Store, open_store
from onceonly.tickets import RunningServer, serve_in_thread

#: The client secret the suite's servers hash client identities with, so that tests can name keys.
CLIENT_SECRET = b"test-client-secret-0123456789abc"


@dataclass
class Served:
    """A running server: its URL, the handler run counts, the store, the gate of /slow."""

    url: str
    runs: Counter[str]
    store: Store
    gate: threading.Event
    entered: threading.Event
    server: RunningServer

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10.0, **kwargs)


def make_app(runs: Counter[str], gate: threading.Event, entered: threading.Event) -> Starlette:
    """Handlers that count their runs: the side effects the middleware must not repeat."""

    async def echo(request: Request) -> Response:
        runs["echo"] += 1
        body = await request.body()
        return JSONResponse(
            {"run": runs["echo"], "body": body.decode(), "query": request.url.query, "method": request.method},
            status_code=201,
            headers={"location": f"/things/{runs['echo']}", "x-secret": "not-replayed", "set-cookie": "s=1"},
        )

    async def slow(request: Request) -> Response:
        runs["slow"] += 1
        entered.set()
        await asyncio.to_thread(gate.wait, 10)
        return JSONResponse({"run": runs["slow"]})

    async def boom(request: Request) -> Response:
        runs["boom"] += 1
        raise RuntimeError("the handler failed")

    async def status(request: Request) -> Response:
        runs["status"] += 1
        return JSONResponse({"run": runs["status"]}, status_code=int(request.path_params["code"]))

    async def big(request: Request) -> Response:
        runs["big"] += 1
        size = int(request.query_params.get("size", "100"))
        return Response(b"x" * size, media_type="application/octet-stream")

    async def stream(request: Request) -> Response:
        runs["stream"] += 1

        async def chunks() -> Any:
            for i in range(4):
                yield f"chunk{i}-{runs['stream']};".encode()

        return StreamingResponse(chunks(), media_type="text/plain")

    async def slowstream(request: Request) -> Response:
        runs["slowstream"] += 1

        async def chunks() -> Any:
            for i in range(6):
                yield f"c{i};".encode()
                await asyncio.sleep(0.05)

        return StreamingResponse(chunks(), status_code=201, media_type="text/plain")

    async def binary(request: Request) -> Response:
        runs["binary"] += 1
        return Response(bytes(range(256)) + bytes([runs["binary"]]), media_type="application/octet-stream")

    async def nothing(request: Request) -> Response:
        runs["get"] += 1
        return JSONResponse({"run": runs["get"]})

    return Starlette(
        routes=[
            Route("/echo", echo, methods=["POST", "PATCH", "PUT"]),
            Route("/echo", nothing, methods=["GET"]),
            Route("/slow", slow, methods=["POST"]),
            Route("/boom", boom, methods=["POST"]),
            Route("/status/{code:int}", status, methods=["POST"]),
            Route("/big", big, methods=["POST"]),
            Route("/stream", stream, methods=["POST"]),
            Route("/slowstream", slowstream, methods=["POST"]),
            Route("/binary", binary, methods=["POST"]),
        ]
    )


@pytest.fixture(name="serve")
def fixture_serve(store_url: str) -> Iterator[Callable[..., Served]]:
    """Start the counting app behind ``IdempotencyMiddleware(**kwargs)`` on the store of this run."""
    started: list[Served] = []
    stores: list[Store] = []

    def start(**kwargs: Any) -> Served:
        runs: Counter[str] = Counter()
        gate, entered = threading.Event(), threading.Event()
        store = open_store(store_url)
        stores.append(store)
        kwargs.setdefault("client_secret", CLIENT_SECRET)
        app = IdempotencyMiddleware(make_app(runs, gate, entered), store=store, **kwargs)
        server = serve_in_thread(app)
        served = Served(server.url, runs, store, gate, entered, server)
        started.append(served)
        return served

    yield start
    for served in started:
        served.gate.set()
        served.server.stop()
    for store in stores:
        store.close()


async def asgi_call(
    app: Any,
    method: str,
    path: str = "/",
    headers: tuple[tuple[bytes, bytes], ...] = (),
    body: bytes | list[bytes] = b"",
    *,
    body_taken: asyncio.Event | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """One HTTP request straight through an ASGI app, as a server would make it (the method as given,
    unchanged): its status, headers (lower-case names, the last of each) and body, which a list sends
    in chunks, as a chunked request arrives. ``body_taken`` is set once the app has read the body."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": list(headers),
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    chunks = body if isinstance(body, list) else [body]
    pending = [{"type": "http.request", "body": c, "more_body": True} for c in reversed(chunks or [b""])]
    pending[0]["more_body"] = False  # the last chunk, popped last
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if pending:
            if body_taken is not None:
                body_taken.set()
            return pending.pop()
        await asyncio.Event().wait()  # the client stays until the response is sent
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    got = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in start.get("headers", ())}
    return start["status"], got, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
