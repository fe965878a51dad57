"""Hostile HTTP, generated: hypothesis sends IdempotencyMiddleware requests with Idempotency-Key headers
that are empty, huge, non-ASCII or latin-1 bytes, repeated (agreeing or not), padded or full of control
characters; bodies that are not JSON, binary, huge or in chunks; content types and methods of all kinds;
from two clients at once, on each real store.

Every answer is a 4xx ``application/problem+json`` document or the application's own response; never
a 5xx. And no response reaches a request it does not belong to: a replay is the response to the same
client's same request (method, path, body), a key reused with another request is a 422, and each client
and key runs the application once.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import socket
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from onceonly.server import IdempotencyMiddleware
from onceonly.server._http import BadKey, Message, Receive, Scope, Send, request_key
from tests._hostile import hostile

from .conftest import CLIENT_SECRET, Served, asgi_call

MAX_BODY = 64 << 10


def echo_app(runs: Counter[str]) -> Any:
    """A raw ASGI application that answers any method with who asked and a digest of what was sent."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        runs["n"] += 1
        run = runs["n"]
        await asyncio.sleep(0.002)  # long enough for a concurrent request with the same key to meet it
        auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        answer = {
            "run": run,
            "auth": auth.decode("latin-1"),
            "method": scope["method"],
            "path": scope["path"],
            "body": hashlib.sha256(body).hexdigest(),
        }
        start: Message = {"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/json")]}
        await send(start)
        await send({"type": "http.response.body", "body": json.dumps(answer).encode()})

    return app


# --- what is drawn ----------------------------------------------------------------------------------

GOOD_KEYS = [b"k1", b"k2", b'"k1"', b" k1\t", b'"k\\"2"']
BAD_KEYS = [
    b"", b" ", b'""', b'"', b'"k1', b'"a\\x"', b"\x00", b"k\x01", b"k\x7f", b"\xff\xfe", "é".encode("latin-1"),
    "é".encode(), b"k" * 255, b"k" * 256, b"k" * 100_000, b"a b", b"k\r\n", b"\x1b[31m",
]  # fmt: skip
# Good keys drawn about as often as bad ones, so that keys meet again: replays, conflicts, races.
KEY_VALUES = st.one_of(st.sampled_from(GOOD_KEYS), st.sampled_from(BAD_KEYS), st.binary(max_size=12))
KEY_HEADERS = st.lists(st.tuples(st.sampled_from([b"idempotency-key", b"x-idempotency-key"]), KEY_VALUES), max_size=2)
BODIES = st.lists(
    st.one_of(
        st.binary(max_size=40),
        st.sampled_from([b"{not json", b'{"a": 1}', b"\x00" * 8, b"\xff\xfe\xfd", b"[" * 1000, b"x" * (MAX_BODY + 1)]),
    ),
    max_size=4,
)
CONTENT_TYPES = st.sampled_from(
    [None, b"application/json", b"text/plain; charset=latin-1", b"multipart/form-data; boundary=x", b"\xff", b""]
)
METHODS = st.one_of(
    st.sampled_from(["POST", "PATCH", "post"]), st.sampled_from(["Patch", "PUT", "GET", "DELETE", "QUERY", "P\xd6ST"])
)
PATHS = st.one_of(st.just("/"), st.sampled_from(["/a", "/\xe4", "/a/../b", "/%00"]))
AUTHS = st.sampled_from([b"Bearer alice", b"Bearer bob", None])


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: tuple[tuple[bytes, bytes], ...]
    body: list[bytes]
    auth: bytes | None

    @property
    def identity(self) -> tuple[str, str, str]:
        """What the middleware fingerprints, as the application reports it back (a method in any case
        is one method: ``post`` is guarded as ``POST``)."""
        return self.method.upper(), self.path, hashlib.sha256(b"".join(self.body)).hexdigest()

    def key(self) -> str | None:
        """The key the request carries, parsed; None when it has none or one the middleware refuses."""
        try:
            return request_key({"headers": list(self.headers)})
        except BadKey:
            return None


@st.composite
def requests(draw: st.DrawFn) -> Request:
    auth = draw(AUTHS)
    headers = list(draw(KEY_HEADERS))
    content_type = draw(CONTENT_TYPES)
    if content_type is not None:
        headers.append((b"content-type", content_type))
    if auth is not None:
        headers.append((b"authorization", auth))
    order = draw(st.permutations(headers))
    return Request(draw(METHODS), draw(PATHS), tuple(order), draw(BODIES), auth)


