"""``onceonly approve`` and ``onceonly deny``: a person's decision on an operation that awaits approval
(``@ledger.tool(approve=...)``), kept in its record's history."""

from __future__ import annotations

from typing import Any

import click

from onceonly import ops
from onceonly._cli import dumps, existing_ledger, fail, printable, url_option
from onceonly.errors import OnceOnlyError
from onceonly.states import Record

__all__ = ["COMMANDS", "approve_command", "deny_command"]


def _decide(url: str, key: str, what: str, by: str, reason: str | None, fingerprint: str | None) -> Record:
    """Find ``key`` (a key or a prefix only it starts with) and approve or deny it; errors as messages."""
    with existing_ledger(url) as ledger:
        try:
            found = ops.find(ledger, key)
            decide = ledger.approve if what == "approve" else ledger.deny
            return decide(found.key, by=by, reason=reason, fingerprint=fingerprint)
        except ops.AmbiguousKey as exc:
            lines = [printable(f"{exc.prefix!r} starts several keys: give more of the key, one of")]
            lines += [printable(f"  {k}") for k in exc.candidates]
            if exc.more:
                lines.append("  … and more (onceonly ls --state awaiting_approval lists them)")
            raise click.UsageError("\n".join(lines)) from exc
        except (OnceOnlyError, ValueError, LookupError) as exc:  # KeyError: no record with that key
            raise fail(exc) from exc


def _show(rec: Record, as_json: bool, said: str) -> None:
    if as_json:
        click.echo(dumps(ops.record_json(rec), indent=2))
    else:
        click.echo(printable(f"{rec.key}: {said}"))


def _options(fn: Any) -> Any:
    for option in reversed(
        (
            url_option(),
            click.argument("key"),
            click.option("--by", required=True, help="Who decides: kept in the record's history."),
            click.option("--reason", default=None, help="Why: kept in the record's history."),
            click.option(
                "--fingerprint",
                default=None,
                help="Only if the record still holds these arguments (its fingerprint, as `onceonly show --json` "
                "shows it).",
            ),
            click.option("--json", "as_json", is_flag=True, help="Print the record as JSON."),
        )
    ):
        fn = option(fn)
    return fn


@click.command("approve")
@_options
def approve_command(url: str, key: str, by: str, reason: str | None, fingerprint: str | None, as_json: bool) -> None:
    """Approve an operation that awaits approval: its next call runs it, once.

    KEY is a key or a prefix only it starts with (as `onceonly ls --state awaiting_approval` shows it).
    The approval holds for that key and those arguments only; a replay after the run asks no one.
    """
    rec = _decide(url, key, "approve", by, reason, fingerprint)
    _show(rec, as_json, f"approved by {by}; the next call of {rec.tool} with these arguments runs it once")


@click.command("deny")
@_options
def deny_command(url: str, key: str, by: str, reason: str | None, fingerprint: str | None, as_json: bool) -> None:
    """Deny an operation that awaits approval: it never runs with these arguments.

    KEY is a key or a prefix only it starts with. Every later call of it is refused (ApprovalDenied),
    and the model is told it was denied; the reason stays in the history, for people.
    """
    rec = _decide(url, key, "deny", by, reason, fingerprint)
    _show(rec, as_json, f"denied by {by}; calls of {rec.tool} with these arguments are refused")


COMMANDS = (approve_command, deny_command)
