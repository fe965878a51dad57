"""SQLite: the guard's per-call cost next to two raw write transactions on the ledger's own table."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from _harness import Contender, guarded_pair, interleave, report, tool_body

import onceonly
from onceonly.stores.sqlite import SQLiteStore


def floor(path: Path) -> Callable[[int], None]:
    """Two raw write transactions per call (claim insert, settle update), same table, same pragmas."""
    conn = SQLiteStore(f"sqlite:///{path}")._conn()
    entry = {"at": time.time(), "from": None, "to": "in_flight", "fence": 1, "reason": "claim", "by": "h:1:1"}
    history_1 = json.dumps([entry])
    history_2 = json.dumps([entry, {**entry, "from": "in_flight", "to": "confirmed"}])
    prefix = uuid.uuid4().hex

    def run(i: int) -> None:
        key = f"default:bench.tool:{hashlib.sha256(f'{prefix}{i}'.encode()).hexdigest()[:32]}"
        now = time.time()
        conn.execute(
            "INSERT INTO onceonly_records (key, scope, tool, fingerprint, state, attempts, fence, version, "
            "lease_owner, lease_until, created_at, updated_at, args, history, conflicts) "
            "VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,0)",
            (key, "default", "bench.tool", key[-32:] * 2, "in_flight", 1, 1, 1, "h:1:1", now + 30, now, now,
             f'{{"i":{i}}}', history_1),
        )  # fmt: skip
        conn.execute(
            "UPDATE onceonly_records SET state=?, version=?, lease_owner=NULL, lease_until=NULL, result=?, via=?, "
            "expires_at=?, updated_at=?, history=? WHERE key=? AND version=?",
            ("confirmed", 2, f'{{"ok":true,"i":{i}}}', "run", now + 86400, now, history_2, key, 1),
        )

    return run


def bench(rounds: int, batch: int, workdir: Path) -> list[dict[str, object]]:
    ledger = onceonly.Ledger.open(f"sqlite:///{workdir / 'ledger.db'}")

    first, replay = guarded_pair(ledger.tool(name="bench.tool")(tool_body))
    contenders = [
        Contender("bare tool", tool_body),
        Contender("floor: 2 raw writes", floor(workdir / "floor.db")),
        first,
        replay,
    ]
    interleave(contenders, rounds, batch)
    ledger.close()
    return report("sqlite", contenders)
