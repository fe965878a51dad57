"""The store's connections are cut again and again during a run of 500 guarded calls, through a sync
tool and through an ``async def`` tool, which drives the store's async face. Redis: CLIENT KILL of
the ledger's connections; PostgreSQL: pg_terminate_backend of the ledger's backends; the servers
themselves stay up, other tests share them.

Every call must end confirmed, failed with StoreUnavailable, or unknown (OutcomeUnknown) — and the
ledger must agree with the side effects, which the tool writes to a PostgreSQL table the faults do
not touch: no operation ran twice, none ran without the ledger knowing it may have, and a second
pass on a healthy store runs what never ran and never re-runs what did.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import pytest

import onceonly
from onceonly.errors import InProgress, OutcomeUnknown, StoreUnavailable
from onceonly.states import Record, State
from onceonly.stores import AsyncStore, Query, Store, open_store
from tests.conftest import RUN_ID, join_url

CALLS = 500
LEASE = 1.0


class CountingStore:
    """The real store, passed through; it counts the StoreUnavailable errors its callers saw."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        assert isinstance(inner, AsyncStore)
        self.ainner = inner
        self.url = inner.url
        self.errors = 0

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except StoreUnavailable:
            self.errors += 1
            raise

    def get(self, key: str) -> Record | None:
        return self._call(self.inner.get, key)  # type: ignore[no-any-return]

    def claim(self, record: Record) -> Record | None:
        return self._call(self.inner.claim, record)  # type: ignore[no-any-return]

    def insert(self, record: Record) -> bool:
        return self._call(self.inner.insert, record)  # type: ignore[no-any-return]

    def swap(self, record: Record, expected: Record) -> bool:
        return self._call(self.inner.swap, record, expected)  # type: ignore[no-any-return]

    def delete(self, key: str, expected_version: int, created_at: float | None = None) -> bool:
        return self._call(self.inner.delete, key, expected_version, created_at)  # type: ignore[no-any-return]

    def scan(self, query: Query) -> list[Record]:
        return self._call(self.inner.scan, query)  # type: ignore[no-any-return]

    def count_by_state(self) -> dict[State, int]:
        return self._call(self.inner.count_by_state)  # type: ignore[no-any-return]

    def wait_for_change(self, key: str, version: int, timeout: float) -> None:
        self._call(self.inner.wait_for_change, key, version, timeout)

    def close(self) -> None:
        self.inner.close()

    # The async face: what an ``async def`` tool's guard calls.

    async def _acall(self, fn: Any, *args: Any) -> Any:
        try:
            return await fn(*args)
        except StoreUnavailable:
            self.errors += 1
            raise

    async def aget(self, key: str) -> Record | None:
        return await self._acall(self.ainner.aget, key)  # type: ignore[no-any-return]

    async def aclaim(self, record: Record) -> Record | None:
        return await self._acall(self.ainner.aclaim, record)  # type: ignore[no-any-return]

    async def ainsert(self, record: Record) -> bool:
        return await self._acall(self.ainner.ainsert, record)  # type: ignore[no-any-return]

    async def aswap(self, record: Record, expected: Record) -> bool:
        return await self._acall(self.ainner.aswap, record, expected)  # type: ignore[no-any-return]

    async def adelete(self, key: str, expected_version: int, created_at: float | None = None) -> bool:
        return await self._acall(self.ainner.adelete, key, expected_version, created_at)  # type: ignore[no-any-return]

    async def ascan(self, query: Query) -> list[Record]:
        return await self._acall(self.ainner.ascan, query)  # type: ignore[no-any-return]

    async def await_for_change(self, key: str, version: int, timeout: float) -> None:
        await self._acall(self.ainner.await_for_change, key, version, timeout)

    async def aclose(self) -> None:
        await self.ainner.aclose()


