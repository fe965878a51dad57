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
import json
import os
import socket
import sqlite3
import subprocess
import sys
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

import onceonly
from onceonly import Ledger
from onceonly import states as st
from onceonly.errors import InProgress, OutcomeUnknown
from onceonly.http import AsyncTransport, Client, RequestsAdapter, Transport, is_replayed
from onceonly.keystatus import STATUS_PATH, Told, read_status
from onceonly.policy import Retry
from onceonly.server import IdempotencyMiddleware, client_hash, store_key
from onceonly.states import Record, State
from onceonly.tickets import RunningServer, serve_in_thread
from onceonly.tickets.app import create_app
from onceonly.tickets.faults import ABORT_KEY

SRC = Path(onceonly.__file__).resolve().parent.parent
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


# --- the reconciler: a caller killed mid-request, a tool on the default on_unknown ------------------

CALLER = '''
"""A caller whose tool posts a ticket through Transport(probe="server"); imported by the reconciler
(--app caller:ledger) for its tools, run by the test, and killed mid-request."""
import os
import sys

import httpx

import onceonly
from onceonly.http import Transport

ledger = onceonly.Ledger.open(os.environ["CALLER_LEDGER"])
PROBE = os.environ.get("CALLER_PROBE") == "server"


@ledger.tool(name="open_ticket", reports_dispatch=True, lease=0.5)  # on_unknown: the default, review
def open_ticket(url: str, title: str) -> int:
    transport = Transport(probe="server", resend_unknown=False) if PROBE else Transport(resend_unknown=False)
    with httpx.Client(transport=transport, timeout=30) as c:
        r = c.post(url, json={"session_id": "s-1", "title": title, "body": "b"},
                   headers={"Authorization": "Bearer alice"})
        return r.status_code


if __name__ == "__main__":
    print("status", open_ticket(sys.argv[1], sys.argv[2]), flush=True)
'''


