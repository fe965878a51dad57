"""What only the PostgreSQL store has to prove: its schema, its indexes, LISTEN/NOTIFY, lost backends.

The store contract itself is proven by test_conformance.py, which runs on PostgreSQL too. Every test
here works in a schema of its own inside this run's database, and tags its connections with an
``application_name`` of its own, so terminating "the store's backends" touches nobody else.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

import pytest

psycopg = pytest.importorskip("psycopg")

import onceonly  # noqa: E402
from onceonly import states as st  # noqa: E402
from onceonly.errors import StoreCorrupt, StoreUnavailable  # noqa: E402
from onceonly.states import Record, State  # noqa: E402
from onceonly.stores import Query, open_store  # noqa: E402
from onceonly.stores._sql import COLUMNS  # noqa: E402
from onceonly.stores.postgres import SCHEMA_VERSION, PostgresStore, parse_postgres_url  # noqa: E402
from tests.conftest import join_url  # noqa: E402
from tests.stores._records import NOW, make  # noqa: E402

pytestmark = pytest.mark.postgres


@pytest.fixture(name="tag")
def fixture_tag() -> str:
    """A name of this test's own: its schema and its connections' application_name."""
    return f"p_{uuid.uuid4().hex[:10]}"


@pytest.fixture(name="pg_url")
def fixture_pg_url(postgres_database_url: str, tag: str) -> str:
    """A ledger URL on a schema that does not exist yet, in this run's database."""
    return join_url(postgres_database_url, schema=tag, application_name=tag)


@pytest.fixture(name="admin")
def fixture_admin(postgres_database_url: str) -> Iterator[Any]:
    """A plain autocommit connection to this run's database, to set up and to look."""
    with psycopg.connect(postgres_database_url, autocommit=True) as conn:
        yield conn


@pytest.fixture(name="store")
def fixture_store(pg_url: str) -> Iterator[PostgresStore]:
    """An open PostgreSQL store on its own fresh schema."""
    store = PostgresStore(pg_url)
    yield store
    store.close()


def catalog(admin: Any, schema: str) -> list[tuple[str, str]]:
    """Every relation, trigger and function in ``schema``, and the version rows: to prove nothing changed."""
    rels = admin.execute(
        "SELECT c.relkind::text, c.relname::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s",
        (schema,),
    ).fetchall()
    trigs = admin.execute(
        "SELECT 'trigger', t.tgname::text FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s AND NOT t.tgisinternal",
        (schema,),
    ).fetchall()
    funcs = admin.execute(
        "SELECT 'function', p.proname::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = %s",
        (schema,),
    ).fetchall()
    versions: list[tuple[str, str]] = []
    if admin.execute("SELECT to_regclass(%s)", (f'"{schema}".onceonly_schema',)).fetchone()[0] is not None:
        try:
            versions = [("version", str(r[0])) for r in admin.execute(f'SELECT * FROM "{schema}".onceonly_schema')]
        except psycopg.Error:
            versions = [("version", "unreadable")]
    return sorted(rels + trigs + funcs + versions)


# --- the URL --------------------------------------------------------------------------------------


def test_url_options_are_taken_out_and_libpq_ones_kept() -> None:
    """onceonly's options leave the URL; libpq's stay; sane defaults are added only when absent."""
    opts = parse_postgres_url(
        "postgresql+psycopg://u:pw@db.example:6543/app?schema=Led_1&pool_max_size=4&pool_min_size=2"
        "&pool_timeout=2.5&listen=off&sslmode=disable&application_name=mine"
    )
    assert (opts.schema, opts.pool_min_size, opts.pool_max_size, opts.pool_timeout, opts.listen) == (
        "Led_1", 2, 4, 2.5, False,
    )  # fmt: skip
    assert opts.conninfo.startswith("postgresql://u:pw@db.example:6543/app?")
    assert "sslmode=disable" in opts.conninfo
    assert "application_name=mine" in opts.conninfo
    assert "connect_timeout=5" in opts.conninfo
    for ours in ("schema", "pool_", "listen"):
        assert ours not in opts.conninfo
    plain = parse_postgres_url("postgres://127.0.0.1/app")
    assert (plain.schema, plain.pool_min_size, plain.pool_max_size, plain.listen) == ("public", 1, 10, True)


@pytest.mark.parametrize(
    "query",
    ["schema=bad-name", "schema=1abc", "schema=" + "s" * 64, "pool_max_size=0", "pool_min_size=5&pool_max_size=2",
     "pool_timeout=0", "listen=maybe", "no_such_libpq_option=1"],
)  # fmt: skip
def test_bad_url_options_are_refused(query: str) -> None:
    """A bad option is a ValueError naming it, before any connection is made."""
    with pytest.raises(ValueError, match=query.split("=", maxsplit=1)[0]):
        parse_postgres_url(f"postgresql://127.0.0.1/app?{query}")


def test_unreachable_server_is_unavailable_and_hides_the_password() -> None:
    """Nothing listens on the port: StoreUnavailable at open, at once, without the password."""
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match="cannot connect") as info:
        open_store("postgresql://someone:s3cret@127.0.0.1:1/nothing?connect_timeout=3")
    assert "s3cret" not in str(info.value)
    assert time.monotonic() - started < 10


# --- schema and migrations ------------------------------------------------------------------------


