"""The reference ticket service: a small ticket API over SQLite, with idempotency and fault injection.

    POST /tickets                             {"session_id", "title", "body"} → 201 ticket
    GET  /tickets?session_id=…[&title=…]      {"tickets": [...]}: the business-key lookup for probes
    GET  /tickets/{id}                        one ticket
    GET  /tickets/by-idempotency-key/{key}    the ticket this client created with that key
    GET  /admin/faults, PUT /admin/faults     fault injection, at run time
    GET  /health

Idempotency, by default, is the transactional mode: ``IdempotencyMiddleware(transactional=True)``
parses and scopes the key, and the handler writes the ticket and its stored response in one SQLite
transaction (``IdempotencyTable``). With ``store=URL`` the middleware keeps keys in an onceonly store
instead (the store mode), and with ``idempotency=False`` there is none: every POST creates a ticket.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import os
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from onceonly.keys import KEY_PATTERN, MAX_KEY_LENGTH
from onceonly.server import (
    DEFAULT_STATUS_PATH,
    IdempotencyMiddleware,
    IdempotencyTable,
    KeyStatus,
    authorization_identity,
    client_hash,
    idempotency_context,
)
from onceonly.server._http import BadKey, request_key
from onceonly.stores import open_store
from onceonly.stores.base import Store
from onceonly.tickets.faults import CRASH_EXIT_CODE, FAULT_KEY, FaultInjector, FaultMiddleware, Faults

__all__ = ["TicketDB", "create_app"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tickets (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id      TEXT NOT NULL,
    title           TEXT NOT NULL,
    body            TEXT NOT NULL,
    created_at      TEXT NOT NULL,
    client          TEXT NOT NULL,
    idempotency_key TEXT
);
CREATE INDEX IF NOT EXISTS tickets_by_session ON tickets (session_id, title);
CREATE INDEX IF NOT EXISTS tickets_by_key ON tickets (client, idempotency_key)
"""
_COLUMNS = "id, session_id, title, body, created_at"
_MAX_ID = 2**63 - 1  # SQLite's INTEGER


# --- the API's shapes, for validation and the OpenAPI spec ----------------------------------------


class TicketIn(BaseModel):
    """A ticket to create."""

    model_config = ConfigDict(extra="forbid")

    session_id: str = Field(min_length=1, max_length=200, description="The agent session asking.")
    title: str = Field(min_length=1, max_length=500)
    body: str = Field(default="", max_length=20_000)


class Ticket(BaseModel):
    """A ticket as stored."""

    id: int
    session_id: str
    title: str
    body: str
    created_at: str = Field(description="UTC, ISO 8601.")


class TicketList(BaseModel):
    tickets: list[Ticket]


class Problem(BaseModel):
    """An error, as ``application/problem+json`` (RFC 9457)."""

    type: str
    title: str
    status: int
    detail: str


class FieldError(BaseModel):
    """One thing wrong with a request: where (``["body", "title"]``), what, and its kind."""

    loc: list[str | int]
    msg: str
    type: str


class InvalidRequest(Problem):
    """A request the API cannot take (422), as ``application/problem+json``, with what was wrong."""

    errors: list[FieldError]


class FaultState(BaseModel):
    faults: Faults
    injected: dict[str, int]
    requests: int


_PROBLEM_CONTENT: dict[str, Any] = {"content": {"application/problem+json": {"schema": Problem.model_json_schema()}}}
_PROBLEM: dict[str, Any] = {"description": "A problem (RFC 9457)", **_PROBLEM_CONTENT}


