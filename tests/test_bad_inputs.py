"""Bad input gets a clear error that says what was wrong and what to do, and loses nothing."""

from __future__ import annotations

import hashlib
import math
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from onceonly import InvalidKey, KeyConflict, Ledger, NotSerializable, StoreCorrupt
from onceonly.stores.sqlite import SCHEMA_VERSION


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _order_tool(sqlite_url: str) -> tuple[Ledger, Callable[[dict[str, object]], int], list[int]]:
    """A ledger and a guarded ``t(order)`` that records each run."""
    ledger = Ledger.open(sqlite_url)
    ran: list[int] = []

    @ledger.tool(name="t")
    def t(order: dict[str, object]) -> int:
        ran.append(1)
        return 1

    return ledger, t, ran


def test_unserialisable_argument_names_the_field(sqlite_url: str) -> None:
    """An argument with no JSON form is refused before anything is written or run."""
    ledger, t, ran = _order_tool(sqlite_url)
    with pytest.raises(NotSerializable) as info:
        t({"items": [1, object()]})
    assert info.value.path == "args.order.items[1]" and "ignore=" in str(info.value)
    assert ran == [] and ledger.stats()["in_flight"] == 0
    ledger.close()


@pytest.mark.parametrize(
    ("args", "path"),
    [({"name": "caf\udce9"}, "args.order.name"), ({"caf\udce9": 1}, "args.order['caf\\udce9']")],
)
def test_text_with_no_utf8_form_is_refused_before_anything_runs(
    sqlite_url: str, args: dict[str, object], path: str
) -> None:
    """A lone surrogate (what bytes decoded with surrogateescape leave) has no UTF-8 form, so no store
    could hold the call: it is refused with the field named, before anything is written or run."""
    ledger, t, ran = _order_tool(sqlite_url)
    with pytest.raises(NotSerializable, match="lone surrogate") as info:
        t(args)
    assert info.value.path == path and "errors='replace'" in str(info.value)
    assert ran == [] and sum(ledger.stats().values()) == 0
    ledger.close()


def test_oversize_and_malformed_keys(sqlite_url: str) -> None:
    """Keys, scopes and explicit keys that cannot be stored are refused with what to change."""
    ledger = Ledger.open(sqlite_url)

    @ledger.tool(name="t")
    def t() -> int:
        return 1

    with pytest.raises(InvalidKey, match="limit is 255"):
        t.using(key="k" * 300)()
    with pytest.raises(InvalidKey, match="whitespace"):
        t.using(key="order 42")()
    with pytest.raises(InvalidKey, match="whitespace"), ledger.task("my task"):
        pass
    with pytest.raises(InvalidKey, match="shorten"), ledger.task("s" * 250):
        t()
    ledger.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [({"ttl": 0}, r"ttl=0: .*above 0, or None \(keep settled records forever\)"), ({"ttl": -1}, "ttl=-1: .*negative"),
     ({"ttl": math.nan}, "ttl=nan: not a finite number"), ({"lease": math.nan}, "lease=nan: not a finite number"),
     ({"lease": math.inf}, "lease=inf: not a finite number"), ({"lease": 0}, "lease=0: .*above 0"),
     ({"timeout": math.nan}, "timeout=nan: .*or None"), ({"timeout": 0}, "timeout=0: .*above 0"),
     ({"settle": math.nan}, "settle=nan: not a finite"), ({"settle": -1}, "settle=-1: .*negative"),
     ({"wait": math.inf}, "wait=inf: not a finite")],
)  # fmt: skip
def test_options_that_are_not_finite_seconds_are_refused(
    sqlite_url: str, options: dict[str, object], message: str
) -> None:
    """A ttl of 0 or less (every call would run again), and a lease, timeout, settle or wait that is nan,
    infinite or not a number, are refused when the tool is declared, saying what to give instead."""
    ledger = Ledger.open(sqlite_url)
    with pytest.raises(ValueError, match=message):

        @ledger.tool(name="t", **options)  # type: ignore[call-overload]
        def t(x: int) -> int:
            return x

    assert "t" not in ledger.tools
    ledger.close()


