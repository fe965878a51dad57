"""Fixtures of the store tests: a private Redis Cluster, started once for the run."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._redis_server import PrivateRedisCluster
from tests.conftest import _unavailable, require_driver


@pytest.fixture(scope="session", name="redis_cluster_url")
def fixture_redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A ``redis+cluster://`` URL of a 3-master Redis Cluster of this run's own, on free ports, stopped
    by PID at the end. Skipped with the reason when redis-server is missing (a failure under CI=true)."""
    require_driver("redis")
    missing = [name for name in ("redis-server", "redis-cli") if shutil.which(name) is None]
    if missing:
        _unavailable(f"{' and '.join(missing)} not installed, so no Redis Cluster can be started")
    cluster = PrivateRedisCluster(Path(tmp_path_factory.mktemp("redis-cluster"))).start()
    try:
        yield f"{cluster.url}?warn_persistence=false"
    finally:
        cluster.stop()
