"""A user's app for the crash and race tests: a ledger, two guarded tools, and an agent loop.

The tools write to a real side-effect table (SQLite, no unique constraint: a duplicate is a second row)
and can be told to die by SIGKILL at chosen points, or to fail with injected faults. The reconciler
imports this module the way it imports a user's app::

    onceonly reconcile --app agent_app:app --app-dir tests/demo

Environment: ``ONCEONLY_APP_LEDGER`` (the ledger URL), ``ONCEONLY_APP_EFFECTS`` (the side-effect
file), ``ONCEONLY_APP_FAULTS`` (probability of an injected fault per attempt, default 0).

Run as a script it is one agent: ``python agent_app.py SEED OPS_JSON KILLS_JSON`` calls the tool
of every operation in ``OPS_JSON`` and dies where ``KILLS_JSON`` (op → "before" | "after") says.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import sys
import threading
import time
from typing import Any

from onceonly import NOT_FOUND, AttemptsExhausted, Ledger, OutcomeUnknown, Retry

#: Seconds a claim holds: short, so that a killed agent's records are up for settling soon.
LEASE = 0.5
#: op → where its tool dies: "before" the side effect (nothing done) or "after" it (done, unanswered).
KILL: dict[str, str] = {}
_lock = threading.Lock()


def effects_db(path: str) -> sqlite3.Connection:
    """The side-effect table: one row per real execution of a tool body."""
    conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE IF NOT EXISTS effects (op TEXT, pid INTEGER, at REAL)")
    return conn


def tool_of(op: str) -> str:
    """Every fifth operation goes through the review tool, the others through the probe tool."""
    return "notify" if int(op.rsplit("-", 1)[1]) % 5 == 0 else "effect"


def register(ledger: Ledger, conn: sqlite3.Connection, fault_rate: float, seed: int) -> None:
    """Register the app's two tools on ``ledger``."""
    rng = random.Random(seed)

    def find(args: dict[str, Any], key: str) -> Any:
        with _lock:
            row = conn.execute(
                "SELECT rowid FROM effects WHERE op = ? ORDER BY rowid LIMIT 1", (args["op"],)
            ).fetchone()
        return NOT_FOUND if row is None else {"op": args["op"], "id": row[0]}

    def body(op: str) -> dict[str, Any]:
        point = KILL.get(op)
        if point == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        with _lock:
            fault = rng.choice(["before", "after"]) if rng.random() < fault_rate else None
        if fault == "before":
            raise ConnectionResetError("injected: connection reset before the commit")
        with _lock:
            rowid = conn.execute("INSERT INTO effects VALUES (?, ?, ?)", (op, os.getpid(), time.time())).lastrowid
        if point == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "after":
            raise ConnectionResetError("injected: answer lost after the commit")
        return {"op": op, "id": rowid}

    retry = Retry(attempts=6, base=0.01, cap=0.05)

    @ledger.tool(name="effect", key=("op",), on_unknown="probe", probe=find, settle=0.05, lease=LEASE, retry=retry)
    def effect(op: str) -> dict[str, Any]:
        return body(op)

    @ledger.tool(name="notify", key=("op",), on_unknown="review", lease=LEASE, retry=retry)
    def notify(op: str) -> dict[str, Any]:
        return body(op)


def app() -> Ledger:
    """The app's ledger with its tools registered (``--app agent_app:app``)."""
    ledger = Ledger.open(os.environ["ONCEONLY_APP_LEDGER"])
    faults = float(os.environ.get("ONCEONLY_APP_FAULTS", "0"))
    register(ledger, effects_db(os.environ["ONCEONLY_APP_EFFECTS"]), faults, seed=os.getpid())
    return ledger


def run_agent(seed: int, ops: list[str], kills: dict[str, str]) -> dict[str, str]:
    """Call the tool of each operation in turn; return how each call ended."""
    KILL.update(kills)
    ledger = Ledger.open(os.environ["ONCEONLY_APP_LEDGER"])
    faults = float(os.environ.get("ONCEONLY_APP_FAULTS", "0"))
    register(ledger, effects_db(os.environ["ONCEONLY_APP_EFFECTS"]), faults, seed)
    ended: dict[str, str] = {}
    for op in ops:
        tool = ledger.tools[tool_of(op)]
        try:
            tool(op)  # type: ignore[operator]
            ended[op] = "confirmed"
        except OutcomeUnknown as exc:
            ended[op] = exc.state or "unknown"
        except AttemptsExhausted:
            ended[op] = "abandoned"
    ledger.close()
    return ended


if __name__ == "__main__":
    _seed, _ops, _kills = sys.argv[1:4]
    print(json.dumps(run_agent(int(_seed), json.loads(_ops), json.loads(_kills))))
