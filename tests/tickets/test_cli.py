"""``onceonly tickets`` refuses settings it cannot serve with before it says "serving": a bad store URL,
an unreachable store, a bad option, port or database file end the command with a clear message and
no traceback."""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from onceonly.tickets.cli import tickets


def _start(tmp_path: Path, *args: str) -> tuple[int, str]:
    """Run ``python -m onceonly.tickets`` with ``args``; its exit status and output. A service that
    says it is serving is stopped, and the test fails: the settings should have been refused."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceonly.tickets", "--port", "0", "--log-level", "warning", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    assert proc.stdout is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        first = proc.stdout.readline() if ready else ""
        if "serving" in first:
            pytest.fail(f"the service started with {args}: {first!r}")
        rest = proc.stdout.read()
        return proc.wait(30), first + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        proc.stdout.close()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        pytest.param(("--idempotency-store", "bogus://x"), "--idempotency-store", id="unknown-scheme"),
        pytest.param(("--idempotency-store", "sqlite:///keys.db?timeout=abc"), "timeout", id="bad-option"),
        pytest.param(("--idempotency-store", "redis://127.0.0.1:1/0"), "--idempotency-store", id="unreachable"),
        pytest.param(("--processing-timeout", "-1"), "--processing-timeout", id="negative-timeout"),
        pytest.param(("--processing-timeout", "nan"), "--processing-timeout", id="nan-timeout"),
    ],
)
def test_bad_store_or_option_is_refused_before_serving(tmp_path: Path, args: tuple[str, ...], says: str) -> None:
    """A store the service cannot use, or a setting the middleware refuses, stops the command at start
    with a message naming the option, instead of serving and answering 500 to every request."""
    code, output = _start(tmp_path, *args)
    assert code != 0
    assert says in output and "Error" in output
    assert "Traceback" not in output


@pytest.mark.parametrize("port", ["70000", "-1", "http"])
def test_bad_port_is_a_usage_error(port: str) -> None:
    """A port outside 0-65535 is a usage error, not an OverflowError from the socket."""
    result = CliRunner().invoke(tickets, ["--port", port])
    assert result.exit_code == 2, result.output
    assert "--port" in result.output
    assert "0<=x<=65535" in result.output or "is not a valid integer" in result.output


def test_bad_database_file_is_an_error(tmp_path: Path) -> None:
    """A --db that is not a SQLite file, or that cannot be made, ends the command with a message that
    names it, not a sqlite3 or OS traceback."""
    not_sqlite = tmp_path / "notes.txt"
    not_sqlite.write_text("not a database, " * 100)
    under_a_file = tmp_path / "notes.txt" / "tickets.db"
    for db in (not_sqlite, under_a_file):
        result = CliRunner().invoke(tickets, ["--port", "0", "--db", str(db)])
        assert result.exit_code == 1, result.output
        assert isinstance(result.exception, SystemExit)
        assert f"cannot open the ticket database {str(db)!r}" in result.output


def test_store_opened_from_a_url_is_closed_at_shutdown(tmp_path: Path) -> None:
    """``create_app(store=URL)`` opens the store at once (a bad one fails there) and closes it when the
    server shuts down."""
    from onceonly import StoreUnavailable
    from onceonly.tickets import create_app, serve_in_thread

    with pytest.raises(ValueError, match="no onceonly store"):
        create_app(tmp_path / "t.db", store="bogus://x")
    with serve_in_thread(create_app(tmp_path / "t.db", store=f"sqlite:///{tmp_path / 'keys.db'}")) as server:
        store = server.app.state.store  # type: ignore[attr-defined]
        assert store.get("x") is None
    with pytest.raises(StoreUnavailable):
        store.get("x")
    server.app.state.db.close()  # type: ignore[attr-defined]
