"""SQLite-specific behaviour (the shared semantics are in test_conformance.py)."""

from __future__ import annotations

import gc
import os
import re
import sqlite3
import sys
import threading
import time
from pathlib import Path

import pytest

import onceonly
from onceonly import states as st
from onceonly.states import State
from onceonly.stores import Query
from onceonly.stores._sql import COLUMNS, scan_sql
from onceonly.stores.sqlite import _INSERT, _MIGRATIONS, APPLICATION_ID, SCHEMA_VERSION, SQLiteStore, _record_values
from tests._workers import count_effects, effects_db
from tests.stores._records import NOW, make


def _open_files(path: Path) -> int:
    """How many of this process's file descriptors are the ledger file, its WAL or its shared memory."""
    names = {str(path), f"{path}-wal", f"{path}-shm"}
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") in names
        except OSError:
            continue  # closed since the listing
    return count


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts open files through /proc/self/fd")
def test_a_thread_that_ends_takes_its_connection_with_it(tmp_path: Path) -> None:
    """Each thread gets a connection of its own; when the thread ends, its connection is released.
    Kept until close(), 20 short-lived threads (a thread per task) held 20 connections and their page
    caches (up to 64 MiB each). SQLite keeps a closed connection's file open while another connection
    of the process holds locks on the file (POSIX locks would be lost), so files are counted only at
    close(); the live connections are what the store still holds."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        assert store.insert(make("main"))  # this thread's connection, and the WAL, exist now
        threads = [threading.Thread(target=store.insert, args=(make(f"t{i}"),)) for i in range(20)]
        for thread in threads:
            thread.start()
            thread.join()
        gc.collect()
        assert len(store._all) == 1  # this thread's; the ended threads' are closed
        assert len(store.scan(Query(limit=100))) == 21  # every write landed
    finally:
        store.close()
    assert _open_files(store.path) == 0  # close() closed what was left


def test_a_forked_child_writes_through_its_own_connection(tmp_path: Path) -> None:
    """A ledger opened before a fork (a module-level ledger, a multiprocessing 'fork' worker): the
    child's calls must reach the file, while the parent goes on writing and then closes. Through the
    inherited connection they went into a WAL that the parent's close checkpointed and deleted; with a
    new connection beside the inherited one, SQLite's copied lock count let the child hold no real
    lock, with the same end. Either way a fresh look saw almost none of them, and running the same
    operations again ran their side effects a second time."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    effects = tmp_path / "effects.db"
    effects_db(effects).close()
    ledger = onceonly.Ledger.open(url)

    @ledger.tool(name="op", wait=30)
    def op(n: int) -> dict[str, int]:
        conn = effects_db(effects)
        conn.execute("INSERT INTO effects VALUES (?, ?, ?)", (str(n), str(os.getpid()), time.time()))
        conn.close()
        return {"n": n}

    op(-1)  # the parent has used its connection before the fork
    started_r, started_w = os.pipe()
    closed_r, closed_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            op(0)  # the child's first call, while the parent's connection is open
            os.write(started_w, b"x")
            os.read(closed_r, 1)  # the parent wrote more and closed its ledger
            for n in range(1, 50):
                op(n)
            code = 0
        finally:
            os._exit(code)  # as a multiprocessing worker ends: no close
    os.read(started_r, 1)
    for n in range(100, 120):
        op(n)  # the parent goes on writing beside the child
    ledger.close()
    os.write(closed_w, b"x")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    again = onceonly.Ledger.open(url)
    try:
        assert again.stats()["confirmed"] == 71, "every call of the child and the parent is in the file"
        rerun = again.tool(name="op", wait=30)(op.spec.fn)
        for n in [*range(50), *range(100, 120)]:
            assert rerun(n) == {"n": n}
        assert set(count_effects(effects).values()) == {1}, "no side effect ran twice"
    finally:
        again.close()


