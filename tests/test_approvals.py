"""Approvals (``approve=``) on every store (SQLite, Redis, Redis Cluster, PostgreSQL): the first call asks
once and runs nothing, a person's approval lets exactly one later call run it (eight processes racing
included), a replay asks no one, other arguments need their own approval, a denial runs nothing and
stays, and who decided and why are in the record's history. Side effects are counted in a SQLite
file the tool bodies write to."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import onceonly
from onceonly import ApprovalDenied, ApprovalPending, Ledger, OnceOnlyError, State, tell_model
from onceonly import states as st
from onceonly.edge import envelope
from tests._workers import count_effects, effects_db
from tests.conftest import empty_store_url
from tests.stores.conftest import fixture_redis_cluster_url  # noqa: F401 - the private Redis Cluster

KINDS = ["sqlite", "redis", "redis-cluster", "postgres"]


@pytest.fixture(name="url", params=KINDS)
def fixture_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return empty_store_url(request.param, request, tmp_path)


class Payments:
    """A ledger with a payment tool that needs approval; each real run is a row in ``effects.db``."""

    def __init__(self, url: str, tmp: Path, **policy: Any) -> None:
        self.ledger = Ledger.open(url)
        self.effects_path = tmp / "effects.db"
        self.conn = effects_db(self.effects_path)
        self.fail_next = False
        conn = self.conn

        @self.ledger.tool(name="pay", approve=policy.pop("approve", True), **policy)
        def pay(to: str, amount: int) -> dict[str, Any]:
            if self.fail_next:
                self.fail_next = False
                raise ValueError("card declined")
            conn.execute("INSERT INTO effects VALUES (?, 'main', 0)", (f"{to}:{amount}",))
            return {"paid": to, "amount": amount}

        self.pay = pay

    def runs(self) -> dict[str, int]:
        return count_effects(self.effects_path)

    def close(self) -> None:
        self.ledger.close()
        self.conn.close()


@pytest.fixture(name="shop")
def fixture_shop(url: str, tmp_path: Path) -> Iterator[Payments]:
    shop = Payments(url, tmp_path)
    yield shop
    shop.close()


def test_the_first_call_asks_once_and_runs_nothing(shop: Payments) -> None:
    """The first call records the request and raises ApprovalPending; a second call before any decision
    raises it again and writes nothing."""
    with pytest.raises(ApprovalPending) as first:
        shop.pay("ana", 50)
    key = shop.pay.key_for("ana", 50)
    rec = shop.ledger.get(key)
    assert rec is not None and rec.state is State.AWAITING_APPROVAL
    assert (rec.attempts, rec.lease_owner, rec.lease_until, rec.version) == (0, None, None, 1)
    assert first.value.key == key and first.value.asked_at == rec.created_at
    assert "onceonly approve" in str(first.value)
    with pytest.raises(ApprovalPending):
        shop.pay("ana", 50)
    again = shop.ledger.get(key)
    assert again is not None and (again.version, again.history_json) == (rec.version, rec.history_json)
    assert shop.runs() == {}
    told = envelope(first.value)
    assert told.state == "awaiting_approval" and "waiting for a person's approval" in told.text
    assert "onceonly" not in tell_model(first.value)


def test_an_approval_runs_it_once_and_a_replay_asks_no_one(shop: Payments) -> None:
    """After an approval the next call runs it; every call after replays it without asking; the
    approval, who gave it and why are in the history."""
    with pytest.raises(ApprovalPending):
        shop.pay("ana", 50)
    key = shop.pay.key_for("ana", 50)
    approved = shop.ledger.approve(key, by="maria", reason="known customer")
    assert approved.state is State.PENDING and approved.history[-1][st.APPROVED_BY] == "maria"
    out = shop.pay.outcome("ana", 50)
    assert (out.result, out.replayed, out.attempts) == ({"paid": "ana", "amount": 50}, False, 1)
    for _ in range(3):
        assert shop.pay.outcome("ana", 50).replayed
    assert shop.runs() == {"ana:50": 1}
    rec = shop.ledger.get(key)
    assert rec is not None and rec.state is State.CONFIRMED
    entries = [e for e in rec.history if e.get(st.APPROVED_BY)]
    assert [(e["approved_by"], e["reason"], e["from"], e["to"]) for e in entries] == [
        ("maria", "known customer", "awaiting_approval", "pending")
    ]
    assert [e["to"] for e in rec.history].count("awaiting_approval") == 1
    with pytest.raises(OnceOnlyError, match="not awaiting approval"):
        shop.ledger.approve(key, by="maria")


def test_other_arguments_need_their_own_approval(shop: Payments) -> None:
    """An approval is bound to the key and the arguments' fingerprint."""
    with pytest.raises(ApprovalPending):
        shop.pay("ana", 50)
    shop.ledger.approve(shop.pay.key_for("ana", 50), by="maria")
    with pytest.raises(ApprovalPending):
        shop.pay("ana", 5000)
    assert shop.pay("ana", 50) == {"paid": "ana", "amount": 50}
    with pytest.raises(ApprovalPending):
        shop.pay("ana", 5000)
    assert shop.runs() == {"ana:50": 1}
    other = shop.ledger.get(shop.pay.key_for("ana", 5000))
    assert other is not None and other.state is State.AWAITING_APPROVAL
    with pytest.raises(OnceOnlyError, match="other arguments"):
        shop.ledger.approve(other.key, by="maria", fingerprint="0" * 64)
    shop.ledger.approve(other.key, by="maria", fingerprint=other.fingerprint)
    assert shop.pay("ana", 5000) == {"paid": "ana", "amount": 5000}
    assert shop.runs() == {"ana:50": 1, "ana:5000": 1}


