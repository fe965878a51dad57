"""What the two SQL stores share in ``stores/_sql.py`` and nothing in onceonly itself calls yet: a
scan by expired lease alone (``Query(lease_expired_before=t)``, no states), through the public
``Query``. It must mean what Redis's ``_matches`` says: a record matches when it is held (pending or
in flight) and its lease ran out before ``t`` (or it has none)."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from onceonly import states as st
from onceonly.errors import StoreCorrupt
from onceonly.states import Record, State
from onceonly.stores import Query, Store, open_store
from onceonly.stores.postgres import PostgresStore
from onceonly.stores.sqlite import SQLiteStore
from tests.conftest import join_url
from tests.stores._records import NOW, make

T = NOW + 100.0  # the query's "lease expired before"


@pytest.fixture(name="sql_store", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def fixture_sql_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """An empty ledger on each SQL store (PostgreSQL: a schema of its own; skipped when unreachable)."""
    if request.param == "sqlite":
        store = open_store(f"sqlite:///{tmp_path / 'ledger.db'}")
    else:
        base = request.getfixturevalue("postgres_database_url")
        store = open_store(join_url(base, schema=f"sql_{uuid.uuid4().hex[:8]}"))
    yield store
    store.close()


def _records() -> dict[str, Record]:
    """One record per case, named by whether it must match."""
    held = make("x")

    def rec(key: str, state: State, lease_until: float | None, tool: str = "t") -> Record:
        return st.replace(make(key, tool=tool), state=state, lease_until=lease_until, lease_owner=held.lease_owner)

    return {
        r.key: r
        for r in (
            rec("yes-pending-expired", State.PENDING, T - 1),
            rec("yes-in-flight-expired", State.IN_FLIGHT, T - 0.001),
            rec("yes-in-flight-no-lease", State.IN_FLIGHT, None),
            rec("yes-other-tool", State.IN_FLIGHT, T - 5, tool="other"),
            rec("no-in-flight-running", State.IN_FLIGHT, T + 1),
            rec("no-in-flight-ends-at-t", State.IN_FLIGHT, T),  # "before", not "at"
            rec("no-pending-running", State.PENDING, T + 30),
            rec("no-unknown-old-lease", State.UNKNOWN, T - 10),
            rec("no-needs-review-old-lease", State.NEEDS_REVIEW, T - 10),
            rec("no-confirmed-old-lease", State.CONFIRMED, T - 10),
            rec("no-failed-no-lease", State.FAILED, None),
        )
    }


def test_a_scan_by_expired_lease_alone_finds_the_held_records_whose_lease_ran_out(sql_store: Store) -> None:
    """No states given: only held records whose lease ended before ``t``, in key order, with the other
    conditions (tool, paging, limit) applied as usual; the same through the async face; and the same
    answer as Redis's own condition, where redis-py is installed."""
    recs = _records()
    for rec in recs.values():
        assert sql_store.insert(rec)
    expected = sorted(k for k in recs if k.startswith("yes-"))
    query = Query(lease_expired_before=T)
    assert [r.key for r in sql_store.scan(query)] == expected
    assert sql_store.scan(query) == [recs[k] for k in expected]
    assert [r.key for r in asyncio.run(sql_store.ascan(query))] == expected  # type: ignore[attr-defined]
    assert [r.key for r in sql_store.scan(Query(lease_expired_before=T, tool="t"))] == [
        k for k in expected if k != "yes-other-tool"
    ]
    assert [r.key for r in sql_store.scan(Query(lease_expired_before=T, after=expected[0], limit=2))] == expected[1:3]
    try:
        from onceonly.stores.redis import _matches
    except ImportError:  # redis-py missing: the expectation above states the same rule
        return
    assert sorted(k for k, r in recs.items() if _matches(r, query, None)) == expected


def _write_raw(store: Store, sql: str) -> None:
    """Run ``sql`` on the store's table behind its back ({table} is its qualified name)."""
    if isinstance(store, SQLiteStore):
        with sqlite3.connect(store.path) as conn:
            conn.execute(sql.format(table="onceonly_records"))
        return
    import psycopg

    assert isinstance(store, PostgresStore)
    with psycopg.connect(store._conninfo, autocommit=True) as conn:
        conn.execute(sql.format(table=f"{store.schema}.onceonly_records"))  # type: ignore[arg-type]


def test_a_state_that_is_not_ours_is_store_corrupt_on_every_read(sql_store: Store) -> None:
    """A row whose state something else wrote: get, scan and the counts say which record and what to
    do (StoreCorrupt), where they raised a bare KeyError that the CLI printed as a traceback."""
    assert sql_store.insert(make("odd"))
    bogus = "UPDATE {table} SET state = 'bogus' WHERE key = 'odd'"
    if isinstance(sql_store, PostgresStore):  # its table refuses such a row in the first place…
        import psycopg

        with pytest.raises(psycopg.errors.CheckViolation):
            _write_raw(sql_store, bogus)
        # …unless someone dropped the check: then the reads (the hot read below the cursor too) say so.
        _write_raw(sql_store, "ALTER TABLE {table} DROP CONSTRAINT onceonly_records_state_check")
    _write_raw(sql_store, bogus)
    for read in (lambda: sql_store.get("odd"), lambda: sql_store.scan(Query()), sql_store.count_by_state):
        with pytest.raises(StoreCorrupt, match="state 'bogus', which is not an onceonly state"):
            read()
