"""The server side of idempotency keys: an ASGI middleware and a transactional mode for SQL databases.

    from onceonly.server import IdempotencyMiddleware

    app.add_middleware(IdempotencyMiddleware, store="sqlite:///idempotency.db")

Needs the ``server`` extra (installing it: README.md) only for the Starlette/FastAPI glue
you bring yourself: the middleware is pure ASGI and imports no web framework.
See docs/server.md.
"""

from __future__ import annotations

from onceonly.server._http import (
    CONTEXT_KEY,
    DEFAULT_PROBLEM_DOCS,
    DEFAULT_REPLAY_HEADERS,
    BadKey,
    IdempotencyContext,
    Replay,
    StoredResponse,
    authorization_identity,
    client_hash,
    idempotency_context,
    parse_key,
    store_key,
)
from onceonly.server._status import DEFAULT_STATUS_PATH, KeyStatus
from onceonly.server.middleware import DEFAULT_RELEASE_STATUSES, IdempotencyMiddleware
from onceonly.server.transactional import IdempotencyTable, Slot

__all__ = [
    "CONTEXT_KEY",
    "DEFAULT_PROBLEM_DOCS",
    "DEFAULT_RELEASE_STATUSES",
    "DEFAULT_REPLAY_HEADERS",
    "DEFAULT_STATUS_PATH",
    "BadKey",
    "IdempotencyContext",
    "IdempotencyMiddleware",
    "IdempotencyTable",
    "KeyStatus",
    "Replay",
    "Slot",
    "StoredResponse",
    "authorization_identity",
    "client_hash",
    "idempotency_context",
    "parse_key",
    "store_key",
]