class Cutter:
    """A thread that cuts the ledger's connections every few milliseconds, from a second client."""

    def __init__(self, kind: str, server_url: str, name: str) -> None:
        self.kind = kind
        self.server_url = server_url
        self.name = name
        self.cuts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Cutter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        rng = random.Random(5)
        if self.kind == "redis":
            import redis

            client = redis.Redis.from_url(self.server_url)
            try:
                while not self._stop.is_set():
                    for c in client.client_list():
                        if c.get("name") == self.name:
                            self.cuts += client.client_kill_filter(_id=c["id"])
                    self._stop.wait(rng.uniform(0.001, 0.008))
            finally:
                client.close()
        else:
            import psycopg

            with psycopg.connect(self.server_url, autocommit=True) as conn:
                while not self._stop.is_set():
                    killed = conn.execute(
                        "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = %s AND pid <> pg_backend_pid()",
                        (self.name,),
                    ).fetchone()
                    self.cuts += killed[0] if killed else 0
                    self._stop.wait(rng.uniform(0.005, 0.03))  # a reconnect costs PostgreSQL ~10 ms


@pytest.fixture(name="target", params=["redis", "postgres"])
def fixture_target(request: pytest.FixtureRequest) -> tuple[str, str, str, str]:
    """(kind, ledger URL with a connection name of its own, server URL for the cutter, that name)."""
    name = f"onceonly-outage-{uuid.uuid4().hex[:8]}"
    # The server fixtures skip, saying why, when a server is unreachable or its client library missing.
    if request.param == "redis":
        base = request.getfixturevalue("redis_base_url")
        prefix = f"onceonly-test-{RUN_ID}-outage-{name[-8:]}"
        url = join_url(base, prefix=prefix, warn_persistence="false", client_name=name)
        return "redis", url, base, name
    base = request.getfixturevalue("postgres_database_url")
    return "postgres", join_url(base, schema=f"outage_{name[-8:]}", application_name=name), base, name


@pytest.fixture(name="effects")
def fixture_effects(postgres_database_url: str) -> Iterator[tuple[Any, str]]:
    """A PostgreSQL connection (not cut) and a table of our own: one row per real execution."""
    import psycopg

    table = f"outage_effects_{uuid.uuid4().hex[:8]}"
    conn = psycopg.connect(postgres_database_url, autocommit=True)
    conn.execute(f"CREATE TABLE {table} (op integer NOT NULL)")
    yield conn, table
    conn.execute(f"DROP TABLE IF EXISTS {table}")
    conn.close()


@contextmanager
def _ending(outcomes: dict[int, str], n: int) -> Iterator[None]:
    """Record how call ``n`` ended: confirmed, or which of the allowed errors it raised."""
    try:
        yield
        outcomes[n] = "confirmed"
    except StoreUnavailable:
        outcomes[n] = "unavailable"
    except OutcomeUnknown:
        outcomes[n] = "unknown"
    except InProgress:
        outcomes[n] = "in_progress"


def _run_all(tool: Any) -> dict[int, str]:
    outcomes: dict[int, str] = {}
    for n in range(CALLS):
        with _ending(outcomes, n):
            assert tool(n) == {"n": n}
    return outcomes


async def _arun_all(tool: Any) -> dict[int, str]:
    """``_run_all`` for an ``async def`` tool: its guard drives the store's async face."""
    outcomes: dict[int, str] = {}
    for n in range(CALLS):
        with _ending(outcomes, n):
            assert await tool(n) == {"n": n}
    return outcomes


