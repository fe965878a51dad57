"""IdempotencyMiddleware in store mode: every status rule, over a real uvicorn server on 127.0.0.1,
for each store. The counting app's ``runs`` is the side effect that must happen once."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

import onceonly
from onceonly import states as st
from onceonly.server import DEFAULT_PROBLEM_DOCS, client_hash, store_key
from onceonly.server._http import fingerprint_start
from onceonly.states import State

from .conftest import CLIENT_SECRET, Served, asgi_call

Serve = Callable[..., Served]
K = {"Idempotency-Key": "key-1"}


def _problem(response: httpx.Response, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    doc: dict[str, object] = response.json()
    assert doc["status"] == status
    assert str(doc["type"]).startswith("urn:onceonly:problem:")
    return doc


def _key_of(key: str, authorization: str = "") -> str:
    return store_key("http", client_hash(authorization, CLIENT_SECRET), key)


def test_missing_key_is_400(serve: Serve) -> None:
    """A POST without a key is refused with a problem document, and the handler never runs."""
    s = serve()
    with s.client() as c:
        doc = _problem(c.post("/echo", content=b"x"), 400)
    assert "Idempotency-Key" in str(doc["title"])
    assert s.runs["echo"] == 0


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("k" * 256, id="256-chars"),
        pytest.param("", id="empty"),
        pytest.param('""', id="empty-quoted"),
        pytest.param('"a b"', id="space-inside-quotes"),
        pytest.param('"abc', id="unterminated-quote"),
        pytest.param('"a\\x"', id="bad-escape"),
        pytest.param('"a"b"', id="inner-quote"),
        pytest.param("a\tb", id="tab-inside"),
        pytest.param(b"caf\xc3\xa9", id="non-ascii"),
    ],
)
def test_malformed_key_is_400(serve: Serve, value: str | bytes) -> None:
    """A key that is not 1-255 visible ASCII characters (after unquoting) is a 400, nothing runs."""
    s = serve()
    with s.client() as c:
        _problem(c.post("/echo", content=b"x", headers={"Idempotency-Key": value}), 400)
    assert s.runs["echo"] == 0


def test_two_differing_keys_are_400(serve: Serve) -> None:
    """Idempotency-Key and X-Idempotency-Key that disagree: the server cannot pick one."""
    s = serve()
    with s.client() as c:
        _problem(c.post("/echo", headers={"Idempotency-Key": "a", "X-Idempotency-Key": "b"}), 400)
    assert s.runs["echo"] == 0


def test_quoted_bare_and_x_header_are_one_key(serve: Serve) -> None:
    """The draft's sf-string, a bare token and X-Idempotency-Key name the same key; 255 chars is fine."""
    s = serve()
    long_key = "k" * 255
    with s.client() as c:
        first = c.post("/echo", content=b"x", headers={"Idempotency-Key": '"abc-1"'})
        again = c.post("/echo", content=b"x", headers={"Idempotency-Key": "abc-1"})
        third = c.post("/echo", content=b"x", headers={"X-Idempotency-Key": "abc-1"})
        escaped = c.post("/echo", content=b"y", headers={"Idempotency-Key": '"q\\"q"'})
        escaped_bare = c.post("/echo", content=b"y", headers={"Idempotency-Key": 'q"q'})
        longest = c.post("/echo", content=b"z", headers={"Idempotency-Key": long_key})
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true" and again.json() == first.json()
    assert third.headers["idempotent-replayed"] == "true"
    assert escaped_bare.headers["idempotent-replayed"] == "true" and escaped_bare.json() == escaped.json()
    assert longest.status_code == 201
    assert s.runs["echo"] == 3
    assert s.store.get(_key_of(long_key)) is not None  # long keys are hashed to fit the store


def test_replay_has_status_allowed_headers_and_body(serve: Serve) -> None:
    """A completed key answers its stored status, allow-listed headers and body, marked replayed."""
    s = serve()
    with s.client() as c:
        first = c.post("/echo?a=1", content=b"hello", headers=K)
        replay = c.post("/echo?a=1", content=b"hello", headers=K)
    assert first.status_code == replay.status_code == 201
    assert replay.content == first.content
    assert replay.headers["location"] == first.headers["location"] == "/things/1"
    assert replay.headers["content-type"] == "application/json"
    assert replay.headers["idempotent-replayed"] == "true"
    assert first.headers["x-secret"] == "not-replayed" and "x-secret" not in replay.headers
    assert "set-cookie" not in replay.headers
    assert s.runs["echo"] == 1
    rec = s.store.get(_key_of("key-1"))
    assert rec is not None and rec.state is State.CONFIRMED and rec.tool == "http"


