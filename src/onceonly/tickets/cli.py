"""``onceonly tickets``: serve the reference ticket service in the foreground.

Only click is imported here; FastAPI and uvicorn load when the command runs, so the rest of the CLI
starts fast and works without the ``server`` extra.
"""

from __future__ import annotations

import math
import sqlite3
import sys

import click

from onceonly._install import install_hint
from onceonly.stores import redact_url

__all__ = ["COMMANDS", "tickets"]


def _seconds(ctx: click.Context, param: click.Parameter, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise click.BadParameter(f"{value}: give a positive number of seconds")
    return value


@click.command("tickets")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="Port; 0 picks a free one (printed)."
)
@click.option("--db", default=".onceonly/tickets.db", show_default=True, help="The SQLite file of the tickets.")
@click.option("--no-idempotency", is_flag=True, help="No idempotency middleware: every POST creates a ticket.")
@click.option(
    "--idempotency-store",
    "store",
    default=None,
    metavar="URL",
    help="Keep keys in this onceonly store (store mode) instead of the tickets' own transaction.",
)
@click.option(
    "--fault",
    "faults",
    multiple=True,
    metavar="KIND=P",
    help="Inject a fault with probability P per POST /tickets; KIND is fail, crash, crash-after-commit, "
    "lost or delay. Repeat for several.",
)
@click.option("--seed", default=None, type=int, help="Seed of the fault draws: the same requests meet the same faults.")
@click.option("--delay-seconds", default=3.0, show_default=True, type=float, help="How long 'delay' holds an answer.")
@click.option(
    "--processing-timeout",
    default=30.0,
    show_default=True,
    type=float,
    callback=_seconds,
    help="Store mode: claim lease (s).",
)
@click.option("--no-admin", is_flag=True, help="Do not serve /admin/faults.")
@click.option(
    "--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"])
)
def tickets(
    host: str,
    port: int,
    db: str,
    no_idempotency: bool,
    store: str | None,
    faults: tuple[str, ...],
    seed: int | None,
    delay_seconds: float,
    processing_timeout: float,
    no_admin: bool,
    log_level: str,
) -> None:
    """Serve the reference ticket API (FastAPI, SQLite) with idempotency and fault injection."""
    try:
        from onceonly.tickets._serve import serve
        from onceonly.tickets.app import create_app
        from onceonly.tickets.faults import Faults
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        raise click.ClickException(
            f"onceonly tickets needs the server extra: {install_hint('server')} ({exc})"
        ) from exc
    from onceonly.errors import StoreError

    if no_idempotency and store:
        raise click.UsageError("--no-idempotency and --idempotency-store exclude each other")
    try:
        parsed = Faults.parse(faults, seed=seed, delay_seconds=delay_seconds)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from exc
    # Everything is opened and checked here, before "serving": a store or file the service cannot
    # use must stop the command, not answer 500 to every request.
    try:
        app = create_app(
            db,
            idempotency=not no_idempotency,
            store=store,
            faults=parsed,
            admin=not no_admin,
            processing_timeout=processing_timeout,
        )
    except StoreError as exc:
        raise click.ClickException(f"cannot open the store of --idempotency-store: {exc}") from exc
    except ValueError as exc:
        if store:  # the other settings were checked above: what is left is the store's URL
            raise click.BadParameter(str(exc), param_hint="'--idempotency-store'") from exc
        raise click.UsageError(str(exc)) from exc
    except (OSError, sqlite3.Error) as exc:
        raise click.ClickException(
            f"cannot open the ticket database {db!r}: {exc}: give the path of a SQLite file (or of a new one) "
            "that this user may write"
        ) from exc
    mode = "off" if no_idempotency else ("store " + redact_url(store) if store else "transactional")
    injected = ", ".join(f"{k}={v:g}" for k, v in parsed.to_dict().items() if k not in ("seed", "delay_seconds") and v)

    def ready(url: str) -> None:
        click.echo(f"onceonly tickets: serving on {url} (db={db}, idempotency={mode}, faults={injected or 'none'})")
        sys.stdout.flush()

    try:
        serve(app, host=host, port=port, log_level=log_level, on_ready=ready)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from exc


COMMANDS = [tickets]
