"""The side effect the framework tests count: one row per ticket made, in a SQLite file."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import onceonly


class Tickets:
    """The side effect: one row per ticket made, in a SQLite file; and the scope each call ran under."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.scopes: list[str | None] = []
        with sqlite3.connect(path) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS tickets (title TEXT)")

    def add(self, title: str) -> int:
        call = onceonly.current_call()  # the current call reached the thread the tool runs in
        self.scopes.append(None if call is None else call.scope)
        with sqlite3.connect(self.path) as conn:
            cur = conn.execute("INSERT INTO tickets VALUES (?)", (title,))
        return int(cur.lastrowid or 0)

    def count(self) -> int:
        with sqlite3.connect(self.path) as conn:
            return int(conn.execute("SELECT COUNT(*) FROM tickets").fetchone()[0])
