"""Working the review queue from the command line, on every store: keys by a unique prefix, search by
an argument's value, bulk resolve with a count and a confirmation, a --confirmed result checked
against the tool's own results, exit codes cron can test, and messages that name what went wrong."""

from __future__ import annotations

import json
import re
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from onceonly import Ledger, State, ops
from onceonly.cli import cli
from onceonly.states import Record

WIDE = {"COLUMNS": "300"}


def _run(*args: str, env: dict[str, str] | None = None, input: str | None = None) -> Result:
    return CliRunner().invoke(cli, list(args), env=env, input=input)


def _ok(result: Result, code: int = 0) -> str:
    assert result.exit_code == code, (result.output, result.exception)
    return result.output


def _queue(url: str, *, refunds: int = 3) -> Ledger:
    """A ledger with two confirmed charges, one confirmed refund, and ``refunds`` refunds whose
    outcome was lost (a read timeout), parked for review."""
    ledger = Ledger.open(url)

    @ledger.tool(name="charge")
    def charge(order: str, amount: int) -> dict[str, Any]:
        return {"charged": order, "amount": amount}

    @ledger.tool(name="refund", on_unknown="review")
    def refund(order: str) -> dict[str, Any]:
        if order.startswith("lost"):
            raise TimeoutError("read timed out")
        return {"refunded": order}

    charge("ord-17", 30)
    charge("ord-18", 40)
    refund("ord-17")
    for n in range(refunds):
        with pytest.raises(Exception, match="unknown"):
            refund(f"lost-{n}")
    return ledger


def _state(url: str, key: str) -> State:
    with Ledger.open(url) as ledger:
        rec = ledger.get(key)
    assert rec is not None
    return rec.state


def _review(url: str) -> list[Record]:
    with Ledger.open(url) as ledger:
        return ledger.list(state="needs_review")


# --- 1. keys by a unique prefix ---------------------------------------------------------------------


def test_resolve_takes_the_short_key_ls_prints(store_url: str) -> None:
    """`resolve` takes the prefix `ls` shows, as `show` does; a prefix several keys start with is bad
    usage (exit 2) listing them, and changes nothing."""
    _queue(store_url).close()
    parked = _review(store_url)[0]
    listed = json.loads(_ok(_run("ls", "--url", store_url, "--state", "needs_review", "--json")))
    assert parked.key in [r["key"] for r in listed["records"]]
    with Ledger.open(store_url) as ledger:
        short = ops.short_keys(ledger, [parked.key])[parked.key]
    assert len(short) < len(parked.key)
    out = _ok(_run("resolve", short, "--url", store_url, "--failed", "the bank shows no refund"))
    assert out.startswith(f"{parked.key}: failed"), out
    assert _state(store_url, parked.key) is State.FAILED

    result = _run("resolve", "default:refund:", "--url", store_url, "--failed", "no")
    assert result.exit_code == 2, result.output
    assert "'default:refund:' starts several keys: give more of the key, one of" in result.output
    still = _review(store_url)
    assert len(still) == 2 and all(f"  {r.key}" in result.output for r in still), result.output


# --- 2. exit codes cron can use ---------------------------------------------------------------------


def test_reconcile_exits_3_while_records_wait_for_a_person(store_url: str) -> None:
    """Records parked by an earlier run still need a person: every single run exits 3 and says so on
    stderr, until they are resolved; then 0."""
    _queue(store_url, refunds=1).close()
    for _ in range(2):
        result = CliRunner().invoke(cli, ["reconcile", "--url", store_url, "--once", "--wait", "0", "--json"])
        assert result.exit_code == 3, result.output
        assert json.loads(result.stdout)["needs_review"] == 1
        assert "1 record(s) wait for a person in needs_review" in result.stderr
    (parked,) = _review(store_url)
    _ok(_run("resolve", parked.key, "--url", store_url, "--failed", "checked"))
    _ok(_run("reconcile", "--url", store_url, "--once", "--wait", "0"))


def test_stats_check_exits_3_on_review_and_past_max_age(store_url: str) -> None:
    """`stats` exits 0 as before; `stats --check` exits 3 while a record is in review, or the oldest
    unsettled one is older than --max-age (also with --counts, which reads only the open records)."""
    _queue(store_url, refunds=1).close()
    _ok(_run("stats", "--url", store_url))
    result = _run("stats", "--url", store_url, "--check", "--json")
    assert result.exit_code == 3 and "wait for a person in needs_review" in result.output, result.output
    _ok(_run("stats", "--url", store_url, "--counts", "--check"), 3)
    (parked,) = _review(store_url)
    _ok(_run("resolve", parked.key, "--url", store_url, "--failed", "checked"))
    _ok(_run("stats", "--url", store_url, "--check"))

    old = time.time() - 7200
    with Ledger.open(store_url) as ledger:
        assert ledger.store.insert(
            Record(
                key="default:charge:stuck",
                scope="default",
                tool="charge",
                fingerprint="f",
                state=State.UNKNOWN,
                attempts=1,
                created_at=old,
                updated_at=old,
                args_json=json.dumps({"order": "ord-9", "amount": 1}),
            )
        )
    for counts in ([], ["--counts"]):
        _ok(_run("stats", "--url", store_url, *counts, "--check", "--max-age", "3h"))
        late = _run("stats", "--url", store_url, *counts, "--check", "--max-age", "1h")
        assert late.exit_code == 3, late.output
        assert "default:charge:stuck is still unknown" in late.output and "--max-age 3600s" in late.output
    _ok(_run("stats", "--url", store_url, "--max-age", "1h"), 2)  # --max-age goes with --check


