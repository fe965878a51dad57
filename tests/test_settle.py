"""The reconciler: its pure decisions, then end to end on every store (probes, re-sends, review, races)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onceonly import NOT_FOUND, AttemptsExhausted, Ledger, OutcomeUnknown, Retry, State
from onceonly import states as st
from onceonly.errors import OnceOnlyError, StoreUnavailable
from onceonly.policy import Policy
from onceonly.settle import (
    Leave,
    ReconcileReport,
    Resend,
    RunProbe,
    Settlement,
    Wait,
    Write,
    after_probe,
    decide,
    reconcile,
    reconcile_forever,
    rerun_problem,
)
from onceonly.states import Record
from onceonly.stores import open_store
from tests._clock import NOW, FakeClock
from tests._settling import Fault, FlakyStore, dead_holder


class Effects:
    """A real side-effect table (SQLite): one row per execution of a tool body, duplicates counted."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("CREATE TABLE IF NOT EXISTS effects (op TEXT, key TEXT)")
        self.lock = threading.Lock()

    def add(self, op: str, key: str = "") -> int:
        with self.lock:
            return int(self.db.execute("INSERT INTO effects VALUES (?, ?)", (op, key)).lastrowid or 0)

    def find(self, op: str) -> Any:
        with self.lock:
            row = self.db.execute("SELECT rowid FROM effects WHERE op = ? ORDER BY rowid LIMIT 1", (op,)).fetchone()
        return NOT_FOUND if row is None else {"op": op, "id": row[0]}

    def count(self, op: str) -> int:
        with self.lock:
            return int(self.db.execute("SELECT COUNT(*) FROM effects WHERE op = ?", (op,)).fetchone()[0])


@pytest.fixture(name="effects")
def fixture_effects(tmp_path: Path) -> Iterator[Effects]:
    """An empty side-effect table."""
    effects = Effects(tmp_path / "effects.db")
    yield effects
    effects.db.close()


def held_record(state: State, *, now: float, key: str = "k", owner: str = "h") -> Record:
    """A record as its holder's claim wrote it at ``now`` (a 30 s lease), as the pure decisions see it."""
    return st.new_record(
        key=key, scope="s", tool="t", fingerprint="f" * 64, args_json='{"a":1}', state=state, owner=owner,
        now=now, lease_seconds=30,
    )  # fmt: skip


def unknown_record(key: str = "s:t:k", *, updated_at: float = NOW - 10, attempts: int = 1) -> Record:
    """A record in state unknown, as the pure decisions see it."""
    rec = held_record(State.IN_FLIGHT, now=updated_at, key=key, owner="h:1:1")
    rec = st.mark_unknown(rec, now=updated_at, reason="timeout", by="h:1:1")
    return st.replace(rec, attempts=attempts)


# --- pure decisions ---------------------------------------------------------------------------------


def test_held_record_with_live_lease_is_left_alone() -> None:
    """A holder whose lease runs is working on it: the reconciler does not touch it."""
    rec = held_record(State.IN_FLIGHT, now=NOW)
    got = decide(rec, Policy(), now=NOW + 1, review_after=0, by="r")
    assert isinstance(got, Leave)
    assert got.settlement is Settlement.SKIPPED


def test_pending_with_expired_lease_fails_since_nothing_was_sent() -> None:
    """pending means the tool had not dispatched: a dead holder's record is failed, free to run again."""
    rec = held_record(State.PENDING, now=NOW - 100)
    got = decide(rec, None, now=NOW, review_after=0, by="r")
    assert isinstance(got, Write)
    assert got.settlement is Settlement.FAILED
    assert got.new.state is State.FAILED and got.new.lease_owner is None
    assert got.new.attempts == rec.attempts  # the attempt is counted


def test_in_flight_with_expired_lease_becomes_unknown_first() -> None:
    """in_flight may have been sent: it becomes unknown (no settlement yet), whatever the tool."""
    rec = held_record(State.IN_FLIGHT, now=NOW - 100)
    got = decide(rec, None, now=NOW, review_after=0, by="r")
    assert isinstance(got, Write)
    assert got.settlement is None
    assert got.new.state is State.UNKNOWN and got.new.fence == rec.fence
    assert got.new.history[-1]["reason"] == "lease of h expired"


def test_probe_waits_for_the_settle_time() -> None:
    """A probe runs only once settle seconds passed since the record became unknown."""
    rec = unknown_record(updated_at=NOW - 1)
    policy = Policy(on_unknown="probe", has_probe=True, settle=5.0)
    early = decide(rec, policy, now=NOW, review_after=0, by="r")
    assert isinstance(early, Wait)
    assert early.until == NOW + 4
    assert isinstance(decide(rec, policy, now=NOW + 4, review_after=0, by="r"), RunProbe)


def test_resend_and_retry_tools_are_re_sent_unless_the_call_cannot_be_rebuilt() -> None:
    """resend/retry re-run from stored arguments; a call that cannot be rebuilt waits for review."""
    rec = unknown_record(updated_at=NOW - 400)
    for strategy in ("resend", "retry"):
        policy = Policy(on_unknown=strategy)
        assert isinstance(decide(rec, policy, now=NOW, review_after=300, by="r"), Resend)
        blocked = decide(rec, policy, now=NOW, review_after=300, by="r", rerun_blocked="it is a method")
        assert isinstance(blocked, Write)
        assert blocked.settlement is Settlement.PARKED
        assert "it is a method" in blocked.new.history[-1]["reason"]


