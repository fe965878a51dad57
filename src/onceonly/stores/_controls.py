"""Operators' control documents (``stores.base.ControlStore``) as every store keeps them: JSON text by
namespace and name, and SQLite's table and statements (the other stores' own are in their packages).

A document is a JSON object, written whole and read back whole: a namespace holds a handful (one per
pause), so it is read in one statement or command, and never per call.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from onceonly.errors import StoreCorrupt, StoreError

__all__ = ["SQLITE_CONTROLS", "SQLiteControls", "decode_doc", "encode_doc"]

#: The SQLite table (schema version 3, ``sqlite._MIGRATIONS``).
SQLITE_CONTROLS = """
CREATE TABLE IF NOT EXISTS onceonly_controls (
    ns   TEXT NOT NULL,
    name TEXT NOT NULL,
    doc  TEXT NOT NULL,
    PRIMARY KEY (ns, name)
) WITHOUT ROWID
"""


def encode_doc(namespace: str, name: str, doc: Mapping[str, Any]) -> str:
    """The stored text of a document; a name or a document that cannot be one is refused here, alike for
    every store."""
    for what, text in (("namespace", namespace), ("name", name)):
        if not isinstance(text, str) or not text or "\x00" in text:
            raise ValueError(f"control {what}={text!r:.80}: give a non-empty str without NUL")
    if not isinstance(doc, Mapping):
        raise TypeError(f"control document {name!r}: give a dict of JSON values, not {type(doc).__name__}")
    return json.dumps(dict(doc), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def decode_doc(name: str, text: str | bytes, where: str) -> dict[str, Any]:
    """A document as stored; text that is not a JSON object was not written by onceonly."""
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        raise StoreCorrupt(
            f"{where}: the control document {name!r} is not a JSON object. Nothing was changed: delete it "
            "(onceonly resume) or check what else writes to the ledger's store"
        )
    return doc


def _missing_table(exc: sqlite3.Error) -> bool:
    return isinstance(exc, sqlite3.OperationalError) and "no such table" in str(exc).lower()


def sqlite_controls(conn: sqlite3.Connection, namespace: str, where: str) -> dict[str, dict[str, Any]]:
    """Every document of ``namespace``: none in a file of an older schema read as it is (no table yet)."""
    try:
        rows = conn.execute("SELECT name, doc FROM onceonly_controls WHERE ns = ?", (namespace,)).fetchall()
    except sqlite3.Error as exc:
        if _missing_table(exc):
            return {}
        raise
    return {name: decode_doc(name, doc, where) for name, doc in rows}


def sqlite_put(conn: sqlite3.Connection, namespace: str, name: str, doc: Mapping[str, Any], where: str) -> None:
    text = encode_doc(namespace, name, doc)
    try:
        conn.execute(
            "INSERT INTO onceonly_controls (ns, name, doc) VALUES (?, ?, ?) "
            "ON CONFLICT (ns, name) DO UPDATE SET doc = excluded.doc",
            (namespace, name, text),
        )
    except sqlite3.Error as exc:
        if _missing_table(exc):
            raise _older(where) from exc
        raise


def sqlite_delete(conn: sqlite3.Connection, namespace: str, name: str, where: str) -> bool:
    try:
        gone = conn.execute("DELETE FROM onceonly_controls WHERE ns = ? AND name = ?", (namespace, name)).rowcount
    except sqlite3.Error as exc:
        if _missing_table(exc):
            return False
        raise
    return bool(gone == 1)


def _older(where: str) -> StoreError:
    return StoreError(
        f"{where} is a ledger of an older onceonly, opened as it is: it has no table of control documents "
        "yet. Open it once with Ledger.open (your app does) to bring it up, then try again"
    )


class SQLiteControls:
    """``SQLiteStore``'s control documents: its table ``onceonly_controls``, through this thread's connection."""

    if TYPE_CHECKING:  # the store's
        path: Path

        def _conn(self) -> sqlite3.Connection: ...
        def _errors(self) -> AbstractContextManager[None]: ...

    def controls(self, namespace: str) -> dict[str, dict[str, Any]]:
        with self._errors():
            return sqlite_controls(self._conn(), namespace, str(self.path))

    def put_control(self, namespace: str, name: str, doc: Mapping[str, Any]) -> None:
        with self._errors():
            sqlite_put(self._conn(), namespace, name, doc, str(self.path))

    def delete_control(self, namespace: str, name: str) -> bool:
        with self._errors():
            return sqlite_delete(self._conn(), namespace, name, str(self.path))

    async def acontrols(self, namespace: str) -> dict[str, dict[str, Any]]:
        return await asyncio.to_thread(self.controls, namespace)
