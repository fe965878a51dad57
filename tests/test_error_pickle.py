"""Every exported onceonly error pickles with its message and attributes: DBOS records a failed step's
exception by pickling it, and Celery, ``multiprocessing`` and Ray carry exceptions across processes the
same way. Each error is built as the library builds it, around a record read from a real ledger."""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import pytest

import onceonly
from onceonly import Ledger, State, errors
from onceonly.plan import Outcome
from onceonly.states import Record


@pytest.fixture(name="records")
def fixture_records(sqlite_url: str) -> tuple[Record, Record]:
    """A confirmed and an in-flight record, as the ledger stores them."""
    with Ledger.open(sqlite_url) as ledger:

        @ledger.tool(name="create_ticket")
        def create_ticket(title: str) -> dict[str, Any]:
            return {"id": 7, "title": title}

        with ledger.task("conv-1"):
            create_ticket("toner")
        done = ledger.list(state=State.CONFIRMED)[0]
        running = Record(
            key="conv-1:create_ticket:0f3a", scope="conv-1", tool="create_ticket", fingerprint="0f3a" * 16,
            state=State.IN_FLIGHT, attempts=1, fence=1, lease_owner="host-1:4242:ab12", lease_until=1.8e9,
            created_at=1.7e9, updated_at=1.7e9, args_json='{"title": "toner"}',
        )  # fmt: skip
        return done, running


def cases(done: Record, running: Record) -> list[errors.OnceOnlyError]:
    key = done.key
    earlier = Outcome({"id": 7, "title": "toner"}, key, State.CONFIRMED, True, 1, via="run", settled_at=1.7e9)
    return [
        errors.OnceOnlyError("resolve needs exactly one of confirmed=RESULT or failed=REASON"),
        errors.InProgress(f"{running.key!r} is running now (lease held by host-1)", key=running.key, record=running),
        errors.RetryScheduled(f"{key!r}: next attempt at 12:00:05", key=key, record=running, retry_at=1.7e9 + 5),
        errors.OutcomeUnknown(f"{key!r}: the outcome is unknown; onceonly resolve {key}", key=key, record=running),
        errors.KeyConflict(f"{key!r} was used with other arguments", key=key, record=done, fingerprint="9" * 64),
        errors.SimilarCall(
            f"a call like this one was made as {key!r}",
            key=key,
            record=done,
            outcome=earlier,
            score=0.93,
            new_key="conv-1:create_ticket:77aa",
        ),
        errors.AttemptsExhausted(
            f"{key!r}: 3 attempts failed", key=key, record=running, last_exception=TimeoutError("read timed out")
        ),
        errors.ReentrantCall(f"{key!r} was called again inside itself", key=key, record=running),
        errors.ApprovalPending(f"{key!r} waits for a person's approval", key=key, asked_at=1.7e9),
        errors.Refused(f"{key!r} was refused", key=key),
        errors.Paused(
            f"{key!r}: calls of create_ticket are paused", key=key, reason="incident 7", tool="create_ticket"
        ),
        errors.BudgetExceeded(
            f"{key!r} would exceed budget spend",
            key=key,
            budget="spend",
            limit=1000,
            used=990,
            amount=20,
            resets_at=1.7e9 + 86400,
        ),
        errors.ApprovalDenied(f"{key!r} was denied by ana", key=key, by="ana", reason="wrong customer"),
        errors.InvalidKey("the key is empty: give a non-empty name such as 'order-42'"),
        errors.NotSerializable("args.order.items[2] is a set: no JSON form", path="args.order.items[2]", value={1}),
        errors.StoreError("the store failed"),
        errors.StoreUnavailable("redis://127.0.0.1:6379/0 did not answer within 2 s"),
        errors.StoreCorrupt("/tmp/ledger.db is not an onceonly ledger (no schema table)"),
    ]


def same(a: Any, b: Any) -> bool:
    if isinstance(a, BaseException):
        return type(a) is type(b) and a.args == b.args
    return bool(a == b)


def test_every_exported_error_has_a_case(records: tuple[Record, Record]) -> None:
    """The cases cover every exception class that onceonly and onceonly.errors export."""
    exported = {
        obj
        for module in (onceonly, errors)
        for name in module.__all__
        if inspect.isclass(obj := getattr(module, name)) and issubclass(obj, BaseException)
    }
    assert {type(e) for e in cases(*records)} == exported


def test_every_error_round_trips_through_pickle(records: tuple[Record, Record]) -> None:
    for error in cases(*records):
        again = pickle.loads(pickle.dumps(error))
        assert type(again) is type(error)
        assert str(again) == str(error) and again.args == error.args
        assert vars(again).keys() == vars(error).keys()
        for name, value in vars(error).items():
            assert same(getattr(again, name), value), (type(error).__name__, name)
        if isinstance(error, errors.InProgress | errors.OutcomeUnknown | errors.ReentrantCall):
            assert again.state == error.state is not None
        assert isinstance(again, ValueError) == isinstance(error, ValueError)
        assert isinstance(again, TypeError) == isinstance(error, TypeError)