def test_schema_is_created_with_its_version(store: PostgresStore, admin: Any, tag: str) -> None:
    """First use creates the schema, the table, its indexes, the watch triggers and one version row."""
    found = catalog(admin, tag)
    names = {name for _, name in found}
    assert {"onceonly_records", "onceonly_schema", "onceonly_records_pkey", "onceonly_records_open",
            "onceonly_records_expires", "onceonly_records_changed", "onceonly_records_deleted",
            "onceonly_notify"} <= names  # fmt: skip
    assert ("version", str(SCHEMA_VERSION)) in found
    by = admin.execute(f'SELECT installed_by FROM "{tag}".onceonly_schema').fetchone()[0]
    assert by == f"onceonly {onceonly.__version__}"  # the installed package's version, as the package says
    # Reopening finds it done and changes nothing.
    PostgresStore(store.url).close()
    assert catalog(admin, tag) == found


def _open_and_claim(url: str, barrier: Any, n: int) -> str:
    """In a fresh process: wait for the others, open the ledger at once with them, claim one key."""
    barrier.wait(timeout=60)
    store = PostgresStore(url)
    try:
        assert store.claim(make(f"proc-{n}")) is None
        shared = store.claim(make("shared", now=NOW + n))
        return "holder" if shared is None else "reader"
    finally:
        store.close()


@pytest.mark.slow
def test_many_processes_create_one_schema_at_once(pg_url: str, admin: Any, tag: str) -> None:
    """Six processes open the same new schema at the same moment: all succeed, it is made once."""
    n = 6
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(n)
        with ctx.Pool(n) as pool:
            roles = pool.starmap(_open_and_claim, [(pg_url, barrier, i) for i in range(n)], chunksize=1)
    assert sorted(roles) == ["holder"] + ["reader"] * (n - 1)
    versions = admin.execute(f'SELECT version FROM "{tag}".onceonly_schema ORDER BY 1').fetchall()
    assert versions == [(v,) for v in range(1, SCHEMA_VERSION + 1)]  # each step once
    keys = [r[0] for r in admin.execute(f'SELECT key FROM "{tag}".onceonly_records ORDER BY key')]
    assert keys == sorted([f"proc-{i}" for i in range(n)] + ["shared"])


def test_a_foreign_table_is_refused_and_left_alone(pg_url: str, admin: Any, tag: str) -> None:
    """A table named onceonly_records that onceonly did not make: StoreCorrupt, nothing created or changed."""
    admin.execute(f'CREATE SCHEMA "{tag}"')
    admin.execute(f'CREATE TABLE "{tag}".onceonly_records (id integer PRIMARY KEY, body text)')
    admin.execute(f"INSERT INTO \"{tag}\".onceonly_records VALUES (1, 'theirs')")
    before = catalog(admin, tag)
    with pytest.raises(StoreCorrupt, match="onceonly did not make it") as info:
        PostgresStore(pg_url)
    assert "schema of its own" in str(info.value)
    assert catalog(admin, tag) == before
    assert admin.execute(f'SELECT * FROM "{tag}".onceonly_records').fetchall() == [(1, "theirs")]


def test_a_foreign_version_table_is_refused(pg_url: str, admin: Any, tag: str) -> None:
    """A table named onceonly_schema of another shape: StoreCorrupt, nothing created."""
    admin.execute(f'CREATE SCHEMA "{tag}"')
    admin.execute(f'CREATE TABLE "{tag}".onceonly_schema (name text)')
    before = catalog(admin, tag)
    with pytest.raises(StoreCorrupt, match="not made by onceonly"):
        PostgresStore(pg_url)
    assert catalog(admin, tag) == before


def test_a_ledger_of_schema_1_is_brought_up_with_its_records(store: PostgresStore, admin: Any, tag: str) -> None:
    """A ledger of schema 1: the next open widens its state check (schema 2) and adds the control
    documents' table (schema 3), its records stay as they were, and a pause can be set on it."""
    store.insert(make("kept"))
    store.close()
    admin.execute(f'DROP TABLE "{tag}".onceonly_controls')
    admin.execute(f'DELETE FROM "{tag}".onceonly_schema WHERE version > 1')
    again = PostgresStore(store.url)
    try:
        versions = admin.execute(f'SELECT version FROM "{tag}".onceonly_schema ORDER BY version').fetchall()
        assert versions == [(1,), (2,), (3,)] == [(v,) for v in range(1, SCHEMA_VERSION + 1)]
        assert again.get("kept") == make("kept")
        assert again.controls("pause") == {}
        again.put_control("pause", "all", {"reason": "drill"})
        assert again.controls("pause") == {"all": {"reason": "drill"}}
    finally:
        again.close()


def test_a_newer_schema_is_refused_and_left_alone(store: PostgresStore, admin: Any, tag: str) -> None:
    """A ledger migrated by a newer onceonly: StoreCorrupt saying to upgrade, and no change at all."""
    store.insert(make("kept"))
    admin.execute(f"INSERT INTO \"{tag}\".onceonly_schema (version, installed_by) VALUES (99, 'onceonly 9.0')")
    before = catalog(admin, tag)
    rows = admin.execute(f'SELECT * FROM "{tag}".onceonly_records').fetchall()
    knows = rf"version 99, newer than this onceonly knows \({SCHEMA_VERSION}\).*upgrade"
    with pytest.raises(StoreCorrupt, match=knows):
        PostgresStore(store.url)
    assert catalog(admin, tag) == before
    assert admin.execute(f'SELECT * FROM "{tag}".onceonly_records').fetchall() == rows


