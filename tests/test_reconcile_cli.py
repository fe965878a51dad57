"""``onceonly reconcile`` and ``onceonly resolve`` as a person runs them, and the crash and race proofs.

The proofs run real agent processes (``tests/demo/agent_app.py``) that die by SIGKILL at chosen points
and hit injected faults, then the real CLI in a subprocess, and count the side effects in a real table.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from onceonly import Ledger, State
from onceonly._cli import load_ledger, parse_duration
from onceonly.cli import cli
from onceonly.states import HELD, Record
from onceonly.stores import open_store
from tests._settling import dead_holder

APP_DIR = Path(__file__).parent / "demo"
AGENT = str(APP_DIR / "agent_app.py")
ONCEONLY = str(Path(sys.executable).parent / "onceonly")
LEASE = 0.5  # agent_app.LEASE


# --- a small app module written per test ------------------------------------------------------------


@pytest.fixture(name="make_app")
def fixture_make_app(tmp_path: Path) -> Iterator[Any]:
    """Write a user's app module into tmp_path; forget it (sys.modules, sys.path) afterwards."""
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


APP_SOURCE = """
    from onceonly import NOT_FOUND, Ledger

    ledger = Ledger.open({url!r})
    HAPPENED = {{"a"}}

    def find(args, key):
        return {{"op": args["op"]}} if args["op"] in HAPPENED else NOT_FOUND

    @ledger.tool(name="create", on_unknown="probe", probe=find)
    def create(op: str) -> None: ...

    @ledger.tool(name="charge")
    def charge(op: str) -> None: ...

    def factory():
        return ledger
"""


def test_reconcile_once_settles_through_the_app_s_probes(sqlite_url: str, make_app: Any, tmp_path: Path) -> None:
    """--app imports the user's module; its probes settle the records; the table says what was done."""
    name = make_app(APP_SOURCE.format(url=sqlite_url))
    with Ledger.open(sqlite_url) as setup:
        setup.tool(name="create")(lambda op: None)
        setup.tool(name="charge")(lambda op: None)
        a, b, c = [dead_holder(setup, tool, op) for tool, op in [("create", "a"), ("create", "b"), ("charge", "c")]]

    result = CliRunner().invoke(
        cli, ["reconcile", "--app", f"{name}:ledger", "--app-dir", str(tmp_path), "--review-after", "10m"]
    )
    assert result.exit_code == 0, result.output
    assert "1 confirmed, 1 failed, 1 waiting" in result.output
    with Ledger.open(sqlite_url) as check:
        assert [check.get(r.key).state for r in (a, b, c)] == [  # type: ignore[union-attr]
            State.CONFIRMED, State.FAILED, State.UNKNOWN,
        ]  # fmt: skip

    # A second run (a new process: the CLI closed the first one's ledger), with review after 0 s: the
    # review tool's record is parked (exit 3: a person must look); JSON for machines; the app named
    # through a factory.
    again = make_app(APP_SOURCE.format(url=sqlite_url))
    result = CliRunner().invoke(
        cli,
        ["reconcile", "--app", f"{again}:factory", "--app-dir", str(tmp_path), "--review-after", "0", "--json"],
    )
    assert result.exit_code == 3, result.output
    report = json.loads(result.stdout)
    assert report["counts"]["parked"] == 1
    assert [(r["key"], r["before"], r["after"]) for r in report["records"]] == [(c.key, "unknown", "needs_review")]


def test_reconcile_without_app_still_settles_dead_holders(sqlite_url: str) -> None:
    """Without --app: a warning; expired leases still become unknown, and nothing is guessed."""
    with Ledger.open(sqlite_url) as setup:
        setup.tool(name="create")(lambda op: None)
        rec = dead_holder(setup, "create", "a")
    result = CliRunner().invoke(cli, ["reconcile", "--url", sqlite_url, "--json"])
    assert result.exit_code == 3, result.output  # a record without its tool stays unsettled: cron must see it
    assert "no tools registered" in result.stderr
    report = json.loads(result.stdout)
    assert report["records"][0]["settlement"] == "no_tool"
    with Ledger.open(sqlite_url) as check:
        assert check.get(rec.key).state is State.UNKNOWN  # type: ignore[union-attr]


