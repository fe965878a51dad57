"""IdempotencyMiddleware in store mode when things go wrong around a request that ran: the client
leaves mid-response, the server's send raises (ASGI 2.4), the store loses an answer or fails once.
In each case the handler ran once, so its response must be stored and the retry must replay it."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from onceonly import State
from onceonly.server import IdempotencyMiddleware, client_hash, store_key
from onceonly.server._http import Message
from onceonly.stores import open_store
from tests._settling import Fault, FlakyStore

from .conftest import CLIENT_SECRET, Served, asgi_call, make_app

K = {"Idempotency-Key": "key-1"}
KEY = store_key("http", client_hash("", CLIENT_SECRET), "key-1")


def _retry_until_settled(s: Served, path: str) -> httpx.Response:
    """Retry ``path`` with key-1 while the first request still holds it (409)."""
    with s.client() as c:
        for _ in range(100):
            response = c.post(path, headers=K)
            if response.status_code != 409:
                return response
            time.sleep(0.05)
    raise AssertionError(f"{path} still answers 409")


def test_client_leaving_mid_stream_still_stores_the_response(serve: Any) -> None:
    """A client that reads one chunk of a streamed response and hangs up does not stop the handler:
    the stream runs to its end, is stored, and the retry replays it instead of running again."""
    s = serve()
    with s.client() as c, c.stream("POST", "/slowstream", headers=K) as first:
        for _ in first.iter_bytes():
            break  # leaving the block closes the connection mid-stream
    again = _retry_until_settled(s, "/slowstream")
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == b"c0;c1;c2;c3;c4;c5;"
    assert s.runs["slowstream"] == 1


def _spec24_app(runs: Counter[str]) -> Starlette:
    """The suite's app (its /slowstream streams for 0.3 s) and a /pay that answers after 0.1 s."""

    async def pay(request: Request) -> Response:
        runs["pay"] += 1
        await asyncio.sleep(0.1)  # the client leaves meanwhile
        return JSONResponse({"paid": runs["pay"]}, status_code=201)

    app = make_app(runs, threading.Event(), threading.Event())
    app.router.routes.append(Route("/pay", pay, methods=["POST"]))
    return app


class _ClientGone(OSError):
    pass