# --- 3. messages ------------------------------------------------------------------------------------


def test_a_mistyped_tool_is_refused_with_close_names(sqlite_url: str) -> None:
    """A --tool no record has lists nothing and passed for an empty queue: now bad usage, naming the
    close tool names."""
    _queue(sqlite_url).close()
    for command in (["ls"], ["stats"], ["resolve", "--state", "needs_review", "--failed", "x", "--yes"]):
        result = _run(*command, "--url", sqlite_url, "--tool", "refnud")
        assert result.exit_code == 2, result.output
        assert "no record of a tool named 'refnud' (--tool): did you mean 'refund'?" in result.output
    far = _run("ls", "--url", sqlite_url, "--tool", "zzz")
    assert far.exit_code == 2 and "the tools with records: 'charge', 'refund'" in far.output, far.output
    # A real tool with nothing in that state is an empty listing, not an error.
    assert "0 record(s)" in _ok(_run("ls", "--url", sqlite_url, "--tool", "charge", "--state", "unknown"))
    assert len(_review(sqlite_url)) == 3


def test_a_missing_driver_names_the_extra(redis_base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the redis package a command named the module only; it names the extra to install."""
    monkeypatch.setitem(sys.modules, "redis", None)  # what `import redis` meets where it is not installed
    result = _run("ls", "--url", redis_base_url)
    assert result.exit_code == 1, result.output
    assert "needs the redis extra: pip install 'onceonly[redis] @ git+" in result.output, result.output


@pytest.fixture(name="make_app")
def fixture_make_app(tmp_path: Path) -> Iterator[Any]:
    made: list[str] = []

    def make(source: str) -> str:
        name = f"app_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        made.append(name)
        return name

    yield make
    for name in made:
        sys.modules.pop(name, None)
    while str(tmp_path) in sys.path:
        sys.path.remove(str(tmp_path))


def test_reconcile_app_with_its_store_down_blames_the_store(make_app: Any, tmp_path: Path) -> None:
    """An app that opens its ledger on a store that does not answer: the store is named, not the app."""
    from tests._redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0?socket_connect_timeout=1"
    name = make_app(f"from onceonly import Ledger\nledger = Ledger.open({url!r})\n")
    result = _run("reconcile", "--app", f"{name}:ledger", "--app-dir", str(tmp_path), "--once")
    assert result.exit_code == 1, result.output
    assert "the app's ledger store failed while the app was imported" in result.output, result.output
    assert "fix the app" not in result.output and ".." not in result.output


def test_reconcile_with_the_wrong_app_names_it(sqlite_url: str, make_app: Any, tmp_path: Path) -> None:
    """Records of a tool the given --app does not register: the message names that app and its tools,
    instead of saying "pass --app"."""
    with _queue(sqlite_url, refunds=0) as ledger:
        rec = ledger.get(ledger.list(tool="refund")[0].key)
        assert rec is not None
    old = time.time() - 3600
    with Ledger.open(sqlite_url) as ledger:
        ledger.store.insert(
            Record(
                key="default:refund:lost",
                scope="default",
                tool="refund",
                fingerprint="f",
                state=State.UNKNOWN,
                attempts=1,
                created_at=old,
                updated_at=old,
                args_json=json.dumps({"order": "x"}),
            )
        )
    name = make_app(
        f"from onceonly import Ledger\nledger = Ledger.open({sqlite_url!r})\n"
        "@ledger.tool(name='charge')\ndef charge(order: str, amount: int) -> None: ...\n"
    )
    result = _run("reconcile", "--app", f"{name}:ledger", "--app-dir", str(tmp_path), "--once", "--wait", "0", env=WIDE)
    assert result.exit_code == 3, result.output
    assert f"--app '{name}:ledger' registers 'charge', not 'refund'" in result.output, result.output
    assert "pass --app" not in result.output


def test_store_unavailable_on_a_read_says_nothing_of_a_write(tmp_path: Path) -> None:
    """A read on a Redis server that went away: the message does not say a write may have landed,
    and has no doubled full stop."""
    from onceonly.errors import StoreUnavailable
    from tests._redis_server import PrivateRedis

    server = PrivateRedis(tmp_path).start()
    ledger = Ledger.open(f"{server.url}?warn_persistence=false&socket_timeout=1&socket_connect_timeout=1")
    try:
        server.stop()
        with pytest.raises(StoreUnavailable) as caught:
            ledger.get("default:charge:x")
    finally:
        ledger.close()
    text = str(caught.value)
    assert "while reading 'default:charge:x'" in text and "changes nothing" in text, text
    assert "landed" not in text and ".." not in text, text


def test_postgres_store_unavailable_tells_reads_from_writes() -> None:
    """The PostgreSQL translation of a lost connection: only a write says its landing is unknown; the
    driver's own full stop is not doubled."""
    psycopg = pytest.importorskip("psycopg")
    from onceonly.stores.postgres._errors import translate
    from onceonly.stores.postgres._url import parse_postgres_url

    options = parse_postgres_url("postgresql://127.0.0.1/db")
    exc = psycopg.OperationalError("connection to server was lost.")
    read = str(translate(exc, "the ledger", options, closed=False, writing=False))
    write = str(translate(exc, "the ledger", options, closed=False, writing=True))
    assert "landed" not in read and "changes nothing" in read and ".." not in read, read
    assert "Whether the last write landed is unknown" in write and ".." not in write, write


def test_redis_persistence_warning_names_the_url_parameter(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The warning said to pass warn_persistence=false to the ledger (a TypeError): it is a URL option."""
    from tests._redis_server import PrivateRedis

    server = PrivateRedis(tmp_path).start()
    try:
        with caplog.at_level("WARNING"), Ledger.open(server.url):
            pass
        (warning,) = [r.getMessage() for r in caplog.records if "persists nothing" in r.getMessage()]
        assert "add warn_persistence=false to the ledger's URL" in warning, warning
        with pytest.raises(TypeError):
            Ledger.open(server.url, warn_persistence=False)  # type: ignore[call-arg]
        caplog.clear()
        with caplog.at_level("WARNING"), Ledger.open(f"{server.url}?warn_persistence=false"):
            pass  # what the warning says to do silences it
        assert not [r for r in caplog.records if "persists nothing" in r.getMessage()]
    finally:
        server.stop()


# --- 4. search by an argument's value ---------------------------------------------------------------


def test_ls_finds_calls_by_an_argument_value(store_url: str) -> None:
    """`ls --arg order=ord-17` lists the calls made with that order, whatever the tool; a number is
    matched by its JSON text; several --arg must all match."""
    _queue(store_url).close()
    found = json.loads(_ok(_run("ls", "--url", store_url, "--arg", "order=ord-17", "--json")))["records"]
    assert sorted(r["tool"] for r in found) == ["charge", "refund"]
    both = json.loads(_ok(_run("ls", "--url", store_url, "--arg", "order=ord-17", "--arg", "amount=30", "--json")))
    assert [r["tool"] for r in both["records"]] == ["charge"]
    assert json.loads(_ok(_run("ls", "--url", store_url, "--arg", "amount=31", "--json")))["records"] == []
    assert 'order="ord-17"' in _ok(_run("ls", "--url", store_url, "--arg", "order=ord-17", env=WIDE))
    _ok(_run("ls", "--url", store_url, "--arg", "order"), 2)


def test_matches_args() -> None:
    """The function behind `ls --arg` (and the dashboard's search)."""
    rec = Record(
        key="k", scope="default", tool="charge", fingerprint="f", state=State.CONFIRMED, attempts=1,
        created_at=0.0, updated_at=0.0, args_json=json.dumps({"order": "ord-17", "amount": 30, "live": True}),
    )  # fmt: skip
    assert ops.matches_args(rec, {"order": "ord-17"})
    assert ops.matches_args(rec, {"amount": "30", "live": "true"}) and ops.matches_args(rec, {"amount": 30})
    assert not ops.matches_args(rec, {"order": "ord-1"}) and not ops.matches_args(rec, {"amount": "30.5"})
    assert not ops.matches_args(rec, {"missing": "x"}) and not ops.matches_args(rec, {"live": 1})
    assert ops.matches_args(rec, {})


# --- 5. bulk resolve, and the shape of a confirmed result -------------------------------------------


def test_bulk_resolve_counts_asks_and_settles(store_url: str) -> None:
    """`resolve --state needs_review --tool refund --failed REASON` shows the count and the records,
    asks; "n" changes nothing, --yes settles them all."""
    _queue(store_url).close()
    no = _run(
        "resolve", "--url", store_url, "--state", "needs_review", "--tool", "refund", "--failed", "x", input="n\n"
    )
    assert no.exit_code == 1 and "3 record(s) to resolve as failed: x" in no.output, no.output
    assert "resolve these 3 record(s)?" in no.output and 'refund(order="lost-0")' in no.output
    assert len(_review(store_url)) == 3

    yes = _run("resolve", "--url", store_url, "--state", "needs_review", "--tool", "refund", "--failed", "no refund",
               "--by", "ops", input="y\n")  # fmt: skip
    assert "resolved 3 record(s) as failed: no refund; 0 left as they were" in _ok(yes)
    assert _review(store_url) == []
    with Ledger.open(store_url) as ledger:
        failed = ledger.list(state="failed")
    assert len(failed) == 3 and all(r.history[-1]["by"] == "ops" for r in failed)

    again = _run("resolve", "--url", store_url, "--state", "needs_review", "--failed", "x", "--yes")
    assert "no record matches" in _ok(again)
    _ok(_run("resolve", "--url", store_url, "--failed", "x"), 2)  # neither a KEY nor --state
    _ok(_run("resolve", "k", "--url", store_url, "--state", "unknown", "--failed", "x"), 2)  # both


def test_bulk_resolve_with_yes_and_json(sqlite_url: str) -> None:
    """--yes asks nothing (a script); --json prints what was resolved."""
    _queue(sqlite_url, refunds=2).close()
    result = CliRunner().invoke(
        cli,
        ["resolve", "--url", sqlite_url, "--state", "needs_review", "--arg", "order=lost-1",
         "--confirmed", '{"refunded": "lost-1"}', "--yes", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [r["args"] for r in data["resolved"]] == [{"order": "lost-1"}] and data["left"] == []
    assert [r.args for r in _review(sqlite_url)] == [{"order": "lost-0"}]


def test_confirmed_is_checked_against_the_tool_s_results(store_url: str) -> None:
    """A --confirmed result unlike the tool's earlier confirmed ones is refused (exit 2), saying how it
    differs; --force records it; one of the right shape is recorded, saying what a call replays."""
    _queue(store_url, refunds=1).close()
    (parked,) = _review(store_url)
    text = _run("resolve", parked.key, "--url", store_url, "--confirmed", '"done"')
    assert text.exit_code == 2, text.output
    assert "it is a string, but the 1 earlier confirmed result(s) of 'refund' are an object" in text.output
    assert "--force to record it as given" in text.output
    keys = _run("resolve", parked.key, "--url", store_url, "--confirmed", '{"done": true}')
    assert keys.exit_code == 2 and "it lacks 'refunded'" in keys.output and "it has 'done'" in keys.output
    assert _state(store_url, parked.key) is State.NEEDS_REVIEW

    out = _ok(_run("resolve", parked.key, "--url", store_url, "--confirmed", '{"refunded": "lost-0"}'))
    assert f'{parked.key}: confirmed; refund(order="lost-0") now replays {{"refunded": "lost-0"}}' in out, out
    with Ledger.open(store_url) as ledger:

        @ledger.tool(name="refund", on_unknown="review")
        def refund(order: str) -> dict[str, Any]:
            raise AssertionError("replayed, never run")

        assert refund("lost-0") == {"refunded": "lost-0"}


def test_confirmed_force_and_a_tool_without_results(sqlite_url: str) -> None:
    """--force records a result of another shape (and says so); a tool with no confirmed result yet
    has nothing to compare with, so any result is taken."""
    _queue(sqlite_url, refunds=1).close()
    (parked,) = _review(sqlite_url)
    forced = _run("resolve", parked.key, "--url", sqlite_url, "--confirmed", '"done"', "--force")
    assert forced.exit_code == 0 and "(recorded anyway: --force)" in forced.output, forced.output
    assert _state(sqlite_url, parked.key) is State.CONFIRMED

    old = time.time() - 3600
    with Ledger.open(sqlite_url) as ledger:
        ledger.store.insert(
            Record(
                key="default:notify:x",
                scope="default",
                tool="notify",
                fingerprint="f",
                state=State.NEEDS_REVIEW,
                attempts=1,
                created_at=old,
                updated_at=old,
                args_json=json.dumps({"to": "ann"}),
            )
        )
    assert "confirmed" in _ok(_run("resolve", "default:notify:x", "--url", sqlite_url, "--confirmed", '"sent"'))


# --- 6. tables that fit 80 columns ------------------------------------------------------------------


def _long_lines(url: str) -> None:
    """Charges keyed by their order alone (the note is not part of the key), and refunds in review
    whose error is longer than a line."""
    with Ledger.open(url) as ledger:

        @ledger.tool(name="charge", key=["order"])
        def charge(amount: int, note: str, order: str) -> None:
            return None

        @ledger.tool(name="refund", on_unknown="review")
        def refund(order: str) -> None:
            raise TimeoutError("read timed out while waiting for the bank's answer to the refund request")

        for n in range(3):
            charge(10 * n, "a note long enough to push the order out of an 80-column table", f"ord-{n}")
            with pytest.raises(Exception, match="unknown"):
                refund(f"ord-{n}")


def test_ls_and_stats_fit_80_columns(sqlite_url: str) -> None:
    """At 80 columns: no line is longer; key, state and time are whole; the arguments the key was made
    of come first (the order, not the alphabetically first amount); only the last column wraps, so the
    error is all there; --wide shows everything whole."""
    _long_lines(sqlite_url)
    narrow = {"COLUMNS": "80"}
    text = _ok(_run("ls", "--url", sqlite_url, env=narrow))
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    rows = [line for line in lines if line.startswith("default:")]
    assert len(rows) == 6, text
    for row in rows:
        assert re.search(r"\s(confirmed|needs_review)\s+\d\d-\d\d \d\d:\d\d\s", row), row
    charges = [row for row in rows if row.startswith("default:charge:")]
    assert all(re.search(r'\s{2}order="ord-', row) for row in charges), text  # not amount= first
    # The error wraps in its column, word by word: every word of it is on the page.
    words = " ".join(line[50:] for line in lines)
    assert all(w in words for w in ("TimeoutError:", "bank's", "refund", "request")), text
    assert "a note long enough to push the order out" in _ok(_run("ls", "--url", sqlite_url, "--wide", env=WIDE))

    stats = _ok(_run("stats", "--url", sqlite_url, env=narrow))
    assert all(len(line) <= 80 for line in stats.splitlines()), stats
    (row,) = [line for line in stats.splitlines() if line.startswith("refund ")]
    assert row.split()[1:4] == ["3", "3", "0"] and "timeout=" in stats, stats  # figures whole, on one line
    with Ledger.open(sqlite_url) as ledger:
        name = "refund_a_customer_payment_through_the_bank_s_own_gateway_v2"
        ledger.tool(name=name)(lambda order: None)("o")
    cut = _ok(_run("stats", "--url", sqlite_url, env=narrow))
    assert all(len(line) <= 80 for line in cut.splitlines()) and "refund_a_customer_…" in cut, cut
    assert name not in cut and name in _ok(_run("stats", "--url", sqlite_url, "--wide", env=WIDE))


def test_key_arguments(sqlite_url: str) -> None:
    """The arguments a key was made of, found by hashing them again."""
    with Ledger.open(sqlite_url) as ledger:

        @ledger.tool(name="charge", key=["order"])
        def charge(amount: int, order: str) -> None: ...

        @ledger.tool(name="pair", key=["b", "c"])
        def pair(a: int, b: int, c: int) -> None: ...

        @ledger.tool(name="all")
        def every(a: int, b: int) -> None: ...

        charge(1, "o")
        pair(1, 2, 3)
        every(1, 2)
        found = {r.tool: ops.key_arguments(r) for r in ledger.list(limit=10)}
    assert found == {"charge": ["order"], "pair": ["b", "c"], "all": ["a", "b"]}


# --- 7. long runs: concurrency, summarised errors, progress, Ctrl-C -----------------------------------

PROBE_APP = """
    import pathlib, threading, time
    from onceonly import NOT_FOUND, Ledger

    ledger = Ledger.open({url!r})
    MARK = pathlib.Path({mark!r})
    together = threading.Barrier({together}, timeout=20)
    lock = threading.Lock()
    now = [0]
    most = [0]

    def find(args, key):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            order = args["order"]
            if order.startswith("flaky"):
                raise ConnectionResetError("the bank reset the connection\\n  a second line\\n  a third line")
            if order.startswith("hang"):
                MARK.write_text("probing")
                time.sleep(60)
            if {together} > 1 and order.startswith("o-"):
                together.wait()  # {together} probes must be running at once to get past this
            return {{"order": order}}
        finally:
            with lock:
                now[0] -= 1
                MARK.with_suffix(".most").write_text(str(most[0]))

    @ledger.tool(name="charge", probe=find, on_unknown="probe")
    def charge(order: str) -> dict: ...
"""


def _probe_app(make_app: Any, url: str, tmp_path: Path, *, together: int = 1) -> tuple[str, Path]:
    mark = tmp_path / "probing"
    return make_app(PROBE_APP.format(url=url, mark=str(mark), together=together)), mark


def _confirmed(url: str, *orders: str) -> None:
    with Ledger.open(url) as ledger:
        for n, order in enumerate(orders):
            rec = Record(
                key=f"default:charge:{n:04d}{order}", scope="default", tool="charge", fingerprint="f",
                state=State.CONFIRMED, attempts=1, created_at=time.time(), updated_at=time.time(),
                args_json=json.dumps({"order": order}), result_json=json.dumps({"order": order}), via="run",
            )  # fmt: skip
            assert ledger.store.insert(rec)


def test_audit_asks_probes_in_a_bounded_pool(sqlite_url: str, make_app: Any, tmp_path: Path) -> None:
    """--concurrency 3: three probes run at once (a barrier of 3 lets them through only together), never
    more; one probe at a time would never pass the barrier."""
    _confirmed(sqlite_url, *(f"o-{n}" for n in range(9)))
    name, mark = _probe_app(make_app, sqlite_url, tmp_path, together=3)
    result = _run("audit", "--app", f"{name}:ledger", "--app-dir", str(tmp_path), "--concurrency", "3", "--json")
    report = json.loads(_ok(result))
    assert report["checked"] == 9 and report["agreed"] == 9 and not report["interrupted"]
    assert mark.with_suffix(".most").read_text() == "3"


def test_audit_summarises_a_flaky_probe(sqlite_url: str, make_app: Any, tmp_path: Path) -> None:
    """Six records whose probe raises the same three-line error: one summary line, not six errors of
    three lines; --json keeps each."""
    _confirmed(sqlite_url, "o-1", *(f"flaky-{n}" for n in range(6)))
    name, _ = _probe_app(make_app, sqlite_url, tmp_path)
    text = _ok(_run("audit", "--app", f"{name}:ledger", "--app-dir", str(tmp_path), env=WIDE), 3)
    lines = [line for line in text.splitlines() if "ConnectionResetError" in line]
    assert len(lines) == 1, text
    assert lines[0].startswith("probe error x6 (charge, e.g. default:charge:0001") and "a second line" not in text
    assert "audited 7 settled record(s): 1 agree, 0 disagree, 6 probe error(s)" in text
    again, _ = _probe_app(make_app, sqlite_url, tmp_path)  # a fresh import: the command closed the first one's ledger
    data = json.loads(_ok(_run("audit", "--app", f"{again}:ledger", "--app-dir", str(tmp_path), "--json"), 3))
    assert len(data["errors"]) == 6


def test_audit_ctrl_c_prints_what_was_checked_and_exits_130(sqlite_url: str, make_app: Any, tmp_path: Path) -> None:
    """Ctrl-C while a probe hangs: the report of the records checked so far, exit 130 (not
    "Aborted!" and 1), without waiting for the hanging probe."""
    import os
    import signal
    import subprocess

    _confirmed(sqlite_url, "o-1", "o-2", "hang-3", "o-4")
    name, mark = _probe_app(make_app, sqlite_url, tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), str(tmp_path)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceonly", "audit", "--app", f"{name}:ledger", "--app-dir", str(tmp_path),
         "--concurrency", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not mark.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)  # well before the hanging probe's 60 s
    finally:
        proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "audited 2 settled record(s): 2 agree" in out and "interrupted (Ctrl-C)" in out, out
    assert "Aborted!" not in out + err and "progress" not in err


def test_progress_shows_on_a_terminal_only(sqlite_url: str, make_app: Any, tmp_path: Path) -> None:
    """On a terminal (a pty) audit draws a progress bar on stderr; into a pipe, or with --json, none."""
    import os
    import pty
    import subprocess

    _confirmed(sqlite_url, *(f"o-{n}" for n in range(5)))
    name, _ = _probe_app(make_app, sqlite_url, tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), str(tmp_path)])}
    command = [sys.executable, "-m", "onceonly", "audit", "--app", f"{name}:ledger", "--app-dir", str(tmp_path)]

    def on_a_terminal(*more: str) -> str:
        leader, follower = pty.openpty()
        try:
            proc = subprocess.run(
                [*command, *more], stdout=subprocess.PIPE, stderr=follower, env=env, timeout=60, check=False
            )
            os.close(follower)
            follower = -1
            seen = b""
            while True:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # the terminal's other end is closed: all was read
                    break
                if not chunk:
                    break
                seen += chunk
        finally:
            os.close(leader)
            if follower >= 0:
                os.close(follower)
        assert proc.returncode == 0, proc
        return seen.decode("utf-8", "replace")

    drawn = on_a_terminal()
    assert "audit" in drawn and "5/5" in drawn, drawn
    assert on_a_terminal("--json") == ""
    piped = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr


# --- reconcile over many records: a bounded pool, each record settled once, Ctrl-C, summaries --------

SETTLE_APP = """
    import os, pathlib, sqlite3, threading, time
    from onceonly import Ledger

    ledger = Ledger.open({url!r})
    EFFECTS = {effects!r}  # a SQLite table of what the probes and the tool did, one row each
    GO = pathlib.Path(EFFECTS).with_name("go")
    together = threading.Barrier({together}, timeout=20)
    lock = threading.Lock()
    now = [0]
    most = [0]

    def effect(what, key):
        db = sqlite3.connect(EFFECTS, timeout=30, isolation_level=None)
        try:
            db.execute("CREATE TABLE IF NOT EXISTS effects (what TEXT, key TEXT, pid INTEGER)")
            db.execute("INSERT INTO effects VALUES (?, ?, ?)", (what, key, os.getpid()))
        finally:
            db.close()

    def find(args, key):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
            pathlib.Path(EFFECTS).with_suffix(".most").write_text(str(most[0]))
        try:
            effect("probe", key)
            order = args["order"]
            if order.startswith("flaky"):
                raise ConnectionResetError("the bank reset the connection\\n  a second line")
            if order.startswith("down"):
                raise TimeoutError("the bank did not answer")
            if order.startswith("hang"):
                pathlib.Path(EFFECTS).with_name("hanging").write_text("probing")
                time.sleep(60)
            if {together} > 1:
                together.wait()  # {together} probes must be running at once to get past this
            time.sleep(0.01)
            return {{"order": order}}
        finally:
            with lock:
                now[0] -= 1

    @ledger.tool(name="charge", probe=find, on_unknown="probe", settle=0)
    def charge(order: str) -> dict: ...

    @ledger.tool(name="refund", on_unknown="resend", settle=0)
    def refund(order: str) -> dict:
        GO.with_name(f"started-{{os.getpid()}}").touch()
        deadline = time.monotonic() + 30
        while not GO.exists() and time.monotonic() < deadline:  # both reconcilers are under way
            time.sleep(0.01)
        effect("refund", order)
        time.sleep(0.01)
        return {{"refunded": order}}
"""


def _settle_app(make_app: Any, url: str, tmp_path: Path, *, together: int = 1) -> tuple[str, Path]:
    effects = tmp_path / "effects.db"
    return make_app(SETTLE_APP.format(url=url, effects=str(effects), together=together)), effects


def _unknown(url: str, *orders: str) -> list[str]:
    """Records of ``charge`` whose outcome is unknown, an hour old, in the order of their keys."""
    old = time.time() - 3600
    keys = []
    with Ledger.open(url) as ledger:
        for n, order in enumerate(orders):
            rec = Record(
                key=f"default:charge:{n:04d}-{order}", scope="default", tool="charge", fingerprint="f",
                state=State.UNKNOWN, attempts=1, created_at=old, updated_at=old,
                args_json=json.dumps({"order": order}),
            )  # fmt: skip
            assert ledger.store.insert(rec)
            keys.append(rec.key)
    return keys


def _effects(path: Path, what: str) -> list[str]:
    import sqlite3

    db = sqlite3.connect(path)
    try:
        return [key for (key,) in db.execute("SELECT key FROM effects WHERE what = ?", (what,))]
    finally:
        db.close()


def _states(url: str, keys: list[str]) -> dict[str, int]:
    found: dict[str, int] = {}
    with Ledger.open(url) as ledger:
        for key in keys:
            rec = ledger.get(key)
            assert rec is not None
            found[rec.state.value] = found.get(rec.state.value, 0) + 1
    return found


def _subprocess_env(tmp_path: Path) -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"), str(tmp_path)])}


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_reconcile_settles_each_record_once_in_a_bounded_pool(
    kind: str, make_app: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """--concurrency 4 over 40 unknown records: four probes run at once (a barrier of 4 lets them
    through only together), never more; each record's probe runs once and it is confirmed once."""
    from tests.conftest import empty_store_url

    url = empty_store_url(kind, request, tmp_path)
    keys = _unknown(url, *(f"o-{n}" for n in range(40)))
    name, effects = _settle_app(make_app, url, tmp_path, together=4)
    result = _run("reconcile", "--app", f"{name}:ledger", "--app-dir", str(tmp_path), "--concurrency", "4", "--json")
    report = json.loads(_ok(result))
    assert report["counts"]["confirmed"] == 40 and not report["interrupted"], report["counts"]
    assert [r["key"] for r in report["records"]] == keys  # in the order they were read, not as they finished
    probed = _effects(effects, "probe")
    assert len(probed) == 40 and set(probed) == set(keys)
    assert effects.with_suffix(".most").read_text() == "4"
    assert _states(url, keys) == {"confirmed": 40}
    with Ledger.open(url) as ledger:
        for key in keys:
            rec = ledger.get(key)
            assert rec is not None
            assert [h["to"] for h in rec.history].count("confirmed") == 1 and rec.via == "reconcile-probe"


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_two_reconcilers_with_pools_send_each_once(
    kind: str, make_app: Any, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Two `reconcile --concurrency 4` processes at once over 40 records whose holder died, of a tool
    that re-sends: both are under way (each has a re-send running) before any re-send goes on, and
    each operation is sent once, confirmed once, counted once between the two reports."""
    import subprocess

    from tests._settling import dead_holder
    from tests.conftest import empty_store_url

    url = empty_store_url(kind, request, tmp_path)
    with Ledger.open(url) as setup:
        setup.tool(name="refund", on_unknown="resend", settle=0)(lambda order: None)
        keys = [dead_holder(setup, "refund", f"r-{n}").key for n in range(40)]
    name, effects = _settle_app(make_app, url, tmp_path)
    command = [sys.executable, "-m", "onceonly", "reconcile", "--app", f"{name}:ledger", "--app-dir", str(tmp_path),
               "--concurrency", "4", "--wait", "0", "--json"]  # fmt: skip
    procs = [
        subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_subprocess_env(tmp_path)
        )
        for _ in range(2)
    ]
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("started-*"))) < 2:
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, [
                p.communicate() for p in procs
            ]
            time.sleep(0.02)
        (tmp_path / "go").touch()
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    reports = [json.loads(out) for out, _ in outs]
    sent = _effects(effects, "refund")
    assert len(sent) == 40 and set(sent) == {f"r-{n}" for n in range(40)}
    assert sum(r["counts"]["confirmed"] for r in reports) == 40, [r["counts"] for r in reports]
    assert _states(url, keys) == {"confirmed": 40}


def test_reconcile_ctrl_c_prints_the_partial_report_and_exits_130(
    sqlite_url: str, make_app: Any, tmp_path: Path
) -> None:
    """Ctrl-C while two probes hang (--concurrency 2), after five records were settled: the report of
    those five, marked partial, exit 130, without waiting for the hanging probes; the two records
    under way and the four not reached are still unknown, as before."""
    import signal
    import subprocess

    keys = _unknown(sqlite_url, *(f"o-{n}" for n in range(5)), *(f"hang-{n}" for n in range(6)))
    name, effects = _settle_app(make_app, sqlite_url, tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceonly", "reconcile", "--app", f"{name}:ledger", "--app-dir", str(tmp_path),
         "--concurrency", "2", "--wait", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**_subprocess_env(tmp_path), **WIDE},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "hanging").exists() or _states(sqlite_url, keys).get("confirmed", 0) < 5:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        while len(_effects(effects, "probe")) < 7:  # both hanging probes are under way
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)  # well before the hanging probes' 60 s
    finally:
        proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "reconciled 5 record(s) in" in out and ": 5 confirmed; interrupted (Ctrl-C), a partial report" in out, out
    assert "Aborted!" not in out + err and "━" not in err  # no bar into a pipe
    assert _states(sqlite_url, keys) == {"confirmed": 5, "unknown": 6}
    assert len(_effects(effects, "probe")) == 7  # the four records not reached were never probed
    with Ledger.open(sqlite_url) as ledger:
        for key in keys[5:]:
            rec = ledger.get(key)
            assert rec is not None and rec.history == [], rec.history  # left exactly as it was


def test_reconcile_every_ctrl_c_prints_the_interrupted_run_and_exits_0(
    sqlite_url: str, make_app: Any, tmp_path: Path
) -> None:
    """The daemon (--every): Ctrl-C while a probe hangs prints that run's partial report (--json:
    "interrupted": true), then exits 0 as on Ctrl-C between runs."""
    import signal
    import subprocess

    keys = _unknown(sqlite_url, "o-0", "o-1", "hang-2")
    name, _ = _settle_app(make_app, sqlite_url, tmp_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceonly", "reconcile", "--app", f"{name}:ledger", "--app-dir", str(tmp_path),
         "--every", "1m", "--concurrency", "1", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_subprocess_env(tmp_path),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "hanging").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, (out, err)
    [report] = [json.loads(line) for line in out.splitlines()]
    assert report["interrupted"] is True and report["counts"]["confirmed"] == 2, report
    assert _states(sqlite_url, keys) == {"confirmed": 2, "unknown": 1}


def test_reconcile_summarises_probe_errors(sqlite_url: str, make_app: Any, tmp_path: Path) -> None:
    """30 records whose probe raises the same two-line error and 3 another: one summary line for each
    distinct error with its count, not a row per record (exit 3: they stay unknown); -v lists each,
    --json keeps each error."""
    keys = _unknown(sqlite_url, "o-1", *(f"flaky-{n}" for n in range(30)), *(f"down-{n}" for n in range(3)))
    name, _ = _settle_app(make_app, sqlite_url, tmp_path)
    args = ["reconcile", "--app", f"{name}:ledger", "--app-dir", str(tmp_path), "--wait", "0", "--concurrency", "4"]
    text = _ok(_run(*args, env=WIDE), 3)
    summary = [line for line in text.splitlines() if line.startswith("probe error")]
    assert len(summary) == 2, text
    assert summary[0].startswith("probe error x30 (charge, e.g. default:charge:0001") and (
        "ConnectionResetError: the bank reset the connection; stays unknown" in summary[0]
    ), summary
    assert summary[1].startswith("probe error x3 (charge, e.g. default:charge:0031") and (
        "TimeoutError: the bank did not answer" in summary[1]
    ), summary
    assert "a second line" not in text and "flaky-" not in text  # no row per record
    assert "reconciled 34 record(s)" in text and "1 confirmed, 33 unsettled" in text, text
    again, _ = _settle_app(make_app, sqlite_url, tmp_path)
    verbose = _ok(_run(*(a if a != name + ":ledger" else f"{again}:ledger" for a in args), "-v", env=WIDE), 3)
    assert sum("stays unknown" in line for line in verbose.splitlines()) == 33 + 2, verbose
    third, _ = _settle_app(make_app, sqlite_url, tmp_path)
    data = json.loads(_ok(_run(*(a if a != name + ":ledger" else f"{third}:ledger" for a in args), "--json"), 3))
    errors = [r["error"] for r in data["records"] if r["error"]]
    assert len(errors) == 33 and errors[0].startswith("ConnectionResetError: the bank reset the connection\n")
    assert _states(sqlite_url, keys) == {"confirmed": 1, "unknown": 33}


def test_reconcile_and_purge_show_progress_on_a_terminal_only(sqlite_url: str, make_app: Any, tmp_path: Path) -> None:
    """On a terminal (a pty) reconcile draws a bar with a count on stderr, and purge a running count;
    into a pipe, or with --json, neither."""
    import subprocess

    _unknown(sqlite_url, *(f"o-{n}" for n in range(5)))
    name, _ = _settle_app(make_app, sqlite_url, tmp_path)
    env = _subprocess_env(tmp_path)
    reconcile = [sys.executable, "-m", "onceonly", "reconcile", "--app", f"{name}:ledger", "--app-dir", str(tmp_path)]
    drawn = _on_a_terminal(reconcile, env)
    assert "reconcile" in drawn and "5/5" in drawn, drawn
    assert _on_a_terminal([*reconcile, "--json"], env) == ""
    _unknown(sqlite_url, *(f"p-{n}" for n in range(5)))
    piped = subprocess.run(reconcile, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert piped.returncode == 0 and piped.stderr == "" and "5 confirmed" in piped.stdout, piped

    purge = [sys.executable, "-m", "onceonly", "purge", "--url", sqlite_url]
    _expired(sqlite_url, 10)
    drawn = _on_a_terminal(purge, env)
    assert "purge" in drawn and "10/?" in drawn, drawn
    assert _on_a_terminal([*purge, "--json"], env) == ""


def _expired(url: str, n: int) -> None:
    """``n`` confirmed records whose ttl passed a second ago."""
    with Ledger.open(url) as ledger:
        for i in range(n):
            rec = Record(
                key=f"default:charge:gone-{i:02d}", scope="default", tool="charge", fingerprint="f",
                state=State.CONFIRMED, attempts=1, created_at=time.time(), updated_at=time.time(),
                args_json="{}", result_json="{}", via="run", expires_at=time.time() - 1,
            )  # fmt: skip
            assert ledger.store.insert(rec)


def test_purge_ctrl_c_says_how_many_were_deleted(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C after the third of ten deletions: exit 130, "3 ... deleted so far" (and --json says so
    too), and seven records are still there for the next run."""
    _expired(store_url, 10)
    purge = Ledger.purge

    def interrupted(self: Ledger, **kwargs: Any) -> int:
        told = kwargs["progress"]

        def progress(n: int) -> None:
            told(n)
            if n == 3:
                raise KeyboardInterrupt

        return purge(self, **{**kwargs, "progress": progress})

    monkeypatch.setattr(Ledger, "purge", interrupted)
    result = _run("purge", "--url", store_url)
    assert result.exit_code == 130, (result.output, result.exception)
    assert "interrupted (Ctrl-C): 3 expired record(s) deleted so far stay deleted" in result.stderr, result.output
    with Ledger.open(store_url) as ledger:
        assert len(ledger.list(state="confirmed", limit=100)) == 7
    again = _run("purge", "--url", store_url, "--json")
    assert again.exit_code == 130, again.output
    data = json.loads(again.stdout)
    assert data["removed"] == 3 and data["interrupted"] is True
    with Ledger.open(store_url) as ledger:
        assert len(ledger.list(state="confirmed", limit=100)) == 4


def _on_a_terminal(command: list[str], env: dict[str, str]) -> str:
    """What ``command`` writes on stderr when stderr is a terminal (a pty); it must exit 0."""
    import os
    import pty
    import subprocess

    leader, follower = pty.openpty()
    try:
        proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=follower, env=env, timeout=60, check=False)
        os.close(follower)
        follower = -1
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal's other end is closed: all was read
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert proc.returncode == 0, proc
    return seen.decode("utf-8", "replace")


def test_audit_with_a_mistyped_tool_says_so(sqlite_url: str, make_app: Any, tmp_path: Path) -> None:
    """`audit --tool chrage` audited nothing and exited 0: now bad usage, naming the close tool."""
    _confirmed(sqlite_url, "o-1")
    name, _ = _probe_app(make_app, sqlite_url, tmp_path)
    result = _run("audit", "--app", f"{name}:ledger", "--app-dir", str(tmp_path), "--tool", "chrage")
    assert result.exit_code == 2 and "did you mean 'charge'?" in result.output, result.output
