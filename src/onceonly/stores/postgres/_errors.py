"""What a driver error means for the ledger: connection trouble is ``StoreUnavailable``, anything else
``StoreCorrupt``, each saying what was wrong and what to do."""

from __future__ import annotations

import psycopg
from psycopg_pool import PoolClosed, PoolTimeout

from onceonly.errors import StoreCorrupt, StoreError, StoreUnavailable
from onceonly.stores import _pgwire as wire
from onceonly.stores.postgres._url import PostgresOptions


def translate(
    exc: BaseException,
    where: str,
    options: PostgresOptions,
    closed: bool,
    cursor: bool = False,
    writing: bool = True,
) -> StoreError:
    """The store error for a driver error: connection trouble → unavailable, anything else → corrupt.

    ``where`` names the ledger in the message; ``closed``: the store was closed (whatever the error,
    that is what the caller hears). ``cursor``: it came from a statement sent through psycopg's cursor
    (the store's ``_run``), not a hot one. ``writing``: the statement writes, so whether it landed is
    unknown; a read or an open changed nothing, and the message does not say otherwise.
    """
    # The driver's text may end with its own full stop; the message adds sentences after it.
    text = str(exc).strip().rstrip(".").strip() or type(exc).__name__
    landed = (
        "Whether the last write landed is unknown; the ledger reads the record again before it decides"
        if writing
        else "It was a read or an open, which changes nothing: try again once the server answers"
    )
    if isinstance(exc, PoolClosed) or closed:
        return StoreUnavailable(f"{where} was closed")
    if isinstance(exc, PoolTimeout):
        return StoreUnavailable(
            f"{where}: no connection within {options.pool_timeout:g}s ({text}). Is the server "
            "up and reachable? (raise pool_max_size or pool_timeout in the URL if it is only busy)"
        )
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate == "57014" and options.statement_timeout is not None and "statement timeout" in text:
        return StoreUnavailable(
            f"{where}: a statement ran longer than statement_timeout={options.statement_timeout} "
            f"and the server cancelled it ({text}). {landed}. If the server is only slow (a lock held long, a "
            "busy disk), raise statement_timeout in the URL"
        )
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError) or sqlstate == "25006":
        # 25006: read-only transaction, e.g. connected to a standby after a failover.
        return StoreUnavailable(f"{where} failed: {text}. {landed}")
    if sqlstate == wire.NOT_PREPARED and cursor:
        # The store's connections never prepare these (prepare_threshold=None): not ours to prepare again.
        return StoreUnavailable(
            f"{where}: a statement sent through psycopg's cursor (a scan, count, delete or a waiter's "
            f"mark) met a prepared statement or portal that the backend did not know ({text}). The store "
            "never prepares those statements, so something else changed the connection's session, likely a "
            "pooler in transaction mode that hands it another backend: connect the ledger in session mode "
            "(or bypass the pooler). The statement ran nowhere"
        )
    if sqlstate == wire.NOT_PREPARED:
        return StoreUnavailable(
            f"{where}: one of the store's hot statements (a read by key, a claim's insert, a swap) "
            f"was unknown to the backend that was to run it ({text}), even right after the store prepared "
            "it again. The likely cause is a pooler in transaction mode without prepared-statement support, "
            "which sends the preparation and the execution to different backends: connect the ledger in "
            "session mode (or bypass the pooler), use PgBouncer 1.21 or newer with max_prepared_statements "
            "set, or open the ledger with prepare=false in the URL. The statement ran nowhere"
        )
    if sqlstate in ("42P01", "42703", "3F000"):  # undefined table, column, schema
        return StoreCorrupt(f"{where}: the ledger's tables are missing or changed ({text}); were they dropped by hand?")
    return StoreCorrupt(f"{where}: unexpected database error: {text}")
