"""A client that loses its first answer and retries, against the ticket server with and without the proxy.

    python examples/mcp_proxy/client.py

The ticket server commits the ticket and answers 3 s later; the client gives up waiting after 1 s and
sends the same call again, with the same key in ``_meta``. Straight to the server that makes two
tickets. Through ``onceonly mcp-proxy`` the retry waits for the first attempt and is answered with its
result, marked as a replay: one ticket. Needs the ``mcp`` extra
(``pip install 'onceonly[mcp] @ git+<repository URL>'``); writes into a temporary directory.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import sys
import tempfile
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters
from mcp.shared.exceptions import MCPError

import onceonly.mcp

HERE = Path(__file__).resolve().parent
UPSTREAM = [sys.executable, str(HERE / "ticket_server.py")]
TICKET = {"session_id": "chat-7", "title": "printer on fire", "body": "third floor, again"}


def count(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT COUNT(*) FROM tickets").fetchone()[0])


async def lose_the_first_answer(params: StdioServerParameters, label: str) -> None:
    async with Client(params) as client:
        key = onceonly.mcp.meta("chat-7/printer-on-fire")
        try:
            await client.call_tool("create_ticket", TICKET, read_timeout_seconds=1, meta=key)
        except MCPError as exc:
            print(f"[{label}] first answer lost: {exc}")
        result = await client.call_tool("create_ticket", TICKET, meta=key)
        replayed = (result.meta or {}).get(onceonly.mcp.REPLAYED_META, False)
        print(f"[{label}] retry answered (replayed={replayed}):")
        for block in result.content:
            print("    " + getattr(block, "text", repr(block)).replace("\n", "\n    "))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        env: dict[str, Any] = {**os.environ, "TICKETS_SLOW_SECONDS": "3"}
        for label in ("direct", "onceonly"):
            db = Path(tmp) / f"{label}.db"
            env["TICKETS_DB"] = str(db)
            with sqlite3.connect(db) as conn:  # the server makes its tables; the fault goes in first
                conn.executescript("CREATE TABLE IF NOT EXISTS faults (kind TEXT NOT NULL, title TEXT NOT NULL);")
                conn.execute("INSERT INTO faults VALUES ('slow', ?)", (TICKET["title"],))
            if label == "direct":
                params = StdioServerParameters(command=UPSTREAM[0], args=UPSTREAM[1:], env=env)
            else:
                proxy = [
                    "-c", "from onceonly.cli import main; main()", "mcp-proxy", "--url", f"sqlite:///{tmp}/ledger.db",
                    "--config", str(HERE / "proxy.toml"), "--", *UPSTREAM,
                ]  # fmt: skip
                params = StdioServerParameters(command=sys.executable, args=proxy, env=env)
            asyncio.run(lose_the_first_answer(params, label))
            print(f"[{label}] tickets created: {count(db)}")


if __name__ == "__main__":
    main()
