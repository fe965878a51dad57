"""Moving a ledger to another store (`onceonly copy`, `export`, `import`): from SQLite into PostgreSQL
and Redis on their real servers, with a second copy racing the first, and then every operation asked
again in the target through a guarded tool that counts its side effects: nothing runs twice, a
conflict is refused and nothing is lost, a held record is reported (or copied as unknown, never run
blindly), a second run picks up what settled, and an export imports back equal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from onceonly import Ledger, OutcomeUnknown, State
from onceonly.cli import cli
from onceonly.states import Record
from onceonly.stores import open_store
from onceonly.transfer import Action, Report, copy_records, plan, store_records
from tests.conftest import empty_store_url
from tests.stores.conftest import fixture_redis_cluster_url  # noqa: F401 - the private Redis Cluster

ROOT = Path(__file__).resolve().parent.parent
ORDERS = 40


def _run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.Popen(
        [sys.executable, "-m", "onceonly", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


class Shop:
    """A ledger with two guarded tools whose bodies count the side effects they make."""

    def __init__(self, url: str, *, gate: threading.Event | None = None) -> None:
        self.ledger = Ledger.open(url)
        self.effects: list[str] = []
        self.gate = gate

        @self.ledger.tool(name="charge")
        def charge(order: str, amount: int) -> dict[str, Any]:
            if self.gate is not None and order == "slow":
                self.gate.wait(30)
            self.effects.append(order)
            return {"charged": order, "amount": amount}

        @self.ledger.tool(name="refund", on_unknown="review")
        def refund(order: str) -> None:
            self.effects.append(f"refund {order}")
            raise TimeoutError("read timed out")

        self.charge = charge
        self.refund = refund

    def records(self) -> dict[str, Record]:
        return {r.key: r for r in store_records(self.ledger.store)}

    def close(self) -> None:
        self.ledger.close()


@pytest.fixture(name="source")
def fixture_source(tmp_path: Path) -> Iterator[Shop]:
    """A SQLite ledger with ORDERS confirmed charges and one refund parked for review (its answer lost)."""
    shop = Shop(f"sqlite:///{tmp_path / 'source.db'}")
    for n in range(ORDERS):
        shop.charge(f"o{n}", n)
    with pytest.raises(OutcomeUnknown):
        shop.refund("o1")
    yield shop
    shop.close()


@pytest.fixture(name="target_url", params=["postgres", "redis", "redis-cluster"])
def fixture_target_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return empty_store_url(request.param, request, tmp_path)


def _summary(output: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
    return loaded


def test_two_copies_at_once_leave_one_copy_of_each_record_and_nothing_runs_again(source: Shop, target_url: str) -> None:
    """Two copies race into an empty target; one record is held in the source while they run. Each
    settled record lands once, byte for byte; the held one is reported by both and not copied; then
    every call asked again in the target is a replay or an unknown, and no side effect happens."""
    gate = threading.Event()
    source.gate = gate
    holder = threading.Thread(target=source.charge, args=("slow", 99))
    holder.start()
    try:
        while not any(r.state is State.IN_FLIGHT for r in source.records().values()):
            threading.Event().wait(0.01)
        url = source.ledger.store.url
        rival = _spawn("copy", "--from", url, "--to", target_url, "--json")
        mine = _run("copy", "--from", url, "--to", target_url, "--json")
        out, err = rival.communicate(timeout=120)
    finally:
        gate.set()
        holder.join()
    assert mine.exit_code == 3, mine.output
    assert rival.returncode == 3, (out, err)
    reports = [_summary(mine.output), _summary(out)]
    settled = ORDERS + 1
    for report in reports:
        assert report["read"] == settled + 1
        assert report["in_flight"] == 1 and report["conflict"] == 0
        assert [r["action"] for r in report["records"]] == ["in_flight"]
    # Each record was written by exactly one of the two; the other found it identical.
    assert sum(r["copied"] for r in reports) == settled
    assert sum(r["identical"] for r in reports) == settled

    before = source.records()
    target = Shop(target_url)
    try:
        copied = target.records()
        slow_key = source.charge.key_for("slow", 99)
        assert slow_key not in copied
        assert {k: v for k, v in before.items() if k != slow_key} == copied
        source_effects = len(source.effects)
        for n in range(ORDERS):
            assert target.charge(f"o{n}", n) == {"charged": f"o{n}", "amount": n}
        with pytest.raises(OutcomeUnknown):
            target.refund("o1")
        assert target.effects == []
        assert len(source.effects) == source_effects

        # The held record settled in the source: a run again copies it, and it replays in the target.
        again = _run("copy", "--from", url, "--to", target_url, "--json")
        assert again.exit_code == 0, again.output
        report = _summary(again.output)
        assert (report["copied"], report["identical"], report["in_flight"]) == (1, settled, 0)
        assert target.charge("slow", 99) == {"charged": "slow", "amount": 99}
        assert target.effects == []
    finally:
        target.close()


def test_a_different_record_in_the_target_is_a_conflict_and_kept(source: Shop, target_url: str) -> None:
    """The target already ran one of the operations itself (another record of that key): the copy
    refuses to write over it, copies everything else, says which key and exits 4."""
    target = Shop(target_url)
    try:
        target.charge("o3", 3)
        theirs = target.ledger.get(target.charge.key_for("o3", 3))
        result = _run("copy", "--from", source.ledger.store.url, "--to", target_url)
        assert result.exit_code == 4, result.output
        assert "CONFLICT" in result.output and target.charge.key_for("o3", 3) in result.output
        assert "1 conflicts" in result.output
        assert target.ledger.get(target.charge.key_for("o3", 3)) == theirs
        assert len(target.records()) == ORDERS + 1
        for n in range(ORDERS):
            target.charge(f"o{n}", n)
        assert target.effects == ["o3"]  # its own first run, and nothing since
        # A second run says the same and still writes nothing over it.
        assert _run("copy", "--from", source.ledger.store.url, "--to", target_url).exit_code == 4
        assert target.ledger.get(target.charge.key_for("o3", 3)) == theirs
    finally:
        target.close()


def test_held_records_copied_as_unknown_are_never_run_and_update_once_settled(source: Shop, target_url: str) -> None:
    """--in-flight=unknown: the held record lands as unknown, so a call in the target settles it (here:
    parks it for review) instead of running it; once it confirmed in the source, a run again updates
    the target's copy, which was still the older version, and the call replays."""
    gate = threading.Event()
    source.gate = gate
    holder = threading.Thread(target=source.charge, args=("slow", 99))
    holder.start()
    target: Shop | None = None
    try:
        while not any(r.state is State.IN_FLIGHT for r in source.records().values()):
            threading.Event().wait(0.01)
        url = source.ledger.store.url
        result = _run("copy", "--from", url, "--to", target_url, "--in-flight=unknown", "--json")
        assert result.exit_code == 0, result.output
        report = _summary(result.output)
        assert (report["copied"], report["copied_as_unknown"], report["in_flight"]) == (ORDERS + 2, 1, 0)
        target = Shop(target_url)
        key = source.charge.key_for("slow", 99)
        stale = target.records()[key]
        assert stale.state is State.UNKNOWN
        again = _summary(_run("copy", "--from", url, "--to", target_url, "--in-flight=unknown", "--json").output)
        assert again["identical"] == ORDERS + 2  # the same attempt, copied as unknown already
    finally:
        gate.set()
        holder.join()
    assert target is not None
    try:
        assert source.ledger.get(key).state is State.CONFIRMED
        settled = _summary(_run("copy", "--from", url, "--to", target_url, "--json").output)
        assert settled["updated"] == 1 and settled["conflict"] == 0
        stored = target.records()[key]
        assert (stored.state, stored.result) == (State.CONFIRMED, {"charged": "slow", "amount": 99})
        assert stored.version > stale.version
        # A caller of the target that read the unknown copy (a reconciler about to park it) loses
        # its compare-and-set against the update instead of writing over the confirmed outcome.
        from onceonly.states import park

        assert not target.ledger.store.swap(park(stale, now=stale.updated_at + 1, reason="t", by="t"), stale)
        assert target.records()[key] == stored
        assert target.charge("slow", 99) == {"charged": "slow", "amount": 99}
        assert target.effects == []
    finally:
        target.close()


