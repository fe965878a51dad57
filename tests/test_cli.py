"""The ``onceonly`` commands on a ledger (ls, show, resolve, stats, purge) as a person runs them: a
store that fails, a wrong URL and a bad option end in a message that says what is wrong, never in a
traceback, and a read never makes a ledger."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from onceonly import Ledger, State
from onceonly.cli import cli
from onceonly.stores.sqlite import parse_sqlite_url
from tests._settling import dead_holder


def _run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env)


def _said(result: Result, code: int, message: str) -> None:
    """The command ended with ``code`` and ``message``, through click (no traceback, no stray error)."""
    assert result.exit_code == code, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    assert message in result.output, result.output


def _with_one_record(url: str) -> str:
    with Ledger.open(url) as ledger:
        ledger.tool(name="charge")(lambda op: None)
        return dead_holder(ledger, "charge", "a").key


def test_store_errors_after_opening_are_messages(sqlite_url: str) -> None:
    """A ledger that opens but fails when read or written (here a SQLite table that lost its columns;
    the commands treat every store's errors alike) is reported by every command as the store's
    message, exit 1 (they used to print the traceback)."""
    key = _with_one_record(sqlite_url)
    path = parse_sqlite_url(sqlite_url)[0]
    conn = sqlite3.connect(path)
    conn.execute("ALTER TABLE onceonly_records RENAME TO damaged")
    conn.execute("CREATE TABLE onceonly_records (key TEXT PRIMARY KEY)")
    conn.commit()
    conn.close()
    for args in (["ls"], ["show", key], ["stats"], ["purge"], ["resolve", key, "--failed", "no"]):
        _said(_run(*args, "--url", sqlite_url), 1, "no such column")


def test_commands_refuse_a_sqlite_ledger_that_is_not_there(tmp_path: Path) -> None:
    """A SQLite URL whose file does not exist (a typo, the wrong directory) is refused as "no ledger
    at PATH" by ls, show, stats, resolve, purge and reconcile, from --url or $ONCEONLY_URL, and nothing is made
    (they used to make an empty ledger, and its directory, and report 0 records)."""
    missing = tmp_path / "nowhere" / "ledger.db"
    url = f"sqlite:///{missing}"
    cases = [["ls"], ["show", "k"], ["stats"], ["resolve", "k", "--failed", "no"], ["purge"], ["reconcile", "--once"]]
    for args in cases:
        _said(_run(*args, "--url", url), 1, f"no ledger at {missing}")
    _said(_run("ls", env={"ONCEONLY_URL": url}), 1, f"no ledger at {missing}")
    # reconcile too: run from cron, "nothing to settle" on a mistyped URL would pass for a quiet night.
    _said(_run("reconcile", "--once", env={"ONCEONLY_URL": url}), 1, f"no ledger at {missing}")
    assert not missing.parent.exists()


def test_listing_and_paging_sizes_are_checked(sqlite_url: str) -> None:
    """--limit and reconcile's --batch take 1 or more (and a sane most) as a usage error; a limit the
    database cannot hold used to end in a store error, a batch of 0 in a ValueError traceback."""
    _with_one_record(sqlite_url)
    for value in ("0", "-1", str(10**20)):
        _said(_run("ls", "--url", sqlite_url, "--limit", value), 2, "Invalid value for '--limit'")
        _said(_run("reconcile", "--url", sqlite_url, "--batch", value), 2, "Invalid value for '--batch'")
    result = _run("ls", "--url", sqlite_url, "--limit", "1", "--json")
    assert result.exit_code == 0, result.output


def test_resolve_reset_goes_with_failed_only(store_url: str) -> None:
    """--reset with --confirmed is a usage error, not silently dropped; the record is left as it was."""
    key = _with_one_record(store_url)
    _said(_run("resolve", key, "--url", store_url, "--confirmed", "1", "--reset"), 2, "--reset goes with --failed")
    with Ledger.open(store_url) as check:
        rec = check.get(key)
    assert rec is not None and rec.state is State.IN_FLIGHT


def test_missing_key_is_said_plainly(store_url: str) -> None:
    """A key that is not in the ledger: the message once, without the quotes of a KeyError's repr."""
    _with_one_record(store_url)
    result = _run("resolve", "no-such-key", "--url", store_url, "--failed", "no")
    _said(result, 1, "no record with key 'no-such-key'")
    assert result.output.startswith("Error: no record with key 'no-such-key': check it with `onceonly ls`")
    _said(_run("show", "no-such-key", "--url", store_url), 1, "Error: no record with key 'no-such-key'")


@pytest.mark.parametrize("command", ["ls", "stats"])
def test_read_commands_on_each_store(store_url: str, command: str) -> None:
    """On every store, the read commands still read: one record listed, one counted."""
    key = _with_one_record(store_url)
    result = _run(command, "--url", store_url, "--json")
    assert result.exit_code == 0, result.output
    assert key in result.output if command == "ls" else '"in_flight": 1' in result.output
