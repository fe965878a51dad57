"""``IdempotencyMiddleware(status_path=...)``: ``GET /idempotency-keys/{key}`` tells the calling client
what the server knows of its key, over a real uvicorn server on 127.0.0.1, on each store, and in
transactional mode; hostile keys and headers get a clear 4xx and store nothing."""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as hst
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from onceonly import states as st
from onceonly.server import (
    DEFAULT_STATUS_PATH,
    IdempotencyMiddleware,
    IdempotencyTable,
    KeyStatus,
    client_hash,
    store_key,
)
from onceonly.states import State
from onceonly.stores import open_store
from onceonly.tickets import serve_in_thread
from tests._hostile import hostile

from .conftest import CLIENT_SECRET, asgi_call

K = {"Idempotency-Key": "key-1"}


def _status(c: httpx.Client, key: str, **kwargs: Any) -> httpx.Response:
    return c.get(f"{DEFAULT_STATUS_PATH}/{quote(key, safe='')}", **kwargs)


def _not_found(response: httpx.Response, state: str = "no-record") -> dict[str, Any]:
    assert response.status_code == 404, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["cache-control"] == "no-store"
    doc: dict[str, Any] = response.json()
    assert doc["type"] == "urn:onceonly:problem:unknown-key"
    assert doc["state"] == state and doc["retry"] == "runs"
    return doc


def test_default_path_is_documented_and_off_unless_set(serve: Any) -> None:
    """Without status_path the path is the application's (Starlette's own 404), not the middleware's."""
    assert DEFAULT_STATUS_PATH == "/idempotency-keys"
    s = serve()
    with s.client() as c:
        assert c.post("/echo", headers=K, content=b"a").status_code == 201
        got = _status(c, "key-1")
    assert got.status_code == 404
    assert got.headers["content-type"] != "application/problem+json"


def test_completed_key_tells_its_status_not_its_body(serve: Any) -> None:
    """After a POST, the key reads completed with the stored status and times; the body stays behind
    the replay, and asking runs nothing."""
    s = serve(status_path=DEFAULT_STATUS_PATH, ttl=3600)
    with s.client() as c:
        first = c.post("/echo", headers=K, content=b"a")
        assert first.status_code == 201
        got = _status(c, "key-1")
        assert got.status_code == 200, got.text
        assert got.headers["content-type"] == "application/json"
        assert got.headers["cache-control"] == "no-store"
        doc = got.json()
        assert set(doc) == {"key", "state", "status", "stored_at", "expires_at", "replay", "retry"}
        assert doc["key"] == "key-1" and doc["state"] == "completed" and doc["status"] == 201
        assert doc["replay"] is True and doc["retry"] == "replays"
        assert doc["stored_at"].endswith("Z") and doc["expires_at"] > doc["stored_at"]
        assert "body" not in got.text and "things" not in got.text  # nothing of the stored response
        replay = c.post("/echo", headers=K, content=b"a")
    assert replay.headers["idempotent-replayed"] == "true" and replay.json() == first.json()
    assert s.runs["echo"] == 1


def test_other_client_and_unused_key_are_not_found(serve: Any) -> None:
    """Another Authorization asking for the key gets 404 as for a key never used: keys are scoped."""
    s = serve(status_path=DEFAULT_STATUS_PATH)
    with s.client(headers={"Authorization": "Bearer alice"}) as alice:
        assert alice.post("/echo", headers=K, content=b"a").status_code == 201
        assert _status(alice, "key-1").json()["state"] == "completed"
        _not_found(_status(alice, "never-used"))
    with s.client(headers={"Authorization": "Bearer mallory"}) as mallory:
        doc = _not_found(_status(mallory, "key-1"))
    with s.client() as anonymous:
        _not_found(_status(anonymous, "key-1"))
    assert doc["key"] == "key-1"
    assert s.runs["echo"] == 1


