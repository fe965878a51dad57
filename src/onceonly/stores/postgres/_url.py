"""The PostgreSQL URL: onceonly's own options (``?schema=…&pool_max_size=…``), and what is left for libpq."""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import psycopg
from psycopg.conninfo import conninfo_to_dict

from onceonly.stores._url import redact_url, scrub

_SCHEMES = ("postgres", "postgresql", "postgresql+psycopg")
_BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
# Quoted in SQL, so any case is kept; limited to characters that need no escaping anywhere (psycopg
# reads % in a statement as a placeholder).
_SCHEMA_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


@dataclass(frozen=True, slots=True)
class PostgresOptions:
    """onceonly's own options of a PostgreSQL URL, and the connection string left for libpq.

    Args:
        conninfo: the URL without onceonly's options, as handed to psycopg.
        schema: the schema that holds the ledger's tables (created if missing).
        pool_min_size: connections the sync pool keeps open.
        pool_max_size: connections each pool may open.
        pool_timeout: seconds to wait for a connection before ``StoreUnavailable``.
        listen: wake waiters by LISTEN/NOTIFY (``False``: poll, e.g. behind a transaction pooler).
        warn_durability: log a warning at open when the server may lose acknowledged commits
            (``synchronous_commit=off``, ``fsync=off``).
        require_durability: refuse to open on such a server instead (``StoreError``).
        statement_timeout: PostgreSQL's ``statement_timeout`` for every statement of the store
            (``"5s"``, ``"500ms"``), set with ``SET LOCAL`` in the statement's own transaction, so that
            it works through a transaction pooler; ``None``: the server's.
        prepare: prepare the hot statements once per connection (``False``: send them unnamed, for
            a transaction pooler without prepared-statement support, PgBouncer before 1.21).

    .. versionadded:: 0.1
    .. versionchanged:: 0.2 ``warn_durability``, ``require_durability``, ``statement_timeout``, ``prepare``.
    """

    conninfo: str
    schema: str = "public"
    pool_min_size: int = 1
    pool_max_size: int = 10
    pool_timeout: float = 10.0
    listen: bool = True
    warn_durability: bool = True
    require_durability: bool = False
    statement_timeout: str | None = None
    prepare: bool = True


_OPTIONS = frozenset(
    {
        "schema",
        "pool_min_size",
        "pool_max_size",
        "pool_timeout",
        "listen",
        "warn_durability",
        "require_durability",
        "statement_timeout",
        "prepare",
    }
)
_FLAGS = (("listen", True), ("warn_durability", True), ("require_durability", False), ("prepare", True))
# PostgreSQL's own syntax for a time setting (a bare number is milliseconds): nothing else reaches SET.
_TIMEOUT = re.compile(r"\d{1,9}(\.\d{1,6})?\s?(us|ms|s|min|h|d)?")
# libpq defaults that suit a ledger: fail fast when the server is unreachable, and be recognisable
# in pg_stat_activity. Both can be overridden in the URL.
_LIBPQ_DEFAULTS = (("connect_timeout", "5"), ("application_name", "onceonly"))


def parse_postgres_url(url: str) -> PostgresOptions:
    """Split ``postgresql://…?schema=…&pool_max_size=…`` into onceonly's options and libpq's URL.

    Raises:
        ValueError: not a PostgreSQL URL, or an option with a bad value.

    .. versionadded:: 0.1
    """
    parts = urlsplit(url)
    if parts.scheme.lower() not in _SCHEMES:
        raise ValueError(f"not a PostgreSQL URL: {redact_url(url)!r} (use postgresql://host/dbname)")
    ours: dict[str, str] = {}
    rest: list[tuple[str, str]] = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name.lower() in _OPTIONS:
            ours[name.lower()] = value
        else:
            rest.append((name, value))
    given = {name for name, _ in rest}
    rest += [(name, value) for name, value in _LIBPQ_DEFAULTS if name not in given]
    # The hot statements send text as UTF-8 bytes (stores/_pgwire.py): the connections speak UTF-8,
    # whatever the database's encoding (the server converts).
    rest = [(name, value) for name, value in rest if name.lower() != "client_encoding"]
    rest.append(("client_encoding", "UTF8"))
    # quote, not quote_plus: libpq decodes %20 but leaves "+" as it is.
    conninfo = urlunsplit(("postgresql", parts.netloc, parts.path, urlencode(rest, quote_via=quote), ""))
    try:
        conninfo_to_dict(conninfo)
    except psycopg.Error as exc:
        raise ValueError(f"{redact_url(url)} is not a valid PostgreSQL URL: {scrub(str(exc), url)}") from None

    schema = ours.get("schema", "public")
    if not schema or len(schema) > 63 or not set(schema) <= _SCHEMA_CHARS or schema[0].isdigit():
        raise ValueError(
            f"schema={schema!r} in {redact_url(url)}: use 1-63 letters, digits and underscores, not starting "
            "with a digit (the name is used as written, case included)"
        )
    try:
        min_size = int(ours.get("pool_min_size", "1"))
        max_size = int(ours.get("pool_max_size", str(max(10, min_size))))
        timeout = float(ours.get("pool_timeout", "10"))
    except ValueError as exc:
        raise ValueError(
            f"{redact_url(url)}: pool_min_size and pool_max_size take integers, pool_timeout seconds ({exc})"
        ) from None
    if min_size < 0 or max_size < 1 or max_size < min_size:
        raise ValueError(f"{redact_url(url)}: need 0 <= pool_min_size <= pool_max_size and pool_max_size >= 1")
    if not timeout > 0:
        raise ValueError(f"{redact_url(url)}: pool_timeout={timeout} must be a positive number of seconds")
    flags: dict[str, bool] = {}
    for name, default in _FLAGS:
        flag = _BOOLEANS.get(ours.get(name, str(default)).lower())
        if flag is None:
            raise ValueError(f"{name}={ours[name]!r} in {redact_url(url)}: use true or false")
        flags[name] = flag
    statement_timeout = ours.get("statement_timeout")
    if statement_timeout is not None and not _TIMEOUT.fullmatch(statement_timeout):
        raise ValueError(
            f"statement_timeout={statement_timeout!r} in {redact_url(url)}: use PostgreSQL's form, e.g. 5s, "
            "500ms or 2min (a bare number is milliseconds, 0 turns it off)"
        )
    return PostgresOptions(conninfo, schema, min_size, max_size, timeout, statement_timeout=statement_timeout, **flags)
