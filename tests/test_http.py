"""onceonly.http: one key per logical call, kept across retries, 409 waited on, 422 as KeyConflict,
errors classified. Against real servers on 127.0.0.1: the ticket service (with its faults) and a
scripted ASGI app that answers a planned sequence and records what it received."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import onceonly
from onceonly import Retry
from onceonly.http import DEFAULT_RETRY, AsyncClient, Client, header_key, is_replayed
from onceonly.states import State
from onceonly.tickets import RunningServer, serve_in_thread

TICKET = {"session_id": "s-1", "title": "printer broken", "body": "on floor 2"}


class Scripted:
    """Answers each request with the next planned (status, headers, body); records every request."""

    def __init__(self) -> None:
        self.plan: list[tuple[int, dict[str, str], bytes]] = []
        self.seen: list[dict[str, str]] = []
        self.on_request: Callable[[dict[str, str]], None] | None = None

    def then(self, status: int, body: bytes = b"{}", **headers: str) -> Scripted:
        self.plan.append((status, {k.replace("_", "-"): v for k, v in headers.items()}, body))
        return self

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        seen = {k.decode(): v.decode() for k, v in scope["headers"]}
        seen[":method"] = scope["method"]
        seen[":path"] = scope["path"]
        self.seen.append(seen)
        if self.on_request is not None:
            self.on_request(seen)
        status, headers, body = self.plan.pop(0) if self.plan else (200, {}, b"{}")
        headers.setdefault("content-type", "application/json")
        raw = [(k.encode(), v.encode()) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})

    def keys(self) -> list[str | None]:
        return [s.get("idempotency-key") for s in self.seen]


@pytest.fixture(name="scripted")
def fixture_scripted() -> Iterator[tuple[Scripted, str]]:
    """A scripted app on uvicorn; yields it and its URL."""
    app = Scripted()
    with serve_in_thread(app) as server:
        yield app, server.url


@pytest.fixture(name="tickets")
def fixture_tickets(tmp_path: Path) -> Iterator[RunningServer]:
    """The ticket service (transactional idempotency), faults off until a test sets them."""
    server = serve_in_thread(db_path=tmp_path / "tickets.db")
    yield server
    server.stop()
    server.app.state.db.close()  # type: ignore[attr-defined]


def _faults(server: RunningServer, **faults: float) -> None:
    httpx.put(f"{server.url}/admin/faults", json=faults, timeout=5).raise_for_status()


def _count(server: RunningServer) -> int:
    return int(server.app.state.db.count())  # type: ignore[attr-defined]


class Sleeps(list[float]):
    """Records the waits instead of sleeping; ``then`` runs at the first one (the network heals…).
    More than ``limit`` waits fail the test (a client that would loop forever)."""

    def __init__(self, then: Callable[[], None] | None = None, limit: int = 1000) -> None:
        super().__init__()
        self.then = then
        self.limit = limit

    def __call__(self, seconds: float) -> None:
        self.append(seconds)
        if len(self) > self.limit:
            raise AssertionError(f"{len(self)} waits: the client does not stop ({self[-5:]})")
        if self.then is not None and len(self) == 1:
            self.then()

    async def asleep(self, seconds: float) -> None:
        self(seconds)


# --- the key, kept across retries ------------------------------------------------------------------


def test_lost_answer_is_resent_with_the_same_key_and_replayed(tickets: RunningServer) -> None:
    """The first answer is lost after the commit (a reset); the client re-sends with the same key
    and gets the one ticket that was made, marked replayed."""
    _faults(tickets, lost=1.0)
    sleeps = Sleeps(then=lambda: _faults(tickets))
    with Client(tickets.url, sleep=sleeps) as c:
        response = c.post("/tickets", json=TICKET)
    assert response.status_code == 201 and is_replayed(response)
    assert len(sleeps) == 1
    key = response.request.headers["Idempotency-Key"]
    assert httpx.get(f"{tickets.url}/tickets/by-idempotency-key/{key}").json() == response.json()
    assert _count(tickets) == 1


def test_read_timeout_is_resent_with_the_same_key(tickets: RunningServer) -> None:
    """A read timeout (the answer is late) is an unknown outcome: re-sent with the key, one ticket."""
    _faults(tickets, delay=1.0, delay_seconds=1.0)
    sleeps = Sleeps(then=lambda: _faults(tickets))
    with Client(tickets.url, sleep=sleeps, timeout=0.3) as c:
        response = c.post("/tickets", json=TICKET)
    assert is_replayed(response)
    assert _count(tickets) == 1


def test_explicit_and_quoted_keys(tickets: RunningServer) -> None:
    """An explicit key is sent as given (bare or as the draft's sf-string) and is the same key."""
    with Client(tickets.url, sleep=Sleeps()) as bare, Client(tickets.url, quoted=True, sleep=Sleeps()) as quoted:
        first = bare.post("/tickets", json=TICKET, idempotency_key="order-42")
        second = quoted.post("/tickets", json=TICKET, idempotency_key="order-42")
    assert first.request.headers["Idempotency-Key"] == "order-42"
    assert second.request.headers["Idempotency-Key"] == '"order-42"'
    assert is_replayed(second) and second.json() == first.json()
    assert _count(tickets) == 1


def test_key_in_the_header_is_the_call_s_key(tickets: RunningServer) -> None:
    """A key the caller puts in the Idempotency-Key header (Stripe's habit) is the call's key: a
    retry of the operation by the caller, with the same header, is replayed, not a second ticket.
    (It used to be replaced by a random key on every call.)"""
    _faults(tickets, lost=1.0)
    with Client(tickets.url, retry=Retry(attempts=2, base=0.01, cap=0.01), sleep=Sleeps()) as c:
        with pytest.raises(httpx.HTTPError):  # the answers of both attempts are lost
            c.post("/tickets", json=TICKET, headers={"Idempotency-Key": "order-42"})
        _faults(tickets)
        again = c.post("/tickets", json=TICKET, headers={"idempotency-key": "order-42"})
    assert again.request.headers["Idempotency-Key"] == "order-42" and is_replayed(again)
    assert _count(tickets) == 1


def test_a_key_given_for_a_method_outside_key_methods_is_sent(scripted: tuple[Scripted, str]) -> None:
    """``idempotency_key=`` on a PUT of a client whose key_methods leave PUT out: the key goes with
    the request (and every retry of it), instead of being dropped without a word; a PUT without one
    still carries none."""
    app, url = scripted
    app.then(503, retry_after="0").then(200)
    with Client(url, key_methods=("POST",), sleep=Sleeps()) as c:
        c.put("/x", json={}, idempotency_key="put-1")
        c.put("/x", json={})
    assert app.keys() == [header_key("put-1"), header_key("put-1"), None]


def test_key_header_rules(scripted: tuple[Scripted, str]) -> None:
    """The client's default key header names every call's key; a per-call key (argument or header)
    wins over it; the argument and the header must agree; the sf-string form is read when quoted."""
    app, url = scripted
    with Client(url, headers={"Idempotency-Key": "k-all"}) as c:
        c.post("/x", json={})
        c.post("/x", json={}, idempotency_key="k-1")
        c.post("/x", json={}, headers={"IDEMPOTENCY-KEY": "k-2"})
        c.post("/x", json={}, idempotency_key="k-3", headers={"Idempotency-Key": "k-3"})
        with pytest.raises(TypeError, match="two idempotency keys"):
            c.post("/x", json={}, idempotency_key="k-4", headers={"Idempotency-Key": "k-5"})
        with pytest.raises(TypeError, match="non-empty string"):
            c.post("/x", json={}, headers={"Idempotency-Key": ""})
    with Client(url, quoted=True) as c:
        c.post("/x", json={}, headers={"Idempotency-Key": '"k-6"'}, idempotency_key="k-6")
    assert app.keys() == ["k-all", "k-1", "k-2", "k-3", '"k-6"']


def test_each_logical_call_gets_its_own_key(scripted: tuple[Scripted, str]) -> None:
    """Two calls, two keys; a GET carries none."""
    app, url = scripted
    with Client(url) as c:
        c.post("/a", json={})
        c.post("/a", json={})
        c.get("/a")
    keys = app.keys()
    assert keys[0] and keys[1] and keys[0] != keys[1] and keys[2] is None


def test_header_key_keeps_or_hashes() -> None:
    """A key that is header-safe travels as is; anything else as the SHA-256 of it."""
    assert header_key("default:create_ticket:abc") == "default:create_ticket:abc"
    hashed = header_key("tâche-1:create:abc")
    assert hashed.startswith("sha256:") and len(hashed) == 71
    assert header_key("x" * 300).startswith("sha256:")


# --- statuses --------------------------------------------------------------------------------------


def test_409_waits_retry_after_without_spending_attempts(scripted: tuple[Scripted, str]) -> None:
    """409 (in progress): wait Retry-After and ask again with the same key; no attempt is spent."""
    app, url = scripted
    app.then(409, retry_after="2").then(409, retry_after="1").then(201, b'{"id":1}')
    sleeps = Sleeps()
    with Client(url, sleep=sleeps, retry=Retry(attempts=1)) as c:
        response = c.post("/tickets", json=TICKET)
    assert response.status_code == 201
    assert sleeps == [2.0, 1.0]
    assert len(set(app.keys())) == 1 and len(app.keys()) == 3


def test_409_for_too_long_is_in_progress(scripted: tuple[Scripted, str]) -> None:
    """After ``wait`` seconds of 409s the call ends with InProgress, naming the key to retry with."""
    app, url = scripted
    for _ in range(5):
        app.then(409, retry_after="1")
    sleeps = Sleeps()
    with Client(url, sleep=sleeps, wait=2.5) as c, pytest.raises(onceonly.InProgress) as caught:
        c.post("/tickets", json=TICKET)
    assert sleeps == [1.0, 1.0]
    assert caught.value.key == app.keys()[0]


@pytest.mark.parametrize("retry_after", ["0", "-5", "nan", "Wed, 21 Oct 2015 07:28:00 GMT"])
@pytest.mark.parametrize("face", ["sync", "async"])
def test_409_that_asks_for_no_wait_still_ends_in_progress(
    scripted: tuple[Scripted, str], retry_after: str, face: str
) -> None:
    """A 409 whose Retry-After asks for no wait (0, negative, nan, a date in the past) is not a busy
    loop: each pause is at least a floor that grows, and after ``wait`` seconds the call ends in
    InProgress (it used to ask again forever, thousands of times a second)."""
    app, url = scripted
    app.on_request = lambda _seen: app.then(409, retry_after=retry_after)  # every answer is a 409
    app.then(409, retry_after=retry_after)
    sleeps = Sleeps(limit=50)

    async def asend() -> None:
        async with AsyncClient(url, sleep=sleeps.asleep, wait=1.0) as c:
            await c.post("/x", json={})

    def send() -> None:
        with Client(url, sleep=sleeps, wait=1.0) as c:
            c.post("/x", json={})

    with pytest.raises(onceonly.InProgress):
        send() if face == "sync" else asyncio.run(asend())
    assert 2 <= len(sleeps) <= 5 and sum(sleeps) <= 1.0
    assert sleeps[0] >= 0.05 and all(b > a for a, b in itertools.pairwise(sleeps))
    assert len(set(app.keys())) == 1


def test_409_wait_is_measured_on_the_clock(scripted: tuple[Scripted, str]) -> None:
    """The time the 409 answers take counts toward ``wait``, not only the pauses: with answers that
    take 0.3 s and ``wait=0.5`` the call ends by the third ask, though its pauses add up to less."""
    app, url = scripted

    def slow_409(_seen: dict[str, str]) -> None:
        time.sleep(0.3)
        app.then(409, retry_after="0")

    app.on_request = slow_409
    sleeps = Sleeps(limit=50)
    started = time.monotonic()
    with Client(url, sleep=sleeps, wait=0.5) as c, pytest.raises(onceonly.InProgress):
        c.post("/x", json={})
    assert len(app.seen) <= 3, f"{len(app.seen)} asks in {time.monotonic() - started:.1f} s"
    with pytest.raises(ValueError, match="wait=nan"):
        Client(url, wait=float("nan"))


def test_422_problem_is_a_key_conflict(tickets: RunningServer) -> None:
    """The same key with another body: the server's 422 problem becomes onceonly.KeyConflict."""
    with Client(tickets.url) as c:
        c.post("/tickets", json=TICKET, idempotency_key="k-1")
        with pytest.raises(onceonly.KeyConflict) as caught:
            c.post("/tickets", json={**TICKET, "body": "re-worded"}, idempotency_key="k-1")
    assert caught.value.key == "k-1"
    assert "another request" in str(caught.value)


def test_422_validation_error_is_not_a_key_conflict(tickets: RunningServer) -> None:
    """A 422 about the request's content (the ticket service's body validation, a problem document
    too) is a definite failure, not a key conflict."""
    with Client(tickets.url) as c, pytest.raises(httpx.HTTPStatusError) as caught:
        c.post("/tickets", json={"title": "no session"})
    assert caught.value.response.status_code == 422
    assert caught.value.response.headers["content-type"] == "application/problem+json"


@pytest.mark.parametrize(
    ("doc", "conflict"),
    [
        pytest.param(
            {"type": "https://developer.example.com/idempotency", "title": "Idempotency-Key is already used"},
            True,
            id="the-drafts-example",
        ),
        pytest.param({"type": "urn:x:key-reused", "title": "Reused"}, True, id="key-reused-type"),
        pytest.param({"type": "about:blank", "title": "Invalid request"}, False, id="validation"),
        pytest.param(["not", "an", "object"], False, id="not-an-object"),
    ],
)
def test_only_a_422_problem_about_the_key_is_a_key_conflict(
    scripted: tuple[Scripted, str], doc: object, conflict: bool
) -> None:
    """A 422 problem+json is a KeyConflict when its type or title speaks of the idempotency key (as
    the draft's and onceonly's do); any other 422 is a definite failure."""
    app, url = scripted
    app.then(422, json.dumps(doc).encode(), content_type="application/problem+json")
    expected: type[Exception] = onceonly.KeyConflict if conflict else httpx.HTTPStatusError
    with Client(url, sleep=Sleeps()) as c, pytest.raises(expected):
        c.post("/x", json={}, idempotency_key="k-1")


def test_503_is_retried_after_retry_after(scripted: tuple[Scripted, str]) -> None:
    """503 (not executed) is retried with the key, waiting at least Retry-After."""
    app, url = scripted
    app.then(503, retry_after="3").then(201)
    sleeps = Sleeps()
    with Client(url, sleep=sleeps) as c:
        assert c.post("/x", json={}).status_code == 201
    assert sleeps[0] >= 3.0
    assert app.keys()[0] == app.keys()[1]


def test_500_is_resent_with_the_key_unless_told_not_to(scripted: tuple[Scripted, str]) -> None:
    """500 is an unknown outcome: re-sent with the same key (the server replays or runs once).
    With resend_unknown=False it is final: HTTPStatusError, one request."""
    app, url = scripted
    app.then(500).then(201)
    with Client(url, sleep=Sleeps()) as c:
        assert c.post("/x", json={}).status_code == 201
    assert len(app.keys()) == 2 and app.keys()[0] == app.keys()[1]
    app.then(500)
    with Client(url, sleep=Sleeps(), resend_unknown=False) as c, pytest.raises(httpx.HTTPStatusError):
        c.post("/x", json={})
    assert len(app.keys()) == 3


def test_safe_method_is_resent_on_an_unknown_outcome(scripted: tuple[Scripted, str]) -> None:
    """A GET carries no key, but re-sending it is safe (RFC 9110): a 502 is re-sent and the 200 returned,
    whatever ``resend_unknown`` says (that switch is about servers honouring keys)."""
    app, url = scripted
    app.then(502).then(200, b'{"ok":true}')
    with Client(url, sleep=Sleeps()) as c:
        response = c.get("/x")
    assert response.status_code == 200 and response.json() == {"ok": True}
    app.then(502).then(200)
    with Client(url, sleep=Sleeps(), resend_unknown=False) as c:
        assert c.request("OPTIONS", "/x").status_code == 200
    assert [s[":method"] for s in app.seen] == ["GET", "GET", "OPTIONS", "OPTIONS"]
    assert app.keys() == [None] * 4


def test_unsafe_method_without_a_key_is_not_resent(scripted: tuple[Scripted, str]) -> None:
    """A PUT left out of ``key_methods`` has no key: an unknown outcome (502) may have run, so it is
    final (one request), while a 503 (not executed) is still retried."""
    app, url = scripted
    app.then(502)
    with Client(url, sleep=Sleeps(), key_methods=("POST",)) as c, pytest.raises(httpx.HTTPStatusError) as caught:
        c.put("/x", json={})
    assert caught.value.response.status_code == 502
    assert app.keys() == [None]
    app.then(503).then(200)
    with Client(url, sleep=Sleeps(), key_methods=("POST",)) as c:
        assert c.put("/x", json={}).status_code == 200
    assert app.keys() == [None] * 3


def test_async_safe_method_resent_and_unsafe_without_key_not(scripted: tuple[Scripted, str]) -> None:
    """AsyncClient: a GET after a 502 is re-sent and succeeds; a key-less PUT after a 502 is final."""
    app, url = scripted
    app.then(502).then(200).then(502)

    async def scenario() -> tuple[int, int]:
        async with AsyncClient(url, sleep=Sleeps().asleep, key_methods=("POST",)) as c:
            got = await c.get("/x")
            with pytest.raises(httpx.HTTPStatusError) as caught:
                await c.put("/x", json={})
        return got.status_code, caught.value.response.status_code

    assert asyncio.run(scenario()) == (200, 502)
    assert [s[":method"] for s in app.seen] == ["GET", "GET", "PUT"]


def test_other_4xx_is_final(scripted: tuple[Scripted, str]) -> None:
    """404 and friends are definite failures: no retry; raised, or returned with raise_for_status=False."""
    app, url = scripted
    app.then(404).then(404)
    with Client(url, sleep=Sleeps()) as c, pytest.raises(httpx.HTTPStatusError):
        c.post("/x", json={})
    with Client(url, sleep=Sleeps(), raise_for_status=False) as c:
        assert c.post("/x", json={}).status_code == 404
    assert len(app.keys()) == 2


def test_attempts_run_out_on_5xx(scripted: tuple[Scripted, str]) -> None:
    """After the last attempt the final 5xx is raised for the caller (or its ledger) to classify."""
    app, url = scripted
    for _ in range(3):
        app.then(502)
    sleeps = Sleeps()
    retry = Retry(attempts=3, base=0.5, cap=8)
    with Client(url, sleep=sleeps, retry=retry) as c, pytest.raises(httpx.HTTPStatusError) as caught:
        c.post("/x", json={})
    assert caught.value.response.status_code == 502
    assert len(app.keys()) == 3 and len(set(app.keys())) == 1
    assert onceonly.classify(caught.value).verdict is onceonly.Verdict.UNKNOWN


def test_connect_error_backs_off_with_full_jitter(tmp_path: Path) -> None:
    """Nothing listening: not sent, so retried; the waits are the full-jitter draws of the policy."""
    from onceonly.tickets._serve import bind

    sock = bind()  # bound, never listening: connections are refused
    port = sock.getsockname()[1]
    sleeps = Sleeps()
    retry = Retry(attempts=4, base=0.5, cap=8)
    try:
        client = Client(f"http://127.0.0.1:{port}", sleep=sleeps, retry=retry, rng=random.Random(7))
        with client as c, pytest.raises(httpx.ConnectError):
            c.post("/x", json={})
    finally:
        sock.close()
    expected = random.Random(7)
    assert sleeps == [retry.backoff(n, expected) for n in (1, 2, 3)]
    assert DEFAULT_RETRY.attempts == 4


# --- inside a guarded tool ----------------------------------------------------------------------


def test_guarded_tool_sends_the_ledger_key(tickets: RunningServer, sqlite_url: str) -> None:
    """Inside a guarded tool the key is the ledger's: a crash-and-retry of the tool sends the same."""
    ledger = onceonly.Ledger.open(sqlite_url)

    @ledger.tool(name="create_ticket", key=("session_id", "title"))
    def create_ticket(session_id: str, title: str, body: str) -> dict[str, Any]:
        with Client(tickets.url) as c:
            response = c.post("/tickets", json={"session_id": session_id, "title": title, "body": body})
            out: dict[str, Any] = response.json()
            out["sent_key"] = response.request.headers["Idempotency-Key"]
            return out

    try:
        result = create_ticket(**TICKET)
        assert result["sent_key"] == header_key(create_ticket.key_for(**TICKET))
        assert create_ticket(**TICKET) == result  # replayed by the ledger: no second request at all
        assert _count(tickets) == 1
    finally:
        ledger.close()


def test_ledger_resend_after_a_lost_answer_sends_the_same_key(tickets: RunningServer, sqlite_url: str) -> None:
    """The ticket is committed but its answer lost; the client gives up at once (one attempt) and the
    ledger settles the unknown by running the tool again (``on_unknown="resend"``): both requests carry
    the ledger's one key, so the service makes one ticket and replays it."""
    _faults(tickets, lost=1.0)
    sent: list[str] = []
    ledger_sleeps = Sleeps(then=lambda: _faults(tickets))  # the network heals while the ledger backs off
    ledger = onceonly.Ledger.open(sqlite_url, sleep=ledger_sleeps)

    def record(request: httpx.Request) -> None:
        sent.append(request.headers["Idempotency-Key"])

    @ledger.tool(name="create_ticket", key=("session_id", "title"), on_unknown="resend")
    def create_ticket(session_id: str, title: str, body: str) -> dict[str, Any]:
        hooks = {"request": [record]}
        with Client(tickets.url, retry=Retry(attempts=1), sleep=Sleeps(), event_hooks=hooks) as c:
            response = c.post("/tickets", json={"session_id": session_id, "title": title, "body": body})
            assert is_replayed(response)
            out: dict[str, Any] = response.json()
            return out

    try:
        result = create_ticket(**TICKET)
    finally:
        ledger.close()
    assert len(ledger_sleeps) == 1
    assert sent == [header_key(create_ticket.key_for(**TICKET))] * 2
    assert _count(tickets) == 1
    assert httpx.get(f"{tickets.url}/tickets/by-idempotency-key/{sent[0]}").json() == result


@pytest.mark.parametrize("face", ["sync", "async"])
def test_each_keyed_request_of_a_tool_has_its_own_key(tickets: RunningServer, sqlite_url: str, face: str) -> None:
    """A tool that makes two tickets sends the ledger's key with the first and ``key#2`` with the
    second: two operations, two keys (with one, the service refused the second as a key reused with
    another body). The second answer is lost, the ledger re-sends the tool: the count starts again,
    the same keys go in the same order, and the service replays both. Two tickets."""
    heal = Sleeps(then=lambda: _faults(tickets))  # the network heals while the ledger backs off
    ledger = onceonly.Ledger.open(sqlite_url, sleep=heal, asleep=heal.asleep)
    sent: list[str] = []

    def ticket(title: str) -> dict[str, Any]:
        return {"session_id": "s-1", "title": title, "body": ""}

    @ledger.tool(name="two_sync", on_unknown="resend")
    def two_sync() -> list[int]:
        with Client(tickets.url, retry=Retry(attempts=1)) as c:
            first = c.post("/tickets", json=ticket("A"))
            sent.append(first.request.headers["Idempotency-Key"])
            if onceonly.current_call().attempt == 1:  # type: ignore[union-attr]
                _faults(tickets, lost=1.0)
            second = c.post("/tickets", json=ticket("B"))
            sent.append(second.request.headers["Idempotency-Key"])
            return [first.json()["id"], second.json()["id"]]

    @ledger.tool(name="two_async", on_unknown="resend")
    async def two_async() -> list[int]:
        async with AsyncClient(tickets.url, retry=Retry(attempts=1)) as c:
            first = await c.post("/tickets", json=ticket("A"))
            sent.append(first.request.headers["Idempotency-Key"])
            if onceonly.current_call().attempt == 1:  # type: ignore[union-attr]
                _faults(tickets, lost=1.0)
            second = await c.post("/tickets", json=ticket("B"))
            sent.append(second.request.headers["Idempotency-Key"])
            return [first.json()["id"], second.json()["id"]]

    try:
        ids = two_sync() if face == "sync" else asyncio.run(two_async())
        key = (two_sync if face == "sync" else two_async).key_for()
    finally:
        ledger.close()
    assert sent == [key, key, f"{key}#2"]  # the first attempt's second answer was lost
    assert ids == [1, 2] and _count(tickets) == 2


def test_key_numbers_are_per_attempt(scripted: tuple[Scripted, str], sqlite_url: str) -> None:
    """The numbering belongs to one attempt of one guarded call: a guarded tool called from another
    has its own count, requests with an explicit key do not count, and a second call of the tool
    starts again from the ledger's key."""
    app, url = scripted
    ledger = onceonly.Ledger.open(sqlite_url)
    c = Client(url)

    @ledger.tool(name="inner")
    def inner() -> None:
        c.post("/i", json={"n": 1})
        c.post("/i", json={"n": 2})

    @ledger.tool(name="outer", retry=Retry(attempts=1))
    def outer(n: int) -> None:
        c.post("/o", json={})
        c.get("/o")
        inner()
        c.post("/o", json={}, idempotency_key=f"mine-{n}")
        c.post("/o", json={"last": True})

    try:
        outer(1)
        outer(2)
        o1, o2, i = outer.key_for(1), outer.key_for(2), inner.key_for()
    finally:
        c.close()
        ledger.close()
    assert app.keys() == [o1, None, i, f"{i}#2", "mine-1", f"{o1}#2", o2, None, "mine-2", f"{o2}#2"]


def test_a_tool_that_sends_the_same_request_again_keeps_its_key(
    scripted: tuple[Scripted, str], sqlite_url: str
) -> None:
    """A tool with a retry loop of its own (the client's retries off, its own except-and-retry): the
    same request sent again is the same operation and keeps its key, so the server replays it; only
    a different request is numbered. Numbering every request sent made the repeat key#2: the server
    ran it a second time."""
    app, url = scripted
    app.then(504).then(201)  # the first answer is lost on the way back
    ledger = onceonly.Ledger.open(sqlite_url)
    c = Client(url, retry=Retry(attempts=1))

    @ledger.tool(name="refund")
    def refund(order: str) -> None:
        for _ in range(2):
            try:
                c.post("/refunds", json={"order": order})
                break
            except httpx.HTTPStatusError:  # its own retry: the same request again
                continue
        c.post("/notifications", json={"order": order})

    try:
        refund("o-1")
        key = refund.key_for("o-1")
    finally:
        c.close()
        ledger.close()
    assert app.keys() == [key, key, f"{key}#2"]


def test_concurrent_requests_of_one_tool_get_keys_of_their_own(scripted: tuple[Scripted, str], sqlite_url: str) -> None:
    """Two different requests sent at once by one async tool (``asyncio.gather``): two keys, numbered
    in the order the tasks start (the same on a re-run). Counted per task context, both got the
    ledger's key and the second was refused as a key reused with another body."""
    app, url = scripted
    ledger = onceonly.Ledger.open(sqlite_url)

    @ledger.tool(name="both")
    async def both(order: str) -> None:
        async with AsyncClient(url) as c:
            await asyncio.gather(c.post("/refunds", json={"order": order}), c.post("/notes", json={"order": order}))

    try:
        asyncio.run(both("o-1"))
        key = both.key_for("o-1")
    finally:
        ledger.close()
    assert sorted(app.keys()) == sorted([key, f"{key}#2"])
    by_path = {seen[":path"]: seen["idempotency-key"] for seen in app.seen}
    assert by_path == {"/refunds": key, "/notes": f"{key}#2"}, "numbered in the order the tasks start"


def test_reports_dispatch_tool_is_marked_sent_before_the_request(
    scripted: tuple[Scripted, str], sqlite_url: str
) -> None:
    """A ``reports_dispatch`` tool is pending until the client sends: the request arrives in_flight."""
    app, url = scripted
    ledger = onceonly.Ledger.open(sqlite_url)
    states: list[State] = []
    pending_before: list[State] = []

    @ledger.tool(name="send", reports_dispatch=True)
    def send(n: int) -> int:
        info = onceonly.current_call()
        assert info is not None
        rec = ledger.get(info.key)
        assert rec is not None
        pending_before.append(rec.state)
        app.on_request = lambda _seen: states.append(ledger.get(info.key).state)  # type: ignore[union-attr]
        with Client(url) as c:
            c.post("/x", json={"n": n})
        return n

    try:
        assert send(1) == 1
    finally:
        ledger.close()
    assert pending_before == [State.PENDING]
    assert states == [State.IN_FLIGHT]


@pytest.mark.parametrize("face", ["sync", "async"])
def test_an_unkeyed_unsafe_request_is_marked_sent_and_not_run_again(
    scripted: tuple[Scripted, str], sqlite_url: str, face: str
) -> None:
    """A ``reports_dispatch`` tool PUTs outside ``key_methods`` (no key) and gets 502, an unknown
    outcome. The PUT may have run, so the tool is marked sent before it goes: the record turns
    unknown and is parked, not read as "never sent" and run again. One PUT, and a GET lookup before
    it does not mark the tool sent."""
    app, url = scripted
    app.then(200)  # the GET
    for _ in range(3):  # the PUT, and any PUT after it
        app.then(502)
    ledger = onceonly.Ledger.open(sqlite_url)
    states: list[State] = []

    def note(info: Any) -> None:
        rec = ledger.get(info.key)
        assert rec is not None
        states.append(rec.state)

    @ledger.tool(name="put_sync", reports_dispatch=True, retry=Retry(attempts=3, base=0.001))
    def put_sync() -> None:
        with Client(url, key_methods=("POST",), retry=Retry(attempts=1)) as c:
            c.get("/lookup", params={"n": 1})
            note(onceonly.current_call())
            c.put("/x", json={"n": 1})

    @ledger.tool(name="put_async", reports_dispatch=True, retry=Retry(attempts=3, base=0.001))
    async def put_async() -> None:
        async with AsyncClient(url, key_methods=("POST",), retry=Retry(attempts=1)) as c:
            await c.get("/lookup", params={"n": 1})
            note(onceonly.current_call())
            await c.put("/x", json={"n": 1})

    try:
        with pytest.raises(onceonly.OutcomeUnknown):
            put_sync() if face == "sync" else asyncio.run(put_async())
        rec = ledger.get((put_sync if face == "sync" else put_async).key_for())
    finally:
        ledger.close()
    puts = [seen for seen in app.seen if seen[":method"] == "PUT"]
    assert len(puts) == 1
    assert states == [State.PENDING]  # the GET did not mark it sent
    assert rec is not None and rec.state is State.NEEDS_REVIEW


# --- async ----------------------------------------------------------------------------------------


def test_async_client_lost_answer_and_409(tickets: RunningServer, scripted: tuple[Scripted, str]) -> None:
    """AsyncClient: the same rules, awaited (lost answer re-sent and replayed; 409 waited on)."""
    app, url = scripted
    app.then(409, retry_after="1").then(201)

    async def scenario() -> tuple[httpx.Response, httpx.Response, Sleeps, Sleeps]:
        _faults(tickets, lost=1.0)
        lost_sleeps = Sleeps(then=lambda: _faults(tickets))
        busy_sleeps = Sleeps()
        async with AsyncClient(tickets.url, sleep=lost_sleeps.asleep) as c:
            replayed = await c.post("/tickets", json=TICKET)
        async with AsyncClient(url, sleep=busy_sleeps.asleep) as c:
            waited = await c.post("/x", json={})
        return replayed, waited, lost_sleeps, busy_sleeps

    replayed, waited, lost_sleeps, busy_sleeps = asyncio.run(scenario())
    assert is_replayed(replayed) and len(lost_sleeps) == 1
    assert waited.status_code == 201 and busy_sleeps == [1.0]
    assert _count(tickets) == 1


def test_async_guarded_tool_uses_the_ledger_key_and_marks_sent(scripted: tuple[Scripted, str], sqlite_url: str) -> None:
    """An async guarded tool sends the ledger's key and, with reports_dispatch, is in_flight on arrival."""
    app, url = scripted
    ledger = onceonly.Ledger.open(sqlite_url)
    states: list[State] = []

    @ledger.tool(name="asend", reports_dispatch=True)
    async def asend(n: int) -> str:
        info = onceonly.current_call()
        assert info is not None
        app.on_request = lambda _seen: states.append(ledger.get(info.key).state)  # type: ignore[union-attr]
        async with AsyncClient(url) as c:
            response = await c.post("/x", json={"n": n})
        return str(response.request.headers["Idempotency-Key"])

    try:
        sent = asyncio.run(asend(1))
    finally:
        ledger.close()
    assert sent == header_key(asend.key_for(1))
    assert states == [State.IN_FLIGHT]