def test_app_ledger_wins_over_onceonly_url(sqlite_url: str, make_app: Any, tmp_path: Path) -> None:
    """$ONCEONLY_URL names the store only when neither --url nor --app does: with --app, the app's store
    is settled and the other one is never opened; without --app, the variable's store is."""
    name = make_app(APP_SOURCE.format(url=sqlite_url))
    elsewhere = tmp_path / "elsewhere.db"
    env = {"ONCEONLY_URL": f"sqlite:///{elsewhere}"}
    with Ledger.open(sqlite_url) as setup:
        setup.tool(name="create")(lambda op: None)
        mine = dead_holder(setup, "create", "a")

    args = ["reconcile", "--app", f"{name}:ledger", "--app-dir", str(tmp_path), "--json"]
    result = CliRunner().invoke(cli, args, env=env)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [(r["key"], r["settlement"]) for r in report["records"]] == [(mine.key, "confirmed")]
    with Ledger.open(sqlite_url) as check:
        done = check.get(mine.key)
    assert done is not None and done.state is State.CONFIRMED and done.via == "reconcile-probe"
    assert not elsewhere.exists()

    # Without --app (and --url) the variable still chooses the store.
    with Ledger.open(env["ONCEONLY_URL"]) as setup:
        setup.tool(name="create")(lambda op: None)
        theirs = dead_holder(setup, "create", "b")
    result = CliRunner().invoke(cli, ["reconcile", "--json"], env=env)
    assert result.exit_code == 3, result.output  # no tool registered for it
    assert [r["key"] for r in json.loads(result.stdout)["records"]] == [theirs.key]