def test_the_target_moved_on_is_kept_and_a_lost_race_plans_again(source: Shop, tmp_path: Path) -> None:
    """Pure plans: a target whose record moved on after the copy is newer and kept; an update carries
    a version above the target's, so that a caller holding the target's copy cannot write over it."""
    key = source.charge.key_for("o2", 2)
    rec = source.ledger.get(key)
    assert rec is not None
    assert plan(rec, None, now=0.0).action is Action.INSERT
    assert plan(rec, rec, now=0.0).action is Action.SKIP
    refund = source.ledger.get(source.refund.key_for("o1"))
    assert refund is not None and refund.state is State.NEEDS_REVIEW
    settled = source.ledger.resolve(refund.key, confirmed={"refunded": True}, by="ops")
    step = plan(settled, refund, now=0.0)
    assert step.action is Action.UPDATE and step.write is not None and step.write.version > refund.version
    assert plan(refund, settled, now=0.0).action is Action.NEWER
    other = source.ledger.get(source.charge.key_for("o3", 3))
    assert other is not None
    from onceonly.states import replace

    assert plan(rec, replace(other, key=rec.key), now=0.0).action is Action.CONFLICT


def _lines(text: str) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in text.splitlines()]
    return rows[1:]  # the header names the store and the time


def test_export_then_import_into_another_store_is_equal(source: Shop, target_url: str, tmp_path: Path) -> None:
    """export → import → export gives the same records; the imported ledger replays every call."""
    exported = _run("export", "--url", source.ledger.store.url)
    assert exported.exit_code == 0, exported.output
    dump = tmp_path / "ledger.jsonl"
    dump.write_text(exported.stdout, encoding="utf-8")
    first = json.loads(exported.stdout.splitlines()[0])
    assert (first["format"], first["version"]) == ("onceonly-ledger", 1)
    imported = _run("import", "--url", target_url, str(dump), "--json")
    assert imported.exit_code == 0, imported.output
    assert _summary(imported.stdout)["copied"] == ORDERS + 1
    again = _run("export", "--url", target_url)
    assert _lines(again.stdout) == _lines(exported.stdout)
    # Imported twice: everything identical, nothing written.
    assert _summary(_run("import", "--url", target_url, str(dump), "--json").stdout)["identical"] == ORDERS + 1
    target = Shop(target_url)
    try:
        for n in range(ORDERS):
            target.charge(f"o{n}", n)
        assert target.effects == []
    finally:
        target.close()