def _inlined(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with its ``$defs`` put in place: a ``#/$defs/…`` reference inside an
    OpenAPI response would point at the root of the whole document."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    result: dict[str, Any] = walk(schema)
    return result


_INVALID: dict[str, Any] = {
    "description": "A request the API cannot take: its path, query or body (problem+json, with errors)",
    "content": {"application/problem+json": {"schema": _inlined(InvalidRequest)}},
}


class InjectedFailure(Exception):
    """The ``fail`` fault: the handler gives up before its commit."""


def _fail() -> None:
    raise InjectedFailure("fault 'fail': the handler failed before its commit; nothing was written")


# --- the database ---------------------------------------------------------------------------------


class TicketDB:
    """The tickets in one SQLite file: one connection per thread, WAL, explicit transactions.

    .. versionadded:: 0.1
    """

    def __init__(self, path: str | Path, table: IdempotencyTable | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.table = table or IdempotencyTable()
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[sqlite3.Connection] = []
        #: Held around every write transaction of this process.
        self.write_lock = threading.Lock()
        conn = self.conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Statement by statement: executescript() would commit the transaction half-way.
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            self.table.create(conn)
            #: The key of the client hash, kept beside the keys: every process on this file agrees.
            self.client_secret = self.table.client_secret(conn)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def key_status(self, store_key: str) -> KeyStatus:
        """What the idempotency table knows of one client's key (the middleware's ``status_lookup``)."""
        return self.table.status(self.conn(), store_key)

    def get(self, ticket_id: int) -> dict[str, Any] | None:
        rows = self.conn().execute(f"SELECT {_COLUMNS} FROM tickets WHERE id = ?", (ticket_id,)).fetchall()
        return _ticket(rows[0]) if rows else None

    def find(self, session_id: str, title: str | None = None) -> list[dict[str, Any]]:
        sql = f"SELECT {_COLUMNS} FROM tickets WHERE session_id = ?"
        params: list[Any] = [session_id]
        if title is not None:
            sql += " AND title = ?"
            params.append(title)
        return [_ticket(r) for r in self.conn().execute(sql + " ORDER BY id", params).fetchall()]

    def by_key(self, client: str, key: str) -> dict[str, Any] | None:
        rows = (
            self.conn()
            .execute(
                f"SELECT {_COLUMNS} FROM tickets WHERE client = ? AND idempotency_key = ? ORDER BY id LIMIT 1",
                (client, key),
            )
            .fetchall()
        )
        return _ticket(rows[0]) if rows else None

    def count(self) -> int:
        return int(self.conn().execute("SELECT COUNT(*) FROM tickets").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()
        self._local = threading.local()


def _ticket(row: tuple[Any, ...]) -> dict[str, Any]:
    return {"id": row[0], "session_id": row[1], "title": row[2], "body": row[3], "created_at": row[4]}


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _problem(
    status: int,
    title: str,
    detail: str,
    slug: str,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> JSONResponse:
    body = {"type": f"urn:onceonly:problem:{slug}", "title": title, "status": status, "detail": detail, **(extra or {})}
    return JSONResponse(body, status_code=status, media_type="application/problem+json", headers=headers)


def _invalid(exc: RequestValidationError) -> JSONResponse:
    """422 problem+json for a request that failed validation. FastAPI's own answer echoes each bad
    input, which cannot always be encoded (NaN, Infinity, a lone surrogate): this one names where
    and what, never the input."""
    errors = [
        {
            "loc": [p if isinstance(p, int) else _printable(p) for p in e.get("loc", ())],
            "msg": _printable(_message(e)),
            "type": _printable(e.get("type", "")),
        }
        for e in exc.errors()
    ]
    where = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'request'}: {e['msg']}" for e in errors[:3])
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return _problem(422, "Invalid request", f"{where}{more}", "invalid-request", extra={"errors": errors})


def _message(error: Any) -> str:
    """An error's message, with the JSON parser's reason when the body is not JSON."""
    reason = (error.get("ctx") or {}).get("error")
    msg = str(error.get("msg", ""))
    return f"{msg}: {reason}" if error.get("type") == "json_invalid" and isinstance(reason, str) else msg


def _printable(value: object) -> str:
    """``value`` as text that encodes as UTF-8: a lone surrogate becomes its escape (``\\ud800``)."""
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")


# --- the application ------------------------------------------------------------------------------


# FastAPI builds each route's pydantic schemas when it is added, and pydantic's schema building is not
# thread-safe: two services made at once in one process (the demo's strategies, tests) could fail with
# AttributeError: __pydantic_core_schema__. One app is built at a time.
_BUILDING = threading.Lock()


def create_app(
    db_path: str | Path = ".onceonly/tickets.db",
    *,
    idempotency: bool = True,
    store: Store | str | None = None,
    faults: Faults | dict[str, Any] | None = None,
    seed: int | None = None,
    admin: bool = True,
    processing_timeout: float = 30.0,
    ttl: float = 86400.0,
) -> FastAPI:
    """The ticket service as a FastAPI app.

    Args:
        db_path: the SQLite file of the tickets (and, in transactional mode, of the keys).
        idempotency: put ``IdempotencyMiddleware`` in front of ``POST /tickets``. Off: every POST
            creates a ticket, key or not (the "naive" server of the demo).
        store: keep keys in this onceonly store (store mode) instead of in the tickets' own
            transaction (transactional mode, the default).
        faults: fault probabilities (``Faults`` or a dict such as ``{"lost": 0.2}``).
        seed: the seed of the fault draws (overrides ``faults.seed``).
        admin: serve ``/admin/faults`` to read and change the faults at run time.
        processing_timeout: the store mode's claim lease (seconds); see ``IdempotencyMiddleware``.
        ttl: seconds a completed key is replayed.

    The app's ``state`` holds ``db`` (``TicketDB``), ``faults`` (``FaultInjector``) and ``store``
    (the store mode's ``Store``: one opened here from a URL is closed at the lifespan shutdown). A
    store that cannot be opened, or a setting the middleware refuses, raises here.

    .. versionadded:: 0.1
    """
    with _BUILDING:
        if isinstance(faults, dict):
            faults = Faults.from_mapping(faults)
        faults = faults or Faults()
        if seed is not None:
            faults = dataclasses.replace(faults, seed=seed)
        transactional = idempotency and store is None
        # Opened now, not by the middleware at the first request: a bad URL or an unreachable store
        # fails here, before anything is served. A store opened here is closed at shutdown.
        opened = open_store(store) if isinstance(store, str) and idempotency else None
        try:
            table = IdempotencyTable(ttl=ttl)
            db = TicketDB(db_path, table)
        except BaseException:
            if opened is not None:
                opened.close()
            raise
        injector = FaultInjector(faults)

        @contextlib.asynccontextmanager
        async def lifespan(app: FastAPI) -> AsyncIterator[None]:
            yield
            if opened is not None:
                closer = getattr(opened, "aclose", None)
                if closer is not None:
                    await closer()  # the async face's connections belong to this loop
                opened.close()

        app = FastAPI(
            lifespan=lifespan,
            title="onceonly tickets",
            version="0.1.0",
            description=(
                "The reference ticket service of onceonly. POST /tickets takes an Idempotency-Key header "
                "(IETF draft; also X-Idempotency-Key) when idempotency is on."
            ),
        )
        app.state.db = db
        app.state.store = opened or store
        app.state.faults = injector
        app.state.idempotency = "transactional" if transactional else ("store" if idempotency else "off")

        @app.exception_handler(RequestValidationError)
        async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
            return _invalid(exc)

        @app.exception_handler(InjectedFailure)
        async def injected_failure(request: Request, exc: InjectedFailure) -> JSONResponse:
            return _problem(503, "Injected failure", str(exc), "injected-failure", {"Retry-After": "1"})

        key_parameter = {
            "name": "Idempotency-Key",
            "in": "header",
            "required": idempotency,
            "description": "One key per logical operation, the same on every retry: 1-255 visible ASCII "
            "characters, bare or as a quoted sf-string (X-Idempotency-Key is accepted too).",
            "schema": {"type": "string", "pattern": f"^{KEY_PATTERN}$"},
        }

        @app.post(
            "/tickets",
            status_code=201,
            response_model=Ticket,
            responses={
                400: {
                    "description": "A bad key (problem+json), or a body that is not JSON (application/json)",
                    "content": {
                        **_PROBLEM_CONTENT["content"],
                        "application/json": {"schema": {"type": "object", "properties": {"detail": {}}}},
                    },
                },
                409: _PROBLEM,
                413: _PROBLEM,
                422: {
                    "description": "An invalid body (with errors), or the key was used with another body",
                    "content": {
                        "application/problem+json": {
                            "schema": {"anyOf": [_inlined(InvalidRequest), Problem.model_json_schema()]}
                        }
                    },
                },
                503: _PROBLEM,
            },
            summary="Create a ticket",
            openapi_extra={"parameters": [key_parameter]},
        )
        def create_ticket(ticket: TicketIn, request: Request) -> Response:
            fault = request.scope.get(FAULT_KEY)
            ctx = idempotency_context(request)
            key: str | None
            if ctx is not None:
                client, key = ctx.client, ctx.key
            else:
                # Idempotency off: no middleware read the key, but the ticket still records it for the lookup.
                client, key = client_hash(authorization_identity(request.scope), db.client_secret), _sent_key(request)
            conn = db.conn()
            # One writer at a time in this process: SQLite allows one anyway, and its busy handler would
            # make the others sleep in steps of milliseconds instead of queueing behind a lock.
            with db.write_lock:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    slot = table.begin_request(conn, ctx) if transactional and ctx is not None else None
                    if fault == "fail":
                        _fail()
                    created = _now()
                    cur = conn.execute(
                        "INSERT INTO tickets (session_id, title, body, created_at, client, idempotency_key) "
                        "VALUES (?, ?, ?, ?, ?, ?)",
                        (ticket.session_id, ticket.title, ticket.body, created, client, key),
                    )
                    if fault == "crash":
                        os._exit(CRASH_EXIT_CODE)  # after the business write, before the commit
                    out = {"id": cur.lastrowid, **ticket.model_dump(), "created_at": created}
                    body = json.dumps(out, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
                    headers = {"content-type": "application/json", "location": f"/tickets/{cur.lastrowid}"}
                    if slot is not None:
                        slot.complete(201, body, headers)
                    conn.execute("COMMIT")
                except BaseException:
                    conn.execute("ROLLBACK")
                    raise
            if fault == "crash_after_commit":
                os._exit(CRASH_EXIT_CODE)
            return Response(body, status_code=201, headers=headers)

        @app.get(
            "/tickets",
            response_model=TicketList,
            responses={422: _INVALID},
            summary="Find tickets by business key (for probes)",
        )
        def find_tickets(
            session_id: Annotated[str, Query(min_length=1, max_length=200)],
            title: Annotated[str | None, Query(max_length=500)] = None,
        ) -> dict[str, Any]:
            return {"tickets": db.find(session_id, title)}

        @app.get(
            "/tickets/by-idempotency-key/{key}",
            response_model=Ticket,
            responses={404: _PROBLEM, 422: _INVALID},
            summary="The ticket this client created with an idempotency key",
        )
        def ticket_by_key(
            key: Annotated[str, PathParam(min_length=1, max_length=MAX_KEY_LENGTH)], request: Request
        ) -> Any:
            client = client_hash(authorization_identity(request.scope), db.client_secret)
            found = db.by_key(client, key)
            if found is None:
                return _problem(404, "No such ticket", f"no ticket of this client has the key {key!r}", "not-found")
            return found

        @app.get(
            "/tickets/{ticket_id}",
            response_model=Ticket,
            responses={404: _PROBLEM, 422: _INVALID},
            summary="One ticket",
        )
        def get_ticket(ticket_id: Annotated[int, PathParam(ge=1, le=_MAX_ID)]) -> Any:
            found = db.get(ticket_id)
            if found is None:
                return _problem(404, "No such ticket", f"there is no ticket {ticket_id}", "not-found")
            return found

        @app.get("/health", summary="Liveness")
        def health() -> dict[str, Any]:
            return {"ok": True, "idempotency": app.state.idempotency}

        if admin:

            @app.get("/admin/faults", response_model=FaultState, summary="The faults and how many were injected")
            def get_faults() -> dict[str, Any]:
                return injector.snapshot()

            @app.put(
                "/admin/faults",
                response_model=FaultState,
                responses={422: _INVALID},
                summary="Set the faults (restarts the draws)",
            )
            def put_faults(settings: Faults) -> Any:
                # FastAPI validated the body as Faults (its __post_init__ included): a bad setting was a 422.
                injector.configure(settings)
                return injector.snapshot()

        # Outermost first: the faults see the finished answer; the idempotency middleware sees the app.
        if idempotency:
            settings: dict[str, Any] = {
                "store": opened or store,
                "transactional": transactional,
                "processing_timeout": processing_timeout,
                "ttl": ttl,
                "client_secret": db.client_secret,
                # GET /idempotency-keys/{key}: a client whose answer was lost asks what happened to its key.
                "status_path": DEFAULT_STATUS_PATH,
            }
            if transactional:
                settings["status_lookup"] = db.key_status
            try:
                IdempotencyMiddleware(
                    app, **settings
                )  # checks the settings now: Starlette builds it at the first request
            except BaseException:
                db.close()
                if opened is not None:
                    opened.close()
                raise
            app.add_middleware(IdempotencyMiddleware, **settings)
        app.add_middleware(FaultMiddleware, injector=injector)
        return app


def _sent_key(request: Request) -> str | None:
    """The key a request sent, if it is one (a bad key is no key when nothing enforces keys)."""
    try:
        return request_key(request.scope)
    except BadKey:
        return None