def test_review_tool_is_parked_after_review_after() -> None:
    """Nothing can settle it automatically: parked once it is review_after old, with who and why."""
    rec = unknown_record(updated_at=NOW - 10)
    waiting = decide(rec, Policy(), now=NOW, review_after=60, by="r")
    assert isinstance(waiting, Wait)
    assert waiting.until == NOW + 50
    parked = decide(rec, Policy(), now=NOW + 50, review_after=60, by="rec-1")
    assert isinstance(parked, Write)
    assert parked.new.state is State.NEEDS_REVIEW
    assert parked.new.history[-1]["by"] == "rec-1"


def test_unregistered_tool_is_left_unknown() -> None:
    """Without its tool the reconciler cannot know how to settle it; the line names the tool (how to
    register it is the command's one hint, which knows whether --app was given)."""
    got = decide(unknown_record(updated_at=NOW - 10_000), None, now=NOW, review_after=0, by="r")
    assert isinstance(got, Leave)
    assert got.settlement is Settlement.NO_TOOL
    assert "'t'" in got.detail and "reconciler's tools" in got.detail


def test_settled_record_is_skipped() -> None:
    """A record settled meanwhile (read late) is nobody's business any more."""
    rec = st.confirm(unknown_record(), result_json="1", now=NOW, ttl=60, via="probe", by="x")
    got = decide(rec, Policy(), now=NOW, review_after=0, by="r")
    assert isinstance(got, Leave)
    assert got.settlement is Settlement.SKIPPED


def test_after_probe_found_not_found_and_raised() -> None:
    """Found confirms (via reconcile-probe); NOT_FOUND fails; a raising probe leaves it unknown."""
    rec = unknown_record()
    policy = Policy(on_unknown="probe", has_probe=True, ttl=60)
    found = after_probe(rec, policy, value={"id": 3}, now=NOW, by="r")
    assert isinstance(found, Write)
    assert found.new.state is State.CONFIRMED and found.new.via == "reconcile-probe"
    assert found.new.result == {"id": 3} and found.new.expires_at == NOW + 60
    missing = after_probe(rec, policy, value=NOT_FOUND, now=NOW, by="r")
    assert isinstance(missing, Write)
    assert missing.new.state is State.FAILED and missing.settlement is Settlement.FAILED
    broken = after_probe(rec, policy, error=ConnectionError("search down"), now=NOW, by="r")
    assert isinstance(broken, Leave)
    assert broken.settlement is Settlement.UNSETTLED and "search down" in broken.detail


def test_rerun_problem_says_when_stored_arguments_cannot_rebuild_a_call() -> None:
    """A method, *args/**kwargs, or a required field left out of the stored arguments: no re-run."""

    def ok(title: str, body: str = "", *, idempotency_key: str) -> None: ...
    def stars(*items: str) -> None: ...
    def needs(title: str, requested_at: str) -> None: ...

    class Api:
        def post(self, title: str) -> None: ...

    assert rerun_problem(ok, {"title": "a", "body": "b"}) is None
    assert rerun_problem(ok, {"title": "a"}) is None
    assert "args" in (rerun_problem(stars, {"items": ["a"]}) or "")
    assert "ignore=" in (rerun_problem(needs, {"title": "a"}) or "")
    assert "method" in (rerun_problem(Api.post, {"title": "a"}) or "")


# --- end to end, on every store -------------------------------------------------------------------------


def test_unknowns_are_settled_by_their_probes(ledger: Ledger, clock: FakeClock, effects: Effects) -> None:
    """Unknowns whose probe failed in-call: the reconciler confirms those that happened, fails the others."""
    probe_up = False
    lost_after_commit = {"a", "c"}
    fail_before_commit = {"b"}

    def find(args: dict[str, Any], key: str) -> Any:
        if not probe_up:
            raise ConnectionRefusedError("search API down")
        return effects.find(args["op"])

    @ledger.tool(name="create", on_unknown="probe", probe=find, settle=2.0)
    def create(op: str) -> dict[str, Any]:
        if op in fail_before_commit:
            raise ConnectionResetError("connection reset before the commit")  # unknown to the caller
        effects.add(op)
        if op in lost_after_commit:
            raise ConnectionResetError("answer lost after the commit")
        return {"op": op}

    for op in ("a", "b", "c"):
        with pytest.raises(OutcomeUnknown, match="probe failed"):
            create(op)
    assert ledger.stats()["unknown"] == 3

    # The probe is still down: every record stays unknown, reported.
    report = reconcile(ledger, review_after=0)
    assert report.counts["unsettled"] == 3
    assert ledger.stats()["unknown"] == 3

    probe_up = True
    report = reconcile(ledger, review_after=0)
    assert report.counts["confirmed"] == 2 and report.counts["failed"] == 1
    by_op = {ln.key: ln.settlement for ln in report.lines}
    assert by_op == {
        create.key_for("a"): Settlement.CONFIRMED,
        create.key_for("b"): Settlement.FAILED,
        create.key_for("c"): Settlement.CONFIRMED,
    }
    rec = ledger.get(create.key_for("a"))
    assert rec is not None and rec.via == "reconcile-probe" and rec.result == {"op": "a", "id": 1}
    assert rec.history[-1]["by"] == report.by

    # The faults are gone. a is replayed, never run again; b did not happen, so calling again runs it.
    lost_after_commit.clear()
    fail_before_commit.clear()
    assert create("a") == {"op": "a", "id": 1}
    assert create("b") == {"op": "b"}
    assert [effects.count(op) for op in "abc"] == [1, 1, 1]