def test_help_needs_only_the_cli_extra() -> None:
    """`onceonly --help` lists every command, and imports none of the other extras (fast, and it works
    where only onceonly[cli] is installed)."""
    extras = ["fastapi", "starlette", "uvicorn", "sqlalchemy", "httpx", "redis", "psycopg", "prometheus_client"]
    code = textwrap.dedent(f"""
        import sys
        from click.testing import CliRunner
        from onceonly.cli import cli
        result = CliRunner().invoke(cli, ["--help"])
        assert result.exit_code == 0, result.output
        print(result.output)
        print(sorted(m for m in sys.modules if m.split(".")[0] in {extras!r}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    for command in ("demo", "ls", "purge", "reconcile", "resolve", "show", "stats", "tickets"):
        assert f"  {command} " in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_bad_app_and_options_say_what_to_do(sqlite_url: str, make_app: Any, tmp_path: Path) -> None:
    """A wrong --app names the module or attribute; --once with --every is refused."""
    name = make_app("x = 1\ndef needs(a): ...\n")
    runner = CliRunner()
    cases = {
        "no_such_module_here:ledger": "no module",
        f"{name}:missing": "no attribute",
        f"{name}:x": "not an onceonly.Ledger",
        f"{name}:needs": "needs arguments",
        "nocolon": "module:attribute",
    }
    for spec, message in cases.items():
        result = runner.invoke(cli, ["reconcile", "--app", spec, "--app-dir", str(tmp_path)])
        assert result.exit_code == 1 and message in result.output, (spec, result.output)
    result = runner.invoke(cli, ["reconcile", "--url", sqlite_url, "--once", "--every", "5s"])
    assert result.exit_code == 2 and "not both" in result.output
    result = runner.invoke(cli, ["reconcile", "--url", sqlite_url, "--every", "soon"])
    assert result.exit_code == 2 and "not a duration" in result.output


def test_app_that_fails_to_import_is_a_message(make_app: Any, tmp_path: Path) -> None:
    """An --app module that raises while it is imported (its own code, or an import of its own that is
    missing) ends in a message naming the app, the error and its text: no traceback."""
    cases = {
        make_app("raise RuntimeError('boom at import')\n"): "RuntimeError: boom at import",
        make_app("import no_such_dependency_zz\n"): "ModuleNotFoundError: No module named 'no_such_dependency_zz'",
        make_app("def factory():\n    raise OSError('no config file')\n"): "OSError: no config file",
    }
    for name, message in cases.items():
        attr = "factory" if "factory" in (tmp_path / f"{name}.py").read_text() else "ledger"
        result = CliRunner().invoke(cli, ["reconcile", "--app", f"{name}:{attr}", "--app-dir", str(tmp_path)])
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (name, result.output)
        assert f"--app '{name}:{attr}': importing the app failed: {message}" in result.output, result.output


def test_load_ledger_uses_the_app_dir(sqlite_url: str, make_app: Any, tmp_path: Path) -> None:
    """load_ledger imports module:attribute from --app-dir, and its tools come with it."""
    name = make_app(APP_SOURCE.format(url=sqlite_url))
    ledger = load_ledger(f"{name}:ledger", str(tmp_path))
    try:
        assert sorted(ledger.tools) == ["charge", "create"]
    finally:
        ledger.close()


def test_parse_duration() -> None:
    """Durations read as a person writes them."""
    assert [parse_duration(t) for t in ("30s", "5m", "1h", "250ms", "2d", "1.5", " 10 s ")] == [
        30, 300, 3600, 0.25, 172800, 1.5, 10,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("-1s")


def test_resolve_cli_records_who_and_why(sqlite_url: str) -> None:
    """onceonly resolve KEY --confirmed JSON: the record is confirmed, with who and why in its history."""
    with Ledger.open(sqlite_url) as setup:
        setup.tool(name="charge")(lambda op: None)
        rec = dead_holder(setup, "charge", "a")
    args = ["resolve", rec.key, "--url", sqlite_url, "--confirmed", '{"charge": "ch_1"}', "--by", "alice"]
    result = CliRunner().invoke(cli, [*args, "--why", "seen in the PSP dashboard"])
    assert result.exit_code == 0, result.output
    with Ledger.open(sqlite_url) as check:
        done = check.get(rec.key)
    assert done is not None and done.state is State.CONFIRMED and done.result == {"charge": "ch_1"}
    assert done.history[-1]["by"] == "alice" and "seen in the PSP dashboard" in done.history[-1]["reason"]


# --- the proofs: agents killed at random points, reconcilers racing them ------------------------------


def _env(ledger_url: str, effects: Path, faults: float) -> dict[str, str]:
    return {
        **os.environ,
        "ONCEONLY_APP_LEDGER": ledger_url,
        "ONCEONLY_APP_EFFECTS": str(effects),
        "ONCEONLY_APP_FAULTS": str(faults),
    }


def _agent(env: dict[str, str], seed: int, ops: list[str], kills: dict[str, str]) -> dict[str, str]:
    """One agent under a supervisor: a process runs until its next kill; a new one continues after it."""
    ended: dict[str, str] = {}
    start = 0
    for i, op in enumerate(ops):
        if op not in kills and i < len(ops) - 1:
            continue
        stretch = ops[start : i + 1]
        dies = {o: kills[o] for o in stretch if o in kills}
        proc = subprocess.run(
            [sys.executable, AGENT, str(seed + i), json.dumps(stretch), json.dumps(dies)],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        if op in kills:
            assert proc.returncode == -signal.SIGKILL, proc.stderr
        else:
            assert proc.returncode == 0, proc.stderr
            ended.update(json.loads(proc.stdout))
        start = i + 1
    return ended


def _agents(env: dict[str, str], ops: list[str], kills: dict[str, str], n: int = 4) -> dict[str, str]:
    with ThreadPoolExecutor(n) as pool:
        parts = list(pool.map(lambda i: _agent(env, 1000 * i, ops[i::n], kills), range(n)))
    return {op: how for part in parts for op, how in part.items()}


def _reconcile(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ONCEONLY, "reconcile", "--app", "agent_app:app", "--app-dir", str(APP_DIR), *args],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _effects(path: Path) -> dict[str, int]:
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute("SELECT op, COUNT(*) FROM effects GROUP BY op").fetchall())
    finally:
        conn.close()


def _effect_id(path: Path, op: str) -> int:
    conn = sqlite3.connect(path)
    try:
        return int(conn.execute("SELECT rowid FROM effects WHERE op = ? ORDER BY rowid LIMIT 1", (op,)).fetchone()[0])
    finally:
        conn.close()


def _records(url: str) -> dict[str, Record]:
    with Ledger.open(url) as ledger:
        return {rec.args["op"]: rec for rec in ledger.list(limit=10_000)}


def _check_settled(url: str, effects: Path, ops: list[str], *, allow_failed: bool) -> dict[str, Record]:
    """Every operation is confirmed exactly once, failed with no side effect (if allowed), or in review."""
    records, counts = _records(url), _effects(effects)
    assert sorted(records) == sorted(ops), "an operation has no record"
    for op in ops:
        rec, n = records[op], counts.get(op, 0)
        assert n <= 1, f"{op} happened {n} times"
        if rec.state is State.CONFIRMED:
            assert n == 1, f"{op} is confirmed but did not happen"
            assert rec.result["op"] == op
        elif rec.state is State.FAILED and allow_failed:
            assert n == 0, f"{op} is failed but happened"
        else:
            assert rec.state is State.NEEDS_REVIEW, f"{op} is {rec.state.value}"
    return records


def _work_the_review_queue(url: str, effects: Path, records: dict[str, Record]) -> int:
    """A person checks each parked operation and resolves it; the first one through the real CLI."""
    counts = _effects(effects)
    parked = [rec for rec in records.values() if rec.state is State.NEEDS_REVIEW]
    for i, rec in enumerate(parked):
        done = counts.get(rec.args["op"], 0) == 1
        # What the person finds in the table, in the tool's own result shape (resolve checks it).
        found = {"op": rec.args["op"], "id": _effect_id(effects, rec.args["op"])} if done else None
        if i == 0:
            how = ["--confirmed", json.dumps(found)] if done else ["--failed", "not found", "--reset"]
            proc = subprocess.run(
                [ONCEONLY, "resolve", rec.key, "--url", url, *how, "--by", "ops", "--why", "checked the table"],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr
            continue
        with Ledger.open(url) as ledger:
            if done:
                ledger.resolve(rec.key, confirmed=found, by="ops", why="checked the table")
            else:
                ledger.resolve(rec.key, failed="not found", reset=True, by="ops", why="checked the table")
    return len(parked)


def _finish_and_check(url: str, effects: Path, ops: list[str], env: dict[str, str]) -> None:
    """After the reconciler: the agents ask again, a person works the queue, and all is exactly once."""
    _check_settled(url, effects, ops, allow_failed=True)
    # The restarted agents ask for every operation again: failed ones run, confirmed ones replay.
    calm = {**env, "ONCEONLY_APP_FAULTS": "0"}
    _agents(calm, ops, {}, n=2)
    records = _check_settled(url, effects, ops, allow_failed=False)
    _work_the_review_queue(url, effects, records)
    ended = _agents(calm, ops, {}, n=2)
    assert set(ended.values()) == {"confirmed"}
    assert _effects(effects) == dict.fromkeys(ops, 1)
    resolved = [r for r in _records(url).values() if r.via == "resolve"]
    assert all(r.history[-1]["by"] == "ops" and "checked the table" in r.history[-1]["reason"] for r in resolved)


@pytest.mark.slow
def test_sigkilled_agents_then_reconcile(sqlite_url: str, tmp_path: Path) -> None:
    """20 of 200 operations die by SIGKILL (before or after the side effect); one `reconcile --once`
    settles every one: confirmed exactly once, failed with nothing done, or waiting in review."""
    effects = tmp_path / "effects.db"
    env = _env(sqlite_url, effects, faults=0.1)
    ops = [f"op-{n:03d}" for n in range(200)]
    rng = random.Random(20)
    kills = {op: rng.choice(["before", "after"]) for op in rng.sample(ops, 20)}

    _agents(env, ops, kills)
    held = [op for op, rec in _records(sqlite_url).items() if rec.state is State.IN_FLIGHT]
    assert sorted(held) == sorted(kills)  # exactly the killed operations were left held
    time.sleep(LEASE + 0.2)  # their leases run out

    proc = _reconcile(env, "--once", "--review-after", "0", "--json")
    report = json.loads(proc.stdout)
    attention = sum(report["counts"][name] for name in ("parked", "unsettled", "no_tool")) + report["needs_review"]
    assert proc.returncode == (3 if attention else 0), proc.stderr
    records = _check_settled(sqlite_url, effects, ops, allow_failed=True)
    counts = _effects(effects)
    for op, point in kills.items():
        expected = {
            ("before", "effect"): State.FAILED,
            ("after", "effect"): State.CONFIRMED,
        }.get((point, "effect" if int(op[3:]) % 5 else "notify"), State.NEEDS_REVIEW)
        assert records[op].state is expected, (op, point, records[op].history)
        assert counts.get(op, 0) == (1 if point == "after" else 0)
    assert report["counts"]["confirmed"] + report["counts"]["failed"] + report["counts"]["parked"] >= len(kills)

    _finish_and_check(sqlite_url, effects, ops, env)


def _wait_until_none_held(url: str, timeout: float = 30.0) -> None:
    """Poll the ledger until no record is held (pending or in_flight): with every agent gone, only the
    reconcilers can move the dead agents' records on once their leases run out."""
    store = open_store(url)
    try:
        deadline = time.monotonic() + timeout
        while True:
            counts = store.count_by_state()
            if not any(counts.get(s, 0) for s in HELD):
                return
            assert time.monotonic() < deadline, f"records still held after {timeout} s: {counts}"
            time.sleep(0.05)
    finally:
        store.close()


@pytest.mark.slow
def test_two_reconcilers_and_four_agents_at_once(store_url: str, tmp_path: Path) -> None:
    """Two `reconcile --every` processes race four agents (faults, SIGKILLs) on each store: exactly once."""
    effects = tmp_path / "effects.db"
    env = _env(store_url, effects, faults=0.2)
    ops = [f"op-{n:03d}" for n in range(120)]
    rng = random.Random(4)
    kills = {op: rng.choice(["before", "after"]) for op in rng.sample(ops, 12)}

    args = [ONCEONLY, "reconcile", "--app", "agent_app:app", "--app-dir", str(APP_DIR)]
    every = ["--every", "0.1s", "--review-after", "0", "--json"]
    reconcilers = [
        subprocess.Popen(
            [*args, *every, "--by", f"rec-{n}"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for n in range(2)
    ]
    try:
        _agents(env, ops, kills)
        _wait_until_none_held(store_url)  # the killed agents' leases ran out and the reconcilers settled them
    finally:
        for proc in reconcilers:
            proc.send_signal(signal.SIGTERM)
        outputs = [proc.communicate(timeout=30) for proc in reconcilers]
    for proc, (out, err) in zip(reconcilers, outputs, strict=True):
        assert proc.returncode == 0, err
        runs = [json.loads(line) for line in out.splitlines()]
        assert runs, "a reconciler never reported"
    settled = sum(run["counts"][k] for out, _ in outputs for run in map(json.loads, out.splitlines())
                  for k in ("confirmed", "failed", "parked"))  # fmt: skip
    assert settled >= len(kills) // 2  # the reconcilers did settle the dead agents' records

    final = _reconcile(env, "--once", "--review-after", "0")
    in_review = sum(r.state is State.NEEDS_REVIEW for r in _records(store_url).values())
    assert final.returncode == (3 if in_review else 0), final.stderr  # records in review wait for a person
    _finish_and_check(store_url, effects, ops, env)