def test_a_file_that_cannot_be_written_is_unavailable_not_corrupt(tmp_path: Path) -> None:
    """No room to write (here a file size limit of 0 bytes, in a child process): the store cannot make
    its schema. That says nothing about the file being foreign or damaged, so it is StoreUnavailable
    with what to check, not StoreCorrupt telling the user to move a good ledger away."""
    import resource
    import signal

    path = tmp_path / "ledger.db"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        answer = b"no error"
        try:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails instead of killing
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            SQLiteStore(f"sqlite:///{path}")
        except Exception as exc:
            answer = f"{type(exc).__name__}: {exc}".encode()
        finally:
            os.write(write, answer)
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read().decode()
    assert answer.startswith("StoreUnavailable: cannot open the ledger file"), answer
    assert "disk has room" in answer


@pytest.mark.parametrize(
    ("query", "says"),
    [("timeout=nan", "timeout='nan'"), ("timeout=-1", "timeout='-1'"), ("timeout=abc", "timeout='abc'"),
     ("timout=5", "unknown option(s) timout")],
)  # fmt: skip
def test_bad_url_options_are_refused_by_name(tmp_path: Path, query: str, says: str) -> None:
    """A busy timeout of nan made opening wait forever on a locked file; a misspelt option was ignored."""
    with pytest.raises(ValueError, match=re.escape(says)):
        SQLiteStore(f"sqlite:///{tmp_path / 'ledger.db'}?{query}")
    assert not (tmp_path / "ledger.db").exists()


# --- the schema and its index ------------------------------------------------------------------------


def _plan(store: SQLiteStore, query: Query) -> str:
    built = scan_sql(query, table="onceonly_records", columns=COLUMNS, placeholder="?", state_per_term=True)
    assert built is not None
    return " / ".join(row[3] for row in store._conn().execute("EXPLAIN QUERY PLAN " + built[0], built[1]))


def test_the_review_states_are_read_from_their_index_and_a_guarded_call_never_enters_it(tmp_path: Path) -> None:
    """`ls --state unknown` (or needs_review, or both, from any key on) reads the review index, not every
    record; a claim and its settle write no entry there (their two writes stay the floor's)."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'ledger.db'}")
    try:
        for states in ([State.UNKNOWN], [State.NEEDS_REVIEW], [State.NEEDS_REVIEW, State.UNKNOWN]):
            for after in (None, "k5"):
                plan = _plan(store, Query(states=states, after=after))
                assert "INDEX onceonly_records_review" in plan, (states, after, plan)
        assert _plan(store, Query()) == "SCAN onceonly_records"  # key order: the primary key, no sort
        rec = make("k1")
        store.insert(rec)
        store.swap(st.confirm(rec, result_json="1", now=NOW, ttl=None, via="run", by=None), rec)
        entries = "SELECT count(*) FROM onceonly_records INDEXED BY onceonly_records_review WHERE state = 'unknown'"
        assert store._conn().execute(entries).fetchone()[0] == 0
        store.insert(st.mark_unknown(make("k2"), now=NOW, reason="r", by=None))
        assert store._conn().execute(entries).fetchone()[0] == 1
    finally:
        store.close()


def test_a_ledger_file_of_schema_1_is_brought_up_with_its_records(tmp_path: Path) -> None:
    """A file written at schema 1 (no review index) gets the index and version 2 when opened, and
    keeps its records; a schema 2 file opens as it is."""
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    unknown = st.mark_unknown(make("b"), now=NOW, reason="r", by=None)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute(_MIGRATIONS[1])  # schema 1 exactly as its onceonly made it
    conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
    conn.execute("PRAGMA user_version=1")
    conn.close()
    old = sqlite3.connect(path, isolation_level=None)  # its rows: the same 20 columns as now
    for rec in (make("a"), unknown):
        old.execute(_INSERT, _record_values(rec))
    old.close()

    store = SQLiteStore(url)
    try:
        conn = store._conn()
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 3
        assert store.controls("pause") == {}  # schema 3's table of control documents, empty
        indexes = [
            r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL")
        ]
        assert indexes == ["onceonly_records_review"]
        assert store.get("a") == make("a")
        assert store.scan(Query(states=[State.UNKNOWN])) == [unknown]
        assert "INDEX onceonly_records_review" in _plan(store, Query(states=[State.UNKNOWN]))
    finally:
        store.close()
    SQLiteStore(url).close()  # at the current version: opens without migrating again
