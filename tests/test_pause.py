"""The kill switch (``onceonly.pause``) on every store: SQLite, Redis, a Redis Cluster and PostgreSQL.

A paused call raises ``Paused`` before it claims: its body does not run and nothing is written. A
pause by scope refuses that scope alone; resume lets calls run again; a call running when the pause
is set finishes and is recorded. And the proof across processes: four workers call a guarded tool in
a loop, ``onceonly pause`` in a process of its own stops them all within a second (measured), no
refused call leaves a record or an attempt, and ``onceonly resume`` starts them again. Side effects
are rows in a SQLite file, counted there.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import onceonly
from onceonly import Ledger, Paused, State
from onceonly.pause import REFRESH_SECONDS, Pause, matching_pause
from onceonly.stores.base import ControlStore
from tests._workers import count_effects, effects_db
from tests.conftest import empty_store_url
from tests.stores.conftest import fixture_redis_cluster_url  # noqa: F401 - the private Redis Cluster

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 4


@pytest.fixture(name="url", params=["sqlite", "redis", "redis-cluster", "postgres"])
def fixture_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return empty_store_url(request.param, request, tmp_path)


@pytest.fixture(name="ledger")
def fixture_ledger(url: str) -> Iterator[Ledger]:
    ledger = Ledger.open(url)
    yield ledger
    ledger.close()


class Effects:
    """Side effects as rows of a SQLite file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.conn = effects_db(path)

    def add(self, op: str) -> None:
        self.conn.execute("INSERT INTO effects VALUES (?, ?, ?)", (op, "test", time.time()))

    def count(self, op: str) -> int:
        return count_effects(self.path).get(op, 0)


@pytest.fixture(name="effects")
def fixture_effects(tmp_path: Path) -> Iterator[Effects]:
    effects = Effects(tmp_path / "effects.db")
    yield effects
    effects.conn.close()


def _records(ledger: Ledger, tool: str) -> list[onceonly.Record]:
    found: list[onceonly.Record] = []
    after = None
    while True:
        page = ledger.list(tool=tool, after=after, limit=1000)
        found += page
        if len(page) < 1000:
            return found
        after = page[-1].key


def test_a_paused_tool_is_refused_before_it_claims(ledger: Ledger, effects: Effects) -> None:
    """Its body does not run, no record is written, the error names the pause and how to lift it, and
    the model is told it is paused (never the operator's reason). Another tool still runs."""
    assert isinstance(ledger.store, ControlStore)

    @ledger.tool(name="send_email")
    def send_email(to: str) -> str:
        effects.add(f"email {to}")
        return f"sent to {to}"

    @ledger.tool(name="lookup_order")
    def lookup_order(order: str) -> str:
        effects.add(f"lookup {order}")
        return order

    assert send_email("a@example.com") == "sent to a@example.com"
    pause = ledger.pause(tool="send_email", reason="provider incident 4411", by="alice")
    assert ledger.pauses() == [pause] and pause.tool == "send_email" and pause.scope is None

    with pytest.raises(Paused) as refused:
        send_email("b@example.com")
    err = refused.value
    assert (err.tool, err.scope, err.reason) == ("send_email", None, "provider incident 4411")
    assert err.key == send_email.key_for("b@example.com")
    assert (
        "alice" in str(err) and "provider incident 4411" in str(err) and "onceonly resume --tool send_email" in str(err)
    )
    told = onceonly.tell_model(err)
    assert "paused by an operator" in told and "4411" not in told

    assert effects.count("email b@example.com") == 0
    assert ledger.get(send_email.key_for("b@example.com")) is None
    assert [r.attempts for r in _records(ledger, "send_email")] == [1]  # the call before the pause, alone
    assert ledger.stats()["confirmed"] == 1

    assert lookup_order("o-1") == "o-1"  # not paused: another tool
    assert effects.count("lookup o-1") == 1

    assert ledger.resume(tool="send_email") == 1
    assert ledger.pauses() == []
    assert send_email("b@example.com") == "sent to b@example.com"
    assert effects.count("email b@example.com") == 1
    assert ledger.get(send_email.key_for("b@example.com")).attempts == 1  # type: ignore[union-attr]