def test_a_denial_runs_nothing_and_stays(shop: Payments) -> None:
    """A denied operation never runs: every later call raises ApprovalDenied (a Refused the model is
    told about), and nobody is asked again."""
    with pytest.raises(ApprovalPending):
        shop.pay("bo", 900)
    key = shop.pay.key_for("bo", 900)
    denied = shop.ledger.deny(key, by="maria", reason="wrong customer")
    assert denied.state is State.FAILED and denied.expires_at is None
    for _ in range(2):
        with pytest.raises(ApprovalDenied) as info:
            shop.pay("bo", 900)
        assert (info.value.by, info.value.reason) == ("maria", "wrong customer")
    assert isinstance(info.value, onceonly.Refused)
    told = envelope(info.value)
    assert told.state == "refused" and "denied" in told.text and "wrong customer" not in told.text
    rec = shop.ledger.get(key)
    assert rec is not None and rec.version == denied.version  # the later calls wrote nothing
    last = rec.history[-1]
    assert (last["denied_by"], last["reason"], last["effect"]) == ("maria", "wrong customer", False)
    assert shop.runs() == {}
    with pytest.raises(OnceOnlyError, match="it was denied"):
        shop.ledger.approve(key, by="maria")
    shop.ledger.purge(before=4e9)  # a denial does not expire
    assert shop.ledger.get(key) is not None


def test_a_run_that_failed_asks_again(shop: Payments) -> None:
    """The approved run failed definitely (the tool's own error): the approval is spent, and the next
    call asks a person again instead of running it."""
    with pytest.raises(ApprovalPending):
        shop.pay("cy", 10)
    key = shop.pay.key_for("cy", 10)
    shop.ledger.approve(key, by="maria")
    shop.fail_next = True
    with pytest.raises(ValueError, match="card declined"):
        shop.pay("cy", 10)
    with pytest.raises(ApprovalPending):
        shop.pay("cy", 10)
    rec = shop.ledger.get(key)
    assert rec is not None and (rec.state, rec.attempts) == (State.AWAITING_APPROVAL, 1)
    shop.ledger.approve(key, by="maria", reason="new card")
    assert shop.pay.outcome("cy", 10).attempts == 2
    assert shop.runs() == {"cy:10": 1}


def test_an_attempt_that_was_not_sent_keeps_its_approval(url: str, tmp_path: Path) -> None:
    """An attempt that never reached the other side (a refused connection) did not spend the approval:
    the retry runs under it."""
    ledger = Ledger.open(url, sleep=lambda s: None)
    tries: list[int] = []

    @ledger.tool(name="send", approve=True)
    def send(to: str) -> str:
        tries.append(1)
        if len(tries) == 1:
            raise ConnectionRefusedError("down")
        return f"sent to {to}"

    try:
        with pytest.raises(ApprovalPending):
            send("ana")
        ledger.approve(send.key_for("ana"), by="maria")
        assert send("ana") == "sent to ana"
        assert len(tries) == 2
    finally:
        ledger.close()


def test_approve_can_decide_per_call(url: str, tmp_path: Path) -> None:
    """approve=(args) -> bool: only the calls it names wait for a person."""
    shop = Payments(url, tmp_path, approve=lambda args: args["amount"] >= 100)
    try:
        assert shop.pay("ana", 5) == {"paid": "ana", "amount": 5}
        with pytest.raises(ApprovalPending):
            shop.pay("ana", 500)
        assert shop.runs() == {"ana:5": 1}
    finally:
        shop.close()


