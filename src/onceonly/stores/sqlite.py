"""The SQLite store: embedded, the default; safe for several threads and processes on one host.

One connection per thread (sqlite3 connections must not be shared while in use), autocommit, WAL, a
busy timeout. Every write is one statement, so every write is one transaction: ``INSERT OR IGNORE``
is the claim, ``UPDATE … WHERE version = ? AND created_at = ?`` the compare-and-set.

Durability: ``synchronous=NORMAL`` by default. In WAL mode that survives any crash of the process
(SIGKILL included) but may lose the last transactions on power loss or an OS crash; pass
``?synchronous=full`` in the URL to fsync every commit, at the price of a disk flush per write.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import operator
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import compress
from pathlib import Path
from typing import Literal, TypeVar
from urllib.parse import parse_qs, quote, unquote, urlencode, urlsplit

from onceonly.errors import StoreCorrupt, StoreUnavailable
from onceonly.similar import Candidate
from onceonly.states import HELD as HELD_STATES
from onceonly.states import Record, State
from onceonly.stores._controls import SQLITE_CONTROLS, SQLiteControls
from onceonly.stores._holders import Holder, Survey, UnsafeOwnersDir, owners_dir, survey
from onceonly.stores._sql import (
    COLUMN_OF,
    COLUMNS,
    SWAP_FIELDS,
    counts_by_state,
    counts_by_tool,
    row_to_record,
    scan_sql,
    swap_fields,
)
from onceonly.stores._sqlite_budgets import SQLiteBudgets, in_transaction
from onceonly.stores._url import redact_url
from onceonly.stores.base import Query

__all__ = ["APPLICATION_ID", "SCHEMA_VERSION", "SQLiteStore"]

T = TypeVar("T")

#: ``PRAGMA application_id`` of an onceonly ledger file: "once" in ASCII.
APPLICATION_ID = 0x6F6E6365
#: ``PRAGMA user_version``: bumped with every schema change; ``_MIGRATIONS`` brings older files up.
SCHEMA_VERSION = 3

_SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS onceonly_records (
    key             TEXT PRIMARY KEY,
    scope           TEXT NOT NULL,
    tool            TEXT NOT NULL,
    fingerprint     TEXT NOT NULL,
    state           TEXT NOT NULL,
    attempts        INTEGER NOT NULL,
    fence           INTEGER NOT NULL,
    version         INTEGER NOT NULL,
    lease_owner     TEXT,
    lease_until     REAL,
    next_attempt_at REAL,
    expires_at      REAL,
    created_at      REAL NOT NULL,
    updated_at      REAL NOT NULL,
    result          TEXT,
    error           TEXT,
    args            TEXT NOT NULL,
    history         TEXT NOT NULL,
    via             TEXT,
    conflicts       INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID
"""
# One secondary index, on the two states a person or a probe must settle: `ls --state unknown` and the
# review queue read those records alone. A guarded call never enters it (claimed in flight, settled
# confirmed or failed): its two writes only test the condition, which costs nothing measurable. An index
# that also held in-flight records, so that a pass finds expired leases without reading every record,
# added ~30 % to those two writes (the claim enters it, the settle leaves it: one more page each,
# `bench_sqlite.py --indexes`). A reconcile pass learns instead from the lease holders' files whether
# any held record can have an expired lease (stores/_holders.py), and reads them only then.
# The condition is one `state = …` per state: the only form SQLite proves a query's `state = 'unknown'`
# to imply (scan_sql(state_per_term=True) writes the queries that way).
_REVIEW_INDEX = (
    "CREATE INDEX IF NOT EXISTS onceonly_records_review ON onceonly_records (state, key) "
    "WHERE state = 'unknown' OR state = 'needs_review'"
)

