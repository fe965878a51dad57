"""The PostgreSQL ledger's tables: the migrations that make them, and the checks at open (the server
takes writes and keeps them, the tables are onceonly's and at this code's version).

The schema is created on first use under an advisory lock (many processes may start at once) and
carries a version table, ``onceonly_schema``, so a later release can migrate it; a schema newer than
this code, or tables of the same name that onceonly did not make, are refused with ``StoreCorrupt``
and left untouched.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from typing import Any

import psycopg

from onceonly.errors import StoreCorrupt, StoreError, StoreUnavailable
from onceonly.states import UNSETTLED, State
from onceonly.stores._sql import COLUMNS, state_literals
from onceonly.stores._url import scrub
from onceonly.stores.postgres._controls import controls_ddl
from onceonly.stores.postgres._errors import translate
from onceonly.stores.postgres._names import channel, ident, log
from onceonly.stores.postgres._url import PostgresOptions

#: The version of the tables this code writes; ``_migrations`` brings older ones up to it.
SCHEMA_VERSION = 3

#: The states version 1's CHECK allowed: its statements stay as they were, whatever ``State`` holds now.
_V1_STATES = ("pending", "in_flight", "confirmed", "failed", "unknown", "needs_review", "abandoned")

# The states the open-records index holds, in the enum's order: the index's text stays the same
# from one run to the next (a frozenset's order may not).
_OPEN_STATES = tuple(s for s in State if s in UNSETTLED)


def _installed_version() -> str:
    """This onceonly's version, for the schema's ``installed_by``: read from the installed package's
    metadata, not from ``onceonly/__init__.py``, which sits layers above the stores (docs/design.md#layers)."""
    try:
        return importlib.metadata.version("onceonly")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def _text(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _migrations(schema: str) -> dict[int, list[str]]:
    """version reached → the statements that reach it from the one before."""
    s = ident(schema)
    t = f"{s}.onceonly_records"
    notify = _text(channel(schema))
    v1 = [
        f"""CREATE TABLE {s}.onceonly_schema (
            version      integer PRIMARY KEY,
            installed_at timestamptz NOT NULL DEFAULT now(),
            installed_by text NOT NULL
        )""",
        # Times are epoch seconds in double precision, as in the Record: they round-trip exactly.
        # JSON is kept as text: the Record holds the exact text, and jsonb would reformat it.
        # key COLLATE "C": byte order, which is code point order in UTF-8, as Python sorts keys.
        f"""CREATE TABLE {t} (
            key             text COLLATE "C" PRIMARY KEY,
            scope           text NOT NULL,
            tool            text NOT NULL,
            fingerprint     text NOT NULL,
            state           text NOT NULL CHECK (state IN ({", ".join(map(_text, _V1_STATES))})),
            attempts        integer NOT NULL,
            fence           bigint NOT NULL,
            version         bigint NOT NULL,
            lease_owner     text,
            lease_until     double precision,
            next_attempt_at double precision,
            expires_at      double precision,
            created_at      double precision NOT NULL,
            updated_at      double precision NOT NULL,
            result          text,
            error           text,
            args            text NOT NULL,
            history         text NOT NULL,
            via             text,
            conflicts       integer NOT NULL DEFAULT 0,
            watched         boolean NOT NULL DEFAULT false
        )""",
        # The reconciler's query (unknown, or held with an expired lease), in key order. Small: it
        # holds only the records that are open now. Purge's query: expired settled records.
        f"CREATE INDEX onceonly_records_open ON {t} (key) WHERE state IN ({state_literals(_OPEN_STATES)})",
        f"CREATE INDEX onceonly_records_expires ON {t} (expires_at) WHERE expires_at IS NOT NULL",
        # The payload is "<version> <key>" (version 0: deleted); waiters ignore a version they know.
        f"""CREATE FUNCTION {s}.onceonly_notify() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_OP = 'DELETE' THEN
                PERFORM pg_notify(TG_ARGV[0], '0 ' || OLD.key);
            ELSE
                PERFORM pg_notify(TG_ARGV[0], NEW.version::text || ' ' || NEW.key);
            END IF;
            RETURN NULL;
        END
        $$""",
        f"""CREATE TRIGGER onceonly_records_changed AFTER UPDATE ON {t} FOR EACH ROW
            WHEN (OLD.watched AND NEW.version <> OLD.version)
            EXECUTE FUNCTION {s}.onceonly_notify({notify})""",
        f"""CREATE TRIGGER onceonly_records_deleted AFTER DELETE ON {t} FOR EACH ROW
            WHEN (OLD.watched) EXECUTE FUNCTION {s}.onceonly_notify({notify})""",
    ]
    # Version 2: awaiting_approval (approve=). PostgreSQL names a column's CHECK <table>_<column>_check;
    # the new one takes the same name. The table keeps its rows: the change only widens the list.
    v2 = [
        f"""ALTER TABLE {t} DROP CONSTRAINT onceonly_records_state_check,
            ADD CONSTRAINT onceonly_records_state_check CHECK (state IN ({state_literals(list(State))}))""",
    ]
    # Version 3: operators' control documents (pauses: ``onceonly.pause``), a table of their own.
    return {1: v1, 2: v2, 3: controls_ddl(schema)}


def lock_id(schema: str) -> int:
    """The advisory lock that serialises the processes making a schema's tables."""
    digest = hashlib.sha256(f"onceonly schema {schema}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def ensure_schema(url: str, options: PostgresOptions, where: str) -> None:
    """Create or migrate the tables, or check them; on a connection of its own, closed after.

    Raises:
        StoreUnavailable: the server cannot be reached or takes no writes, or the user may not create
            the tables.
        StoreCorrupt: the tables are not onceonly's, or of a newer version than this code knows.
        StoreError: the server may lose acknowledged writes and ``require_durability`` is set.
    """
    _Opening(url, options, where).ensure()


class _Opening:
    """The checks at open, on one connection."""

    def __init__(self, url: str, options: PostgresOptions, where: str) -> None:
        self.url = url
        self.options = options
        self.schema = options.schema
        self._where = where
        self._conninfo = options.conninfo
        self._table = f"{ident(self.schema)}.onceonly_records"

    def ensure(self) -> None:
        try:
            conn = psycopg.connect(self._conninfo, autocommit=True)
        except psycopg.Error as exc:
            said = scrub(str(exc), self.url).strip()
            raise StoreUnavailable(
                f"cannot connect to {self._where}: {said}. Check that the server is up and the URL "
                "(host, port, database, user) is right"
            ) from exc
        try:
            with conn:
                self.check_server(conn)
                version, has_records = self.inspect(conn)
                if version != SCHEMA_VERSION or not has_records:
                    # Serialise the processes that start at once on a new schema: the first creates it,
                    # the others find it done. A transaction-level lock, released by the commit or the
                    # rollback whatever happens to this process: a session lock would stay held by a
                    # pooled backend behind a transaction pooler (PgBouncer), and block every later
                    # opening. inspect reads the catalog tables with a snapshot taken after the wait.
                    with conn.transaction():
                        conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_id(self.schema),))
                        version, has_records = self.inspect(conn)
                        self.migrate(conn, version, has_records)
                self.check_columns(conn)
        except StoreError:
            raise
        except psycopg.Error as exc:
            if exc.sqlstate == "42501":  # insufficient_privilege
                raise StoreUnavailable(
                    f"{self._where}: not allowed to create the ledger's tables ({str(exc).strip()}). Create them "
                    f"as an owner once (open the ledger as that user), or grant CREATE on schema {self.schema}"
                ) from exc
            raise translate(exc, self._where, self.options, closed=False, writing=False) from exc  # opening

    def check_server(self, conn: psycopg.Connection[Any]) -> None:
        """Refuse a server that cannot take the ledger's writes, and warn of (or refuse) one that may lose
        acknowledged ones. One query at open, on a connection opened as the pool's are, so the role's and
        the database's settings and the URL's ``options`` all count; nothing per call."""
        row = conn.execute(
            "SELECT pg_is_in_recovery(), current_setting('transaction_read_only'), "
            "current_setting('synchronous_commit'), current_setting('fsync')"
        ).fetchone()
        assert row is not None
        standby, read_only, synchronous_commit, fsync = bool(row[0]), row[1] == "on", row[2], row[3]
        if standby or read_only:
            if standby:
                what = "is a hot standby (pg_is_in_recovery() is true): it takes no writes"
            else:
                what = (
                    "accepts only read-only transactions (transaction_read_only is on: default_transaction_read_only "
                    "is set for this role, database or server)"
                )
            raise StoreUnavailable(
                f"{self._where} {what}, and every write of the ledger would fail. Give the primary's address, or "
                "list every host with target_session_attrs=read-write in the URL "
                "(postgresql://host1,host2/db?target_session_attrs=read-write) so that libpq picks the primary"
            )
        lossy = []
        if synchronous_commit == "off":
            lossy.append("synchronous_commit is off (a commit is acknowledged before it is flushed)")
        if fsync == "off":
            lossy.append("fsync is off (nothing is flushed to disk)")
        if not lossy:
            return
        what = (
            f"{self._where}: {' and '.join(lossy)}, so a crash of the server may lose writes it has already "
            "acknowledged: a lost claim or result is a call that runs again."
        )
        fix = (
            "Set synchronous_commit = on (and fsync = on) for the server, the database or the ledger's role "
            "(ALTER ROLE … SET synchronous_commit = on)"
        )
        if self.options.require_durability:
            raise StoreError(f"{what} {fix}, or open the ledger without require_durability=true")
        if self.options.warn_durability:
            log.warning("onceonly: %s %s, or open the ledger with warn_durability=false if this is intended", what, fix)

    def inspect(self, conn: psycopg.Connection[Any]) -> tuple[int | None, bool]:
        """The schema version (None: no version table) and whether the records table exists."""
        s = ident(self.schema)
        # A query on pg_class, not to_regclass(): that looks names up in this backend's catalog cache,
        # which may still hold "no such table" from before another process committed them.
        row = conn.execute(
            "SELECT bool_or(c.relname = 'onceonly_schema'), bool_or(c.relname = 'onceonly_records') "
            "FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relname IN ('onceonly_schema', 'onceonly_records')",
            (self.schema,),
        ).fetchone()
        assert row is not None
        has_version, has_records = bool(row[0]), bool(row[1])
        if not has_version:
            return None, has_records
        try:
            found = conn.execute(f"SELECT max(version) FROM {s}.onceonly_schema").fetchone()
        except psycopg.errors.UndefinedColumn as exc:
            raise StoreCorrupt(
                f"{self._where}: the table {self.schema}.onceonly_schema was not made by onceonly. Nothing was "
                "changed: give the ledger a schema of its own (?schema=onceonly)"
            ) from exc
        version = found[0] if found else None
        if version is None or version < 1:
            # Not a state onceonly leaves (it writes the version row in the transaction that makes the
            # tables): a restore without its rows, or a hand edit. Migrating from 0 would fail half-way.
            held = "is empty" if version is None else f"holds version {version}, which onceonly never writes"
            if has_records:
                fix = (
                    "restore its rows, or insert the version the tables are at (this onceonly writes "
                    f"{SCHEMA_VERSION}) if you know it"
                )
            else:
                fix = "drop onceonly_schema to start anew"
            raise StoreCorrupt(
                f"{self._where}: the version table {self.schema}.onceonly_schema {held} and the table "
                f"onceonly_records {'exists' if has_records else 'is missing'}: it was changed by hand. Nothing "
                f"was changed: {fix}, or give the ledger a schema of its own"
            )
        return int(version), has_records

    def migrate(self, conn: psycopg.Connection[Any], version: int | None, has_records: bool) -> None:
        where = f"{self._where}, schema {self.schema}"
        if version is None and has_records:
            raise StoreCorrupt(
                f"{where} has a table onceonly_records but no onceonly_schema version table: onceonly did not "
                "make it. Nothing was changed: give the ledger a schema of its own (?schema=onceonly)"
            )
        if version is not None and version > SCHEMA_VERSION:
            raise StoreCorrupt(
                f"{where} has ledger schema version {version}, newer than this onceonly knows "
                f"({SCHEMA_VERSION}). Nothing was changed: upgrade onceonly on this host"
            )
        if version == SCHEMA_VERSION and not has_records:
            raise StoreCorrupt(
                f"{where} is at schema version {version} but its table onceonly_records is missing: the ledger "
                "was dropped by hand. Nothing was changed: restore it, or drop onceonly_schema to start anew"
            )
        if version == SCHEMA_VERSION:
            return
        exists = conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = %s)", (self.schema,)
        ).fetchone()
        if not (exists and exists[0]):
            conn.execute(f"CREATE SCHEMA {ident(self.schema)}")
        steps = _migrations(self.schema)
        for target in range((version or 0) + 1, SCHEMA_VERSION + 1):
            for statement in steps[target]:
                conn.execute(statement)
            conn.execute(
                f"INSERT INTO {ident(self.schema)}.onceonly_schema (version, installed_by) VALUES (%s, %s)",
                (target, f"onceonly {_installed_version()}"),
            )

    def check_columns(self, conn: psycopg.Connection[Any]) -> None:
        try:
            conn.execute(f"SELECT {COLUMNS}, watched FROM {self._table} LIMIT 0")
        except psycopg.errors.UndefinedColumn as exc:
            raise StoreCorrupt(
                f"{self._where}: {self.schema}.onceonly_records lacks columns of schema version {SCHEMA_VERSION} "
                f"({str(exc).strip()}): it was changed by hand. Nothing was changed"
            ) from exc
