"""Stores: one file per backend; Redis and PostgreSQL are imported only when their URL is opened."""

from __future__ import annotations

from urllib.parse import urlsplit

from onceonly._install import install_hint
from onceonly.stores._url import redact_url
from onceonly.stores.base import AsyncStore, Query, Store

__all__ = ["AsyncStore", "Query", "Store", "open_store", "redact_url"]


def open_store(url: str) -> Store:
    """The store for ``url``: ``sqlite:///…``, ``redis://…`` / ``rediss://…`` (``redis+cluster://…`` for a
    Redis Cluster, ``redis+sentinel://…`` for a master that Redis Sentinel watches), ``postgresql://…``.

    .. versionadded:: 0.1
    """
    scheme = urlsplit(url).scheme.lower()
    shown = redact_url(url)
    if scheme == "sqlite":
        from onceonly.stores.sqlite import SQLiteStore

        return SQLiteStore(url)
    if scheme in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster", "redis+sentinel", "rediss+sentinel"):
        try:
            from onceonly.stores.redis import RedisStore
        except ImportError as exc:  # pragma: no cover - depends on the installed extras
            raise ImportError(f"{shown!r} needs the redis extra: {install_hint('redis')} ({exc})") from exc
        return RedisStore(url)
    if scheme in ("postgres", "postgresql", "postgresql+psycopg"):
        try:
            from onceonly.stores.postgres import PostgresStore
        except ImportError as exc:  # pragma: no cover - depends on the installed extras
            raise ImportError(f"{shown!r} needs the postgres extra: {install_hint('postgres')} ({exc})") from exc
        return PostgresStore(url)
    raise ValueError(
        f"no onceonly store for {shown!r}: use sqlite:///path.db, redis://host:6379/0 or postgresql://host/db"
    )
