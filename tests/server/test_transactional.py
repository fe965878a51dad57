"""IdempotencyTable: the key and the business write commit together or not at all, on SQLite and
PostgreSQL, through plain DB-API connections (sqlite3, psycopg) and SQLAlchemy 2 sessions."""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onceonly.errors import InProgress, KeyConflict
from onceonly.server import DEFAULT_REPLAY_HEADERS, IdempotencyTable, Replay, StoredResponse
from onceonly.server.transactional import _convert

FP = "f" * 64
SECRET = b"test-client-secret-0123456789abc"


class Db:
    """One database reached one way: opens transactions, writes and counts a business row."""

    def __init__(self, kind: str, url: str) -> None:
        self.kind = kind
        self.url = url
        self.name = f"idem_{uuid.uuid4().hex[:8]}"
        self.business = f"biz_{uuid.uuid4().hex[:8]}"
        self.engine: Any = None
        if kind.startswith("sqlalchemy"):
            import sqlalchemy

            self.engine = sqlalchemy.create_engine(url)
        with self.transaction() as tx:
            self.run(tx, f"CREATE TABLE {self.business} (k VARCHAR(300), note VARCHAR(100))")

    def connect(self) -> Any:
        if self.kind == "sqlite3":
            return sqlite3.connect(self.url, isolation_level=None, timeout=5)
        import psycopg

        return psycopg.connect(self.url)

    @contextlib.contextmanager
    def transaction(self, **options: Any) -> Iterator[Any]:
        """A transaction: committed at the end of the block, rolled back on an exception."""
        if self.engine is not None:
            from sqlalchemy.orm import Session

            with Session(self.engine) as session, session.begin():
                yield session
            return
        conn = self.connect()
        try:
            if self.kind == "sqlite3":
                conn.execute(options.get("begin", "BEGIN IMMEDIATE"))
            try:
                yield conn
            except BaseException:
                conn.rollback() if self.kind != "sqlite3" else conn.execute("ROLLBACK")
                raise
            conn.commit() if self.kind != "sqlite3" else conn.execute("COMMIT")
        finally:
            conn.close()

    def run(self, tx: Any, sql: str, *args: Any) -> list[Any]:
        if self.engine is not None:
            import sqlalchemy

            params = {f"p{i}": a for i, a in enumerate(args)}
            for i in range(len(args)):
                sql = sql.replace("?", f":p{i}", 1)
            result = tx.execute(sqlalchemy.text(sql), params)
            return list(result.fetchall()) if result.returns_rows else []
        if self.kind == "psycopg":
            sql = sql.replace("?", "%s")
        cur = tx.cursor()
        cur.execute(sql, args)
        rows = cur.fetchall() if cur.description else []
        cur.close()
        return list(rows)

    def business_rows(self) -> int:
        with self.transaction() as tx:
            return int(self.run(tx, f"SELECT COUNT(*) FROM {self.business}")[0][0])

    def close(self) -> None:
        if self.engine is not None:
            self.engine.dispose()


@pytest.fixture(name="db", params=["sqlite3", "psycopg", "sqlalchemy-sqlite", "sqlalchemy-postgres"])
def fixture_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    """An empty database of each kind, reached through each API."""
    kind: str = request.param
    if kind == "sqlite3":
        url = str(tmp_path / "app.db")
    elif kind == "sqlalchemy-sqlite":
        url = f"sqlite:///{tmp_path / 'app.db'}"
    else:
        base = request.getfixturevalue("postgres_database_url")
        url = base.replace("postgresql://", "postgresql+psycopg://", 1) if kind.startswith("sqlalchemy") else base
    db = Db(kind, url)
    yield db
    db.close()


def _table(db: Db, **kwargs: Any) -> IdempotencyTable:
    table = IdempotencyTable(db.name, **kwargs)
    with db.transaction() as tx:
        table.create(tx)
    return table


def _write(db: Db, table: IdempotencyTable, key: str, note: str, fp: str = FP) -> StoredResponse:
    """The handler: take the key, write the business row, store the response, commit."""
    with db.transaction() as tx:
        slot = table.begin(tx, key, fp)
        db.run(tx, f"INSERT INTO {db.business} (k, note) VALUES (?, ?)", key, note)
        return slot.complete(201, f'{{"note":"{note}"}}', {"Content-Type": "application/json"})