def test_in_flight_is_409_with_retry_after(serve: Serve) -> None:
    """While the first request runs, the same key gets 409 and Retry-After; afterwards a replay."""
    s = serve(retry_after=2)

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=s.url, timeout=10) as c:
            first = asyncio.ensure_future(c.post("/slow", headers=K))
            await asyncio.to_thread(s.entered.wait, 5)
            second = await c.post("/slow", headers=K)
            s.gate.set()
            done = await first
            return done, second, await c.post("/slow", headers=K)

    done, second, third = asyncio.run(scenario())
    doc = _problem(second, 409)
    assert second.headers["retry-after"] == "2"
    assert doc["key"] == "key-1"
    assert done.status_code == 200 and third.headers["idempotent-replayed"] == "true"
    assert s.runs["slow"] == 1


@pytest.mark.parametrize(
    ("first", "second"),
    [
        pytest.param(("POST", "/echo", b"a"), ("POST", "/echo", b"b"), id="body"),
        pytest.param(("POST", "/echo?x=1", b"a"), ("POST", "/echo?x=2", b"a"), id="query"),
        pytest.param(("POST", "/status/200", b""), ("POST", "/status/201", b""), id="path"),
        pytest.param(("POST", "/echo", b"a"), ("PATCH", "/echo", b"a"), id="method"),
    ],
)
def test_other_fingerprint_is_422(serve: Serve, first: tuple[str, str, bytes], second: tuple[str, str, bytes]) -> None:
    """The same key with another method, path, query or body is refused with 422; nothing runs twice."""
    s = serve()
    with s.client() as c:
        ok = c.request(first[0], first[1], content=first[2], headers=K)
        refused = c.request(second[0], second[1], content=second[2], headers=K)
    assert ok.status_code < 300
    _problem(refused, 422)
    assert sum(s.runs.values()) == 1


def test_handler_exception_releases_the_key(serve: Serve) -> None:
    """A handler that raises leaves no claim: a retry with the same key runs again."""
    s = serve()
    for _ in range(2):
        # One connection each: after an exception uvicorn closes the connection it answered 500 on.
        with s.client() as c:
            assert c.post("/boom", headers=K).status_code == 500
    assert s.runs["boom"] == 2
    assert s.store.get(_key_of("key-1")) is None


@pytest.mark.parametrize("code", [500, 502, 503, 504, 429, 408])
def test_5xx_and_refusals_release_the_key(serve: Serve, code: int) -> None:
    """A 5xx (and 408/429: not executed) is passed on and released, so the retry runs again."""
    s = serve()
    with s.client() as c:
        first = c.post(f"/status/{code}", headers=K)
        second = c.post(f"/status/{code}", headers=K)
    assert first.status_code == second.status_code == code
    assert "idempotent-replayed" not in second.headers
    assert s.runs["status"] == 2


def test_4xx_is_stored_and_replayed(serve: Serve) -> None:
    """A 4xx is the handler's answer: stored and replayed like a success (Stripe does the same)."""
    s = serve()
    with s.client() as c:
        first = c.post("/status/404", headers=K)
        second = c.post("/status/404", headers=K)
    assert first.status_code == second.status_code == 404
    assert second.headers["idempotent-replayed"] == "true"
    assert s.runs["status"] == 1