def test_processing_key_says_wait_then_completed(serve: Any) -> None:
    """While the handler runs the key is processing (a retry gets 409: wait); once it answers, completed."""
    s = serve(status_path=DEFAULT_STATUS_PATH, retry_after=2)
    with s.client() as c:
        done: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: done.append(c.post("/slow", headers=K)))
        worker.start()
        assert s.entered.wait(10)
        got = _status(c, "key-1")
        doc = got.json()
        assert doc["state"] == "processing" and doc["retry"] == "waits" and doc["replay"] is False
        assert doc["status"] is None and doc["expires_at"] is not None  # when the claim would go stale
        assert got.headers["retry-after"] == "2"
        s.gate.set()
        worker.join(10)
        assert done[0].status_code == 200
        assert _status(c, "key-1").json()["state"] == "completed"
    assert s.runs["slow"] == 1


def test_released_key_after_a_5xx_is_not_found(serve: Any) -> None:
    """A 500 releases the key: the server keeps no record and a retry runs."""
    s = serve(status_path=DEFAULT_STATUS_PATH)
    with s.client() as c:
        assert c.post("/status/503", headers=K).status_code == 503
        _not_found(_status(c, "key-1"))


def test_expired_key_says_expired(serve: Any) -> None:
    """A completed key past its ttl is 404 with state expired: the server can tell it ran, long ago."""
    now = [1_000_000.0]
    s = serve(status_path=DEFAULT_STATUS_PATH, ttl=60, clock=lambda: now[0])
    with s.client() as c:
        assert c.post("/echo", headers=K, content=b"a").status_code == 201
        now[0] += 61
        doc = _not_found(_status(c, "key-1"), state="expired")
    assert doc["expired_at"] == "1970-01-12T13:47:40Z"


def test_stale_claim_is_unknown(serve: Any) -> None:
    """A claim whose server stopped mid-request (its lease ran out unrenewed) is unknown: whether its
    effects landed is not recorded, and a retry runs the request again."""
    s = serve(status_path=DEFAULT_STATUS_PATH)
    client = client_hash("", CLIENT_SECRET)
    rec = st.new_record(
        key=store_key("http", client, "key-1"), scope=f"http:{client}", tool="http", fingerprint="f" * 64,
        args_json="{}", state=State.IN_FLIGHT, owner="gone", now=1.0, lease_seconds=1.0, reason="request",
    )  # fmt: skip
    assert s.store.claim(rec) is None
    with s.client() as c:
        doc = _status(c, "key-1").json()
    assert doc["state"] == "unknown" and doc["retry"] == "runs" and doc["replay"] is False


def test_keys_with_reserved_characters_travel_percent_encoded(serve: Any) -> None:
    """A key may hold '/', '%', '?' or '#': percent-encoded in the path, it names the same key."""
    s = serve(status_path=DEFAULT_STATUS_PATH)
    key = "a/b%2F?c#d"
    with s.client() as c:
        assert c.post("/echo", headers={"Idempotency-Key": key}, content=b"a").status_code == 201
        assert _status(c, key).json()["key"] == key
        _not_found(_status(c, "a/b"))


def test_only_get_is_answered(serve: Any) -> None:
    """A POST to the status path is 405 (Allow: GET), and neither runs nor stores anything."""
    s = serve(status_path=DEFAULT_STATUS_PATH)
    with s.client() as c:
        got = c.post(f"{DEFAULT_STATUS_PATH}/key-1", headers=K)
    assert got.status_code == 405 and got.headers["allow"] == "GET"
    assert s.store.count_by_state() == {}


@pytest.mark.parametrize("path", ["/", "idempotency-keys", "/idempotency-keys/", "/a b", "/a?b", "/caf\u00e9", "/a%2F"])
def test_bad_status_path_is_refused(path: str) -> None:
    with pytest.raises(ValueError, match="status_path="):
        IdempotencyMiddleware(lambda *a: None, store="sqlite:///:memory:", status_path=path)


# --- hostile keys and headers -------------------------------------------------------------------