def test_a_pause_by_scope_refuses_that_scope_alone_and_resume_takes_the_same_names(
    ledger: Ledger, effects: Effects
) -> None:
    @ledger.tool(name="charge")
    def charge(order: str) -> str:
        effects.add(f"charge {order}")
        return order

    ledger.pause(scope="tenant-a", reason="tenant a under investigation")
    with ledger.task("tenant-a"), pytest.raises(Paused) as refused:
        charge("o1")
    assert refused.value.scope == "tenant-a" and refused.value.tool is None
    with ledger.task("tenant-b"):
        assert charge("o1") == "o1"
    assert charge("o1") == "o1"  # the ledger's own scope
    assert effects.count("charge o1") == 2

    # A pause is lifted by the names it was set with: the pause of every call is another one.
    assert ledger.resume() == 0
    assert ledger.resume(scope="tenant-a") == 1
    with ledger.task("tenant-a"):
        assert charge("o1") == "o1"
    assert effects.count("charge o1") == 3
    assert sorted(r.scope for r in _records(ledger, "charge")) == ["default", "tenant-a", "tenant-b"]


def test_a_narrower_pause_names_itself_and_every_pause_is_lifted_with_every() -> None:
    wide = Pause(None, None, "all", "ops", 1.0)
    tool = Pause("charge", None, "tool", "ops", 2.0)
    both = Pause("charge", "tenant-a", "both", "ops", 3.0)
    assert matching_pause([wide, tool, both], "charge", "tenant-a") is both
    assert matching_pause([wide, tool, both], "charge", "tenant-b") is tool
    assert matching_pause([wide, tool, both], "refund", "tenant-a") is wide
    assert matching_pause([tool, both], "refund", "tenant-a") is None


def test_a_running_call_finishes_and_is_recorded_when_a_pause_is_set(ledger: Ledger, effects: Effects) -> None:
    started, release = threading.Event(), threading.Event()

    @ledger.tool(name="slow_charge")
    def slow_charge(order: str) -> str:
        started.set()
        assert release.wait(30)
        effects.add(f"charge {order}")
        return f"charged {order}"

    got: dict[str, object] = {}
    worker = threading.Thread(target=lambda: got.update(out=slow_charge.outcome("o1")))
    worker.start()
    assert started.wait(30)
    ledger.pause(reason="stop everything")
    with pytest.raises(Paused):
        slow_charge("o2")
    release.set()
    worker.join(30)

    out = got["out"]
    assert isinstance(out, onceonly.Outcome) and out.result == "charged o1" and out.state is State.CONFIRMED
    rec = ledger.get(out.key)
    assert rec is not None and rec.state is State.CONFIRMED and rec.attempts == 1
    assert effects.count("charge o1") == 1 and effects.count("charge o2") == 0
    assert len(_records(ledger, "slow_charge")) == 1
    # While paused, the same call again is refused too (a replay is a new call), and records nothing new.
    with pytest.raises(Paused):
        slow_charge("o1")
    assert ledger.get(out.key) == rec


def test_an_async_tool_is_paused_and_a_read_only_tool_never_is(ledger: Ledger, effects: Effects) -> None:
    @ledger.tool(name="async_send")
    async def async_send(to: str) -> str:
        effects.add(f"async {to}")
        return to

    @ledger.tool(name="read_balance", effect="read")
    def read_balance(account: str) -> int:
        effects.add(f"read {account}")
        return 7

    ledger.pause(reason="incident")
    with pytest.raises(Paused):
        asyncio.run(async_send("x"))
    assert read_balance("acc") == 7
    assert effects.count("async x") == 0 and effects.count("read acc") == 1
    with ledger.dry_run() as seen:
        asyncio.run(async_send("x"))
    assert [(e.tool, e.would) for e in seen] == [("async_send", "paused")]
    assert ledger.resume(every=True) == 1
    assert asyncio.run(async_send("x")) == "x"
    assert effects.count("async x") == 1
    assert [r.attempts for r in _records(ledger, "async_send")] == [1]


def test_an_async_call_reads_the_pauses_when_they_are_due(url: str, effects: Effects) -> None:
    """An async tool on another ledger refuses once its reading is due, read through the store's async
    face (``acontrols``), and runs again after the resume, at the next reading."""
    with Ledger.open(url) as operator, Ledger.open(url) as other:

        @other.tool(name="async_notify")
        async def notify(n: int) -> int:
            effects.add("notify")
            return n

        assert asyncio.run(notify(1)) == 1
        operator.pause(tool="async_notify", reason="incident")
        time.sleep(REFRESH_SECONDS + 0.05)
        assert other.runtime.pauses.due()
        with pytest.raises(Paused):
            asyncio.run(notify(2))
        operator.resume(tool="async_notify")
        time.sleep(REFRESH_SECONDS + 0.05)
        assert asyncio.run(notify(2)) == 2
        assert effects.count("notify") == 2 and len(_records(other, "async_notify")) == 2


