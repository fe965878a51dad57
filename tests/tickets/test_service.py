"""The ticket service over uvicorn on 127.0.0.1, in each idempotency mode (transactional, and the
store mode on every store): its API, the status rules, concurrency, and each injected fault.
The ticket count read from the database file is the side effect that must happen once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest

from onceonly.tickets import RunningServer

from .conftest import client, new_ticket, ticket_count

Start = Callable[..., RunningServer]


def _key(k: str) -> dict[str, str]:
    return {"Idempotency-Key": k}


def test_create_read_list_and_lookup(tickets: Start) -> None:
    """POST answers 201 with the ticket and its Location; GET by id, by business key and by
    idempotency key find it."""
    server = tickets()
    with client(server) as c:
        created = c.post("/tickets", json=new_ticket(), headers=_key("k-1"))
        assert created.status_code == 201
        ticket = created.json()
        assert set(ticket) == {"id", "session_id", "title", "body", "created_at"}
        assert created.headers["location"] == f"/tickets/{ticket['id']}"
        assert c.get(f"/tickets/{ticket['id']}").json() == ticket
        assert c.get("/tickets", params={"session_id": "s-1"}).json() == {"tickets": [ticket]}
        assert c.get("/tickets", params={"session_id": "s-1", "title": "printer broken"}).json()["tickets"] == [ticket]
        assert c.get("/tickets", params={"session_id": "s-1", "title": "other"}).json() == {"tickets": []}
        assert c.get("/tickets/by-idempotency-key/k-1").json() == ticket
        missing = c.get("/tickets/by-idempotency-key/nope")
        assert missing.status_code == 404 and missing.headers["content-type"] == "application/problem+json"
        assert c.get("/tickets/999").status_code == 404
        assert c.get("/health").json()["ok"] is True


def test_status_rules(tickets: Start) -> None:
    """Missing key 400, malformed 400, replay with Idempotent-Replayed, other body 422, all problem+json."""
    server = tickets()
    with client(server) as c:
        assert c.post("/tickets", json=new_ticket()).status_code == 400
        assert c.post("/tickets", json=new_ticket(), headers=_key("k" * 256)).status_code == 400
        assert c.post("/tickets", json=new_ticket(), headers=_key('"unclosed')).status_code == 400
        first = c.post("/tickets", json=new_ticket(), headers=_key("k-1"))
        replay = c.post("/tickets", json=new_ticket(), headers=_key('"k-1"'))
        other = c.post("/tickets", json=new_ticket(body="re-worded"), headers=_key("k-1"))
    assert first.status_code == replay.status_code == 201
    assert replay.json() == first.json()
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.headers["location"] == first.headers["location"]
    assert other.status_code == 422 and other.headers["content-type"] == "application/problem+json"
    assert ticket_count(server) == 1


def test_other_client_gets_no_access(tickets: Start) -> None:
    """Bob reusing Alice's key creates Bob's own ticket; he can neither replay nor look up hers."""
    server = tickets()
    with (
        client(server, headers={"Authorization": "Bearer alice"}) as alice,
        client(server, headers={"Authorization": "Bearer bob"}) as bob,
    ):
        hers = alice.post("/tickets", json=new_ticket(), headers=_key("shared")).json()
        assert bob.get("/tickets/by-idempotency-key/shared").status_code == 404
        his = bob.post("/tickets", json=new_ticket(), headers=_key("shared"))
        assert his.status_code == 201 and "idempotent-replayed" not in his.headers
        assert his.json()["id"] != hers["id"]
        assert bob.get("/tickets/by-idempotency-key/shared").json() == his.json()
        assert alice.get("/tickets/by-idempotency-key/shared").json() == hers
    assert ticket_count(server) == 2


def test_fifty_concurrent_requests_make_one_ticket(tickets: Start) -> None:
    """50 POSTs with one key at once: one ticket; 49 replays or 409s; never a second row."""
    server = tickets()

    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as c:
            return await asyncio.gather(
                *(c.post("/tickets", json=new_ticket(), headers=_key("burst")) for _ in range(50))
            )

    responses = asyncio.run(burst())
    fresh = [r for r in responses if r.status_code == 201 and "idempotent-replayed" not in r.headers]
    replayed = [r for r in responses if r.headers.get("idempotent-replayed") == "true"]
    busy = [r for r in responses if r.status_code == 409]
    assert len(fresh) == 1
    assert len(replayed) + len(busy) == 49
    assert {r.json()["id"] for r in replayed} <= {fresh[0].json()["id"]}
    assert ticket_count(server) == 1


def test_fail_fault_writes_nothing_and_the_retry_runs(tickets: Start) -> None:
    """A failure before the commit answers 503 with no ticket; the same key then creates it once."""
    server = tickets(faults={"fail": 1.0})
    with client(server) as c:
        failed = c.post("/tickets", json=new_ticket(), headers=_key("k-1"))
        assert failed.status_code == 503 and failed.headers["retry-after"] == "1"
        assert ticket_count(server) == 0
        assert c.put("/admin/faults", json={}).status_code == 200
        retried = c.post("/tickets", json=new_ticket(), headers=_key("k-1"))
    assert retried.status_code == 201 and "idempotent-replayed" not in retried.headers
    assert ticket_count(server) == 1


def test_lost_answer_is_a_reset_and_the_retry_replays(tickets: Start) -> None:
    """The answer is lost after the commit: the client sees a reset connection, no status at all;
    its retry with the same key gets the ticket that was made, and no second one."""
    server = tickets(faults={"lost": 1.0})
    with client(server) as c, pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
        c.post("/tickets", json=new_ticket(), headers=_key("k-1"))
    assert ticket_count(server) == 1
    with client(server) as c:
        c.put("/admin/faults", json={})
        retried = c.post("/tickets", json=new_ticket(), headers=_key("k-1"))
        faults = c.get("/admin/faults").json()
    assert retried.status_code == 201 and retried.headers["idempotent-replayed"] == "true"
    assert ticket_count(server) == 1
    assert faults["requests"] == 1 and faults["injected"]["lost"] == 0  # counts restart with the settings


def test_delayed_answer_times_out_and_the_retry_replays(tickets: Start) -> None:
    """The answer is held past the client's timeout; the retry (while it is still held) replays."""
    server = tickets(faults={"delay": 1.0, "delay_seconds": 1.5})
    with client(server, timeout=0.3) as c, pytest.raises(httpx.ReadTimeout):
        c.post("/tickets", json=new_ticket(), headers=_key("k-1"))
    with client(server) as c:
        c.put("/admin/faults", json={})
        retried = c.post("/tickets", json=new_ticket(), headers=_key("k-1"))
    assert retried.headers["idempotent-replayed"] == "true"
    assert ticket_count(server) == 1