async def _spec24_request(app: Any, path: str, leave_after: float | None) -> list[Message]:
    """One request as an ASGI 2.4 server makes it: once the client has left, ``send`` raises an
    OSError and ``receive`` answers ``http.disconnect``."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
        "query_string": b"", "headers": [(b"host", b"t"), (b"idempotency-key", b"key-1")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }  # fmt: skip
    gone = asyncio.Event()
    if leave_after is not None:
        asyncio.get_running_loop().call_later(leave_after, gone.set)
    body_sent = False
    got: list[Message] = []

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if gone.is_set():
            raise _ClientGone("the client closed the connection")
        got.append(message)

    await app(scope, receive, send)
    return got


@pytest.mark.parametrize(("path", "leave_after"), [("/pay", 0.02), ("/slowstream", 0.08)])
def test_send_raising_oserror_still_stores_the_response(store_url: str, path: str, leave_after: float) -> None:
    """Under ASGI 2.4 a send to a client that left raises OSError: the middleware stops forwarding
    without raising into the app, which finishes; its response is stored and the retry replays it."""
    runs: Counter[str] = Counter()
    app = IdempotencyMiddleware(_spec24_app(runs), store=store_url)

    async def scenario() -> list[Message]:
        try:
            await _spec24_request(app, path, leave_after)  # the app is not told: no exception reaches here
            return await _spec24_request(app, path, None)
        finally:
            await app.aclose()

    start, body = asyncio.run(scenario())
    assert start["status"] == 201
    assert (b"idempotent-replayed", b"true") in start["headers"]
    assert runs[path.strip("/")] == 1
    assert body["body"] in (b'{"paid":1}', b"c0;c1;c2;c3;c4;c5;")


def test_send_raising_oserror_stops_a_stream_that_will_not_be_stored(store_url: str) -> None:
    """Under ASGI 2.4 an endless stream whose client left stops once it passes max_stored_body (it will
    not be stored, so no one reads it): the app hears the OSError, the key is released and a retry runs
    again instead of answering 409 while the stream runs on."""
    runs: Counter[str] = Counter()

    async def endless(request: Request) -> Response:
        runs["endless"] += 1

        async def rows() -> Any:
            while True:
                yield b"x" * 100
                await asyncio.sleep(0.005)

        return StreamingResponse(rows(), media_type="text/plain")

    store = open_store(store_url)
    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/endless", endless, methods=["POST"])]),
        store=store,
        max_stored_body=2000,
        client_secret=CLIENT_SECRET,
    )

    async def scenario() -> None:
        with pytest.raises(ClientDisconnect):  # Starlette's answer to the OSError; the key is released first
            await asyncio.wait_for(_spec24_request(app, "/endless", 0.02), 5.0)

    try:
        asyncio.run(scenario())
        assert store.get(KEY) is None
    finally:
        store.close()
    assert runs["endless"] == 1


def _flaky_app(runs: Counter[str], *, seconds: float) -> Starlette:
    async def pay(request: Request) -> Response:
        runs["pay"] += 1
        await asyncio.sleep(seconds)
        return JSONResponse({"paid": runs["pay"]}, status_code=int(request.query_params.get("status", "201")))

    return Starlette(routes=[Route("/pay", pay, methods=["POST"])])


def _run_twice(
    store: FlakyStore, runs: Counter[str], *, seconds: float, status: int = 201, pause: float = 0.8
) -> list[httpx.Response]:
    """Two requests with key-1 through the middleware on ``store``, the second ``pause`` s after the first
    (by default past its lease: an unstored claim would run again then)."""
    app = IdempotencyMiddleware(
        _flaky_app(runs, seconds=seconds),
        store=store,
        processing_timeout=0.6,
        store_calls="thread",
        client_secret=CLIENT_SECRET,
    )

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            first = await c.post(f"/pay?status={status}", headers=K)
            await asyncio.sleep(pause)
            return [first, await c.post(f"/pay?status={status}", headers=K)]

    return asyncio.run(scenario())


@pytest.mark.parametrize(
    "fault",
    [
        pytest.param(Fault("swap", frm=State.IN_FLIGHT, to=State.IN_FLIGHT, lands=True), id="renewal-answer-lost"),
        pytest.param(Fault("swap", frm=State.IN_FLIGHT, to=State.IN_FLIGHT), id="renewal-refused"),
        pytest.param(Fault("swap", frm=State.IN_FLIGHT, to=State.CONFIRMED), id="completion-refused-once"),
        pytest.param(Fault("swap", frm=State.IN_FLIGHT, to=State.CONFIRMED, lands=True), id="completion-answer-lost"),
        pytest.param(
            Fault("swap", frm=State.IN_FLIGHT, to=State.CONFIRMED, then=Fault("get")), id="completion-and-read-fail"
        ),
    ],
)
def test_one_store_failure_does_not_lose_the_response(store_url: str, fault: Fault) -> None:
    """One failed store write while the request runs (a renewal whose answer was lost, a completion
    refused once) is re-read and retried: the response is stored and the retry replays it."""
    store = FlakyStore(open_store(store_url), fault)
    runs: Counter[str] = Counter()
    try:
        first, again = _run_twice(store, runs, seconds=0.45)  # longer than a third of the lease: renewals
        assert store.raised[:1] == ["swap"]
        rec = store.get(KEY)
        assert rec is not None and rec.state is State.CONFIRMED
    finally:
        store.close()
    assert first.status_code == again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.json() == first.json() == {"paid": 1}
    assert runs["pay"] == 1


def test_release_after_a_lost_renewal_answer_frees_the_key(store_url: str) -> None:
    """A 5xx after a renewal whose answer was lost still releases the key at once (the version that
    is there), so the retry runs without waiting for the claim to go stale."""
    store = FlakyStore(open_store(store_url), Fault("swap", frm=State.IN_FLIGHT, to=State.IN_FLIGHT, lands=True))
    runs: Counter[str] = Counter()
    try:
        first, again = _run_twice(store, runs, seconds=0.45, status=503, pause=0.0)
        assert store.raised == ["swap"]
        assert store.get(KEY) is None
    finally:
        store.close()
    assert first.status_code == again.status_code == 503
    assert runs["pay"] == 2


def test_completion_that_landed_unseen_is_not_reported_as_taken_over(
    store_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A completion that landed but whose answer and re-read were both lost is refused on the retry by
    that very record: the response is stored, and no "may have run twice" warning is logged."""
    fault = Fault("swap", frm=State.IN_FLIGHT, to=State.CONFIRMED, lands=True, then=Fault("get"))
    store = FlakyStore(open_store(store_url), fault)
    runs: Counter[str] = Counter()
    try:
        with caplog.at_level(logging.WARNING, logger="onceonly.server"):
            first, again = _run_twice(store, runs, seconds=0.05)
        assert store.raised == ["swap", "get"]
        rec = store.get(KEY)
        assert rec is not None and rec.state is State.CONFIRMED
    finally:
        store.close()
    assert [r.getMessage() for r in caplog.records if r.name == "onceonly.server"] == []
    assert first.status_code == again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert runs["pay"] == 1