def test_dead_holders_are_settled_and_pending_ones_run_again(
    ledger: Ledger, clock: FakeClock, effects: Effects
) -> None:
    """Killed callers: in_flight → unknown → probe; pending (nothing sent) → failed, and a new call runs it."""

    @ledger.tool(name="create", on_unknown="probe", probe=lambda a, k: effects.find(a["op"]), reports_dispatch=True)
    def create(op: str) -> dict[str, Any]:
        effects.add(op)
        return {"op": op}

    effects.add("sent")
    dead_holder(ledger, create, "sent")  # it had sent it, then died
    dead_holder(ledger, create, "lost")  # it died before the request arrived
    dead_holder(ledger, create, "never", state=State.PENDING)  # it died before dispatch

    report = reconcile(ledger)
    ops = {create.key_for(op): op for op in ("sent", "lost", "never")}
    got = {ops[ln.key]: (ln.before, ln.after, ln.settlement) for ln in report.lines}
    assert got == {
        "sent": (State.IN_FLIGHT, State.CONFIRMED, Settlement.CONFIRMED),
        "lost": (State.IN_FLIGHT, State.FAILED, Settlement.FAILED),
        "never": (State.PENDING, State.FAILED, Settlement.FAILED),
    }
    sent = ledger.get(create.key_for("sent"))
    assert sent is not None
    assert [h["to"] for h in sent.history] == ["in_flight", "unknown", "confirmed"]

    # Every operation now happens exactly once whoever calls again.
    for op in ("sent", "lost", "never"):
        create(op)
    assert [effects.count(op) for op in ("sent", "lost", "never")] == [1, 1, 1]


def test_lease_expiry_then_probe_in_one_run_with_wait(ledger: Ledger, clock: FakeClock, effects: Effects) -> None:
    """With wait=, one run sleeps once for the settle time of records it just marked unknown."""

    @ledger.tool(name="create", on_unknown="probe", probe=lambda a, k: effects.find(a["op"]), settle=3.0)
    def create(op: str) -> None: ...

    for op in ("x", "y"):
        effects.add(op)
        dead_holder(ledger, create, op)
    short = reconcile(ledger)
    assert short.counts["waiting"] == 2 and ledger.stats()["unknown"] == 2
    assert all(ln.due_at == NOW + 3.0 for ln in short.lines)

    report = reconcile(ledger, wait=10)
    assert report.counts["confirmed"] == 2
    assert clock.sleeps == [3.0]  # one sleep for the batch, not one per record


def test_resend_tool_is_re_sent_with_the_same_key_and_stored_arguments(ledger: Ledger, effects: Effects) -> None:
    """on_unknown='resend': the reconciler calls the tool again with the key; a key-honouring server dedups."""
    server: dict[str, str] = {}
    received: list[tuple[str, str]] = []

    @ledger.tool(name="post", on_unknown="resend")
    def post(title: str, body: str, *, idempotency_key: str) -> dict[str, str]:
        received.append((idempotency_key, title))
        if idempotency_key not in server:
            server[idempotency_key] = title
            effects.add(title, idempotency_key)
        return {"title": server[idempotency_key]}

    rec = dead_holder(ledger, post, "hello", "world")
    server[rec.key] = "hello"  # the dead caller's request had arrived
    effects.add("hello", rec.key)

    report = reconcile(ledger)
    assert [ln.settlement for ln in report.lines] == [Settlement.CONFIRMED]
    assert received == [(rec.key, "hello")]
    done = ledger.get(rec.key)
    assert done is not None and done.state is State.CONFIRMED and done.result == {"title": "hello"}
    assert done.attempts == 2 and done.fence == 2
    assert effects.count("hello") == 1
    assert post("hello", "world") == {"title": "hello"} and len(received) == 1  # replayed


def test_resend_that_is_unknown_again_stays_unknown_then_parks(ledger: Ledger, clock: FakeClock) -> None:
    """A re-send that times out again stays unknown; when attempts run out it is parked for a person."""
    sent: list[str] = []

    @ledger.tool(name="post", on_unknown="retry", retry=Retry(attempts=2, base=5.0, cap=5.0))
    def post(title: str) -> None:
        sent.append(title)
        raise TimeoutError("read timed out")

    rec = dead_holder(ledger, post, "t")
    first = reconcile(ledger)
    assert [ln.settlement for ln in first.lines] == [Settlement.PARKED]  # attempt 2 was the last one
    assert sent == ["t"]
    parked = ledger.get(rec.key)
    assert parked is not None and parked.state is State.NEEDS_REVIEW and parked.attempts == 2