def test_options_of_the_wrong_type_are_refused(sqlite_url: str) -> None:
    """Seconds given as text or a bool, and retry=3, are TypeErrors when the tool is declared."""
    ledger = Ledger.open(sqlite_url)
    with pytest.raises(TypeError, match="wait='10': a str is not a number of seconds"):
        ledger.tool(name="t", wait="10")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="lease=True: a bool is not a number of seconds"):
        ledger.tool(name="t", lease=True)
    with pytest.raises(TypeError, match=r"retry=3: give an onceonly.Retry"):
        ledger.tool(name="t", retry=3)  # type: ignore[call-overload]
    ledger.close()


@pytest.mark.parametrize("occurrence", [True, 2.0, "2", 0, -1, None])
def test_occurrence_must_be_an_int_from_1(sqlite_url: str, occurrence: object) -> None:
    """True would be occurrence 1's key and 2.0 a key other than 2's (a second occurrence could then run
    twice): only an int from 1 is taken, for sync and async tools alike, and nothing runs."""
    ledger = Ledger.open(sqlite_url)
    ran: list[int] = []

    @ledger.tool(name="t")
    def t(x: int) -> int:
        ran.append(x)
        return x

    @ledger.tool(name="at")
    async def at(x: int) -> int:
        return x

    with pytest.raises(InvalidKey, match=rf"occurrence={occurrence!r}: give an int from 1"):
        t.using(occurrence=occurrence)(1)  # type: ignore[arg-type]
    with pytest.raises(InvalidKey, match="give an int from 1"):
        at.using(occurrence=occurrence)  # type: ignore[arg-type]
    assert ran == [] and sum(ledger.stats().values()) == 0
    assert t.using(occurrence=2).outcome(1).key == t.key_for(1) + "#2"
    ledger.close()


def test_same_key_other_arguments(sqlite_url: str) -> None:
    """KeyConflict says which key and what to do; the first record is untouched."""
    ledger = Ledger.open(sqlite_url)

    @ledger.tool(name="t", key=("a",))
    def t(a: int, b: int) -> int:
        return a + b

    assert t(1, 2) == 3
    before = ledger.get(t.key_for(1, 2))
    with pytest.raises(KeyConflict, match="another key or occurrence"):
        t(1, 5)
    assert ledger.get(t.key_for(1, 2)) == before
    ledger.close()


def test_corrupt_file_is_refused_untouched(tmp_path: Path) -> None:
    """A file that is not SQLite: StoreCorrupt, and the file keeps every byte."""
    path = tmp_path / "ledger.db"
    path.write_bytes(b"this is not a database, it is someone's notes\n" * 100)
    before = _digest(path)
    with pytest.raises(StoreCorrupt, match="not a readable SQLite database"):
        Ledger.open(f"sqlite:///{path}")
    assert _digest(path) == before


def test_foreign_database_is_refused_untouched(tmp_path: Path) -> None:
    """A SQLite file of another application: StoreCorrupt naming its tables; nothing changed."""
    path = tmp_path / "app.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)")
    conn.execute("INSERT INTO invoices VALUES (1, 9.5)")
    conn.commit()
    conn.close()
    before = _digest(path)
    with pytest.raises(StoreCorrupt, match=r"another application.*invoices"):
        Ledger.open(f"sqlite:///{path}")
    assert _digest(path) == before


def test_newer_schema_is_refused(sqlite_url: str) -> None:
    """A ledger written by a newer onceonly is not opened (nor downgraded)."""
    Ledger.open(sqlite_url).close()
    path = Path(sqlite_url.removeprefix("sqlite:///"))
    conn = sqlite3.connect(path)
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(StoreCorrupt, match="upgrade onceonly"):
        Ledger.open(sqlite_url)


def test_bad_urls() -> None:
    """URLs that name no durable ledger are refused with an example of a good one."""
    with pytest.raises(ValueError, match="no onceonly store"):
        Ledger.open("mysql://x/y")
    with pytest.raises(ValueError, match="names no file"):
        Ledger.open("sqlite:///:memory:")
    with pytest.raises(ValueError, match="host part"):
        Ledger.open("sqlite://host/x.db")


def test_many_processes_open_a_new_file_at_once(tmp_path: Path) -> None:
    """Several processes creating one new ledger file at once all succeed (no 'database is locked')."""
    import multiprocessing

    url = f"sqlite:///{tmp_path / 'new.db'}"
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(6) as pool:
        assert pool.map(_open_and_count, [url] * 12) == [0] * 12


def _open_and_count(url: str) -> int:
    with Ledger.open(url) as ledger:
        return sum(ledger.stats().values())
