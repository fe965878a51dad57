"""A FastMCP server over streamable HTTP with two side-effecting tools, for the tests of who is calling.

Run as ``python _mcp_doors_server.py DB PORT [LEDGER_URL]``. ``create_api_key`` mints a fresh secret and
``charge`` charges a card; each one that runs is a row in DB. With a LEDGER_URL the server is guarded by
``onceonly.mcp.OnceOnlyMiddleware``.
"""

from __future__ import annotations

import secrets
import sqlite3
import sys
from typing import Any

from fastmcp import FastMCP

import onceonly
from onceonly.mcp import OnceOnlyMiddleware

db = sys.argv[1]
server: FastMCP[Any] = FastMCP("keys")


def _row(kind: str, what: str) -> int:
    with sqlite3.connect(db, timeout=30) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS effects (kind TEXT, what TEXT)")
        return int(conn.execute("INSERT INTO effects VALUES (?, ?)", (kind, what)).lastrowid or 0)


@server.tool()
def create_api_key(name: str) -> str:
    """Mint a new API key."""
    key = "sk-" + secrets.token_hex(8)
    _row("api_key", f"{name}:{key}")
    return key


@server.tool()
def charge(customer: str, cents: int) -> str:
    """Charge a customer's card."""
    number = _row("charge", f"{customer}:{cents}")
    return f"charged {customer} {cents} (charge #{number})"


if __name__ == "__main__":
    if len(sys.argv) > 3:
        server.add_middleware(OnceOnlyMiddleware(onceonly.Ledger.open(sys.argv[3])))
    server.run(transport="http", host="127.0.0.1", port=int(sys.argv[2]), path="/mcp", show_banner=False)
