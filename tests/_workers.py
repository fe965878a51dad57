"""Tools and worker entry points for multi-process tests (importable by spawned processes)."""

from __future__ import annotations

import os
import random
import sqlite3
import time
from pathlib import Path
from typing import Any

import onceonly
from onceonly import NOT_FOUND, Ledger


def effects_db(path: str | Path) -> sqlite3.Connection:
    """The side-effect log: one row per real execution of a tool body."""
    conn = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE IF NOT EXISTS effects (op TEXT, worker TEXT, at REAL)")
    return conn


def count_effects(path: str | Path) -> dict[str, int]:
    conn = effects_db(path)
    try:
        return dict(conn.execute("SELECT op, COUNT(*) FROM effects GROUP BY op").fetchall())
    finally:
        conn.close()


def race_worker(ledger_url: str, effects_path: str, worker: str, ops: int, seed: int) -> dict[str, Any]:
    """Call the tool for every operation, in a shuffled order; return what each call returned."""
    ledger = Ledger.open(ledger_url)
    conn = effects_db(effects_path)
    rng = random.Random(seed)

    @ledger.tool(name="race.op", wait=60)
    def op(n: int) -> dict[str, Any]:
        conn.execute("INSERT INTO effects VALUES (?, ?, ?)", (str(n), worker, time.time()))
        time.sleep(rng.random() * 0.002)  # widen the window between claim and settle
        return {"op": n, "by": worker}

    order = list(range(ops))
    rng.shuffle(order)
    try:
        return {str(n): op(n) for n in order}
    finally:
        ledger.close()
        conn.close()


def crash_worker(ledger_url: str, effects_path: str, on_unknown: str, task: str) -> None:
    """Run a guarded tool that does its side effect and then dies by SIGKILL before it can settle."""
    ledger = Ledger.open(ledger_url)
    conn = effects_db(effects_path)
    tool = _crash_tool(ledger, conn, on_unknown, die=True)
    with ledger.task(task):
        tool("ticket-1")


def _crash_tool(ledger: Ledger, conn: sqlite3.Connection, on_unknown: str, die: bool) -> Any:
    def probe(args: dict[str, Any], key: str) -> Any:
        row = conn.execute("SELECT worker FROM effects WHERE op = ?", (args["title"],)).fetchone()
        return NOT_FOUND if row is None else {"title": args["title"], "by": row[0]}

    @ledger.tool(name="crash.create", on_unknown=on_unknown, probe=probe if on_unknown == "probe" else None, lease=0.5)  # type: ignore[arg-type]
    def create(title: str) -> dict[str, Any]:
        conn.execute("INSERT INTO effects VALUES (?, ?, ?)", (title, str(os.getpid()), time.time()))
        if die:
            os.kill(os.getpid(), 9)  # SIGKILL: no cleanup, no settle, the lease just stops
        return {"title": title, "by": str(os.getpid())}

    return create


def rerun_after_crash(ledger_url: str, effects_path: str, on_unknown: str, task: str) -> onceonly.Outcome:
    """The next run of the same task, in a fresh process's ledger."""
    ledger = Ledger.open(ledger_url)
    conn = effects_db(effects_path)
    tool = _crash_tool(ledger, conn, on_unknown, die=False)
    try:
        with ledger.task(task):
            out: onceonly.Outcome = tool.outcome("ticket-1")
            return out
    finally:
        ledger.close()
        conn.close()


def run_until_printed(cmd: list[str], out: Path, marker: str, times: int, **popen: Any) -> int:
    """Run a command that runs until SIGTERM (``--every``) with its stdout in ``out``; once ``marker`` is
    printed ``times`` times (or it ended, or 60 s passed), SIGTERM it and return its exit status."""
    import signal
    import subprocess

    with out.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, **popen)
    try:
        deadline = time.monotonic() + 60
        while out.read_text().count(marker) < times and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    return proc.returncode


# --- lease holders (tests/test_lease_holders.py) ------------------------------------------------------

#: The tool of the lease-holder workers; the reconciler's ledger registers it too, with the same probe.
HOLDER_TOOL = "holders.create"


def holder_probe(conn: sqlite3.Connection) -> Any:
    """The probe: the effects table says whether the ticket was made."""

    def probe(args: dict[str, Any], key: str) -> Any:
        row = conn.execute("SELECT op FROM effects WHERE op = ?", (args["title"],)).fetchone()
        return NOT_FOUND if row is None else {"title": args["title"]}

    return probe


def holder_worker() -> None:
    """``python -c 'from tests._workers import holder_worker; holder_worker()' URL EFFECTS THEN TITLE``:
    one guarded call, whose tool writes its effect, prints ``sent`` and then does what THEN says:
    ``die`` (SIGKILL), ``hang``; after the call, ``exit-hard`` ends without finalizers, ``close``
    closes the ledger. ``die-after-claim`` is SIGKILLed the moment its claim is written: the tool
    never runs."""
    import signal
    import sys

    url, effects, then, title = sys.argv[1:5]
    if then == "die-after-claim":
        from onceonly.stores import sqlite as sqlite_store

        class Dying(sqlite3.Cursor):
            def execute(self, sql: str, params: Any = ()) -> Any:  # type: ignore[override]
                out = super().execute(sql, params)
                if sql == sqlite_store._INSERT:
                    os.kill(os.getpid(), signal.SIGKILL)  # the claim is committed; nothing after it runs
                return out

        real_conn = sqlite_store.SQLiteStore._conn

        def conn_with_dying_cursor(self: Any) -> sqlite3.Connection:
            conn = real_conn(self)
            self._local.cursor = conn.cursor(Dying)
            return conn

        sqlite_store.SQLiteStore._conn = conn_with_dying_cursor  # type: ignore[method-assign]
    ledger = Ledger.open(url)
    conn = effects_db(effects)

    @ledger.tool(name=HOLDER_TOOL, on_unknown="probe", probe=holder_probe(conn), lease=0.6)
    def create(title: str) -> dict[str, Any]:
        conn.execute("INSERT INTO effects VALUES (?, ?, ?)", (title, str(os.getpid()), time.time()))
        print("sent", flush=True)
        if then == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        if then == "hang":
            time.sleep(3600)
        return {"title": title}

    create(title)
    print("settled", flush=True)
    if then == "exit-hard":
        time.sleep(1.5)  # the holder's refresh (about every second) says it holds nothing
        os._exit(0)  # no finalizers: the holder's file stays, unlocked
    ledger.close()