def test_an_async_tool_asks_and_runs_once(url: str, tmp_path: Path) -> None:
    """The async driver follows the same plan."""
    conn = effects_db(tmp_path / "effects.db")

    async def main() -> None:
        ledger = Ledger.open(url)

        @ledger.tool(name="apay", approve=True)
        async def apay(to: str) -> str:
            conn.execute("INSERT INTO effects VALUES (?, 'async', 0)", (to,))
            return to

        try:
            with pytest.raises(ApprovalPending):
                await apay("ana")
            ledger.approve(apay.key_for("ana"), by="maria")
            assert await asyncio.gather(*(apay("ana") for _ in range(5))) == ["ana"] * 5
        finally:
            ledger.close()

    asyncio.run(main())
    assert count_effects(tmp_path / "effects.db") == {"ana": 1}
    conn.close()


def test_the_reconciler_leaves_an_approved_record_alone(shop: Payments) -> None:
    """An approved record's lease has run out by design (its next call takes it over): the reconciler
    does not take it for a dead holder's."""
    with pytest.raises(ApprovalPending):
        shop.pay("dee", 7)
    key = shop.pay.key_for("dee", 7)
    approved = shop.ledger.approve(key, by="maria")
    shop.ledger.reconcile()
    rec = shop.ledger.get(key)
    assert rec is not None and rec.version == approved.version
    assert shop.pay("dee", 7) == {"paid": "dee", "amount": 7}


def test_approve_and_deny_refuse_what_does_not_wait(shop: Payments) -> None:
    """No record, no name, a record that is not awaiting: refused, nothing changed."""
    with pytest.raises(KeyError):
        shop.ledger.approve("default:pay:nope", by="maria")
    with pytest.raises(ApprovalPending):
        shop.pay("eve", 1)
    key = shop.pay.key_for("eve", 1)
    with pytest.raises(ValueError, match="by=NAME"):
        shop.ledger.deny(key, by=" ")
    shop.ledger.approve(key, by="maria")
    with pytest.raises(OnceOnlyError, match="it was approved"):
        shop.ledger.deny(key, by="maria")


# --- eight processes racing the same approved operation ---------------------------------------------


def race_approved(url: str, effects_path: str, worker: str, barrier: Any) -> Any:
    """One process of the race: the same tool, the same arguments, called at the barrier."""
    ledger = Ledger.open(url)
    conn = effects_db(effects_path)

    @ledger.tool(name="pay", approve=True, wait=60)
    def pay(to: str, amount: int) -> dict[str, Any]:
        conn.execute("INSERT INTO effects VALUES (?, ?, 0)", (f"{to}:{amount}", worker))
        return {"paid": to, "by": worker}

    try:
        barrier.wait(60)
        return pay("ana", 50)
    finally:
        ledger.close()
        conn.close()


def test_eight_processes_racing_an_approved_operation_run_it_once(url: str, tmp_path: Path) -> None:
    """Eight processes call the approved operation at once: one side effect, the same result for all."""
    shop = Payments(url, tmp_path)
    try:
        with pytest.raises(ApprovalPending):
            shop.pay("ana", 50)
        key = shop.pay.key_for("ana", 50)
        shop.ledger.approve(key, by="maria")
    finally:
        shop.close()
    n = 8
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(n)
        with ctx.Pool(n) as pool:
            args = [(url, str(tmp_path / "effects.db"), f"w{i}", barrier) for i in range(n)]
            results = pool.starmap(race_approved, args, chunksize=1)
    assert count_effects(tmp_path / "effects.db") == {"ana:50": 1}
    assert len({r["by"] for r in results}) == 1
    ledger = Ledger.open(url)
    try:
        rec = ledger.get(key)
        assert rec is not None and (rec.state, rec.attempts) == (State.CONFIRMED, 1)
    finally:
        ledger.close()


# --- the state table and the PostgreSQL schema ------------------------------------------------------


