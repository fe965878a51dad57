"""What the ``onceonly`` commands share (needs the ``cli`` extra): option types, the checks made
before a command opens a ledger, and how text that came from a store or a user is printed."""

from __future__ import annotations

import inspect
import json
import os
import pkgutil
import re
import signal
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from types import FrameType
from typing import Any, Protocol
from urllib.parse import urlsplit

import click
from rich.text import Text

from onceonly._install import install_hint
from onceonly.errors import OnceOnlyError, StoreError
from onceonly.ledger import DEFAULT_URL, Ledger
from onceonly.stores._url import redact_url, scrub

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


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "": 1.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d|)\s*$")


def parse_duration(text: str) -> float:
    """Seconds in ``"30s"``, ``"5m"``, ``"1h"``, ``"250ms"``, ``"2d"`` or a plain number of seconds.

    .. versionadded:: 0.1
    """
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration: write 30s, 5m, 1h, 250ms or a number of seconds")
    return float(match.group(1)) * _UNITS[match.group(2)]


class Duration(click.ParamType):  # type: ignore[type-arg]
    """A click parameter: a duration such as ``30s``, in seconds. ``positive``: 0 is refused, with
    ``example`` in the message (the ``--every`` of a daemon, a period)."""

    name = "duration"

    def __init__(self, *, positive: bool = False, example: str = "30s") -> None:
        self.positive = positive
        self.example = example

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            seconds = float(value)
        else:
            try:
                seconds = parse_duration(str(value))
            except ValueError as exc:
                self.fail(str(exc), param, ctx)
        if self.positive and not seconds > 0:
            name = param.opts[0] if param is not None and param.opts else "this option"
            raise click.UsageError(f"{name} needs a positive duration, e.g. {self.example}", ctx)
        return seconds


class Since(click.ParamType):  # type: ignore[type-arg]
    """A click parameter: a moment, as a duration back from now (``1h``, ``2d``) or an ISO 8601 time
    (``2026-01-31``, ``2026-01-31T08:00:00Z``; without a zone: UTC); in seconds since the epoch."""

    name = "since"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, int | float):
            return float(value)
        text = str(value).strip()
        try:
            return time.time() - parse_duration(text)
        except ValueError:
            pass
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            self.fail(f"{text!r} is neither a duration (1h, 2d) nor an ISO time (2026-01-31T08:00:00Z)", param, ctx)
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return moment.timestamp()


@contextmanager
def until_stopped() -> Iterator[Callable[[], bool]]:
    """For a command that runs until told to stop: yields ``stopping()``, true once SIGTERM arrived;
    Ctrl-C ends the block quietly (exit 0). The previous SIGTERM handler is put back on the way out."""
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield lambda: stopping
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_every(every: float, once: Callable[[], None]) -> None:
    """Call ``once()`` every ``every`` seconds until SIGTERM or Ctrl-C (then return: exit 0). A run
    that raises ends the loop with its error, as a single run would."""
    with until_stopped() as stopping:
        while not stopping():
            began = time.monotonic()
            once()
            # Short naps, so that SIGTERM ends the loop within a fraction of a second.
            while not stopping() and (rest := every - (time.monotonic() - began)) > 0:
                time.sleep(min(rest, 0.25))


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
    """Refuse a ledger that is not there (``url`` None: what ``Ledger.open()`` would open), looking
    without writing: a SQLite file that is missing or not an onceonly ledger, a Redis prefix without
    the ledger's metadata, a PostgreSQL schema without the ledger's tables.

    Opening such a store makes an empty ledger (a file and its directory, a Redis ``meta`` with this
    URL's shard count, a schema named after a typo) and reports no records or nothing to settle: a
    wrong --url or $ONCEONLY_URL would pass for an empty ledger, and leave something behind. A ledger
    that is there is opened without a write (``open_as_is``: a SQLite file of an older schema too).
    """
    url = url or os.environ.get("ONCEONLY_URL") or DEFAULT_URL
    scheme = urlsplit(url).scheme.lower()
    try:
        if scheme == "sqlite":
            _sqlite_ledger(url)
        elif scheme in ("redis", "rediss", "unix"):
            _redis_ledger(url)
        elif scheme in ("postgres", "postgresql", "postgresql+psycopg"):
            _postgres_ledger(url)
    except ValueError as exc:  # a bad option in the URL: the store says which, URL masked
        raise click.ClickException(printable(exc)) from exc


def open_as_is(url: str) -> Ledger:
    """The ledger at ``url`` for a command that only reads it: a SQLite file of an older schema is read
    as it is, not brought up to this onceonly's (the app does that when it opens it)."""
    if urlsplit(url).scheme.lower() == "sqlite":
        from onceonly.stores.sqlite import SQLiteStore

        return Ledger(SQLiteStore(url, upgrade=False))
    return Ledger.open(url)


