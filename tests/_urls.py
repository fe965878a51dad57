"""A store URL with a password in it, for the tests that check it is never shown."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

SECRET = "hunter2-s3cret"


def with_password(url: str, secret: str = SECRET) -> str:
    """``url`` with ``secret`` as its password (the test servers ignore it: Redis has none set, and
    PostgreSQL trusts loopback clients)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:{secret}@{host}"))
