"""``onceonly reconcile``: settle what guarded calls left unsettled, once or every N seconds."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import click
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from onceonly import ops
from onceonly._cli import (
    COUNT,
    INTERRUPTED_EXIT,
    Duration,
    cell,
    dumps,
    load_app,
    parse_duration,
    printable,
    progress_bar,
    refuse_missing_ledger,
    until_stopped,
)
from onceonly.errors import OnceOnlyError
from onceonly.ledger import Ledger
from onceonly.settle import (
    DEFAULT_FULL_EVERY,
    DEFAULT_REVIEW_AFTER,
    ReconcileReport,
    Settlement,
    probe_errors,
    reconcile,
    reconcile_forever,
)
from onceonly.states import Record, State

__all__ = ["ATTENTION_EXIT", "COMMANDS", "Duration", "parse_duration", "reconcile_command"]

#: The exit status of a run that leaves work for a person: records unsettled, without a tool, parked
#: for review (reconcile), or settled records the business disagrees with (audit).
ATTENTION_EXIT = 3
#: What a reconcile run reports that makes it exit with ``ATTENTION_EXIT``.
ATTENTION = (Settlement.UNSETTLED, Settlement.NO_TOOL, Settlement.PARKED)

_COLOURS = {
    Settlement.CONFIRMED: "green",
    Settlement.FAILED: "yellow",
    Settlement.PARKED: "magenta",
    Settlement.UNSETTLED: "red",
    Settlement.NO_TOOL: "red",
    Settlement.WAITING: "dim",
    Settlement.SKIPPED: "dim",
}


def _no_tool_hint(missing: list[str], app: str | None, tools: Mapping[str, Any]) -> str:
    """What to do about records whose tool the reconciler does not know: name the app, or another one."""
    names = ", ".join(repr(t) for t in missing)
    if app is None:
        return f"no tool registered for {names}: pass --app module:ledger, the ledger that registers them"
    known = ", ".join(repr(t) for t in sorted(tools)) or "none"
    return f"--app {app!r} registers {known}, not {names}: name the app whose ledger registers them"


def _print_report(
    console: Console,
    report: ReconcileReport,
    *,
    verbose: bool,
    app: str | None = None,
    tools: Mapping[str, Any] | None = None,
    short: Mapping[str, str] | None = None,
) -> None:
    # A probe that raised is summarised below, one line per distinct error (-v: also a row per record).
    lines = report.lines if verbose else [ln for ln in report.acted if ln.error is None]
    if lines:
        table = Table(title=cell(f"reconcile by {report.by}"), box=box.SIMPLE_HEAD)
        for col in ("key", "tool", "was", "now", "done", "detail"):
            table.add_column(col, overflow="fold")
        for ln in lines:
            colour = _COLOURS[ln.settlement]
            table.add_row(
                cell(ln.key),
                cell(ln.tool),
                ln.before.value,
                "gone" if ln.after is None else ln.after.value,
                f"[{colour}]{ln.settlement.value}[/{colour}]",
                cell(ln.detail),
            )
        console.print(table)
    missing = sorted({ln.tool for ln in report.lines if ln.settlement is Settlement.NO_TOOL})
    if missing:
        console.print(cell(_no_tool_hint(missing, app, tools or {})), soft_wrap=True)
    for n, tool, error, key in probe_errors(report.lines):
        example = (short or {}).get(key, key)
        console.print(cell(f"probe error x{n} ({tool}, e.g. {example}): {error}; stays unknown"), soft_wrap=True)
    counts = ", ".join(f"{n} {name}" for name, n in report.counts.items() if n) or "nothing to settle"
    took = report.finished_at - report.started_at
    when = time.strftime("%H:%M:%S")
    partial = (
        "; interrupted (Ctrl-C), a partial report: the records not reached, and those whose probe was under "
        "way, stay as they were; run again for the rest"
        if report.interrupted
        else ""
    )
    console.print(f"{when} reconciled {len(report.lines)} record(s) in {took:.2f}s: {counts}{partial}", soft_wrap=True)


@click.command("reconcile")
@click.option(
    "--app",
    "app",
    default=None,
    metavar="MODULE:ATTR",
    help="Your ledger with its tools registered, e.g. myapp.tools:ledger (imported, as uvicorn does).",
)
@click.option("--app-dir", default=".", show_default=True, help="Put this directory first on sys.path for --app.")
@click.option(
    "--url",
    default=None,  # no envvar=: $ONCEONLY_URL must not win over the --app ledger's own store
    help="The ledger's store (default: the --app ledger's, else $ONCEONLY_URL, else the default file).",
)
@click.option("--once", is_flag=True, help="Run once and exit (the default without --every).")
@click.option(
    "--every", "every", type=Duration(positive=True), default=None, help="Run every DURATION (30s, 5m) until stopped."
)
@click.option(
    "--review-after",
    type=Duration(),
    default=DEFAULT_REVIEW_AFTER,
    show_default=True,
    help="Park an unknown record that nothing can settle automatically once it is this old.",
)
@click.option(
    "--wait",
    type=Duration(),
    default=None,
    help="Sleep up to this long for records that become due soon (settle times). Default: 10s with "
    "--once, 0 with --every.",
)
@click.option("--by", default=None, help="Who reconciles, for the records' histories (default: reconcile@host:pid).")
@click.option("--scope", default=None, help="Only the records of this scope (default: all).")
@click.option(
    "--batch",
    type=COUNT,
    default=200,
    show_default=True,
    help="Records read per page.",
)
@click.option(
    "--purge",
    "purge",
    is_flag=True,
    help="After a run, also delete settled records whose ttl passed (onceonly purge): after the first "
    "run, then once every --purge-every.",
)
@click.option(
    "--purge-every",
    type=Duration(positive=True, example="1h"),
    default=3600.0,
    show_default=True,
    help="With --purge and --every: how often to purge (a purge reads every record on SQLite).",
)
@click.option(
    "--full-every",
    type=Duration(positive=True, example="10m"),
    default=DEFAULT_FULL_EVERY,
    show_default=True,
    help="SQLite: a run reads the in-flight records only when a holder of their leases died or stalled, "
    "and at least once in this long.",
)
@click.option(
    "--max-age",
    type=Duration(positive=True, example="1h"),
    default=None,
    help="A single run also exits 3 when the oldest unsettled record is older than this (30m, 1h).",
)
@click.option(
    "--server-header",
    "server_header",
    multiple=True,
    metavar="'NAME: VALUE'",
    help='A header sent when asking a server about a key its request was sent with (probe="server" '
    "records): the calls' credentials, since a server answers each client about its own keys. "
    "'Authorization: env:API_TOKEN' reads the value from $API_TOKEN, off the command line. Repeatable.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 256),
    default=4,
    show_default=True,
    help="Records settled at once (their probes and re-sends run in a bounded pool); 1: one after another.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per run.")
@click.option(
    "--verbose",
    "-v",
    is_flag=True,
    help="Also list the records that are waiting or were skipped, and each record whose probe raised.",
)
def reconcile_command(
    app: str | None,
    app_dir: str,
    url: str | None,
    once: bool,
    every: float | None,
    review_after: float,
    wait: float | None,
    by: str | None,
    scope: str | None,
    batch: int,
    purge: bool,
    purge_every: float,
    full_every: float,
    max_age: float | None,
    server_header: tuple[str, ...],
    concurrency: int,
    as_json: bool,
    verbose: bool,
) -> None:
    """Settle unknown records, and in-flight ones whose holder died, through their tools' probes.

    Records of tools that re-send (on_unknown="resend" or "retry") are re-sent with the same key;
    what nothing can settle is parked as needs_review once older than --review-after. Several
    reconcilers may run at once: each record is settled once.

    Exit status of a single run: 0 when nothing needs a person, 3 when records stay unsettled (the
    probe raised), have no tool registered, were parked for review, or wait in needs_review from
    before, or (--max-age) an unsettled record is older than that; 1 on an error, 2 on bad usage;
    130 when Ctrl-C ended it, after the report of what was settled until then (records not reached,
    and those whose probe was under way, stay as they were). With --every it runs until SIGTERM or
    Ctrl-C, then exits 0. A progress bar shows on a terminal (not with --json or into a pipe); probe
    errors are summarised, one line per distinct error.

    \b
    Examples:
      onceonly reconcile --app myapp.tools:ledger
      onceonly reconcile --app myapp.tools:ledger --every 30s --review-after 10m
    """
    if once and every is not None:
        raise click.UsageError("give --once or --every DURATION, not both")
    server_headers = _server_headers(server_header)
    if url or not app:
        refuse_missing_ledger(url)  # the store this command settles, unless it is the app's own
    source = load_app(app, app_dir) if app else None
    try:
        # Ledger.open() without a URL reads $ONCEONLY_URL itself.
        ledger = Ledger.open(url) if url else (source if source is not None else Ledger.open())
    except (OnceOnlyError, ValueError, TypeError, ImportError) as exc:
        if source is not None:
            source.close()
        raise click.ClickException(printable(exc)) from exc
    # The app's tools settle its records on whichever store holds them (--url: the same app elsewhere).
    tools = source.tools if source is not None else ledger.tools
    console = Console(stderr=as_json)
    if not tools:
        console.print(
            "[yellow]no tools registered[/yellow]: expired leases are still settled, but unknown records "
            "need their tools' probes: "
            + (
                escape(printable(f"--app {app!r} registers none; name the ledger its tools are registered on"))
                if app
                else "pass --app module:ledger"
            )
        )
    kwargs: dict[str, Any] = {
        "tools": tools, "scope": scope, "review_after": review_after, "by": by, "batch": batch,
        "full_every": full_every, "server_headers": server_headers, "concurrency": concurrency,
    }  # fmt: skip

    purged_at: list[float] = []  # when this process last purged

    waiting: list[str] = []  # a single run: why a person is needed beyond what the run itself reports

    def show(report: ReconcileReport) -> None:
        data = report.to_dict()
        if every is None and not report.interrupted:
            in_review, oldest = _waiting(ledger, scope, max_age)
            data["needs_review"] = in_review
            waiting.extend(ops.attention(in_review, oldest, ledger.clock(), max_age))
        # Not after every run: a run every few seconds reads only the open records, a purge every record.
        due = not purged_at or ledger.clock() - purged_at[-1] >= purge_every
        if purge and due and not report.interrupted:
            purged_at.append(ledger.clock())
            data["purged"] = ledger.purge()
        if as_json:
            click.echo(dumps(data))
        else:
            examples = [key for _, _, _, key in probe_errors(report.lines)]
            short = ops.short_keys(ledger, examples) if examples else {}
            _print_report(console, report, verbose=verbose, app=app, tools=tools, short=short)
            if "purged" in data:
                console.print(f"purged {data['purged']} expired record(s)")
        for reason in waiting:
            click.echo(printable(f"attention: {reason}"), err=True)

    try:
        if every is None:
            report = ReconcileReport()
            try:
                # The bar's end: the unknown records (the store's counters), moved on as expired leases are read.
                known = ledger.stats()[State.UNKNOWN.value] if scope is None and _shown(as_json) else 0
                with progress_bar("reconcile", known or None, enabled=not as_json) as done:
                    reconcile(
                        ledger, wait=10.0 if wait is None else wait, report=report,
                        progress=lambda n, seen: done(n, max(known, seen)), **kwargs,
                    )  # fmt: skip
            except KeyboardInterrupt:
                report.interrupted = True
                show(report)
                raise SystemExit(INTERRUPTED_EXIT) from None
            show(report)
            if waiting or any(report.counts.get(s.value) for s in ATTENTION):
                raise SystemExit(ATTENTION_EXIT)
            return
        with until_stopped() as stopping:
            reconcile_forever(ledger, every=every, on_report=show, stop=stopping, wait=wait or 0.0, **kwargs)
    except OnceOnlyError as exc:
        raise click.ClickException(printable(exc)) from exc
    finally:
        ledger.close()
        if source is not None and source is not ledger:
            source.close()


def _shown(as_json: bool) -> bool:
    """Whether a progress bar shows: on a terminal, without --json."""
    return not as_json and sys.stderr.isatty()


def _waiting(ledger: Ledger, scope: str | None, max_age: float | None) -> tuple[int, Record | None]:
    """The records in review (of ``scope``), and with ``max_age`` the oldest unsettled record."""
    if scope is None:
        in_review = ledger.stats()[State.NEEDS_REVIEW.value]  # the store's counters: no record is read
    else:
        in_review = sum(1 for _ in ops.records(ledger, states=[State.NEEDS_REVIEW], scope=scope))
    oldest = ops.oldest_unsettled(ledger, scope=scope) if max_age is not None else None
    return in_review, oldest


def _server_headers(given: tuple[str, ...]) -> dict[str, str]:
    """``--server-header 'NAME: VALUE'`` (``env:VAR`` reads $VAR) as a dict; bad usage says which."""
    headers: dict[str, str] = {}
    for item in given:
        name, sep, value = item.partition(":")
        name, value = name.strip(), value.strip()
        if not sep or not name or not name.isascii() or any(c in name for c in " \t\r\n"):
            raise click.BadParameter(f"{item[:40]!r}: give 'NAME: VALUE', such as 'Authorization: env:API_TOKEN'",
                                     param_hint="'--server-header'")  # fmt: skip
        if value.startswith("env:"):
            var = value[4:]
            if var not in os.environ:
                raise click.BadParameter(
                    f"${var} is not set (named by the {name} header)", param_hint="'--server-header'"
                )
            value = os.environ[var]
        if any(c in value for c in "\r\n"):
            raise click.BadParameter(f"the {name} header's value holds a line break", param_hint="'--server-header'")
        headers[name] = value
    return headers


COMMANDS = [reconcile_command]
