"""Timeouts after the work was done: settled by a probe, or by resending the same key to a server
that honours it. One side effect each time."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

import onceonly
from onceonly import NOT_FOUND, Ledger, Retry, State
from onceonly.stores import open_store
from tests._settling import Fault, FlakyStore
from tests._workers import count_effects, effects_db


@pytest.mark.parametrize(
    ("work_seconds", "settle", "via"), [(0.4, 0.6, "late:1"), (0.8, 0.2, "probe")], ids=["late-first", "probe-first"]
)
def test_timeout_after_work_settled_by_probe(
    sqlite_url: str, tmp_path: Path, work_seconds: float, settle: float, via: str
) -> None:
    """The attempt outlives timeout= after doing its work; the late answer or the probe settles it; once."""
    effects_path = tmp_path / "effects.db"
    conn = effects_db(effects_path)
    ledger = Ledger.open(sqlite_url)

    def probe(args: dict[str, Any], key: str) -> Any:
        row = conn.execute("SELECT worker FROM effects WHERE op = ?", (args["title"],)).fetchone()
        return NOT_FOUND if row is None else {"title": args["title"], "id": row[0]}

    @ledger.tool(name="create", timeout=0.1, on_unknown="probe", probe=probe, settle=settle)
    def create(title: str) -> dict[str, Any]:
        conn.execute("INSERT INTO effects VALUES (?, ?, ?)", (title, "1", time.time()))
        time.sleep(work_seconds)  # the answer comes too late for the caller
        return {"title": title, "id": "1"}

    out = create.outcome("printer")
    # A late answer that lands during the settle wait confirms the record itself; otherwise the probe
    # does. Either way: the result, once.
    assert out.result == {"title": "printer", "id": "1"} and out.via == via
    time.sleep(work_seconds)  # let the late result arrive: the same attempt, so no conflict is counted
    rec = ledger.get(out.key)
    assert rec is not None and rec.state is State.CONFIRMED and rec.conflicts == 0
    assert count_effects(effects_path) == {"printer": 1}
    ledger.close()
    conn.close()


class _KeyHonouringServer(ThreadingHTTPServer):
    """A tiny server with an idempotency table: a repeated key gets the first response, never a 2nd effect."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.responses: dict[str, threading.Event | bytes] = {}
        self.effects: list[str] = []
        self.slow_first = True


class _Handler(BaseHTTPRequestHandler):
    server: _KeyHonouringServer

    def do_POST(self) -> None:
        key = self.headers["Idempotency-Key"]
        body = self.rfile.read(int(self.headers["Content-Length"]))
        with self.server.lock:
            entry = self.server.responses.get(key)
            if entry is None:
                self.server.responses[key] = done = threading.Event()
        if entry is None:
            self.server.effects.append(key)
            payload = json.dumps({"ticket": len(self.server.effects), "echo": json.loads(body)}).encode()
            with self.server.lock:
                self.server.responses[key] = payload
            done.set()
            if self.server.slow_first:
                self.server.slow_first = False
                time.sleep(0.5)  # the work is done; the answer misses the client's timeout
        else:
            if isinstance(entry, threading.Event):
                entry.wait(5)
            payload = self.server.responses[key]  # type: ignore[assignment]
        assert isinstance(payload, bytes)
        try:
            self.send_response(201)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:
            pass  # the client gave up on this one

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(name="server")
def fixture_server() -> Iterator[_KeyHonouringServer]:
    """The key-honouring server on 127.0.0.1, on a free port."""
    server = _KeyHonouringServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_timeout_settled_by_resend(sqlite_url: str, server: _KeyHonouringServer) -> None:
    """on_unknown='resend': the read timeout is unknown; the same key goes again; one side effect."""
    ledger = Ledger.open(sqlite_url)
    url = f"http://127.0.0.1:{server.server_address[1]}/tickets"
    sent_keys: list[str] = []

    @ledger.tool(name="post_ticket", on_unknown="resend", retry=Retry(attempts=3, base=0.05, cap=0.1))
    def post_ticket(title: str, *, idempotency_key: str) -> dict[str, Any]:
        sent_keys.append(idempotency_key)
        resp = httpx.post(url, json={"title": title}, headers={"Idempotency-Key": idempotency_key}, timeout=0.2)
        resp.raise_for_status()
        result: dict[str, Any] = resp.json()
        return result

    out = post_ticket.outcome("printer")
    assert out.result == {"ticket": 1, "echo": {"title": "printer"}}
    assert out.attempts == 2 and len(sent_keys) == 2 and len(set(sent_keys)) == 1
    assert server.effects == [out.key]
    ledger.close()


@pytest.mark.parametrize("answer_lost", [False, True], ids=["answered", "answer-lost"])
def test_a_late_result_landing_under_a_newer_attempt_is_counted_as_a_duplicate(
    store_url: str, tmp_path: Path, answer_lost: bool
) -> None:
    """Attempt 1 times out and runs on; the probe finds nothing yet, so attempt 2 claims the record.
    Attempt 1's late result confirms it while attempt 2 still holds it; then attempt 2 does its own
    side effect. Two side effects happened (the limit of probing too early): the ledger must count
    the second as a conflict, not take attempt 2 for "the same attempt, already confirmed"."""
    effects_path = tmp_path / "effects.db"
    conn = effects_db(effects_path)
    # answer-lost: attempt 1's late write lands but its answer is lost; re-read, it is ours, not a duplicate.
    flaky = FlakyStore(open_store(store_url), *([Fault("swap", frm=State.IN_FLIGHT, to=State.CONFIRMED, lands=True)]
                                                if answer_lost else []))  # fmt: skip
    ledger = Ledger(flaky)

    def probe(args: dict[str, Any], key: str) -> Any:
        row = conn.execute("SELECT worker FROM effects WHERE op = ?", (args["order"],)).fetchone()
        return NOT_FOUND if row is None else {"fence": int(row[0])}

    @ledger.tool(name="charge", on_unknown="probe", probe=probe, settle=0.0, timeout=0.5)
    def charge(order: str) -> dict[str, int]:
        info = onceonly.current_call()
        assert info is not None
        if info.fence == 1:
            time.sleep(0.8)  # past its timeout: the caller moves on, attempt 1 runs on
        else:  # attempt 2 acts only once attempt 1's late result has confirmed the record
            deadline = time.monotonic() + 10
            while (rec := ledger.get(info.key)) is None or rec.state is not State.CONFIRMED:
                assert time.monotonic() < deadline, "attempt 1's late result never landed"
                time.sleep(0.01)
        conn.execute("INSERT INTO effects VALUES (?, ?, ?)", (order, str(info.fence), time.time()))
        return {"fence": info.fence}

    try:
        charge.outcome("o-1")
        assert count_effects(effects_path) == {"o-1": 2}, "the scenario: two side effects"
        rec = ledger.get(charge.key_for("o-1"))
        assert rec is not None and rec.state is State.CONFIRMED
        assert rec.conflicts == 1, "the second side effect is a counted conflict"
        if answer_lost:  # the late write re-reads 0.1 s after its lost answer: it must not count itself
            for _ in range(10):
                time.sleep(0.05)
                again = ledger.get(charge.key_for("o-1"))
                assert again is not None and again.conflicts == 1, "the late write took itself for a duplicate"
        assert flaky.raised == (["swap"] if answer_lost else []), "the lost answer hit the late write"
        assert "late outcome of attempt 2" in rec.history[-1]["reason"]
    finally:
        ledger.close()
        conn.close()
