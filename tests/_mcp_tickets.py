"""The side effect the MCP tests count: tickets in a SQLite file, written by the servers under test."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from fastmcp import FastMCP
from mcp.server.mcpserver import MCPServer
from mcp_types import ToolAnnotations

SCHEMA = """
CREATE TABLE IF NOT EXISTS tickets (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, title TEXT NOT NULL, body TEXT NOT NULL,
    created_at REAL NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS faults (kind TEXT NOT NULL, title TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS servers (pid INTEGER NOT NULL, started_at REAL NOT NULL);
"""


class Tickets:
    """A ticket table in a SQLite file: what a tool creates, and what a test counts."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with self._connect() as conn:
            conn.executescript(SCHEMA)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        conn.row_factory = sqlite3.Row
        return conn

    def create(self, session_id: str, title: str, body: str) -> dict[str, Any]:
        with self._connect() as conn:
            fault = conn.execute("SELECT kind FROM faults WHERE title = ?", (title,)).fetchone()
            if fault is not None and fault["kind"] == "error_once":
                conn.execute("DELETE FROM faults WHERE title = ?", (title,))
                raise ValueError(f"the ticket system is busy, {title!r} was not created")
            cur = conn.execute(
                "INSERT INTO tickets (session_id, title, body) VALUES (?, ?, ?)", (session_id, title, body)
            )
            return {"id": cur.lastrowid, "session_id": session_id, "title": title, "body": body}

    def count(self, title: str | None = None) -> int:
        with self._connect() as conn:
            if title is None:
                return int(conn.execute("SELECT COUNT(*) FROM tickets").fetchone()[0])
            return int(conn.execute("SELECT COUNT(*) FROM tickets WHERE title = ?", (title,)).fetchone()[0])

    def fault(self, kind: str, title: str) -> None:
        with self._connect() as conn:
            conn.execute("INSERT INTO faults (kind, title) VALUES (?, ?)", (kind, title))

    def last_pid(self) -> int | None:
        with self._connect() as conn:
            row = conn.execute("SELECT pid FROM servers ORDER BY rowid DESC LIMIT 1").fetchone()
        return None if row is None else int(row[0])


DESTRUCTIVE = ToolAnnotations(destructive_hint=True, idempotent_hint=False)
READ_ONLY = ToolAnnotations(read_only_hint=True)


def fastmcp_server(tickets: Tickets) -> FastMCP[Any]:
    """A FastMCP ticket server over ``tickets``."""
    server: FastMCP[Any] = FastMCP("tickets")

    @server.tool(annotations=DESTRUCTIVE)
    def create_ticket(session_id: str, title: str, body: str = "") -> dict[str, Any]:
        """Open a new support ticket."""
        return tickets.create(session_id, title, body)

    @server.tool(annotations=READ_ONLY)
    def count_tickets(title: str) -> int:
        """How many tickets have this title."""
        return tickets.count(title)

    return server


def sdk_server(tickets: Tickets) -> MCPServer[Any]:
    """The same ticket server on the official SDK's ``MCPServer``."""
    server: MCPServer[Any] = MCPServer("tickets")

    @server.tool(annotations=DESTRUCTIVE)
    def create_ticket(session_id: str, title: str, body: str = "") -> dict[str, Any]:
        """Open a new support ticket."""
        return tickets.create(session_id, title, body)

    @server.tool(annotations=READ_ONLY)
    def count_tickets(title: str) -> int:
        """How many tickets have this title."""
        return tickets.count(title)

    return server