_RUN_ONCE = "give the ledger's URL with --url or $ONCEONLY_URL (a ledger is made when the app opens it: Ledger.open)"


def _sqlite_ledger(url: str) -> None:
    from onceonly.stores.sqlite import APPLICATION_ID, parse_sqlite_url

    path = parse_sqlite_url(url)[0]
    if not path.is_file():
        raise click.ClickException(printable(f"no ledger at {path.absolute()}: {_RUN_ONCE}"))
    try:
        # Read-only: a file that is not a ledger must be left exactly as it was.
        conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode=ro", uri=True)
        try:
            app_id, version = conn.execute(
                "SELECT (SELECT application_id FROM pragma_application_id), "
                "(SELECT user_version FROM pragma_user_version)"
            ).fetchone()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise click.ClickException(printable(f"cannot read the ledger file {path.absolute()}: {exc}")) from exc
    if app_id != APPLICATION_ID:
        raise click.ClickException(printable(f"{path.absolute()} is not an onceonly ledger: {_RUN_ONCE}"))
    if version < 1:
        raise click.ClickException(printable(f"{path.absolute()} is not an onceonly ledger yet: {_RUN_ONCE}"))


def _extra(name: str, url: str, exc: ImportError) -> click.ClickException:
    """A store's driver that is not installed: name the extra that brings it, as the library does."""
    missing = f"no module named {exc.name!r}" if exc.name else str(exc)
    return click.ClickException(
        printable(f"{redact_url(url)!r} needs the {name} extra: {install_hint(name)} ({missing})")
    )


def _redis_ledger(url: str) -> None:
    try:
        import redis

        from onceonly.stores.redis import parse_redis_url
    except ImportError as exc:
        raise _extra("redis", url, exc) from exc

    client_url, opts = parse_redis_url(url)
    shown = redact_url(url)
    meta = f"{opts['prefix']}:meta"
    client = redis.Redis.from_url(client_url)
    try:
        found = client.exists(meta)
    except redis.RedisError as exc:
        raise click.ClickException(printable(f"cannot read {shown}: {scrub(str(exc), url)}")) from exc
    finally:
        client.close()
    if not found:
        raise click.ClickException(printable(f"no ledger under prefix {opts['prefix']!r} in {shown}: {_RUN_ONCE}"))


def _postgres_ledger(url: str) -> None:
    try:
        import psycopg

        from onceonly.stores.postgres import SCHEMA_VERSION, parse_postgres_url
    except ImportError as exc:
        raise _extra("postgres", url, exc) from exc

    options = parse_postgres_url(url)
    shown = redact_url(url)
    s = '"' + options.schema + '"'
    try:
        with psycopg.connect(options.conninfo, autocommit=True) as conn:
            row = conn.execute(
                "SELECT to_regclass(%s) IS NOT NULL AND to_regclass(%s) IS NOT NULL",
                (f"{s}.onceonly_schema", f"{s}.onceonly_records"),
            ).fetchone()
            if not (row and row[0]):
                raise click.ClickException(printable(f"no ledger in schema {options.schema!r} of {shown}: {_RUN_ONCE}"))
            version = conn.execute(f"SELECT max(version) FROM {s}.onceonly_schema").fetchone()
    except psycopg.Error as exc:
        raise click.ClickException(printable(f"cannot read {shown}: {scrub(str(exc), url).strip()}")) from exc
    if version is None or version[0] is None or int(version[0]) < SCHEMA_VERSION:
        raise click.ClickException(
            printable(
                f"schema {options.schema!r} of {shown} holds a ledger of an older onceonly: open it once "
                "with your app to upgrade it"
            )
        )


def _app_failed(spec: str, exc: Exception) -> ImportError:
    if isinstance(exc, StoreError):
        # The app opened its ledger while it was imported, and the store did not answer: the app is fine.
        return ImportError(
            f"--app {spec!r}: the app's ledger store failed while the app was imported (it opens its ledger "
            f"then): {str(exc).rstrip('. ')}. Bring the store up or fix its URL, then run again"
        )
    return ImportError(
        f"--app {spec!r}: importing the app failed: {type(exc).__name__}: {exc} (fix the app, or name another)"
    )


