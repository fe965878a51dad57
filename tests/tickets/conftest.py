"""The ticket service on uvicorn, 127.0.0.1, in each idempotency mode: transactional (the keys in the
tickets' own SQLite transaction) and the store mode on every store of tests/conftest.py."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from onceonly.stores import Store, open_store
from onceonly.tickets import RunningServer, serve_in_thread
from tests.conftest import RUN_ID, STORES, join_url

MODES = ["transactional"] + [f"store-{name}" for name in STORES]


@pytest.fixture(name="mode", params=MODES)
def fixture_mode(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    """The idempotency store of the mode: ``None`` for transactional, else a fresh store URL."""
    name: str = request.param
    if name == "transactional":
        return None
    store = name.removeprefix("store-")
    if store == "sqlite":
        return f"sqlite:///{tmp_path / 'idempotency.db'}"
    test_id = uuid.uuid4().hex[:8]
    if store == "redis":
        return join_url(request.getfixturevalue("redis_base_url"), prefix=f"onceonly-test-{RUN_ID}-{test_id}")
    return join_url(request.getfixturevalue("postgres_database_url"), schema=f"t_{test_id}")


@pytest.fixture(name="tickets")
def fixture_tickets(mode: str | None, tmp_path: Path) -> Iterator[Callable[..., RunningServer]]:
    """Start the ticket service in this mode (``create_app`` keyword arguments pass through)."""
    servers: list[RunningServer] = []
    stores: list[Store] = []

    def start(**kwargs: Any) -> RunningServer:
        kwargs.setdefault("db_path", tmp_path / f"tickets-{len(servers)}.db")
        if kwargs.get("idempotency", True) and mode is not None and "store" not in kwargs:
            # Opened here, not by URL in the app, so that the test closes what it opened.
            kwargs["store"] = open_store(mode)
            stores.append(kwargs["store"])
        server = serve_in_thread(**kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
        server.app.state.db.close()  # type: ignore[attr-defined]
    for store in stores:
        store.close()


def ticket_count(server: RunningServer) -> int:
    """Tickets in the service's database (read from the file, not through the API)."""
    return int(server.app.state.db.count())  # type: ignore[attr-defined]


def new_ticket(session: str = "s-1", title: str = "printer broken", body: str = "on floor 2") -> dict[str, str]:
    return {"session_id": session, "title": title, "body": body}


def client(server: RunningServer, **kwargs: Any) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=kwargs.pop("timeout", 10.0), **kwargs)