def _good_file(source: Shop) -> list[str]:
    return _run("export", "--url", source.ledger.store.url).stdout.splitlines()


def _edit(lines: list[str], n: int, **changes: Any) -> list[str]:
    row = json.loads(lines[n - 1])
    row.update(changes)
    for name, value in changes.items():
        if value is ...:
            del row[name]
    return [*lines[: n - 1], json.dumps(row).replace('"NUMBER"', "1e999"), *lines[n:]]


BAD: dict[str, tuple[Any, str]] = {
    "not JSON": (lambda ls: [*ls[:2], '{"key": "x",', *ls[3:]], "line 3: not JSON"),
    "a field missing": (lambda ls: _edit(ls, 4, fence=...), "line 4: not a record of format 1 (missing fence)"),
    "an unknown field": (lambda ls: _edit(ls, 5, colour="red"), "line 5: not a record of format 1 (unknown colour)"),
    "a bad state": (lambda ls: _edit(ls, 2, state="done"), "state 'done' is not one of"),
    "text for a number": (lambda ls: _edit(ls, 6, attempts="2"), "line 6 ("),
    "a history that is not one": (lambda ls: _edit(ls, 7, history_json='{"a": 1}'), "line 7:"),
    "a key onceonly refuses": (lambda ls: _edit(ls, 8, key="has space"), "line 8:"),
    "a second record of a key": (lambda ls: [*ls[:3], ls[2], *ls[3:]], "line 4: a second record of key"),
    "no header": (lambda ls: ls[1:], "line 1: not an onceonly export"),
    "another format version": (lambda ls: _edit(ls, 1, version=2), "format version 2"),
    "cut short": (lambda ls: ls[:-5], "without its end line: it was cut short"),
    "cut after a whole record": (lambda ls: ls[:-1], "without its end line"),
    "records added after the export": (lambda ls: [*ls[:-1], ls[-3], ls[-1]], "a second record of key"),
    "an empty file": (lambda ls: [], "the file is empty"),
    "a count too large for a store": (
        lambda ls: _edit(ls, 3, attempts=2**40),
        "attempts=1099511627776 is out of range",
    ),
    "a time that is not finite": (lambda ls: _edit(ls, 3, created_at="NUMBER"), "created_at holds inf"),
    "NaN": (lambda ls: [*ls[:3], ls[3].replace('"conflicts": 0', '"conflicts": NaN'), *ls[4:]], "line 4: not JSON"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_file_names_the_line_and_imports_nothing(source: Shop, tmp_path: Path, case: str) -> None:
    """Each kind of damage is refused with the line and what is wrong, before anything is written:
    the target is not even made."""
    edit, message = BAD[case]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(line + "\n" for line in edit(_good_file(source))), encoding="utf-8")
    target = tmp_path / "target.db"
    result = _run("import", "--url", f"sqlite:///{target}", str(bad))
    assert result.exit_code == 1, result.output
    assert message in result.output, result.output
    assert "nothing was imported" in result.output
    assert not target.exists()


def test_a_file_that_is_not_text_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    result = _run("import", "--url", f"sqlite:///{tmp_path / 't.db'}", str(bad))
    assert result.exit_code == 1 and "not UTF-8" in result.output


def test_copy_refuses_a_missing_source_and_the_same_store(tmp_path: Path) -> None:
    missing = f"sqlite:///{tmp_path / 'nope.db'}"
    result = _run("copy", "--from", missing, "--to", f"sqlite:///{tmp_path / 't.db'}")
    assert result.exit_code == 1 and "no ledger at" in result.output
    assert not (tmp_path / "nope.db").exists()
    assert _run("copy", "--from", missing, "--to", missing).exit_code == 2


def test_the_target_store_is_opened_with_its_own_codecs(source: Shop, target_url: str) -> None:
    """What a copy wrote is read back by the store's own decoder as the source's record, field for field."""
    assert _run("copy", "--from", source.ledger.store.url, "--to", target_url).exit_code == 0
    store = open_store(target_url)
    try:
        assert {r.key: r for r in store_records(store, batch=7)} == source.records()
    finally:
        store.close()


def test_copies_racing_in_threads_write_each_record_once_and_update_it_once(source: Shop, target_url: str) -> None:
    """Four copies start together on one target, each with its own connection: every record is
    inserted by exactly one of them, and, once the source moved on, updated by exactly one; the others
    lose the compare-and-set, read what won and find it identical."""
    for n in range(ORDERS, 300):
        source.charge(f"o{n}", n)
    records = list(store_records(source.ledger.store))

    def race(batch: list[Record]) -> list[Report]:
        start = threading.Barrier(4)
        reports: list[Report] = []

        def one() -> None:
            store = open_store(target_url)
            try:
                start.wait()
                reports.append(copy_records(batch, store))
            finally:
                store.close()

        threads = [threading.Thread(target=one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(reports) == 4
        return reports

    first = race(records)
    assert sum(r.counts[Action.INSERT] for r in first) == len(records)
    assert all(r.counts[Action.INSERT] + r.counts[Action.SKIP] == len(records) for r in first)
    writers = sum(1 for r in first if r.counts[Action.INSERT])
    # The source moves on: every record gets a later version (a conflict noted, as a late duplicate is).
    from onceonly.states import note_conflict, replace

    for rec in records:
        if rec.state is State.CONFIRMED:
            assert source.ledger.store.swap(note_conflict(rec, now=rec.updated_at + 1, reason="later", by="t"), rec)
        else:
            source.ledger.resolve(rec.key, confirmed={"refunded": True}, by="ops")
    later = list(store_records(source.ledger.store))
    second = race(later)
    assert sum(r.counts[Action.UPDATE] for r in second) == len(later)
    assert all(r.counts[Action.UPDATE] + r.counts[Action.SKIP] == len(later) for r in second)
    store = open_store(target_url)
    try:
        stored = {r.key: r for r in store_records(store)}
    finally:
        store.close()
    for rec in later:
        got = stored.pop(rec.key)
        assert replace(got, version=rec.version) == rec
    assert stored == {}
    assert writers >= 2, "the copies did not overlap: the race was not run"


def test_a_record_settled_in_both_stores_is_a_conflict_and_one_settled_in_the_target_is_kept(
    source: Shop, target_url: str
) -> None:
    """After a copy, a person settles the parked refund in the target (it never happened): a copy
    again keeps it as newer there (exit 0). Someone then settles it otherwise in the source: the
    copy refuses to write over the target's outcome (exit 4) and the target's record is unchanged."""
    url = source.ledger.store.url
    assert _run("copy", "--from", url, "--to", target_url).exit_code == 0
    target = Shop(target_url)
    try:
        key = source.refund.key_for("o1")
        mine = target.ledger.resolve(key, failed="never reached the bank", by="alice")
        kept = _run("copy", "--from", url, "--to", target_url, "--json")
        assert kept.exit_code == 0, kept.output
        assert _summary(kept.output)["newer_in_target"] == 1
        source.ledger.resolve(key, confirmed={"refunded": True}, by="bob")
        refused = _run("copy", "--from", url, "--to", target_url, "--json")
        assert refused.exit_code == 4, refused.output
        listed = _summary(refused.output)["records"]
        assert [(r["key"], r["action"]) for r in listed] == [(key, "conflict")]
        assert "moved on in both stores" in listed[0]["why"]
        assert target.ledger.get(key) == mine
        assert target.effects == []
    finally:
        target.close()


def test_no_password_reaches_the_output(source: Shop, target_url: str) -> None:
    """A store URL with a password: copy, export and import print it masked, and the file holds none."""
    from tests._urls import SECRET, with_password

    secret_url = with_password(target_url)
    copied = _run("copy", "--from", source.ledger.store.url, "--to", secret_url)
    assert copied.exit_code == 0 and SECRET not in copied.output
    exported = _run("export", "--url", secret_url)
    assert exported.exit_code == 0 and SECRET not in exported.output


def test_back_again_into_sqlite_is_the_same_ledger(source: Shop, target_url: str, tmp_path: Path) -> None:
    """SQLite → the server → a new SQLite file: the records arrive as they left, field for field."""
    back = f"sqlite:///{tmp_path / 'back.db'}"
    assert _run("copy", "--from", source.ledger.store.url, "--to", target_url).exit_code == 0
    assert _run("copy", "--from", target_url, "--to", back).exit_code == 0
    shop = Shop(back)
    try:
        assert shop.records() == source.records()
        shop.charge("o7", 7)
        assert shop.effects == []
    finally:
        shop.close()


def test_trimmed_histories_are_still_told_apart(source: Shop) -> None:
    """Past HISTORY_LIMIT transitions a store keeps only the last ones: an older copy is still told
    from a later one by the stretch both hold, and two records that went separate ways are a conflict."""
    from onceonly.states import HISTORY_LIMIT, note_conflict

    rec = source.ledger.get(source.charge.key_for("o5", 5))
    assert rec is not None
    versions = [rec]
    for n in range(HISTORY_LIMIT + 20):
        versions.append(note_conflict(versions[-1], now=rec.updated_at + n + 1, reason=f"n{n}", by="t"))
    old, new = versions[HISTORY_LIMIT + 5], versions[-1]
    assert len(old.history) == len(new.history) == HISTORY_LIMIT
    assert plan(new, old, now=0.0).action is Action.UPDATE
    assert plan(old, new, now=0.0).action is Action.NEWER
    elsewhere = note_conflict(old, now=rec.updated_at + 999, reason="elsewhere", by="t")
    assert plan(new, elsewhere, now=0.0).action is Action.CONFLICT
    too_far = versions[2]  # the source no longer holds any of its entries: it cannot be told
    assert plan(new, too_far, now=0.0).action is Action.CONFLICT


def test_progress_is_drawn_on_a_terminal_only(source: Shop, tmp_path: Path) -> None:
    """On a terminal, stderr shows a running count; piped, only the summary is printed."""
    import pty

    args = ("copy", "--from", source.ledger.store.url, "--to", f"sqlite:///{tmp_path / 'a.db'}")
    master, slave = pty.openpty()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "onceonly", *args], env=env, stdout=subprocess.PIPE, stderr=slave, text=True
    )
    os.close(slave)
    out, _ = proc.communicate(timeout=60)
    drawn = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        drawn += chunk
    os.close(master)
    assert proc.returncode == 0, out
    assert b"\rcopy: " in drawn and b"copied" in drawn
    piped = _spawn(*args[:-1], f"sqlite:///{tmp_path / 'b.db'}")
    out, err = piped.communicate(timeout=60)
    assert piped.returncode == 0 and "\r" not in err and f"{ORDERS + 1} copied" in out


def test_a_record_held_in_the_target_is_never_written_over(source: Shop) -> None:
    """A caller of the target holds the record: a later version of the source's is kept (newer), and
    one that is not is a conflict; neither is written."""
    from onceonly.states import claim_again, confirm, replace

    rec = source.ledger.get(source.charge.key_for("o4", 4))
    assert rec is not None
    expired = replace(rec, expires_at=rec.updated_at)
    held = claim_again(expired, state=State.IN_FLIGHT, owner="w", now=rec.updated_at + 5, lease_seconds=30, reason="r")
    assert plan(rec, held, now=0.0).action is Action.NEWER
    moved = confirm(rec, result_json="{}", now=rec.updated_at + 1, ttl=None, via="resolve", by="p")
    assert plan(moved, held, now=0.0).action is Action.CONFLICT
