"""``probe="server"``: every face of onceonly.http settles an unknown outcome by asking the server's key
status endpoint (``GET /idempotency-keys/{key}``), over real HTTP on 127.0.0.1.

- the answer is lost after the commit: completed → sent again with the key, the server replays: one ticket;
- the connection drops before the request reaches the service: 404 → sent again, once: one ticket;
- the handler still runs when the client gives up reading: processing → wait, then replay or ``InProgress``.

Each is shown with ``resend_unknown=False`` (no blind resend), so the server's word is what settles it;
without the probe the same call stays unknown.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from onceonly import states as st
from onceonly.errors import InProgress, OutcomeUnknown
from onceonly.http import AsyncTransport, Client, RequestsAdapter, Transport, is_replayed
from onceonly.keystatus import STATUS_PATH, Told, read_status
from onceonly.policy import Retry
from onceonly.server import IdempotencyMiddleware, client_hash, store_key
from onceonly.states import State
from onceonly.tickets import RunningServer, serve_in_thread
from onceonly.tickets.app import create_app
from onceonly.tickets.faults import ABORT_KEY

TICKET = {"session_id": "s-1", "title": "printer broken", "body": "on floor 2"}
AUTH = {"Authorization": "Bearer alice"}
FACES = ["transport", "async_transport", "client", "requests"]


def _no_sleep(_seconds: float) -> None:
    """Backoff skipped: the tests count requests and tickets, not time."""


class Front:
    """In front of the ticket service: records what reaches it, and breaks the connection of the next
    ``POST /tickets`` once, before the service sees it (``before``) or after it answered (``after``)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[tuple[str, str]] = []
        self.drop: str | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.seen.append((scope["method"], scope["path"]))
        drop, self.drop = (self.drop, None) if scope["method"] == "POST" else (None, self.drop)
        if drop == "before":
            scope[ABORT_KEY]()  # reset: the request never reached the service
            await asyncio.sleep(0)
            return
        if drop == "after":
            held: list[Any] = []

            async def hold(message: Any) -> None:
                held.append(message)

            await self.app(scope, receive, hold)  # the service ran and stored its answer
            scope[ABORT_KEY]()
            await asyncio.sleep(0)
            return
        await self.app(scope, receive, send)


@pytest.fixture(name="service")
def fixture_service(tmp_path: Path) -> Iterator[tuple[Front, RunningServer, Callable[[], int]]]:
    """The reference ticket service (transactional mode, which serves the status path) behind ``Front``."""
    app = create_app(tmp_path / "tickets.db")
    front = Front(app)
    server = serve_in_thread(front)
    yield front, server, app.state.db.count
    server.stop()
    app.state.db.close()


def post(face: str, url: str, key: str, **options: Any) -> Any:
    """``POST /tickets`` with ``key`` through one face: its response (httpx or requests)."""
    headers = {**AUTH, "Idempotency-Key": key}
    options.setdefault("sleep", _no_sleep)
    if face == "transport":
        with httpx.Client(transport=Transport(**options), timeout=5) as c:
            r = c.post(f"{url}/tickets", json=TICKET, headers=headers)
            r.read()
            return r
    if face == "async_transport":
        options["sleep"] = _async(options["sleep"])

        async def go() -> httpx.Response:
            async with httpx.AsyncClient(transport=AsyncTransport(**options), timeout=5) as c:
                r = await c.post(f"{url}/tickets", json=TICKET, headers=headers)
                await r.aread()
                return r

        return asyncio.run(go())
    if face == "client":
        with Client(url, timeout=5, raise_for_status=False, **options) as c:
            return c.post("/tickets", json=TICKET, headers=headers)
    session = requests.Session()
    session.mount("http://", RequestsAdapter(**options))
    try:
        return session.post(f"{url}/tickets", json=TICKET, headers=headers, timeout=5)
    finally:
        session.close()


def _async(sleep: Callable[[float], Any]) -> Callable[[float], Any]:
    async def asleep(seconds: float) -> None:
        await asyncio.to_thread(sleep, seconds)

    return asleep


def _asked(front: Front) -> int:
    return sum(1 for m, p in front.seen if m == "GET" and p.startswith(STATUS_PATH + "/"))


@pytest.mark.parametrize("face", FACES)
def test_lost_answer_after_commit_is_confirmed_by_the_servers_word(face: str, service: Any) -> None:
    """The service committed the ticket and the answer was lost: the server says completed, the
    client sends the request again with its key and gets the stored answer, replayed: one ticket."""
    front, server, count = service
    front.drop = "after"
    got = post(face, server.url, "lost-1", probe="server", resend_unknown=False)
    assert got.status_code == 201 and is_replayed(got)
    assert count() == 1 and _asked(front) == 1


@pytest.mark.parametrize("face", FACES)
def test_without_the_probe_the_lost_answer_stays_unknown(face: str, service: Any) -> None:
    """The same lost answer without probe= and without a blind resend: the call ends in an error."""
    front, server, count = service
    front.drop = "after"
    with pytest.raises((httpx.HTTPError, requests.RequestException)):
        post(face, server.url, "lost-2", resend_unknown=False)
    assert count() == 1 and _asked(front) == 0