def test_commit_then_replay(db: Db) -> None:
    """After the commit a second begin replays the stored response and writes nothing."""
    table = _table(db)
    stored = _write(db, table, "k1", "first")
    with pytest.raises(Replay) as caught, db.transaction() as tx:
        table.begin(tx, "k1", FP)
    assert caught.value.response == stored
    assert caught.value.response.headers == (("content-type", "application/json"),)
    assert db.business_rows() == 1
    with db.transaction() as tx:
        assert table.get(tx, "k1") == stored


def test_crash_before_commit_leaves_neither(db: Db) -> None:
    """A failure between the business write and the commit rolls back both: the retry runs again."""
    table = _table(db)

    def handler() -> None:
        with db.transaction() as tx:
            table.begin(tx, "k1", FP)
            db.run(tx, f"INSERT INTO {db.business} (k, note) VALUES (?, ?)", "k1", "lost")
            raise RuntimeError("crash before commit")

    with pytest.raises(RuntimeError):
        handler()
    assert db.business_rows() == 0
    with db.transaction() as tx:
        assert table.get(tx, "k1") is None
    _write(db, table, "k1", "retry")
    assert db.business_rows() == 1


def test_other_fingerprint_is_a_key_conflict(db: Db) -> None:
    """The same key with another request's fingerprint is refused."""
    table = _table(db)
    _write(db, table, "k1", "first")
    with pytest.raises(KeyConflict) as caught, db.transaction() as tx:
        table.begin(tx, "k1", "0" * 64)
    assert caught.value.key == "k1"
    assert db.business_rows() == 1


def test_expired_key_runs_again(db: Db) -> None:
    """After ttl the key is free: the expired row is replaced inside the new transaction."""
    now = [1000.0]
    table = _table(db, ttl=60, clock=lambda: now[0])
    _write(db, table, "k1", "first")
    now[0] += 61
    _write(db, table, "k1", "second", fp="1" * 64)  # even with another fingerprint: the old one is gone
    assert db.business_rows() == 2
    with db.transaction() as tx:
        assert table.purge(tx, before=now[0] + 120) == 1
        assert table.get(tx, "k1") is None


def test_committed_unfinished_row_is_in_progress(db: Db) -> None:
    """begin() committed without complete() (two transactions: a misuse) reads as in progress."""
    table = _table(db)
    with db.transaction() as tx:
        table.begin(tx, "k1", FP)
    with pytest.raises(InProgress), db.transaction() as tx:
        table.begin(tx, "k1", FP)


def test_complete_without_begin_row_fails_loudly(db: Db) -> None:
    """complete() after the row vanished (a rolled-back begin) refuses instead of storing nothing."""
    table = _table(db)
    with db.transaction() as tx:
        slot = table.begin(tx, "k1", FP)
        db.run(tx, f"DELETE FROM {db.name}")
        with pytest.raises(RuntimeError, match="no row in progress"):
            slot.complete(200, b"x")


def test_concurrent_begin_waits_then_replays(db: Db) -> None:
    """A second transaction on a held key waits for the first's commit, then replays its response."""
    table = _table(db)
    holding, release = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def first() -> None:
        with db.transaction() as tx:
            slot = table.begin(tx, "k1", FP)
            db.run(tx, f"INSERT INTO {db.business} (k, note) VALUES (?, ?)", "k1", "first")
            holding.set()
            release.wait(10)
            outcome["first"] = slot.complete(201, b"done")

    def second() -> None:
        try:
            with db.transaction() as tx:
                table.begin(tx, "k1", FP)
                db.run(tx, f"INSERT INTO {db.business} (k, note) VALUES (?, ?)", "k1", "second")
        except Replay as exc:
            outcome["second"] = exc.response

    t1 = threading.Thread(target=first)
    t1.start()
    assert holding.wait(10)
    t2 = threading.Thread(target=second)
    t2.start()
    time.sleep(0.3)  # the second is now blocked on the key's lock
    assert "second" not in outcome
    release.set()
    t1.join(10)
    t2.join(10)
    assert outcome["second"] == outcome["first"]
    assert db.business_rows() == 1


@pytest.mark.parametrize("db", ["sqlite3", "psycopg"], indirect=True)
def test_lock_timeout_is_in_progress(db: Db) -> None:
    """A transaction that cannot get the key's lock in time gets InProgress (409), not a crash."""
    table = _table(db)
    with db.transaction() as holder:
        table.begin(holder, "k1", FP)
        conn = db.connect()
        try:
            if db.kind == "sqlite3":
                conn.execute("PRAGMA busy_timeout = 100")
                conn.execute("BEGIN")  # deferred: the INSERT is what waits for the write lock
            else:
                conn.execute("SET lock_timeout = '100ms'")
            with pytest.raises(InProgress):
                table.begin(conn, "k1", FP)
        finally:
            conn.rollback() if db.kind == "psycopg" else conn.execute("ROLLBACK")
            conn.close()


