"""The record as stored: one JSON array ``d`` and the arguments ``a``, the scripts' arguments, and the full
condition of a scan on one record."""

from __future__ import annotations

import json

from onceonly.errors import StoreCorrupt
from onceonly.states import HELD, Record, State, misplaced
from onceonly.stores.base import Query
from onceonly.stores.redis._layout import SCHEMA_VERSION, STATES, VALUE

# One encoder, made once (json.dumps with these options makes a new one per call).
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), check_circular=False).encode
_loads = json.loads


def encode(r: Record) -> str:
    """Every field but key and args, as one JSON array: one value to write, one to read and decode.

    Measured against a hash of 20 fields, the array costs about a third of the client's CPU per
    transition (redis-py packs and parses every field as a separate bulk string). The arguments
    are kept apart (field ``a``) so that a settle, which leaves them alone, does not send them again.
    """
    return _dumps(
        [
            r.scope, r.tool, r.fingerprint, VALUE[r.state], r.attempts, r.fence, r.version, r.lease_owner,
            r.lease_until, r.next_attempt_at, r.expires_at, r.created_at, r.updated_at, r.result_json, r.error,
            r.history_json, r.via, r.conflicts,
        ]
    )  # fmt: skip


def decode(key: str, d: bytes, a: bytes | None) -> Record:
    try:
        x = _loads(d)
        rec = Record(
            key, x[0], x[1], x[2], STATES[x[3]], x[4], x[5], x[6], x[7], x[8], x[9], x[10], x[11], x[12], x[13],
            x[14], "{}" if a is None else a.decode(), x[15], x[16], x[17],
        )  # fmt: skip
    except (ValueError, KeyError, IndexError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise StoreCorrupt(
            f"the Redis record of {key!r} is not an onceonly record of schema {SCHEMA_VERSION} ({exc!r}). "
            "Nothing was changed: check what else writes under this prefix, or use another prefix"
        ) from exc
    wrong = misplaced(rec)
    if wrong is not None:
        field, value = wrong
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise StoreCorrupt(
            f"the Redis record of {key!r} has {shown} ({type(value).__name__}) in its {field}, which is not what "
            "onceonly writes there. Nothing was changed: check what else writes under this prefix, or fix or "
            "delete the record"
        )
    return rec


def _head(r: Record) -> str:
    """Version, state and the record's scores in the held and expiry indexes, as one argument.

    ``"<version> <state> <lease> <expiry>"``, a score left empty when the record is not in that
    index. One string instead of four arguments: redis-py packs each argument in Python.
    """
    lease = ("-inf" if r.lease_until is None else repr(r.lease_until)) if r.state in HELD else ""
    return f"{r.version} {VALUE[r.state]} {lease} {'' if r.expires_at is None else repr(r.expires_at)}"


def claim_args(record: Record) -> tuple[str, ...]:
    """A claim script's ARGV: the head with the record's incarnation appended, ``d`` and ``a``."""
    return f"{_head(record)} {record.created_at!r}", encode(record), record.args_json


def swap_args(record: Record, expected: Record) -> tuple[str, ...]:
    """A swap script's ARGV: the head with the expected version and incarnation appended, ``d``, and ``a``
    only when the arguments changed (a settle leaves them alone: they are not sent again)."""
    head = f"{_head(record)} {expected.version} {expected.created_at!r}"
    if record.args_json == expected.args_json:
        return head, encode(record)
    return head, encode(record), record.args_json


def matches(r: Record, q: Query, states: frozenset[State] | None) -> bool:
    """The full condition of ``q`` on one record (the indexes only narrow the candidates)."""
    if states is not None:
        if r.state not in states:
            return False
        if (
            r.state in HELD
            and q.lease_expired_before is not None
            and not (r.lease_until is None or r.lease_until < q.lease_expired_before)
        ):
            return False
    elif q.lease_expired_before is not None and (
        r.state not in HELD or not (r.lease_until is None or r.lease_until < q.lease_expired_before)
    ):
        return False
    if q.tool is not None and r.tool != q.tool:
        return False
    if q.scope is not None and r.scope != q.scope:
        return False
    if q.expires_before is not None and (r.expires_at is None or not r.expires_at < q.expires_before):
        return False
    return q.after is None or r.key > q.after
