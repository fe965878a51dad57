"""What the ``onceonly`` commands share (needs the ``cli`` extra): option types and the checks made
before a command opens a ledger."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import click

from onceonly.ledger import DEFAULT_URL

#: A count of records (``--limit``, ``--batch``): the stores take 64-bit integers, and a larger one
#: failed inside the database; 0 or less means nothing.
COUNT = click.IntRange(min=1, max=1_000_000_000)


def refuse_missing_ledger(url: str | None) -> None:
    """Refuse a SQLite ledger file that is not there (``url`` None: what ``Ledger.open()`` would open).

    Opening it would make an empty ledger (and its directory) and report no records, or nothing to
    settle: a wrong --url or $ONCEONLY_URL would pass for an empty ledger.
    """
    url = url or os.environ.get("ONCEONLY_URL") or DEFAULT_URL
    if urlsplit(url).scheme.lower() != "sqlite":
        return
    from onceonly.stores.sqlite import parse_sqlite_url

    path = parse_sqlite_url(url)[0]
    if not path.is_file():
        raise click.ClickException(f"no ledger at {path.absolute()}: give the ledger's URL with --url or $ONCEONLY_URL")