@pytest.mark.parametrize("face", FACES)
def test_request_that_never_arrived_is_sent_once_more(face: str, service: Any) -> None:
    """The connection broke before the service saw the request: the server has no record (404), so
    it is sent again with the same key, once: one ticket."""
    front, server, count = service
    front.drop = "before"
    got = post(face, server.url, "never-1", probe="server", resend_unknown=False)
    assert got.status_code == 201 and not is_replayed(got)
    assert count() == 1 and _asked(front) == 1
    assert [m for m, p in front.seen if p == "/tickets"] == ["POST", "POST"]


def test_probe_carries_the_callers_credentials_and_the_scoping_holds(service: Any) -> None:
    """The status GET goes with the request's Authorization; asked as someone else, the key is unknown."""
    _front, server, _count = service
    assert post("client", server.url, "mine").status_code == 201
    with httpx.Client(base_url=server.url, timeout=5) as c:
        mine = c.get(f"{STATUS_PATH}/mine", headers=AUTH)
        theirs = c.get(f"{STATUS_PATH}/mine", headers={"Authorization": "Bearer mallory"})
    assert read_status(mine.status_code, mine.headers, mine.content).told is Told.COMPLETED
    assert read_status(theirs.status_code, theirs.headers, theirs.content).told is Told.NOT_RUN


def test_server_without_the_endpoint_falls_back_to_the_rule_without_a_probe(tmp_path: Path) -> None:
    """A server that answers its own 404 at the status path cannot tell: the rule without a probe
    applies (here resend_unknown=True: sent again with the key, and replayed)."""
    app = create_app(tmp_path / "t.db")
    front = Front(app)
    server = serve_in_thread(front)
    try:
        front.drop = "after"
        got = post("client", server.url, "k", probe="server", status_path="/nowhere")
        assert got.status_code == 201 and is_replayed(got) and app.state.db.count() == 1
    finally:
        server.stop()
        app.state.db.close()


# --- processing: the handler still runs when the client stops reading ------------------------------


@pytest.fixture(name="slow")
def fixture_slow(tmp_path: Path) -> Iterator[tuple[str, Counter[str], threading.Event, threading.Event]]:
    """A store-mode server whose POST /slow waits on ``gate`` (after ``entered``)."""
    runs: Counter[str] = Counter()
    gate, entered = threading.Event(), threading.Event()

    async def slow(request: Request) -> Response:
        runs["slow"] += 1
        entered.set()
        await asyncio.to_thread(gate.wait, 10)
        return JSONResponse({"run": runs["slow"]}, status_code=201)

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/slow", slow, methods=["POST"])]),
        store=f"sqlite:///{tmp_path / 'keys.db'}",
        status_path=STATUS_PATH,
        retry_after=1,
    )
    server = serve_in_thread(app)
    yield server.url, runs, gate, entered
    gate.set()
    server.stop()


def test_processing_is_waited_out_then_replayed(slow: Any) -> None:
    """A read timeout while the handler runs: the server says processing; the client waits, and once
    the handler answered, sends again with its key and gets the replay: one run."""
    url, runs, gate, _entered = slow
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        gate.set()  # the handler finishes while the client waits
        time.sleep(0.3)

    with Client(url, timeout=httpx.Timeout(5, read=0.5), probe="server", resend_unknown=False, sleep=sleep) as c:
        got = c.post("/slow", headers={"Idempotency-Key": "p-1"})
    assert got.status_code == 201 and is_replayed(got)
    assert runs["slow"] == 1 and waits and waits[0] >= 1  # the server's Retry-After


def test_processing_past_wait_stays_in_progress(slow: Any) -> None:
    """The handler still runs after ``wait`` seconds of asking: ``InProgress`` (the outcome is open),
    never a second run."""
    url, runs, _gate, _entered = slow
    with (
        Client(url, timeout=httpx.Timeout(5, read=0.3), probe="server", wait=2.5, sleep=_no_sleep) as c,
        pytest.raises(InProgress),
    ):
        c.post("/slow", headers={"Idempotency-Key": "p-2"})
    assert runs["slow"] == 1


class _PostsReset(httpx.BaseTransport):
    """Every POST meets a reset (its outcome unknown to the client); other requests go through."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            raise httpx.ReadError("connection reset", request=request)
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def test_server_that_stopped_mid_request_leaves_it_unknown(tmp_path: Path) -> None:
    """A claim whose server died (its lease ran out unrenewed) reads unknown: the client does not
    send the request again (a retry would run it again) and raises ``OutcomeUnknown``."""
    runs: Counter[str] = Counter()
    secret = b"probe-test-secret-0123456789abcdef"

    async def handler(request: Request) -> Response:
        runs["n"] += 1
        return JSONResponse({}, status_code=201)

    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/x", handler, methods=["POST"])]),
        store=f"sqlite:///{tmp_path / 'keys.db'}",
        status_path=STATUS_PATH,
        client_secret=secret,
    )
    client = client_hash("", secret)
    stale = st.new_record(
        key=store_key("http", client, "dead-1"), scope=f"http:{client}", tool="http", fingerprint="f" * 64,
        args_json="{}", state=State.IN_FLIGHT, owner="dead", now=time.time() - 60, lease_seconds=30, reason="request",
    )  # fmt: skip
    assert app.store is not None and app.store.claim(stale) is None
    server = serve_in_thread(app)
    try:
        with (
            httpx.Client(transport=Transport(_PostsReset(), probe="server", retry=Retry(attempts=3)), timeout=5) as c,
            pytest.raises(OutcomeUnknown, match="stopped mid-request"),
        ):
            c.post(f"{server.url}/x", headers={"Idempotency-Key": "dead-1"})
        assert runs["n"] == 0
    finally:
        server.stop()