def test_table_name_is_checked() -> None:
    """Only plain identifiers (optionally schema-qualified) reach the SQL text."""
    IdempotencyTable("app.idem_keys")
    with pytest.raises(ValueError, match="table name"):
        IdempotencyTable("keys; DROP TABLE users")


@pytest.mark.parametrize(
    ("style", "sql", "args"),
    [
        ("qmark", "a = ? AND b = ?", [1, 2]),
        ("numeric", "a = :1 AND b = :2", [1, 2]),
        ("format", "a = %s AND b = %s", [1, 2]),
        ("pyformat", "a = %(a)s AND b = %(b)s", {"a": 1, "b": 2}),
        ("named", "a = :a AND b = :b", {"a": 1, "b": 2}),
    ],
)
def test_placeholders_follow_the_driver(style: str, sql: str, args: Any) -> None:
    """``:name`` placeholders become each PEP 249 paramstyle."""
    assert _convert("a = :a AND b = :b", {"a": 1, "b": 2}, style) == (sql, args)


def test_complete_keeps_headers_lower_cased_and_filters_them_on_request(tmp_path: Path) -> None:
    """complete() keeps every header (names lower-cased) unless replay_headers names the ones to keep;
    a replay repeats what was stored."""
    conn = sqlite3.connect(tmp_path / "h.db", isolation_level=None)
    table = IdempotencyTable()
    table.create(conn)
    headers = {"Content-Type": "application/json", "Location": "/t/1", "Set-Cookie": "s=1"}
    try:
        conn.execute("BEGIN IMMEDIATE")
        every = table.begin(conn, "k-all", FP).complete(201, "{}", headers)
        some = table.begin(conn, "k-some", FP).complete(201, "{}", headers, replay_headers=["content-TYPE"])
        conn.execute("COMMIT")
        assert every.headers == (("content-type", "application/json"), ("location", "/t/1"), ("set-cookie", "s=1"))
        assert some.headers == (("content-type", "application/json"),)
        with pytest.raises(Replay) as caught:
            table.begin(conn, "k-some", FP)
        assert caught.value.response == some
    finally:
        conn.close()


def test_complete_with_the_store_modes_allow_list_drops_set_cookie(tmp_path: Path) -> None:
    """The docs' advice for a handler that holds per-response headers: complete(...,
    replay_headers=DEFAULT_REPLAY_HEADERS) stores and replays what store mode would, no Set-Cookie."""
    conn = sqlite3.connect(tmp_path / "d.db", isolation_level=None)
    table = IdempotencyTable()
    table.create(conn)
    headers = {"Content-Type": "application/json", "Location": "/t/1", "Set-Cookie": "s=1", "X-Request-Id": "r1"}
    try:
        conn.execute("BEGIN IMMEDIATE")
        stored = table.begin(conn, "k", FP).complete(201, "{}", headers, replay_headers=DEFAULT_REPLAY_HEADERS)
        conn.execute("COMMIT")
        assert stored.headers == (("content-type", "application/json"), ("location", "/t/1"))
        with pytest.raises(Replay) as caught:
            table.begin(conn, "k", FP)
        assert caught.value.response.headers == stored.headers
    finally:
        conn.close()


def test_row_committed_without_complete_expires_with_its_ttl(db: Db) -> None:
    """A transaction that commits its row without complete() (an early return inside the block) holds
    the key as in progress only until ttl: then begin() takes it again and purge() removes it."""
    now = [1000.0]
    table = _table(db, ttl=60, clock=lambda: now[0])
    with db.transaction() as tx:
        table.begin(tx, "k1", FP)  # and the handler returns a 400 without complete(): committed
        table.begin(tx, "k2", FP)
    with pytest.raises(InProgress, match="until its ttl passes"), db.transaction() as tx:
        table.begin(tx, "k1", FP)
    now[0] += 61
    _write(db, table, "k1", "after ttl")  # begin() takes the expired row over
    with db.transaction() as tx:
        assert table.purge(tx) == 1  # k2; k1 is completed now, with its own expiry
    assert db.business_rows() == 1
    with pytest.raises(Replay), db.transaction() as tx:
        table.begin(tx, "k1", FP)
    now[0] += 30  # past the processing row's expiry: complete() set the completed row's own
    with pytest.raises(Replay), db.transaction() as tx:
        table.begin(tx, "k1", FP)


