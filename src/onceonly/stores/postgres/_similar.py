"""The SQL of near-duplicate calls (``onceonly.Similar``; only tools with ``similar=`` come here): the
group tables, made on first use, and the statements on them. ``table`` is the records table, quoted."""

from __future__ import annotations

import operator
from typing import Any

from onceonly.states import Record, State
from onceonly.stores._sql import COLUMNS
from onceonly.stores.postgres._names import ident

# A record's values in COLUMNS order (similar_claim inserts through psycopg's cursor, not _pgwire).
_record_values = operator.attrgetter(*Record.__dataclass_fields__)


def similar_tables(schema: str) -> tuple[str, str]:
    s = ident(schema)
    return f"{s}.onceonly_similar", f"{s}.onceonly_similar_locks"


def similar_ddl(schema: str, table: str) -> list[str]:
    """The group tables: members (key → group, claimed at; indexed by group and time) and group locks.
    A record's membership goes with it (a trigger on delete: purge); no trigger on update, so the other
    tools' writes cost what they did."""
    members, locks = similar_tables(schema)
    s = ident(schema)
    return [
        f"""CREATE TABLE IF NOT EXISTS {members} (
                key text COLLATE "C" PRIMARY KEY,
                grp text COLLATE "C" NOT NULL,
                at  double precision NOT NULL
            )""",
        f"CREATE INDEX IF NOT EXISTS onceonly_similar_group ON {members} (grp, at)",
        f"""CREATE TABLE IF NOT EXISTS {locks} (
                grp   text COLLATE "C" PRIMARY KEY,
                token text NOT NULL,
                until double precision NOT NULL
            )""",
        f"""CREATE OR REPLACE FUNCTION {s}.onceonly_similar_gone() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                DELETE FROM {members} WHERE key = OLD.key;
                RETURN NULL;
            END
            $$""",
        f"""CREATE TRIGGER onceonly_similar_gone AFTER DELETE ON {table} FOR EACH ROW
                EXECUTE FUNCTION {s}.onceonly_similar_gone()""",
    ]


def similar_lock_sql(schema: str, table: str) -> tuple[str, str]:
    members, locks = similar_tables(schema)
    lock = (
        f"INSERT INTO {locks} (grp, token, until) VALUES (%s, %s, %s) ON CONFLICT (grp) DO UPDATE "
        f"SET token = EXCLUDED.token, until = EXCLUDED.until WHERE {locks}.token = EXCLUDED.token "
        f"OR {locks}.until <= %s"
    )
    read = (
        f"SELECT m.key, m.at, r.args FROM {members} m JOIN {table} r ON r.key = m.key "
        f"WHERE m.grp = %s AND EXISTS (SELECT 1 FROM {locks} l WHERE l.grp = m.grp AND l.token = %s) "
        "AND m.at >= %s ORDER BY m.at DESC LIMIT %s"
    )
    return lock, read


def similar_claim_sql(schema: str, table: str) -> str:
    """``similar_claim`` as one statement (one round trip, one transaction): free the lock if this
    token holds it, and only then insert the record and, if it was new, its membership. Answers
    (lock freed, record inserted)."""
    members, locks = similar_tables(schema)
    return (
        f"WITH freed AS (DELETE FROM {locks} WHERE grp = %s AND token = %s RETURNING 1), "
        f"made AS (INSERT INTO {table} ({COLUMNS}) SELECT {', '.join(['%s'] * 20)} "
        "WHERE EXISTS (SELECT 1 FROM freed) ON CONFLICT (key) DO NOTHING RETURNING key, created_at), "
        f"filed AS (INSERT INTO {members} (key, grp, at) SELECT key, %s, created_at FROM made) "
        "SELECT (SELECT count(*) FROM freed), (SELECT count(*) FROM made)"
    )


def similar_claim_params(record: Record, group: str, token: str) -> tuple[Any, ...]:
    values = tuple(v.value if isinstance(v, State) else v for v in _record_values(record))
    return (group, token, *values, group)
