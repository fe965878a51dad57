"""``onceonly copy``, ``export`` and ``import``: moving a ledger to another store (``onceonly.transfer``).

Exit status: 0 every record is in the target; 3 held records were left out (copy again once they
settled); 4 conflicts (records kept in the target that differ from the source; nothing was written
over); 1 an error (a store, a bad file: the message says what); 2 bad usage.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

import click

from onceonly import transfer
from onceonly._cli import dumps, existing_ledger, fail, printable, url_option
from onceonly.errors import OnceOnlyError
from onceonly.stores import Store, open_store, redact_url

__all__ = ["COMMANDS", "CONFLICT_EXIT", "IN_FLIGHT_EXIT"]

#: Done, but held records were not copied: copy again after they settle.
IN_FLIGHT_EXIT = 3
#: Done, but records in the target differ from the source's and were kept.
CONFLICT_EXIT = 4

_in_flight_option = click.option(
    "--in-flight",
    "in_flight",
    type=click.Choice(["report", "unknown"]),
    default="report",
    show_default=True,
    help="Records held in the source (pending, in_flight): 'report' leaves them out and lists them; 'unknown' "
    "copies them as unknown, so that the target settles them (probe, review) instead of running them again.",
)
_json_option = click.option("--json", "as_json", is_flag=True, help="The summary as one JSON object.")


_fail = fail


@contextmanager
def _source(url: str) -> Iterator[Store]:
    """The ledger at ``url``, read as it is; a missing one is refused (it would read as empty)."""
    with existing_ledger(url) as ledger:
        yield ledger.store


@contextmanager
def _target(url: str) -> Iterator[Store]:
    """The store at ``url``, made when it is not there yet (the ledger being moved in)."""
    try:
        store = open_store(url)
    except (OnceOnlyError, ValueError, ImportError) as exc:
        raise _fail(exc) from exc
    try:
        yield store
    finally:
        store.close()


class _Progress:
    """A count on stderr, redrawn in place, only when stderr is a terminal."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.shown = 0.0
        self.on = sys.stderr.isatty()

    def __call__(self, report: transfer.Report) -> None:
        now = time.monotonic()
        if self.on and now - self.shown > 0.2:
            self.shown = now
            c = report.counts
            sys.stderr.write(
                f"\r{self.what} {report.total} record(s): {c[transfer.Action.INSERT]} copied, "
                f"{c[transfer.Action.UPDATE]} updated, {c[transfer.Action.SKIP]} identical, "
                f"{c[transfer.Action.IN_FLIGHT]} in flight, {c[transfer.Action.CONFLICT]} conflicts"
            )
            sys.stderr.flush()

    def done(self) -> None:
        if self.on and self.shown:
            sys.stderr.write("\n")


def _run(records: Any, url: str, in_flight: transfer.InFlight, what: str) -> transfer.Report:
    progress = _Progress(what)
    try:
        with _target(url) as store:
            return transfer.copy_records(records, store, in_flight=in_flight, progress=progress)
    except OnceOnlyError as exc:
        raise click.ClickException(
            printable(
                f"{str(exc).rstrip('. ')}. The records before it are in the target: run the same command again to "
                "carry on"
            )
        ) from exc
    finally:
        progress.done()


def _finish(report: transfer.Report, source: str, target: str, as_json: bool) -> None:
    A = transfer.Action
    c = report.counts
    if as_json:
        click.echo(dumps({"from": source, "to": target, **report.to_dict()}))
    else:
        for o in report.listed:
            if o.action is A.CONFLICT:
                label = "CONFLICT"
            elif o.as_unknown:
                label = "as unknown"
            else:
                label = "in flight"
            click.echo(printable(f"  {label:<10} {o.key}" + (f": {o.why}" if o.why else "")))
        click.echo(
            printable(
                f"{source} → {target}: {report.total} record(s) read; {c[A.INSERT]} copied, {c[A.UPDATE]} updated, "
                f"{c[A.SKIP]} skipped (identical), {c[A.NEWER]} newer in the target (kept), "
                f"{c[A.IN_FLIGHT]} in flight (not copied), {report.as_unknown} copied as unknown, "
                f"{c[A.CONFLICT]} conflicts"
            )
        )
        if c[A.IN_FLIGHT]:
            click.echo("held records were left out: copy again once they settled (or --in-flight=unknown)", err=True)
        if c[A.CONFLICT]:
            click.echo("conflicts were kept as the target has them: compare with `onceonly show KEY` in both", err=True)
    if c[A.CONFLICT]:
        raise SystemExit(CONFLICT_EXIT)
    if c[A.IN_FLIGHT]:
        raise SystemExit(IN_FLIGHT_EXIT)


@click.command("copy")
@click.option("--from", "source", required=True, metavar="URL", help="The ledger to copy (it is only read).")
@click.option("--to", "target", required=True, metavar="URL", help="The store to copy into (made when absent).")
@_in_flight_option
@_json_option
def copy_command(source: str, target: str, in_flight: transfer.InFlight, as_json: bool) -> None:
    """Copy every record, with its history, from one store into another.

    Writes only what is absent in the target, or older there; a record that differs in the target is a
    conflict and kept. Run it again to pick up what changed; two copies may run at once.

    \b
    Exit status: 0 done; 3 held records left out; 4 conflicts; 1 an error; 2 bad usage.
    """
    if source == target:
        raise click.UsageError("--from and --to are the same store")
    with _source(source) as store:
        report = _run(transfer.store_records(store), target, in_flight, "copy:")
    _finish(report, redact_url(source), redact_url(target), as_json)


@click.command("export")
@url_option()
@click.option("-o", "--output", type=click.File("w", encoding="utf-8", lazy=True), default="-", help="Default: stdout.")
def export_command(url: str, output: TextIO) -> None:
    """Write every record, with its history, as JSON lines: a header, one record per line, an end line.

    Held records are written as they are (``import`` decides what to do with them).
    """
    progress_on = sys.stderr.isatty()
    n = 0
    with _source(url) as store:
        try:
            for line in transfer.export_lines(transfer.store_records(store), source=redact_url(url), now=time.time()):
                output.write(line + "\n")
                n += 1
                if progress_on and n % 1000 == 0:
                    sys.stderr.write(f"\rexport: {n} record(s)")
        except OnceOnlyError as exc:
            raise _fail(exc) from exc
    output.flush()
    click.echo(("\n" if progress_on and n >= 1000 else "") + f"exported {max(0, n - 2)} record(s)", err=True)


@click.command("import")
@url_option("The store to import into (made when absent).")
@click.argument("file", type=click.File("r", encoding="utf-8"))
@_in_flight_option
@_json_option
def import_command(url: str, file: TextIO, in_flight: transfer.InFlight, as_json: bool) -> None:
    """Import an export file (``onceonly export``): the same rules as ``onceonly copy``.

    The whole file is checked before anything is written: a bad line is reported with its number and
    nothing is imported.

    \b
    Exit status: 0 done; 3 held records left out; 4 conflicts; 1 an error (a bad file); 2 bad usage.
    """
    try:
        records = transfer.read_export(line.rstrip("\n") for line in file)
    except UnicodeDecodeError as exc:
        raise click.ClickException(f"{file.name}: not UTF-8 text ({exc.reason}); nothing was imported") from exc
    except transfer.BadFile as exc:
        raise click.ClickException(printable(f"{file.name}: {exc}; nothing was imported")) from exc
    report = _run(records, url, in_flight, "import:")
    _finish(report, file.name, redact_url(url), as_json)


COMMANDS = [copy_command, export_command, import_command]
