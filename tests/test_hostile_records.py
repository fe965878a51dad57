"""Malformed records planted under the ledger, generated: hypothesis writes garbage into a stored record
with each store's own driver (sqlite3, redis-py, psycopg): text that is not JSON, JSON of the wrong
shape, values of the wrong type, states onceonly does not have, times that are not finite, versions as
text, huge histories, Redis records shorter or longer than the format (as a newer release might write).

Every way a ledger reads records then meets it: ``get``, a guarded call with that key (its claim or
replay), ``list``, ``stats``, ``reconcile``, ``purge``, a record's ``to_dict`` (``show``) and the CLI's
``ls``, ``show`` and ``stats``. Each either works or raises ``StoreCorrupt`` (or another clear onceonly
error); never another exception. A record the ledger finds corrupt when it reads it to decide (or whose
history, which each transition extends, is damaged) is kept byte for byte, for a person to look at;
and a sentinel record planted first is never touched. (A damaged result or arguments are reported by
every read of them, but a record whose state lets it run again is run, and the new attempt replaces
its result without reading the old one.)
"""

from __future__ import annotations

import itertools
import json
import math
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import example, given
from hypothesis import strategies as st

from onceonly import Ledger, OnceOnlyError, State, StoreCorrupt, ops
from onceonly.cli import cli
from tests._clock import FakeClock
from tests._hostile import hostile, plant_sentinel, store_kind
from tests._raw import RawRecords


class Big(str):
    """A long text that prints short (hypothesis prints the examples it runs)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"<{len(self):,} characters: {str(self[:12])!r}...>"


#: Text a field may hold that onceonly never writes there.
GARBAGE_TEXT = st.one_of(
    st.sampled_from(
        [
            "",
            "{not json",
            "nope",
            "[",
            "]",
            "[1,",
            "null",
            "42",
            '"text"',
            "{}",
            '{"a": 1}',
            "[]",
            "[1, 2]",
            '[{"at": "yesterday"}]',
            "NaN",
            "Infinity",
            "[NaN]",
            "\x00",
            "\ufffd",
            "exploded",
            "CONFIRMED",
            "confirmed ",
            "[" * 100_000 + "]" * 100_000,
            json.dumps([{"at": 1.0, "to": "x"}] * 50_000),
        ]
    ),
    st.text(max_size=30),
)
NUMBERS = st.one_of(
    st.sampled_from([-1, 0, 2**31 - 1, 2**62, -(2**62), math.nan, math.inf, -math.inf, -0.0, 1e308]),
    st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
)
COLUMNS = {
    "text": ["scope", "tool", "fingerprint", "state", "lease_owner", "result", "error", "args", "history", "via"],
    "int": ["attempts", "fence", "version", "conflicts"],
    "float": ["lease_until", "next_attempt_at", "expires_at", "created_at", "updated_at"],
}
STATES = [s.value for s in State]


def plants(kind: str) -> st.SearchStrategy[list[tuple[str, Any]]]:
    """One to three (field, value) writes into a stored record, as store ``kind`` can hold them."""
    text = st.tuples(st.sampled_from(COLUMNS["text"]), st.one_of(GARBAGE_TEXT, st.sampled_from(STATES)))
    number = st.tuples(st.sampled_from(COLUMNS["int"] + COLUMNS["float"]), NUMBERS)
    if kind == "postgres":
        # Typed columns: text where text belongs, a number where a number does (an int column takes no
        # float), NULL where the column allows it. The state's CHECK refuses states onceonly lacks.
        text = st.tuples(
            st.sampled_from([c for c in COLUMNS["text"] if c != "state"]),
            GARBAGE_TEXT.filter(lambda t: "\x00" not in t),
        )
        number = st.one_of(
            st.tuples(st.sampled_from(COLUMNS["int"][:1] + COLUMNS["int"][3:]), st.integers(-(2**31), 2**31 - 1)),
            st.tuples(st.sampled_from(COLUMNS["int"][1:3]), st.integers(-(2**63), 2**63 - 1)),
            st.tuples(st.sampled_from(COLUMNS["float"]), NUMBERS.map(float)),
            st.tuples(st.sampled_from(["state"]), st.sampled_from(STATES)),
        )
        return st.lists(st.one_of(text, number), min_size=1, max_size=3)
    wrong = st.tuples(
        st.sampled_from([c for cs in COLUMNS.values() for c in cs]),
        st.one_of(st.none(), NUMBERS, GARBAGE_TEXT, st.binary(max_size=8) if kind == "sqlite" else st.nothing()),
    )
    one = st.one_of(text, number, wrong)
    if kind == "redis":
        whole = st.tuples(
            st.sampled_from(["d", "a"]),
            st.one_of(
                GARBAGE_TEXT,
                st.binary(max_size=16),  # not even UTF-8
                st.sampled_from(["short", "long"]),  # the array with a field less, or one more
            ),
        )
        one = st.one_of(one, whole)
    return st.lists(one, min_size=1, max_size=3)


_fresh = itertools.count()


@pytest.fixture(name="sentinel")
def fixture_sentinel(ledger: Ledger) -> Iterator[Callable[[], None]]:
    """A record written before the damaged one; the check asserts it kept every stored byte."""
    check = plant_sentinel(ledger)
    yield check
    check()


def _plant(raw: RawRecords, key: str, column: str, value: Any) -> None:
    """Write ``value`` into ``column`` of the stored record of ``key``; on Redis, ``d`` ``short``/``long``
    is the record's array with its last field cut off, or with a field more at the end."""
    try:
        if raw.kind == "redis" and value in ("short", "long") and column == "d":
            d = json.loads(raw.read(key)[b"d"])
            value = json.dumps(d[:-1] if value == "short" else [*d, {"added": "by a newer format"}])
        raw.write(key, column, value)
    except sqlite3.IntegrityError:  # NULL where the table says NOT NULL: SQLite keeps no such garbage
        return
    except (ValueError, TypeError, IndexError):  # a Redis field inside a ``d`` already planted over
        assert raw.kind == "redis"