def test_the_state_table_has_the_approval_transitions() -> None:
    """awaiting_approval goes to pending (approved), failed (denied) or confirmed (resolved by hand);
    failed, abandoned and confirmed records of an approve= tool may ask again; nothing is held."""
    assert st.ALLOWED[State.AWAITING_APPROVAL] == {State.PENDING, State.FAILED, State.CONFIRMED}
    for frm in (State.FAILED, State.ABANDONED, State.CONFIRMED):
        assert State.AWAITING_APPROVAL in st.ALLOWED[frm]
    for frm in (State.PENDING, State.IN_FLIGHT, State.UNKNOWN, State.NEEDS_REVIEW):
        assert State.AWAITING_APPROVAL not in st.ALLOWED[frm]
    assert State.AWAITING_APPROVAL not in st.HELD | st.UNSETTLED | st.SETTLED
    rec = st.ask_approval(key="k", scope="s", tool="t", fingerprint="f" * 64, args_json="{}", by="o", now=1.0)
    with pytest.raises(st.IllegalTransition):
        st.mark_unknown(rec, now=2.0, reason="x", by=None)
    approved = st.approve(rec, now=2.0, by="ana")
    assert st.approved_unclaimed(approved) and st.approval_of(approved) is not None
    claimed = st.claim_again(approved, state=State.IN_FLIGHT, owner="o", now=3.0, lease_seconds=30, reason="run")
    assert (claimed.fence, claimed.attempts) == (1, 1) and st.approval_of(claimed) is not None
    done = st.confirm(claimed, result_json="1", now=4.0, ttl=None, via="run", by="o")
    assert st.approval_of(done) is None  # spent by the run
    assert not st.may_have_happened(st.fail(claimed, error="x", now=4.0, retry_at=None, ttl=None, by="o", effect=False))


