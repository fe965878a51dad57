"""``onceonly demo``: the project's main job (``make demo``). Only click and rich load at start; the
ticket service and the agents load when the command runs."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import click
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from onceonly._cli import printable
from onceonly._install import install_hint

__all__ = ["COMMANDS", "demo"]

_ABOUT = {
    "naive": "plain POST, retried on any error, no key",
    "key-only": "one Idempotency-Key per call, kept across its retries; the server's middleware on",
    "onceonly": "a ledger keyed by (session, title), a probe, the reconciler; the server's middleware off",
    "onceonly+server": "the same ledger, no probe: the tool asks the server what became of its key "
    '(probe="server"); the server\'s middleware and key status path on',
    "onceonly+similar": "the onceonly row, with similar=Similar(fields=('title',)): a title like an earlier one of the "
    "session is the same ticket",
}


@click.command("demo")
@click.option("--agents", default=8, show_default=True, help="Simulated agents (threads).")
@click.option("--ops", default=200, show_default=True, help="Tickets the agents ask for, in all.")
@click.option(
    "--fault-rate",
    default=0.2,
    show_default=True,
    help="Share of POST /tickets that meet a fault: answer lost after the commit, delayed past the "
    "client timeout, or failed before the commit.",
)
@click.option(
    "--reword-rate",
    default=0.1,
    show_default=True,
    help="Share of tickets the agent asks for again in other words ('Printer on fire #12' as 'The printer "
    "is on fire #12!'): another title, another exact key; only onceonly+similar takes it for the same ticket.",
)
@click.option(
    "--seed",
    default=7,
    show_default=True,
    help="Seeds the asks and the faults: same seed, same counts in the table (the latencies vary).",
)
@click.option(
    "--url",
    default=None,
    help="The onceonly ledger's store (redis://…, postgresql://…); default: a SQLite file in a temp dir.",
)
@click.option(
    "--strategy",
    "strategies",
    multiple=True,
    type=click.Choice(["naive", "key-only", "onceonly", "onceonly+server", "onceonly+similar"]),
    help="Run only these (repeat); default: all five (onceonly+similar needs the similar extra).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (the progress goes to stderr).")
def demo(
    agents: int,
    ops: int,
    fault_rate: float,
    reword_rate: float,
    seed: int,
    url: str | None,
    strategies: tuple[str, ...],
    as_json: bool,
) -> None:
    """Agents create tickets under injected faults: naive retry, key only, onceonly, and onceonly with
    similar=, side by side.

    Embedded: the reference ticket service runs on 127.0.0.1, SQLite files in a temporary directory.
    onceonly's rows read 0 missing; onceonly+similar's reads 0 duplicates too. onceonly with its exact
    key duplicates only the tickets asked for again in other words (--reword-rate 0 shows none).

    One seed gives one run: the same asks, the same faults on the same requests, whatever order the
    agents' threads send them in; so the same counts (asked, created, duplicates, missing, unsettled,
    calls, faults, how onceonly settled). The latencies and seconds vary with the machine. On a machine
    so busy that an answer without a fault takes longer than the client's timeout (0.5 s), that answer
    counts as lost, and the counts move. docs/demo.md says more.
    """
    try:
        from onceonly.demo.run import DemoConfig, asks_of, run_demo
        from onceonly.demo.strategies import unavailable
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise click.ClickException(
            f"onceonly demo needs the server and http extras: {install_hint('server,http')} ({exc})"
        ) from exc
    try:
        config = DemoConfig(agents=agents, ops=ops, fault_rate=fault_rate, reword_rate=reword_rate, seed=seed, url=url)
        if strategies:
            config = replace(config, strategies=strategies)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc

    console = Console(stderr=as_json)
    per_strategy = asks_of(config)
    columns = (TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=as_json) as bar:
        # Strategies run one after another: each bar's clock starts with its first answer.
        running = [name for name in config.strategies if unavailable(name) is None]
        tasks = {name: bar.add_task(name, total=per_strategy, start=False) for name in running}

        def advance(name: str) -> None:
            task = tasks[name]
            if not bar.tasks[task].started:
                bar.start_task(task)
            bar.advance(task)

        try:
            result = run_demo(config, progress=advance)
        except Exception as exc:
            raise click.ClickException(printable(f"the demo failed: {type(exc).__name__}: {exc}")) from exc

    if as_json:
        click.echo(json.dumps(result.to_dict()))
        return
    _print_table(console, result)


def _print_table(console: Console, result: Any) -> None:
    config = result.config
    title = (
        f"{config.agents} agents, {config.ops} tickets, fault rate {config.fault_rate:g}, "
        f"reword rate {config.reword_rate:g}, seed {result.seed}"
    )
    # No outer edge: with the row "onceonly+similar" the table fits in 80 columns.
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, show_edge=False)
    table.add_column("strategy", no_wrap=True)
    for col in ("asked", "created", "duplicates", "missing", "unsettled", "p50 ms", "p99 ms"):
        table.add_column(col, justify="right", no_wrap=True)
    for row in result.strategies:
        bad = "red" if row.duplicates or row.missing else "green"
        table.add_row(
            row.name,
            str(row.asked),
            str(row.created),
            f"[{bad}]{row.duplicates}[/{bad}]",
            f"[{bad}]{row.missing}[/{bad}]",
            str(row.unsettled),
            f"{row.p50_ms:.0f}",
            f"{row.p99_ms:.0f}",
        )
    console.print(table)
    console.print()
    for row in result.strategies:
        faults = ", ".join(f"{n} {kind}" for kind, n in row.faults.items()) or "none"
        lines = [
            f"[bold]{row.name}[/bold]: {_ABOUT[row.name]}. {row.calls} calls in {row.seconds:.1f}s; faults: {faults}."
        ]
        if row.duplicates:
            lines.append(
                f"Duplicates: {row.duplicates - row.duplicates_reasked} on operations asked once (lost or late "
                f"answers), {row.duplicates_reasked} on operations asked again (a re-plan, a second agent), "
                f"{row.duplicates_reworded} of them on operations asked again in other words."
            )
        if row.similar_replayed:
            lines.append(f"Similar: {row.similar_replayed} calls in other words got the earlier call's ticket.")
        if row.settled:
            lines.append("Settled: " + ", ".join(f"{n} {how}" for how, n in row.settled.items()) + ".")
        if row.reconciled:
            lines.append("Reconciler: " + ", ".join(f"{n} {what}" for what, n in row.reconciled.items()) + ".")
        console.print(" ".join(lines), highlight=False)
    for name, why in result.skipped.items():
        console.print(f"[bold]{name}[/bold]: not run: {escape(why)}.", highlight=False)  # why has "[similar]"
    console.print(
        "[dim]asked: tickets the agents asked for; calls: their tool calls, more than asked because a "
        "re-plan or a second agent asks again for a ticket already asked for. duplicates: tickets beyond the "
        "first of an operation, whatever their titles. A re-plan in other words (faults: reword) has another "
        "title, so another exact key: only onceonly+similar takes it for the same ticket; onceonly's "
        "duplicates are those. missing: operations with no ticket that were reported done or left "
        "unsettled. unsettled: operations whose outcome is unknown at the end. Latency: one call as its "
        "agent saw it, retries and waits included; onceonly's p99 is the price of knowing: a lost or late "
        "answer costs its call the timeout, then the settle wait, then a probe. The same seed gives the same "
        "counts; the latencies vary. docs/demo.md explains.[/dim]"
    )


COMMANDS = [demo]