# The tables of near-duplicate calls (onceonly.Similar), made on first use so that a ledger without
# similar= tools never has them: members (key → group, claimed at; indexed by group and time) and group
# locks. A record's membership goes with it (a trigger on delete: purge); nothing fires on the other
# tools' writes.
_SIMILAR_TABLES = (
    """CREATE TABLE IF NOT EXISTS onceonly_similar (
        key TEXT PRIMARY KEY,
        grp TEXT NOT NULL,
        at  REAL NOT NULL
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS onceonly_similar_group ON onceonly_similar (grp, at)",
    """CREATE TABLE IF NOT EXISTS onceonly_similar_locks (
        grp   TEXT PRIMARY KEY,
        token TEXT NOT NULL,
        until REAL NOT NULL
    ) WITHOUT ROWID""",
    """CREATE TRIGGER IF NOT EXISTS onceonly_similar_gone AFTER DELETE ON onceonly_records
    BEGIN DELETE FROM onceonly_similar WHERE key = OLD.key; END""",
)
_SIMILAR_LOCK = (
    "INSERT INTO onceonly_similar_locks (grp, token, until) VALUES (?, ?, ?) ON CONFLICT (grp) DO UPDATE "
    "SET token = excluded.token, until = excluded.until "
    "WHERE onceonly_similar_locks.token = excluded.token OR onceonly_similar_locks.until <= ?"
)
_SIMILAR_READ = (
    "SELECT m.key, m.at, r.args FROM onceonly_similar m JOIN onceonly_records r ON r.key = m.key "
    "WHERE m.grp = ? AND m.at >= ? ORDER BY m.at DESC LIMIT ?"
)
_SIMILAR_UNLOCK = "DELETE FROM onceonly_similar_locks WHERE grp = ? AND token = ?"

# version reached → the statements that reach it from the one before.
_MIGRATIONS: dict[int, str] = {1: _SCHEMA_V1, 2: _REVIEW_INDEX, 3: SQLITE_CONTROLS}

_SELECT = f"SELECT {COLUMNS} FROM onceonly_records WHERE key = ?"
_INSERT = f"INSERT OR IGNORE INTO onceonly_records ({COLUMNS}) VALUES ({','.join('?' * 20)})"
_UPDATES: dict[tuple[bool, ...], str] = {}  # which fields changed → the UPDATE that writes them
# Our own type binds as its text; a dict lookup in C (Enum.value is a Python-level property).
sqlite3.register_adapter(State, {s: s.value for s in State}.__getitem__)


# A record's values in COLUMNS order, in one C call (the state binds through its adapter).
_record_values = operator.attrgetter(*Record.__dataclass_fields__)
# The held states, compared by identity: `in HELD` hashes the enum member in Python on every write.
_PENDING, _IN_FLIGHT = State.PENDING, State.IN_FLIGHT


def _is_locked(exc: sqlite3.Error) -> bool:
    msg = str(exc).lower()
    return "locked" in msg or "busy" in msg


def parse_sqlite_url(url: str) -> tuple[Path, dict[str, str]]:
    """``sqlite:///relative.db`` or ``sqlite:////absolute.db`` (SQLAlchemy's habit) → path, options."""
    parts = urlsplit(url)
    if parts.scheme != "sqlite":
        raise ValueError(f"not a sqlite URL: {redact_url(url)!r}")
    raw = unquote(parts.path)
    if parts.netloc:
        raise ValueError(
            f"sqlite URL {redact_url(url)!r} has a host part: use sqlite:///relative.db or sqlite:////abs/path.db"
            " (a SQLite ledger is a local file)"
        )
    # urlsplit keeps the leading slash of the path: "sqlite:///a.db" → "/a.db" means relative "a.db".
    path = raw[1:] if raw.startswith("/") else raw
    if not path or path == ":memory:":
        raise ValueError(
            f"sqlite URL {redact_url(url)!r} names no file: the ledger must outlive the process, "
            "give a file such as sqlite:///.onceonly/ledger.db"
        )
    opts = {k.lower(): v[-1] for k, v in parse_qs(parts.query).items()}
    return Path(path), opts


class _Connection(sqlite3.Connection):
    """A connection the store can hold weakly (``sqlite3.Connection`` itself takes no weak reference)."""


# The stores of this process, so that a forked child can drop its parent's connections. SQLite forbids
# using a connection across fork(), and POSIX locks are not inherited: a child writing through its
# parent's connection committed into a WAL that the parent's close then checkpointed and deleted, so
# the child's records vanished and their operations ran again. Merely setting them aside is not
# enough: SQLite's per-file lock count, copied into the child, would let the child's new connection
# count a lock it does not hold. So the child closes them (the parent's real locks keep that close
# from checkpointing under it) and opens its own.
_stores: weakref.WeakSet[SQLiteStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_stores):
        store._forget_inherited()


os.register_at_fork(after_in_child=_after_fork_in_child)


class SQLiteStore(SQLiteBudgets, SQLiteControls):
    """An onceonly ledger in one SQLite file.

    Args:
        url: ``sqlite:///relative.db`` or ``sqlite:////absolute/path.db``; options in the query:
            ``timeout`` (busy timeout, seconds, default 30), ``synchronous`` (``normal`` or ``full``).

    .. versionadded:: 0.1
    """

    def __init__(self, url: str, *, upgrade: bool = True) -> None:
        self.url = url
        # False: a ledger file of an older schema is used as it is, not brought up (the commands that
        # only read a ledger must leave it as they found it; every schema so far reads the same rows).
        self.upgrade = upgrade
        self.path, opts = parse_sqlite_url(url)
        shown = redact_url(url)
        unknown = sorted(set(opts) - {"timeout", "synchronous"})
        if unknown:
            raise ValueError(
                f"{shown!r}: unknown option(s) {', '.join(unknown)}; a sqlite URL takes timeout= and synchronous="
            )
        try:
            self.busy_timeout = float(opts.get("timeout", "30"))
        except ValueError:
            self.busy_timeout = math.nan
        if not (math.isfinite(self.busy_timeout) and self.busy_timeout >= 0):
            raise ValueError(f"timeout={opts['timeout']!r} in {shown!r}: give the busy timeout in seconds, 0 or more")
        sync = opts.get("synchronous", "normal").upper()
        if sync not in ("NORMAL", "FULL", "EXTRA", "OFF"):
            raise ValueError(f"synchronous={sync.lower()!r} in {shown!r}: use normal or full")
        self.synchronous = sync
        self._local = threading.local()
        # Weak: a thread that ends drops its thread-local connection, which then closes; a strong list
        # kept every ended thread's connection (its files and page cache) open until close().
        self._all: weakref.WeakSet[_Connection] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._closed = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The leases this process holds, published for reconcile passes (stores/_holders.py). Left at
        # exit, or when the store is dropped unclosed: the file goes, or its lock does.
        self._holder = Holder(owners_dir(self.path))
        self._held = self._holder._leases
        weakref.finalize(self, self._holder.close)
        self._conn()  # open (and create or check the schema) now, so a bad file fails at open
        _stores.add(self)

    def _forget_inherited(self) -> None:
        """In a forked child (only the forking thread runs): close the parent's connections, use new ones."""
        inherited = list(self._all)
        self._local = threading.local()
        self._all = weakref.WeakSet()
        self._lock = threading.Lock()
        self._holder.forget()
        self._held = self._holder._leases
        for conn in inherited:
            with contextlib.suppress(sqlite3.Error):
                conn.close()

    # --- connections --------------------------------------------------------------------------

    def _conn(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is not None:
            return conn
        if self._closed:
            raise StoreUnavailable(f"the ledger {redact_url(self.url)} was closed")
        conn = self._connect()
        self._local.conn = conn
        # Reused by the hot primitives: conn.execute() would build a new cursor for every statement
        # (a few µs of Python on every call).
        self._local.cursor = conn.cursor()
        with self._lock:
            self._all.add(conn)
        return conn

    def _cursor(self) -> sqlite3.Cursor:
        """This thread's cursor for the hot primitives (its connection opened on first use)."""
        cursor: sqlite3.Cursor | None = getattr(self._local, "cursor", None)
        if cursor is None:
            self._conn()
            cursor = self._local.cursor
        return cursor

    def _connect(self) -> _Connection:
        try:
            conn = sqlite3.connect(
                self.path, timeout=self.busy_timeout, isolation_level=None, check_same_thread=False, factory=_Connection
            )
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"cannot open the ledger file {self.path}: {exc}") from exc
        try:
            self._retry_locked(lambda: self._setup(conn))
        except BaseException:
            conn.close()
            raise
        return conn

    def _retry_locked(self, fn: Callable[[], T]) -> T:
        """Retry what SQLite refuses with "database is locked" before its busy handler applies.

        Several processes opening a new file at once race on ``journal_mode=WAL`` and on the schema;
        those statements can fail at once instead of waiting. Retry them within the busy timeout.
        """
        deadline = time.monotonic() + self.busy_timeout
        delay = 0.002
        while True:
            try:
                return fn()
            except sqlite3.OperationalError as exc:
                if not _is_locked(exc) or time.monotonic() > deadline:
                    raise StoreUnavailable(f"the ledger file {self.path} stays locked: {exc}") from exc
                time.sleep(delay)
                delay = min(delay * 2, 0.1)

    def _setup(self, conn: sqlite3.Connection) -> None:
        try:
            app_id, version, tables = self._identify(conn)
            if app_id == APPLICATION_ID and (
                version == SCHEMA_VERSION or (not self.upgrade and 1 <= version < SCHEMA_VERSION)
            ):
                self._pragmas(conn)
                return
            # Check before the first write (journal_mode=WAL rewrites the header): a file that is not
            # ours, or is newer than us, must be left exactly as it was.
            self._refuse_foreign(app_id, version, tables)
            self._pragmas(conn)
            self._create_or_migrate(conn)
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError):
                if _is_locked(exc):
                    raise
                # Read-only, cannot open, I/O error, disk full: the file may be a good ledger.
                raise StoreUnavailable(
                    f"cannot open the ledger file {self.path} for writing ({exc}): check that this process may "
                    "write the file and its directory (SQLite keeps -wal and -shm files beside it) and that the "
                    "disk has room"
                ) from exc
            raise StoreCorrupt(
                f"{self.path} is not a readable SQLite database ({exc}). Nothing was changed in it: "
                "move it away or open a ledger at another path"
            ) from exc

    def _pragmas(self, conn: sqlite3.Connection) -> None:
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise StoreUnavailable(f"{self.path}: cannot switch to WAL journal mode (got {mode!r})")
        conn.execute(f"PRAGMA synchronous={self.synchronous}")
        # A ledger is read by random hashed keys: a 64 MiB page cache and memory-mapped reads keep a
        # replay from paying a read() system call per B-tree page once the file outgrows the default
        # 2 MiB cache. The cache is per connection, so per thread: docs/sqlite.md says what it costs.
        conn.execute("PRAGMA cache_size=-65536")
        conn.execute("PRAGMA mmap_size=268435456")

    @staticmethod
    def _identify(conn: sqlite3.Connection) -> tuple[int, int, list[str]]:
        # One statement, one snapshot: read separately, another process's schema creation could
        # commit between the reads and make a half-made ledger look like a foreign database.
        app_id, version, tables = conn.execute(
            "SELECT (SELECT application_id FROM pragma_application_id), "
            "(SELECT user_version FROM pragma_user_version), "
            "(SELECT group_concat(name, char(31)) FROM sqlite_master WHERE type = 'table')"
        ).fetchone()
        return int(app_id), int(version), tables.split("\x1f") if tables else []

    def _refuse_foreign(self, app_id: int, version: int, tables: list[str]) -> None:
        if app_id not in (0, APPLICATION_ID):
            raise StoreCorrupt(
                f"{self.path} belongs to another application (application_id {app_id:#x}). "
                "Nothing was changed in it: open the ledger at another path"
            )
        if app_id == 0 and tables:
            raise StoreCorrupt(
                f"{self.path} is a SQLite database of another application (tables: "
                f"{', '.join(sorted(tables)[:5])}). Nothing was changed in it: open the ledger at another path"
            )
        if version > SCHEMA_VERSION:
            raise StoreCorrupt(
                f"{self.path} has ledger schema {version}, newer than this onceonly knows ({SCHEMA_VERSION}): "
                "upgrade onceonly"
            )

    def _create_or_migrate(self, conn: sqlite3.Connection) -> None:
        # IMMEDIATE takes the write lock first, so two processes creating one file serialise here and
        # the second sees the first's finished schema.
        conn.execute("BEGIN IMMEDIATE")
        try:
            app_id, version, tables = self._identify(conn)
            self._refuse_foreign(app_id, version, tables)  # again, under the write lock
            for target in range(version + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[target].split(";"):
                    if statement.strip():
                        conn.execute(statement)
            conn.execute(f"PRAGMA application_id={APPLICATION_ID}")
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _translate(self, exc: sqlite3.Error) -> Exception:
        """The store error for a sqlite3 error: busy or I/O → unavailable, anything else → corrupt."""
        if isinstance(exc, sqlite3.OperationalError):
            return StoreUnavailable(f"the ledger file {self.path} failed: {exc}")
        return StoreCorrupt(f"the ledger file {self.path} is damaged: {exc}")

    @contextmanager
    def _errors(self) -> Iterator[None]:
        """Translate sqlite3 errors into the store's error tree."""
        try:
            yield
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc

    # --- the primitives -------------------------------------------------------------------------

    # The three hot primitives translate errors with a plain try (free in 3.11) rather than the
    # _errors() context manager, which costs a generator per call.

    def get(self, key: str) -> Record | None:
        try:
            # fetchall, not fetchone: the statement runs to its end and releases its read snapshot now.
            rows = self._cursor().execute(_SELECT, (key,)).fetchall()
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc
        return row_to_record(rows[0]) if rows else None

    def claim(self, record: Record) -> Record | None:
        # Insert first: a first call is then the floor's two writes and no read. A read before every
        # insert cost ~4 µs alone, and with 8 processes on one file a third of the throughput (0.45-0.49x
        # of the floor against 0.72-0.75x: every extra transaction re-reads pages another process
        # changed); a replay pays an ignored insert (~7 µs) before its read instead (docs/benchmarks.md).
        while True:
            if self.insert(record):
                return None
            current = self.get(record.key)
            if current is not None:
                return current
            # Deleted (purged) between our insert and our read: claim again.

    def insert(self, record: Record) -> bool:
        cursor = self._cursor()  # first: a closed store publishes nothing
        held = record.state is _PENDING or record.state is _IN_FLIGHT
        if held:
            self._hold(record)  # published before the write: a crash right after it is seen
        try:
            cur = cursor.execute(_INSERT, _record_values(record))
        except sqlite3.Error as exc:
            if held:
                self._recheck(record.key, record.lease_owner)
            raise self._translate(exc) from exc
        if cur.rowcount == 1:
            return True
        if held:
            self._holder.gone(record.key, record.lease_owner)  # a replay: nothing of ours was written
        return False

    def swap(self, record: Record, expected: Record) -> bool:
        # Write only the columns that changed: a settle that leaves args alone does not rewrite them
        # (about 10 µs of the floor per call, docs/benchmarks.md).
        # The diff runs in C (map, compress); a changed state binds through the adapter registered above.
        new = swap_fields(record)
        changed = tuple(map(operator.ne, new, swap_fields(expected)))
        sql = _UPDATES.get(changed)
        if sql is None:
            sets = "".join(f", {COLUMN_OF.get(n, n)}=?" for n in compress(SWAP_FIELDS, changed))
            sql = _UPDATES[changed] = (
                f"UPDATE onceonly_records SET version=?{sets} WHERE key=? AND version=? AND created_at=?"
            )
        values = [record.version, *compress(new, changed), record.key, expected.version, expected.created_at]
        key, owner, was = record.key, record.lease_owner, expected.lease_owner
        cursor = self._cursor()  # first: a closed store publishes nothing
        holds = record.state is _PENDING or record.state is _IN_FLIGHT
        taken = holds and self._hold(record)  # a lease new to us, published before the write
        try:
            cur = cursor.execute(sql, values)
        except sqlite3.Error as exc:
            for who in {owner, was}:
                if (key, who) in self._held:
                    self._recheck(key, who)  # did it land? publish what is stored
            raise self._translate(exc) from exc
        if cur.rowcount == 1:
            if (key, was) in self._held and (was != owner or not holds):
                self._holder.gone(key, was)  # a lease of ours that this write ended or passed on
            return True
        if taken:
            self._holder.gone(key, owner)  # not written: we do not hold it after all
        if (key, was) in self._held:
            self._recheck(key, was)
        return False

    def _hold(self, record: Record) -> bool:
        """Publish a lease of ours before writing it (stores/_holders.py); True when it is a new one."""
        try:
            return self._holder.held(record.key, record.lease_owner, record.lease_until, record.updated_at)
        except UnsafeOwnersDir as exc:
            raise StoreUnavailable(str(exc)) from exc  # says what it is and what to do
        except OSError as exc:
            raise StoreUnavailable(
                f"cannot write {self._holder.directory} ({exc}): a SQLite ledger keeps who holds its "
                "leases there, beside the ledger file; let this process write that directory"
            ) from exc

    def _recheck(self, key: str, owner: str | None) -> None:
        """A write of a record we hold failed or lost to another: publish its lease as it is stored,
        or stop publishing it if the record is no longer held by ``owner``."""
        try:
            cur = self.get(key)
        except StoreCorrupt:
            cur = None
        except StoreUnavailable:
            return  # unknown: keep publishing it, the careful side
        if cur is not None and cur.state in HELD_STATES and cur.lease_owner == owner:
            with contextlib.suppress(OSError):  # published already: the file exists
                self._holder.held(key, owner, cur.lease_until, cur.updated_at)
        else:
            self._holder.gone(key, owner)

    def delete(self, key: str, expected_version: int, created_at: float | None = None) -> bool:
        sql = "DELETE FROM onceonly_records WHERE key = ? AND version = ?"
        params: tuple[object, ...] = (key, expected_version)
        if created_at is not None:
            sql += " AND created_at = ?"
            params += (created_at,)
        with self._errors():
            cur = self._conn().execute(sql, params)
        if cur.rowcount != 1:
            return False
        if self._held:
            # list() first: a copy in one C call, while other threads' calls add and remove entries.
            for k, owner in [k for k in list(self._held) if k[0] == key]:
                self._holder.gone(k, owner)
        return True

    def lease_survey(self, now: float, full_every: float | None) -> Survey:
        """Whether a reconcile pass at ``now`` must read the held records: has a lease possibly run out
        (stores/_holders.py)? ``full_every``: read them anyway when no pass did for that many seconds."""
        return survey(owners_dir(self.path), now, full_every)

    def scan(self, query: Query) -> list[Record]:
        built = scan_sql(query, table="onceonly_records", columns=COLUMNS, placeholder="?", state_per_term=True)
        if built is None:
            return []
        sql, params = built
        with self._errors():
            rows = self._conn().execute(sql, params).fetchall()
        return [row_to_record(r) for r in rows]

    def count_by_state(self) -> dict[State, int]:
        with self._errors():
            rows = self._conn().execute("SELECT state, COUNT(*) FROM onceonly_records GROUP BY state").fetchall()
        return counts_by_state(rows)

    def count_by_tool(self) -> dict[tuple[str, State], int]:
        """Records per (tool, state): the ``onceonly_records`` gauge's series, in one query."""
        sql = "SELECT tool, state, COUNT(*) FROM onceonly_records GROUP BY tool, state"
        with self._errors():
            rows = self._conn().execute(sql).fetchall()
        return counts_by_tool(rows)

    def wait_for_change(self, key: str, version: int, timeout: float) -> None:
        # SQLite has no notifications across processes: the caller polls with a growing interval.
        time.sleep(timeout)

    # --- near-duplicate calls (onceonly.Similar): only tools with similar= come here ---------------------

    def _ensure_similar(self, conn: sqlite3.Connection) -> None:
        if not getattr(self, "_similar_ready", False):
            self.transaction(lambda c: [c.execute(statement) for statement in _SIMILAR_TABLES])
            self._similar_ready = True

    def transaction(self, fn: Callable[[sqlite3.Connection], T], *, write: bool = True) -> T:
        """``fn(connection)`` on this thread's connection in one ``BEGIN IMMEDIATE`` transaction, retried while
        the file is locked (``write=False``: as it is); errors as the store's. Budgets write through it."""
        conn = self._conn()
        with self._errors():
            return self._retry_locked(lambda: in_transaction(conn, fn, write))

    def similar_lock(
        self, group: str, token: str, now: float, until: float, since: float, limit: int
    ) -> list[Candidate] | None:
        conn = self._conn()
        self._ensure_similar(conn)
        with self._errors():
            # Two statements: the read's snapshot starts after the lock is ours, so it sees every claim
            # committed by the group's last holder.
            if conn.execute(_SIMILAR_LOCK, (group, token, until, now)).rowcount != 1:
                return None
            rows = conn.execute(_SIMILAR_READ, (group, since, limit)).fetchall()
        return [Candidate(k, float(at), args) for k, at, args in rows]

    def similar_claim(self, record: Record, group: str, token: str) -> Record | Literal[False] | None:
        conn = self._conn()
        held = record.state is _PENDING or record.state is _IN_FLIGHT
        if held:
            self._hold(record)
        with self._errors():
            conn.execute("BEGIN IMMEDIATE")
            try:
                if conn.execute(_SIMILAR_UNLOCK, (group, token)).rowcount != 1:
                    conn.execute("ROLLBACK")
                    if held:
                        self._holder.gone(record.key, record.lease_owner)
                    return False  # the lock ran out and another call took it: nothing written
                inserted = conn.execute(_INSERT, _record_values(record)).rowcount == 1
                if inserted:
                    conn.execute(
                        "INSERT OR REPLACE INTO onceonly_similar (key, grp, at) VALUES (?, ?, ?)",
                        (record.key, group, record.created_at),
                    )
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                if held:
                    self._recheck(record.key, record.lease_owner)  # written or not: as stored
                raise
        if not inserted:
            if held:
                self._holder.gone(record.key, record.lease_owner)
            return self.get(record.key)
        return None

    def similar_unlock(self, group: str, token: str) -> None:
        with self._errors():
            self._conn().execute(_SIMILAR_UNLOCK, (group, token))

    # --- on an event loop (stores.base.InlineStore) -----------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return self._closed

    def writes_inline(self) -> bool:
        """Whether a write takes microseconds (``synchronous`` NORMAL or OFF: no fsync per commit), so
        that it may be made on an event loop."""
        return self.synchronous in ("NORMAL", "OFF")

    def nowait(self) -> SQLiteStore:
        """The same file through connections whose busy timeout is 0: a lock held elsewhere fails a call
        at once (``is_busy``) instead of stopping the thread. A new store: the caller closes it."""
        query = urlencode({"timeout": "0", "synchronous": self.synchronous.lower()})
        return SQLiteStore(f"sqlite:///{quote(str(self.path.resolve()))}?{query}")

    def is_busy(self, exc: BaseException) -> bool:
        """Whether a call failed only because another connection held the lock (it wrote nothing)."""
        cause = exc.__cause__ if isinstance(exc, StoreUnavailable) else exc
        if not isinstance(cause, sqlite3.OperationalError):
            return False
        message = str(cause).lower()
        return "locked" in message or "busy" in message

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, self._all = list(self._all), weakref.WeakSet()
        for conn in conns:
            with contextlib.suppress(sqlite3.Error):  # closing a broken connection
                conn.close()
        self._local = threading.local()
        self._holder.close()

    # --- async face: sqlite3 blocks, so every call runs in a worker thread ------------------------

    async def aget(self, key: str) -> Record | None:
        return await asyncio.to_thread(self.get, key)

    async def aclaim(self, record: Record) -> Record | None:
        return await asyncio.to_thread(self.claim, record)

    async def ainsert(self, record: Record) -> bool:
        return await asyncio.to_thread(self.insert, record)

    async def aswap(self, record: Record, expected: Record) -> bool:
        return await asyncio.to_thread(self.swap, record, expected)

    async def adelete(self, key: str, expected_version: int, created_at: float | None = None) -> bool:
        return await asyncio.to_thread(self.delete, key, expected_version, created_at)

    async def ascan(self, query: Query) -> list[Record]:
        return await asyncio.to_thread(self.scan, query)

    async def await_for_change(self, key: str, version: int, timeout: float) -> None:
        await asyncio.sleep(timeout)

    async def asimilar_lock(
        self, group: str, token: str, now: float, until: float, since: float, limit: int
    ) -> list[Candidate] | None:
        return await asyncio.to_thread(self.similar_lock, group, token, now, until, since, limit)

    async def asimilar_claim(self, record: Record, group: str, token: str) -> Record | Literal[False] | None:
        return await asyncio.to_thread(self.similar_claim, record, group, token)

    async def asimilar_unlock(self, group: str, token: str) -> None:
        await asyncio.to_thread(self.similar_unlock, group, token)

    async def aclose(self) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SQLiteStore({redact_url(self.url)!r}, pid={os.getpid()})"
