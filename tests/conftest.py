"""Fixtures shared by the whole suite: one store fixture per backend, each on its real server.

Redis and PostgreSQL come from ONCEONLY_TEST_REDIS_URL and ONCEONLY_TEST_POSTGRES_URL (loopback
defaults). An unreachable server, or a store whose client library (redis-py, psycopg) is not installed,
skips its tests with the reason shown; under CI=true it fails them.
Each run makes its own PostgreSQL database and Redis key prefix, and removes only what it made.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from onceonly import Ledger
from tests._clock import FakeClock

REDIS_URL = os.environ.get("ONCEONLY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("ONCEONLY_TEST_POSTGRES_URL", "postgresql://127.0.0.1:5432/postgres")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
RUN_ID = uuid.uuid4().hex[:10]


def _reachable(url: str, default_port: int) -> str | None:
    """None when a TCP connection to the URL's host opens, else the reason it did not."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or default_port), timeout=2):
            return None
    except OSError as exc:
        return f"{url} is unreachable ({exc})"


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"CI=true and {reason}: CI must test every store", pytrace=False)
    pytest.skip(reason)


# The client libraries each networked store needs (its extra). The store modules themselves always
# exist, so it is these that decide whether the store can run here.
_DRIVERS = {"redis": ("redis",), "postgres": ("psycopg", "psycopg_pool")}


def require_driver(store: str) -> None:
    """Skip (under CI: fail) the test, with the reason shown, when ``store``'s client library is missing."""
    missing = [name for name in _DRIVERS[store] if importlib.util.find_spec(name) is None]
    if missing:
        _unavailable(
            f"{', '.join(missing)} not installed, so the {store} store cannot run: pip install 'onceonly[{store}]'"
        )


# --- per-run resources: a PostgreSQL database, a Redis key prefix ------------------------------


@pytest.fixture(scope="session", name="postgres_database_url")
def fixture_postgres_database_url() -> Iterator[str]:
    """A PostgreSQL database made for this run, dropped at its end."""
    require_driver("postgres")
    reason = _reachable(POSTGRES_URL, 5432)
    if reason:
        _unavailable(reason)
    import psycopg

    name = f"onceonly_test_{RUN_ID}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    parts = urlsplit(POSTGRES_URL)
    url = parts._replace(path=f"/{name}").geturl()
    try:
        yield url
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session", name="redis_base_url")
def fixture_redis_base_url() -> Iterator[str]:
    """The Redis URL; at the end of the run every key under this run's prefix is removed."""
    require_driver("redis")
    reason = _reachable(REDIS_URL, 6379)
    if reason:
        _unavailable(reason)
    yield REDIS_URL
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        # Test clean-up only: the keys this run made all start with its prefix.
        batch = list(client.scan_iter(match=f"onceonly-test-{RUN_ID}*", count=1000))
        for i in range(0, len(batch), 500):
            client.delete(*batch[i : i + 500])
    finally:
        client.close()


def join_url(url: str, **params: str) -> str:
    """``url`` with query parameters added (a store URL with its per-test prefix or schema)."""
    sep = "&" if "?" in url else "?"
    return url + sep + "&".join(f"{k}={v}" for k, v in params.items())


# --- one fresh, empty ledger URL per test, for each store ----------------------------------------

# Every store, always: one whose driver is missing shows up as a skip that says so (see require_driver).
STORES = ["sqlite", "redis", "postgres"]


def empty_store_url(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL of an empty ledger on store ``kind`` ("sqlite", "redis", "postgres", or "redis-cluster": a
    prefix on the run's private Redis Cluster, from the ``redis_cluster_url`` fixture of tests/stores)."""
    test_id = uuid.uuid4().hex[:8]
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'ledger.db'}"
    if kind in ("redis", "redis-cluster"):
        base = request.getfixturevalue("redis_base_url" if kind == "redis" else "redis_cluster_url")
        return join_url(base, prefix=f"onceonly-test-{RUN_ID}-{test_id}")
    base = request.getfixturevalue("postgres_database_url")
    return join_url(base, schema=f"t_{test_id}")


@pytest.fixture(name="store_url", params=STORES)
def fixture_store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A URL of an empty ledger on each store: its own SQLite file, Redis prefix or PostgreSQL schema."""
    return empty_store_url(request.param, request, tmp_path)


@pytest.fixture(name="clock")
def fixture_clock() -> FakeClock:
    """A fake clock whose sleep advances it."""
    return FakeClock()


@pytest.fixture(name="ledger")
def fixture_ledger(store_url: str, clock: FakeClock) -> Iterator[Ledger]:
    """A fresh ledger on each store, on a fake clock."""
    ledger = Ledger.open(store_url, clock=clock, sleep=clock.sleep)
    yield ledger
    ledger.close()


@pytest.fixture(name="sqlite_url")
def fixture_sqlite_url(tmp_path: Path) -> str:
    """An empty SQLite ledger file for tests about SQLite itself (processes, files, crashes)."""
    return f"sqlite:///{tmp_path / 'ledger.db'}"