def test_rebuild_problem_parks_instead_of_re_sending(ledger: Ledger, clock: FakeClock) -> None:
    """A resend tool whose required field was left out by ignore= cannot be re-run: parked after review_after."""

    @ledger.tool(name="post", on_unknown="resend", ignore=("requested_at",))
    def post(title: str, requested_at: str) -> None:
        raise AssertionError("must not run")

    rec = dead_holder(ledger, post, "t", "2026-01-01", age=100)
    # The review age counts from the dead holder's last sign of life, not from the lease expiry.
    [waiting] = reconcile(ledger, review_after=160).lines
    assert waiting.settlement is Settlement.WAITING and waiting.due_at == NOW + 60
    clock.now += 60
    report = reconcile(ledger, review_after=160)
    assert [ln.settlement for ln in report.lines] == [Settlement.PARKED]
    parked = ledger.get(rec.key)
    assert parked is not None and "ignore=" in parked.history[-1]["reason"]


def test_review_tool_and_unregistered_tool(ledger: Ledger, clock: FakeClock, tmp_path: Path) -> None:
    """A review tool's unknown is parked after review_after; an unregistered tool's is left and reported."""

    @ledger.tool(name="charge")
    def charge(amount: int) -> None: ...

    parked = dead_holder(ledger, charge, 5)
    other = Ledger.open(ledger.url, clock=clock)

    @other.tool(name="elsewhere")
    def elsewhere(n: int) -> None: ...

    stray = dead_holder(other, elsewhere, 1)
    report = reconcile(ledger, review_after=30)
    by_key = {ln.key: ln.settlement for ln in report.lines}
    assert by_key == {parked.key: Settlement.PARKED, stray.key: Settlement.NO_TOOL}
    stray_now = ledger.get(stray.key)
    assert stray_now is not None and stray_now.state is State.UNKNOWN  # the lease expiry is still recorded
    # With the other app's registry it can be settled by its policy (review: parked).
    again = reconcile(ledger, tools=other.tools, review_after=30)
    assert {ln.key: ln.settlement for ln in again.lines} == {stray.key: Settlement.PARKED}


def test_async_tool_and_async_probe(ledger: Ledger, effects: Effects) -> None:
    """Async probes are awaited and async tools re-sent, from the sync reconciler."""

    async def find(args: dict[str, Any], key: str) -> Any:
        await asyncio.sleep(0)
        return effects.find(args["op"])

    @ledger.tool(name="aprobe", on_unknown="probe", probe=find)
    async def aprobe(op: str) -> None: ...

    @ledger.tool(name="aresend", on_unknown="resend")
    async def aresend(op: str, *, idempotency_key: str) -> dict[str, str]:
        await asyncio.sleep(0)
        effects.add(op, idempotency_key)
        return {"op": op}

    effects.add("p")
    dead_holder(ledger, aprobe, "p")
    rec = dead_holder(ledger, aresend, "r")
    report = reconcile(ledger)
    assert sorted(ln.settlement.value for ln in report.lines) == ["confirmed", "confirmed"]
    done = ledger.get(rec.key)
    assert done is not None and done.result == {"op": "r"}
    assert effects.count("r") == 1 and effects.count("p") == 1


def test_report_shape(ledger: Ledger, effects: Effects) -> None:
    """The report's JSON form: who, when, counts for every settlement, one line per record."""

    @ledger.tool(name="create", on_unknown="probe", probe=lambda a, k: effects.find(a["op"]))
    def create(op: str) -> None: ...

    dead_holder(ledger, create, "gone")
    data = ledger.reconcile(by="ops-team").to_dict()  # the Ledger method delegates to settle.reconcile
    assert data["by"] == "ops-team"
    assert set(data["counts"]) == {s.value for s in Settlement}
    assert data["counts"]["failed"] == 1
    [line] = data["records"]
    assert set(line) == {"key", "tool", "before", "after", "settlement", "detail", "due_at", "error"}
    assert (line["before"], line["after"], line["settlement"]) == ("in_flight", "failed", "failed")


def test_invalid_arguments(ledger: Ledger) -> None:
    """Negative seconds and empty pages are refused with what to change."""
    with pytest.raises(ValueError, match="negative"):
        reconcile(ledger, review_after=-1)
    with pytest.raises(ValueError, match="batch"):
        reconcile(ledger, batch=0)
    with pytest.raises(ValueError, match="concurrency=0: settle 1 or more records at once"):
        reconcile(ledger, concurrency=0)


def test_paging_through_many_records(ledger: Ledger, effects: Effects) -> None:
    """More records than one page: every one is looked at once."""

    @ledger.tool(name="create", on_unknown="probe", probe=lambda a, k: effects.find(a["op"]))
    def create(op: str) -> None: ...

    for n in range(25):
        if n % 2:
            effects.add(str(n))
        dead_holder(ledger, create, str(n))
    report = reconcile(ledger, batch=4)
    assert len(report.lines) == 25
    assert report.counts["confirmed"] == 12 and report.counts["failed"] == 13