def test_a_dropped_records_table_is_not_silently_recreated(store: PostgresStore, admin: Any, tag: str) -> None:
    """The version row says a ledger was here but its table is gone: refuse, do not start an empty one."""
    admin.execute(f'DROP TABLE "{tag}".onceonly_records')
    with pytest.raises(StoreCorrupt, match="missing"):
        PostgresStore(store.url)
    assert admin.execute("SELECT to_regclass(%s)", (f'"{tag}".onceonly_records',)).fetchone()[0] is None
    # A store that was already open reports it at the next call.
    with pytest.raises(StoreCorrupt, match="missing or changed"):
        store.get("anything")


@pytest.mark.parametrize(
    ("version_row", "records", "said"),
    [(None, True, "is empty and the table onceonly_records exists"),
     (None, False, "is empty and the table onceonly_records is missing"),
     (0, True, "holds version 0, which onceonly never writes")],
    ids=["empty", "empty-no-records", "version-0"],
)  # fmt: skip
def test_a_version_table_without_a_version_is_refused_and_left_alone(
    store: PostgresStore, admin: Any, tag: str, version_row: int | None, records: bool, said: str
) -> None:
    """onceonly_schema there but with no version onceonly wrote (a restore without its rows, a hand edit):
    a refusal that says so, not a migration from nothing that trips over the existing tables."""
    store.insert(make("kept"))
    admin.execute(f'DELETE FROM "{tag}".onceonly_schema')
    if version_row is not None:
        admin.execute(f"INSERT INTO \"{tag}\".onceonly_schema (version, installed_by) VALUES ({version_row}, 'me')")
    if not records:
        admin.execute(f'DROP TABLE "{tag}".onceonly_records')
    before = catalog(admin, tag)
    rows = admin.execute(f'SELECT * FROM "{tag}".onceonly_records').fetchall() if records else None
    with pytest.raises(StoreCorrupt, match=said) as info:
        PostgresStore(store.url)
    assert "changed by hand. Nothing was changed" in str(info.value)
    assert ("restore its rows" if records else "drop onceonly_schema") in str(info.value)
    assert catalog(admin, tag) == before
    if records:
        assert admin.execute(f'SELECT * FROM "{tag}".onceonly_records').fetchall() == rows


# --- indexes ---------------------------------------------------------------------------------------


def _explain(admin: Any, store: PostgresStore, query: Query) -> str:
    built = store._scan_sql(query)
    assert built is not None
    sql, params = built
    return "\n".join(r[0] for r in admin.execute("EXPLAIN " + sql, params))


def test_reconciler_and_purge_queries_use_their_indexes(store: PostgresStore, admin: Any, tag: str) -> None:
    """On 30 000 records the reconciler's scan walks the open-records index in key order (not the primary
    key, not a sort), and purge's reads the expiry index, not the table."""
    t = f'"{tag}".onceonly_records'
    # 1% unknown, 1% in flight with a lease long expired, 1% expired, the rest confirmed expiring later.
    admin.execute(
        f"""INSERT INTO {t} (key, scope, tool, fingerprint, state, attempts, fence, version, lease_owner,
                lease_until, expires_at, created_at, updated_at, args, history)
            SELECT 'k' || lpad(i::text, 6, '0'), 's', 't', 'f', s.state, 1, 1, 2, NULL, s.lease_until,
                   s.expires_at, {NOW}, {NOW}, '{{}}', '[]'
            FROM generate_series(1, 30000) AS i,
            LATERAL (SELECT CASE WHEN i % 100 = 1 THEN 'unknown' WHEN i % 100 = 2 THEN 'in_flight'
                                 ELSE 'confirmed' END AS state,
                            CASE WHEN i % 100 = 2 THEN {NOW} - 60 END AS lease_until,
                            CASE WHEN i % 100 IN (1, 2) THEN NULL WHEN i % 100 = 3 THEN {NOW} - 1
                                 ELSE {NOW} + 86400 END AS expires_at) AS s"""
    )
    admin.execute(f"ANALYZE {t}")
    reconcile = Query(states=[State.UNKNOWN, State.IN_FLIGHT, State.PENDING], lease_expired_before=NOW, limit=100)
    purge = Query(states=[State.CONFIRMED, State.FAILED, State.ABANDONED], expires_before=NOW, limit=500)
    plan = _explain(admin, store, reconcile)
    assert "Index Scan using onceonly_records_open" in plan and "Sort" not in plan, plan
    assert "onceonly_records_expires" in _explain(admin, store, purge)
    found = store.scan(reconcile)
    assert [r.key for r in found] == [f"k{i:06d}" for i in range(1, 30000) if i % 100 in (1, 2)][:100]
    assert len(store.scan(purge)) == 300
    # Paging by key stays on the index too.
    paged = _explain(admin, store, Query(states=[State.UNKNOWN], after="k015000"))
    assert "Index Scan using onceonly_records_open" in paged, paged


# --- LISTEN/NOTIFY ---------------------------------------------------------------------------------


def _settle_later(url: str, rec: Record, delay: float, done_at: list[float]) -> threading.Thread:
    """Another store (its own connections) confirms ``rec`` after ``delay`` seconds."""

    def run() -> None:
        other = PostgresStore(url)
        try:
            time.sleep(delay)
            done_at.append(time.monotonic())
            assert other.swap(st.confirm(rec, result_json="1", now=NOW + 1, ttl=None, via="run", by="b"), rec)
        finally:
            other.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_notify_wakes_a_waiter_long_before_its_timeout(store: PostgresStore, pg_url: str) -> None:
    """A 30 s wait ends within moments of another connection settling the record, not before it."""
    rec = make("waited")
    store.insert(rec)
    done_at: list[float] = []
    thread = _settle_later(pg_url, rec, 0.5, done_at)
    store.wait_for_change("waited", rec.version, 30.0)
    returned = time.monotonic()
    thread.join()
    assert done_at, "the settle happened"
    assert done_at[0] <= returned < done_at[0] + 5.0
    assert store.get("waited").state is State.CONFIRMED  # type: ignore[union-attr]


