"""A stdio MCP server (the official SDK's ``MCPServer``) with one side-effecting tool, ``charge``.

Run as ``python _mcp_charge_server.py CHARGES_DB [LEDGER_URL]``. Every charge that runs is a row in
CHARGES_DB's ``charges`` table. With a LEDGER_URL the server is guarded by onceonly
(``onceonly.mcp.guard_server``): a call whose ``_meta`` carries a key runs once per key. ``environment``
names the variables the server was started with.
"""

from __future__ import annotations

import os
import sqlite3
import sys

from mcp.server.mcpserver import MCPServer

import onceonly
import onceonly.mcp

charges_db = sys.argv[1]
server = MCPServer("payments")


@server.tool()
def charge(customer: str, cents: int) -> str:
    """Charge a customer's card."""
    with sqlite3.connect(charges_db) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS charges (customer TEXT, cents INTEGER)")
        number = conn.execute("INSERT INTO charges VALUES (?, ?)", (customer, cents)).lastrowid
    return f"charged {customer} {cents} (charge #{number})"


@server.tool(annotations={"readOnlyHint": True})
def environment() -> list[str]:
    """The names of this server's environment variables (what its parent passed it)."""
    return sorted(os.environ)


if __name__ == "__main__":
    if len(sys.argv) > 2:
        onceonly.mcp.guard_server(server, onceonly.Ledger.open(sys.argv[2]))
    server.run("stdio")
