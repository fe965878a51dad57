"""The PostgreSQL store on servers of the test's own: one that may lose acknowledged commits
(``synchronous_commit=off``), and a streaming hot standby given as the URL. Each test starts its own
server on a free port (tests/_pg_server.py) and stops it by its PID."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest

psycopg = pytest.importorskip("psycopg")

from onceonly.errors import StoreError, StoreUnavailable  # noqa: E402
from onceonly.stores.postgres import PostgresStore  # noqa: E402
from tests._pg_server import PrivatePostgres, postgres_bin  # noqa: E402
from tests.conftest import _unavailable, join_url  # noqa: E402
from tests.stores._records import make  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

_WARNED = "may lose writes it has already acknowledged"


@pytest.fixture(name="server")
def fixture_server() -> Iterator[PrivatePostgres]:
    """A private PostgreSQL with the default (durable) settings."""
    if postgres_bin() is None:
        _unavailable("initdb and postgres are not installed: no private PostgreSQL to start")
    server = PrivatePostgres().start()
    try:
        yield server
    finally:
        server.stop()


def _admin(server: PrivatePostgres, sql: str) -> Any:
    with psycopg.connect(server.url, autocommit=True) as conn:
        return conn.execute(sql).fetchall() if sql.lstrip().upper().startswith("SELECT") else conn.execute(sql)


# --- synchronous_commit=off ------------------------------------------------------------------------


def test_a_server_with_synchronous_commit_off_is_warned_of(
    server: PrivatePostgres, caplog: pytest.LogCaptureFixture
) -> None:
    """synchronous_commit=off for the ledger's role: opening logs a warning naming the setting and the fix;
    warn_durability=false silences it; a durable server gets none."""
    with caplog.at_level(logging.WARNING, logger="onceonly.stores.postgres"):
        PostgresStore(join_url(server.url, schema="durable")).close()
    assert not [r for r in caplog.records if _WARNED in r.getMessage()]

    _admin(server, "ALTER ROLE postgres SET synchronous_commit = off")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="onceonly.stores.postgres"):
        store = PostgresStore(join_url(server.url, schema="lossy"))
    warned = [r.getMessage() for r in caplog.records if _WARNED in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert "synchronous_commit is off" in warned[0] and "warn_durability=false" in warned[0]
    assert "ALTER ROLE" in warned[0]
    store.close()

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="onceonly.stores.postgres"):
        PostgresStore(join_url(server.url, schema="lossy", warn_durability="false")).close()
    assert not [r for r in caplog.records if _WARNED in r.getMessage()]


def test_require_durability_refuses_a_server_with_synchronous_commit_off(server: PrivatePostgres) -> None:
    """require_durability=true: a database with synchronous_commit=off is refused at open, and so is the
    setting given in the URL's own options; with synchronous_commit=on it opens."""
    url = join_url(server.url, schema="strict", require_durability="true")
    PostgresStore(url).close()
    _admin(server, "ALTER DATABASE postgres SET synchronous_commit = off")
    with pytest.raises(StoreError, match="synchronous_commit is off") as raised:
        PostgresStore(url)
    assert "require_durability=true" in str(raised.value)
    _admin(server, "ALTER DATABASE postgres RESET synchronous_commit")
    PostgresStore(url).close()
    with pytest.raises(StoreError, match="synchronous_commit is off"):
        PostgresStore(join_url(url, options="-c%20synchronous_commit%3Doff"))


def test_synchronous_commit_off_loses_acknowledged_records_in_a_crash() -> None:
    """Why it is warned of: with synchronous_commit=off (and the WAL writer slowed down), records the
    store acknowledged are gone after a crash of the server; with it on, none is."""
    if postgres_bin() is None:
        _unavailable("initdb and postgres are not installed: no private PostgreSQL to start")
    lost = {}
    for setting in ("off", "on"):
        server = PrivatePostgres(f"synchronous_commit={setting}", "wal_writer_delay=10s",
                                 "wal_writer_flush_after=0").start()  # fmt: skip
        try:
            store = PostgresStore(join_url(server.url, schema="crash", warn_durability="false"))
            for i in range(200):
                assert store.claim(make(f"k{i}")) is None  # acknowledged
            store.close()
            server.crash()
            server.start()
            with psycopg.connect(server.url, autocommit=True) as conn:
                kept = conn.execute("SELECT count(*) FROM crash.onceonly_records").fetchone()[0]
            lost[setting] = 200 - kept
        finally:
            server.stop()
    assert lost["on"] == 0
    # How many synchronous_commit=off loses depends on the WAL writer's timing: reported, not asserted.
    print(f"acknowledged claims lost in a crash: {lost}")


# --- a hot standby -----------------------------------------------------------------------------------


def test_a_hot_standby_is_refused_at_open_with_what_to_do(server: PrivatePostgres) -> None:
    """A streaming standby (pg_basebackup -R) as the URL: StoreUnavailable at open naming the standby and
    target_session_attrs=read-write, on a schema that exists (made on the primary) and on a new one;
    a two-host URL with target_session_attrs=read-write finds the primary."""
    PostgresStore(join_url(server.url, schema="made")).close()
    standby = server.standby().start()
    try:
        deadline = time.monotonic() + 30
        while not _admin(standby, "SELECT count(*) FROM pg_namespace WHERE nspname = 'made'")[0][0]:
            assert time.monotonic() < deadline, "the standby never replayed the schema"
            time.sleep(0.1)
        for schema in ("made", "fresh"):
            with pytest.raises(StoreUnavailable, match="hot standby") as raised:
                PostgresStore(join_url(standby.url, schema=schema))
            text = str(raised.value)
            assert "pg_is_in_recovery" in text and "target_session_attrs=read-write" in text, text
        both = (
            f"postgresql://postgres@127.0.0.1:{standby.port},127.0.0.1:{server.port}/postgres"
            "?schema=made&target_session_attrs=read-write"
        )
        store = PostgresStore(both)
        try:
            assert store.claim(make("on-the-primary")) is None
        finally:
            store.close()
    finally:
        standby.stop()


def test_a_read_only_database_is_refused_at_open(server: PrivatePostgres) -> None:
    """default_transaction_read_only=on: every write would fail, so opening says so."""
    _admin(server, "ALTER DATABASE postgres SET default_transaction_read_only = on")
    with pytest.raises(StoreUnavailable, match="read-only transactions"):
        PostgresStore(join_url(server.url, schema="ro"))