def test_body_before_response_start_stores_nothing_and_releases_the_key(store_url: str) -> None:
    """An app that sends its body before ``http.response.start`` breaks the ASGI protocol: nothing is
    stored (no "status 0" response replayed for the ttl), the key is released, and every try gets
    the server's 500 and runs again instead of a broken replay."""
    from onceonly.tickets import serve_in_thread

    runs: list[int] = []

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        runs.append(1)
        await send({"type": "http.response.body", "body": b"too early"})

    store = open_store(store_url)
    try:
        with (
            serve_in_thread(IdempotencyMiddleware(broken, store=store, client_secret=CLIENT_SECRET)) as server,
            httpx.Client(base_url=server.url, timeout=10) as c,
        ):
            first = c.post("/o", headers=K)
            assert store.get(KEY) is None
            again = c.post("/o", headers=K)
    finally:
        store.close()
    assert first.status_code == again.status_code == 500
    assert "idempotent-replayed" not in again.headers
    assert runs == [1, 1]


@pytest.mark.parametrize(
    "messages",
    [
        pytest.param([{"type": "http.response.start", "status": 0}], id="status-0"),
        pytest.param([{"type": "http.response.start", "status": "201"}], id="status-text"),
        pytest.param(
            [{"type": "http.response.start", "status": 201}, {"type": "http.response.start", "status": 200}],
            id="two-starts",
        ),
    ],
)
def test_response_no_server_can_send_is_not_stored(sqlite_url: str, messages: list[Message]) -> None:
    """A start with a status that is no HTTP status, or a second start, is a protocol error too: the
    application gets an error, the key is released, nothing is stored."""
    runs: list[int] = []

    async def broken(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        runs.append(1)
        for message in messages:
            await send(message)
        await send({"type": "http.response.body", "body": b"x"})

    store = open_store(sqlite_url)
    middleware = IdempotencyMiddleware(broken, store=store, client_secret=CLIENT_SECRET)
    try:
        with pytest.raises(RuntimeError, match="ASGI protocol error"):
            asyncio.run(asgi_call(middleware, "POST", "/o", ((b"idempotency-key", b"key-1"),)))
        assert store.get(KEY) is None
    finally:
        store.close()
    assert runs == [1]


_HOLD_LOCK = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
"""


def test_sqlite_file_locked_by_another_process_does_not_block_the_event_loop(sqlite_url: str) -> None:
    """While another process holds the SQLite file's write lock, a keyed POST waits for it off the event
    loop: a keyless GET meanwhile is answered at once, and the POST runs (once) when the lock goes."""
    store_path = sqlite_url.removeprefix("sqlite:///")
    runs: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        runs.append(scope["method"])
        await send({"type": "http.response.start", "status": 201 if scope["method"] == "POST" else 200})
        await send({"type": "http.response.body", "body": b"ok"})

    middleware = IdempotencyMiddleware(app, store=sqlite_url + "?timeout=10")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, store_path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdin is not None and holder.stdout is not None

    async def scenario() -> tuple[int, int, list[str], bool]:
        try:
            taken = asyncio.Event()
            post = asyncio.ensure_future(
                asgi_call(middleware, "POST", "/o", ((b"idempotency-key", b"key-1"),), b"x", body_taken=taken)
            )
            await asyncio.wait_for(taken.wait(), 60)  # the POST now claims its key: the file is locked
            got, _, _ = await asyncio.wait_for(asgi_call(middleware, "GET", "/health"), 60)
            post_waited = not post.done()
            seen = list(runs)
            holder.stdin.write("\n")  # let the lock go
            holder.stdin.flush()
            posted, _, _ = await asyncio.wait_for(post, 60)
            return got, posted, seen, post_waited
        finally:
            await middleware.aclose()

    try:
        assert holder.stdout.readline().strip() == "locked"
        got, posted, seen, post_waited = asyncio.run(scenario())
    finally:
        holder.stdin.close()
        holder.stdout.close()
        holder.wait(30)
    assert got == 200 and seen == ["GET"]  # answered while the POST was still waiting for the lock
    assert post_waited
    assert posted == 201 and runs == ["GET", "POST"]