def test_a_postgres_ledger_of_schema_1_is_migrated(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A PostgreSQL ledger made before approvals (schema 1: its state check lists seven states) opens,
    keeps its records, and takes awaiting_approval records."""
    import psycopg

    url = empty_store_url("postgres", request, tmp_path)
    schema = url.rsplit("schema=", 1)[1]
    shop = Payments(url, tmp_path, approve=False)
    shop.pay("ana", 1)
    shop.close()
    db = url.split("?", 1)[0]
    v1 = "'pending', 'in_flight', 'confirmed', 'failed', 'unknown', 'needs_review', 'abandoned'"
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(
            f'ALTER TABLE "{schema}".onceonly_records DROP CONSTRAINT onceonly_records_state_check, '
            f"ADD CONSTRAINT onceonly_records_state_check CHECK (state IN ({v1}))"
        )
        conn.execute(f'DROP TABLE "{schema}".onceonly_controls')  # schema 3's, for a ledger of schema 1
        conn.execute(f'DELETE FROM "{schema}".onceonly_schema WHERE version > 1')
    shop = Payments(url, tmp_path)
    try:
        assert len(shop.ledger.list()) == 1
        with pytest.raises(ApprovalPending):
            shop.pay("bo", 2)
        with psycopg.connect(db) as conn:
            versions = [r[0] for r in conn.execute(f'SELECT version FROM "{schema}".onceonly_schema ORDER BY 1')]
        assert versions == [1, 2, 3]
    finally:
        shop.close()


# --- the command line -----------------------------------------------------------------------------


def test_the_cli_approves_and_denies_by_key_prefix(sqlite_url: str, tmp_path: Path) -> None:
    """`onceonly approve KEY --by NAME --reason TEXT` and `onceonly deny`: a unique prefix finds the key;
    `ls --state awaiting_approval` lists what waits; a record that does not wait is an error (exit 1)."""
    from click.testing import CliRunner

    from onceonly.cli import cli

    def run(*args: str) -> Any:
        return CliRunner().invoke(cli, [*args, "--url", sqlite_url])

    shop = Payments(sqlite_url, tmp_path)
    try:
        for amount in (1, 2):
            with pytest.raises(ApprovalPending):
                shop.pay("ana", amount)
        listed = run("ls", "--state", "awaiting_approval", "--json")
        assert listed.exit_code == 0, listed.output
        assert len(json.loads(listed.output)["records"]) == 2
        one, two = shop.pay.key_for("ana", 1), shop.pay.key_for("ana", 2)
        prefix = next(one[:n] for n in range(len("default:pay:") + 1, len(one)) if not two.startswith(one[:n]))
        done = run("approve", prefix, "--by", "maria", "--reason", "known customer")
        assert done.exit_code == 0, done.output
        assert "approved by maria" in done.output
        assert shop.pay("ana", 1) == {"paid": "ana", "amount": 1}
        again = run("approve", one, "--by", "maria")
        assert again.exit_code == 1 and "not awaiting approval" in again.output
        ambiguous = run("deny", "default:pay:", "--by", "maria")
        assert ambiguous.exit_code == 2
        denied = run("deny", two, "--by", "maria", "--reason", "too much", "--json")
        assert denied.exit_code == 0, denied.output
        assert json.loads(denied.output)["state"] == "failed"
        with pytest.raises(ApprovalDenied):
            shop.pay("ana", 2)
        assert run("approve", "default:pay:nope", "--by", "maria").exit_code == 1
        assert run("approve", one).exit_code == 2  # --by is required
        assert shop.runs() == {"ana:1": 1}
    finally:
        shop.close()


def test_a_dry_run_says_it_would_ask(shop: Payments) -> None:
    """In a dry run an operation that needs approval would ask (nothing written); an approved one runs;
    a denied one is refused."""
    with shop.ledger.dry_run() as seen:
        shop.pay("fay", 3)
    assert [c.would for c in seen] == ["ask"] and shop.ledger.list() == []
    with pytest.raises(ApprovalPending):
        shop.pay("fay", 3)
    with pytest.raises(ApprovalPending):
        shop.pay("gus", 4)
    shop.ledger.approve(shop.pay.key_for("fay", 3), by="maria")
    shop.ledger.deny(shop.pay.key_for("gus", 4), by="maria")
    with shop.ledger.dry_run() as seen:
        shop.pay("fay", 3)
        shop.pay("gus", 4)
    assert [c.would for c in seen] == ["run", "refuse"]
    assert shop.runs() == {}


def test_a_copy_moves_requests_and_approvals_as_they_are(shop: Payments, tmp_path: Path) -> None:
    """`onceonly copy` moves a record awaiting approval and an approved one unchanged (nobody holds an
    approved record's lease: it is not copied as unknown), and the target runs the approved one once."""
    from onceonly.transfer import copy_records, store_records

    for to in ("ana", "bo"):
        with pytest.raises(ApprovalPending):
            shop.pay(to, 1)
    shop.ledger.approve(shop.pay.key_for("ana", 1), by="maria")
    target_url = f"sqlite:///{tmp_path / 'target.db'}"
    with Ledger.open(target_url) as target:
        report = copy_records(store_records(shop.ledger.store), target.store, in_flight="unknown")
        assert report.as_unknown == 0
        states = {r.key: r.state for r in target.list()}
    assert states == {shop.pay.key_for("ana", 1): State.PENDING, shop.pay.key_for("bo", 1): State.AWAITING_APPROVAL}
    (tmp_path / "t").mkdir()
    moved = Payments(target_url, tmp_path / "t")
    try:
        assert moved.pay("ana", 1) == {"paid": "ana", "amount": 1}
        with pytest.raises(ApprovalPending):
            moved.pay("bo", 1)
    finally:
        moved.close()


def test_an_expired_result_asks_again(url: str, tmp_path: Path) -> None:
    """A confirmed record past its ttl is a new operation: it asks a person again before it runs."""
    from tests._clock import FakeClock

    clock = FakeClock()
    ledger = Ledger.open(url, clock=clock, sleep=clock.sleep)
    runs: list[str] = []

    @ledger.tool(name="post", approve=True, ttl=60)
    def post(text: str) -> str:
        runs.append(text)
        return text

    try:
        with pytest.raises(ApprovalPending):
            post("hello")
        ledger.approve(post.key_for("hello"), by="maria")
        assert post("hello") == "hello" and post.outcome("hello").replayed
        clock.now += 120
        with pytest.raises(ApprovalPending):
            post("hello")
        rec = ledger.get(post.key_for("hello"))
        assert rec is not None and (rec.state, rec.attempts, rec.result_json) == (State.AWAITING_APPROVAL, 0, None)
        ledger.approve(rec.key, by="maria")
        assert post("hello") == "hello"
        assert runs == ["hello", "hello"]
    finally:
        ledger.close()


def test_approve_settings_are_checked(sqlite_url: str) -> None:
    """approve= takes True, False or a function; a read tool has nothing to approve; the function must
    answer True or False."""
    ledger = Ledger.open(sqlite_url)
    try:
        with pytest.raises(TypeError, match="approve="):
            ledger.tool(approve="yes")  # type: ignore[call-overload]
        with pytest.raises(ValueError, match="read tool"):
            ledger.tool(effect="read", approve=True)

        @ledger.tool(name="odd", approve=lambda args: "maybe")  # type: ignore[arg-type, return-value]
        def odd(x: int) -> int:
            return x

        with pytest.raises(TypeError, match="return True"):
            odd(1)
        assert ledger.list() == []
    finally:
        ledger.close()