def _must_be_clear(what: str, fn: Callable[[], Any]) -> BaseException | None:
    """Run ``fn``: it works, or raises an onceonly error (returned); any other exception fails the test."""
    try:
        fn()
    except OnceOnlyError as exc:
        return exc
    except BaseException as exc:  # anything else is what this test is here to find
        raise AssertionError(f"{what} raised {type(exc).__name__}: {exc!s:.300}") from exc
    return None


def _show(ledger: Ledger, key: str) -> None:
    """Every field of the record decoded, as ``onceonly show`` and the dashboard read it."""
    rec = ledger.get(key)
    if rec is not None:
        rec.to_dict()


def _cli(url: str, *args: str) -> None:
    result = CliRunner().invoke(cli, [*args, "--url", url])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"onceonly {args[0]} crashed: {type(result.exception).__name__}: {result.exception}")
    assert result.exit_code in (0, 1), result.output


def test_malformed_records_are_store_corrupt_kept_and_alone(
    ledger: Ledger, sentinel: Callable[[], None], clock: FakeClock
) -> None:
    """Garbage written into one stored record: every read of it works or raises StoreCorrupt (never
    another exception), a record found corrupt is left exactly as planted, and the sentinel is untouched."""
    kind = store_kind(ledger)
    raw = RawRecords(ledger.store.url)
    runs: list[int] = []

    @ledger.tool(name="victim", on_unknown="retry", wait=0.0)  # a held record: InProgress at once
    def victim(order: int) -> dict[str, int]:
        runs.append(order)
        return {"order": order}

    @hostile(kind, scale=0.5)
    @given(writes=plants(kind))
    @example(writes=[("history", '{"a": 1}')])
    @example(writes=[("history", "nope")])
    @example(writes=[("state", "unknown"), ("history", "nope")])  # a settle appended to it: "nop,{...}]"
    @example(writes=[("args", "[1, 2]")])
    @example(writes=[("history", ""), ("expires_at", -1.0)])  # purge deleted it: left in place now
    @example(writes=[("lease_until", math.nan), ("state", "in_flight")])
    @example(writes=[("expires_at", math.inf)])
    @example(writes=[("updated_at", 1e300), ("expires_at", 1e300), ("next_attempt_at", 1e300)])  # past year 9999
    @example(writes=[("history", Big("[" * 100_000 + "]" * 100_000))])
    def check(writes: list[tuple[str, Any]]) -> None:
        with ledger.task(f"rec-{next(_fresh)}"):
            key = victim.outcome(1).key
            good = raw.read(key)
            for column, value in writes:
                _plant(raw, key, column, value)
            planted = raw.read(key)
            read = _must_be_clear("get", lambda: ledger.get(key))
            _must_be_clear("to_dict (show)", lambda: _show(ledger, key))
            appended = _must_be_clear("history", lambda: (r := ledger.get(key)) and r.history)
            # Corrupt as the ledger reads a record to decide (every field but the result and the
            # arguments, which a new attempt replaces or carries without reading them: one decode less
            # per call), and its history, which every transition appends to.
            found_corrupt = isinstance(read, StoreCorrupt) or isinstance(appended, StoreCorrupt)
            _must_be_clear("a guarded call with that key", lambda: victim(1))
            clock.now += 120.0  # past any lease: the reconciler looks at held records too
            _must_be_clear("list", lambda: ledger.list(limit=1000))
            _must_be_clear("stats", ledger.stats)
            _must_be_clear("ops.stats", lambda: ops.stats(ledger))
            _must_be_clear("reconcile", lambda: ledger.reconcile(review_after=0.0))
            _must_be_clear("purge", ledger.purge)
        for args in (("ls",), ("show", key), ("stats",)):
            _cli(ledger.store.url, *args)
        if found_corrupt:
            assert repr(raw.read(key)) == repr(planted), "a record found corrupt was written over"  # NaN != NaN
        sentinel()
        # Repaired, as a person would: the next example's list, stats and ls meet only its own damage.
        raw.restore(key, good)

    check()