def test_async_wait_is_woken_and_leaves_the_loop_free(store: PostgresStore, pg_url: str) -> None:
    """await_for_change wakes on the settle, and the loop keeps running other tasks meanwhile."""
    rec = make("awaited")
    store.insert(rec)

    async def main() -> tuple[float, float, int]:
        done_at: list[float] = []
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        thread = _settle_later(pg_url, rec, 0.5, done_at)
        await store.await_for_change("awaited", rec.version, 30.0)
        returned = time.monotonic()
        tick_task.cancel()
        await asyncio.to_thread(thread.join)
        await store.aclose()
        return done_at[0], returned, ticks

    done, returned, ticks = asyncio.run(main())
    assert done <= returned < done + 5.0
    assert ticks >= 10, "the loop ran other tasks while waiting"


def test_wait_returns_at_once_when_the_version_already_moved(store: PostgresStore) -> None:
    """Waiting on a version the record has left returns without waiting for a notification."""
    rec = make("moved")
    store.insert(rec)
    store.swap(st.mark_unknown(rec, now=NOW, reason="r", by=None), rec)
    started = time.monotonic()
    store.wait_for_change("moved", rec.version, 30.0)
    store.wait_for_change("gone", 1, 30.0)
    assert time.monotonic() - started < 5.0


def test_the_hot_path_notifies_only_when_someone_watches(store: PostgresStore, admin: Any, tag: str) -> None:
    """Claim and settle with no waiter send no NOTIFY; a watched record's change sends exactly one."""
    listener = psycopg.connect(store.options.conninfo, autocommit=True)
    try:
        listener.execute(f'LISTEN "onceonly.{tag}"')
        rec = make("quiet")
        assert store.claim(rec) is None
        done = st.confirm(rec, result_json="1", now=NOW + 1, ttl=60, via="run", by=None)
        assert store.swap(done, rec)
        assert [n.payload for n in listener.notifies(timeout=0.5)] == []
        # A waiter marks the record; the next change notifies once, with its new version.
        admin.execute(f"UPDATE \"{tag}\".onceonly_records SET watched = true WHERE key = 'quiet'")
        again = st.note_conflict(done, now=NOW + 2, reason="x", by=None)
        assert store.swap(again, done)
        assert [n.payload for n in listener.notifies(timeout=2.0, stop_after=1)] == [f"{again.version} quiet"]
        assert admin.execute(f"SELECT watched FROM \"{tag}\".onceonly_records WHERE key = 'quiet'").fetchone() == (
            False,
        )
    finally:
        listener.close()


def test_listen_false_polls(pg_url: str) -> None:
    """With listen=false waiting is a plain sleep of the timeout: correct, only slower."""
    store = PostgresStore(join_url(pg_url, listen="false"))
    try:
        rec = make("polled")
        store.insert(rec)
        started = time.monotonic()
        store.wait_for_change("polled", rec.version, 0.2)
        assert time.monotonic() - started >= 0.19
    finally:
        store.close()


# --- the claim's snapshot subtlety --------------------------------------------------------------------


@pytest.mark.parametrize("outcome", ["commit", "rollback"])
def test_claim_racing_an_uncommitted_insert(store: PostgresStore, admin: Any, tag: str, outcome: str) -> None:
    """A claim that waits on another transaction's insert of the key returns that record, or wins."""
    theirs = make("contested", now=NOW - 5)
    other = psycopg.connect(store.options.conninfo)
    try:
        other.execute(
            f'INSERT INTO "{tag}".onceonly_records (key, scope, tool, fingerprint, state, attempts, fence, version, '
            "lease_owner, lease_until, created_at, updated_at, args, history) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (theirs.key, theirs.scope, theirs.tool, theirs.fingerprint, theirs.state.value, theirs.attempts,
             theirs.fence, theirs.version, theirs.lease_owner, theirs.lease_until, theirs.created_at,
             theirs.updated_at, theirs.args_json, theirs.history_json),
        )  # fmt: skip
        got: list[Record | None] = []
        mine = make("contested")
        thread = threading.Thread(target=lambda: got.append(store.claim(mine)))
        thread.start()
        # The claim blocks on the uncommitted key until the other transaction ends.
        for _ in range(100):
            waiting = admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'",
                (tag,),
            ).fetchone()[0]
            if waiting:
                break
            time.sleep(0.05)
        assert waiting, "the claim waits for the other transaction"
        other.commit() if outcome == "commit" else other.rollback()
        thread.join(timeout=30)
        assert not thread.is_alive()
    finally:
        other.close()
    if outcome == "commit":
        assert got == [theirs], "the claim read the record its snapshot could not see"
    else:
        assert got == [None], "the other insert rolled back: the claim wrote its own"
        assert store.get("contested") == mine


# --- lost connections -------------------------------------------------------------------------------


def _blocked_pids(admin: Any, tag: str, not_in: AbstractSet[int] = frozenset()) -> set[int]:
    """The store's backends waiting on a lock, once at least one other than ``not_in`` waits."""
    for _ in range(200):
        pids = {
            r[0]
            for r in admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'", (tag,)
            )
        }
        if pids - not_in:
            return pids
        time.sleep(0.02)
    raise AssertionError("the store's statement never waited on the lock")


def _values(r: Record) -> tuple[Any, ...]:
    """A record's column values, for writing it with plain psycopg."""
    return tuple(r.state.value if f == "state" else getattr(r, f) for f in Record.__dataclass_fields__)