@pytest.mark.parametrize("face", ["sync", "async"])
def test_cut_connections_lose_nothing_and_repeat_nothing(
    target: tuple[str, str, str, str], effects: tuple[Any, str], face: str
) -> None:
    """500 calls while the store's connections are cut: each ends confirmed, StoreUnavailable or
    unknown; the ledger never loses an execution; a second pass never runs one twice. Through a
    sync tool, and through an ``async def`` tool (the store's async face, its own connections)."""
    kind, url, server_url, name = target
    conn, table = effects
    store = CountingStore(open_store(url))
    ledger = onceonly.Ledger(store)

    def record(n: int) -> dict[str, int]:
        conn.execute(f"INSERT INTO {table} (op) VALUES (%s)", (n,))
        return {"n": n}

    effect: Any
    if face == "sync":
        effect = ledger.tool(name="outage.effect", lease=LEASE, wait=2 * LEASE)(record)
    else:

        @ledger.tool(name="outage.effect", lease=LEASE, wait=2 * LEASE)
        async def aeffect(n: int) -> dict[str, int]:
            return record(n)  # a plain blocking write: the one side effect, counted like the sync one's

        effect = aeffect

    def run_all() -> dict[int, str]:
        return _run_all(effect) if face == "sync" else asyncio.run(_arun_all(effect))

    def executions() -> dict[int, int]:
        return dict(conn.execute(f"SELECT op, count(*) FROM {table} GROUP BY op").fetchall())

    try:
        with Cutter(kind, server_url, name) as cutter:
            first = run_all()
        hits = store.errors + getattr(store.inner, "reruns", 0)  # seen by the guard, or re-run in the store
        assert cutter.cuts > 0 and hits > 0, "the faults never hit a call: the test proved nothing"
        assert set(first.values()) <= {"confirmed", "unavailable", "unknown"}, {
            n: o for n, o in first.items() if o == "in_progress"
        }
        runs = executions()
        assert max(runs.values(), default=0) <= 1, "a side effect happened twice"
        for n in range(CALLS):
            rec = ledger.get(effect.key_for(n))
            if first[n] == "confirmed":
                assert runs.get(n) == 1 and rec is not None and rec.state is State.CONFIRMED
            if runs.get(n):  # it ran: the ledger must know that it may have happened
                assert rec is not None and rec.state is not State.FAILED and rec.state is not State.ABANDONED, (n, rec)
            elif rec is not None:
                assert rec.state is not State.CONFIRMED, (n, rec)

        # A healthy store, leases run out: what never ran runs now; nothing runs twice.
        time.sleep(LEASE + 0.2)
        second = run_all()
        runs = executions()
        assert max(runs.values(), default=0) <= 1, "a side effect happened twice after the outage"
        assert set(second.values()) <= {"confirmed", "unknown"}
        for n, outcome in second.items():
            if outcome == "confirmed":
                assert runs.get(n) == 1
        print(
            f"{kind} {face}: {cutter.cuts} cuts, {store.errors} store errors, {hits} hits; first pass "
            f"{sorted((o, list(first.values()).count(o)) for o in set(first.values()))}; second pass "
            f"{sorted((o, list(second.values()).count(o)) for o in set(second.values()))}"
        )
    finally:
        ledger.close()


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_read_only_postgresql_refuses_the_claim_and_the_call_says_so(postgres_database_url: str, face: str) -> None:
    """A server that takes reads but refuses writes once the ledger is open (a standby after a
    failover; here this ledger's own role, made read-only after the open, whose check it passed, and
    its backends cut): the call ends with a clear StoreUnavailable after a few pauses, the tool never
    ran, and the store was not hammered. Before, the guard took each unchanged re-read for a lost race
    and inserted again at once, thousands of times a second."""
    import psycopg

    tag = f"readonly_{uuid.uuid4().hex[:8]}"
    url = join_url(postgres_database_url, schema=tag)
    onceonly.Ledger.open(url).close()  # the schema, made while writes are allowed
    admin = psycopg.connect(postgres_database_url, autocommit=True)
    admin.execute(f'CREATE ROLE "{tag}" LOGIN')
    admin.execute(f'GRANT USAGE ON SCHEMA "{tag}" TO "{tag}"')
    admin.execute(f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{tag}" TO "{tag}"')
    parts = urlsplit(url)
    role_url = parts._replace(netloc=f"{tag}@{parts.hostname}:{parts.port or 5432}").geturl()
    store = CountingStore(open_store(role_url))
    admin.execute(f'ALTER ROLE "{tag}" SET default_transaction_read_only = on')
    admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (tag,))
    ledger = onceonly.Ledger(store)  # type: ignore[arg-type]
    runs: list[int] = []
    try:
        if face == "sync":

            @ledger.tool(name="charge")
            def charge(n: int) -> int:
                runs.append(n)
                return n

            call: Any = lambda: charge(1)  # noqa: E731
        else:

            @ledger.tool(name="charge")
            async def acharge(n: int) -> int:
                runs.append(n)
                return n

            call = lambda: asyncio.run(acharge(1))  # noqa: E731
        start = time.monotonic()
        with pytest.raises(StoreUnavailable, match="read-only") as err:
            call()
        assert time.monotonic() - start < 10
        assert store.errors == 4, "the claim and three more writes were refused: no more were sent"
        assert "did not run the tool" in str(err.value)
        assert runs == []
        assert ledger.get(ledger.tools["charge"].key_for(1)) is None
    finally:
        ledger.close()
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (tag,))
        admin.execute(f'DROP OWNED BY "{tag}"')
        admin.execute(f'DROP ROLE "{tag}"')
        admin.close()
