"""What a guarded call sends to each store: the shape the benchmarks' figures rest on.

A first call is two writes (the claim and the settle) and nothing else; a replay is answered from
the store, never from a process cache: one round trip on Redis (one script), an ignored insert and
a read on SQLite and PostgreSQL. Counted on the wire (statements, commands), not timed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from onceonly import Ledger
from onceonly.stores import open_store

FIRST = {"sqlite": ["INSERT", "UPDATE"], "redis": ["claim", "swap"], "postgresql": ["insert", "update"]}
REPLAY = {"sqlite": ["INSERT", "SELECT"], "redis": ["claim"], "postgresql": ["insert", "get"]}


def _spy(store: Any) -> list[str]:
    """Record what the store sends from now on, one word per statement or command."""
    sent: list[str] = []
    kind = type(store).__name__
    if kind == "SQLiteStore":
        store._conn().set_trace_callback(lambda sql: sent.append(sql.split()[0].upper()))
    elif kind == "RedisStore":
        names = {store._claim.sha: "claim", store._swap.sha: "swap"}
        command: Callable[..., Any] = store._command

        def spy_command(*args: Any) -> Any:
            sent.append(names.get(args[1], "?") if args[0] == "EVALSHA" else str(args[0]))
            return command(*args)

        store._command = spy_command
    else:
        exec_: Callable[..., Any] = store._exec
        run: Callable[..., Any] = store._run

        def spy_exec(stmt: Any, params: Any) -> Any:
            sent.append(stmt.name.decode().split("_")[2])  # onceonly_<table tag>_<what>[_<columns>]
            return exec_(stmt, params)

        def spy_run(sql: str, *args: Any) -> Any:
            sent.append(sql.split(maxsplit=1)[0].upper())
            return run(sql, *args)

        store._exec, store._run = spy_exec, spy_run
    return sent


def test_a_first_call_is_two_writes_and_a_replay_comes_from_the_store(store_url: str) -> None:
    scheme = store_url.split(":", 1)[0]
    ledger = Ledger(open_store(store_url))
    try:
        tool = ledger.tool(name="hot")(lambda n: {"n": n})
        assert tool(0) == {"n": 0}  # warm: connections open, scripts loaded, statements prepared
        sent = _spy(ledger.store)
        assert tool(1) == {"n": 1}
        assert sent == FIRST[scheme]
        other = Ledger(ledger.store)  # another process's registry over the same store
        sent.clear()  # opening it read the store's clock (Redis, PostgreSQL): once per ledger, not per call
        assert other.tool(name="hot")(lambda n: pytest.fail("a replay ran the tool"))(1) == {"n": 1}
        assert sent == REPLAY[scheme]
    finally:
        ledger.close()
