"""Records damaged under the ledger (a hand edit, another program, a bad restore), planted with each
store's own raw access: every read that meets one raises ``StoreCorrupt`` naming the key and the field,
never a bare ``JSONDecodeError`` or ``TypeError`` from deep in the guard."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from onceonly import Ledger, Retry, State
from onceonly.errors import StoreCorrupt
from tests._raw import RawRecords


@pytest.fixture(name="plant")
def fixture_plant(store_url: str) -> Callable[[str, str, Any], None]:
    """``plant(key, column, value)``: writes into a stored record behind the ledger, with the store's own
    raw access."""
    return RawRecords(store_url).write


@pytest.fixture(name="real_ledger")
def fixture_real_ledger(store_url: str) -> Iterator[Ledger]:
    """A fresh ledger on each store."""
    ledger = Ledger.open(store_url)
    yield ledger
    ledger.close()


def test_a_result_that_is_not_json_is_store_corrupt(real_ledger: Ledger, plant: Callable[..., None]) -> None:
    """A confirmed record whose stored result is not JSON: its replay raises StoreCorrupt naming the key
    and the result, on every store; the tool does not run again."""
    runs: list[int] = []

    @real_ledger.tool(name="charge")
    def charge(order: int) -> dict[str, int]:
        runs.append(order)
        return {"order": order}

    key = charge.outcome(1).key
    plant(key, "result", "{not json")
    with pytest.raises(StoreCorrupt, match="result") as corrupt:
        charge(1)
    assert repr(key) in str(corrupt.value)
    assert runs == [1]
    rec = real_ledger.get(key)
    assert rec is not None
    with pytest.raises(StoreCorrupt, match=repr(key)):
        rec.to_dict()


def test_arguments_or_history_that_are_not_json_are_store_corrupt(
    real_ledger: Ledger, plant: Callable[..., None]
) -> None:
    """The stored arguments or history are not JSON: reading them (``show``, the reconciler) raises
    StoreCorrupt naming the key and the field."""

    @real_ledger.tool(name="charge")
    def charge(order: int) -> int:
        return order

    key = charge.outcome(2).key
    plant(key, "args", "[oops")
    rec = real_ledger.get(key)
    assert rec is not None
    with pytest.raises(StoreCorrupt, match=f"{key!r}.*args"):
        _ = rec.args
    plant(key, "history", "nope")
    rec = real_ledger.get(key)
    assert rec is not None
    with pytest.raises(StoreCorrupt, match=f"{key!r}.*history"):
        _ = rec.history


@pytest.fixture(name="loose_store_url")
def fixture_loose_store_url(store_url: str) -> str:
    """Only the stores whose fields can hold a value of another type (SQLite columns take any type;
    Redis keeps JSON): PostgreSQL's typed columns refuse text where a number belongs."""
    if store_url.startswith("postgresql"):
        pytest.skip("PostgreSQL's columns are typed: text cannot be stored where a number belongs")
    return store_url


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("attempts", "three"),
        ("fence", "one"),
        ("created_at", "yesterday"),
        ("attempts", 1.5),
        ("result", 5),  # Redis keeps a JSON number; a SQLite text column turns it into the text "5"
        ("result", b"\x00\xff"),  # SQLite keeps a blob; JSON has none
    ],
    ids=["text-attempts", "text-fence", "text-created_at", "real-attempts", "number-result", "blob-result"],
)
def test_a_field_of_the_wrong_type_is_store_corrupt(loose_store_url: str, column: str, value: Any) -> None:
    """Text in a numeric field (or a number in a text one): reading the record raises StoreCorrupt
    naming the key and the field, rather than handing the guard a record that fails later with a
    TypeError (``attempts >= limit``) far from its cause."""
    if (type(value) is bytes) != loose_store_url.startswith("sqlite") and column == "result":
        pytest.skip("this store cannot hold that value in that field")
    ledger = Ledger.open(loose_store_url)
    try:

        @ledger.tool(name="send", retry=Retry(attempts=3))
        def send(n: int) -> int:
            raise ValueError("refused")  # a definite failure: the record is failed, attempt 1 of 3

        with pytest.raises(ValueError, match="refused"):
            send(3)
        key = send.key_for(3)
        rec = ledger.get(key)
        assert rec is not None and rec.state is State.FAILED
        RawRecords(loose_store_url).write(key, column, value)
        with pytest.raises(StoreCorrupt, match=f"{key!r}.*{column.replace('result', 'result_json')}"):
            ledger.get(key)
        with pytest.raises(StoreCorrupt, match=repr(key)):
            send(3)
    finally:
        ledger.close()


@pytest.mark.parametrize(
    ("column", "value"),
    [("fence", -1), ("attempts", -1), ("conflicts", -2), ("version", 0), ("version", -5)],
    ids=["negative-fence", "negative-attempts", "negative-conflicts", "version-0", "negative-version"],
)
def test_a_counter_below_its_start_is_store_corrupt(store_url: str, column: str, value: int) -> None:
    """A counter no record ever holds (a negative fence or attempt count, a version below 1), planted in a
    failed record that may be retried: the retry raises StoreCorrupt naming the key and the field, and
    the tool does not run again. A negative fence would pass every fence comparison, and negative
    attempts would grant more retries than the limit."""
    ledger = Ledger.open(store_url)
    runs: list[int] = []
    try:

        @ledger.tool(name="send", retry=Retry(attempts=3))
        def send(n: int) -> int:
            runs.append(n)
            raise ValueError("refused")  # a definite failure: the record is failed, attempt 1 of 3

        with pytest.raises(ValueError, match="refused"):
            send(4)
        key = send.key_for(4)
        RawRecords(store_url).write(key, column, value)
        with pytest.raises(StoreCorrupt, match=f"{key!r}.*{column}") as corrupt:
            ledger.get(key)
        assert str(value) in str(corrupt.value)
        with pytest.raises(StoreCorrupt, match=repr(key)):
            send(4)
        assert runs == [4], "the tool ran again over a corrupt record"
    finally:
        ledger.close()
