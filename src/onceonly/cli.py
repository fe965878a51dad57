"""The ``onceonly`` command: the demo and the operations on a ledger (ls, show, resolve, stats, purge)."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

try:
    import click
    from rich.console import Console
    from rich.table import Table
except ImportError as exc:  # pragma: no cover - the cli extra is not installed
    _MISSING_CLI: ImportError | None = exc
else:
    _MISSING_CLI = None

from onceonly.errors import OnceOnlyError
from onceonly.ledger import DEFAULT_URL, Ledger
from onceonly.states import State
from onceonly.stores import redact_url


def main() -> None:
    """Entry point of the ``onceonly`` script."""
    if _MISSING_CLI is not None:  # pragma: no cover
        sys.stderr.write(f"the onceonly command needs its extra: pip install 'onceonly[cli]' ({_MISSING_CLI})\n")
        sys.exit(2)
    cli()


if _MISSING_CLI is None:
    from onceonly._cli import COUNT, cell, dumps, printable, refuse_missing_ledger

    _url_option = click.option(
        "--url",
        envvar="ONCEONLY_URL",
        default=DEFAULT_URL,
        show_default=True,
        help="The ledger: sqlite:///path.db, redis://host:6379/0, postgresql://host/db.",
    )

    def _fail(exc: Exception) -> click.ClickException:
        # str() of a KeyError is the repr of its message, quoted: show the message itself.
        text = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        return click.ClickException(printable(text))

    @contextmanager
    def _ledger(url: str) -> Iterator[Ledger]:
        """The ledger at ``url``, closed afterwards; its errors (and those of the command's calls on
        it) become a message, not a traceback.

        A SQLite file that is not there is refused: opening it would make an empty ledger (and its
        directory) and report no records, hiding a wrong --url.
        """
        try:
            refuse_missing_ledger(url)
            ledger = Ledger.open(url)
        except (OnceOnlyError, ValueError, ImportError) as exc:
            raise _fail(exc) from exc
        try:
            yield ledger
        except (OnceOnlyError, ValueError, KeyError) as exc:  # KeyError: no record with that key
            raise _fail(exc) from exc
        finally:
            ledger.close()

    def _when(ts: float | None) -> str:
        return "" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))

    def _strict_json(text: str) -> Any:
        """``json.loads`` that refuses what Python's json accepts beyond strict JSON: NaN, Infinity,
        numbers too large for a double (1e400 becomes inf) and lone surrogates, which no store can
        keep as JSON."""

        def constant(name: str) -> Any:
            raise ValueError(f"{name} has no JSON form; give a number, or quote it as a string")

        def number(digits: str) -> float:
            value = float(digits)
            if not math.isfinite(value):
                raise ValueError(f"{digits} is too large for a JSON number; quote it as a string")
            return value

        value = json.loads(text, parse_constant=constant, parse_float=number)
        try:  # "\ud800" parses, but a lone surrogate has no UTF-8 form for the store to keep
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as exc:
            bad = exc.object[exc.start : exc.end]
            raise ValueError(f"it holds a lone surrogate {bad!r}, which has no UTF-8 form; remove it") from None
        return value

    @click.group()
    @click.version_option(package_name="onceonly")
    def cli() -> None:
        """onceonly: make the side-effecting tool calls of AI agents happen exactly once."""

    @cli.command("ls")
    @_url_option
    @click.option("--state", "states", multiple=True, type=click.Choice([s.value for s in State]))
    @click.option("--tool", default=None)
    @click.option("--scope", default=None)
    @click.option("--limit", type=COUNT, default=50, show_default=True)
    @click.option("--json", "as_json", is_flag=True)
    def ls(url: str, states: tuple[str, ...], tool: str | None, scope: str | None, limit: int, as_json: bool) -> None:
        """List records."""
        with _ledger(url) as ledger:
            records = ledger.list(state=list(states) or None, tool=tool, scope=scope, limit=limit)
        if as_json:
            click.echo(json.dumps([r.to_dict() for r in records], indent=2))
            return
        table = Table(title=cell(f"{len(records)} record(s) in {redact_url(url)}"))
        for col in ("key", "state", "tool", "attempts", "updated", "via / error"):
            table.add_column(col, overflow="fold")
        for r in records:
            table.add_row(
                cell(r.key),
                r.state.value,
                cell(r.tool),
                str(r.attempts),
                _when(r.updated_at),
                cell(r.via or r.error or ""),
            )
        Console().print(table)

    @cli.command()
    @_url_option
    @click.argument("key")
    def show(url: str, key: str) -> None:
        """Show one record with its history, as JSON."""
        with _ledger(url) as ledger:
            rec = ledger.get(key)
        if rec is None:
            raise click.ClickException(f"no record with key {key!r}")
        click.echo(dumps(rec.to_dict(), indent=2))

    @cli.command()
    @_url_option
    @click.argument("key")
    @click.option("--confirmed", "confirmed", default=None, help="It happened: its result, as JSON.")
    @click.option("--failed", "failed", default=None, help="It did not happen: the reason.")
    @click.option("--reset", is_flag=True, help="With --failed: set attempts back to 0 so it may run again.")
    @click.option("--by", default=None, help="Who resolves it (default: $USER).")
    @click.option("--why", default=None, help="Why: kept in the record's history.")
    def resolve(
        url: str, key: str, confirmed: str | None, failed: str | None, reset: bool, by: str | None, why: str | None
    ) -> None:
        """Settle a record by hand: --confirmed JSON or --failed REASON."""
        if (confirmed is None) == (failed is None):
            raise click.UsageError("give exactly one of --confirmed JSON or --failed REASON")
        if reset and failed is None:
            raise click.UsageError("--reset goes with --failed: a confirmed record never runs again")
        kwargs: dict[str, Any] = {"by": by, "why": why}
        if confirmed is not None:
            try:
                kwargs["confirmed"] = _strict_json(confirmed)
            except json.JSONDecodeError as exc:
                raise click.UsageError(f"--confirmed takes JSON ({exc}); quote a string as '\"text\"'") from exc
            except ValueError as exc:
                raise click.UsageError(printable(f"--confirmed {confirmed!r} is not strict JSON: {exc}")) from exc
        else:
            kwargs["failed"] = failed
            kwargs["reset"] = reset
        with _ledger(url) as ledger:
            rec = ledger.resolve(key, **kwargs)
        click.echo(printable(f"{key}: {rec.state.value}"))

    @cli.command()
    @_url_option
    @click.option("--json", "as_json", is_flag=True)
    def stats(url: str, as_json: bool) -> None:
        """How many records are in each state."""
        with _ledger(url) as ledger:
            counts = ledger.stats()
        if as_json:
            click.echo(json.dumps(counts))
            return
        table = Table(title=cell(redact_url(url)))
        table.add_column("state")
        table.add_column("records", justify="right")
        for state, n in counts.items():
            table.add_row(cell(state), str(n))
        Console().print(table)

    @cli.command()
    @_url_option
    def purge(url: str) -> None:
        """Delete settled records whose ttl passed (unknown and needs_review are kept)."""
        with _ledger(url) as ledger:
            removed = ledger.purge()
        click.echo(f"removed {removed} expired record(s)")

    # Commands that live beside the things they run. Their modules import only click and rich at the
    # top (the ticket service and the demo load their extras when run), so `onceonly --help` stays fast.
    from onceonly import settle_cli
    from onceonly.demo import cli as demo_cli
    from onceonly.mcp import proxy as mcp_proxy_cli
    from onceonly.tickets import cli as tickets_cli

    for _command in (*tickets_cli.COMMANDS, *settle_cli.COMMANDS, *demo_cli.COMMANDS, *mcp_proxy_cli.COMMANDS):
        cli.add_command(_command)
