"""The PostgreSQL store: the durable choice for many hosts (psycopg 3 with ``psycopg_pool``).

One table, ``onceonly_records``, in the schema named by ``?schema=`` (default ``public``). Every
write is one autocommitted statement, so every transition is one transaction:

- claim: ``INSERT … ON CONFLICT (key) DO NOTHING``; only when it inserted nothing does a second
  statement read the stored row. A first call is then the floor's two writes (claim, settle) and no
  read; a replay costs two round trips;
- swap: ``UPDATE … WHERE key = $1 AND version = $2 AND created_at = $3``, writing only the columns
  that changed (``created_at`` tells a record lost and made again from the one the caller read);
- delete: ``DELETE … WHERE key = $1 AND version = $2`` (``AND created_at = $3`` when given).

The schema is created on first use under an advisory lock (many processes may start at once) and
carries a version table, ``onceonly_schema``, so a later release can migrate it; a schema newer than
this code, or tables of the same name that onceonly did not make, are refused with ``StoreCorrupt``
and left untouched.

Waiting without spinning: a waiter marks the row ``watched`` (an UPDATE that also checks the version
it read), and a trigger sends a NOTIFY only when a watched row changes. So the hot path (claim, settle)
never notifies unless someone waits on that very key: NOTIFY takes a database-wide lock at commit that
would otherwise serialise every settle. One LISTEN connection per store, in a daemon thread, wakes the
waiters of both faces; when it cannot listen, waiting falls back to polling.

The sync face uses a ``psycopg_pool.ConnectionPool``; the async face keeps its own idle connections
per event loop, made on first use in that loop (``_pools.LoopConnections`` says why not an async pool).
docs/postgres.md has the URL options, the indexes and what they cost, and the measured figures.

The parts: ``store`` (``PostgresStore`` and its primitives), ``_url`` (the URL's options), ``_schema``
(the tables, their migrations and the checks at open), ``_pools`` (connections and pools), ``_listen``
(LISTEN/NOTIFY), ``_similar`` (the SQL of near-duplicate calls), ``_errors`` (driver errors as the
store's), ``_names`` (the logger, quoting, the NOTIFY channel).
"""

from __future__ import annotations

from onceonly.stores.postgres._schema import SCHEMA_VERSION
from onceonly.stores.postgres._url import PostgresOptions, parse_postgres_url
from onceonly.stores.postgres.store import PostgresStore

__all__ = ["SCHEMA_VERSION", "PostgresOptions", "PostgresStore", "parse_postgres_url"]

# They say where users import them from: the package (reprs, docs, pickles).
for _public in (PostgresOptions, PostgresStore, parse_postgres_url):
    _public.__module__ = __name__
del _public