def _post(key: bytes, who: bytes, body: bytes) -> Request:
    auth = b"Bearer " + who
    return Request("POST", "/", ((b"idempotency-key", key), (b"authorization", auth)), [body], auth)


@st.composite
def waves(draw: st.DrawFn) -> list[list[Request]]:
    """Waves of requests, the requests of one wave sent at once, drawn from a few distinct ones: the
    same request again (a retry, concurrent or later) is what makes replays and 409s."""
    pool = draw(st.lists(requests(), min_size=1, max_size=3))
    picks = st.lists(st.integers(0, len(pool) - 1), min_size=1, max_size=3)
    return [[pool[i] for i in wave] for wave in draw(st.lists(picks, min_size=1, max_size=3))]


def _fresh_clients(wave: list[Request], n: int) -> list[Request]:
    """The wave with each Authorization made this example's own, so each example starts from no keys
    (requests without one share the anonymous namespace across examples, which is fine too)."""
    out = []
    for r in wave:
        if r.auth is None:
            out.append(r)
            continue
        auth = r.auth + b"-%d" % n
        headers = tuple((k, auth if k == b"authorization" else v) for k, v in r.headers)
        out.append(Request(r.method, r.path, headers, r.body, auth))
    return out


_examples = itertools.count()


@pytest.fixture(name="guarded")
def fixture_guarded(store_url: str) -> Iterator[tuple[IdempotencyMiddleware, Counter[str], asyncio.AbstractEventLoop]]:
    """The echo application behind the middleware on each store, and the one event loop it runs on."""
    runs: Counter[str] = Counter()
    loop = asyncio.new_event_loop()
    # From the URL: the middleware owns the store, and aclose() closes its async face on this loop.
    mw = IdempotencyMiddleware(echo_app(runs), store=store_url, client_secret=CLIENT_SECRET, max_request_body=MAX_BODY)
    yield mw, runs, loop
    loop.run_until_complete(mw.aclose())
    loop.close()


def test_hostile_requests_get_a_problem_or_their_own_response(
    guarded: tuple[IdempotencyMiddleware, Counter[str], asyncio.AbstractEventLoop], store_url: str
) -> None:
    """Drawn requests, a few at once: each answer is a 4xx problem document or the application's
    answer to that very request (same client, method, path and body); a key used again with another
    request is a 422; each client's key runs the application at most once. Never a 5xx."""
    mw, runs, loop = guarded
    first: dict[tuple[bytes | None, str], tuple[str, str, str]] = {}  # (client, key) → its first request

    @hostile(store_url.split(":", 1)[0].replace("postgresql", "postgres"))
    @given(drawn=waves())
    @example(drawn=[[Request("POST", "/", ((b"idempotency-key", b"k1"), (b"idempotency-key", b"k1")), [b"x"], None)]])
    @example(drawn=[[Request("POST", "/", ((b"idempotency-key", b"\xe9"),), [b"x"], None)]])
    @example(drawn=[[Request("POST", "/", ((b"idempotency-key", b"k" * 100_000),), [b"\xff"], None)]])
    @example(drawn=[[_post(b"k1", b"alice", b"a"), _post(b"k1", b"alice", b"a")], [_post(b"k1", b"alice", b"a")]])
    @example(drawn=[[_post(b"k2", b"alice", b"a"), _post(b"k2", b"bob", b"b")], [_post(b"k2", b"alice", b"b")]])
    def check(drawn: list[list[Request]]) -> None:
        n = next(_examples)
        for wave in (_fresh_clients(w, n) for w in drawn):

            async def send_wave(wave: list[Request] = wave) -> list[tuple[int, dict[str, str], bytes]]:
                return await asyncio.gather(*(asgi_call(mw, r.method, r.path, r.headers, r.body) for r in wave))

            answers = loop.run_until_complete(send_wave())
            fresh = []
            for request, (status, headers, body) in zip(wave, answers, strict=True):
                assert status < 500, (status, body[:300])
                if headers.get("content-type") == "application/problem+json":
                    doc = json.loads(body)
                    assert doc["status"] == status and doc["title"] and doc["detail"]
                    assert 400 <= status < 500
                    continue
                assert status == 201, (status, body[:300])
                got = json.loads(body)
                # The answer is to this request: the same client, method, path and body.
                assert (got["auth"], got["method"].upper(), got["path"], got["body"]) == (
                    (request.auth or b"").decode("latin-1"),
                    *request.identity,
                )
                key = request.key()
                if key is None or request.method.upper() not in ("POST", "PATCH"):
                    continue
                if headers.get("idempotent-replayed") != "true":
                    fresh.append((request.auth, key, request.identity))
            for auth, key, identity in fresh:
                assert (auth, key) not in first, f"{key!r} ran twice for {auth!r}"
                first[auth, key] = identity
            # Then what replays and conflicts answered, once the wave's own first runs are known (a
            # request of the same wave may have finished before its twin claimed the key).
            for request, (status, headers, _) in zip(wave, answers, strict=True):
                recorded = first.get((request.auth, request.key() or ""))
                if headers.get("idempotent-replayed") == "true":
                    assert recorded == request.identity, "a replay of another request"
                if status == 422:
                    assert recorded not in (None, request.identity), "a 422 for the request the key was used for"

    check()
    assert runs["n"] >= len(first)


