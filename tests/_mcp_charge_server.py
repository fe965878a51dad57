"""A stdio MCP server with one side-effecting tool, ``charge``, guarded by onceonly on the server side.

Run as ``python _mcp_charge_server.py LEDGER_URL CHARGES_DB``. A call whose ``_meta`` carries
``dev.onceonly/idempotencyKey`` goes through the ledger under that key; a call without one just runs.
Every charge that runs is a row in CHARGES_DB's ``charges`` table. (A small glue for tests: onceonly's
MCP middleware is the full version of it.)
"""

from __future__ import annotations

import sqlite3
import sys

from mcp.server.mcpserver import Context, MCPServer

import onceonly

KEY = "dev.onceonly/idempotencyKey"

ledger = onceonly.Ledger.open(sys.argv[1], scope="mcp")
charges_db = sys.argv[2]
server = MCPServer("payments")


def _record(customer: str, cents: int) -> str:
    with sqlite3.connect(charges_db) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS charges (customer TEXT, cents INTEGER)")
        cur = conn.execute("INSERT INTO charges VALUES (?, ?)", (customer, cents))
    return f"charged {customer} {cents} (charge #{cur.lastrowid})"


guarded_record = ledger.tool(name="charge")(_record)


@server.tool()
def charge(customer: str, cents: int, ctx: Context) -> str:
    """Charge a customer's card."""
    key = (ctx.request_context.meta or {}).get(KEY)
    if not key:
        return _record(customer, cents)
    return str(guarded_record.using(key=key)(customer, cents))


if __name__ == "__main__":
    server.run("stdio")
