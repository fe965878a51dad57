"""The short demo: one ticket, its answer lost after the commit, naive retry next to onceonly.

The "ticket service" is a real SQLite table; its first answer per ticket is lost after the commit
(the connection resets), as a timed-out HTTP call would be.
"""

from __future__ import annotations

import sqlite3
import tempfile
from pathlib import Path
from typing import Any

from onceonly.guard import NOT_FOUND
from onceonly.ledger import Ledger


class _TicketService:
    """Commits the ticket, then loses the first answer for each title."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("CREATE TABLE tickets (id INTEGER PRIMARY KEY, session_id TEXT, title TEXT, body TEXT)")
        self.answered: set[tuple[str, str]] = set()
        self.calls = 0

    def create(self, session_id: str, title: str, body: str) -> dict[str, Any]:
        self.calls += 1
        cur = self.db.execute(
            "INSERT INTO tickets (session_id, title, body) VALUES (?, ?, ?)", (session_id, title, body)
        )
        if (session_id, title) not in self.answered:
            self.answered.add((session_id, title))
            raise ConnectionResetError("connection reset by peer (the ticket was committed; the answer is lost)")
        return {"id": cur.lastrowid, "title": title}

    def find(self, session_id: str, title: str) -> dict[str, Any] | None:
        row = self.db.execute(
            "SELECT id, title FROM tickets WHERE session_id = ? AND title = ? ORDER BY id LIMIT 1", (session_id, title)
        ).fetchone()
        return None if row is None else {"id": row[0], "title": row[1]}

    def count(self, session_id: str) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM tickets WHERE session_id = ?", (session_id,)).fetchone()[0])


def run_basic_demo() -> dict[str, Any]:
    """Run both strategies against a fresh service and ledger; return what happened."""
    with tempfile.TemporaryDirectory(prefix="onceonly-demo-") as tmp:
        service = _TicketService(Path(tmp) / "tickets.db")
        rows = []

        # Naive: retry on any error. The retry creates the ticket again.
        calls_before = service.calls
        returned: Any = None
        for _ in range(3):
            try:
                returned = service.create("naive", "Printer on fire", "3rd floor")
                break
            except ConnectionError:
                continue
        created = service.count("naive")
        rows.append(
            {"name": "naive retry", "calls": service.calls - calls_before, "created": created,
             "duplicates": created - 1, "returned": returned}
        )  # fmt: skip

        # onceonly: the lost answer makes the outcome unknown; the probe asks the service.
        ledger = Ledger.open(f"sqlite:///{Path(tmp) / 'ledger.db'}")

        def find_ticket(args: dict[str, Any], key: str) -> Any:
            found = service.find(args["session_id"], args["title"])
            return NOT_FOUND if found is None else found

        @ledger.tool(
            name="create_ticket", key=("session_id", "title"), on_unknown="probe", probe=find_ticket, settle=0.05
        )
        def create_ticket(session_id: str, title: str, body: str) -> dict[str, Any]:
            return service.create(session_id, title, body)

        calls_before = service.calls
        outcome = create_ticket.outcome("onceonly", "Printer on fire", "3rd floor")
        again = create_ticket.outcome("onceonly", "Printer on fire", "3rd floor")  # the agent re-plans
        created = service.count("onceonly")
        rows.append(
            {"name": "onceonly", "calls": service.calls - calls_before, "created": created,
             "duplicates": created - 1, "returned": outcome.result}
        )  # fmt: skip
        record = ledger.get(outcome.key)
        history = [f"{h['from']}→{h['to']} ({h.get('reason', '')})" for h in (record.history if record else [])]
        ledger.close()
        service.db.close()
        return {"strategies": rows, "history": history, "replayed_second_call": again.replayed}