class Hang:
    """In front of a service: the next POST is held for ever, after the service ran it (``after``) or
    before it reached it (``before``); ``seen`` is set once it is held."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.mode: str | None = None
        self.seen = threading.Event()
        self.status_down = False  # GET answers 503: the status path cannot be asked

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "GET" and self.status_down:
            await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"down for maintenance"})
            return
        mode = None
        if scope["type"] == "http" and scope["method"] == "POST":
            mode, self.mode = self.mode, None
        if mode is None:
            await self.app(scope, receive, send)
            return
        if mode == "after":

            async def hold(message: Any) -> None:
                pass

            await self.app(scope, receive, hold)
        self.seen.set()
        while (await receive())["type"] != "http.disconnect":  # no answer: the caller is killed waiting
            pass


def _caller(tmp_path: Path, ledger_url: str, probe: bool) -> dict[str, str]:
    (tmp_path / "caller.py").write_text(CALLER)
    env = {**os.environ, "CALLER_LEDGER": ledger_url, "PYTHONPATH": os.pathsep.join([str(SRC), str(tmp_path)])}
    if probe:
        env["CALLER_PROBE"] = "server"
    return env


def _run_killed(env: dict[str, str], tmp_path: Path, url: str, hang: Hang) -> None:
    """Run the caller until its request is held by ``hang``, then SIGKILL it: no settle, no cleanup."""
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "caller.py"), url, "printer broken"], env=env, cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert hang.seen.wait(30), f"the request never came (the caller exited {proc.poll()})"
    finally:
        proc.kill()
        proc.wait(10)
    time.sleep(0.6)  # its lease (0.5 s) runs out


def _reconcile(env: dict[str, str], tmp_path: Path, *extra: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "onceonly", "reconcile", "--app", "caller:ledger", "--app-dir", str(tmp_path),
         "--once", "--wait", "0", "--json", "--server-header", "Authorization: env:CALLER_TOKEN", *extra],
        env={**env, "CALLER_TOKEN": "Bearer alice"}, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode in (0, 3), proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    report["counts"] = {k: n for k, n in report["counts"].items() if n}
    return report


@pytest.fixture(name="hung_tickets")
def fixture_hung_tickets(tmp_path: Path) -> Iterator[tuple[Hang, str, Callable[[], int]]]:
    app = create_app(tmp_path / "tickets.db")
    hang = Hang(app)
    server = serve_in_thread(hang)
    yield hang, f"{server.url}/tickets", app.state.db.count
    server.stop()
    app.state.db.close()


def _record(ledger_url: str) -> Record:
    with Ledger.open(ledger_url) as ledger:
        (rec,) = ledger.list()
        return rec


def test_reconcile_confirms_a_request_the_server_completed(tmp_path: Path, hung_tickets: Any) -> None:
    """The caller died after the service committed its ticket: `onceonly reconcile` asks the server
    (with --server-header credentials), which says completed: confirmed with the stored status, not
    parked, though the tool is on the default on_unknown (review), even with --review-after 0."""
    hang, url, count = hung_tickets
    ledger_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = _caller(tmp_path, ledger_url, probe=True)
    hang.mode = "after"
    _run_killed(env, tmp_path, url, hang)
    assert _record(ledger_url).state is State.IN_FLIGHT
    report = _reconcile(env, tmp_path, "--review-after", "0")
    assert report["counts"] == {"confirmed": 1}, report
    rec = _record(ledger_url)
    assert rec.state is State.CONFIRMED and rec.via == "reconcile-server"
    target = st.dispatch_target(rec)
    assert target is not None and target["method"] == "POST" and target["url"] == url
    assert rec.result == {"status": 201, "key": target["key"], "settled_by": "server"}
    assert "Bearer" not in rec.history_json  # credentials never reach the record
    assert count() == 1


def test_reconcile_fails_a_request_that_never_reached_the_server_and_it_is_sent_once(
    tmp_path: Path, hung_tickets: Any
) -> None:
    """The caller died while its request had not reached the service: the server has no record, so
    the reconciler marks it failed (nothing ran) and the next call sends it, once."""
    hang, url, count = hung_tickets
    ledger_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = _caller(tmp_path, ledger_url, probe=True)
    hang.mode = "before"
    _run_killed(env, tmp_path, url, hang)
    report = _reconcile(env, tmp_path, "--review-after", "0")
    assert report["counts"] == {"failed": 1}, report
    assert count() == 0
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "caller.py"), url, "printer broken"], env=env, capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and "status 201" in proc.stdout, proc.stderr
    assert count() == 1 and _record(ledger_url).state is State.CONFIRMED


def test_without_the_probe_the_dead_callers_record_goes_to_review(tmp_path: Path, hung_tickets: Any) -> None:
    """The same death with a transport without probe="server": no target was recorded, so the tool's
    on_unknown (review) applies and a person must settle it."""
    hang, url, count = hung_tickets
    ledger_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = _caller(tmp_path, ledger_url, probe=False)
    hang.mode = "after"
    _run_killed(env, tmp_path, url, hang)
    report = _reconcile(env, tmp_path, "--review-after", "0")
    assert report["counts"] == {"parked": 1}, report
    assert _record(ledger_url).state is State.NEEDS_REVIEW and count() == 1


def test_a_record_parked_while_its_server_could_not_be_asked_is_settled_by_it_later(
    tmp_path: Path, hung_tickets: Any
) -> None:
    """The caller died after the service committed; the status path was down at the first reconcile,
    so the default on_unknown parked it for a person. A later reconcile asks the server again and its
    word settles the parked record: confirmed, nothing sent again."""
    hang, url, count = hung_tickets
    ledger_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = _caller(tmp_path, ledger_url, probe=True)
    hang.mode = "after"
    _run_killed(env, tmp_path, url, hang)
    hang.status_down = True
    assert _reconcile(env, tmp_path, "--review-after", "0")["counts"] == {"parked": 1}
    assert _record(ledger_url).state is State.NEEDS_REVIEW
    again = _reconcile(env, tmp_path, "--review-after", "0")  # still down: it stays a person's
    assert again["counts"] == {"skipped": 1} and _record(ledger_url).state is State.NEEDS_REVIEW, again
    hang.status_down = False
    report = _reconcile(env, tmp_path, "--review-after", "0")
    assert report["counts"] == {"confirmed": 1}, report
    rec = _record(ledger_url)
    assert rec.state is State.CONFIRMED and rec.via == "reconcile-server"
    assert count() == 1


def test_reconcile_waits_while_the_server_processes_then_confirms(tmp_path: Path, slow: Any) -> None:
    """The caller died while the handler still ran: the server says processing, the record waits;
    once the handler answered, the next run confirms it. One run of the handler."""
    url, runs, gate, entered = slow
    ledger_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = _caller(tmp_path, ledger_url, probe=True)
    (tmp_path / "caller.py").write_text(CALLER)
    proc = subprocess.Popen(
        [sys.executable, str(tmp_path / "caller.py"), f"{url}/slow", "t"], env=env, cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert entered.wait(30)
    finally:
        proc.kill()
        proc.wait(10)
    time.sleep(0.6)
    first = _reconcile(env, tmp_path, "--review-after", "0")
    assert first["counts"] == {"waiting": 1}, first
    assert "runs now" in first["records"][0]["detail"]
    gate.set()
    deadline = time.monotonic() + 10
    while True:
        again = _reconcile(env, tmp_path, "--review-after", "0")
        if again["counts"] != {"waiting": 1} or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert again["counts"] == {"confirmed": 1}, again
    assert runs["slow"] == 1


@pytest.mark.parametrize("mode", ["transactional", "store"])
def test_the_ticket_service_serves_the_status_path_in_both_modes(mode: str, tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path / 'keys.db'}" if mode == "store" else None
    with (
        serve_in_thread(db_path=tmp_path / "tickets.db", store=store) as server,
        httpx.Client(base_url=server.url, headers=AUTH, timeout=5) as c,
    ):
        assert c.post("/tickets", json=TICKET, headers={"Idempotency-Key": "t-1"}).status_code == 201
        doc = c.get(f"{STATUS_PATH}/t-1").json()
        assert doc["state"] == "completed" and doc["status"] == 201 and doc["replay"] is True
        assert c.get(f"{STATUS_PATH}/t-2").status_code == 404


def test_reconcile_refuses_a_server_header_it_cannot_send(tmp_path: Path) -> None:
    """--server-header takes 'NAME: VALUE' (env:VAR for a secret); anything else is bad usage, said."""
    for bad, said in [("Authorization", "NAME: VALUE"), ("Authorization: env:NOT_SET_HERE_1", "is not set")]:
        proc = subprocess.run(
            [sys.executable, "-m", "onceonly", "reconcile", "--url", f"sqlite:///{tmp_path / 'l.db'}", "--once",
             "--server-header", bad],
            capture_output=True, text=True, timeout=60, check=False, env={**os.environ, "PYTHONPATH": str(SRC)},
        )  # fmt: skip
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr


# --- a server that dies mid-request: its claim reads processing, then unknown ------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _tickets_process(tmp_path: Path, port: int, *extra: str) -> subprocess.Popen[bytes]:
    """`onceonly tickets` in store mode (keys in keys.db, claims of 2 s), in a process of its own."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceonly", "tickets", "--port", str(port), "--db", str(tmp_path / "tickets.db"),
         "--idempotency-store", f"sqlite:///{tmp_path / 'keys.db'}", "--processing-timeout", "2", "--no-admin",
         "--log-level", "error", *extra],
        env={**os.environ, "PYTHONPATH": str(SRC)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the ticket service did not start")


def test_server_killed_after_its_commit_reads_processing_then_unknown_and_nothing_runs_twice(
    tmp_path: Path, sqlite_url: str
) -> None:
    """The ticket service dies (os._exit) after committing the ticket, before storing its answer. The
    caller cannot ask it then (it is down), so the tool's on_unknown (review) parks the record. Once
    the service is back, its key reads processing while the dead claim's lease lasts, then unknown:
    neither says "send it again", so nothing does; the reconciler leaves the parked record to its
    person (asked again, the server still cannot tell). One ticket, never a second."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    dying = _tickets_process(tmp_path, port, "--fault", "crash_after_commit=1")
    ledger = Ledger.open(sqlite_url)

    @ledger.tool(name="open_ticket", reports_dispatch=True)
    def open_ticket(title: str) -> int:
        with httpx.Client(transport=Transport(probe="server", resend_unknown=False), timeout=10) as c:
            return c.post(f"{url}/tickets", json={**TICKET, "title": title}, headers=AUTH).status_code

    try:
        with pytest.raises(OutcomeUnknown):
            open_ticket("printer broken")
        assert dying.wait(10) != 0  # the service died mid-request
        (rec,) = ledger.list()
        target = st.dispatch_target(rec)
        assert rec.state is State.NEEDS_REVIEW and target is not None
        back = _tickets_process(tmp_path, port)
        try:
            told = []
            for _ in range(2):
                answer = httpx.get(target["status"], headers=AUTH, timeout=5)
                told.append(read_status(answer.status_code, answer.headers, answer.content).told)
                time.sleep(2.2)  # the dead claim's lease (2 s) runs out
            assert told[-1] is Told.UNKNOWN and set(told) <= {Told.PROCESSING, Told.UNKNOWN}, told
            (line,) = ledger.reconcile(review_after=0, server_headers=AUTH).lines  # asked again: it cannot tell
            assert line.settlement.value == "skipped" and "waiting for a person" in line.detail, line
            assert ledger.get(rec.key).state is State.NEEDS_REVIEW  # type: ignore[union-attr]
            with pytest.raises(OutcomeUnknown):  # the parked call is not run again either
                open_ticket("printer broken")
            with sqlite3.connect(tmp_path / "tickets.db") as conn:
                assert conn.execute("SELECT COUNT(*) FROM tickets").fetchone() == (1,)
        finally:
            back.kill()
            back.wait(10)
    finally:
        dying.kill()
        ledger.close()
