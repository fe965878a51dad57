"""The ``onceonly`` commands on a ledger (ls, show, resolve, stats, purge) as a person runs them: a
store that fails, a wrong URL and a bad option end in a message that says what is wrong, never in a
traceback, and a read never makes a ledger."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner, Result

from onceonly import Ledger, State
from onceonly.cli import cli
from onceonly.states import Record
from onceonly.stores.sqlite import parse_sqlite_url
from tests._settling import dead_holder
from tests._urls import SECRET, with_password
from tests._workers import run_until_printed
from tests.conftest import RUN_ID


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
    assert result.output.startswith(
        "Error: no record with key 'no-such-key' (nor a key starting with it): check it with `onceonly ls`"
    )
    _said(_run("show", "no-such-key", "--url", store_url), 1, "Error: no record with key 'no-such-key'")


@pytest.mark.parametrize("command", ["ls", "stats"])
def test_read_commands_on_each_store(store_url: str, command: str) -> None:
    """On every store, the read commands still read: one record listed, one counted."""
    key = _with_one_record(store_url)
    result = _run(command, "--url", store_url, "--json")
    assert result.exit_code == 0, result.output
    assert key in result.output if command == "ls" else '"in_flight": 1' in result.output


# --- what the commands print: no password, stored text as text ----------------------------------------


def _networked(store_url: str) -> None:
    if store_url.startswith("sqlite"):
        pytest.skip("a SQLite URL has no password")


def test_store_urls_are_shown_without_their_password(store_url: str) -> None:
    """ls and stats name the store in their titles, and a bad option or an unknown scheme is refused
    naming the URL: each shows it with the password masked (a user part or ``?password=``), and the
    host still there (they used to print the URL as given)."""
    _networked(store_url)
    _with_one_record(store_url)
    host = str(urlsplit(store_url).hostname)
    for url in (with_password(store_url), f"{store_url}&password={SECRET}"):
        for command in ("ls", "stats"):
            result = _run(command, "--url", url, env={"COLUMNS": "300"})
            assert result.exit_code == 0, result.output
            shown = re.sub(r"\s+", "", result.output)  # a title wraps at the table's width
            assert SECRET not in shown and "***" in shown and host in shown, result.output
    bad = "shards=0" if store_url.startswith("redis") else "pool_max_size=0"
    for args in (["ls"], ["stats"], ["purge"], ["show", "k"], ["reconcile", "--once"]):
        for url in (with_password(store_url) + f"&{bad}", f"{store_url}&password={SECRET}&{bad}"):
            result = _run(*args, "--url", url)
            _said(result, 1, host)
            assert SECRET not in result.output, result.output


def test_unknown_store_urls_are_shown_without_their_password() -> None:
    """A URL of no onceonly store, given to the commands that open one (the demo too), is refused with
    its password masked (the message used to repeat it as given)."""
    url = f"mysql://root:{SECRET}@db.example/x"
    demo = ["demo", "--strategy", "onceonly", "--ops", "1", "--agents", "1"]
    for args in (["ls"], ["stats"], ["reconcile", "--once"], demo):
        result = _run(*args, "--url", url)
        _said(result, 1, "no onceonly store for 'mysql://root:***@db.example/x'")
        assert SECRET not in result.output, result.output


def test_tickets_serving_line_hides_the_store_password(redis_base_url: str, tmp_path: Path) -> None:
    """`onceonly tickets --idempotency-store URL` says where it serves and which store it uses, with
    the store's password masked (it used to print the URL as given)."""
    url = with_password(redis_base_url) + f"?prefix=onceonly-test-{RUN_ID}-tickets-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "out.txt"
    args = ["-m", "onceonly.tickets", "--port", "0", "--db", str(tmp_path / "t.db"), "--idempotency-store", url]
    with out.open("w") as sink:
        proc = subprocess.Popen([sys.executable, *args], stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "serving on" not in out.read_text() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = out.read_text()
    assert "serving on" in text, text
    assert SECRET not in text and f"store redis://:***@{urlsplit(url).netloc.rpartition('@')[2]}" in text, text


# Markup rich would act on (a closing tag with no opening one made rich raise; an emoji code), and
# terminal controls: colour, a window title, an 8-bit CSI, a right-to-left override, a carriage return.
HOSTILE = "[/oops] [bold]b[/bold] :smile: \x1b[31mred\x1b[0m \x1b]0;title\x07 \x9b2J \u202eevil\r\nend"
_CONTROLS = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")  # the newline ends lines


def _plant(url: str, key: str, state: State, **fields: Any) -> Record:
    """A record written straight to the store, as another program (or a tool's error) could leave it."""
    old = time.time() - 1000
    rec = Record(
        key=key, scope="default", tool=f"tool {HOSTILE}", fingerprint="f", state=state, attempts=1,
        created_at=old, updated_at=old, error=f"error {HOSTILE}", args_json=json.dumps({"op": HOSTILE}), **fields,
    )  # fmt: skip
    with Ledger.open(url) as ledger:
        assert ledger.store.insert(rec)
    return rec


def _plain(result: Result, code: int = 0) -> str:
    """The output of a command that ended with ``code`` (0: it succeeded) and printed no terminal control."""
    assert result.exit_code == code, (result.output, result.exception)
    assert not _CONTROLS.search(result.output), repr(result.output)
    return result.output


def test_stored_text_is_shown_as_text(sqlite_url: str) -> None:
    """Keys, tools, errors, args and results holding rich markup and terminal controls: ls, show,
    resolve and reconcile (table and JSON) print the markup as written and the controls as visible
    escapes, never raw (rich markup in an error crashed ls and reconcile, and C1 controls went out raw)."""
    failed = _plant(sqlite_url, "k-[/oops]-failed", State.FAILED)
    _plant(sqlite_url, "k-[/oops]-unknown", State.UNKNOWN)
    _plant(sqlite_url, "k-[/oops]-held", State.IN_FLIGHT, lease_owner="dead:1:1", lease_until=time.time() - 900)
    wide = {"COLUMNS": "400"}

    listed = _plain(_run("ls", "--url", sqlite_url, "--wide", env=wide))
    for shown in (
        "k-[/oops]-failed",
        "[bold]b[/bold] :smile:",
        "\\x1b[31mred\\x1b[0m",
        "\\x9b2J",
        "\\u202eevil\\r\\nend",
    ):
        assert shown in listed, listed

    assert "k-[/oops]-failed" in _plain(_run("show", failed.key, "--url", sqlite_url))
    shown = _plain(_run("show", failed.key, "--url", sqlite_url, "--json"))
    assert json.loads(shown)["error"] == f"error {HOSTILE}" and json.loads(shown)["args"] == {"op": HOSTILE}

    assert _plain(_run("resolve", failed.key, "--url", sqlite_url, "--confirmed", json.dumps(HOSTILE))).startswith(
        "k-[/oops]-failed: confirmed"
    )
    assert json.loads(_plain(_run("show", failed.key, "--url", sqlite_url, "--json")))["result"] == HOSTILE

    by = "[/me] \x1b[2J"
    # Exit 3: the records have no tool registered here, and stay unsettled.
    report = _plain(
        _run("reconcile", "--once", "-v", "--url", sqlite_url, "--review-after", "0", "--by", by, env=wide), 3
    )
    assert "k-[/oops]-unknown" in report and "reconcile by [/me] \\x1b[2J" in report, report
    runs = _plain(_run("reconcile", "--once", "--json", "--url", sqlite_url, "--by", by), 3)
    assert json.loads(runs.splitlines()[-1])["by"] == by


def test_reconcile_every_survives_stored_markup(sqlite_url: str, tmp_path: Path) -> None:
    """`reconcile --every` keeps running over a record whose tool name and error hold markup and
    controls, and stops cleanly on SIGTERM (the first report used to crash the daemon)."""
    _plant(sqlite_url, "k-[/oops]", State.UNKNOWN)
    out = tmp_path / "out.txt"
    args = ["-c", "from onceonly.cli import main; main()", "reconcile", "--url", sqlite_url, "--every", "0.1s", "-v"]
    code = run_until_printed(
        [sys.executable, *args], out, "reconciled", 2, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "400"}
    )
    text = out.read_text()
    assert code == 0, text
    assert text.count("reconciled 1 record(s)") >= 2 and "k-[/oops]" in text and "\\x1b[31m" in text, text
    assert not _CONTROLS.search(text), repr(text)


@pytest.mark.parametrize(
    "value", ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", '{"total": [1, NaN]}', '{"\\ud800": 1}', '"a\\udfff"']
)
def test_resolve_refuses_json_that_is_not_strict(sqlite_url: str, value: str) -> None:
    """--confirmed NaN (or Infinity, a number too large for a double, an escaped lone surrogate) is a
    usage error that says the result must be strict JSON; the record is left as it was (it used to be
    confirmed, with a description of the value stored as its result)."""
    key = _with_one_record(sqlite_url)
    _said(_run("resolve", key, "--url", sqlite_url, "--confirmed", value), 2, "not strict JSON")
    with Ledger.open(sqlite_url) as check:
        rec = check.get(key)
    assert rec is not None and rec.state is State.IN_FLIGHT
