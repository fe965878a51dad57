"""The ``onceonly`` command: the demo and the operations on a ledger (ls, show, resolve, stats, purge)."""

from __future__ import annotations

import difflib
import json
import math
import shlex
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

try:
    import click
    from rich import box
    from rich.console import Console
    from rich.table import Table
except ImportError as exc:  # pragma: no cover - the cli extra is not installed
    _MISSING_CLI: ImportError | None = exc
else:
    _MISSING_CLI = None

from onceonly._install import install_hint
from onceonly.errors import OnceOnlyError
from onceonly.ledger import Ledger
from onceonly.states import SETTLED, UNSETTLED, Record, State, shown_result
from onceonly.stores import redact_url
from onceonly.stores.base import Query


def main() -> None:
    """Entry point of the ``onceonly`` script."""
    if _MISSING_CLI is not None:  # pragma: no cover
        sys.stderr.write(f"the onceonly command needs its extra: {install_hint('cli')} ({_MISSING_CLI})\n")
        sys.exit(2)
    cli()


if _MISSING_CLI is None:
    from onceonly import ops
    from onceonly._cli import (
        COUNT,
        INTERRUPTED_EXIT,
        Duration,
        Since,
        cell,
        dumps,
        existing_ledger,
        fail,
        open_as_is,
        printable,
        progress_bar,
        refuse_missing_ledger,
        run_every,
        url_option,
    )
    from onceonly.budgets import number_text

    _url_option = url_option()

    _fail = fail

    @contextmanager
    def _ledger(url: str) -> Iterator[Ledger]:
        """``existing_ledger``, and the errors of the command's calls on it become a message too."""
        with existing_ledger(url) as ledger:
            try:
                yield ledger
            except ops.AmbiguousKey as exc:
                raise _ambiguous(exc) from exc
            except (OnceOnlyError, ValueError, LookupError) as exc:  # KeyError: no record with that key
                raise fail(exc) from exc

    def _ambiguous(exc: ops.AmbiguousKey) -> click.UsageError:
        """A prefix several keys start with is bad usage: the message lists them, to pick one."""
        lines = [printable(f"{exc.prefix!r} starts several keys: give more of the key, one of")]
        lines += [printable(f"  {k}") for k in exc.candidates]
        if exc.more:
            lines.append("  … and more (onceonly ls lists them)")
        return click.UsageError("\n".join(lines))

    def _check_tool(ledger: Ledger, tool: str | None) -> None:
        """Refuse a --tool no record has (a typo would list nothing and pass for an empty queue),
        naming the tools whose names are close. Reads every record, only when nothing matched."""
        if tool is None or ledger.store.scan(Query(tool=tool, limit=1)):
            return
        names = sorted(ops.tool_names(ledger))
        close = difflib.get_close_matches(tool, names, n=3, cutoff=0.6)
        if close:
            hint = f"did you mean {' or '.join(map(repr, close))}?"
        elif names:
            hint = f"the tools with records: {', '.join(map(repr, names[:20]))}{'…' if len(names) > 20 else ''}"
        else:
            hint = "the ledger has no records"
        raise click.UsageError(printable(f"no record of a tool named {tool!r} (--tool): {hint}"))

    def _arg_filters(pairs: tuple[str, ...]) -> dict[str, str]:
        """``--arg NAME=VALUE`` options as a dict for ``ops.matches_args``."""
        wanted: dict[str, str] = {}
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if not sep or not name:
                raise click.UsageError(printable(f"--arg {pair!r}: write NAME=VALUE, e.g. --arg order=ord-17"))
            wanted[name] = value
        return wanted

    _arg_option = click.option(
        "--arg",
        "arg_pairs",
        multiple=True,
        metavar="NAME=VALUE",
        help="Only calls with this argument's value (repeatable): order=ord-17, amount=30.",
    )

    def _when(ts: float | None) -> str:
        """An ISO 8601 time in UTC, to the millisecond."""
        return ops.iso(ts) or ""

    def _short_when(ts: float) -> str:
        try:
            return datetime.fromtimestamp(ts, UTC).strftime("%m-%d %H:%M")
        except (OverflowError, ValueError, OSError):  # past year 9999: the number itself
            return repr(ts)

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
        """onceonly: make the side-effecting tool calls of AI agents happen exactly once.

        \b
        Exit status: 0 done; 1 an error (the message says what); 2 bad usage;
        3 done, and something needs a person (reconcile, stats --check, audit; copy,
        import: held records left out); 4 copy, import: conflicts kept; 130 ended by
        Ctrl-C (audit, reconcile, purge). See docs/operations.md.
        """

    @cli.command("ls")
    @_url_option
    @click.option("--state", "states", multiple=True, type=click.Choice([s.value for s in State]), help="Repeatable.")
    @click.option("--tool", default=None, help="Only this tool's records.")
    @click.option("--scope", default=None, help="Only this scope's records.")
    @click.option("--since", type=Since(), default=None, help="Updated since: a duration (1h, 2d) or an ISO time.")
    @_arg_option
    @click.option("--after", default=None, metavar="KEY", help="Start after this key (the next page).")
    @click.option("--limit", type=COUNT, default=50, show_default=True)
    @click.option("--wide", is_flag=True, help="Whole keys, whole arguments and errors.")
    @click.option("--json", "as_json", is_flag=True)
    def ls(
        url: str,
        states: tuple[str, ...],
        tool: str | None,
        scope: str | None,
        since: float | None,
        arg_pairs: tuple[str, ...],
        after: str | None,
        limit: int,
        wide: bool,
        as_json: bool,
    ) -> None:
        """List records in key order, a page at a time.

        Keys are shortened to a prefix no other key starts with (`onceonly show` takes it); --wide
        shows them whole. The last line says how many more records match and how to list them.
        """
        with _ledger(url) as ledger:
            found = ops.page(
                ledger,
                states=[State(s) for s in states] or None,
                tool=tool,
                scope=scope,
                since=since,
                after=after,
                limit=limit,
                args=_arg_filters(arg_pairs),
            )
            if not found.records:
                _check_tool(ledger, tool)
            short = {} if wide or as_json else ops.short_keys(ledger, [r.key for r in found.records])
        more = f"{found.more}{'+' if found.more_capped else ''}"
        if as_json:
            click.echo(dumps(found.to_dict(), indent=2))
            return
        # Sized for the terminal (80 columns in cron mail): the key (its unique prefix), state and time
        # whole; the tool is in the key (scope:tool:digest) unless the key was given, then it is shown
        # before the arguments, the identifying ones first. Only the last column wraps.
        table = Table(title=cell(f"{len(found.records)} record(s) in {redact_url(url)}"), **_TABLE)
        console = Console()
        rows = []
        for r in found.records:
            note = r.error or (f"via {r.via}" if r.via else "")
            if r.conflicts:
                note = f"{r.conflicts} CONFLICT(S) {note}".rstrip()
            args = _args_summary(r)
            if not r.key.startswith(f"{r.scope}:{r.tool}:") or wide:
                args = f"{r.tool}({args})"
            state = r.state.value if r.attempts <= 1 else f"{r.state.value} x{r.attempts}"
            when = _when(r.updated_at) if wide else _short_when(r.updated_at)
            rows.append((short.get(r.key, r.key), state, when, args, note))
        if wide:
            for name in ("key", "state", "updated (UTC)", "args", "error / via"):
                table.add_column(name, overflow="fold")
        else:
            fixed = [max([len(printable(row[i])) for row in rows] + [len(h)]) for i, h in enumerate(_LS_HEADS)]
            rest = console.width - sum(fixed) - _gaps(5)
            key_fold = rest < 16  # keys too long to leave room: fold them (whole) rather than cut them
            if key_fold:
                fixed[0] = max(len(_LS_HEADS[0]), fixed[0] - (16 - rest))
                rest = 16
            args_w = min(max([len(printable(row[3])) for row in rows] + [4]), rest // 2)
            for i, (head, width) in enumerate(zip(_LS_HEADS, fixed, strict=True)):
                table.add_column(head, width=width, no_wrap=not (i == 0 and key_fold), overflow="fold")
            table.add_column("args", width=args_w, no_wrap=True, overflow="ellipsis")
            table.add_column("error / via", width=rest - args_w, overflow="fold")
        for row in rows:
            table.add_row(*(cell(c) for c in row))
        console.print(table)
        if found.more:
            click.echo(printable(f"{more} more — next: onceonly ls --after {shlex.quote(found.next_after or '')}"))

    _LS_HEADS = ("key", "state", "updated UTC")
    #: The tables of ls and stats: no edges, two spaces between columns, a line under the heads.
    _TABLE: dict[str, Any] = {
        "box": box.SIMPLE_HEAD,
        "show_edge": False,
        "pad_edge": False,
        "padding": (0, 1),
        "collapse_padding": True,
    }

    def _gaps(columns: int) -> int:
        """The characters a ``_TABLE`` spends between its ``columns`` columns."""
        return 2 * (columns - 1)

    def _args_summary(rec: Record) -> str:
        """``name=value, ...``, the arguments that identify the call (its key) first."""
        try:
            args = rec.args
        except OnceOnlyError:
            return rec.args_json
        first = ops.key_arguments(rec)
        names = [*first, *(k for k in args if k not in first)]
        return ", ".join(f"{k}={json.dumps(args[k], ensure_ascii=False)}" for k in names)

    @cli.command()
    @_url_option
    @click.argument("key")
    @click.option("--json", "as_json", is_flag=True, help="The record as JSON (times also as ISO 8601).")
    def show(url: str, key: str, as_json: bool) -> None:
        """Show one record, by its key or a prefix only it starts with: its arguments, result, error
        and history as a timeline."""
        with _ledger(url) as ledger:
            rec = ops.find(ledger, key)
            rec.to_dict()  # decodes every stored field here, so a damaged one is a message (StoreCorrupt)
        if as_json:
            click.echo(dumps(ops.record_json(rec), indent=2))
            return
        lines = [
            ("key", rec.key),
            ("state", rec.state.value + (f" (via {rec.via})" if rec.via else "")),
            ("tool", rec.tool),
            ("scope", rec.scope),
            ("attempts", f"{rec.attempts} (fence {rec.fence})"),
            ("created", _when(rec.created_at)),
            ("updated", _when(rec.updated_at)),
        ]
        if rec.lease_owner:
            lines.append(("lease", f"{rec.lease_owner} until {_when(rec.lease_until)}"))
        if rec.next_attempt_at is not None:
            lines.append(("next attempt", _when(rec.next_attempt_at)))
        if rec.expires_at is not None:
            lines.append(("expires", _when(rec.expires_at)))
        if rec.conflicts:
            lines.append(("CONFLICTS", f"{rec.conflicts}: the side effect happened more than once"))
        similar_to = [e["similar_to"] for e in rec.history if isinstance(e.get("similar_to"), str)]
        if similar_to:
            lines.append(("similar to", f"{similar_to[-1]} (onceonly show '{similar_to[-1]}')"))
        lines.append(("args", dumps(rec.args)))
        if rec.result_json is not None:
            lines.append(("result", dumps(shown_result(rec))))
        if rec.error:
            lines.append(("error", rec.error))
        for name, value in lines:
            click.echo(f"{name:>12}  {printable(value)}")
        click.echo(f"{'history':>12}")
        began: float | None = None
        for entry in rec.history:
            at = entry.get("at")
            when = _when(at) if isinstance(at, int | float) else "?"
            step = f"+{at - began:.3f}s" if isinstance(at, int | float) and began is not None else ""
            if isinstance(at, int | float) and began is None:
                began = at
            moved = f"{entry.get('from') or '(new)'} → {entry.get('to')}"
            who = f" by {entry['by']}" if entry.get("by") else ""
            why = f": {entry['reason']}" if entry.get("reason") else ""
            click.echo(printable(f"  {when} {step:>10}  {moved} [fence {entry.get('fence')}]{who}{why}"))

    #: The states a bulk resolve selects from: a confirmed record is never resolved again.
    _RESOLVABLE = [s.value for s in State if s is not State.CONFIRMED]

    @cli.command()
    @_url_option
    @click.argument("key", required=False)
    @click.option("--confirmed", "confirmed", default=None, help="It happened: its result, as JSON.")
    @click.option("--failed", "failed", default=None, help="It did not happen: the reason.")
    @click.option("--reset", is_flag=True, help="With --failed: set attempts back to 0 so it may run again.")
    @click.option("--by", default=None, help="Who resolves it (default: $USER).")
    @click.option("--why", default=None, help="Why: kept in the record's history.")
    @click.option(
        "--state",
        "states",
        multiple=True,
        type=click.Choice(_RESOLVABLE),
        help="Without KEY: resolve every record in this state (repeatable), of --tool, --scope, --arg.",
    )
    @click.option("--tool", default=None, help="Without KEY: only this tool's records.")
    @click.option("--scope", default=None, help="Without KEY: only this scope's records.")
    @_arg_option
    @click.option("--yes", "-y", is_flag=True, help="Without KEY: do not ask before resolving them (scripts).")
    @click.option(
        "--force",
        is_flag=True,
        help="With --confirmed: record it even though it differs from the shape of the tool's earlier results.",
    )
    @click.option("--json", "as_json", is_flag=True, help="Print the settled record(s) as JSON.")
    def resolve(
        url: str,
        key: str | None,
        confirmed: str | None,
        failed: str | None,
        reset: bool,
        by: str | None,
        why: str | None,
        states: tuple[str, ...],
        tool: str | None,
        scope: str | None,
        arg_pairs: tuple[str, ...],
        yes: bool,
        force: bool,
        as_json: bool,
    ) -> None:
        """Settle a record by hand: --confirmed JSON or --failed REASON.

        KEY is a key or a prefix only it starts with (as `onceonly ls` shows it). Without KEY, every
        record selected by --state (and --tool, --scope, --arg) is resolved alike: their count is
        shown and confirmation asked (--yes: not asked). A --confirmed result is what the tool's
        calls with those arguments replay from then on: it is checked against the tool's earlier
        confirmed results (the same JSON type, an object's keys) and refused when it differs, unless
        --force.
        """
        if (confirmed is None) == (failed is None):
            raise click.UsageError("give exactly one of --confirmed JSON or --failed REASON")
        if reset and failed is None:
            raise click.UsageError("--reset goes with --failed: a confirmed record never runs again")
        selecting = bool(states or tool or scope or arg_pairs)
        if key is not None and selecting:
            raise click.UsageError("give a KEY, or select records with --state (--tool, --scope, --arg): not both")
        if key is None and not states:
            raise click.UsageError(
                "give the record's KEY, or select records with --state (e.g. --state needs_review --tool refund)"
            )
        kwargs: dict[str, Any] = {"by": by, "why": why}
        value: Any = None
        if confirmed is not None:
            try:
                value = kwargs["confirmed"] = _strict_json(confirmed)
            except json.JSONDecodeError as exc:
                raise click.UsageError(f"--confirmed takes JSON ({exc}); quote a string as '\"text\"'") from exc
            except ValueError as exc:
                raise click.UsageError(printable(f"--confirmed {confirmed!r} is not strict JSON: {exc}")) from exc
        else:
            kwargs["failed"] = failed
            kwargs["reset"] = reset
        with _ledger(url) as ledger:
            if key is not None:
                found = ops.find(ledger, key)
                if confirmed is not None:
                    _check_shape(ledger, [found.tool], value, force)
                rec = ledger.resolve(found.key, **kwargs)
                if as_json:
                    click.echo(dumps(ops.record_json(rec), indent=2))
                    return
                click.echo(printable(f"{rec.key}: {rec.state.value}{_replays(rec, value, confirmed)}"))
                return
            _resolve_many(ledger, states, tool, scope, _arg_filters(arg_pairs), kwargs, value, yes, force, as_json)

    def _replays(rec: Record, value: Any, confirmed: str | None) -> str:
        if confirmed is None:
            return ""
        return f"; {rec.tool}({_args_summary(rec)}) now replays {dumps(value)}"

    def _check_shape(ledger: Ledger, tools: list[str], value: Any, force: bool) -> None:
        """Refuse a --confirmed result unlike the tools' earlier ones: the agent gets it back as the
        tool's own answer. With --force, say so and go on."""
        for name in sorted(set(tools)):
            why = ops.result_mismatch(ledger, name, value)
            if why is None:
                continue
            text = printable(f"--confirmed {dumps(value)} for {name!r}: {why}")
            if not force:
                raise click.UsageError(
                    f"{text}. A replayed call returns it as {printable(name)}'s own result: give one of that "
                    "shape, or --force to record it as given"
                )
            click.echo(f"{text} (recorded anyway: --force)", err=True)

    def _resolve_many(
        ledger: Ledger,
        states: tuple[str, ...],
        tool: str | None,
        scope: str | None,
        args: dict[str, str],
        kwargs: dict[str, Any],
        value: Any,
        yes: bool,
        force: bool,
        as_json: bool,
    ) -> None:
        selected = list(ops.records(ledger, states=[State(s) for s in states], tool=tool, scope=scope, args=args))
        if not selected:
            _check_tool(ledger, tool)
            click.echo("no record matches: nothing resolved", err=True)
            return
        if "confirmed" in kwargs:
            _check_shape(ledger, [r.tool for r in selected], value, force)
            outcome = f"confirmed with the result {dumps(value)} (their calls replay it from then on)"
        else:
            again = " (attempts reset: they may run again)" if kwargs["reset"] else ""
            outcome = f"failed: {kwargs['failed']}{again}"
        short = ops.short_keys(ledger, [r.key for r in selected[:10]])
        shown = sys.stderr if as_json else sys.stdout
        click.echo(printable(f"{len(selected)} record(s) to resolve as {outcome}:"), file=shown)
        for r in selected[:10]:
            click.echo(printable(f"  {short[r.key]}  {r.state.value}  {r.tool}({_args_summary(r)})"), file=shown)
        if len(selected) > 10:
            click.echo(f"  … and {len(selected) - 10} more", file=shown)
        if not yes:
            click.confirm(f"resolve these {len(selected)} record(s)?", abort=True, err=as_json)
        done: list[Record] = []
        left: list[tuple[str, str]] = []
        for r in selected:
            try:
                # At the version shown: one a reconciler or a colleague settled meanwhile is left as it is.
                done.append(ledger.resolve(r.key, version=r.version, **kwargs))
            except (OnceOnlyError, LookupError) as exc:
                left.append((r.key, str(exc.args[0] if isinstance(exc, LookupError) and exc.args else exc)))
        if as_json:
            click.echo(
                dumps(
                    {
                        "resolved": [ops.record_json(r) for r in done],
                        "left": [{"key": k, "error": e} for k, e in left],
                    },
                    indent=2,
                )
            )
        else:
            for k, e in left:
                click.echo(printable(f"  left as it was: {k}: {e}"), err=True)
            click.echo(printable(f"resolved {len(done)} record(s) as {outcome}; {len(left)} left as they were"))
        if left:
            raise SystemExit(1)

    @cli.command()
    @_url_option
    @click.option("--tool", default=None, help="Only this tool's records.")
    @click.option("--scope", default=None, help="Only this scope's records.")
    @click.option(
        "--counts",
        is_flag=True,
        help="Only the records per state, from the store's counters (no record is read).",
    )
    @click.option(
        "--check",
        is_flag=True,
        help="Exit 3 while records wait for a person (needs_review), or one is unsettled for longer than "
        "--max-age: for cron.",
    )
    @click.option(
        "--max-age",
        type=Duration(positive=True, example="1h"),
        default=None,
        help="With --check: exit 3 also when the oldest unsettled record is older than this (30m, 1h).",
    )
    @click.option("--wide", is_flag=True, help="Whole tool names and keys, whatever the terminal's width.")
    @click.option("--json", "as_json", is_flag=True)
    def stats(
        url: str,
        tool: str | None,
        scope: str | None,
        counts: bool,
        check: bool,
        max_age: float | None,
        wide: bool,
        as_json: bool,
    ) -> None:
        """Records by state and tool, the oldest unsettled one, conflicts, and each tool's call
        durations (p50/p95/p99) with the timeout= they suggest (1.5-2x the p99). Reads every record
        (of --tool, --scope); --counts reads only the counts per state.

        With --check, exit 3 while records wait for a person (needs_review), or (--max-age) an
        unsettled record is older than that; 0 otherwise.
        """
        if counts and (tool or scope):
            raise click.UsageError("--counts counts the whole ledger: leave out --tool and --scope")
        if max_age is not None and not check:
            raise click.UsageError("--max-age goes with --check")
        oldest_rec: Record | None = None
        oldest_short: str | None = None
        with _ledger(url) as ledger:
            if counts:
                by_state = ledger.stats()
                if max_age is not None:
                    oldest_rec = ops.oldest_unsettled(ledger)  # reads the unsettled records only
            else:
                figures = ops.stats(ledger, tool=tool, scope=scope)
                if not sum(figures.states.values()):
                    _check_tool(ledger, tool)
                oldest_rec = figures.oldest_unsettled
                if oldest_rec is not None and not wide:  # the prefix `show` takes: the line fits 80 columns
                    oldest_short = ops.short_keys(ledger, [oldest_rec.key])[oldest_rec.key]
            now = ledger.clock()
        if counts:
            if as_json:
                click.echo(json.dumps({"states": by_state, "total": sum(by_state.values())}))
            else:
                table = Table(title=cell(redact_url(url)), box=box.SIMPLE_HEAD)
                table.add_column("state")
                table.add_column("records", justify="right")
                for state, n in by_state.items():
                    table.add_row(cell(state), str(n))
                Console().print(table)
            if check:
                _stats_check(by_state, oldest_rec, now, max_age)
            return
        data = figures.to_dict()
        if as_json:
            click.echo(dumps(data))
        else:
            _print_stats(url, figures, data, oldest_short)
        if check:
            _stats_check(figures.states, oldest_rec, now, max_age)

    def _print_budgets(console: Console, budgets: list[dict[str, Any]]) -> None:
        """The budgets' current windows (``budget=``), when there are any."""
        if not budgets:
            return
        table = Table(title="budgets", **_TABLE)
        for head in ("budget", "window (UTC)", "used", "limit"):
            table.add_column(head, justify="left" if head in ("budget", "window (UTC)") else "right")
        for b in budgets:
            window = f"{b['window_start']} to {b['window_end']}"
            table.add_row(cell(printable(b["budget"])), cell(window), number_text(b["used"]), number_text(b["limit"]))
        console.print(table)

    def _stats_check(by_state: dict[str, int], oldest: Record | None, now: float, max_age: float | None) -> None:
        """Exit ``ATTENTION_EXIT`` when a person is needed, saying why on stderr."""
        from onceonly.settle_cli import ATTENTION_EXIT

        reasons = ops.attention(by_state.get(State.NEEDS_REVIEW.value, 0), oldest, now, max_age)
        for reason in reasons:
            click.echo(printable(f"check: {reason}"), err=True)
        if reasons:
            raise SystemExit(ATTENTION_EXIT)

    def _print_stats(url: str, figures: ops.LedgerStats, data: dict[str, Any], oldest_short: str | None) -> None:
        """The tables of ``stats``; ``oldest_short``: the oldest unsettled key as shown (None: whole, --wide)."""
        wide = oldest_short is None
        console = Console()
        table = Table(title=cell(redact_url(url)), box=box.SIMPLE_HEAD)
        table.add_column("state")
        table.add_column("records", justify="right")
        for state, n in figures.states.items():
            table.add_row(cell(state), str(n))
        table.add_row("total", str(data["total"]))
        console.print(table)
        oldest = data["oldest_unsettled"]
        if oldest is not None:
            click.echo(
                printable(
                    f"oldest unsettled: {oldest_short or oldest['key']} ({oldest['state']}, {oldest['tool']}), "
                    f"{_age(oldest['age_seconds'])} old"
                )
            )
        if figures.conflicts:
            click.echo(
                f"conflicts: {figures.conflicts} in {figures.records_with_conflicts} record(s), marked in `onceonly ls`"
            )
        _print_budgets(console, data["budgets"])
        if not figures.tools:
            return
        # Fits the terminal (80 columns in cron mail): "open" counts the unsettled records, "dup" the
        # conflicts, "timed" the attempts whose duration the histories show. The figures are whole; a
        # tool name longer than what is left is cut with an ellipsis (--wide: whole, wrapped).
        heads = ("records", "open", "dup", "timed", "p50", "p95", "p99", "timeout=")
        rows = []
        for t in data["tools"]:
            unsettled = sum(n for s, n in t["states"].items() if State(s) in UNSETTLED)
            timed = [f"{t[q]:.3f}s" if q in t else "" for q in ("p50", "p95", "p99")]
            suggestion = f"{t['suggested_timeout']:g}" if "suggested_timeout" in t else ""
            rows.append(
                (printable(t["tool"]), str(sum(t["states"].values())), str(unsettled), str(t["conflicts"]),
                 str(t["attempts_timed"]), *timed, suggestion)
            )  # fmt: skip
        widths = [max([len(row[i + 1]) for row in rows] + [len(h)]) for i, h in enumerate(heads)]
        tools = Table(title="by tool", **_TABLE)
        if wide:
            tools.add_column("tool", overflow="fold")
        else:
            room = max(8, console.width - sum(widths) - _gaps(len(heads) + 1))
            tools.add_column("tool", no_wrap=True, overflow="ellipsis", max_width=room)
        for head, width in zip(heads, widths, strict=True):
            tools.add_column(head, justify="right", no_wrap=True, min_width=width)
        for row in rows:
            tools.add_row(*(cell(c) for c in row))
        console.print(tools)

    @cli.command()
    @click.option("--app", required=True, metavar="MODULE:ATTR", help="Your ledger with its tools (their probes).")
    @click.option("--app-dir", default=".", show_default=True, help="Put this directory first on sys.path for --app.")
    @click.option("--url", default=None, help="The ledger's store (default: the --app ledger's own).")
    @click.option("--since", type=Since(), default=None, help="Records settled since: a duration (1d) or an ISO time.")
    @click.option("--tool", default=None, help="Only this tool's records.")
    @click.option("--scope", default=None, help="Only this scope's records.")
    @click.option(
        "--every",
        type=Duration(positive=True, example="1d"),
        default=None,
        help="Audit every DURATION (1d) until stopped.",
    )
    @click.option(
        "--concurrency",
        type=click.IntRange(1, 256),
        default=4,
        show_default=True,
        help="Probes asked at once (a bounded pool).",
    )
    @click.option("--json", "as_json", is_flag=True, help="One JSON object per run.")
    def audit(
        app: str,
        app_dir: str,
        url: str | None,
        since: float | None,
        tool: str | None,
        scope: str | None,
        every: float | None,
        concurrency: int,
        as_json: bool,
    ) -> None:
        """Check settled records against the business: each tool's probe is asked whether the
        operation happened. A disagreement is a confirmed record the probe does not find, or a failed
        or abandoned one it finds. Writes nothing.

        Exit status of a single run: 0 when all agree, 3 on a disagreement or a probe that raised;
        1 on an error, 2 on bad usage; 130 when Ctrl-C ended it (after the report of what was
        checked). With --every it runs until SIGTERM or Ctrl-C, then exits 0; each disagreement is
        also logged as an AuditDisagreement warning. A progress bar shows on a terminal (not with
        --json or into a pipe); probe errors are summarised, one line per distinct error.
        """
        from onceonly._cli import load_app
        from onceonly.settle_cli import ATTENTION_EXIT

        if url:
            refuse_missing_ledger(url)
        source = load_app(app, app_dir)
        try:
            ledger = open_as_is(url) if url else source
        except (OnceOnlyError, ValueError, ImportError) as exc:
            source.close()
            raise _fail(exc) from exc
        found_any = False

        def once() -> None:
            nonlocal found_any
            report = ops.AuditReport()
            interrupted = False
            try:
                total = None
                if since is None and tool is None and scope is None:  # the store's counters say how many
                    counts = ledger.stats()
                    total = sum(counts[s.value] for s in SETTLED)
                with progress_bar("audit", total, enabled=not as_json) as done:
                    ops.audit(
                        ledger, source.tools, since=since, tool=tool, scope=scope, concurrency=concurrency,
                        report=report, progress=lambda r: done(r.checked + sum(r.without_probe.values())),
                    )  # fmt: skip
            except KeyboardInterrupt:
                interrupted = True
            except OnceOnlyError as exc:
                raise _fail(exc) from exc
            if not interrupted and not report.checked and not report.without_probe:
                try:
                    _check_tool(ledger, tool)  # a mistyped --tool audits nothing: say so, exit 2
                except OnceOnlyError as exc:
                    raise _fail(exc) from exc
            found_any = bool(report.disagreements or report.errors)
            if as_json:
                click.echo(dumps({"at": _when(time.time()), **report.to_dict(), "interrupted": interrupted}))
            else:
                problems = [d.key for d in report.disagreements + report.errors]
                _print_audit(report, ops.short_keys(ledger, problems), interrupted=interrupted)
            if interrupted:
                if every is not None:
                    raise KeyboardInterrupt  # the daemon stops as on Ctrl-C between runs: exit 0
                raise SystemExit(INTERRUPTED_EXIT)

        try:
            if every is None:
                once()
                if found_any:
                    raise SystemExit(ATTENTION_EXIT)
            else:
                run_every(every, once)
        finally:
            ledger.close()
            if ledger is not source:
                source.close()

    def _print_audit(report: ops.AuditReport, short: dict[str, str], *, interrupted: bool = False) -> None:
        if report.disagreements:
            table = Table(title="disagreements", **_TABLE)
            table.add_column("key", no_wrap=True)
            for col in ("tool", "ledger", "probe"):
                table.add_column(col, no_wrap=True)
            table.add_column("detail", overflow="fold")
            for d in report.disagreements:
                table.add_row(cell(short.get(d.key, d.key)), cell(d.tool), d.state, d.finding, cell(d.detail))
            Console().print(table)
        # One line per distinct probe error: a flaky probe is not the same traceback once per record.
        for n, tool_name, text, key in ops.error_summary(report.errors):
            example = short.get(key, key)
            click.echo(printable(f"probe error x{n} ({tool_name}, e.g. {example}): {text}"))
        skipped = ", ".join(f"{n} of {printable(t)}" for t, n in report.without_probe.items())
        click.echo(
            f"{time.strftime('%H:%M:%S')} audited {report.checked} settled record(s): {report.agreed} agree, "
            f"{len(report.disagreements)} disagree, {len(report.errors)} probe error(s)"
            + (f"; not checked (no probe): {skipped}" if skipped else "")
            + ("; interrupted (Ctrl-C): the records after these were not checked" if interrupted else "")
        )

    def _age(seconds: float) -> str:
        for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
            if seconds >= size:
                return f"{seconds / size:.1f}{unit}"
        return f"{seconds:.0f}s"

    @cli.command()
    @_url_option
    @click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
    @click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535), help="0 picks a free one.")
    @click.option(
        "--token",
        envvar="ONCEONLY_DASHBOARD_TOKEN",
        default=None,
        help="Every request must carry it (Authorization: Bearer, or ?token= in the page's address); needed "
        "beyond loopback. Prefer $ONCEONLY_DASHBOARD_TOKEN: a command line is visible to other users.",
    )
    @click.option(
        "--poll",
        type=click.FloatRange(min=0.1),
        default=1.0,
        show_default=True,
        help="Seconds between two checks for changes (a count of the records per state), for the live page.",
    )
    @click.option(
        "--app",
        default=None,
        metavar="MODULE:ATTR",
        help="Your ledger with its tools: 'Reconcile now' settles unknown records through their probes.",
    )
    @click.option("--app-dir", default=".", show_default=True, help="Put this directory first on sys.path for --app.")
    def dashboard(
        url: str, host: str, port: int, token: str | None, poll: float, app: str | None, app_dir: str
    ) -> None:
        """Serve a web page over the ledger until Ctrl-C: what needs a person first, records with
        filters and a search by argument value, each record's timeline, per-tool latency, resolving
        records in review one by one or together, reconciling; live. Its JSON API is under /api/
        (docs/operations.md)."""
        try:
            from onceonly.dashboard.app import check_binding, create_app
            from onceonly.tickets._serve import serve
        except ImportError as exc:
            missing = f"no module named {exc.name!r}" if exc.name else str(exc)
            raise click.ClickException(
                f"onceonly dashboard needs its extra: {install_hint('dashboard')} ({missing})"
            ) from exc
        try:
            check_binding(host, token)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from exc

        def ready(address: str) -> None:
            # The token is never printed: whoever started the dashboard has it.
            page = f"{address}/?token=<token>" if token else f"{address}/"
            click.echo(printable(f"onceonly dashboard of {redact_url(url)} at {page} (Ctrl-C stops it)"))

        from onceonly._cli import load_app

        # The app is imported only for its tools; the dashboard shows --url's ledger.
        source = load_app(app, app_dir) if app else None
        tools = None if source is None else source.tools
        try:
            with _ledger(url) as ledger:
                try:
                    serve(
                        create_app(ledger, token=token, poll_seconds=poll, tools=tools),
                        host=host,
                        port=port,
                        log_level="warning",
                        on_ready=ready,
                    )
                except OSError as exc:
                    raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        finally:
            if source is not None:
                source.close()

    @cli.command()
    @_url_option
    @click.option(
        "--every",
        type=Duration(positive=True, example="1h"),
        default=None,
        help="Purge every DURATION (1h) until stopped.",
    )
    @click.option("--json", "as_json", is_flag=True, help="One JSON object per run.")
    def purge(url: str, every: float | None, as_json: bool) -> None:
        """Delete settled records whose ttl passed (unknown and needs_review are kept)."""
        with _ledger(url) as ledger:

            def once() -> None:
                gone = [0]  # deleted so far: what an interrupted run reports

                def deleted(n: int) -> None:
                    gone[0] = n
                    done(n)

                try:
                    with progress_bar("purge: deleting expired records", None, enabled=not as_json) as done:
                        removed = ledger.purge(progress=deleted)
                except KeyboardInterrupt:
                    if every is not None:
                        raise  # the daemon stops as on Ctrl-C between runs: exit 0
                    if as_json:
                        click.echo(json.dumps({"removed": gone[0], "at": ops.iso(time.time()), "interrupted": True}))
                    click.echo(
                        f"interrupted (Ctrl-C): {gone[0]} expired record(s) deleted so far stay deleted; run again "
                        "for the rest",
                        err=True,
                    )
                    raise SystemExit(INTERRUPTED_EXIT) from None
                if as_json:
                    click.echo(json.dumps({"removed": removed, "at": ops.iso(time.time())}))
                else:
                    click.echo(f"{time.strftime('%H:%M:%S')} removed {removed} expired record(s)")

            if every is None:
                once()
                return
            run_every(every, once)

    @cli.command("metrics")
    @_url_option
    @click.option("--port", type=click.IntRange(0, 65535), default=9464, show_default=True, help="0: any free port.")
    @click.option("--addr", default="127.0.0.1", show_default=True, help="The address to listen on (0.0.0.0: all).")
    def metrics_command(url: str, port: int, addr: str) -> None:
        """Serve the ledger's records by state and the age of its oldest unsettled record as Prometheus
        gauges on http://ADDR:PORT/metrics, read from the store at each scrape (reads only). Runs until
        stopped. The counters of guarded calls live in the processes that make them: see
        docs/operations.md, "Metrics"."""
        try:  # onceonly.metrics first: without prometheus-client it says which extra to install
            from onceonly.metrics import LedgerCollector, build_info, start_http_server
        except ImportError as exc:
            raise _fail(exc) from exc
        from prometheus_client import CollectorRegistry

        with _ledger(url) as ledger:
            registry = CollectorRegistry()
            registry.register(LedgerCollector(ledger))
            build_info(registry)
            try:
                server, thread = start_http_server(port, addr, registry=registry)
            except OSError as exc:
                raise click.ClickException(f"cannot listen on {addr}:{port}: {exc.strerror or exc}") from exc
            where = f"http://{addr}:{server.server_port}/metrics"
            click.echo(printable(f"serving the metrics of {redact_url(url)} on {where}"), err=True)
            try:
                thread.join()
            except KeyboardInterrupt:
                pass
            finally:
                server.shutdown()

    # Commands that live beside the things they run. Their modules import only click and rich at the
    # top (the ticket service and the demo load their extras when run), so `onceonly --help` stays fast.
    from onceonly import approve_cli, pause_cli, settle_cli, transfer_cli
    from onceonly.demo import cli as demo_cli
    from onceonly.mcp import proxy as mcp_proxy_cli
    from onceonly.tickets import cli as tickets_cli

    for _command in (
        *tickets_cli.COMMANDS,
        *settle_cli.COMMANDS,
        *demo_cli.COMMANDS,
        *mcp_proxy_cli.COMMANDS,
        *transfer_cli.COMMANDS,
        *approve_cli.COMMANDS,
        *pause_cli.COMMANDS,
    ):
        cli.add_command(_command)
