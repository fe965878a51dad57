"""Budgets (``budget=onceonly.Budget(...)``) on every store, Redis Cluster included: a call over its
window's limit is refused before it runs; the window counts every call that may have happened (an
unknown holds its amount) and frees one only once it is settled as failed; racing processes never
slip past the limit together. Side effects are counted in a SQLite file of their own."""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import onceonly
from onceonly import NOT_FOUND, ApprovalPending, Budget, BudgetExceeded, Ledger, OutcomeUnknown, State
from onceonly.budgets import parse_per, window_of
from tests._clock import FakeClock
from tests._workers import effects_db
from tests.conftest import empty_store_url
from tests.stores.conftest import fixture_redis_cluster_url  # noqa: F401 - the private Redis Cluster

STORES = ["sqlite", "redis", "redis-cluster", "postgres"]


@pytest.fixture(name="url", params=STORES)
def fixture_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty ledger's URL on each store."""
    return empty_store_url(request.param, request, tmp_path)


@pytest.fixture(name="clock")
def fixture_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(name="ledger")
def fixture_ledger(url: str, clock: FakeClock) -> Iterator[Ledger]:
    ledger = Ledger.open(url, clock=clock, sleep=clock.sleep)
    yield ledger
    ledger.close()


@pytest.fixture(name="effects")
def fixture_effects(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    conn = effects_db(tmp_path / "effects.db")
    yield conn
    conn.close()


def _ran(effects: sqlite3.Connection, op: str | None = None) -> int:
    if op is None:
        return int(effects.execute("SELECT count(*) FROM effects").fetchone()[0])
    return int(effects.execute("SELECT count(*) FROM effects WHERE op = ?", (op,)).fetchone()[0])


def _used(ledger: Ledger) -> dict[str, float]:
    store: Any = ledger.store
    return {u.budget: u.used for u in store.budget_usage(ledger.clock())}


def _pay_tool(ledger: Ledger, effects: sqlite3.Connection, budget: Budget, name: str = "pay") -> Any:
    @ledger.tool(name=name, budget=budget)
    def pay(order: str, cents: int) -> str:
        effects.execute("INSERT INTO effects VALUES (?, ?, 0)", (f"{name}:{order}", name))
        return f"paid {order}"

    return pay


def test_within_the_limit_runs_and_past_it_is_refused_before_it_runs(
    ledger: Ledger, effects: sqlite3.Connection, clock: FakeClock
) -> None:
    pay = _pay_tool(ledger, effects, Budget(amount="cents", limit=10, per="1d"))
    assert pay("a", 4) == "paid a"
    assert pay("b", 5) == "paid b"
    with pytest.raises(BudgetExceeded) as refused:
        pay("c", 2)
    err = refused.value
    assert (err.used, err.limit, err.amount) == (9, 10, 2)
    assert err.budget == "tool:pay:scope:default"
    assert err.resets_at == window_of(86400, clock())[2]
    assert "2 " in str(err) or "needs 2" in str(err)
    assert ledger.get(err.key) is None  # nothing was recorded
    assert _ran(effects, "pay:c") == 0
    # A replay runs nothing and counts nothing twice; a call that fits still runs.
    assert pay.outcome("a", 4).replayed
    assert pay("d", 1) == "paid d"
    assert _used(ledger) == {"tool:pay:scope:default": 10}
    assert _ran(effects) == 3


def test_a_plain_tool_pays_nothing_and_makes_nothing(ledger: Ledger, effects: sqlite3.Connection) -> None:
    @ledger.tool
    def plain(order: str) -> str:
        effects.execute("INSERT INTO effects VALUES (?, 'plain', 0)", (order,))
        return order

    plain("a")
    assert _used(ledger) == {}
    if ledger.url.startswith("sqlite"):
        conn = sqlite3.connect(ledger.url.removeprefix("sqlite:///"))
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        conn.close()
        assert not [t for t in tables if "budget" in t]


def test_by_scope_tool_and_a_shared_name(ledger: Ledger, effects: sqlite3.Connection) -> None:
    per_scope = _pay_tool(ledger, effects, Budget(amount="cents", limit=5, per="1h"), name="scoped")
    with ledger.task("t1"):
        per_scope("a", 5)
        with pytest.raises(BudgetExceeded):
            per_scope("b", 1)
    with ledger.task("t2"):
        assert per_scope("b", 5) == "paid b"  # another scope, another budget

    per_tool = _pay_tool(ledger, effects, Budget(amount="cents", limit=5, per="1h", by="tool"), name="whole")
    with ledger.task("t1"):
        per_tool("a", 3)
    with ledger.task("t2"), pytest.raises(BudgetExceeded) as refused:
        per_tool("b", 3)
    assert refused.value.budget == "tool:whole"

    shared = Budget(amount="cents", limit=10, per="1d", by="spend")
    first = _pay_tool(ledger, effects, shared, name="first")
    second = _pay_tool(ledger, effects, shared, name="second")
    with ledger.task("t1"):
        first("a", 6)
    with ledger.task("t2"), pytest.raises(BudgetExceeded) as refused:
        second("a", 5)
    assert refused.value.budget == "spend"
    second("b", 4)
    assert _used(ledger)["spend"] == 10
    assert _ran(effects, "second:a") == 0 and _ran(effects, "second:b") == 1


def test_an_unknown_holds_its_amount_until_it_is_resolved_failed(ledger: Ledger, effects: sqlite3.Connection) -> None:
    @ledger.tool(name="charge", on_unknown="review", budget=Budget(amount="cents", limit=10, per="1d"))
    def charge(order: str, cents: int) -> str:
        effects.execute("INSERT INTO effects VALUES (?, 'charge', 0)", (order,))
        if order == "lost":
            raise TimeoutError("the answer was lost")  # sent, outcome unknown
        return order

    with pytest.raises(OutcomeUnknown) as unknown:
        charge("lost", 8)
    key = unknown.value.key
    rec = ledger.get(key)
    assert rec is not None and rec.state in (State.UNKNOWN, State.NEEDS_REVIEW)
    assert _used(ledger) == {"tool:charge:scope:default": 8}
    with pytest.raises(BudgetExceeded):
        charge("next", 3)  # the unknown may have happened: it counts
    # Asked again, the unknown is not counted twice.
    with pytest.raises(OutcomeUnknown):
        charge("lost", 8)
    assert _used(ledger) == {"tool:charge:scope:default": 8}
    ledger.resolve(key, failed="the bank says it never arrived")
    assert _used(ledger) == {"tool:charge:scope:default": 0}
    assert charge("next", 3) == "next"
    assert _ran(effects, "next") == 1


def test_a_definite_failure_frees_its_amount(ledger: Ledger, effects: sqlite3.Connection) -> None:
    @ledger.tool(name="refund", budget=Budget(amount="cents", limit=10, per="1d"))
    def refund(order: str, cents: int) -> str:
        effects.execute("INSERT INTO effects VALUES (?, 'refund', 0)", (order,))
        raise ValueError("card declined")

    with pytest.raises(ValueError, match="declined"):
        refund("a", 9)
    assert _used(ledger) == {"tool:refund:scope:default": 0}


def test_the_reconciler_settling_an_unknown_as_failed_frees_it(ledger: Ledger, effects: sqlite3.Connection) -> None:
    asked = {"n": 0}

    def find(args: dict[str, Any], key: str) -> Any:
        asked["n"] += 1
        if asked["n"] == 1:
            raise ConnectionError("the other side is down")  # in-call: stays unknown for the reconciler
        return NOT_FOUND

    @ledger.tool(name="send", on_unknown="probe", probe=find, budget=Budget(amount="cents", limit=10, per="1d"))
    def send(order: str, cents: int) -> str:
        effects.execute("INSERT INTO effects VALUES (?, 'send', 0)", (order,))
        raise TimeoutError("no answer")

    with pytest.raises(OutcomeUnknown):
        send("a", 7)
    assert _used(ledger) == {"tool:send:scope:default": 7}
    report = ledger.reconcile()
    assert [ln.settlement.value for ln in report.lines] == ["failed"]
    assert _used(ledger) == {"tool:send:scope:default": 0}


def test_windows_are_fixed_and_a_replay_of_an_earlier_window_costs_nothing(
    ledger: Ledger, effects: sqlite3.Connection, clock: FakeClock
) -> None:
    pay = _pay_tool(ledger, effects, Budget(amount="cents", limit=10, per="1h"))
    pay("a", 10)
    with pytest.raises(BudgetExceeded) as refused:
        pay("b", 1)
    clock.now = refused.value.resets_at  # the next window: empty
    assert pay.outcome("a", 10).replayed  # done in the last window: replayed, not counted again
    assert _used(ledger) == {"tool:pay:scope:default": 0}
    pay("b", 10)
    assert pay.outcome("a", 10).replayed  # a full window still replays what is done
    assert _ran(effects) == 2


def test_an_async_tool_is_budgeted_the_same(ledger: Ledger, effects: sqlite3.Connection) -> None:
    @ledger.tool(name="book", budget=Budget(amount=lambda args: args["n"] * 2, limit=10, per=3600))
    async def book(n: int) -> int:
        effects.execute("INSERT INTO effects VALUES (?, 'book', 0)", (str(n),))
        return n

    async def main() -> None:
        assert await book(3) == 3
        assert await book(2) == 2
        with pytest.raises(BudgetExceeded):
            await book(1)

    asyncio.run(main())
    assert _used(ledger) == {"tool:book:scope:default": 10}
    assert _ran(effects) == 2


def test_the_model_is_told_it_is_over_the_limit(ledger: Ledger, effects: sqlite3.Connection) -> None:
    @ledger.tool(name="tip", tell_model=True, budget=Budget(amount="cents", limit=1, per="1d"))
    def tip(order: str, cents: int) -> str:
        effects.execute("INSERT INTO effects VALUES (?, 'tip', 0)", (order,))
        return "tipped"

    assert tip("a", 1) == "tipped"
    text = tip("b", 1)
    assert text.startswith("This action was not done: it would exceed its limit (1 of 1 used")
    assert _ran(effects) == 1


# --- racing processes ----------------------------------------------------------------------------


def race_worker(url: str, effects_path: str, n: int, start: Any, out: Any) -> None:
    """One process: one distinct operation of amount 1 against a limit of 10, once the start is given.
    Every process opens the new ledger at the same time too; whatever it raises is reported."""
    try:
        ledger = Ledger.open(url)
    except BaseException as exc:
        out.put(f"open: {type(exc).__name__}: {exc}")
        return
    conn = effects_db(effects_path)

    @ledger.tool(name="race", budget=Budget(amount="units", limit=10, per="1d"))
    def spend(op: int, units: int) -> int:
        conn.execute("INSERT INTO effects VALUES (?, 'race', 0)", (str(op),))
        return op

    start.wait(60)
    try:
        spend(n, 1)
        out.put("ran")
    except BudgetExceeded:
        out.put("refused")
    except BaseException as exc:
        out.put(f"{type(exc).__name__}: {exc}")
    finally:
        ledger.close()
        conn.close()


def test_sixteen_racing_processes_never_slip_past_the_limit(url: str, tmp_path: Path) -> None:
    effects_path = str(tmp_path / "race-effects.db")
    effects_db(effects_path).close()
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=race_worker, args=(url, effects_path, n, start, out)) for n in range(16)]
    for p in procs:
        p.start()
    start.set()
    said = sorted(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    assert said == ["ran"] * 10 + ["refused"] * 6, said
    conn = effects_db(effects_path)
    try:
        assert _ran(conn) == 10
    finally:
        conn.close()
    ledger = Ledger.open(url)
    try:
        assert _used(ledger) == {"tool:race:scope:default": 10}
    finally:
        ledger.close()


# --- settings refused with what to do ---------------------------------------------------------


def test_bad_budgets_are_refused_at_decoration(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="limit"):
        Budget(amount="cents", limit=0)
    with pytest.raises(ValueError, match="limit"):
        Budget(amount="cents", limit=math.inf)
    with pytest.raises(ValueError, match="per="):
        Budget(amount="cents", limit=1, per="1 fortnight")
    with pytest.raises(ValueError, match="per="):
        Budget(amount="cents", limit=1, per=0)
    with pytest.raises(TypeError, match="amount"):
        Budget(amount=3, limit=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="by="):
        Budget(amount="cents", limit=1, by="")
    with pytest.raises(ValueError, match="tool:"):
        Budget(amount="cents", limit=1, by="tool:mine")
    assert (parse_per("1d"), parse_per("30m"), parse_per("1.5h"), parse_per(90)) == (86400, 1800, 5400, 90)

    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    try:
        with pytest.raises(TypeError, match="not one of its parameters"):
            ledger.tool(budget=Budget(amount="price", limit=1))(lambda order, cents: None)
        with pytest.raises(TypeError, match="ignore="):
            ledger.tool(ignore=("cents",), budget=Budget(amount="cents", limit=1))(lambda order, cents: None)
        with pytest.raises(TypeError, match="effect='read'"):
            ledger.tool(readonly=True, budget=Budget(amount="cents", limit=1))(lambda order, cents: None)
        with pytest.raises(TypeError, match=r"onceonly\.Budget"):
            ledger.tool(budget={"limit": 1})(lambda order, cents: None)  # type: ignore[call-overload]

        def one(order: str, cents: int) -> None: ...
        def two(order: str, cents: int) -> None: ...

        ledger.tool(budget=Budget(amount="cents", limit=5, by="shared"))(one)
        with pytest.raises(ValueError, match="same"):
            ledger.tool(budget=Budget(amount="cents", limit=6, by="shared"))(two)
    finally:
        ledger.close()


@pytest.mark.parametrize("bad", ["12", None, True, -1, math.nan, math.inf])
def test_a_bad_amount_is_refused_before_anything_runs(tmp_path: Path, bad: Any) -> None:
    ledger = Ledger.open(f"sqlite:///{tmp_path / 'l.db'}")
    ran = []
    try:

        @ledger.tool(budget=Budget(amount="cents", limit=100))
        def pay(order: str, cents: Any) -> None:
            ran.append(order)

        # NaN and infinity are refused already as key material, every other bad amount by the budget.
        with pytest.raises((TypeError, ValueError), match=r"finite number|NaN and infinity"):
            pay("a", bad)
        assert ran == [] and ledger.list() == []
    finally:
        ledger.close()


def test_budget_is_exported() -> None:
    assert onceonly.Budget is Budget


# --- a person frees an amount; stats and the dashboard show the windows --------------------------


def _parked(url: str, order: str) -> str:
    """A charge of 8 of 10 whose outcome is unknown, parked for review: its key."""
    with Ledger.open(url) as ledger:

        @ledger.tool(name="charge", on_unknown="review", budget=Budget(amount="cents", limit=10, per="1d", by="tool"))
        def charge(order: str, cents: int) -> str:
            raise TimeoutError("the answer was lost")

        with pytest.raises(OutcomeUnknown) as unknown:
            charge(order, 8)
        return unknown.value.key


def _used_at(url: str) -> dict[str, float]:
    with Ledger.open(url) as ledger:
        return _used(ledger)


def test_onceonly_resolve_failed_frees_and_stats_show_the_windows(url: str) -> None:
    from click.testing import CliRunner

    from onceonly.cli import cli

    key = _parked(url, "o-1")
    shown = CliRunner().invoke(cli, ["stats", "--url", url, "--json"])
    assert shown.exit_code == 0, shown.output
    (window,) = json.loads(shown.output)["budgets"]
    assert (window["budget"], window["used"], window["limit"]) == ("tool:charge", 8, 10)
    assert window["window_start"].endswith("T00:00:00.000Z") and window["window_end"].endswith("T00:00:00.000Z")
    table = CliRunner().invoke(cli, ["stats", "--url", url])
    assert table.exit_code == 0 and "budgets" in table.output and "tool:charge" in table.output, table.output

    done = CliRunner().invoke(cli, ["resolve", key, "--url", url, "--failed", "the bank shows no charge"])
    assert done.exit_code == 0, done.output
    assert _used_at(url) == {"tool:charge": 0}


def test_the_dashboards_resolve_frees_and_its_stats_show_the_windows(url: str) -> None:
    from starlette.testclient import TestClient

    from onceonly.dashboard.app import create_app

    key = _parked(url, "o-1")
    with Ledger.open(url) as ledger, TestClient(create_app(ledger), base_url="http://127.0.0.1:8765") as client:
        budgets = client.get("/api/stats").json()["budgets"]
        assert [(b["budget"], b["used"]) for b in budgets] == [("tool:charge", 8)]
        version = ledger.get(key).version  # type: ignore[union-attr]
        body = {"key": key, "version": version, "by": "ana", "why": "no charge", "failed": "no charge"}
        answer = client.post("/api/resolve", json=body)
        assert answer.status_code == 200, answer.text
        assert _used(ledger) == {"tool:charge": 0}


def test_a_conflict_frees_what_it_reserved(ledger: Ledger, effects: sqlite3.Connection, clock: FakeClock) -> None:
    @ledger.tool(name="order", key=("order_id",), budget=Budget(amount="cents", limit=10, per="1h"))
    def order(order_id: str, cents: int) -> str:
        effects.execute("INSERT INTO effects VALUES (?, 'order', 0)", (order_id,))
        return order_id

    order("o-1", 4)
    clock.now += 3600  # the next window: the same key with other arguments is a conflict, and costs nothing
    with pytest.raises(onceonly.KeyConflict):
        order("o-1", 6)
    assert _used(ledger) == {"tool:order:scope:default": 0}
    assert _ran(effects) == 1


def test_a_dry_run_says_refuse_past_the_limit_and_reserves_nothing(ledger: Ledger, effects: sqlite3.Connection) -> None:
    pay = _pay_tool(ledger, effects, Budget(amount="cents", limit=10, per="1d"))
    pay("a", 6)
    with ledger.dry_run() as seen:
        pay("b", 4)
        pay("c", 5)
        pay("a", 6)
    assert [(call.arguments["order"], call.would) for call in seen] == [("b", "run"), ("c", "refuse"), ("a", "replay")]
    assert _used(ledger) == {"tool:pay:scope:default": 6}
    assert _ran(effects) == 1


def test_a_langchain_tool_over_its_budget_tells_the_model(tmp_path: Path) -> None:
    """Through an integration (LangChain's real ``@tool``, guarded): the call past the limit reaches the
    model as an error ToolMessage saying it was not done, and its body never ran."""
    pytest.importorskip("langchain_core")
    from langchain_core.messages import ToolMessage
    from langchain_core.tools import tool

    from onceonly.langchain import guard

    ran: list[str] = []

    @tool
    def pay(order: str, cents: int) -> str:
        """Pay an order."""
        ran.append(order)
        return f"paid {order}"

    with Ledger.open(f"sqlite:///{tmp_path / 'l.db'}") as ledger:
        guarded = guard(pay, ledger, budget=Budget(amount="cents", limit=10, per="1d", by="tool"))
        first = guarded.invoke({"type": "tool_call", "name": "pay", "args": {"order": "a", "cents": 8}, "id": "c1"})
        second = guarded.invoke({"type": "tool_call", "name": "pay", "args": {"order": "b", "cents": 3}, "id": "c2"})
    assert isinstance(first, ToolMessage) and first.status == "success" and first.content == "paid a"
    assert isinstance(second, ToolMessage) and second.status == "error"
    assert str(second.content).startswith("This action was not done: it would exceed its limit (8 of 10 used")
    assert ran == ["a"]


def crash_before_claim(url: str) -> None:
    """A process that dies after its reservation, at the claim (nothing of the record written)."""
    import os

    ledger = Ledger.open(url)
    store: Any = ledger.store
    store.claim = lambda record: os._exit(3)  # the claim never happens: the process is gone

    @ledger.tool(name="crash", budget=Budget(amount="cents", limit=10, per="1d", by="tool"))
    def crash(order: str, cents: int) -> str:
        return order

    crash("a", 7)


def test_a_crash_between_reserve_and_claim_keeps_the_amount_held(url: str) -> None:
    """The safe side: the amount stays held (until its window ends) though no record was made."""
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=crash_before_claim, args=(url,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 3
    with Ledger.open(url) as ledger:
        assert ledger.list() == []
        assert _used(ledger) == {"tool:crash": 7}


def test_a_call_waiting_for_approval_holds_nothing_and_its_approved_run_counts_once(
    ledger: Ledger, effects: sqlite3.Connection
) -> None:
    """approve= and budget= together: the request for approval ran nothing, so its amount is freed;
    the approved run reserves it then, once, and a replay adds nothing."""

    @ledger.tool(name="pay", approve=True, budget=Budget(amount="cents", limit=100, per="1d", by="tool"))
    def pay(order: str, cents: int) -> str:
        effects.execute("INSERT INTO effects VALUES (?, ?, 0)", (order, "pay"))
        return order

    with pytest.raises(ApprovalPending) as asked:
        pay("o-1", 60)
    assert _used(ledger).get("tool:pay", 0) == 0
    ledger.approve(asked.value.key, by="ana")
    assert pay("o-1", 60) == "o-1" and pay("o-1", 60) == "o-1"
    assert _used(ledger)["tool:pay"] == 60 and _ran(effects) == 1