async def _nothing(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("the status endpoint never reaches the application")


_TEXT = hst.characters(blacklist_categories=("Cs",))


def test_asking_before_any_key_was_stored_makes_no_client_secret(store_url: str) -> None:
    """Without client_secret= the store mode makes one on the first guarded request; a status request
    only reads, so before that it answers 404 and the store stays empty."""
    store = open_store(store_url)
    app = IdempotencyMiddleware(_nothing, store=store, status_path=DEFAULT_STATUS_PATH)
    try:
        status, got, _ = asyncio.run(asgi_call(app, "GET", f"{DEFAULT_STATUS_PATH}/key-1"))
        assert status == 404 and got["content-type"] == "application/problem+json"
        assert store.count_by_state() == {}
    finally:
        asyncio.run(app.aclose())
        store.close()


def test_hostile_status_requests_get_a_clear_4xx_and_store_nothing(store_url: str) -> None:
    """Paths and headers of every kind (empty, huge, non-ASCII, control characters, bytes that are not
    text, several keys): a 400, 404 or 405 problem document, and nothing written."""
    store = open_store(store_url)
    app = IdempotencyMiddleware(_nothing, store=store, status_path=DEFAULT_STATUS_PATH, client_secret=CLIENT_SECRET)

    @hostile(store_url.split(":", 1)[0].replace("postgresql", "postgres"), scale=0.5)
    @given(
        rest=hst.one_of(
            hst.text(alphabet=_TEXT, max_size=300),
            hst.text(alphabet=hst.characters(max_codepoint=0x7F), max_size=300),
        ),
        method=hst.sampled_from(["GET", "get", "POST", "HEAD", "DELETE", "PATCH"]),
        headers=hst.lists(
            hst.tuples(
                hst.sampled_from([b"authorization", b"idempotency-key", b"x-idempotency-key", b"cookie", b"x-any"]),
                hst.binary(max_size=300),
            ),
            max_size=4,
        ),
    )
    @example(rest="key-1", method="GET", headers=[(b"authorization", b"\xff\xfe")])
    @example(rest="k" * 256, method="GET", headers=[])
    @example(rest="", method="GET", headers=[])
    @example(rest="caf\u00e9", method="GET", headers=[])
    @example(rest="a\x00b", method="GET", headers=[(b"idempotency-key", b"\x00")])
    @example(rest="key-1/../x", method="GET", headers=[(b"authorization", b"a"), (b"authorization", b"b")])
    def check(rest: str, method: str, headers: list[tuple[bytes, bytes]]) -> None:
        status, got, body = asyncio.run(asgi_call(app, method, f"{DEFAULT_STATUS_PATH}/{rest}", headers=tuple(headers)))
        assert status in (400, 404, 405), (status, body)
        assert got["content-type"] == "application/problem+json"
        assert store.count_by_state() == {}

    try:
        check()
    finally:
        asyncio.run(app.aclose())
        store.close()


# --- transactional mode: the application's own table ----------------------------------------------

SECRET = b"transactional-secret-0123456789"


@pytest.fixture(name="tx_server")
def fixture_tx_server(tmp_path: Path) -> Iterator[tuple[str, Counter[str]]]:
    path = tmp_path / "app.db"
    table = IdempotencyTable(ttl=3600)
    with sqlite3.connect(path) as conn:
        table.create(conn)
        conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT)")
    runs: Counter[str] = Counter()

    def order(request: Request, body: bytes) -> Response:
        conn = sqlite3.connect(path, timeout=5, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            slot = table.begin_request(conn, request)
            cur = conn.execute("INSERT INTO orders (item) VALUES (?)", (body.decode(),))
            runs["orders"] += 1
            answer = f'{{"order": {cur.lastrowid}}}'
            slot.complete(201, answer, [("content-type", "application/json")])
            conn.execute("COMMIT")
        finally:
            conn.close()
        return Response(answer, status_code=201, media_type="application/json")

    async def post(request: Request) -> Response:
        return await asyncio.to_thread(order, request, await request.body())

    def lookup(key: str) -> KeyStatus:
        conn = sqlite3.connect(path, timeout=5)
        try:
            return table.status(conn, key)
        finally:
            conn.close()

    app = Starlette(routes=[Route("/orders", post, methods=["POST"])])
    app.add_middleware(
        IdempotencyMiddleware, transactional=True, client_secret=SECRET, status_path=DEFAULT_STATUS_PATH,
        status_lookup=lookup,
    )  # fmt: skip
    server = serve_in_thread(app)
    yield server.url, runs
    server.stop()


def test_transactional_mode_reads_the_applications_table(tx_server: tuple[str, Counter[str]]) -> None:
    url, runs = tx_server
    with httpx.Client(base_url=url, headers={"Authorization": "Bearer alice"}, timeout=10) as c:
        assert c.post("/orders", headers=K, content=b"tea").status_code == 201
        doc = _status(c, "key-1").json()
        assert doc["state"] == "completed" and doc["status"] == 201 and doc["replay"] is True
        assert "order" not in str(doc)
        _not_found(_status(c, "never-used"))
        _not_found(_status(c, "onceonly:meta:client-secret"))
    with httpx.Client(base_url=url, headers={"Authorization": "Bearer mallory"}, timeout=10) as other:
        _not_found(_status(other, "key-1"))
    assert runs["orders"] == 1


def test_transactional_status_path_needs_a_lookup() -> None:
    with pytest.raises(ValueError, match="status_lookup="):
        IdempotencyMiddleware(_nothing, transactional=True, client_secret=SECRET, status_path="/keys")
    with pytest.raises(ValueError, match="transactional=True"):
        IdempotencyMiddleware(
            _nothing, store="sqlite:///:memory:", status_lookup=lambda k: KeyStatus("no-record", "runs")
        )


def _raw(url: str, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    """Send ``request`` as bytes to the server at ``url`` (``Connection: close``); its status, headers, body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = dict(line.split(b": ", 1) for line in lines[1:] if b": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def test_hostile_status_requests_on_the_wire_get_a_clear_4xx_and_store_nothing(serve: Any) -> None:
    """The same through a real uvicorn server: raw request lines with percent-encoded bytes of every
    kind, key headers and Authorization values a server may or may not pass on. Every answer is the
    server's own 400 or the endpoint's 400, 404 or 405 problem, and the store stays empty."""
    s = serve(status_path=DEFAULT_STATUS_PATH)

    @hostile("redis", scale=0.5)  # a server round trip per request: few examples on every store
    @given(
        raw_key=hst.binary(max_size=300),
        method=hst.sampled_from([b"GET", b"POST", b"PUT", b"DELETE"]),
        auth=hst.binary(max_size=40),
        key_header=hst.one_of(hst.none(), hst.binary(max_size=40)),
    )
    @example(raw_key=b"key-1", method=b"GET", auth=b"Bearer alice", key_header=None)
    @example(raw_key=b"\xff\xfe", method=b"GET", auth=b"", key_header=None)
    @example(raw_key=b"k" * 300, method=b"GET", auth=b"", key_header=b"k")
    @example(raw_key=b"%00", method=b"GET", auth=b"\r\n", key_header=None)
    def check(raw_key: bytes, method: bytes, auth: bytes, key_header: bytes | None) -> None:
        target = DEFAULT_STATUS_PATH.encode() + b"/" + quote(raw_key, safe="").encode()
        head = method + b" " + target + b" HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
        head += b"Authorization: " + auth.replace(b"\r", b"").replace(b"\n", b"") + b"\r\n"
        if key_header is not None:
            head += b"Idempotency-Key: " + key_header.replace(b"\r", b"").replace(b"\n", b"") + b"\r\n"
        status, headers, answer = _raw(s.url, head + b"Content-Length: 0\r\n\r\n")
        assert status in (400, 404, 405), (status, answer[:300])
        if headers.get(b"content-type") == b"application/problem+json":
            assert json.loads(answer)["status"] == status
        else:
            assert status == 400  # the server's own refusal of what it cannot parse
        assert s.store.count_by_state() == {}

    check()