def load_ledger(spec: str, app_dir: str | None = ".") -> Ledger:
    """Import the user's ledger from ``module:attribute``, as uvicorn imports an app.

    Importing the module registers its tools on the ledger, so the reconciler knows how each tool
    settles. The attribute may be a ``Ledger`` or a function of no arguments that returns one.

    Args:
        spec: ``package.module:attribute`` (dots in the attribute reach nested objects).
        app_dir: a directory put first on ``sys.path`` (default: the current one), or ``None``.

    Raises:
        ValueError: the spec is malformed or names nothing.
        TypeError: it names something that is not a ledger.
        ImportError: the module cannot be imported, or importing it (or calling the factory) raised:
            the message says which and why, the app's own error is its cause.

    .. versionadded:: 0.1
    """
    module_name, sep, attr = spec.partition(":")
    names = f"{module_name}.{attr}".split(".")
    if not sep or not all(name.isidentifier() for name in names):
        raise ValueError(f"--app {spec!r}: use module:attribute, e.g. myapp.tools:ledger")
    if app_dir is not None:
        path = os.path.abspath(app_dir)
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        obj: Any = pkgutil.resolve_name(spec)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise ImportError(
                f"--app {spec!r}: no module {module_name!r} on the path (run from its directory, or pass --app-dir)"
            ) from exc
        raise _app_failed(spec, exc) from exc  # the app itself imports something that is missing
    except AttributeError as exc:
        if exc.name not in attr.split("."):
            raise _app_failed(spec, exc) from exc  # raised while importing the app, not a missing name
        raise ValueError(f"--app {spec!r}: {module_name} has no attribute {attr!r}") from None
    except Exception as exc:  # importing the app runs its code: whatever that raises is the app's
        raise _app_failed(spec, exc) from exc
    if not isinstance(obj, Ledger) and callable(obj):
        try:
            inspect.signature(obj).bind()
        except TypeError:
            raise TypeError(
                f"--app {spec!r} is a function that needs arguments: name a Ledger, or a factory that takes none"
            ) from None
        except ValueError:
            pass  # no signature to check (a builtin): just call it
        try:
            obj = obj()
        except Exception as exc:
            raise _app_failed(spec, exc) from exc
    if not isinstance(obj, Ledger):
        raise TypeError(f"--app {spec!r} is a {type(obj).__name__}, not an onceonly.Ledger")
    return obj


def load_app(spec: str, app_dir: str) -> Ledger:
    """``load_ledger`` for the command line: its errors say what to do, and become the message."""
    try:
        return load_ledger(spec, app_dir)
    except (ValueError, TypeError, ImportError) as exc:
        raise click.ClickException(printable(exc)) from exc


def url_option(
    help: str = "The ledger: sqlite:///path.db, redis://host:6379/0, postgresql://host/db.",
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The ``--url`` option of a command that works on one ledger: ``$ONCEONLY_URL``, else the default file."""
    return click.option("--url", envvar="ONCEONLY_URL", default=DEFAULT_URL, show_default=True, help=help)


def fail(exc: Exception) -> click.ClickException:
    """An error as the command's message, not a traceback."""
    # str() of a KeyError is the repr of its message, quoted: show the message itself.
    text = exc.args[0] if isinstance(exc, LookupError) and exc.args else exc
    return click.ClickException(printable(text))


@contextmanager
def existing_ledger(url: str) -> Iterator[Ledger]:
    """The ledger at ``url``, read as it is, closed afterwards; an error opening it becomes the message.

    A SQLite file that is not there is refused: opening it would make an empty ledger (and its
    directory) and report no records, hiding a wrong --url.
    """
    try:
        refuse_missing_ledger(url)
        ledger = open_as_is(url)
    except (OnceOnlyError, ValueError, ImportError) as exc:
        raise fail(exc) from exc
    try:
        yield ledger
    finally:
        ledger.close()


#: The exit status of a command ended by Ctrl-C (128 + SIGINT), after its partial report.
INTERRUPTED_EXIT = 130


class Done(Protocol):
    """``done(n)``: ``n`` are done; ``done(n, total)`` also moves the bar's end (work found as it goes)."""

    def __call__(self, n: int, total: int | None = None) -> None: ...


def _nothing(n: int, total: int | None = None) -> None:
    pass


@contextmanager
def progress_bar(what: str, total: int | None, *, enabled: bool = True) -> Iterator[Done]:
    """A rich progress bar on stderr while the block runs, only when stderr is a terminal and
    ``enabled`` (not with --json): yields ``done(n)``. ``total`` None: a count without a bar's end.
    It disappears when the block ends, so that the report is what stays on the screen."""
    if not enabled or not sys.stderr.isatty():
        yield _nothing
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = [SpinnerColumn(), TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(what, total=total)

        def done(n: int, total: int | None = None) -> None:
            bar.update(task, completed=n, total=total)  # total None: the end stays where it was

        yield done