@pytest.mark.parametrize("face", ["sync", "async"])
@pytest.mark.parametrize("primitive", ["claim", "insert", "swap"])
def test_a_write_whose_connection_dies_is_rerun_and_knows_its_own_row(
    store: PostgresStore, admin: Any, tag: str, primitive: str, face: str
) -> None:
    """The store's write waits on a lock; its backend is terminated; the rerun on a fresh connection
    then finds the very row this write meant to leave (as if the first run had landed before the cut):
    it reports the write as its own (claim → holder, insert/swap → True), not as someone else's. The
    async face (its own connections, ``_aon_connection``) the same way."""
    old = make("cut")
    new = st.confirm(old, result_json="1", now=NOW + 1, ttl=None, via="run", by="a")
    if primitive == "swap":
        store.insert(old)
    mine = old if primitive != "swap" else new
    # "The first run": the same statement with the same values, in a transaction held open.
    other = psycopg.connect(store.options.conninfo)
    try:
        if primitive == "swap":
            sets = ", ".join(f"{c} = %s" for c in COLUMNS.split(", "))
            sql = f'UPDATE "{tag}".onceonly_records SET {sets} WHERE key = %s AND version = %s'
            assert other.execute(sql, (*_values(new), old.key, old.version)).rowcount == 1
        else:
            sql = f'INSERT INTO "{tag}".onceonly_records ({COLUMNS}) VALUES ({", ".join(["%s"] * 20)})'
            assert other.execute(sql, _values(old)).rowcount == 1
        result: list[object] = []
        errors: list[BaseException] = []

        async def acall() -> object:
            if primitive == "claim":
                return await store.aclaim(old)
            if primitive == "insert":
                return await store.ainsert(old)
            return await store.aswap(new, old)

        def call() -> None:
            try:
                if face == "async":
                    result.append(asyncio.run(acall()))
                elif primitive == "claim":
                    result.append(store.claim(old))
                elif primitive == "insert":
                    result.append(store.insert(old))
                else:
                    result.append(store.swap(new, old))
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        thread = threading.Thread(target=call)
        thread.start()
        first = _blocked_pids(admin, tag)
        admin.execute("SELECT pg_terminate_backend(pid, 5000) FROM unnest(%s::int[]) AS pid", (list(first),))
        _blocked_pids(admin, tag, not_in=first)  # the rerun waits on the same lock
        other.commit()
        thread.join(timeout=30)
    finally:
        other.close()
    assert not errors, errors
    assert store.reruns == 1
    assert result == [None if primitive == "claim" else True]
    assert store.get("cut") == mine


def _terminate(admin: Any, tag: str) -> int:
    """Terminate every backend of this test's store and wait until they are gone; how many there were."""
    rows = admin.execute(
        "SELECT pg_terminate_backend(pid, 5000) FROM pg_stat_activity WHERE application_name = %s", (tag,)
    ).fetchall()
    return len(rows)


@pytest.mark.timeout(90)
def test_terminated_backends_cost_at_most_one_call(pg_url: str, admin: Any, tag: str) -> None:
    """After pg_terminate_backend of all the store's connections, the next call fails cleanly or works, the
    one after works: never a hang, never another error type. Five times over, through each primitive."""
    store = PostgresStore(join_url(pg_url, pool_min_size="3"))
    try:
        rec = make("survivor")
        store.insert(rec)
        store.wait_for_change("survivor", rec.version, 0.05)  # the listener connection too
        calls: list[tuple[bool, Callable[[], object]]] = [  # (writes, the call)
            (False, lambda: store.get("survivor")),
            (True, lambda: store.claim(make("survivor"))),
            (False, lambda: store.scan(Query())),
            (False, lambda: store.count_by_state()),
            (True, lambda: store.insert(make("survivor"))),
        ]
        messages: list[tuple[bool, str]] = []
        for writes, call in calls:
            assert _terminate(admin, tag) >= 1
            try:
                call()
            except StoreUnavailable as exc:  # allowed once; anything else fails the test
                messages.append((writes, str(exc)))
            call()  # the one after must work
            assert store.get("survivor") == rec
        # Only a write may have landed unseen; a read says it changed nothing.
        assert all(("whether the last write landed is unknown" in m.lower()) == w for w, m in messages), messages
        assert not any(".." in m for _, m in messages), messages
        # A write whose connection dies is re-read, never guessed: the record still is what it was.
        _terminate(admin, tag)
        done = st.confirm(rec, result_json="1", now=NOW + 1, ttl=None, via="run", by="a")
        try:
            landed = store.swap(done, rec)
        except StoreUnavailable:
            landed = store.get("survivor") == done
        assert store.get("survivor") == (done if landed else rec)
    finally:
        store.close()


@pytest.mark.timeout(90)
def test_the_listener_comes_back_after_its_backend_is_terminated(pg_url: str, admin: Any, tag: str) -> None:
    """The LISTEN connection is terminated: the next wait still ends on a settle, not at its timeout."""
    store = PostgresStore(pg_url)
    try:
        first = make("w1")
        store.insert(first)
        store.wait_for_change("w1", first.version, 0.05)  # starts the listener
        _terminate(admin, tag)
        for attempt in range(50):  # the listener thread notices the loss, then the next wait reconnects
            rec = make(f"w2-{attempt}")
            store.insert(rec)
            done_at: list[float] = []
            thread = _settle_later(pg_url, rec, 0.3, done_at)
            store.wait_for_change(rec.key, rec.version, 20.0)
            returned = time.monotonic()
            thread.join()
            if returned - done_at[0] < 5.0:
                break
        else:
            pytest.fail("no wait was woken by a notification after the listener's backend was terminated")
    finally:
        store.close()


