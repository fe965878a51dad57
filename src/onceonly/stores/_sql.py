"""What the SQL stores share: the record's columns, how a row becomes a Record, which fields a swap
may write, and the query that answers ``Store.scan``. Pure: builds text and records, runs nothing."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from onceonly.errors import StoreCorrupt
from onceonly.states import HELD, Record, State, misplaced
from onceonly.stores.base import Query

#: The table's columns, in the order of the Record's fields (a row is a Record's arguments).
COLUMNS = (
    "key, scope, tool, fingerprint, state, attempts, fence, version, lease_owner, lease_until, "
    "next_attempt_at, expires_at, created_at, updated_at, result, error, args, history, via, conflicts"
)
#: A state's stored text → the State.
STATES = {s.value: s for s in State}
#: Record fields a swap may change (key never changes; version is always written), in field order.
SWAP_FIELDS = tuple(f for f in Record.__dataclass_fields__ if f not in ("key", "version"))
#: A Record field → its column, where the names differ.
COLUMN_OF = {"result_json": "result", "args_json": "args", "history_json": "history"}
#: The SWAP_FIELDS of a record, all in one C call: a swap reads them of both records to diff them.
swap_fields = operator.attrgetter(*SWAP_FIELDS)


def row_to_record(row: Sequence[Any]) -> Record:
    """A row of ``COLUMNS`` as a Record; ``StoreCorrupt`` for a state or a value that is not ours."""
    rec = Record(*row)  # the columns are the fields, in order
    try:
        rec.state = STATES[row[4]]  # a fresh object, not yet shared: set before anyone sees it
    except KeyError:
        raise bad_state(row[0], row[4]) from None
    wrong = misplaced(rec)
    if wrong is not None:
        raise bad_value(rec.key, *wrong)
    return rec


def bad_value(key: str, field: str, value: object) -> StoreCorrupt:
    """The error for a field whose stored value is not of its type (text where a number belongs…)."""
    column = COLUMN_OF.get(field, field)
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return StoreCorrupt(
        f"the record of {key!r} has {shown} ({type(value).__name__}) in its {column} column ({field}), which "
        "is not what onceonly writes there: something else wrote it. Nothing was changed: fix or delete that row"
    )


def bad_state(key: str | None, value: object) -> StoreCorrupt:
    """The error for a stored state that is not one of ours (a row written by something else)."""
    where = "a record" if key is None else f"the record of {key!r}"
    return StoreCorrupt(
        f"{where} has state {value!r}, which is not an onceonly state: something else wrote it. Nothing was "
        "changed: fix or delete that row"
    )


def counts_by_state(rows: Sequence[Sequence[Any]]) -> dict[State, int]:
    """``SELECT state, COUNT(*) … GROUP BY state`` as counts per State."""
    try:
        return {STATES[s]: int(n) for s, n in rows}
    except KeyError as exc:
        raise bad_state(None, exc.args[0]) from None


def counts_by_tool(rows: Sequence[Sequence[Any]]) -> dict[tuple[str, State], int]:
    """``SELECT tool, state, COUNT(*) … GROUP BY tool, state`` as counts per (tool, State)."""
    try:
        return {(str(t), STATES[s]): int(n) for t, s, n in rows}
    except KeyError as exc:
        raise bad_state(None, exc.args[0]) from None


def state_literals(states: Sequence[State]) -> str:
    """States inlined as SQL literals (our own constants, never user input), so a planner can match a
    partial index's predicate: it cannot prove that a parameter lies in the index's state list."""
    return ", ".join(f"'{s.value}'" for s in states)


def scan_sql(
    query: Query, *, table: str, columns: str, placeholder: str, state_per_term: bool = False
) -> tuple[str, list[Any]] | None:
    """The SELECT for ``query`` and its parameters; ``None`` when no record can match (no states).

    The states stand alone at the top of the WHERE, as one IN list, so a planner can walk an
    open-records index in key order (under an OR it does not); the lease condition then exempts the
    states that hold no lease rather than repeating them. ``state_per_term``: ``state = 'a' OR state =
    'b'`` instead, the only form SQLite matches against a partial index on ``state = … OR state = …``
    (it proves no IN list, not even a one-state one, to imply such an index's condition).
    """
    ph = placeholder
    where: list[str] = []
    params: list[Any] = []
    if query.states is not None:
        states = list(dict.fromkeys(query.states))
        if not states:
            return None
    elif query.lease_expired_before is not None:
        states = sorted(HELD, key=lambda s: s.value)
    else:
        states = []
    if states:
        if state_per_term or len(states) == 1:
            where.append("(" + " OR ".join(f"state = {state_literals([s])}" for s in states) + ")")
        else:
            where.append(f"state IN ({state_literals(states)})")
        held = [s for s in states if s in HELD]
        if held and query.lease_expired_before is not None:
            expired = f"lease_until IS NULL OR lease_until < {ph}"
            if len(held) < len(states):
                expired = f"state NOT IN ({state_literals(held)}) OR {expired}"
            where.append(f"({expired})")
            params.append(query.lease_expired_before)
    for column, value in (("tool", query.tool), ("scope", query.scope)):
        if value is not None:
            where.append(f"{column} = {ph}")
            params.append(value)
    if query.expires_before is not None:
        where.append(f"expires_at IS NOT NULL AND expires_at < {ph}")
        params.append(query.expires_before)
    if query.after is not None:
        where.append(f"key > {ph}")
        params.append(query.after)
    sql = f"SELECT {columns} FROM {table}"
    if where:
        sql += " WHERE " + " AND ".join(where)
    sql += f" ORDER BY key LIMIT {ph}"
    params.append(max(0, query.limit))
    return sql, params
