"""The budgets of a SQLite ledger (``onceonly.Budget``; only tools with ``budget=`` come here): two tables,
made on first use, and the steps of ``BudgetStore``, each in one write transaction of
``SQLiteStore.transaction`` (``BEGIN IMMEDIATE``: the file's write lock makes check-and-add atomic across
processes)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from onceonly.stores.base import BudgetUse, Reservation

T = TypeVar("T")

#: A window's total, and each operation key's amount in it (indexed by key: a release knows only the key).
TABLES = (
    """CREATE TABLE IF NOT EXISTS onceonly_budget_windows (
        budget TEXT NOT NULL,
        win    INTEGER NOT NULL,
        start  REAL NOT NULL,
        until  REAL NOT NULL,
        used   REAL NOT NULL,
        lim    REAL NOT NULL,
        PRIMARY KEY (budget, win)
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS onceonly_budget_holds (
        budget TEXT NOT NULL,
        win    INTEGER NOT NULL,
        key    TEXT NOT NULL,
        amount REAL NOT NULL,
        PRIMARY KEY (budget, win, key)
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS onceonly_budget_holds_key ON onceonly_budget_holds (key)",
)


def in_transaction(conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T], write: bool) -> T:
    """``fn(conn)`` in one write transaction (``BEGIN IMMEDIATE``: the file's write lock first), rolled back
    if it raises; ``write=False``: as it is."""
    if not write:
        return fn(conn)
    conn.execute("BEGIN IMMEDIATE")
    try:
        out = fn(conn)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return out


def _exists(conn: sqlite3.Connection) -> bool:
    found = conn.execute(
        "SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = 'onceonly_budget_holds'"
    ).fetchone()
    return bool(found and found[0])


def reserve(
    conn: sqlite3.Connection,
    budget: str,
    window: int,
    key: str,
    amount: float,
    limit: float,
    start: float,
    until: float,
    make: bool = True,
) -> Reservation:
    """``BudgetStore.budget_reserve``, inside the caller's write transaction; ``make``: make the tables
    first (once per store)."""
    if make:
        for statement in TABLES:
            conn.execute(statement)
    row = conn.execute(
        "SELECT used FROM onceonly_budget_windows WHERE budget = ? AND win = ?", (budget, window)
    ).fetchone()
    if row is None:
        # A budget's first call in a new window: the ended windows of that budget go.
        conn.execute("DELETE FROM onceonly_budget_holds WHERE budget = ? AND win < ?", (budget, window))
        conn.execute("DELETE FROM onceonly_budget_windows WHERE budget = ? AND win < ?", (budget, window))
        conn.execute(
            "INSERT INTO onceonly_budget_windows (budget, win, start, until, used, lim) VALUES (?, ?, ?, ?, 0, ?)",
            (budget, window, start, until, limit),
        )
        used = 0.0
    else:
        used = float(row[0])
    held = conn.execute(
        "SELECT 1 FROM onceonly_budget_holds WHERE budget = ? AND win = ? AND key = ?", (budget, window, key)
    ).fetchone()
    if held is not None:
        return Reservation(True, used, False)
    if used + amount > limit:
        return Reservation(False, used, False)
    conn.execute(
        "INSERT INTO onceonly_budget_holds (budget, win, key, amount) VALUES (?, ?, ?, ?)",
        (budget, window, key, amount),
    )
    conn.execute(
        "UPDATE onceonly_budget_windows SET used = used + ?, lim = ? WHERE budget = ? AND win = ?",
        (amount, limit, budget, window),
    )
    return Reservation(True, used + amount, True)


def release(conn: sqlite3.Connection, key: str) -> bool:
    """``BudgetStore.budget_release``, inside the caller's write transaction."""
    if not _exists(conn):
        return False
    holds = conn.execute("SELECT budget, win, amount FROM onceonly_budget_holds WHERE key = ?", (key,)).fetchall()
    for budget, window, amount in holds:
        conn.execute(
            "UPDATE onceonly_budget_windows SET used = max(0, used - ?) WHERE budget = ? AND win = ?",
            (amount, budget, window),
        )
    conn.execute("DELETE FROM onceonly_budget_holds WHERE key = ?", (key,))
    return bool(holds)


def usage(conn: sqlite3.Connection, now: float) -> list[BudgetUse]:
    """``BudgetStore.budget_usage``: a read, which makes no table."""
    if not _exists(conn):
        return []
    rows = conn.execute(
        "SELECT budget, start, until, used, lim FROM onceonly_budget_windows WHERE start <= ? AND until > ? "
        "ORDER BY budget",
        (now, now),
    ).fetchall()
    return [BudgetUse(b, float(s), float(u), float(used), float(lim)) for b, s, u, used, lim in rows]


class SQLiteBudgets:
    """``SQLiteStore``'s budget primitives (``onceonly.stores.base.BudgetStore``), through its public
    ``transaction``."""

    if TYPE_CHECKING:  # the store's

        def transaction(self, fn: Callable[[sqlite3.Connection], T], *, write: bool = True) -> T: ...

    def budget_reserve(
        self, budget: str, window: int, key: str, amount: float, limit: float, start: float, until: float
    ) -> Reservation:
        make = not getattr(self, "_budget_tables", False)
        got = self.transaction(lambda conn: reserve(conn, budget, window, key, amount, limit, start, until, make))
        self._budget_tables = True
        return got

    def budget_release(self, key: str) -> bool:
        return self.transaction(lambda conn: release(conn, key))

    def budget_usage(self, now: float) -> list[BudgetUse]:
        return self.transaction(lambda conn: usage(conn, now), write=False)