def test_other_client_cannot_replay_the_response(serve: Serve) -> None:
    """The same key from another Authorization runs as its own operation: no access to the first
    client's response, and no 422 that would reveal the key is taken."""
    s = serve()
    with (
        s.client(headers={"Authorization": "Bearer alice"}) as alice,
        s.client(headers={"Authorization": "Bearer bob"}) as bob,
    ):
        a1 = alice.post("/echo", content=b"alice's secret", headers=K)
        b1 = bob.post("/echo", content=b"alice's secret", headers=K)
        b2 = bob.post("/echo", content=b"something else", headers=K)
        a2 = alice.post("/echo", content=b"alice's secret", headers=K)
    assert a1.json()["run"] == 1
    assert b1.status_code == 201 and "idempotent-replayed" not in b1.headers and b1.json()["run"] == 2
    _problem(b2, 422)  # bob's own key, bound to bob's own first request
    assert a2.json() == a1.json() and a2.headers["idempotent-replayed"] == "true"
    assert s.runs["echo"] == 2
    assert _key_of("key-1", "Bearer alice") != _key_of("key-1", "Bearer bob")
    assert s.store.get(_key_of("key-1", "Bearer alice")) is not None


def test_response_over_the_limit_is_passed_through_not_stored(serve: Serve) -> None:
    """A body above max_stored_body reaches the client whole, is not kept, and a retry runs again."""
    s = serve(max_stored_body=50)
    with s.client() as c:
        big1 = c.post("/big?size=100", headers=K)
        big2 = c.post("/big?size=100", headers=K)
        assert c.post("/big?size=50", headers={"Idempotency-Key": "small"}).status_code == 200
        small2 = c.post("/big?size=50", headers={"Idempotency-Key": "small"})
    assert big1.content == big2.content == b"x" * 100
    assert "idempotent-replayed" not in big2.headers
    assert small2.headers["idempotent-replayed"] == "true" and small2.content == b"x" * 50
    assert s.runs["big"] == 3
    assert s.store.get(_key_of("key-1")) is None


def test_streaming_and_binary_bodies_replay_exactly(serve: Serve) -> None:
    """A streamed response is kept whole; a body that is not UTF-8 comes back byte for byte."""
    s = serve()
    with s.client() as c:
        st1 = c.post("/stream", headers=K)
        st2 = c.post("/stream", headers=K)
        bin1 = c.post("/binary", headers={"Idempotency-Key": "bin"})
        bin2 = c.post("/binary", headers={"Idempotency-Key": "bin"})
    assert st1.content == st2.content == b"chunk0-1;chunk1-1;chunk2-1;chunk3-1;"
    assert bin2.headers["idempotent-replayed"] == "true"
    assert bin1.content == bin2.content == bytes(range(256)) + b"\x01"
    assert s.runs["stream"] == 1 and s.runs["binary"] == 1


def test_methods_not_configured_pass_through(serve: Serve) -> None:
    """GET (and PUT by default) need no key and are never replayed; ``methods=`` changes the set."""
    s = serve()
    with s.client() as c:
        assert c.get("/echo").status_code == 200
        assert c.get("/echo", headers=K).json() == {"run": 2}
        assert c.put("/echo").status_code == 201
    assert s.runs["get"] == 2
    s2 = serve(methods=("PUT",))
    with s2.client() as c:
        _problem(c.put("/echo"), 400)
        assert c.post("/echo").status_code == 201  # POST is not in methods any more


def test_key_optional_when_not_required(serve: Serve) -> None:
    """With require_key=False a request without a key runs every time; with a key, once."""
    s = serve(require_key=False)
    with s.client() as c:
        c.post("/echo")
        c.post("/echo")
        c.post("/echo", headers=K)
        c.post("/echo", headers=K)
    assert s.runs["echo"] == 3


def test_request_body_over_the_limit_is_413(serve: Serve) -> None:
    """A body larger than max_request_body is refused before anything is claimed or run."""
    s = serve(max_request_body=10)
    with s.client() as c:
        _problem(c.post("/echo", content=b"x" * 11, headers=K), 413)
        assert c.post("/echo", content=b"x" * 10, headers=K).status_code == 201
    assert s.runs["echo"] == 1


def _plant(s: Served, *, lease_left: float, body: bytes = b"") -> None:
    """A claim on key-1 for POST /echo as a server that is gone (or still running) left it."""
    digest = fingerprint_start("POST", "/echo", b"")
    digest.update(body)
    now = time.time()
    rec = st.new_record(
        key=_key_of("key-1"), scope="http:x", tool="http", fingerprint=digest.hexdigest(), args_json="{}",
        state=State.IN_FLIGHT, owner="other-host:1:1", now=now - 60, lease_seconds=60 + lease_left,
    )  # fmt: skip
    assert s.store.insert(rec)