def test_begin_request_without_context_says_where_the_middleware_goes() -> None:
    """Without the middleware's context, begin_request names app.add_middleware: wrapped around a
    Starlette app, the app's error middleware would answer Replay with a 500 first."""
    with pytest.raises(LookupError, match=r"app\.add_middleware\(IdempotencyMiddleware, transactional=True\)"):
        IdempotencyTable().begin_request(None, {"type": "http"})


def test_transactional_middleware_wrapped_outside_logs_where_it_belongs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Added with app.add_middleware, a replay is answered by the middleware; wrapped around the app,
    the app's error middleware answers 500 first, and the log says how to add it instead."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from onceonly.server import IdempotencyMiddleware

    path = tmp_path / "tx.db"
    table = IdempotencyTable()
    setup = sqlite3.connect(path, isolation_level=None)
    table.create(setup)
    setup.close()

    async def order(request: Request) -> Response:
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            slot = table.begin_request(conn, request)
            slot.complete(201, "made", {"content-type": "text/plain"})
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        finally:
            conn.close()
        return Response("made", status_code=201, media_type="text/plain")

    inside = Starlette(routes=[Route("/o", order, methods=["POST"])])
    inside.add_middleware(IdempotencyMiddleware, transactional=True, client_secret=SECRET)
    outside = IdempotencyMiddleware(
        Starlette(routes=[Route("/o", order, methods=["POST"])]), transactional=True, client_secret=SECRET
    )

    def twice(app: Any, key: str) -> list[Any]:
        import asyncio

        import httpx

        async def scenario() -> list[Any]:
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                return [await c.post("/o", headers={"Idempotency-Key": key}) for _ in range(2)]

        return asyncio.run(scenario())

    first, replay = twice(inside, "in")
    assert first.status_code == replay.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    _, broken = twice(outside, "out")
    assert broken.status_code == 500
    assert "app.add_middleware(IdempotencyMiddleware, transactional=True)" in caplog.text


def test_async_connection_is_refused_by_name(postgres_database_url: str) -> None:
    """An async connection (psycopg.AsyncConnection) is refused with a TypeError naming the supported
    ones, instead of running coroutines nobody awaits and answering 409 forever."""
    import asyncio

    import psycopg

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(postgres_database_url) as conn:
            with pytest.raises(TypeError, match=r"async connection.*psycopg\.Connection"):
                IdempotencyTable().begin(conn, "k1", FP)

    asyncio.run(scenario())


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_postgres_snapshot_isolation_waiter_gets_in_progress(postgres_database_url: str, isolation: str) -> None:
    """Above READ COMMITTED, a transaction that waited on the key while another committed it cannot
    see that row (serialization failure, SQLSTATE 40001): it gets InProgress (409), and its retry
    in a new transaction replays."""
    import psycopg

    table = IdempotencyTable(f"idem_{uuid.uuid4().hex[:8]}")
    with psycopg.connect(postgres_database_url, autocommit=True) as conn:
        table.create(conn)
    holding, release = threading.Event(), threading.Event()

    def first() -> None:
        with psycopg.connect(postgres_database_url) as conn:
            slot = table.begin(conn, "k1", FP)
            holding.set()
            release.wait(10)
            slot.complete(201, "done")
            conn.commit()

    t1 = threading.Thread(target=first)
    t1.start()
    assert holding.wait(10)
    with psycopg.connect(postgres_database_url) as waiter:
        waiter.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        waiter.execute("SELECT 1")  # the snapshot is taken before the holder commits
        threading.Timer(0.3, release.set).start()
        with pytest.raises(InProgress):
            table.begin(waiter, "k1", FP)
        waiter.rollback()
        t1.join(10)
        with pytest.raises(Replay):
            table.begin(waiter, "k1", FP)


def test_client_secret_is_made_once_and_kept_in_the_table(db: Db) -> None:
    """``client_secret(tx)`` makes a random secret on first use and keeps it in the table: every later
    call, from any connection (any server process), gets the same one, and purge keeps it."""
    table = _table(db)
    with db.transaction() as tx:
        first = table.client_secret(tx)
    with db.transaction() as tx:
        again = table.client_secret(tx)
        assert table.purge(tx, before=time.time() + 10 * 365 * 86400) == 0
    with db.transaction() as tx:
        assert table.client_secret(tx) == first
    assert again == first and len(first) == 32
    other = _table(db, ttl=None)
    with db.transaction() as tx:
        assert other.client_secret(tx) == first  # the same table, read by another instance
