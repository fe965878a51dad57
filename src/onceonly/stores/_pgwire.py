"""The PostgreSQL store's hot statements, below psycopg's cursor layer.

``get``, the claim's ``INSERT`` and every swap's ``UPDATE`` run as statements prepared once per
connection, with binary parameters and binary results, sent with psycopg's libpq wrapper
(``PGconn.send_query_prepared``) and read by psycopg's own result reader (``generators.execute``,
C-accelerated in psycopg's binary build) under the connection's ``wait()``, which also cancels the
statement on Ctrl-C. A cursor's ``execute`` spends ~35 µs of client CPU per statement here (query
conversion, adaptation, its preparation bookkeeping); this spends ~25 µs less per statement, about 0.04x
of the floor on a guarded first call (docs/benchmarks.md).

One logic for both faces: ``run()`` is a generator that the sync connection's ``wait()`` drives, and
the async connection's ``await wait()``.

The types are the table's (``stores/postgres/_schema.py``: text, integer, bigint, double precision), declared
at preparation, so the server never guesses them. A float8 is sent and read as its eight bytes:
exact both ways.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Generator, Sequence
from typing import Any

from psycopg import errors as e
from psycopg import pq
from psycopg.generators import execute, fetch_many, send

from onceonly.states import Record, State, out_of_range
from onceonly.stores._sql import bad_state, bad_value

TEXT, INT4, INT8, FLOAT8 = 25, 23, 20, 701  # PostgreSQL type oids
#: The type of each column, in the order of the Record's fields (and of the store's column list).
COLUMN_TYPES = (TEXT, TEXT, TEXT, TEXT, TEXT, INT4, INT8, INT8, TEXT, FLOAT8, FLOAT8, FLOAT8, FLOAT8, FLOAT8,
                TEXT, TEXT, TEXT, TEXT, TEXT, INT4)  # fmt: skip

_BINARY = pq.Format.BINARY
_I4, _I8, _F8 = struct.Struct("!i"), struct.Struct("!q"), struct.Struct("!d")
int4, int8, float8 = _I4.pack, _I8.pack, _F8.pack
_STATE_BYTES = {s: s.value.encode() for s in State}
_STATES = {s.value.encode(): s for s in State}
_OK = (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK)
_PIPELINE_SYNC = pq.ExecStatus.PIPELINE_SYNC
#: Sets the statement's timeout for its own transaction only (SET LOCAL): nothing stays on the session,
#: which a transaction pooler hands to others.
SET_TIMEOUT = "SELECT set_config('statement_timeout', %s, true)"
_SET_TIMEOUT = SET_TIMEOUT.replace("%s", "$1").encode()
#: invalid_sql_statement_name: e.g. a transaction pooler moved us to another backend (the store's
#: ``_translate`` names the likely cause when it comes back after the statement was prepared again).
NOT_PREPARED = "26000"
_ALREADY_PREPARED = "42P05"  # duplicate_prepared_statement


def _text(v: str | None) -> bytes | None:
    return None if v is None else v.encode()


def _float(v: float | None) -> bytes | None:
    return None if v is None else _F8.pack(v)


#: How each Record field becomes a parameter, in field order.
FIELD_ENCODERS: tuple[Callable[[Any], bytes | None], ...] = (
    str.encode, str.encode, str.encode, str.encode, _STATE_BYTES.__getitem__, int4, int8, int8, _text,
    _float, _float, _float, _float, _float, _text, _text, str.encode, str.encode, _text, int4,
)  # fmt: skip


def record_params(r: Record) -> list[bytes | None]:
    """A whole record as the INSERT's parameters (unrolled: the first write of every guarded call)."""
    f = _F8.pack
    return [
        r.key.encode(), r.scope.encode(), r.tool.encode(), r.fingerprint.encode(), _STATE_BYTES[r.state],
        _I4.pack(r.attempts), _I8.pack(r.fence), _I8.pack(r.version), _text(r.lease_owner),
        None if r.lease_until is None else f(r.lease_until),
        None if r.next_attempt_at is None else f(r.next_attempt_at),
        None if r.expires_at is None else f(r.expires_at), f(r.created_at), f(r.updated_at), _text(r.result_json),
        _text(r.error), r.args_json.encode(), r.history_json.encode(), _text(r.via), _I4.pack(r.conflicts),
    ]  # fmt: skip


def _str(v: bytes | None) -> str | None:
    return None if v is None else v.decode()


def _real(v: bytes | None) -> float | None:
    return None if v is None else _F8.unpack(v)[0]


