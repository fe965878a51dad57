"""A process that calls a guarded tool in a loop until told to stop (``tests/test_pause.py``).

Each call's side effect is a row in a SQLite file (``effects``: op "run"); the first refusal after a
run is a row too (op "paused"), with the time it was seen. Run: python -m tests._pause_worker URL FILE NAME
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import onceonly
from onceonly import Ledger
from tests._workers import effects_db


def main(url: str, effects_path: str, worker: str) -> None:
    ledger = Ledger.open(url)
    conn = effects_db(effects_path)
    stop = Path(effects_path).with_suffix(".stop")

    @ledger.tool(name="pause.send")
    def send(worker: str, n: int) -> int:
        conn.execute("INSERT INTO effects VALUES (?, ?, ?)", ("run", worker, time.time()))
        return n

    n = 0
    running = True
    try:
        while not stop.exists():
            n += 1
            try:
                send(worker, n)
                running = True
            except onceonly.Paused:
                if running:
                    conn.execute("INSERT INTO effects VALUES (?, ?, ?)", ("paused", worker, time.time()))
                running = False
            time.sleep(0.01)
    finally:
        ledger.close()
        conn.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
