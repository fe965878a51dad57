"""A ledger's stored records read and written under the ledger, with each store's own driver (sqlite3,
redis-py, psycopg): what a hand edit, another program or a bad restore would do to them."""

from __future__ import annotations

import json
import sqlite3
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from onceonly.stores import open_store

__all__ = ["REDIS_AT", "RawRecords"]

#: The record's fields in the Redis store's JSON array ``d`` (stores/redis/_codec.py ``encode``).
REDIS_AT = {
    "scope": 0, "tool": 1, "fingerprint": 2, "state": 3, "attempts": 4, "fence": 5, "version": 6, "lease_owner": 7,
    "lease_until": 8, "next_attempt_at": 9, "expires_at": 10, "created_at": 11, "updated_at": 12, "result": 13,
    "error": 14, "history": 15, "via": 16, "conflicts": 17,
}  # fmt: skip


class RawRecords:
    """The records of the ledger at ``url`` (a SQLite file, a Redis prefix or a PostgreSQL schema), as
    its store keeps them: ``read`` a record exactly as stored, ``write`` one of its fields, ``restore`` it
    as it was read."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.kind = urlsplit(url).scheme.split("+")[0]

    def _redis_name(self, key: str) -> str:
        store = open_store(self.url)
        try:
            return str(store._keys(key)[0])  # type: ignore[attr-defined]
        finally:
            store.close()

    def _redis(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url.split("?", 1)[0])

    def _postgres(self) -> tuple[Any, str]:
        import psycopg

        parts = urlsplit(self.url)
        schema = dict(parse_qsl(parts.query))["schema"]
        return psycopg.connect(urlunsplit(parts._replace(query="")), autocommit=True), f'"{schema}".onceonly_records'

    def read(self, key: str) -> Any:
        """The stored record of ``key`` as the driver returns it (a row, or a Redis hash), or None."""
        if self.kind == "sqlite":
            with sqlite3.connect(urlsplit(self.url).path[1:]) as conn:
                return conn.execute("SELECT * FROM onceonly_records WHERE key = ?", (key,)).fetchone()
        if self.kind == "redis":
            client = self._redis()
            try:
                return client.hgetall(self._redis_name(key)) or None
            finally:
                client.close()
        conn, table = self._postgres()
        with conn:
            return conn.execute(f"SELECT * FROM {table} WHERE key = %s", (key,)).fetchone()

    def write(self, key: str, column: str, value: Any) -> None:
        """Set one field of the stored record of ``key`` to ``value``, under the ledger. On Redis,
        ``column`` ``"d"`` (the JSON array of fields) or ``"a"`` (the arguments) replaces that hash field
        as it is; another field is set inside ``d``."""
        if self.kind == "sqlite":
            with sqlite3.connect(urlsplit(self.url).path[1:]) as conn:
                sql = f"UPDATE onceonly_records SET {column} = ? WHERE key = ?"
                assert conn.execute(sql, (value, key)).rowcount == 1
            return
        if self.kind == "redis":
            name = self._redis_name(key)
            client = self._redis()
            try:
                if column in ("a", "d", "args"):
                    client.hset(name, column[0], value)
                    return
                d = json.loads(client.hget(name, "d"))
                d[REDIS_AT[column]] = value
                client.hset(name, "d", json.dumps(d))
            finally:
                client.close()
            return
        conn, table = self._postgres()
        with conn:
            assert conn.execute(f"UPDATE {table} SET {column} = %s WHERE key = %s", (value, key)).rowcount == 1

    def restore(self, key: str, stored: Any) -> None:
        """Put back the record of ``key`` exactly as ``read`` returned it (a row, or a Redis hash)."""
        if self.kind == "redis":
            name = self._redis_name(key)
            client = self._redis()
            try:
                client.delete(name)
                client.hset(name, mapping=stored)
            finally:
                client.close()
            return
        marks = ", ".join(["?" if self.kind == "sqlite" else "%s"] * len(stored))
        if self.kind == "sqlite":
            with sqlite3.connect(urlsplit(self.url).path[1:]) as conn:
                conn.execute("DELETE FROM onceonly_records WHERE key = ?", (key,))
                conn.execute(f"INSERT INTO onceonly_records VALUES ({marks})", stored)
            return
        conn, table = self._postgres()
        with conn, conn.transaction():
            conn.execute(f"DELETE FROM {table} WHERE key = %s", (key,))
            conn.execute(f"INSERT INTO {table} VALUES ({marks})", stored)