def decode_record(res: pq.abc.PGresult) -> Record | None:
    """The first row of a binary result of the store's column list, or None when there is none."""
    if not res.ntuples:
        return None
    v = [res.get_value(0, i) for i in range(len(COLUMN_TYPES))]
    u4, u8, f8 = _I4.unpack, _I8.unpack, _F8.unpack
    state = _STATES.get(v[4])  # type: ignore[arg-type]
    if state is None:
        raise bad_state(v[0].decode(), v[4].decode())  # type: ignore[union-attr]
    rec = Record(
        v[0].decode(), v[1].decode(), v[2].decode(), v[3].decode(), state,  # type: ignore[union-attr]
        u4(v[5])[0], u8(v[6])[0], u8(v[7])[0], _str(v[8]), _real(v[9]), _real(v[10]), _real(v[11]),  # type: ignore[arg-type]
        f8(v[12])[0], f8(v[13])[0], _str(v[14]), _str(v[15]), v[16].decode(), v[17].decode(),  # type: ignore[arg-type,union-attr]
        _str(v[18]), u4(v[19])[0],  # type: ignore[arg-type]
    )  # fmt: skip
    wrong = out_of_range(rec)  # double precision holds NaN and Infinity, integers hold negatives
    if wrong is not None:
        raise bad_value(rec.key, *wrong)
    return rec


class Statement:
    """A statement prepared once per connection under ``name``, with its parameters' types."""

    __slots__ = ("formats", "name", "sql", "types")

    def __init__(self, name: str, sql: str, types: Sequence[int]) -> None:
        # psycopg's placeholders (%s) become PostgreSQL's ($1, $2…); the store's SQL holds no other %.
        parts = sql.split("%s")
        if len(parts) != len(types) + 1:
            raise ValueError(f"{name}: {len(parts) - 1} placeholders for {len(types)} types")
        self.name = name.encode()
        self.sql = "".join(p + (f"${i}" if i < len(parts) else "") for i, p in enumerate(parts, 1)).encode()
        self.types = list(types)
        self.formats = [_BINARY] * len(types)


def _check(results: list[pq.abc.PGresult]) -> pq.abc.PGresult:
    res = results[-1]
    if res.status not in _OK:
        raise e.error_from_result(res)  # the store's connections talk UTF-8 (psycopg's default)
    return res


def run(
    pgconn: pq.abc.PGconn, prepared: set[bytes], stmt: Statement, params: Sequence[bytes | None]
) -> Generator[Any, Any, pq.abc.PGresult]:
    """Run ``stmt`` on the connection, preparing it first if this connection has not; its result.

    Drive it with the connection's ``wait()``. A failed statement raises psycopg's error for it.
    """
    for attempt in (1, 2):
        if stmt.name not in prepared:
            pgconn.send_prepare(stmt.name, stmt.sql, stmt.types)
            res = (yield from execute(pgconn))[-1]
            if res.status not in _OK and res.error_field(pq.DiagnosticField.SQLSTATE) != _ALREADY_PREPARED.encode():
                _check([res])
            prepared.add(stmt.name)
        pgconn.send_query_prepared(stmt.name, params, stmt.formats, _BINARY)
        results = yield from execute(pgconn)
        res = results[-1]
        if res.error_field(pq.DiagnosticField.SQLSTATE) == NOT_PREPARED.encode():
            if attempt == 1:
                # The statement ran nowhere: forget what this connection had prepared and do it again.
                prepared.clear()
                continue
            # Preparing again did not help: the preparation and the execution reached different
            # backends (a transaction pooler without prepared-statement support). It ran nowhere, so
            # send it once unnamed, parsed and run in one message train, which one backend gets.
            return (yield from run_unnamed(pgconn, stmt, params, None))
        return _check(results)
    raise AssertionError("unreachable")  # pragma: no cover


def run_unnamed(
    pgconn: pq.abc.PGconn, stmt: Statement, params: Sequence[bytes | None], timeout: bytes | None
) -> Generator[Any, Any, pq.abc.PGresult]:
    """Run ``stmt`` unnamed (parsed, bound and run in one message train): nothing is left prepared on
    the backend, for a transaction pooler that hands each transaction another one.

    ``timeout``: PostgreSQL's ``statement_timeout`` for this statement, sent in the same pipeline before
    it with one Sync, so both run in one implicit transaction on one backend, which ``SET LOCAL`` needs.
    """
    if timeout is None:
        pgconn.send_query_params(stmt.sql, params, stmt.types, stmt.formats, _BINARY)
        return _check((yield from execute(pgconn)))
    pgconn.enter_pipeline_mode()
    try:
        pgconn.send_query_params(_SET_TIMEOUT, [timeout], [TEXT])
        pgconn.send_query_params(stmt.sql, params, stmt.types, stmt.formats, _BINARY)
        pgconn.pipeline_sync()
        yield from send(pgconn)
        answers: list[list[pq.abc.PGresult]] = []
        while True:
            got = yield from fetch_many(pgconn)
            if got and got[-1].status == _PIPELINE_SYNC:
                break
            answers.append(got)
    finally:
        if pgconn.pipeline_status != pq.PipelineStatus.OFF and not pgconn.is_busy():
            pgconn.exit_pipeline_mode()
    for got in answers:  # the first error is the cause; a statement after it reports only "aborted"
        if got and got[-1].status not in _OK:
            _check(got)
    return _check(answers[-1])
