"""``onceonly pause``, ``resume`` and ``pauses``: the kill switch (``onceonly.pause``) from a shell.

Exit status: 0 done; 1 an error (the store failed, ``resume`` found no such pause: the message says what
and lists the pauses in force); 2 bad usage.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from contextlib import contextmanager

import click

from onceonly import ops
from onceonly._cli import dumps, existing_ledger, fail, printable, refuse_missing_ledger, url_option
from onceonly.errors import OnceOnlyError
from onceonly.ledger import Ledger
from onceonly.pause import REFRESH_SECONDS, Pause, when_text
from onceonly.stores.base import Query

__all__ = ["COMMANDS"]

_tool_option = click.option("--tool", default=None, help="Only this tool's calls (default: every tool's).")
_scope_option = click.option("--scope", default=None, help="Only calls in this scope (default: every scope).")
_json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


@contextmanager
def _writable(url: str) -> Iterator[Ledger]:
    """The ledger at ``url``, opened to be written (a SQLite file of an older schema is brought up); a
    ledger that is not there is refused, as every command refuses it."""
    try:
        refuse_missing_ledger(url)
        ledger = Ledger.open(url)
    except (OnceOnlyError, ValueError, ImportError) as exc:
        raise fail(exc) from exc
    try:
        yield ledger
    except (OnceOnlyError, ValueError) as exc:
        raise fail(exc) from exc
    finally:
        ledger.close()


def _unknown_tool(ledger: Ledger, tool: str | None) -> str | None:
    """A note when no record has ``tool``: a typo would pause nothing that runs (a new tool has none
    yet, so it is paused anyway). Reads every record, only when nothing matched."""
    if tool is None or ledger.store.scan(Query(tool=tool, limit=1)):
        return None
    close = difflib.get_close_matches(tool, sorted(ops.tool_names(ledger)), n=3, cutoff=0.6)
    hint = f": did you mean {' or '.join(map(repr, close))}?" if close else ""
    return f"note: no record of a tool named {tool!r} yet; paused anyway{hint}"


def _line(p: Pause) -> str:
    by = f" by {p.by}" if p.by else ""
    return printable(f"{p.what()}: paused{by} since {when_text(p.at)}: {p.reason}  (lift: {p.resume_command()})")


@click.command("pause")
@url_option()
@_tool_option
@_scope_option
@click.option("--reason", required=True, help="Why: shown with the pause and in each refused call's error.")
@click.option("--by", default=None, help="Who pauses (default: user@host).")
@_json_option
def pause_command(url: str, tool: str | None, scope: str | None, reason: str, by: str | None, as_json: bool) -> None:
    """Refuse new guarded calls (of --tool, in --scope; default every call) on every process of the ledger.

    Within half a second each matching call raises Paused before it claims: its tool does not run and
    nothing is recorded. Calls already running finish. Read-only tools are never paused.
    """
    with _writable(url) as ledger:
        p = ledger.pause(tool=tool, scope=scope, reason=reason, by=by)
        note = _unknown_tool(ledger, tool)
    if note is not None:
        click.echo(printable(note), err=True)
    if as_json:
        click.echo(dumps(p.to_json()))
        return
    click.echo(
        printable(
            f"paused {p.what()} (by {p.by}): every process on this ledger refuses its new calls within "
            f"{REFRESH_SECONDS:g} s. Lift it with `{p.resume_command()}`"
        )
    )


@click.command("resume")
@url_option()
@_tool_option
@_scope_option
@click.option("--all", "every", is_flag=True, help="Lift every pause.")
@_json_option
def resume_command(url: str, tool: str | None, scope: str | None, every: bool, as_json: bool) -> None:
    """Lift the pause set with the same --tool and --scope (none: the pause of every call), or --all."""
    if every and (tool is not None or scope is not None):
        raise click.UsageError("--all lifts every pause: give it alone, or --tool/--scope for one pause")
    with _writable(url) as ledger:
        before = ledger.pauses()
        lifted = ledger.resume(tool=tool, scope=scope, every=every)
        after = ledger.pauses() if not lifted and not every else []
    chosen = [p for p in before if every or (p.tool, p.scope) == (tool, scope)]
    if as_json:
        click.echo(dumps({"lifted": lifted, "pauses": [p.to_json() for p in chosen]}))
    elif every or lifted:
        click.echo(f"lifted {lifted} pause(s)" + (": new calls run again within 0.5 s" if lifted else ""))
        for p in chosen:
            click.echo("  " + _line(p))
    if lifted or every:
        return
    wanted = Pause(tool, scope, "", None, 0.0).what()
    listed = "; ".join(f"{p.what()} (`{p.resume_command()}`)" for p in after) or "none"
    raise click.ClickException(printable(f"no pause of {wanted}, nothing lifted. Pauses in force: {listed}"))


@click.command("pauses")
@url_option()
@_json_option
def pauses_command(url: str, as_json: bool) -> None:
    """List the pauses in force."""
    with existing_ledger(url) as ledger:
        try:
            found = ledger.pauses()
        except OnceOnlyError as exc:
            raise fail(exc) from exc
    if as_json:
        click.echo(dumps([p.to_json() for p in found]))
        return
    if not found:
        click.echo("no pauses: every guarded call runs")
    for p in found:
        click.echo(_line(p))


COMMANDS = [pause_command, resume_command, pauses_command]
