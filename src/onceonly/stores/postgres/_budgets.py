"""Budgets (``onceonly.Budget``; only tools with ``budget=`` come here): two tables and a function, made
on first use (as the near-duplicate tables are), so that a ledger without budgets never has them and
the schema version stays. A reservation is one call of ``onceonly_budget_reserve``: it locks the
window's row (``FOR UPDATE``), so the reservers of one window take turns and each sees the total the
one before left, then checks and adds in the same transaction."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from onceonly.stores.base import BudgetUse, Reservation
from onceonly.stores.postgres._names import ident
from onceonly.stores.postgres._schema import lock_id

if TYPE_CHECKING:
    from psycopg import Connection

T = TypeVar("T")


def _names(schema: str) -> tuple[str, str, str]:
    s = ident(schema)
    return f"{s}.onceonly_budget_windows", f"{s}.onceonly_budget_holds", f"{s}.onceonly_budget_reserve"


def budget_ddl(schema: str) -> list[str]:
    """A window's total per (budget, window), each key's amount in it (indexed by key: a release knows only
    the key), and the reserve function. A budget's first call in a new window drops its ended windows."""
    windows, holds, reserve = _names(schema)
    return [
        f"""CREATE TABLE IF NOT EXISTS {windows} (
                budget text COLLATE "C" NOT NULL,
                win    bigint NOT NULL,
                start  double precision NOT NULL,
                until  double precision NOT NULL,
                used   double precision NOT NULL,
                lim    double precision NOT NULL,
                PRIMARY KEY (budget, win)
            )""",
        f"""CREATE TABLE IF NOT EXISTS {holds} (
                budget text COLLATE "C" NOT NULL,
                win    bigint NOT NULL,
                key    text COLLATE "C" NOT NULL,
                amount double precision NOT NULL,
                PRIMARY KEY (budget, win, key)
            )""",
        f"CREATE INDEX IF NOT EXISTS onceonly_budget_holds_key ON {holds} (key)",
        f"""CREATE OR REPLACE FUNCTION {reserve}(
                p_budget text, p_win bigint, p_key text, p_amount double precision, p_lim double precision,
                p_start double precision, p_until double precision,
                OUT granted boolean, OUT total double precision, OUT added boolean)
            LANGUAGE plpgsql AS $$
            BEGIN
                INSERT INTO {windows} (budget, win, start, until, used, lim)
                    VALUES (p_budget, p_win, p_start, p_until, 0, p_lim) ON CONFLICT DO NOTHING;
                IF FOUND THEN
                    DELETE FROM {holds} WHERE budget = p_budget AND win < p_win;
                    DELETE FROM {windows} WHERE budget = p_budget AND win < p_win;
                END IF;
                SELECT w.used INTO total FROM {windows} w WHERE w.budget = p_budget AND w.win = p_win FOR UPDATE;
                PERFORM 1 FROM {holds} h WHERE h.budget = p_budget AND h.win = p_win AND h.key = p_key;
                IF FOUND THEN
                    granted := true; added := false; RETURN;
                END IF;
                IF total + p_amount > p_lim THEN
                    granted := false; added := false; RETURN;
                END IF;
                INSERT INTO {holds} (budget, win, key, amount) VALUES (p_budget, p_win, p_key, p_amount);
                UPDATE {windows} SET used = used + p_amount, lim = p_lim
                    WHERE budget = p_budget AND win = p_win RETURNING used INTO total;
                granted := true; added := true;
            END
            $$""",
    ]


class PostgresBudgets:
    """``PostgresStore``'s budget primitives (``onceonly.stores.base.BudgetStore``)."""

    if TYPE_CHECKING:  # the store's
        schema: str

        def _on_connection(
            self, op: Callable[[Connection], T], rerun: bool = True, cursor: bool = False, writing: bool = True
        ) -> tuple[T, bool]: ...

    def _budget_tables(self, make: bool) -> bool:
        """Whether the budget tables are there; made first (once per store) when ``make``."""
        if getattr(self, "_budgets_ready", False):
            return True
        windows, _, _ = _names(self.schema)
        statements = budget_ddl(self.schema)

        def op(conn: Connection) -> bool:
            with conn.transaction():
                if make:  # the processes that make them at once take turns, as at the schema's creation
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (lock_id(self.schema),))
                found = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (windows,)).fetchone()
                there = bool(found and found[0])
                if make and not there:
                    for statement in statements:
                        conn.execute(statement)
                return there or make

        ready, _ = self._on_connection(op, cursor=True)
        self._budgets_ready = ready
        return ready

    def _budget_run(self, sql: str, params: tuple[Any, ...], writing: bool = True) -> list[Any]:
        def op(conn: Connection) -> list[Any]:
            return conn.execute(sql, params).fetchall()

        rows, _ = self._on_connection(op, cursor=True, writing=writing)  # each step is safe to run again
        return rows

    def budget_reserve(
        self, budget: str, window: int, key: str, amount: float, limit: float, start: float, until: float
    ) -> Reservation:
        self._budget_tables(make=True)
        _, _, reserve = _names(self.schema)
        rows = self._budget_run(
            f"SELECT granted, total, added FROM {reserve}(%s, %s, %s, %s, %s, %s, %s)",
            (budget, window, key, amount, limit, start, until),
        )
        granted, total, added = rows[0]
        return Reservation(bool(granted), float(total), bool(added))

    def budget_release(self, key: str) -> bool:
        if not self._budget_tables(make=False):
            return False
        windows, holds, _ = _names(self.schema)
        rows = self._budget_run(
            f"WITH gone AS (DELETE FROM {holds} WHERE key = %s RETURNING budget, win, amount) "
            f"UPDATE {windows} w SET used = greatest(0, w.used - g.amount) FROM gone g "
            "WHERE w.budget = g.budget AND w.win = g.win RETURNING 1",
            (key,),
        )
        return bool(rows)

    def budget_usage(self, now: float) -> list[BudgetUse]:
        if not self._budget_tables(make=False):
            return []
        windows, _, _ = _names(self.schema)
        rows = self._budget_run(
            f"SELECT budget, start, until, used, lim FROM {windows} WHERE start <= %s AND until > %s ORDER BY budget",
            (now, now),
            writing=False,
        )
        return [BudgetUse(b, float(s), float(u), float(used), float(lim)) for b, s, u, used, lim in rows]
