"""What the ``onceonly`` commands share (needs the ``cli`` extra): option types, the checks made
before a command opens a ledger, and how text that came from a store or a user is printed."""

from __future__ import annotations

import json
import os
import re
from typing import Any
from urllib.parse import urlsplit

import click
from rich.text import Text

from onceonly.ledger import DEFAULT_URL

#: A count of records (``--limit``, ``--batch``): the stores take 64-bit integers, and a larger one
#: failed inside the database; 0 or less means nothing.
COUNT = click.IntRange(min=1, max=1_000_000_000)

# What a terminal acts on instead of showing: C0 and C1 controls (ESC starts colour, title and cursor
# sequences; 0x9b is an 8-bit CSI; CR and newline redraw lines), DEL, and the bidirectional overrides
# and isolates that reorder what is shown (and the line and paragraph separators).
_BEYOND_C0 = "\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"
_CONTROLS = re.compile(f"[\x00-\x1f{_BEYOND_C0}]")
# json.dumps escapes C0 itself (and its indentation is made of newlines and spaces).
_JSON_CONTROLS = re.compile(f"[{_BEYOND_C0}]")


def printable(text: object) -> str:
    """``text`` as one line a terminal shows as written: each control character becomes a visible
    escape (``\\x1b``, ``\\u202e``). For everything a command prints that came from a store or a user:
    keys, tools, scopes, errors, results, arguments, messages that quote them."""
    return _CONTROLS.sub(_escape, str(text))


def cell(text: object) -> Text:
    """``printable(text)`` for rich: a ``Text``, never parsed as markup (a stored ``[/x]`` made rich
    raise) nor for emoji codes."""
    return Text(printable(text))


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps(value, ensure_ascii=False)`` whose strings hold no control character: json escapes
    C0 itself, the others become ``\\u`` escapes too; it decodes to the same value."""
    return _JSON_CONTROLS.sub(_json_escape, json.dumps(value, ensure_ascii=False, **kwargs))


_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}


def _escape(match: re.Match[str]) -> str:
    char = match[0]
    code = ord(char)
    return _NAMED.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def _json_escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match[0]):04x}"


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
        raise click.ClickException(
            printable(f"no ledger at {path.absolute()}: give the ledger's URL with --url or $ONCEONLY_URL")
        )