def _parked_charge(ledger: Ledger) -> str:
    """The key of a charge whose answer timed out, parked for a person (the default on_unknown)."""

    @ledger.tool(name="charge")
    def charge(amount: int) -> None:
        raise TimeoutError("read timed out")

    with pytest.raises(OutcomeUnknown) as info:
        charge(5)
    return info.value.key


def test_resolve_records_who_and_why(ledger: Ledger) -> None:
    """The review queue: a person resolves a parked record; who and why are in its history."""
    key = _parked_charge(ledger)
    done = ledger.resolve(key, failed="not in the PSP's list", by="bob", why="checked the PSP dashboard")
    assert done.state is State.FAILED and done.via == "resolve"
    last = done.history[-1]
    assert last["by"] == "bob" and "checked the PSP dashboard" in last["reason"] and last["from"] == "needs_review"


def test_resolve_at_a_version_refuses_a_record_settled_meanwhile(ledger: Ledger) -> None:
    """A person looked at version N; a colleague settled it since: resolving at N changes nothing."""
    key = _parked_charge(ledger)
    seen = ledger.get(key)
    assert seen is not None and seen.state is State.NEEDS_REVIEW
    colleague = ledger.resolve(key, failed="not in the PSP's list", by="carol", reset=True)
    with pytest.raises(OnceOnlyError, match="changed since it was read"):
        ledger.resolve(key, failed="declined", by="bob", version=seen.version)
    assert ledger.get(key) == colleague
    done = ledger.resolve(key, failed="declined", by="bob", version=colleague.version)
    assert done.history[-1]["by"] == "bob"


# --- the store fails mid-run ----------------------------------------------------------------------------


@pytest.fixture(name="flaky")
def fixture_flaky(store_url: str, clock: FakeClock) -> Iterator[tuple[Ledger, FlakyStore]]:
    """A ledger on each real store, through a wrapper that fails as its ``faults`` say."""
    store = FlakyStore(open_store(store_url))
    ledger = Ledger(store, clock=clock, sleep=clock.sleep)
    yield ledger, store
    ledger.close()


def test_resend_whose_claim_lands_with_its_answer_lost_is_sent_once(
    flaky: tuple[Ledger, FlakyStore], effects: Effects
) -> None:
    """The re-send's claim (unknown → in_flight) is written, then the store fails: the plan re-reads,
    finds its own claim, and sends exactly once."""
    ledger, store = flaky

    @ledger.tool(name="post", on_unknown="resend")
    def post(title: str) -> dict[str, str]:
        effects.add(title)
        return {"title": title}

    rec = dead_holder(ledger, post, "t")
    store.faults.append(Fault("swap", frm=State.UNKNOWN, to=State.IN_FLIGHT, lands=True))
    [line] = reconcile(ledger).lines
    assert store.raised == ["swap"]
    assert line.settlement is Settlement.CONFIRMED and line.after is State.CONFIRMED
    assert effects.count("t") == 1
    done = ledger.get(rec.key)
    assert done is not None and done.result == {"title": "t"} and done.attempts == 2
    assert [h["to"] for h in done.history] == ["in_flight", "unknown", "in_flight", "confirmed"]
    assert post("t") == {"title": "t"} and effects.count("t") == 1  # replayed


def test_probe_settlement_whose_answer_is_lost_lands_once(flaky: tuple[Ledger, FlakyStore], effects: Effects) -> None:
    """Both of the reconciler's writes (lease expired → unknown, found → confirmed) land, then the store
    fails: re-reading shows each is ours, so the record is settled once and reported as confirmed."""
    ledger, store = flaky

    @ledger.tool(name="create", on_unknown="probe", probe=lambda a, k: effects.find(a["op"]))
    def create(op: str) -> dict[str, str]:
        effects.add(op)
        return {"op": op}

    effects.add("x")  # the dead caller's request had arrived
    rec = dead_holder(ledger, create, "x")
    store.faults += [Fault("swap", to=State.UNKNOWN, lands=True), Fault("swap", to=State.CONFIRMED, lands=True)]
    [line] = reconcile(ledger).lines
    assert store.raised == ["swap", "swap"]
    assert line.settlement is Settlement.CONFIRMED and line.after is State.CONFIRMED
    done = ledger.get(rec.key)
    assert done is not None and done.via == "reconcile-probe"
    assert [h["to"] for h in done.history] == ["in_flight", "unknown", "confirmed"]
    assert reconcile(ledger).lines == []  # nothing is left to settle
    assert create("x") == {"op": "x", "id": 1} and effects.count("x") == 1  # replayed, never run


def _two_dead_probe_records(ledger: Ledger, effects: Effects) -> list[str]:
    """Two records of killed callers whose requests had arrived; their keys."""

    @ledger.tool(name="create", on_unknown="probe", probe=lambda a, k: effects.find(a["op"]))
    def create(op: str) -> None: ...

    keys = []
    for op in ("a", "b"):
        effects.add(op)
        keys.append(dead_holder(ledger, create, op).key)
    return keys


def _down_at_the_second_confirmation() -> Fault:
    """The second confirmation is not written, and the read that checks it fails too: the run ends."""
    return Fault("swap", to=State.CONFIRMED, skip=1, then=Fault("get"))