@pytest.mark.timeout(90)
def test_async_face_recovers_after_terminated_backends(pg_url: str, admin: Any, tag: str) -> None:
    """The async pool recovers the same way: one failed call at most, then calls work."""
    store = PostgresStore(pg_url)

    async def main() -> None:
        rec = make("a-survivor")
        await store.ainsert(rec)
        for _ in range(3):
            await asyncio.to_thread(_terminate, admin, tag)
            with contextlib.suppress(StoreUnavailable):  # allowed once
                await store.aget("a-survivor")
            assert await store.aget("a-survivor") == rec
            assert await store.aclaim(rec) == rec
        await store.aclose()

    try:
        asyncio.run(main())
    finally:
        store.close()


def test_closed_store_is_unavailable(store: PostgresStore) -> None:
    """A call on a closed store says so, as StoreUnavailable."""
    store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        store.get("k")


# --- the async face under several event loops -----------------------------------------------------------


def test_async_face_under_several_event_loops(store: PostgresStore) -> None:
    """asyncio.run three times on one store, then two loops in two threads at once: each gets its own pool."""

    async def work(prefix: str) -> list[Record | None]:
        recs = [make(f"{prefix}-{i}") for i in range(10)]
        first = await asyncio.gather(*(store.aclaim(r) for r in recs))
        assert first == [None] * 10
        # Ten tasks claim one key at once: one holder, nine readers of its record.
        contested = await asyncio.gather(*(store.aclaim(make(f"{prefix}-one", now=NOW + i)) for i in range(10)))
        assert contested.count(None) == 1
        return [await store.aget(r.key) for r in recs]

    for run in range(3):
        got = asyncio.run(work(f"run{run}"))
        assert [r.key for r in got if r is not None] == [f"run{run}-{i}" for i in range(10)]

    errors: list[BaseException] = []

    def in_thread(name: str) -> None:
        try:
            asyncio.run(work(name))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=in_thread, args=(f"thread{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert store.count_by_state()[State.IN_FLIGHT] == 5 * 11
    # And the sync face still works after all those loops ended.
    assert store.get("run0-0") is not None


def test_a_loop_closed_without_shutdown_leaves_nothing_behind(store: PostgresStore) -> None:
    """A hand-made loop closed without shutdown_asyncgens(): the next loop and close() clean its
    connections up without warnings (the suite turns an unraisable exception into an error)."""
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(store.aclaim(make("manual"))) is None
    finally:
        loop.close()
    assert asyncio.run(store.aget("manual")) == make("manual")
    gc.collect()
    store.close()
    gc.collect()


def test_float_times_round_trip_exactly(store: PostgresStore) -> None:
    """Epoch-second floats of every shape come back bit for bit."""
    for i, t in enumerate([0.1 + 0.2, 1e-300, 1_800_000_000.123456789, 2.0**53 + 1, 5e-324, 1.7976931348623157e308]):
        rec = st.replace(make(f"f{i}"), lease_until=t, next_attempt_at=-t, expires_at=t / 3, created_at=t * 0.7)
        assert store.insert(rec)
        assert store.get(rec.key) == rec


def test_connections_speak_utf8_whatever_the_url_says(pg_url: str) -> None:
    """The hot statements send text as UTF-8 bytes: a URL asking for LATIN1 (which cannot even hold the
    key below) still gets UTF-8 connections, and keys and results of any script round-trip exactly,
    through the hot statements (get) and psycopg's own decoding (scan)."""
    url = join_url(pg_url, client_encoding="LATIN1")
    conninfo = parse_postgres_url(url).conninfo
    assert "client_encoding=UTF8" in conninfo and "LATIN1" not in conninfo
    store = PostgresStore(url)
    try:
        key = "é-中文-🙂"
        rec = make(key)
        assert store.claim(rec) is None
        assert store.claim(rec) == rec
        done = st.confirm(rec, result_json='{"title":"é-中文-🙂"}', now=NOW + 1, ttl=None, via="run", by="ü")
        assert store.swap(done, rec)
        assert store.get(key) == done
        assert store.scan(Query()) == [done]
        assert asyncio.run(store.aget(key)) == done
        conn = store._getconn()
        try:
            assert conn.execute("SHOW client_encoding").fetchone() == ("UTF8",)
        finally:
            store._pool.putconn(conn)
    finally:
        store.close()


def test_the_pool_hands_out_the_connection_returned_last(pg_url: str) -> None:
    """LIFO: one caller keeps one warm backend instead of round-robin over every pooled connection
    (psycopg_pool is FIFO; ``LifoPool`` turns it; this fails if a psycopg_pool upgrade undoes that)."""
    store = PostgresStore(join_url(pg_url, pool_min_size="3", pool_max_size="3"))
    try:
        store._pool.wait(timeout=10)
        held = [store._pool.getconn() for _ in range(3)]
        for conn in held:
            store._pool.putconn(conn)
        last = held[-1]
        for _ in range(5):
            conn = store._pool.getconn()
            assert conn is last
            store._pool.putconn(conn)
        store.insert(make("lifo"))
        assert store.get("lifo") is not None
        # The others are still there, oldest first, for the pool's shrinking to take.
        assert list(store._pool._pool) == held  # type: ignore[attr-defined]
    finally:
        store.close()


def _forget_prepared(store: PostgresStore) -> Any:
    """The server forgets the hot statements of the next connection the store takes; the connection does
    not know. That connection (LIFO: the one handed back last), to look at afterwards."""
    conn = store._getconn()
    try:
        assert conn.ledger_prepared  # the hot statements are prepared on it
        conn.execute("DEALLOCATE ALL")
    finally:
        store._pool.putconn(conn)
    return conn


def test_hot_statements_survive_a_lost_or_doubled_preparation(store: PostgresStore, admin: Any, tag: str) -> None:
    """The hot statements are prepared once per connection. A backend that forgot them (DEALLOCATE, or
    a transaction pooler handing us another backend) prepares them again; one that still has a
    statement we think is new (42P05) uses it. Either way the call works and nothing runs twice: a
    write that is the first to meet "not prepared" (26000) ran nowhere, and runs once."""

    def rows(key: str) -> int:
        return int(admin.execute(f'SELECT count(*) FROM "{tag}".onceonly_records WHERE key = %s', (key,)).fetchone()[0])

    store.insert(make("prep"))
    assert store.get("prep") is not None
    conn = _forget_prepared(store)
    assert store.insert(make("prep-first")) is True  # the first statement to meet 26000 is a write
    assert conn.ledger_prepared == {store._stmt_insert.name}, "the insert did not meet the forgotten statement"
    assert rows("prep-first") == 1 and store.get("prep-first") == make("prep-first")

    def settle(rec: Record) -> Record:
        return st.confirm(rec, result_json="1", now=NOW + 1, ttl=None, via="run", by="a")

    assert store.swap(settle(make("prep")), make("prep"))  # prepares the UPDATE of this shape
    update = store._update(settle(make("prep")), make("prep"))[0].name
    conn = _forget_prepared(store)
    swapped = settle(make("prep-first"))
    assert store.swap(swapped, make("prep-first")) is True  # again, a write first meets 26000
    assert conn.ledger_prepared == {update}, "the swap did not meet the forgotten statement"
    assert rows("prep-first") == 1 and store.get("prep-first") == swapped
    _forget_prepared(store)
    assert store.get("prep") == settle(make("prep"))
    assert store.insert(make("prep2")) is True
    conn = store._getconn()
    try:
        assert conn.ledger_prepared
        conn.ledger_prepared.clear()  # the connection forgets them; the server still has them
    finally:
        store._pool.putconn(conn)
    assert store.get("prep2") == make("prep2")
    done = st.confirm(make("prep2"), result_json="1", now=NOW + 1, ttl=None, via="run", by="a")
    assert store.swap(done, make("prep2"))
    assert store.reruns == 0


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_statement_forgotten_again_after_its_new_preparation_is_sent_unnamed(
    store: PostgresStore, admin: Any, tag: str, monkeypatch: pytest.MonkeyPatch, face: str
) -> None:
    """What a transaction pooler without prepared-statement support does: the backend that runs a
    statement is never the one that prepared it. Here the real backend forgets every statement right
    after it is prepared (DEALLOCATE ALL between the preparation and the execution), so the store's
    one re-preparation meets 26000 again; it ran nowhere, so it is sent once unnamed (parsed and run
    in one message train): written once, nothing re-run."""
    from psycopg.generators import execute as real_execute

    forgot: list[bytes] = []

    def forgetful_execute(pgconn: Any) -> Any:
        results = yield from real_execute(pgconn)
        res = results[-1]
        if res.status == psycopg.pq.ExecStatus.COMMAND_OK and not res.command_status:  # a preparation's answer
            done = pgconn.exec_(b"DEALLOCATE ALL")  # blocking, between the two round trips of run()
            forgot.append(done.command_status)
        return results

    def insert() -> bool:
        if face == "sync":
            return store.insert(make("never"))
        return asyncio.run(store.ainsert(make("never")))

    monkeypatch.setattr("onceonly.stores._pgwire.execute", forgetful_execute)
    assert insert() is True
    assert forgot == [b"DEALLOCATE ALL"] * 2, "prepared twice, and made to forget it twice"
    assert admin.execute(f'SELECT count(*) FROM "{tag}".onceonly_records').fetchone() == (1,)
    assert store.reruns == 0


def _deallocate_behind_psycopgs_back(conn: Any) -> None:
    """What a transaction pooler sends between two clients: the backend forgets every prepared
    statement, and psycopg, which did not send it, does not know."""
    assert conn.pgconn.exec_(b"DEALLOCATE ALL").command_status == b"DEALLOCATE ALL"


@pytest.mark.parametrize("face", ["sync", "async"])
def test_cursor_statements_survive_a_deallocate_behind_psycopgs_back(pg_url: str, face: str) -> None:
    """The statements sent through psycopg's cursor (scan, count, delete, a waiter's mark) are never
    prepared: by default psycopg prepares a query after 5 runs and keeps using it, so after a DEALLOCATE
    ALL it did not see, every later run of that query on the connection failed (26000). Each runs here
    more than 5 times, the backend forgets, and each still works, as do the hot statements."""
    from onceonly.stores.postgres.store import _ALL, _COUNT

    store = PostgresStore(join_url(pg_url, pool_min_size="1", pool_max_size="1"))  # one connection
    recs = [make(f"cur-{i}") for i in range(3)]

    def sync() -> list[Any]:
        for rec in recs:
            assert store.insert(rec)
        found: list[Any] = []
        for round_ in range(2):
            if round_:
                conn = store._getconn()
                try:
                    _deallocate_behind_psycopgs_back(conn)
                finally:
                    store._pool.putconn(conn)
            for _ in range(7):
                found = [
                    len(store.scan(Query())),
                    store.count_by_state()[State.IN_FLIGHT],
                    store.delete("nobody", 1),
                    store._watch("nobody", 1),
                ]
        found += [store._watch(recs[0].key, recs[0].version), store.delete(recs[1].key, recs[1].version)]
        return [*found, store.get(recs[0].key) is not None]

    async def async_() -> list[Any]:
        for rec in recs:
            assert await store.ainsert(rec)
        found: list[Any] = []
        for round_ in range(2):
            if round_:
                (conn,) = store._aconnections[asyncio.get_running_loop()].idle
                _deallocate_behind_psycopgs_back(conn)
            for _ in range(7):
                found = [
                    len(await store.ascan(Query())),
                    dict((await store._arun(store._sql_count, (), _ALL))[0])["in_flight"],
                    await store.adelete("nobody", 1),
                    (await store._arun(store._sql_watch, ("nobody", 1), _COUNT))[0] == 1,
                ]
        watched, _ = await store._arun(store._sql_watch, (recs[0].key, recs[0].version), _COUNT)
        found += [watched == 1, await store.adelete(recs[1].key, recs[1].version)]
        return [*found, await store.aget(recs[0].key) is not None]

    try:
        found = sync() if face == "sync" else asyncio.run(async_())
        # scan, count, delete and mark of nobody, mark and delete of a record at its version, a hot read
        assert found == [3, 3, False, False, True, True, True]
        assert store.reruns == 0
    finally:
        store.close()


def test_a_forgotten_statement_on_the_cursor_path_is_explained_as_such(store: PostgresStore) -> None:
    """A 26000 met by a statement sent through psycopg's cursor does not claim the store prepared it
    again (only the hot statements are prepared by the store); it still names the likely cause."""
    from onceonly.stores.postgres.store import _COUNT

    with pytest.raises(StoreUnavailable, match="psycopg's cursor") as info:
        store._run("EXECUTE onceonly_never_prepared", (), _COUNT)
    assert "never prepares" in str(info.value) and "prepared it again" not in str(info.value)
    assert "session mode" in str(info.value) and "ran nowhere" in str(info.value)


@pytest.mark.parametrize("filled", [True, False], ids=["every-field-set", "nones"])
def test_record_params_agrees_with_the_field_encoders(filled: bool) -> None:
    """``record_params`` is an unrolled copy of ``FIELD_ENCODERS`` (the INSERT of every first call):
    the two give the same bytes, field by field, with every optional field set and with each left None."""
    from onceonly.stores import _pgwire

    fields = list(Record.__dataclass_fields__)
    assert len(fields) == len(_pgwire.FIELD_ENCODERS) == len(_pgwire.COLUMN_TYPES) == len(COLUMNS.split(", "))
    if filled:  # every value distinct, so that two fields swapped in the copy cannot agree by chance
        rec = Record(
            key="k:é", scope="sc", tool="to", fingerprint="fp", state=State.UNKNOWN, attempts=3, fence=-4,
            version=2**40, lease_owner="host:1:2", lease_until=NOW + 0.5, next_attempt_at=NOW + 1.25,
            expires_at=NOW + 86400.125, created_at=NOW - 3.5, updated_at=NOW - 1.75, result_json='{"r":1}',
            error="boom", args_json='{"a":2}', history_json='[{"h":3}]', via="probe", conflicts=7,
        )  # fmt: skip
        assert all(getattr(rec, f) is not None for f in fields)
    else:
        rec = Record(key="k", scope="s", tool="t", fingerprint="f", state=State.PENDING)
        assert [f for f in fields if getattr(rec, f) is None] == [
            "lease_owner", "lease_until", "next_attempt_at", "expires_at", "result_json", "error", "via",
        ]  # fmt: skip
    expected = [enc(getattr(rec, f)) for enc, f in zip(_pgwire.FIELD_ENCODERS, fields, strict=True)]
    assert _pgwire.record_params(rec) == expected


def test_a_forked_child_gets_connections_of_its_own(postgres_database_url: str) -> None:
    """A store used before fork() (a module-level ledger, a prefork worker): parent and child read
    at once through a pool of one connection. On the shared socket each got the other's answers (the
    review counted 1,166 wrong records in 2,000 reads); the child now has a pool of its own. And the
    connections it inherited are blinded: closing them, as the garbage collector at its exit would,
    does not end the parent's session."""
    import os

    import psycopg

    from onceonly.stores.postgres import _pools

    store = open_store(join_url(postgres_database_url, schema=f"fork_{uuid.uuid4().hex[:8]}", pool_max_size="1"))
    for who in ("p", "c"):
        for i in range(50):
            assert store.insert(make(f"{who}-{i}"))
    assert store.get("p-0") is not None  # the parent's connection is open and has been used
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        wrong = -1
        try:
            wrong = sum(
                (got := store.get(f"c-{i}")) is None or got.key != f"c-{i}" for _ in range(10) for i in range(50)
            )
            for old in _pools.inherited:
                if isinstance(old, psycopg.Connection):
                    old.close()  # sends Terminate: into /dev/null
        finally:
            os.write(write, str(wrong).encode())
            os._exit(0)
    os.close(write)
    parent_wrong = sum(
        (got := store.get(f"p-{i}")) is None or got.key != f"p-{i}" for _ in range(10) for i in range(50)
    )
    os.waitpid(pid, 0)
    with os.fdopen(read) as pipe:
        child_wrong = int(pipe.read())
    try:
        assert (parent_wrong, child_wrong) == (0, 0), "each process read its own records, and only them"
        assert store.reruns == 0, "the parent's connection was not lost"
        assert store.get("p-1") is not None
    finally:
        store.close()
