"""The PostgreSQL store behind PgBouncer (Debian's ``pgbouncer`` package), started on a free port in
front of the shared server, on this run's own database. In transaction mode: many processes opening a
new schema at once, prepared and unnamed statements, libpq's ``options`` refused and the store's
``statement_timeout=`` instead, and guarded calls while the pooler's server connections are recycled
and cut. In session mode: the default options, LISTEN included."""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest

psycopg = pytest.importorskip("psycopg")

import onceonly  # noqa: E402
from onceonly.states import State  # noqa: E402
from onceonly.stores.postgres import PostgresStore  # noqa: E402
from tests._pg_server import PgBouncer, pgbouncer_bin  # noqa: E402
from tests.conftest import _unavailable, join_url  # noqa: E402
from tests.stores._records import NOW, make  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def _bouncer(postgres_database_url: str, *settings: str, pool_mode: str = "transaction") -> PgBouncer:
    if pgbouncer_bin() is None:
        _unavailable("pgbouncer is not installed (apt-get install pgbouncer): cannot test through a pooler")
    parts = urlsplit(postgres_database_url)
    return PgBouncer(parts.hostname or "127.0.0.1", parts.port or 5432, *settings, pool_mode=pool_mode).start()


@pytest.fixture(name="tag")
def fixture_tag() -> str:
    return f"b_{uuid.uuid4().hex[:10]}"


@pytest.fixture(name="database")
def fixture_database(postgres_database_url: str) -> str:
    return urlsplit(postgres_database_url).path.lstrip("/")


@pytest.fixture(name="bouncer")
def fixture_bouncer(postgres_database_url: str) -> Iterator[PgBouncer]:
    """PgBouncer in transaction mode with few server connections, so that clients share them."""
    bouncer = _bouncer(postgres_database_url, "default_pool_size = 8")
    try:
        yield bouncer
    finally:
        bouncer.stop()


@pytest.fixture(name="admin")
def fixture_admin(postgres_database_url: str) -> Iterator[Any]:
    with psycopg.connect(postgres_database_url, autocommit=True) as conn:
        yield conn


def _open_and_claim(url: str, barrier: Any, n: int) -> str:
    barrier.wait(timeout=60)
    store = PostgresStore(url)
    try:
        assert store.claim(make(f"proc-{n}")) is None
        return "holder" if store.claim(make("shared", now=NOW + n)) is None else "reader"
    finally:
        store.close()


def test_eight_processes_open_a_new_schema_through_pgbouncer_at_once(
    bouncer: PgBouncer, database: str, admin: Any, tag: str
) -> None:
    """Through a transaction pooler, eight processes open the same new schema at the same moment: all
    finish within a bound, the schema is made once, and no advisory lock is left held by a pooled
    backend (a session lock taken on one backend and released on another would be)."""
    n = 8
    url = join_url(bouncer.url(database), schema=tag, listen="false", prepare="false")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(n)
        with ctx.Pool(n) as pool:
            pending = pool.starmap_async(_open_and_claim, [(url, barrier, i) for i in range(n)], chunksize=1)
            roles = pending.get(timeout=60)
    assert sorted(roles) == ["holder"] + ["reader"] * (n - 1)
    held = admin.execute(
        "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
        "WHERE l.locktype = 'advisory' AND d.datname = current_database()"
    ).fetchone()[0]
    assert held == 0
    keys = [r[0] for r in admin.execute(f'SELECT key FROM "{tag}".onceonly_records ORDER BY key')]
    assert keys == sorted([f"proc-{i}" for i in range(n)] + ["shared"])


class _Cutter:
    """Cuts PgBouncer's server connections under load: ``pg_terminate_backend`` of one of the pooler's
    backends in the test database every few milliseconds (a statement on it then loses its client
    connection: PgBouncer closes it), and ``RECONNECT`` now and then (every server connection is closed
    once released)."""

    def __init__(self, postgres_database_url: str, bouncer: PgBouncer, every: float) -> None:
        self.url = postgres_database_url
        self.bouncer = bouncer
        self.every = every
        self.cuts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Cutter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True, application_name="cutter") as conn:
            n = 0
            while not self._stop.wait(self.every):
                n += 1
                if n % 25 == 0:
                    self.bouncer.admin("RECONNECT")
                    continue
                killed = conn.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM (SELECT pid FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = "
                    "'client backend' AND application_name = 'onceonly' AND state IN ('active', 'idle') "
                    "AND backend_start < now() - interval '100 ms' ORDER BY random() LIMIT 1) victims"
                ).fetchone()[0]
                self.cuts += killed


CALLS = 2000


