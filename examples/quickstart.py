"""The README's quick start, runnable: a guarded tool against the reference ticket service.

The service loses every answer after committing the ticket (fault "lost" with probability 1), and
its idempotency middleware is off: the hardest case. The tool's outcome is therefore unknown each
time; the probe asks the service and finds the ticket. Run it:

    python examples/quickstart.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import httpx

import onceonly
from onceonly.tickets import serve_in_thread


def main() -> None:
    # The ledger is closed before the directory goes: the run leaves nothing behind.
    with (
        tempfile.TemporaryDirectory(prefix="onceonly-quickstart-") as tmp,
        serve_in_thread(db_path=Path(tmp) / "tickets.db", idempotency=False, faults={"lost": 1.0}, seed=1) as server,
        onceonly.Ledger.open(f"sqlite:///{Path(tmp) / 'ledger.db'}") as ledger,
    ):

        def find_ticket(args: dict[str, Any], key: str) -> Any:
            """Ask the ticket system whether the ticket exists: the probe settles lost answers."""
            params = {"session_id": args["session_id"], "title": args["title"]}
            found = httpx.get(f"{server.url}/tickets", params=params).json()["tickets"]
            return found[0] if found else onceonly.NOT_FOUND

        @ledger.tool(key=("session_id", "title"), on_unknown="probe", probe=find_ticket, settle=0.2, timeout=5)
        def create_ticket(session_id: str, title: str, body: str, *, idempotency_key: str) -> dict[str, Any]:
            response = httpx.post(
                f"{server.url}/tickets",
                json={"session_id": session_id, "title": title, "body": body},
                headers={"Idempotency-Key": idempotency_key},
            )
            response.raise_for_status()
            ticket: dict[str, Any] = response.json()
            return ticket

        first = create_ticket.outcome("sess-1", "Printer on fire", "3rd floor")
        again = create_ticket.outcome("sess-1", "Printer on fire", "3rd floor")  # the agent re-plans
        tickets = httpx.get(f"{server.url}/tickets", params={"session_id": "sess-1"}).json()["tickets"]
        print(f"first call: ticket {first.result['id']}, settled via {first.via}")
        print(f"second call: ticket {again.result['id']}, replayed={again.replayed}")
        print(f"tickets in the service: {len(tickets)}")


if __name__ == "__main__":
    main()
