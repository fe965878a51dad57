"""Operating a ledger from the command line, on every store: `ls` pages, filters and summarises,
`show` takes a unique prefix and prints a timeline, `stats` measures durations and suggests a timeout,
`audit` checks settled records against the business, the read commands never make or change a ledger,
and `purge`/`reconcile` run as scheduled processes with exit codes a script can test."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner, Result

from onceonly import Ledger, State, ops
from onceonly.cli import cli
from onceonly.states import Record
from tests._redis_server import PrivateRedis
from tests._workers import run_until_printed
from tests.conftest import POSTGRES_URL, join_url, require_driver

ONCEONLY = str(Path(sys.executable).parent / "onceonly")
WIDE = {"COLUMNS": "300"}


def _run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env)


def _ok(result: Result, code: int = 0) -> str:
    assert result.exit_code == code, (result.output, result.exception)
    return result.output


def _charges(url: str, *, orders: int = 5) -> Ledger:
    """A ledger with ``orders`` confirmed charges and one refund whose outcome was lost (a read
    timeout), parked for review."""
    ledger = Ledger.open(url)

    @ledger.tool(name="charge")
    def charge(order: str, amount: int) -> dict[str, Any]:
        return {"charged": order}

    @ledger.tool(name="refund", on_unknown="review")
    def refund(order: str) -> None:
        raise TimeoutError("read timed out")

    for n in range(1, orders + 1):
        charge(f"o-{n}", 10 * n)
    with pytest.raises(Exception, match="unknown"):
        refund("o-1")
    return ledger


def _insert(url: str, key: str, state: State, **fields: Any) -> Record:
    old = time.time() - 7200
    values: dict[str, Any] = {
        "key": key, "scope": "default", "tool": "charge", "fingerprint": "f", "state": state, "attempts": 1,
        "created_at": old, "updated_at": old, "args_json": json.dumps({"order": key}),
    }  # fmt: skip
    values.update(fields)
    rec = Record(**values)
    with Ledger.open(url) as ledger:
        assert ledger.store.insert(rec)
    return rec


def test_an_unknown_outcome_keeps_its_error_message(store_url: str) -> None:
    """A call whose outcome is lost to a read timeout keeps "TimeoutError: read timed out" as its
    record's error, through to needs_review (only the type was kept, in the history)."""
    with _charges(store_url, orders=0) as ledger:
        (rec,) = ledger.list(state="needs_review")
    assert rec.error == "TimeoutError: read timed out"


def test_ls_pages_filters_and_summarises(store_url: str) -> None:
    """ls shows a page and says how many more match and how to list them; the next page follows
    from --after; --state/--tool/--scope/--since filter; each row has the arguments, the error
    message and the conflicts; keys are shortened to a prefix no other key has; --json pages too."""
    with _charges(store_url) as ledger:
        keys = [r.key for r in ledger.list(limit=100)]
    with Ledger.open(store_url, scope="night") as other:
        other.tool(name="charge")(lambda order, amount: None)("o-9", 90)
    _insert(store_url, "zz-old-duplicate", State.CONFIRMED, conflicts=2, via="run")

    first = json.loads(_ok(_run("ls", "--url", store_url, "--limit", "2", "--json")))
    assert len(first["records"]) == 2 and first["more"] == 6 and first["next_after"] == first["records"][1]["key"]
    text = _ok(_run("ls", "--url", store_url, "--limit", "2", env=WIDE))
    assert f"6 more — next: onceonly ls --after {first['next_after']}" in text, text
    rest = json.loads(_ok(_run("ls", "--url", store_url, "--after", first["next_after"], "--json")))
    assert len(rest["records"]) == 6 and rest["more"] == 0 and rest["next_after"] is None
    listed = [r["key"] for r in first["records"] + rest["records"]]
    assert listed == sorted(set(listed)) and set(keys) <= set(listed)

    review = _ok(_run("ls", "--url", store_url, "--state", "needs_review", env=WIDE))
    assert 'order="o-1"' in review and "TimeoutError: read timed out" in review, review
    assert "more" not in review
    assert (
        json.loads(_ok(_run("ls", "--url", store_url, "--tool", "refund", "--json")))["records"][0]["tool"] == "refund"
    )
    scoped = json.loads(_ok(_run("ls", "--url", store_url, "--scope", "night", "--json")))["records"]
    assert [r["args"] for r in scoped] == [{"order": "o-9", "amount": 90}]
    recent = json.loads(_ok(_run("ls", "--url", store_url, "--since", "1h", "--json")))["records"]
    assert "zz-old-duplicate" not in [r["key"] for r in recent] and len(recent) == 7
    assert len(json.loads(_ok(_run("ls", "--url", store_url, "--since", "2000-01-01", "--json")))["records"]) == 8
    assert "2 CONFLICT(S)" in _ok(_run("ls", "--url", store_url, "--after", "z", env=WIDE))

    # At 80 columns: the keys as prefixes that `show` takes, never folded over lines.
    narrow = _ok(_run("ls", "--url", store_url, "--state", "confirmed", env={"COLUMNS": "80"}))
    assert all(len(line) <= 80 for line in narrow.splitlines()), narrow
    shown = [line.split()[0] for line in narrow.splitlines() if line.startswith("default:")]
    assert len(shown) == 5 and all(key not in narrow for key in keys), narrow
    for prefix in shown:
        assert json.loads(_ok(_run("show", prefix, "--url", store_url, "--json")))["key"].startswith(prefix)
    wide = _ok(_run("ls", "--url", store_url, "--wide", env=WIDE))
    assert all(key in wide for key in keys)