# --- on the wire: what a server parses before the middleware sees it ------------------------------------


def _raw(url: str, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    """Send ``request`` as bytes to the server at ``url``; its status, headers and body."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = dict(line.split(b": ", 1) for line in lines[1:] if b": " in line)
    if headers.get(b"transfer-encoding") == b"chunked":
        out, rest = b"", body
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2 :]
        body = out
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


def _chunked(parts: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts if p) + b"0\r\n\r\n"


WIRE_KEYS = st.lists(
    st.one_of(st.sampled_from(GOOD_KEYS), st.sampled_from(BAD_KEYS[:12]), st.binary(max_size=8)), min_size=1, max_size=2
)


def test_hostile_requests_on_the_wire_get_a_clear_4xx_or_their_own_response(serve: Any) -> None:
    """The same over a real server (uvicorn): repeated key headers, bytes a server may or may not pass
    on, chunked bodies. The server itself may refuse a request it cannot parse (its own 400: the
    application never sees it); every other answer is a problem document or this request's own."""
    served: Served = serve()
    seen: dict[tuple[bytes, str], bytes] = {}  # (client, key) → the first body sent with it

    @hostile("redis", scale=0.5)  # a server round trip per request: few examples on every store
    @given(keys=WIRE_KEYS, body=st.lists(st.binary(max_size=16).map(bytes.hex).map(str.encode), max_size=3),
           chunked=st.booleans(), who=st.sampled_from([b"alice", b"bob"]))  # fmt: skip
    @example(keys=[b"k1", b"k1"], body=[b"ab"], chunked=True, who=b"alice")
    @example(keys=[b"k1", b"k2"], body=[b"ab"], chunked=False, who=b"alice")
    @example(keys=["é".encode("latin-1")], body=[b"ab"], chunked=False, who=b"bob")
    def check(keys: list[bytes], body: list[bytes], chunked: bool, who: bytes) -> None:
        content = who + b":" + b"".join(body)  # the echo handler sends the body back: it names the client
        head = b"POST /echo HTTP/1.1\r\nHost: t\r\nConnection: close\r\nAuthorization: Bearer " + who + b"\r\n"
        head += b"".join(b"Idempotency-Key: " + k + b"\r\n" for k in keys)
        if chunked:
            wire = head + b"Transfer-Encoding: chunked\r\n\r\n" + _chunked([who + b":", *body])
        else:
            wire = head + b"Content-Length: %d\r\n\r\n" % len(content) + content
        before = served.runs["echo"]
        status, headers, answer = _raw(served.url, wire)
        assert status < 500, (status, answer[:300])
        if headers.get(b"content-type") == b"application/problem+json":
            assert 400 <= status < 500 and json.loads(answer)["status"] == status
            assert served.runs["echo"] == before
            return
        if status == 400 and served.runs["echo"] == before:
            return  # the server refused to parse it; nothing reached the application
        assert status == 201, (status, answer[:300])
        assert json.loads(answer)["body"] == content.decode(), "another request's response"
        key = request_key({"headers": [(b"idempotency-key", k) for k in keys]})
        assert key is not None, "a request with a key the middleware refuses reached the application"
        if headers.get(b"idempotent-replayed") == b"true":
            assert seen[who, key] == content
        else:
            assert (who, key) not in seen, f"{key!r} ran twice for {who!r}"
            seen[who, key] = content

    check()
