"""Servers and fixtures for the tests of onceonly.http's transports, adapter and 409 handling.

``Service`` runs a ticket server on uvicorn, 127.0.0.1, records the headers of every request, and loses
the answer of the first ``POST /tickets`` after its commit: the reference ticket service with its
``lost`` fault (fixture ``tickets``) or a small server that answers 409 to a used key (``used``).
A test module imports the fixtures it uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import onceonly
from onceonly.tickets import FaultInjector, FaultMiddleware, Faults, RunningServer, serve_in_thread
from onceonly.tickets.app import create_app

TICKET = {"session_id": "s-1", "title": "printer broken", "body": "on floor 2"}


def _no_sleep(_seconds: float) -> None:
    """The ledger's backoff, skipped: the tests count requests and tickets, not time."""


async def _no_asleep(_seconds: float) -> None:
    """``_no_sleep`` for async tools."""


class Service:
    """A ticket server on uvicorn, 127.0.0.1, that records the headers of every request it gets and
    loses the answer of the first ``POST /tickets`` after its commit (the ticket service's ``lost``
    fault), then no other: the network heals before the next request arrives."""

    def __init__(self, app: Any, faults: FaultInjector, count: Callable[[], int], close: Callable[[], None]) -> None:
        self.seen: list[dict[str, str]] = []
        self._app = app
        self._faults = faults
        self.count = count
        self._close = close
        self.server: RunningServer = serve_in_thread(self)

    @property
    def url(self) -> str:
        return self.server.url

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            if self._faults.counts["lost"]:  # one answer lost: heal before this request is drawn
                self._faults.configure(Faults())
            seen = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            self.seen.append({**seen, ":method": scope["method"], ":path": scope["path"]})
        await self._app(scope, receive, send)

    def lose_next(self) -> None:
        """Lose the answer of the next ``POST /tickets`` (after its commit) again."""
        self._faults.configure(Faults(lost=1.0))

    def heal(self) -> None:
        """Lose no answer."""
        self._faults.configure(Faults())

    def posted_keys(self) -> list[str | None]:
        return [s.get("idempotency-key") for s in self.seen if s[":method"] == "POST"]

    def stop(self) -> None:
        self.server.stop()
        self._close()


def used_key_app() -> tuple[Starlette, list[dict[str, Any]]]:
    """A ticket server that answers **409 to a key it has seen** (and does not replay), with
    ``GET /tickets/by-idempotency-key/{key}``; a POST without a key always makes a ticket."""
    made: list[dict[str, Any]] = []
    by_key: dict[str, dict[str, Any]] = {}

    async def create(request: Request) -> JSONResponse:
        key = request.headers.get("idempotency-key")
        if key is not None and key in by_key:
            return JSONResponse({"error": f"the idempotency key {key} was used already"}, status_code=409)
        ticket = {"id": len(made) + 1, **(await request.json())}
        made.append(ticket)
        if key is not None:
            by_key[key] = ticket
        return JSONResponse(ticket, status_code=201)

    async def lookup(request: Request) -> JSONResponse:
        ticket = by_key.get(request.path_params["key"])
        return JSONResponse(ticket) if ticket else JSONResponse({"error": "no such key"}, status_code=404)

    routes = [Route("/tickets", create, methods=["POST"]), Route("/tickets/by-idempotency-key/{key:path}", lookup)]
    return Starlette(routes=routes), made


@contextmanager
def open_ledger(url: str, **kwargs: Any) -> Iterator[onceonly.Ledger]:
    """A ledger whose backoff does not sleep (``kwargs`` for ``Ledger.open``)."""
    ledger = onceonly.Ledger.open(url, sleep=_no_sleep, asleep=_no_asleep, **kwargs)
    try:
        yield ledger
    finally:
        ledger.close()


# --- fixtures: a test module imports the ones it uses -----------------------------------------------


@pytest.fixture(name="tickets")
def fixture_tickets(tmp_path: Path) -> Iterator[Service]:
    """The reference ticket service (transactional idempotency); the next answer is lost."""
    app = create_app(tmp_path / "tickets.db", faults={"lost": 1.0})
    service = Service(app, app.state.faults, app.state.db.count, app.state.db.close)
    yield service
    service.stop()


@pytest.fixture(name="used")
def fixture_used() -> Iterator[Service]:
    """The 409-for-a-used-key server; the next answer is lost."""
    app, made = used_key_app()
    faults = FaultInjector(Faults(lost=1.0))
    service = Service(FaultMiddleware(app, faults), faults, made.__len__, lambda: None)
    yield service
    service.stop()


@pytest.fixture(name="ledger")
def fixture_ledger(sqlite_url: str) -> Iterator[onceonly.Ledger]:
    """A SQLite ledger whose backoff does not sleep."""
    with open_ledger(sqlite_url) as ledger:
        yield ledger