def test_stale_claim_of_a_stopped_server_runs_again(serve: Serve) -> None:
    """A claim whose lease ran out (its server stopped) no longer blocks: the retry runs."""
    s = serve()
    _plant(s, lease_left=-1.0, body=b"a")
    with s.client() as c:
        response = c.post("/echo", content=b"a", headers=K)
    assert response.status_code == 201
    assert s.runs["echo"] == 1
    rec = s.store.get(_key_of("key-1"))
    assert rec is not None and rec.state is State.CONFIRMED and rec.attempts == 2


def test_live_claim_of_another_server_is_409(serve: Serve) -> None:
    """A claim held by another server (lease still running) gets 409, even from this server."""
    s = serve()
    _plant(s, lease_left=30.0, body=b"a")
    with s.client() as c:
        _problem(c.post("/echo", content=b"a", headers=K), 409)
    assert s.runs["echo"] == 0


def test_long_request_keeps_its_claim(serve: Serve) -> None:
    """A handler running past processing_timeout renews its claim: a retry meanwhile gets 409."""
    s = serve(processing_timeout=1.0)

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=s.url, timeout=10) as c:
            first = asyncio.ensure_future(c.post("/slow", headers=K))
            await asyncio.to_thread(s.entered.wait, 5)
            await asyncio.sleep(2.2)  # more than two leases
            second = await c.post("/slow", headers=K)
            s.gate.set()
            return await first, second

    done, second = asyncio.run(scenario())
    assert done.status_code == 200
    _problem(second, 409)
    assert s.runs["slow"] == 1


def test_expired_key_runs_again(serve: Serve) -> None:
    """After ``ttl`` a completed key is free: the same key runs as a new operation."""
    s = serve(ttl=0.3)
    with s.client() as c:
        c.post("/echo", content=b"a", headers=K)
        time.sleep(0.5)
        again = c.post("/echo", content=b"b", headers=K)  # even with another body: the old one is gone
    assert again.status_code == 201 and "idempotent-replayed" not in again.headers
    assert s.runs["echo"] == 2


def test_store_down_is_503_and_nothing_runs(serve: Serve) -> None:
    """When the store cannot record the key, the request is refused (503), not run unprotected."""
    s = serve(retry_after=3)
    s.store.close()
    with s.client() as c:
        response = c.post("/echo", headers=K)
    _problem(response, 503)
    assert response.headers["retry-after"] == "3"
    assert s.runs["echo"] == 0


def test_fifty_concurrent_requests_run_once(serve: Serve) -> None:
    """50 requests with one key at once: one run, the 49 others replayed or told 409."""
    s = serve()

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=s.url, timeout=30, limits=limits) as c:
            return await asyncio.gather(*(c.post("/echo", content=b"same", headers=K) for _ in range(50)))

    responses = asyncio.run(burst())
    fresh = [r for r in responses if r.status_code == 201 and "idempotent-replayed" not in r.headers]
    replayed = [r for r in responses if r.headers.get("idempotent-replayed") == "true"]
    busy = [r for r in responses if r.status_code == 409]
    assert len(fresh) == 1
    assert len(replayed) + len(busy) == 49
    assert all(r.json() == fresh[0].json() for r in replayed)
    assert s.runs["echo"] == 1


def test_store_opened_from_a_url_is_closed_at_shutdown(sqlite_url: str) -> None:
    """A store the middleware opened itself (from a URL) is closed at the lifespan shutdown."""
    from starlette.applications import Starlette

    from onceonly.server import IdempotencyMiddleware

    middleware = IdempotencyMiddleware(Starlette(), store=sqlite_url)
    store = middleware.store
    assert store is not None and store.get("x") is None
    events = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[str] = []

    async def receive() -> dict[str, str]:
        return events.pop(0)

    async def send(message: dict[str, str]) -> None:
        sent.append(message["type"])

    asyncio.run(middleware({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send))
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert middleware.store is None
    with pytest.raises(onceonly.StoreUnavailable):
        store.get("x")


def _asgi_round_trips(store_url: str, app: Any, requests: list[tuple[str, dict[str, str]]]) -> list[httpx.Response]:
    """POST each (path, headers) in turn to ``app`` behind the middleware on this run's store, in-process."""
    from onceonly.server import IdempotencyMiddleware

    middleware = IdempotencyMiddleware(app, store=store_url)

    async def scenario() -> list[httpx.Response]:
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=middleware), base_url="http://t") as c:
                return [await c.post(path, headers=headers, content=b"{}") for path, headers in requests]
        finally:
            await middleware.aclose()

    return asyncio.run(scenario())


