"""What every part of the PostgreSQL store names the same way: its logger, a quoted identifier, the
NOTIFY channel of a schema."""

from __future__ import annotations

import hashlib
import logging

# The package's name: logging configured for onceonly.stores.postgres covers every part of it.
log = logging.getLogger("onceonly.stores.postgres")


def ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def channel(schema: str) -> str:
    """The NOTIFY channel of a schema's ledger; at most 63 bytes, PostgreSQL's limit."""
    name = f"onceonly.{schema}"
    if len(name) <= 63:
        return name
    return "onceonly." + hashlib.sha256(schema.encode()).hexdigest()[:40]
