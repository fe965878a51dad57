"""SQLite: a reconcile pass reads the held records only when a lease may have run out.

Each process holding leases keeps a locked file in ``<ledger>-owners/`` (stores/_holders.py). These
tests run real worker processes that die (SIGKILL), stall (SIGSTOP) or leave cleanly, and check both
sides: a pass skips the held records while every holder lives, and never misses an abandoned call.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onceonly import Ledger, State
from onceonly.errors import StoreUnavailable
from onceonly.settle import reconcile
from onceonly.stores._holders import FULL_PASS, owners_dir
from onceonly.stores.sqlite import SQLiteStore
from tests._workers import HOLDER_TOOL, count_effects, effects_db, holder_probe
from tests.stores._records import make

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def app(sqlite_url: str, tmp_path: Path) -> Iterator[tuple[Ledger, Path]]:
    """The reconciler's side: a ledger with the workers' tool registered (same name, same probe),
    after its first pass: that one reads everything (no full pass on record) and stamps one, so that
    the passes after it may skip the held records."""
    effects = tmp_path / "effects.db"
    conn = effects_db(effects)
    ledger = Ledger.open(sqlite_url)

    @ledger.tool(name=HOLDER_TOOL, on_unknown="probe", probe=holder_probe(conn), lease=0.6)
    def create(title: str) -> dict[str, Any]:
        raise AssertionError("the reconciler never runs the tool: it probes")

    first = reconcile(ledger)
    assert first.read_held and first.read_held_why == ["no full pass on record"]
    assert not reconcile(ledger).read_held
    yield ledger, effects
    ledger.close()
    conn.close()


def _worker(url: str, effects: Path, then: str, title: str = "ticket-1") -> subprocess.Popen[str]:
    """A ``holder_worker`` process; returns once its tool said it ran (unless it dies at its claim)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    script = "from tests._workers import holder_worker; holder_worker()"
    proc = subprocess.Popen(
        [sys.executable, "-c", script, url, str(effects), then, title],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    if then != "die-after-claim":
        assert proc.stdout.readline().strip() == "sent"
    return proc


def _end(proc: subprocess.Popen[str], *, kill: bool = True) -> int:
    if kill and proc.poll() is None:
        proc.kill()
    code = proc.wait(30)
    assert proc.stdout is not None
    proc.stdout.close()
    return code


def _owners(ledger: Ledger) -> Path:
    store = ledger.store
    assert isinstance(store, SQLiteStore)
    return owners_dir(store.path)


def _holders(ledger: Ledger) -> list[str]:
    directory = _owners(ledger)
    return sorted(n for n in os.listdir(directory) if not n.startswith(".")) if directory.exists() else []


def _file(ledger: Ledger, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((_owners(ledger) / name).read_text())
    return data


def _sleep_past(moment: float | None) -> None:
    """Until a moment on the host's clock (a lease's end) has passed."""
    time.sleep(max(0.0, (moment or 0.0) - time.time()) + 0.1)


def test_a_pass_skips_held_records_while_every_holder_lives(app: tuple[Ledger, Path], sqlite_url: str) -> None:
    ledger, effects = app
    proc = _worker(sqlite_url, effects, "hang")  # alive, its heartbeats keep the lease
    try:
        assert len(_holders(ledger)) == 1
        time.sleep(1.0)  # longer than the lease: only the heartbeats keep it
        report = reconcile(ledger)
        assert not report.read_held and report.lines == []
        [rec] = ledger.list()
        assert rec.state is State.IN_FLIGHT
    finally:
        _end(proc)


def test_a_killed_holder_is_found_once_its_lease_runs_out(app: tuple[Ledger, Path], sqlite_url: str) -> None:
    ledger, effects = app
    proc = _worker(sqlite_url, effects, "die")
    assert _end(proc, kill=False) == -signal.SIGKILL
    [holder] = _holders(ledger)
    [rec] = ledger.list()
    assert rec.state is State.IN_FLIGHT
    if rec.lease_until is not None and rec.lease_until > time.time() + 0.05:
        # Dead, but none of its leases has run out yet: nothing to read for it now.
        assert not reconcile(ledger).read_held
    _sleep_past(rec.lease_until)
    report = reconcile(ledger, wait=5)
    assert report.read_held and report.read_held_why == [f"{holder}: its holder died holding leases"]
    [line] = report.lines
    assert line.after is State.CONFIRMED  # the probe found the effect: never run again
    assert count_effects(effects) == {"ticket-1": 1}
    # Its file says until when it may have held leases (a lease ahead of its latest); the first full
    # pass after that removes it, and the passes after that skip the held records again.
    _sleep_past(_file(ledger, holder)["hi"])
    assert reconcile(ledger).read_held
    assert _holders(ledger) == []
    assert not reconcile(ledger).read_held


def test_a_holder_killed_the_moment_its_claim_is_written_is_found(app: tuple[Ledger, Path], sqlite_url: str) -> None:
    """The lease is published before the claim is written: a worker SIGKILLed right after the write,
    before anything else it would do, is still a dead holder of that lease, and a pass finds it."""
    ledger, effects = app
    proc = _worker(sqlite_url, effects, "die-after-claim")
    assert _end(proc, kill=False) == -signal.SIGKILL
    [holder] = _holders(ledger)
    assert _file(ledger, holder)["held"] == 1
    [rec] = ledger.list()
    assert rec.state is State.IN_FLIGHT
    _sleep_past(rec.lease_until)
    report = reconcile(ledger, wait=5)
    assert report.read_held_why == [f"{holder}: its holder died holding leases"]
    assert [ln.after for ln in report.lines] == [State.FAILED]  # the probe: it never happened
    assert count_effects(effects) == {}


def test_a_stalled_holder_is_found(app: tuple[Ledger, Path], sqlite_url: str) -> None:
    """Alive (its lock held) but stopped: its heartbeats stop, the lease runs out, a pass reads it."""
    ledger, effects = app
    proc = _worker(sqlite_url, effects, "hang")
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        [holder] = _holders(ledger)
        [rec] = ledger.list()
        _sleep_past(rec.lease_until)
        report = reconcile(ledger, wait=5)
        assert report.read_held
        assert report.read_held_why == [f"{holder}: a lease ran out while its holder lives"]
        assert [ln.after for ln in report.lines] == [State.CONFIRMED]
        assert count_effects(effects) == {"ticket-1": 1}
        assert _holders(ledger) == [holder]  # alive: its file stays
    finally:
        _end(proc)


def test_holders_that_end_holding_nothing_leave_nothing_to_read(app: tuple[Ledger, Path], sqlite_url: str) -> None:
    ledger, effects = app
    clean = _worker(sqlite_url, effects, "close")
    assert _end(clean, kill=False) == 0
    assert _holders(ledger) == []  # left cleanly: its file is gone
    hard = _worker(sqlite_url, effects, "exit-hard", "ticket-2")
    assert _end(hard, kill=False) == 0
    assert len(_holders(ledger)) == 1  # ended without finalizers: its file stays, unlocked
    report = reconcile(ledger)
    assert not report.read_held  # it held nothing when it died
    assert _holders(ledger) == []  # and its file is removed by the survey
    assert [r.state for r in ledger.list()] == [State.CONFIRMED, State.CONFIRMED]


def test_a_full_pass_is_due_every_full_every_seconds(tmp_path: Path) -> None:
    now = [1000.0]
    store = SQLiteStore(f"sqlite:///{tmp_path / 'l.db'}")
    with Ledger(store, clock=lambda: now[0]) as ledger:
        assert reconcile(ledger, full_every=60).read_held
        assert not reconcile(ledger, full_every=60).read_held
        now[0] += 59
        assert not reconcile(ledger, full_every=60).read_held
        now[0] += 1
        report = reconcile(ledger, full_every=60)
        assert report.read_held and report.read_held_why == ["a full pass is due"]
        now[0] += 3600
        assert not reconcile(ledger, full_every=None).read_held
        stamp = json.loads((owners_dir(store.path) / FULL_PASS).read_text())
        assert stamp == {"at": 1060.0}
        with pytest.raises(ValueError, match="full_every=0"):
            reconcile(ledger, full_every=0)


def test_a_pass_of_one_scope_removes_no_holder(tmp_path: Path) -> None:
    """A scoped pass reads one scope's records: a dead holder's others may still be held."""
    now = [1000.0]
    url = f"sqlite:///{tmp_path / 'l.db'}"
    store = SQLiteStore(url)
    with Ledger(store, clock=lambda: now[0]) as ledger:
        assert reconcile(ledger).read_held
    rec_store = SQLiteStore(url)
    assert rec_store.insert(make("k1", now=980.0))  # held until 1010
    holder = rec_store._holder.path
    assert holder is not None and holder.exists()
    rec_store._holder.forget()  # as a fork child would: its descriptor closed, the lock gone
    with Ledger(SQLiteStore(url), clock=lambda: now[0]) as ledger:
        now[0] = 1050.0  # past its lease (1010) and the lease after it (hi: 1040)
        assert reconcile(ledger, scope="another").read_held
        assert holder.exists()
        report = reconcile(ledger)
        assert report.read_held and [ln.after for ln in report.lines] == [State.UNKNOWN]
        assert not holder.exists()


def test_a_directory_that_cannot_be_written_fails_the_claim_before_it_is_written(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'l.db'}"
    (tmp_path / "l.db-owners").write_text("not a directory")
    with Ledger.open(url) as ledger:

        @ledger.tool(name="t")
        def t() -> int:
            raise AssertionError("must not run")

        with pytest.raises(StoreUnavailable, match=r"l\.db-owners"):
            t()
        assert ledger.list() == []


def _covers(holder: Any, until: float) -> bool:
    """Does the holder's file cover a lease until ``until``: a count of at least 1, ``lo`` no later?"""
    data = json.loads(holder.path.read_bytes())
    return bool(data["held"] >= 1 and (math.inf if data["lo"] is None else data["lo"]) <= until)


def test_a_lease_published_while_a_refresh_reads_stays_published(tmp_path: Path) -> None:
    """The race that matters, made to happen: a call publishes its lease (without the lock) just after
    a refresh has read what is held, and before the refresh writes. The call must not return before
    the file covers its lease, and the refresh must not write over it."""
    import threading

    from onceonly.stores._holders import Holder

    holder = Holder(tmp_path / "l.db-owners")
    holder.held("early", "o1", 1010.0, 1000.0)
    holder.gone("early", "o1")  # the file says 1 held until a refresh: the call below need not write
    returned = threading.Event()

    class Snapshot(dict):  # type: ignore[type-arg]
        def values(self):  # type: ignore[no-untyped-def]
            seen = list(super().values())  # what the refresh reads ...
            threading.Thread(target=lambda: (holder.held("late", "o2", 1020.0, 1000.0), returned.set())).start()
            returned.wait(0.5)  # ... then the call runs, to its return or to the lock
            return seen

    holder._leases = Snapshot()
    holder.refresh()
    assert returned.wait(5)
    assert _covers(holder, 1020.0)
    holder.close()


def test_a_published_lease_stays_published_while_refreshes_race(tmp_path: Path) -> None:
    """The same property under load: from ``held()`` returning until ``gone()``, the file covers the lease."""
    import threading

    from onceonly.stores._holders import Holder

    holder = Holder(tmp_path / "l.db-owners")
    stop = threading.Event()
    failures: list[float] = []

    def refresher() -> None:
        while not stop.is_set():
            holder.refresh()

    def caller(n: int) -> None:
        for i in range(5000):
            now = 1000.0 + i
            until = now + (1 + (i * 7 + n) % 5)
            holder.held(f"k{n}-{i}", f"o{n}", until, now)
            if not _covers(holder, until):
                failures.append(until)
            holder.gone(f"k{n}-{i}", f"o{n}")

    threads = [threading.Thread(target=refresher)] + [threading.Thread(target=caller, args=(n,)) for n in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads between almost any two bytecodes, to meet the races
    try:
        for t in threads:
            t.start()
        for t in threads[1:]:
            t.join()
    finally:
        stop.set()
        threads[0].join()
        sys.setswitchinterval(interval)
    assert failures == []
    holder.refresh()
    assert holder.path is not None
    assert json.loads(holder.path.read_bytes())["held"] == 0
    holder.close()
    assert not holder.path.exists()  # closed holding nothing: its file goes


def test_a_forked_child_leaves_its_parent_holding(tmp_path: Path) -> None:
    """The child closes the parent's file descriptor it inherited; the parent's lock stays, and the
    child publishes its own leases in a file of its own."""
    import fcntl
    import multiprocessing

    url = f"sqlite:///{tmp_path / 'l.db'}"
    ledger = Ledger.open(url)

    @ledger.tool(name="t")
    def t(n: int) -> int:
        return n

    t(1)
    [parent] = _holders(ledger)
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=t, args=(2,))
    child.start()
    child.join(30)
    assert child.exitcode == 0
    names = _holders(ledger)
    assert parent in names and len(names) == 2  # the child's own file, left without finalizers
    store = ledger.store
    assert isinstance(store, SQLiteStore)
    fd = os.open(owners_dir(store.path) / parent, os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # still the parent's
    finally:
        os.close(fd)
    assert {r.key: r.state for r in ledger.list()} == {t.key_for(1): State.CONFIRMED, t.key_for(2): State.CONFIRMED}
    ledger.close()
    assert _holders(ledger) == [n for n in names if n != parent]


def test_the_cli_says_whether_a_run_read_the_held_records(sqlite_url: str) -> None:
    from click.testing import CliRunner

    from onceonly.cli import cli

    with Ledger.open(sqlite_url) as ledger:
        ledger.tool(name="t")(lambda n: n)(1)  # a ledger file, and a holder that closed holding nothing
    runs = [json.loads(CliRunner().invoke(cli, ["reconcile", "--url", sqlite_url, "--json"]).stdout) for _ in range(2)]
    assert [(r["read_held"], r["read_held_why"]) for r in runs] == [(True, ["a full pass is due"]), (False, [])]
    due = CliRunner().invoke(cli, ["reconcile", "--url", sqlite_url, "--json", "--full-every", "1ms"])
    assert json.loads(due.stdout)["read_held_why"] == ["a full pass is due"]
    bad = CliRunner().invoke(cli, ["reconcile", "--url", sqlite_url, "--full-every", "0s"])
    assert bad.exit_code == 2 and "--full-every needs a positive duration" in bad.output


def test_a_store_used_without_a_ledger_refreshes_its_file(tmp_path: Path) -> None:
    """The server middleware writes leases through a bare store: its holder's own thread brings the
    file back to what is held, so passes over that store skip the held records again."""
    from onceonly import states as st

    store = SQLiteStore(f"sqlite:///{tmp_path / 'l.db'}")
    now = time.time()
    rec = make("k1", now=now)
    assert store.insert(rec)
    done = st.confirm(rec, result_json="{}", now=now, ttl=60, via="run", by="host:1:1")
    assert store.swap(done, rec)
    path = store._holder.path
    assert path is not None
    deadline = time.monotonic() + 5
    while json.loads(path.read_bytes())["held"] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads(path.read_bytes())["held"] == 0
    store.close()
    assert not path.exists()


def test_a_closed_store_publishes_nothing(tmp_path: Path) -> None:
    """A write after close is refused before anything is published: no file is left behind."""
    store = SQLiteStore(f"sqlite:///{tmp_path / 'l.db'}")
    store.close()
    with pytest.raises(StoreUnavailable, match="was closed"):
        store.insert(make("k1"))
    assert not owners_dir(store.path).exists()


# --- the directory is trusted only as far as it must be: a pass removes files in it --------------

_DEAD_EMPTY = '{"held": 0, "lo": null, "hi": null, "pid": 1, "host": "web-1", "since": "2026-12-01T00:00:00Z"}\n'
_VICTIMS = {"backup.tar": b"\x00tar", "id_ed25519": b"-----BEGIN OPENSSH PRIVATE KEY-----\n", "thesis.tex": b"\\x"}


def _victims(directory: Path) -> dict[str, bytes]:
    """Files that are not onceonly's, among them one with a holder's name saying it died holding nothing."""
    directory.mkdir()
    files = {**_VICTIMS, "web-1-4242-0123abcd": _DEAD_EMPTY.encode()}
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return files


def _contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def _dead_holder(url: str, now: float) -> Path:
    """A holder that died holding one lease (written at ``now``, held 30 s), its file left unlocked."""
    store = SQLiteStore(url)
    assert store.insert(make("k1", now=now))
    path = store._holder.path
    assert path is not None
    store._holder.forget()  # as a fork child would: its descriptor closed, the lock gone
    return path


def test_a_symlinked_owners_directory_is_neither_followed_nor_cleaned(tmp_path: Path) -> None:
    """``<ledger>-owners`` pointing elsewhere: a pass deletes nothing there and writes nothing, reads
    the held records and says why; a guarded call is refused before it runs, naming what to do."""
    from click.testing import CliRunner

    from onceonly.cli import cli

    url = f"sqlite:///{tmp_path / 'l.db'}"
    target = tmp_path / "home"
    files = _victims(target)
    SQLiteStore(url).close()  # the ledger file
    (tmp_path / "l.db-owners").symlink_to(target)
    runs = [CliRunner().invoke(cli, ["reconcile", "--url", url, "--json"]) for _ in range(2)]
    assert _contents(target) == files  # every file there, as it was, and nothing added
    for run in runs:
        assert run.exit_code == 0, run.output
        report = json.loads(run.stdout)
        assert report["read_held"] and "symbolic link" in report["read_held_why"][0]
    with Ledger.open(url) as ledger:

        @ledger.tool(name="t")
        def t() -> int:
            raise AssertionError("must not run")

        with pytest.raises(StoreUnavailable, match=r"l\.db-owners is a symbolic link: .* remove l\.db-owners"):
            t()
        assert ledger.list() == []
    assert _contents(target) == files


def test_a_directory_swapped_for_a_link_after_the_survey_is_not_cleaned(tmp_path: Path) -> None:
    """The survey saw a dead holder's file to remove after the pass; meanwhile the directory became a
    link to another with a file of that name. The removal happens in the directory surveyed, or not at all."""
    url = f"sqlite:///{tmp_path / 'l.db'}"
    holder = _dead_holder(url, now=980.0)
    store = SQLiteStore(url)
    looked = store.lease_survey(1050.0, None)  # past its lease (1010) and the one after it (hi: 1040)
    assert looked.needed and looked.why == [f"{holder.name}: its holder died holding leases"]
    owners = owners_dir(store.path)
    owners.rename(tmp_path / "moved")
    target = tmp_path / "home"
    files = _victims(target)
    (target / holder.name).write_bytes(b"a file of the same name, not onceonly's")
    files[holder.name] = (target / holder.name).read_bytes()
    owners.symlink_to(target)
    looked.done()
    assert _contents(target) == files
    store.close()


def _reconcile_within(ledger: Ledger, fifos: list[Path], seconds: float = 10.0) -> Any:
    """A pass on another thread, given ``seconds``; a pass blocked opening a FIFO is let go (a writer
    opens it) so that the test ends either way."""
    import threading

    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(reconcile(ledger)), daemon=True)
    thread.start()
    thread.join(seconds)
    finished = not thread.is_alive()
    if not finished:
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
    assert finished, "the reconcile pass blocked on a FIFO in the owners directory"
    return result[0]


@pytest.mark.parametrize("name", ["web-1-4242-0123abcd", ".web-1-4242-0123abcd.new", FULL_PASS, "notes"])
def test_a_fifo_in_the_owners_directory_does_not_hold_up_a_pass(tmp_path: Path, name: str) -> None:
    """A FIFO planted there (under a holder's name, a half-made one's, the stamp's, any other): the
    pass opens no such file, finishes, and settles the abandoned call it has to."""
    url = f"sqlite:///{tmp_path / 'l.db'}"
    _dead_holder(url, now=980.0)
    fifo = owners_dir(tmp_path / "l.db") / name
    os.mkfifo(fifo)
    with Ledger(SQLiteStore(url), clock=lambda: 1050.0) as ledger:
        report = _reconcile_within(ledger, [fifo])
        assert report.read_held
        assert [(ln.key, ln.after) for ln in report.lines] == [("k1", State.UNKNOWN)]
    if name != FULL_PASS:  # not onceonly's: left alone (the stamp's name is replaced by the stamp)
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_directory_other_users_can_write_is_not_used_to_skip_reads(
    tmp_path: Path, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Another user who can write the directory could remove a dead holder's file (or write the
    stamp), and so hide an abandoned call: every pass reads the held records, changes nothing there,
    and says why; calls go on, with a warning."""
    url = f"sqlite:///{tmp_path / 'l.db'}"
    owners = tmp_path / "l.db-owners"
    owners.mkdir()
    owners.chmod(mode)
    (owners / "web-1-4242-0123abcd").write_text(_DEAD_EMPTY)  # would be removed in a trusted directory
    with Ledger.open(url) as ledger:

        @ledger.tool(name="t")
        def t(n: int) -> int:
            return n

        caplog.set_level(logging.WARNING, logger="onceonly.stores.sqlite")
        assert t(1) == 1
        for _ in range(2):
            report = reconcile(ledger)
            assert report.read_held
            assert [w.split(" (")[0] for w in report.read_held_why] == ["l.db-owners is writable by other users"]
        assert (owners / "web-1-4242-0123abcd").read_text() == _DEAD_EMPTY
        assert not (owners / FULL_PASS).exists()
        warned = [r.getMessage() for r in caplog.records if "writable by other users" in r.getMessage()]
        assert len(warned) == 3  # the call's process when it made its file, and each pass
    owners.chmod(0o755)  # as the message says: then the directory is used again
    with Ledger.open(url) as ledger:
        assert reconcile(ledger).read_held  # the first full pass on record
        assert not reconcile(ledger).read_held
        assert not (owners / "web-1-4242-0123abcd").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to give the directory to another user")
def test_a_directory_of_another_user_is_not_used_to_skip_reads(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'l.db'}"
    owners = tmp_path / "l.db-owners"
    owners.mkdir(mode=0o755)
    (owners / "web-1-4242-0123abcd").write_text(_DEAD_EMPTY)
    os.chown(owners, 65534, 65534)
    with Ledger.open(url) as ledger:
        for _ in range(2):
            report = reconcile(ledger)
            assert report.read_held and "belongs to uid 65534" in report.read_held_why[0]
    assert (owners / "web-1-4242-0123abcd").read_text() == _DEAD_EMPTY
    assert not (owners / FULL_PASS).exists()


def test_a_pass_removes_no_file_under_a_name_onceonly_never_writes(tmp_path: Path) -> None:
    """Files planted under other names are neither read nor removed; a dead holder's own file is."""
    url = f"sqlite:///{tmp_path / 'l.db'}"
    with Ledger.open(url) as ledger:
        assert reconcile(ledger).read_held  # makes the directory, stamps a full pass
        owners = _owners(ledger)
        planted = {
            "notes.txt": b"mine",
            "web-1-4242-XYZ": b"{}",
            ".hidden": b"",
            "web-1-4242-0123abcd.bak": _DEAD_EMPTY.encode(),
            ".full-pass.old": b"",
        }
        for name, data in planted.items():
            (owners / name).write_bytes(data)
        (owners / "web-1-4242-0123abcd").write_text(_DEAD_EMPTY)  # onceonly's name: a dead holder's
        reports = [reconcile(ledger, full_every=1e-9) for _ in range(2)]
        assert {n: (owners / n).read_bytes() for n in planted} == planted
        assert [r.read_held_why for r in reports] == [["a full pass is due"]] * 2
        assert not (owners / "web-1-4242-0123abcd").exists()


def test_a_pass_passes_over_directories_and_links_there(tmp_path: Path) -> None:
    """A directory, and a link under a holder's name to a file that reads as a dead holder's: the
    pass neither opens nor removes them (a link is not followed), and does not fail on them."""
    url = f"sqlite:///{tmp_path / 'l.db'}"
    with Ledger.open(url) as ledger:
        assert reconcile(ledger).read_held
        owners = _owners(ledger)
        (owners / "web-1-4242-0000000a").mkdir()
        (owners / "web-1-4242-0000000a" / "kept").write_text("kept")
        outside = tmp_path / "outside.json"
        outside.write_text(_DEAD_EMPTY)
        (owners / "web-1-4242-0000000b").symlink_to(outside)
        for _ in range(2):
            assert reconcile(ledger, full_every=1e-9).read_held_why == ["a full pass is due"]
        assert (owners / "web-1-4242-0000000a" / "kept").read_text() == "kept"
        assert (owners / "web-1-4242-0000000b").is_symlink() and outside.read_text() == _DEAD_EMPTY


def test_a_host_name_of_any_characters_makes_a_holder_a_pass_recognises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file's name is made of the host name's safe characters, and is what a pass looks for."""
    import socket

    from onceonly.stores._holders import Holder

    monkeypatch.setattr(socket, "gethostname", lambda: ".web 1/über.example")
    url = f"sqlite:///{tmp_path / 'l.db'}"
    holder = _dead_holder(url, now=980.0)
    assert holder.name.startswith("web_1__ber.example-")
    assert json.loads(holder.read_text())["host"] == ".web 1/über.example"
    looked = SQLiteStore(url).lease_survey(1050.0, None)
    assert looked.why == [f"{holder.name}: its holder died holding leases"] and looked.stale == [holder.name]
    looked.done()
    assert not holder.exists()
    live = Holder(tmp_path / "other-owners")
    live.held("k", "o", 2000.0, 1000.0)
    assert live.path is not None and live.path.exists()
    live.gone("k", "o")
    live.close()  # holding nothing: it removes its own file
    assert not live.path.exists()


def test_the_directory_is_made_writable_by_its_owner_alone(tmp_path: Path) -> None:
    """Whatever the umask (002 is common): a directory onceonly makes is used to skip reads."""
    old = os.umask(0o002)
    try:
        with Ledger.open(f"sqlite:///{tmp_path / 'l.db'}") as ledger:
            ledger.tool(name="t")(lambda n: n)(1)
            assert stat.S_IMODE(_owners(ledger).stat().st_mode) == 0o755
            assert reconcile(ledger).read_held
            assert not reconcile(ledger).read_held
    finally:
        os.umask(old)


def test_a_holder_leaving_after_its_directory_was_swapped_removes_only_its_own_file(tmp_path: Path) -> None:
    """A process removes its file when it closes holding nothing: through the directory it made the
    file in, not through whatever now bears that directory's name."""
    from onceonly.stores._holders import Holder

    owners = tmp_path / "l.db-owners"
    holder = Holder(owners)
    holder.held("k", "o", 2000.0, 1000.0)
    holder.gone("k", "o")
    assert holder.path is not None
    name = holder.path.name
    owners.rename(tmp_path / "moved")
    target = tmp_path / "home"
    target.mkdir()
    (target / name).write_text("not onceonly's")
    owners.symlink_to(target)
    holder.close()
    assert (target / name).read_text() == "not onceonly's"
    assert not (tmp_path / "moved" / name).exists()