def test_store_error_ends_a_run_keeping_what_it_settled(flaky: tuple[Ledger, FlakyStore], effects: Effects) -> None:
    """A run that the store fails midway raises; what it settled stays settled, and the next run
    settles the rest without touching it again."""
    ledger, store = flaky
    keys = _two_dead_probe_records(ledger, effects)
    store.faults.append(_down_at_the_second_confirmation())
    with pytest.raises(StoreUnavailable):
        reconcile(ledger)
    assert store.raised == ["swap", "get"]
    after = {key: ledger.get(key) for key in keys}
    [settled] = [rec for rec in after.values() if rec is not None and rec.state is State.CONFIRMED]
    [left] = [key for key, rec in after.items() if rec is not None and rec.state is State.UNKNOWN]

    report = reconcile(ledger)
    assert [(ln.key, ln.before, ln.settlement) for ln in report.lines] == [(left, State.UNKNOWN, Settlement.CONFIRMED)]
    again = ledger.get(settled.key)
    assert again is not None and (again.version, again.history_json) == (settled.version, settled.history_json)
    assert ledger.stats()["confirmed"] == 2


def test_reconcile_forever_outlives_store_errors(
    flaky: tuple[Ledger, FlakyStore], effects: Effects, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """The first pass cannot read the records, the second fails midway; each error is logged and ends
    its pass only, and the third settles what is left."""
    ledger, store = flaky
    keys = _two_dead_probe_records(ledger, effects)
    store.faults += [Fault("scan"), _down_at_the_second_confirmation()]
    reports: list[ReconcileReport] = []
    with caplog.at_level(logging.WARNING, logger="onceonly.settle"):
        reconcile_forever(
            ledger, every=30, on_report=reports.append, stop=lambda: bool(reports) or clock.now > NOW + 300
        )
    assert store.raised == ["scan", "swap", "get"]
    assert sum("the store failed" in r.getMessage() for r in caplog.records) == 2
    assert clock.now == NOW + 60  # a pause after each failed pass
    [report] = reports
    assert [ln.settlement for ln in report.lines] == [Settlement.CONFIRMED]
    assert report.lines[0].key in keys
    assert ledger.stats()["confirmed"] == 2 and ledger.stats()["unknown"] == 0


# --- several reconcilers at once ----------------------------------------------------------------------


def _race(store_url: str, n_reconcilers: int, setup: Any) -> list[ReconcileReport]:
    """Run several reconcilers, each with its own ledger (connection), against the same records at once."""
    ledgers = [Ledger.open(store_url) for _ in range(n_reconcilers)]
    for led in ledgers:
        setup(led)
    barrier = threading.Barrier(n_reconcilers)
    reports: list[ReconcileReport] = []
    errors: list[BaseException] = []

    def run(led: Ledger, n: int) -> None:
        try:
            barrier.wait()
            reports.append(reconcile(led, by=f"rec-{n}"))
        except BaseException as exc:  # reported by the test, not lost in a thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(led, n)) for n, led in enumerate(ledgers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for led in ledgers:
        led.close()
    assert not errors, errors
    return reports


def test_several_reconcilers_settle_each_record_once(store_url: str, effects: Effects) -> None:
    """Four reconcilers over the same 40 records: each record is settled by exactly one of them."""
    n_ops = 40
    resent: list[str] = []

    def setup(led: Ledger) -> None:
        @led.tool(name="create", on_unknown="probe", probe=lambda a, k: effects.find(a["op"]))
        def create(op: str) -> None: ...

        @led.tool(name="post", on_unknown="resend")
        def post(op: str, *, idempotency_key: str) -> dict[str, str]:
            resent.append(op)
            effects.add(op, idempotency_key)  # no key-honouring server here: a second run would show
            return {"op": op}

    with Ledger.open(store_url) as first:
        setup(first)
        for n in range(n_ops):
            tool = first.tools["create"] if n % 2 else first.tools["post"]
            if n % 4 == 1:
                effects.add(f"op{n}")
            dead_holder(first, tool, f"op{n}")

    reports = _race(store_url, 4, setup)
    settled = [ln for r in reports for ln in r.lines if ln.settlement is not Settlement.SKIPPED]
    assert sorted(ln.key for ln in settled) == sorted({ln.key for r in reports for ln in r.lines})
    assert len(settled) == n_ops  # one settlement per record, across all reconcilers
    assert sorted(resent) == sorted(f"op{n}" for n in range(0, n_ops, 2))  # each re-sent once
    assert all(effects.count(f"op{n}") == 1 for n in range(n_ops) if n % 2 == 0 or n % 4 == 1)
    with Ledger.open(store_url) as check:
        stats = check.stats()
    assert stats["confirmed"] == n_ops // 2 + n_ops // 4 and stats["failed"] == n_ops // 4
    assert stats["unknown"] == stats["in_flight"] == 0


def test_reconcile_one_scope_only(ledger: Ledger, effects: Effects) -> None:
    """scope= limits a run to one scope's records: another tenant's records are not touched."""

    @ledger.tool(name="create", on_unknown="probe", probe=lambda a, k: effects.find(a["op"]))
    def create(op: str) -> None: ...

    with ledger.task("tenant-a"):
        mine = dead_holder(ledger, create, "x")
    with ledger.task("tenant-b"):
        theirs = dead_holder(ledger, create, "x")
    report = reconcile(ledger, scope="tenant-a")
    assert [ln.key for ln in report.lines] == [mine.key]
    untouched = ledger.get(theirs.key)
    assert untouched is not None and untouched.state is State.IN_FLIGHT


# --- probes end to end, against the reference ticket service ------------------------------------------


@pytest.fixture(name="tickets")
def fixture_tickets(tmp_path: Path) -> Iterator[Any]:
    """The ticket service on 127.0.0.1 with its idempotency middleware off (it dedups nothing)."""
    from onceonly.tickets import serve_in_thread

    server = serve_in_thread(db_path=tmp_path / "tickets.db", idempotency=False, faults={"delay_seconds": 0.6})
    yield server
    server.stop()  # also closes the ticket database


def test_probes_end_to_end_against_the_ticket_service(tickets: Any, sqlite_url: str) -> None:
    """Answers lost, answers late, failures before the commit, a probe that fails: one ticket each."""
    import httpx

    admin = httpx.Client(base_url=tickets.url, timeout=5)
    http = httpx.Client(base_url=tickets.url, timeout=0.3)
    probe_up = True

    def find(args: dict[str, Any], key: str) -> Any:
        if not probe_up:
            raise httpx.ConnectError("search is down")
        found = http.get("/tickets", params={"session_id": args["session_id"], "title": args["title"]}).json()
        return found["tickets"][0] if found["tickets"] else NOT_FOUND

    ledger = Ledger.open(sqlite_url)

    @ledger.tool(name="create_ticket", key=("session_id", "title"), on_unknown="probe", probe=find, settle=0.2,
                 retry=Retry(attempts=2, base=0.01, cap=0.05))  # fmt: skip
    def create_ticket(session_id: str, title: str) -> dict[str, Any]:
        response = http.post("/tickets", json={"session_id": session_id, "title": title})
        response.raise_for_status()
        return response.json()  # type: ignore[no-any-return]

    def faults(**probabilities: float) -> None:
        admin.put("/admin/faults", json={**probabilities, "delay_seconds": 0.6}).raise_for_status()

    def count(title: str) -> int:
        return len(admin.get("/tickets", params={"session_id": "s", "title": title}).json()["tickets"])

    try:
        faults(lost=1.0)  # committed, the answer lost: the probe finds it
        out = create_ticket.outcome("s", "lost")
        assert out.via == "probe" and out.result["title"] == "lost" and count("lost") == 1
        faults(delay=1.0)  # committed, the answer later than the client's timeout
        out = create_ticket.outcome("s", "late")
        assert out.via == "probe" and count("late") == 1
        faults(fail=1.0)  # 503 before the commit: not executed, retried while attempts last
        with pytest.raises(AttemptsExhausted) as info:
            create_ticket("s", "refused")
        assert "503" in str(info.value.last_exception)
        assert count("refused") == 0
        faults(lost=1.0)
        probe_up = False  # the answer lost and the probe down: it stays unknown
        with pytest.raises(OutcomeUnknown, match="probe failed"):
            create_ticket("s", "unprobed")
        faults()
        probe_up = True
        report = reconcile(ledger, wait=1.0)
        assert [ln.settlement for ln in report.lines] == [Settlement.CONFIRMED]
        assert create_ticket("s", "unprobed")["title"] == "unprobed" and count("unprobed") == 1
    finally:
        ledger.close()
        admin.close()
        http.close()


def test_resend_unknown_again_is_re_sent_by_a_later_run(ledger: Ledger, clock: FakeClock) -> None:
    """A re-send whose outcome is unknown again stays unknown (unsettled); the next run re-sends it."""
    server: dict[str, str] = {}
    sent: list[str] = []

    @ledger.tool(name="post", on_unknown="resend", retry=Retry(attempts=4, base=5.0, cap=5.0))
    def post(title: str, *, idempotency_key: str) -> dict[str, str]:
        sent.append(idempotency_key)
        server.setdefault(idempotency_key, title)
        if len(sent) == 1:
            raise TimeoutError("read timed out")  # applied by the server, the answer lost
        return {"title": server[idempotency_key]}

    rec = dead_holder(ledger, post, "t")
    [first] = reconcile(ledger).lines
    assert first.settlement is Settlement.UNSETTLED and first.after is State.UNKNOWN
    clock.now += 10
    [second] = reconcile(ledger).lines
    assert second.settlement is Settlement.CONFIRMED
    assert sent == [rec.key, rec.key] and server == {rec.key: "t"}  # one key, one ticket


def test_resend_not_sent_is_failed_for_a_new_call(ledger: Ledger) -> None:
    """A re-send refused before sending (connection refused) leaves it failed: a new call may run it."""

    @ledger.tool(name="post", on_unknown="resend", retry=Retry(attempts=3, base=5.0, cap=5.0))
    def post(title: str) -> None:
        raise ConnectionRefusedError("nobody listens")

    rec = dead_holder(ledger, post, "t")
    [line] = reconcile(ledger).lines
    assert line.settlement is Settlement.FAILED and line.after is State.FAILED
    assert "ConnectionRefusedError" in line.detail
    failed = ledger.get(rec.key)
    assert failed is not None and failed.next_attempt_at is not None


def test_resend_stops_when_the_record_moved_on(ledger: Ledger, clock: FakeClock) -> None:
    """A reconciler that decided on an old version never re-sends: someone else acted first."""
    from onceonly.settle import _Reconciler

    calls: list[str] = []

    @ledger.tool(name="post", on_unknown="resend")
    def post(title: str) -> None:
        calls.append(title)

    rec = dead_holder(ledger, post, "t")
    unknown = st.mark_unknown(rec, now=clock.now, reason="lease expired", by="another")
    assert ledger.store.swap(unknown, rec)
    settled = st.confirm(unknown, result_json="null", now=clock.now, ttl=60, via="probe", by="another")
    assert ledger.store.swap(settled, unknown)
    worker = _Reconciler(ledger, ledger.tools, review_after=0, by="late", sleep_budget=lambda: 0.0)
    line = worker._resend(ledger.tools["post"].spec, unknown, State.UNKNOWN)  # decided on the stale version
    assert line.settlement is Settlement.SKIPPED and "confirmed" in line.detail
    assert calls == []


# --- a run in a pool of threads: each record once, progress, Ctrl-C -----------------------------------


def test_a_pool_settles_each_record_once(ledger: Ledger, effects: Effects) -> None:
    """concurrency=4 on every store: four probes run at once (a barrier of 4 lets them through only
    together), each of the 20 records is probed once and confirmed once; progress counts each record
    in the caller's thread."""
    together = threading.Barrier(4, timeout=20)

    def find(args: dict[str, Any], key: str) -> Any:
        together.wait()
        effects.add("probe", key)
        return {"op": args["op"]}

    @ledger.tool(name="create", on_unknown="probe", probe=find, settle=0)
    def create(op: str) -> None: ...

    keys = [dead_holder(ledger, create, f"op-{n:02d}").key for n in range(20)]
    me = threading.current_thread()
    seen: list[tuple[int, int]] = []

    def progress(done: int, handed: int) -> None:
        assert threading.current_thread() is me
        seen.append((done, handed))

    report = reconcile(ledger, concurrency=4, progress=progress)
    assert report.counts["confirmed"] == 20 and not report.interrupted
    assert [ln.key for ln in report.lines] == sorted(keys)  # the order they were read in
    probed = [k for (k,) in effects.db.execute("SELECT key FROM effects WHERE op = 'probe'")]
    assert sorted(probed) == sorted(keys)
    assert [done for done, _ in seen] == list(range(1, 21)) and seen[-1] == (20, 20)
    for key in keys:
        rec = ledger.get(key)
        assert rec is not None and rec.state is State.CONFIRMED
        assert [h["to"] for h in rec.history].count("confirmed") == 1


@pytest.mark.parametrize("concurrency", [1, 4])
def test_an_interrupted_run_reports_what_it_wrote(ledger: Ledger, concurrency: int) -> None:
    """Ctrl-C (a KeyboardInterrupt) after five records: it propagates, and the report handed in says
    what was written until then, exactly: each line's state is the record's in the store, and the
    records without a line are as they were (held by their dead holder)."""

    @ledger.tool(name="create", on_unknown="probe", probe=lambda a, k: {"op": a["op"]}, settle=0)
    def create(op: str) -> None: ...

    keys = [dead_holder(ledger, create, f"op-{n:02d}").key for n in range(30)]
    report = ReconcileReport()

    def progress(done: int, handed: int) -> None:
        if done == 5 and not report.interrupted:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        reconcile(ledger, concurrency=concurrency, progress=progress, report=report)
    assert report.interrupted and report.to_dict()["interrupted"] is True
    assert 5 <= len(report.lines) < 30, len(report.lines)
    lines = {ln.key: ln for ln in report.lines}
    for key in keys:
        rec = ledger.get(key)
        assert rec is not None
        if key in lines:
            assert lines[key].after is rec.state is State.CONFIRMED
        else:
            assert rec.state is State.IN_FLIGHT and rec.lease_owner == "dead-host:1:1"
    assert report.counts["confirmed"] == sum(ledger.get(k).state is State.CONFIRMED for k in keys)  # type: ignore[union-attr]


def test_the_daemon_hands_an_interrupted_run_to_on_report(ledger: Ledger) -> None:
    """reconcile_forever: Ctrl-C during a run hands its partial report to on_report, then propagates."""

    @ledger.tool(name="create", on_unknown="probe", probe=lambda a, k: {"op": a["op"]}, settle=0)
    def create(op: str) -> None: ...

    for n in range(6):
        dead_holder(ledger, create, f"op-{n}")
    got: list[ReconcileReport] = []

    def progress(done: int, handed: int) -> None:
        if done == 2 and not got:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        reconcile_forever(ledger, every=60, on_report=got.append, progress=progress, concurrency=2)
    assert len(got) == 1 and got[0].interrupted and got[0].counts["confirmed"] >= 2
