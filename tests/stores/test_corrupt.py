"""Records damaged under the ledger (a hand edit, another program, a bad restore), planted with each
store's own raw access: every read that meets one raises ``StoreCorrupt`` naming the key and the field,
never a bare ``JSONDecodeError`` or ``TypeError`` from deep in the guard."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import pytest

from onceonly import Ledger, Retry, State
from onceonly.errors import StoreCorrupt
from onceonly.stores import open_store

# The record's fields in the Redis store's JSON array ``d`` (stores/redis.py ``_encode``).
_REDIS_AT = {"attempts": 4, "fence": 5, "created_at": 11, "result": 13, "history": 15}


def _planter(url: str) -> Callable[[str, str, Any], None]:
    """``plant(key, column, value)``: write ``value`` into one field of a stored record, under the store."""
    scheme = urlsplit(url).scheme
    if scheme == "sqlite":
        path = urlsplit(url).path[1:]

        def plant_sqlite(key: str, column: str, value: Any) -> None:
            with sqlite3.connect(path) as conn:
                assert conn.execute(f"UPDATE onceonly_records SET {column} = ? WHERE key = ?", (value, key)).rowcount

        return plant_sqlite
    if scheme == "redis":
        import redis

        def plant_redis(key: str, column: str, value: Any) -> None:
            store = open_store(url)
            name = store._keys(key)[0]  # type: ignore[attr-defined]
            store.close()
            client = redis.Redis.from_url(url.split("?", 1)[0])
            try:
                if column == "args":
                    client.hset(name, "a", value)
                    return
                d = json.loads(client.hget(name, "d"))
                d[_REDIS_AT[column]] = value
                client.hset(name, "d", json.dumps(d))
            finally:
                client.close()

        return plant_redis
    import psycopg

    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    conninfo = urlunsplit(parts._replace(query=""))

    def plant_postgres(key: str, column: str, value: Any) -> None:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            sql = f'UPDATE "{query["schema"]}".onceonly_records SET {column} = %s WHERE key = %s'
            assert conn.execute(sql, (value, key)).rowcount == 1

    return plant_postgres


@pytest.fixture(name="plant")
def fixture_plant(store_url: str) -> Callable[[str, str, Any], None]:
    """Writes into a stored record behind the ledger, with the store's own raw access."""
    return _planter(store_url)


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
        _planter(loose_store_url)(key, column, value)
        with pytest.raises(StoreCorrupt, match=f"{key!r}.*{column.replace('result', 'result_json')}"):
            ledger.get(key)
        with pytest.raises(StoreCorrupt, match=repr(key)):
            send(3)
    finally:
        ledger.close()