@pytest.mark.parametrize("mode", ["transactional"], indirect=True)
def test_without_idempotency_every_post_creates(tickets: Start) -> None:
    """--no-idempotency is the naive server: the same key twice makes two tickets (the demo's baseline)."""
    server = tickets(idempotency=False)
    with client(server) as c:
        a = c.post("/tickets", json=new_ticket(), headers=_key("k-1"))
        b = c.post("/tickets", json=new_ticket(), headers=_key("k-1"))
        c_ = c.post("/tickets", json=new_ticket())
        lookup = c.get("/tickets/by-idempotency-key/k-1").json()
    assert a.status_code == b.status_code == c_.status_code == 201
    assert a.json()["id"] != b.json()["id"]
    assert lookup == a.json()  # the first ticket made with the key
    assert ticket_count(server) == 3


@pytest.mark.parametrize("mode", ["transactional"], indirect=True)
def test_admin_endpoint_sets_and_reports_faults(tickets: Start) -> None:
    """PUT /admin/faults changes the faults at run time; impossible settings are refused (422)."""
    server = tickets(seed=3)
    with client(server) as c:
        assert c.get("/admin/faults").json()["faults"]["seed"] == 3
        assert c.put("/admin/faults", json={"lost": 0.7, "fail": 0.7}).status_code == 422
        assert c.put("/admin/faults", json={"lost": 2}).status_code == 422
        assert c.put("/admin/faults", json={"bogus": 1}).status_code == 422
        assert c.put("/admin/faults", json={"delay_seconds": 601}).status_code == 422
        assert c.put("/admin/faults", json={"seed": "x"}).status_code == 422
        state = c.put("/admin/faults", json={"fail": 1.0, "seed": 9}).json()
        assert state["faults"]["fail"] == 1.0 and state["faults"]["seed"] == 9
        c.post("/tickets", json=new_ticket(), headers=_key("k-1"))
        assert c.get("/admin/faults").json()["injected"]["fail"] == 1
    no_admin = tickets(admin=False)
    with client(no_admin) as c:
        assert c.get("/admin/faults").status_code == 404


@pytest.mark.parametrize("mode", ["transactional"], indirect=True)
@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        pytest.param("POST", "/tickets", b'{"session_id": NaN, "title": "t"}', id="nan"),
        pytest.param("POST", "/tickets", b'{"session_id": "s", "title": Infinity}', id="infinity"),
        pytest.param("POST", "/tickets", b'{"session_id": "s", "title": "t", "body": 1e400}', id="1e400"),
        pytest.param("POST", "/tickets", b'{"session_id": "\\ud800", "title": "t"}', id="lone-surrogate"),
        pytest.param("POST", "/tickets", b'{"session_id": "s", "title": "t", "\\udfff": 1}', id="surrogate-name"),
        pytest.param("POST", "/tickets", b'{"session_id": "s"', id="not-json"),
        pytest.param("POST", "/tickets", b'{"title": "t"}', id="missing-field"),
        pytest.param("PUT", "/admin/faults", b'{"lost": NaN}', id="faults-nan"),
        pytest.param("PUT", "/admin/faults", b'{"seed": 1e400}', id="faults-1e400"),
    ],
)
def test_invalid_json_is_a_422_problem(tickets: Start, method: str, path: str, body: bytes) -> None:
    """A body the API cannot take, even one holding NaN, Infinity, a number past a double or a lone
    surrogate (which the input echo of FastAPI's own answer cannot encode), is a 422
    application/problem+json that says which field is wrong; nothing is created."""
    server = tickets()
    headers = {"content-type": "application/json", **_key("k-invalid")}
    with client(server) as c:
        response = c.request(method, path, content=body, headers=headers)
        faults = c.get("/admin/faults").json()["faults"]
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    doc = response.json()
    assert doc["status"] == 422 and doc["title"] == "Invalid request" and doc["detail"]
    assert doc["errors"] and all({"loc", "msg", "type"} <= set(e) for e in doc["errors"])
    assert "input" not in response.text
    assert ticket_count(server) == 0 and faults["lost"] == 0.0