def test_ls_and_show_in_a_process_of_their_own(store_url: str) -> None:
    """The installed `onceonly` script lists and shows a record, from $ONCEONLY_URL."""
    with _charges(store_url, orders=1) as ledger:
        (rec,) = ledger.list(state="needs_review")
    env = {**os.environ, "ONCEONLY_URL": store_url, "COLUMNS": "200"}
    listed = subprocess.run([ONCEONLY, "ls"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert listed.returncode == 0 and "needs_review" in listed.stdout, listed.stderr
    shown = subprocess.run(
        [ONCEONLY, "show", rec.key[:24]], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert shown.returncode == 0 and rec.key in shown.stdout, shown.stderr


def test_show_takes_a_prefix_and_prints_a_timeline(store_url: str) -> None:
    """show finds a record by a prefix only it starts with, refuses one several keys start with
    (saying so), and prints the arguments, the error message and the history with ISO times;
    resolve --json prints the settled record."""
    with _charges(store_url, orders=2) as ledger:
        (parked,) = ledger.list(state="needs_review")
    text = _ok(_run("show", parked.key[:-20], "--url", store_url))
    assert parked.key in text and '{"order": "o-1"}' in text and "TimeoutError: read timed out" in text
    timeline = [line for line in text.splitlines() if re.match(r"^  \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line)]
    assert len(timeline) == 3, text
    assert "(new) → in_flight" in timeline[0] and "unknown → needs_review" in timeline[2]
    assert re.search(r"\+\d+\.\d{3}s", timeline[1]), timeline
    data = json.loads(_ok(_run("show", parked.key, "--url", store_url, "--json")))
    assert all(re.match(r"\d{4}-.*Z$", entry["at_iso"]) for entry in data["history"])
    resolved = _run("resolve", parked.key, "--failed", "refused", "--by", "ops", "--url", store_url, "--json")
    settled = json.loads(_ok(resolved))
    assert settled["state"] == "failed" and settled["history"][-1]["by"] == "ops" and "at_iso" in settled["history"][-1]
    result = _run("show", "default:charge:", "--url", store_url)
    assert result.exit_code == 2 and "starts several keys" in result.output, result.output
    result = _run("show", "default:nothing", "--url", store_url)
    assert result.exit_code == 1 and "no record with key 'default:nothing'" in result.output


# --- stats ------------------------------------------------------------------------------------------


def test_stats_times_each_tool_and_suggests_a_timeout(store_url: str) -> None:
    """stats counts by state and tool, names the oldest unsettled record, counts conflicts, and gives
    each tool's p50/p95/p99 call duration (measured from the records' own histories) with a timeout
    of 1.5-2x the p99; --counts gives the same counts per state from the store's counters."""
    with Ledger.open(store_url) as ledger:

        @ledger.tool(name="slow")
        def slow(n: int) -> int:
            time.sleep(0.03)
            return n

        for n in range(5):
            slow(n)
    _insert(store_url, "held-long-ago", State.UNKNOWN)
    _insert(store_url, "dup", State.CONFIRMED, conflicts=1, via="run")
    data = json.loads(_ok(_run("stats", "--url", store_url, "--json")))
    assert data["states"]["confirmed"] == 6 and data["states"]["unknown"] == 1 and data["total"] == 7
    assert data["oldest_unsettled"]["key"] == "held-long-ago" and data["oldest_unsettled"]["age_seconds"] > 7000
    assert data["conflicts"] == 1
    (timed,) = [t for t in data["tools"] if t["tool"] == "slow"]
    assert timed["attempts_timed"] == 5 and 0.03 <= timed["p50"] <= timed["p95"] <= timed["p99"] < 1
    assert 1.5 * timed["p99"] <= timed["suggested_timeout"] <= 2.2 * timed["p99"]
    counted = json.loads(_ok(_run("stats", "--url", store_url, "--counts", "--json")))
    assert counted["states"] == data["states"] and counted["total"] == 7
    text = _ok(_run("stats", "--url", store_url, "--wide", env=WIDE))
    assert "oldest unsettled: held-long-ago" in text and "slow" in text


def test_suggested_timeouts_are_round_and_in_the_range() -> None:
    """1.5-2x the p99, rounded up to two significant digits; never below 10 ms."""
    for p99 in (0.0001, 0.004, 0.123, 0.9, 1.0, 2.5, 37.0):
        got = ops.suggest_timeout(p99)
        assert got >= 0.01 and (got == 0.01 or 1.5 * p99 <= got <= 2.1 * p99), (p99, got)
    assert ops.suggest_timeout(0.123) == 0.25 and ops.suggest_timeout(2.5) == 3.8


# --- audit ------------------------------------------------------------------------------------------

AUDIT_APP = """
    import json
    from pathlib import Path
    from onceonly import NOT_FOUND, Ledger

    ledger = Ledger.open({url!r})
    BUSINESS = Path({business!r})

    def look(args, key):
        done = json.loads(BUSINESS.read_text())
        return {{"charged": args["order"]}} if args["order"] in done else NOT_FOUND

    @ledger.tool(probe=look)
    def charge(order: str) -> dict:
        done = json.loads(BUSINESS.read_text())
        BUSINESS.write_text(json.dumps(done + [order]))
        return {{"charged": order}}
"""


@pytest.fixture(name="audit_app")
def fixture_audit_app(tmp_path: Path) -> Iterator[Any]:
    """Write an app module whose probe reads a JSON list of the orders the business has (tmp_path /
    "business.json", empty at first); ``make(url)`` gives its ``module:ledger``. Forget it after."""
    made: list[str] = []
    business = tmp_path / "business.json"
    business.write_text("[]")

    def make(url: str) -> str:
        name = f"audit_app_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(AUDIT_APP.format(url=url, business=str(business))))
        made.append(name)
        return f"{name}:ledger"

    yield make
    for name in made:
        sys.modules.pop(name, None)


def test_audit_finds_planted_disagreements(
    store_url: str, audit_app: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A confirmed charge the business does not have, and a failed one it has, are reported (exit 3,
    an AuditDisagreement warning each); once the business agrees, audit exits 0. It writes nothing."""
    business = tmp_path / "business.json"
    with Ledger.open(store_url) as setup:
        _insert(store_url, "kept", State.CONFIRMED, via="run", args_json='{"order": "o-1"}')
        _insert(store_url, "lost", State.CONFIRMED, via="run", args_json='{"order": "o-2"}')
        _insert(store_url, "undone", State.FAILED, error="declined", args_json='{"order": "o-3"}')
        _insert(store_url, "other", State.CONFIRMED, tool="email", args_json='{"to": "x"}')
        before = {r.key: r for r in setup.list(limit=100)}
    business.write_text(json.dumps(["o-1", "o-3"]))

    def audit(*more: str, code: int = 0, env: dict[str, str] | None = None) -> str:
        # Each run imports the app anew, as a process of its own would (the command closes its ledger).
        app = audit_app(store_url)
        return _ok(_run("audit", "--app", app, "--app-dir", str(tmp_path), *more, env=env), code)

    with caplog.at_level(logging.WARNING, logger="onceonly.alerts"):
        result = _run("audit", "--app", audit_app(store_url), "--app-dir", str(tmp_path), "--json")
    report = json.loads(_ok(result, 3))
    assert report["checked"] == 3 and report["agreed"] == 1 and report["without_probe"] == {"email": 1}
    assert {(d["key"], d["finding"]) for d in report["disagreements"]} == {("lost", "missing"), ("undone", "found")}
    events = [r.onceonly["event"] for r in caplog.records if hasattr(r, "onceonly")]  # type: ignore[attr-defined]
    assert events == ["AuditDisagreement", "AuditDisagreement"]
    assert "lost" in audit(code=3, env=WIDE)
    with Ledger.open(store_url) as check:
        assert {r.key: r for r in check.list(limit=100)} == before

    business.write_text(json.dumps(["o-1", "o-2"]))
    assert "3 agree, 0 disagree" in audit("--tool", "charge", "--since", "3h")
    assert json.loads(audit("--since", "1h", "--json"))["checked"] == 0


# --- read commands never make or change a ledger -----------------------------------------------------


def _read_everything(url: str, key: str, app: str, app_dir: Path) -> None:
    for args in (["ls"], ["ls", "--json"], ["show", key], ["show", key[:20], "--json"], ["stats"], ["stats", "--json"]):
        _ok(_run(*args, "--url", url))
    # The business (an empty list) has none of the charges: audit reports them, and writes nothing.
    _ok(_run("audit", "--app", app, "--app-dir", str(app_dir), "--url", url), 3)


def _refused(url: str, message: str) -> None:
    for args in (["ls"], ["show", "k"], ["stats"], ["purge"], ["resolve", "k", "--failed", "x"]):
        result = _run(*args, "--url", url)
        assert result.exit_code == 1 and message in result.output, (args, result.output)


def test_reads_leave_a_redis_db_as_it_was(tmp_path: Path, audit_app: Any) -> None:
    """On a Redis server of its own: ls, show, stats and audit leave every key of the db byte for byte
    (DUMP) as it was; a prefix with no ledger is refused, and nothing is written (no meta made)."""
    require_driver("redis")
    import redis

    server = PrivateRedis(tmp_path).start()
    try:
        url = f"{server.url}?prefix=shop"
        app = audit_app(url)
        with _charges(url) as ledger:
            key = ledger.list(limit=1)[0].key
        client = redis.Redis.from_url(server.url)

        def snapshot() -> dict[bytes, bytes | None]:
            return {k: client.dump(k) for k in sorted(client.keys("*"))}

        before = snapshot()
        _read_everything(url, key, app, tmp_path)
        assert snapshot() == before
        _refused(f"{server.url}?prefix=shpo&shards=32", "no ledger under prefix 'shpo'")
        assert snapshot() == before
        client.close()
    finally:
        server.stop()


def test_reads_leave_a_postgres_database_as_it_was(tmp_path: Path, audit_app: Any) -> None:
    """In a PostgreSQL database of its own: ls, show, stats and audit leave its schemas, tables and
    the ledger's rows as they were; a schema with no ledger (a typo) is refused, and none is made."""
    require_driver("postgres")
    import psycopg

    name = f"onceonly_ops_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        db = urlsplit(POSTGRES_URL)._replace(path=f"/{name}").geturl()
        url = join_url(db, schema="shop")
        app = audit_app(url)
        with _charges(url) as ledger:
            key = ledger.list(limit=1)[0].key

        def snapshot() -> tuple[Any, ...]:
            with psycopg.connect(db) as conn:
                schemas = conn.execute("SELECT nspname FROM pg_namespace ORDER BY 1").fetchall()
                tables = conn.execute("SELECT schemaname, tablename FROM pg_tables ORDER BY 1, 2").fetchall()
                rows = conn.execute("SELECT * FROM shop.onceonly_records ORDER BY key").fetchall()
                versions = conn.execute("SELECT * FROM shop.onceonly_schema").fetchall()
            return schemas, tables, rows, versions

        before = snapshot()
        _read_everything(url, key, app, tmp_path)
        assert snapshot() == before
        _refused(join_url(db, schema="shpo"), "no ledger in schema 'shpo'")
        assert snapshot() == before
    finally:
        with psycopg.connect(POSTGRES_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_reads_leave_sqlite_files_as_they_were(tmp_path: Path, audit_app: Any) -> None:
    """SQLite: the reads leave the ledger's rows as they were; a file that is not a ledger is refused
    and left byte for byte; a missing one is not made (nor its directory)."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    app = audit_app(url)
    with _charges(url) as ledger:
        key = ledger.list(limit=1)[0].key
        before = ledger.list(limit=100)
    _read_everything(url, key, app, tmp_path)
    with Ledger.open(url) as check:
        assert check.list(limit=100) == before

    other = tmp_path / "notes.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE notes (body TEXT)")
    conn.commit()
    conn.close()
    content = other.read_bytes()
    _refused(f"sqlite:///{other}", "is not an onceonly ledger")
    assert other.read_bytes() == content
    _refused(f"sqlite:///{tmp_path / 'typo' / 'ledger.db'}", "no ledger at")
    assert not (tmp_path / "typo").exists()


def test_reads_take_a_sqlite_file_of_an_older_schema_as_it_is(tmp_path: Path) -> None:
    """A ledger file of schema 1 (before the review index) is read by ls, show, stats and pauses as it is:
    not refused, not upgraded, its bytes unchanged; the app's own open then brings it up."""
    path = tmp_path / "ledger.db"
    url = f"sqlite:///{path}"
    with _charges(url) as ledger:
        key = ledger.list(limit=1)[0].key
        before = ledger.list(limit=100)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("DROP INDEX onceonly_records_review")  # schema 1 had no secondary index
    conn.execute("DROP TABLE onceonly_controls")  # nor control documents (schema 3)
    conn.execute("PRAGMA user_version=1")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    content = path.read_bytes()
    for args in (["ls"], ["ls", "--state", "needs_review", "--json"], ["show", key], ["stats", "--json"], ["pauses"]):
        _ok(_run(*args, "--url", url))
    assert path.read_bytes() == content
    with Ledger.open(url) as app:
        assert app.list(limit=100) == before
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 3
    conn.close()


# --- scheduled processes ----------------------------------------------------------------------------


def test_purge_every_and_reconcile_purge(store_url: str, tmp_path: Path) -> None:
    """`purge --every` purges each period until SIGTERM, then exits 0; `reconcile --purge` purges
    after its run and says how many in its JSON."""
    _insert(store_url, "expired-1", State.CONFIRMED, via="run", expires_at=time.time() - 10)
    out = tmp_path / "out.txt"
    code = run_until_printed([ONCEONLY, "purge", "--url", store_url, "--every", "0.1s", "--json"], out, "removed", 2)
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert code == 0 and runs[0]["removed"] == 1 and runs[1]["removed"] == 0, runs

    _insert(store_url, "expired-2", State.FAILED, error="no", expires_at=time.time() - 10)
    result = _run("reconcile", "--url", store_url, "--purge", "--json", "--wait", "0")
    report = json.loads(_ok(result).splitlines()[-1])
    assert report["purged"] == 1
    with Ledger.open(store_url) as check:
        assert check.list(limit=10) == []


def test_the_reconcile_daemon_purges_once_every_purge_every(sqlite_url: str, tmp_path: Path) -> None:
    """`reconcile --every --purge` purges after its first run, then once per --purge-every, not after
    every run: a run reads the open records, a purge every record."""
    with Ledger.open(sqlite_url) as ledger:
        ledger.tool(name="t")(lambda n: n)(1)
    out = tmp_path / "out.txt"
    cmd = [ONCEONLY, "reconcile", "--url", sqlite_url, "--every", "0.05s", "--purge", "--json"]
    assert run_until_printed(cmd, out, '"counts"', 6) == 0
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert ["purged" in r for r in runs[:6]] == [True] + [False] * 5  # the default: once an hour
    out = tmp_path / "out2.txt"
    assert run_until_printed([*cmd, "--purge-every", "0.3s"], out, '"counts"', 20) == 0
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    purged = [r["finished_at"] for r in runs if "purged" in r]
    assert runs[0].get("purged") == 0 and 2 <= len(purged) < len(runs)
    assert all(b - a >= 0.25 for a, b in itertools.pairwise(purged))
    assert _run("reconcile", "--url", sqlite_url, "--purge-every", "0s").exit_code == 2