def test_another_ledger_on_the_store_sees_a_pause_within_its_refresh(url: str, effects: Effects) -> None:
    """A second ledger (as another process has) read the pauses before this one paused: it runs on its
    last reading until the next one, due within REFRESH_SECONDS, and then refuses."""
    with Ledger.open(url) as operator, Ledger.open(url) as other:

        @other.tool(name="notify")
        def notify(n: int) -> int:
            effects.add("notify")
            return n

        notify(0)  # the other ledger has read the pauses: none
        operator.pause(tool="notify", reason="too many messages")
        set_at = time.monotonic()
        n = 0
        while True:
            n += 1
            try:
                notify(n)
            except Paused:
                break
            assert time.monotonic() - set_at < 5, "the pause never reached the other ledger"
            time.sleep(0.005)
        seen_after = time.monotonic() - set_at
        assert seen_after < REFRESH_SECONDS + 0.5, f"refused {seen_after:.3f} s after the pause"
        ran = effects.count("notify")
        assert len(_records(other, "notify")) == ran  # every run recorded, the refused call not
        operator.resume(tool="notify")
        deadline = time.monotonic() + 5
        while True:
            try:
                notify(n)
                break
            except Paused:
                assert time.monotonic() < deadline, "the other ledger never saw the resume"
                time.sleep(0.01)
        assert effects.count("notify") == ran + 1


class _CountedReads:
    """A store's control documents, with each read of a namespace counted."""

    def __init__(self, store: ControlStore) -> None:
        self.store = store
        self.reads = 0

    def controls(self, namespace: str) -> dict[str, dict[str, object]]:
        self.reads += 1
        return self.store.controls(namespace)

    def put_control(self, namespace: str, name: str, doc: dict[str, object]) -> None:
        self.store.put_control(namespace, name, doc)

    def delete_control(self, namespace: str, name: str) -> bool:
        return self.store.delete_control(namespace, name)


def test_calls_read_the_pauses_once_per_half_second_whatever_their_rate(ledger: Ledger, effects: Effects) -> None:
    """Many calls, few reads: the pauses are read when half a second has passed since the last reading,
    never per call (the ledger read them as it opened)."""

    @ledger.tool(name="tick")
    def tick(n: int) -> int:
        effects.add("tick")
        return n

    watch = ledger.runtime.pauses
    assert watch.store is not None
    counted = _CountedReads(watch.store)
    watch.store = counted
    started = time.monotonic()
    calls = 0
    while time.monotonic() - started < 3 * REFRESH_SECONDS or calls < 20:
        calls += 1
        tick(calls)
    elapsed = time.monotonic() - started
    assert effects.count("tick") == calls
    assert 1 <= counted.reads <= elapsed / REFRESH_SECONDS + 1, (counted.reads, calls, elapsed)
    assert counted.reads < calls / 5


def test_the_commands_pause_list_and_resume(ledger: Ledger, url: str, effects: Effects) -> None:
    """``onceonly pause`` names what it paused and how to lift it, and notes a tool no record has (a typo
    pauses nothing that runs); ``pauses`` lists them; ``resume`` of a pause that is not there exits 1,
    naming those in force; ``resume --all`` lifts the rest."""
    from click.testing import CliRunner

    from onceonly.cli import cli

    @ledger.tool(name="send_email")
    def send_email(to: str) -> str:
        effects.add(to)
        return to

    send_email("a@example.com")
    run = CliRunner().invoke
    done = run(cli, ["pause", "--url", url, "--tool", "send_email", "--reason", "incident", "--by", "bob"])
    assert done.exit_code == 0, done.output
    assert "paused tool 'send_email' in every scope (by bob)" in done.output
    assert "onceonly resume --tool send_email" in done.output and "note:" not in done.output
    typo = run(cli, ["pause", "--url", url, "--tool", "send_emial", "--reason", "incident"])
    assert typo.exit_code == 0 and "did you mean 'send_email'?" in typo.output, typo.output
    listed = run(cli, ["pauses", "--url", url, "--json"])
    shown = [(p["tool"], p["by"]) for p in json.loads(listed.output)]
    assert len(shown) == 2 and shown[0] == ("send_email", "bob") and shown[1][0] == "send_emial"
    time.sleep(REFRESH_SECONDS + 0.05)  # the command was another ledger: this one's next reading is due
    with pytest.raises(Paused):
        send_email("b@example.com")

    missing = run(cli, ["resume", "--url", url, "--scope", "tenant-a"])
    assert missing.exit_code == 1 and "no pause of every tool in scope 'tenant-a'" in missing.output
    assert "onceonly resume --tool send_email" in missing.output
    assert run(cli, ["resume", "--url", url, "--all", "--tool", "x"]).exit_code == 2
    lifted = run(cli, ["resume", "--url", url, "--all"])
    assert lifted.exit_code == 0 and "lifted 2 pause(s)" in lifted.output, lifted.output
    assert "no pauses" in run(cli, ["pauses", "--url", url]).output
    time.sleep(REFRESH_SECONDS + 0.05)  # this ledger's reading, due again
    assert send_email("b@example.com") == "b@example.com"
    assert effects.count("b@example.com") == 1


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }


def _rows(path: Path) -> list[tuple[str, str, float]]:
    conn = effects_db(path)
    try:
        return [(op, w, float(at)) for op, w, at in conn.execute("SELECT op, worker, at FROM effects").fetchall()]
    finally:
        conn.close()


def _wait(what: str, ready: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not ready():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


def test_a_pause_from_the_cli_stops_four_processes_within_a_second(url: str, tmp_path: Path) -> None:
    Ledger.open(url).close()  # the ledger exists before the workers and the command open it
    effects = tmp_path / "effects.db"
    effects_db(effects).close()
    names = [f"w{i}" for i in range(WORKERS)]
    logs = [(tmp_path / f"{name}.err").open("w") for name in names]
    workers = [
        subprocess.Popen(
            _python("-m", "tests._pause_worker", url, str(effects), name),
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        for name, log in zip(names, logs, strict=True)
    ]
    try:
        _wait("every worker ran", lambda: {w for op, w, _ in _rows(effects) if op == "run"} == set(names))

        paused = subprocess.run(
            _python("-m", "onceonly", "pause", "--url", url, "--tool", "pause.send", "--reason", "drill", "--json"),
            check=False, env=_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert paused.returncode == 0, paused.stderr
        pause_at = json.loads(paused.stdout.strip().splitlines()[-1])["at"]

        def first_paused() -> dict[str, float]:
            found: dict[str, float] = {}
            for op, w, at in _rows(effects):
                if op == "paused" and at >= pause_at - 1 and w not in found:
                    found[w] = at
            return found

        _wait("every worker was refused", lambda: len(first_paused()) == WORKERS)
        seen = first_paused()
        took = {w: round(at - pause_at, 3) for w, at in seen.items()}
        assert max(took.values()) < 1.0, f"seconds from the pause to each worker's first refusal: {took}"
        print(f"{url.split(':', maxsplit=1)[0]}: the pause reached every worker after {took} s")

        time.sleep(2 * REFRESH_SECONDS)  # refused all along: no side effect after each one's refusal
        rows = _rows(effects)
        late = [(w, at) for op, w, at in rows if op == "run" and at > seen[w]]
        assert late == [], f"side effects after the worker was refused: {late}"
        with Ledger.open(url) as ledger:
            records = _records(ledger, "pause.send")
        runs = sum(1 for op, *_ in rows if op == "run")
        assert len(records) == runs and sum(r.attempts for r in records) == runs  # no attempt for a refusal

        resumed_from = time.time()
        resumed = subprocess.run(
            _python("-m", "onceonly", "resume", "--url", url, "--tool", "pause.send"),
            check=False, env=_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr
        assert "lifted 1 pause" in resumed.stdout

        _wait(
            "every worker ran again",
            lambda: {w for op, w, at in _rows(effects) if op == "run" and at > resumed_from} == set(names),
        )
    finally:
        (tmp_path / "effects.stop").touch()
        for proc in workers:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    for name, proc in zip(names, workers, strict=True):
        assert proc.returncode == 0, (tmp_path / f"{name}.err").read_text()
    with Ledger.open(url) as ledger:
        records = _records(ledger, "pause.send")
        assert ledger.pauses() == []
    runs = sum(1 for op, *_ in _rows(effects) if op == "run")
    assert len(records) == runs and all(r.attempts == 1 and r.state is State.CONFIRMED for r in records)