@pytest.mark.parametrize("prepare", ["true", "false"])
def test_guarded_calls_survive_recycled_and_cut_server_connections(
    postgres_database_url: str, database: str, admin: Any, tag: str, prepare: str
) -> None:
    """Guarded calls from four threads through PgBouncer whose server connections live 1 s, are
    RECONNECTed and terminated under the calls: every operation runs exactly once (the tool counts),
    every call is confirmed, and no record is left unsettled for review because a connection dropped."""
    # server_login_retry: a backend cut while PgBouncer logs in makes it refuse new logins for that
    # long (15 s by default); the cutter spares backends younger than 100 ms, but not always in time.
    bouncer = _bouncer(postgres_database_url, "default_pool_size = 4", "server_lifetime = 1",
                       "server_idle_timeout = 1", "server_login_retry = 0")  # fmt: skip
    url = join_url(bouncer.url(database), schema=tag, listen="false", prepare=prepare)
    ledger = onceonly.Ledger.open(url)
    runs: Counter[int] = Counter()
    lock = threading.Lock()

    @ledger.tool(name="pgbouncer.effect", lease=5.0, wait=10.0)
    def effect(n: int) -> int:
        with lock:
            runs[n] += 1
        return n

    failed: list[tuple[int, BaseException]] = []

    def caller(start: int) -> None:
        for n in range(start, CALLS, 4):
            try:
                assert effect(n) == n
            except Exception as exc:
                failed.append((n, exc))

    try:
        with _Cutter(postgres_database_url, bouncer, every=0.005) as cutter:
            threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        store = ledger.store
        reruns = getattr(store, "reruns", 0)
        print(f"prepare={prepare}: {cutter.cuts} backends cut, {reruns} statements rerun, {len(failed)} failed")
        assert cutter.cuts > 0 and reruns > 0, "the cuts never hit a statement: the test proved nothing"
        assert failed == [], failed[:3]
        assert sorted(runs) == list(range(CALLS)) and set(runs.values()) == {1}, runs.most_common(3)
        open_states = admin.execute(
            f'SELECT state, count(*) FROM "{tag}".onceonly_records WHERE state <> %s GROUP BY state',
            (State.CONFIRMED.value,),
        ).fetchall()
        assert open_states == []
    finally:
        ledger.close()
        bouncer.stop()


def test_libpq_options_are_refused_by_pgbouncer(bouncer: PgBouncer, database: str, tag: str) -> None:
    """PgBouncer refuses libpq's ``options`` startup parameter, so ``options=-c statement_timeout=…``
    cannot bound a statement behind it (the store's ``statement_timeout=`` below can)."""
    url = join_url(bouncer.url(database), schema=tag, listen="false", options="-c%20statement_timeout%3D5s")
    with pytest.raises(onceonly.StoreUnavailable, match="unsupported startup parameter: options"):
        PostgresStore(url)


@pytest.mark.parametrize("prepare", ["true", "false"])
def test_statement_timeout_cancels_a_blocked_statement_through_pgbouncer(
    postgres_database_url: str, database: str, admin: Any, tag: str, prepare: str
) -> None:
    """Through PgBouncer in transaction mode with one server connection (every client shares it),
    ``statement_timeout=300ms``: a swap (a hot statement) and a delete (through psycopg's cursor) that
    wait on a row another transaction locked are cancelled after about 300 ms, sync and async, each with
    the store's error naming the timeout; the row is unchanged; the timeout was set for each statement's
    own transaction, so another client of the same server connection sees the server's setting; and
    once the lock is gone the same store writes."""
    import asyncio
    import time

    bouncer = _bouncer(postgres_database_url, "default_pool_size = 1")
    url = join_url(bouncer.url(database), schema=tag, listen="false", statement_timeout="300ms", prepare=prepare)
    store = PostgresStore(url)
    try:
        rec = make("held")
        assert store.claim(rec) is None
        done = onceonly.states.confirm(rec, result_json="1", now=NOW + 1, ttl=None, via="run", by="t")
        with admin.transaction():
            admin.execute(f'SELECT 1 FROM "{tag}".onceonly_records WHERE key = %s FOR UPDATE', ("held",))
            for what, call in [
                ("swap", lambda: store.swap(done, rec)),
                ("delete", lambda: store.delete("held", rec.version, rec.created_at)),
                ("aswap", lambda: asyncio.run(store.aswap(done, rec))),
                ("adelete", lambda: asyncio.run(store.adelete("held", rec.version, rec.created_at))),
            ]:
                started = time.monotonic()
                with pytest.raises(onceonly.StoreUnavailable, match="longer than statement_timeout=300ms") as caught:
                    call()
                took = time.monotonic() - started
                assert 0.25 < took < 5, (what, took)
                print(what, f"{took:.2f}s:", caught.value)
        got = store.get("held")
        assert got is not None and got.state is State.IN_FLIGHT and got.version == rec.version
        with psycopg.connect(bouncer.url(database), autocommit=True) as plain:
            assert plain.execute("SHOW statement_timeout").fetchone()[0] == "0"
        assert store.swap(done, rec)
        assert asyncio.run(store.aget("held")) == done
    finally:
        store.close()
        bouncer.stop()


def test_session_mode_takes_the_defaults(postgres_database_url: str, database: str, tag: str) -> None:
    """PgBouncer in session mode passes everything through, LISTEN included: a ledger with the default
    options (listen, prepared statements) and a statement_timeout, a second caller waiting on a running
    call gets its result, and the operation runs once."""
    bouncer = _bouncer(postgres_database_url, "default_pool_size = 4", pool_mode="session")
    ledger = onceonly.Ledger.open(join_url(bouncer.url(database), schema=tag, statement_timeout="5s"))
    runs: list[int] = []
    started = threading.Event()

    @ledger.tool(name="pgbouncer.session", wait=10.0)
    def effect(n: int) -> int:
        started.set()
        runs.append(n)
        threading.Event().wait(0.5)
        return n

    try:
        first = threading.Thread(target=effect, args=(7,))
        first.start()
        assert started.wait(10)
        second = effect.outcome(7)
        first.join(10)
        assert second.replayed and second.result == 7 and runs == [7]
    finally:
        ledger.close()
        bouncer.stop()