def test_compressed_response_replays_with_its_encoding(store_url: str) -> None:
    """A body compressed inside the middleware (GZipMiddleware in the app) is stored compressed; the
    replay carries Content-Encoding and Vary with it, so the client can read it."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.middleware.gzip import GZipMiddleware
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    runs = []

    async def order(request: Any) -> JSONResponse:
        runs.append(1)
        return JSONResponse({"run": len(runs), "pad": "x" * 2000}, status_code=201)

    app = Starlette(routes=[Route("/o", order, methods=["POST"])], middleware=[Middleware(GZipMiddleware)])
    gz = {**K, "accept-encoding": "gzip"}
    first, replay = _asgi_round_trips(store_url, app, [("/o", gz), ("/o", gz)])
    assert first.headers["content-encoding"] == "gzip"
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.headers["content-encoding"] == "gzip"
    assert replay.headers["vary"] == "Accept-Encoding"
    assert replay.json() == first.json() == {"run": 1, "pad": "x" * 2000}
    assert len(runs) == 1


@pytest.mark.parametrize("code", [204, 304])
def test_bodiless_replay_has_no_content_length(store_url: str, code: int) -> None:
    """A replayed 204 or 304 carries no Content-Length, as the first answer did (RFC 9110 8.6)."""
    from starlette.applications import Starlette
    from starlette.responses import Response
    from starlette.routing import Route

    async def empty(request: Any) -> Response:
        return Response(status_code=code)

    app = Starlette(routes=[Route("/e", empty, methods=["POST"])])
    first, replay = _asgi_round_trips(store_url, app, [("/e", K), ("/e", K)])
    assert first.status_code == replay.status_code == code
    assert replay.headers["idempotent-replayed"] == "true"
    assert "content-length" not in first.headers and "content-length" not in replay.headers


@pytest.mark.parametrize("value", [0, 0.5, -1, 1.5])
def test_retry_after_must_be_whole_seconds(sqlite_url: str, value: float) -> None:
    """Retry-After is whole seconds: 0.5 would be sent as 0 (retry at once), so it is refused."""
    from starlette.applications import Starlette

    from onceonly.server import IdempotencyMiddleware

    with pytest.raises(ValueError, match="whole number of seconds"):
        IdempotencyMiddleware(Starlette(), store=sqlite_url, retry_after=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "error"), [(float("inf"), ValueError), (float("nan"), ValueError), ("5", TypeError), (None, TypeError)]
)
def test_retry_after_that_is_no_number_of_seconds_is_refused_clearly(
    sqlite_url: str, value: Any, error: type[Exception]
) -> None:
    """Infinity, NaN or a string is refused with the same clear message, not an OverflowError."""
    from starlette.applications import Starlette

    from onceonly.server import IdempotencyMiddleware

    with pytest.raises(error, match="whole number of seconds, 1 or more"):
        IdempotencyMiddleware(Starlette(), store=sqlite_url, retry_after=value)


def test_retry_after_may_be_an_integral_float(sqlite_url: str) -> None:
    from starlette.applications import Starlette

    from onceonly.server import IdempotencyMiddleware

    assert IdempotencyMiddleware(Starlette(), store=sqlite_url, retry_after=2.0).retry_after == 2  # type: ignore[arg-type]


def test_lower_case_method_is_guarded_like_upper_case(store_url: str) -> None:
    """A server may pass ``post`` as the method and an app may take it as POST (Django's ASGI handler
    upper-cases it): the middleware compares methods without case, so ``post`` needs a key, runs
    once per key, and is the same operation as ``POST`` with that key."""
    from onceonly.server import IdempotencyMiddleware

    runs: list[str] = []

    async def django_like(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        runs.append(scope["method"].upper())
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": f"run {len(runs)}".encode()})

    middleware = IdempotencyMiddleware(django_like, store=store_url)
    key = ((b"idempotency-key", b"lower-1"),)

    async def scenario() -> list[tuple[int, dict[str, str], bytes]]:
        try:
            return [
                await asgi_call(middleware, "post", "/o", key, b"x"),
                await asgi_call(middleware, "post", "/o", key, b"x"),
                await asgi_call(middleware, "POST", "/o", key, b"x"),
                await asgi_call(middleware, "Post", "/o", (), b"x"),
                await asgi_call(middleware, "patch", "/o", (), b"x"),
            ]
        finally:
            await middleware.aclose()

    first, again, upper, keyless, keyless_patch = asyncio.run(scenario())
    assert first[0] == 201 and first[2] == b"run 1"
    assert again[1]["idempotent-replayed"] == "true" and again[2] == b"run 1"
    assert upper[1]["idempotent-replayed"] == "true" and upper[2] == b"run 1"
    assert keyless[0] == keyless_patch[0] == 400
    assert keyless[1]["content-type"] == "application/problem+json"
    assert runs == ["POST"]


def test_corrupt_record_is_500_naming_the_key_state(sqlite_url: str) -> None:
    """A record the store cannot read (here a state that is not one of onceonly's) is no outage to wait
    out: a 500 problem document that names the key and its state, without Retry-After, and the
    handler does not run."""
    import sqlite3

    from onceonly.server import IdempotencyMiddleware

    store = onceonly.open_store(sqlite_url)
    runs: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        runs.append(1)

    middleware = IdempotencyMiddleware(app, store=store, client_secret=CLIENT_SECRET)
    header = ((b"idempotency-key", b"key-1"),)
    try:
        _plant_store(store, _key_of("key-1"))
        with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as raw:
            raw.execute("UPDATE onceonly_records SET state = 'bogus'")
        status, headers, body = asyncio.run(asgi_call(middleware, "POST", "/echo", header, b"a"))
    finally:
        store.close()
    assert status == 500 and headers["content-type"] == "application/problem+json"
    assert "retry-after" not in headers
    doc = json.loads(body)
    assert doc["status"] == 500 and doc["key"] == "key-1" and doc["state"] == "unreadable"
    assert "was not run" in str(doc["detail"])
    assert runs == []


def _plant_store(store: Any, key: str) -> None:
    rec = st.new_record(
        key=key, scope="http:x", tool="http", fingerprint="f", args_json="{}", state=State.IN_FLIGHT,
        owner="other-host:1:1", now=time.time(), lease_seconds=30,
    )  # fmt: skip
    assert store.insert(rec)


def test_completed_key_whose_response_is_unreadable_is_500(store_url: str) -> None:
    """A completed record whose result is not a stored response is a 500 that names the key's state
    (completed), without Retry-After; the handler does not run again."""
    from onceonly.server import IdempotencyMiddleware

    store = onceonly.open_store(store_url)
    runs: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        runs.append(1)

    digest = fingerprint_start("POST", "/echo", b"")
    digest.update(b"a")
    now = time.time()
    held = st.new_record(
        key=_key_of("key-1"), scope="http:x", tool="http", fingerprint=digest.hexdigest(), args_json="{}",
        state=State.IN_FLIGHT, owner="other-host:1:1", now=now, lease_seconds=30,
    )  # fmt: skip
    try:
        assert store.insert(st.confirm(held, result_json='{"x": 1}', now=now, ttl=None, via="run", by=None))
        status, headers, body = asyncio.run(
            asgi_call(
                IdempotencyMiddleware(app, store=store, client_secret=CLIENT_SECRET),
                "POST",
                "/echo",
                ((b"idempotency-key", b"key-1"),),
                b"a",
            )
        )
    finally:
        store.close()
    assert status == 500 and "retry-after" not in headers
    doc = json.loads(body)
    assert doc["key"] == "key-1" and doc["state"] == "completed"
    assert runs == []


def test_sqlite_with_an_fsync_per_commit_is_called_off_the_loop(sqlite_url: str) -> None:
    """``store_calls="auto"`` calls SQLite on the loop only without an fsync per commit: with
    ``synchronous=full`` each write waits for the disk, so it goes through the async face instead."""
    from onceonly.server import IdempotencyMiddleware

    async def app(scope: Any, receive: Any, send: Any) -> None:
        pass

    normal = IdempotencyMiddleware(app, store=sqlite_url)
    full = IdempotencyMiddleware(app, store=sqlite_url + "?synchronous=full")
    try:
        assert (normal.store_calls, full.store_calls) == ("inline", "async")
    finally:
        asyncio.run(normal.aclose())
        asyncio.run(full.aclose())


def test_problems_link_to_their_documentation(serve: Serve) -> None:
    """A 400 and a 422 carry a link to documentation, as the Idempotency-Key draft asks: ``type`` is an
    https URL of the page that explains the rule, repeated in a ``Link: rel="describedby"`` header."""
    docs = "https://api.example.com/docs/idempotency"
    s = serve(problem_docs=docs)
    with s.client() as c:
        missing = c.post("/echo", content=b"a")
        c.post("/echo", content=b"a", headers=K)
        reused = c.post("/echo", content=b"b", headers=K)
    assert DEFAULT_PROBLEM_DOCS is None, "onceonly publishes no page of its own: none is assumed"
    for response, slug in ((missing, "missing-key"), (reused, "key-reused")):
        url = f"{docs}#{slug}"
        assert response.json()["type"] == url
        assert response.headers["link"] == f'<{url}>; rel="describedby"; type="text/html"'
    assert (missing.status_code, reused.status_code) == (400, 422)


def test_problem_documentation_is_configurable(serve: Serve) -> None:
    """``problem_docs=`` points the links at the application's own documentation; ``None`` keeps
    ``urn:`` types and no Link header."""
    own = serve(problem_docs="https://api.example.com/docs/idempotency")
    bare = serve(problem_docs=None)
    with own.client() as c:
        response = c.post("/echo")
    assert response.json()["type"] == "https://api.example.com/docs/idempotency#missing-key"
    assert response.headers["link"].startswith("<https://api.example.com/docs/idempotency#missing-key>")
    with bare.client() as c:
        response = c.post("/echo")
    assert response.json()["type"] == "urn:onceonly:problem:missing-key"
    assert "link" not in response.headers


@pytest.mark.parametrize(
    "value",
    [
        "ftp://x.example/docs",
        "/docs/idempotency",
        "https://x.example/a#b",
        "https://x.example/a b",
        "https://x.example/\u00e9",
    ],
)
def test_problem_documentation_must_be_an_http_url(sqlite_url: str, value: str) -> None:
    """The documentation link goes into a header and every problem's ``type``: an absolute http(s)
    URL in ASCII without spaces or a fragment (each problem adds its own)."""
    from starlette.applications import Starlette

    from onceonly.server import IdempotencyMiddleware

    with pytest.raises(ValueError, match="problem_docs="):
        IdempotencyMiddleware(Starlette(), store=sqlite_url, problem_docs=value)


def test_client_hash_is_keyed() -> None:
    """The client part of a key is an HMAC of the identity: without the secret, a stored or logged
    hash of an ``Authorization`` header cannot be matched against guessed credentials."""
    basic = "Basic dXNlcjpwYXNzd29yZA=="
    one, other = client_hash(basic, b"s" * 32), client_hash(basic, b"t" * 32)
    assert one != other and len(one) == 32
    assert one != hashlib.sha256(basic.encode()).hexdigest()[:32]
    with pytest.raises(ValueError, match="16 bytes"):
        client_hash(basic, b"short")


def test_servers_on_one_store_agree_on_the_generated_client_secret(store_url: str) -> None:
    """Without ``client_secret=``, the store mode generates one and keeps it in the store: servers that
    start together (here two middlewares, each with its own memory) agree on it, so a key sent to one
    is replayed by the other, and the hash in the store is keyed with the stored secret."""
    from onceonly.server import IdempotencyMiddleware

    runs: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        runs.append(1)
        await send({"type": "http.response.start", "status": 201})
        await send({"type": "http.response.body", "body": f"run {len(runs)}".encode()})

    servers = [IdempotencyMiddleware(app, store=store_url) for _ in range(2)]
    auth = ((b"authorization", b"Basic dXNlcjpwYXNzd29yZA=="),)

    async def scenario() -> list[tuple[int, dict[str, str], bytes]]:
        try:
            firsts = await asyncio.gather(
                *(
                    asgi_call(s, "POST", "/o", (*auth, (b"idempotency-key", f"k-{i}".encode())))
                    for i, s in enumerate(servers)
                )
            )
            crossed = [
                await asgi_call(s, "POST", "/o", (*auth, (b"idempotency-key", f"k-{1 - i}".encode())))
                for i, s in enumerate(servers)
            ]
            return [*firsts, *crossed]
        finally:
            for s in servers:
                await s.aclose()

    first_a, first_b, crossed_a, crossed_b = asyncio.run(scenario())
    assert first_a[0] == first_b[0] == 201 and runs == [1, 1]
    assert crossed_a[1]["idempotent-replayed"] == crossed_b[1]["idempotent-replayed"] == "true"
    assert (crossed_a[2], crossed_b[2]) == (first_b[2], first_a[2])
    store = onceonly.open_store(store_url)
    try:
        meta = store.get("http:meta:client-secret")
        assert meta is not None and meta.state is State.CONFIRMED and meta.expires_at is None
        secret = bytes.fromhex(json.loads(meta.result_json or "")["client_secret"])
        client = client_hash("Basic dXNlcjpwYXNzd29yZA==", secret)
        assert store.get(store_key("http", client, "k-0")) is not None
        assert client != hashlib.sha256(b"Basic dXNlcjpwYXNzd29yZA==").hexdigest()[:32]
    finally:
        store.close()


@pytest.mark.parametrize("secret", [b"", b"x" * 15, "short", 42])
def test_client_secret_must_be_16_bytes_or_more(sqlite_url: str, secret: Any) -> None:
    """A client secret is bytes or text of 16 bytes or more: a short one would not keep hashes secret."""
    from onceonly.server import IdempotencyMiddleware

    async def app(scope: Any, receive: Any, send: Any) -> None:
        pass

    with pytest.raises((ValueError, TypeError), match="client_secret="):
        IdempotencyMiddleware(app, store=sqlite_url, client_secret=secret)


def test_transactional_mode_needs_a_client_secret() -> None:
    """The transactional mode keeps no store where a generated secret could be shared between server
    processes, so it asks for one and says where to keep it."""
    from onceonly.server import IdempotencyMiddleware

    async def app(scope: Any, receive: Any, send: Any) -> None:
        pass

    with pytest.raises(ValueError, match=r"client_secret=.*IdempotencyTable\.client_secret"):
        IdempotencyMiddleware(app, transactional=True)
    assert IdempotencyMiddleware(app, transactional=True, client_secret="a" * 16).transactional


@pytest.mark.parametrize("name", ["processing_timeout", "ttl"])
@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf")])
def test_seconds_must_be_positive_and_finite(sqlite_url: str, name: str, value: float) -> None:
    """A lease or a ttl of NaN or infinity is refused at construction, like zero or a negative one."""
    from starlette.applications import Starlette

    from onceonly.server import IdempotencyMiddleware

    with pytest.raises(ValueError, match=f"{name}="):
        IdempotencyMiddleware(Starlette(), store=sqlite_url, **{name: value})


@pytest.mark.parametrize("size", [16, 64, 65, 200])
def test_client_hash_is_hmac_sha256(size: int) -> None:
    """The client hash is exactly HMAC-SHA256 (RFC 2104) of the identity, cut to 128 bits, for keys
    shorter and longer than SHA-256's block."""
    import hmac

    secret = bytes(range(size % 256)) * (size // 256) + bytes(range(size % 256))
    for identity in ("", "Bearer abc", "caf\u00e9 \udc80"):
        expected = hmac.new(secret, identity.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:32]
        assert client_hash(identity, secret) == expected


def test_one_client_hasher_gives_hmac_new_for_every_identity() -> None:
    """The middleware keys one ``ClientHasher`` and reuses it for every request: each digest, in any
    order and repeated, is ``hmac.new``'s for that identity, so no request's state leaks into the next."""
    import hmac

    from onceonly.server._http import ClientHasher

    for secret in (b"k" * 16, b"k" * 64, bytes(range(200))):
        hasher = ClientHasher(secret)
        for identity in ("Bearer a", "", "Bearer a", "caf\u00e9 \udc80", "Basic " + "x" * 500):
            expected = hmac.new(secret, identity.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:32]
            assert hasher(identity) == expected
