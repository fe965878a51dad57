"""A ticket MCP server (stdio, the official SDK's ``MCPServer``) that writes its tickets to SQLite.

It stands for any MCP server with a side effect: ``create_ticket`` makes a new ticket every time it is
called, so a client that retries after a lost answer makes two. Run it behind ``onceonly mcp-proxy``.

    TICKETS_DB=tickets.db python ticket_server.py                      # stdio
    TICKETS_DB=tickets.db python ticket_server.py --http 127.0.0.1:9000  # streamable HTTP at /mcp

Faults, for the example and the tests, are rows of the ``faults`` table (kind, title):
``slow`` commits the ticket and then answers after ``TICKETS_SLOW_SECONDS`` (default 3), ``hang``
commits and never answers, ``error_once`` answers with an error result once (and forgets the fault).
Each process that starts adds its pid to the ``servers`` table.
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

DB = os.environ.get("TICKETS_DB", "tickets.db")
SCHEMA = """
CREATE TABLE IF NOT EXISTS tickets (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, title TEXT NOT NULL, body TEXT NOT NULL,
    created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS faults (kind TEXT NOT NULL, title TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS servers (pid INTEGER NOT NULL, started_at REAL NOT NULL);
"""

server = MCPServer("tickets")


def connect() -> sqlite3.Connection:
    conn = sqlite3.connect(DB, timeout=30, isolation_level=None)
    conn.row_factory = sqlite3.Row
    return conn


def _fault(conn: sqlite3.Connection, title: str) -> str | None:
    row = conn.execute("SELECT kind FROM faults WHERE title = ? LIMIT 1", (title,)).fetchone()
    return None if row is None else str(row["kind"])


@server.tool(annotations=ToolAnnotations(destructive_hint=True, idempotent_hint=False))
def create_ticket(session_id: str, title: str, body: str) -> dict[str, Any]:
    """Open a new support ticket and return it."""
    with connect() as conn:
        fault = _fault(conn, title)
        if fault == "error_once":
            conn.execute("DELETE FROM faults WHERE kind = 'error_once' AND title = ?", (title,))
            raise ValueError(f"the ticket system is busy, {title!r} was not created")
        cur = conn.execute(
            "INSERT INTO tickets (session_id, title, body, created_at) VALUES (?, ?, ?, ?)",
            (session_id, title, body, time.time()),
        )
        ticket = {"id": cur.lastrowid, "session_id": session_id, "title": title, "body": body}
    if fault == "slow":  # committed: the answer is what gets lost
        time.sleep(float(os.environ.get("TICKETS_SLOW_SECONDS", "3")))
    while fault == "hang":
        time.sleep(3600)
    return ticket


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def find_ticket(session_id: str, title: str) -> dict[str, Any] | None:
    """The ticket of a session with this title, or null."""
    with connect() as conn:
        row = conn.execute(
            "SELECT id, session_id, title, body FROM tickets WHERE session_id = ? AND title = ? ORDER BY id LIMIT 1",
            (session_id, title),
        ).fetchone()
    return None if row is None else dict(row)


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def count_tickets(session_id: str) -> int:
    """How many tickets a session has."""
    with connect() as conn:
        return int(conn.execute("SELECT COUNT(*) FROM tickets WHERE session_id = ?", (session_id,)).fetchone()[0])


if __name__ == "__main__":
    with connect() as conn:
        conn.executescript(SCHEMA)
        conn.execute("INSERT INTO servers (pid, started_at) VALUES (?, ?)", (os.getpid(), time.time()))
    if len(sys.argv) == 3 and sys.argv[1] == "--http":
        host, _, port = sys.argv[2].rpartition(":")
        server.run("streamable-http", host=host, port=int(port))
    else:
        server.run()  # stdio
