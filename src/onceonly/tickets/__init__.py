"""The reference ticket service (``onceonly tickets``): FastAPI over SQLite, idempotency switchable,
fault injection (answer lost, delayed, failure before commit, crash). See docs/tickets.md.

    from onceonly.tickets import serve_in_thread

    with serve_in_thread(db_path="tickets.db", faults={"lost": 0.2}, seed=7) as server:
        ...  # server.url is http://127.0.0.1:PORT

Needs the ``server`` extra. Names are imported on first use, so ``import onceonly.tickets`` (which the
CLI does at start) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from onceonly.tickets._serve import RunningServer, serve, serve_in_thread
    from onceonly.tickets.app import TicketDB, create_app
    from onceonly.tickets.faults import KINDS, FaultInjector, FaultMiddleware, Faults

__all__ = [
    "KINDS",
    "FaultInjector",
    "FaultMiddleware",
    "Faults",
    "RunningServer",
    "TicketDB",
    "create_app",
    "serve",
    "serve_in_thread",
]

_WHERE = {
    "RunningServer": "onceonly.tickets._serve",
    "serve": "onceonly.tickets._serve",
    "serve_in_thread": "onceonly.tickets._serve",
    "TicketDB": "onceonly.tickets.app",
    "create_app": "onceonly.tickets.app",
    "KINDS": "onceonly.tickets.faults",
    "FaultInjector": "onceonly.tickets.faults",
    "FaultMiddleware": "onceonly.tickets.faults",
    "Faults": "onceonly.tickets.faults",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'onceonly.tickets' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
