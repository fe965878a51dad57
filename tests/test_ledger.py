"""The guard's semantics, on every store: claim, run, settle; replays, failures, unknowns, waits."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

import onceonly
from onceonly import (
    NOT_FOUND,
    AttemptsExhausted,
    InProgress,
    KeyConflict,
    Ledger,
    OutcomeUnknown,
    Retry,
    State,
    TransitionEvent,
)
from onceonly import states as st
from onceonly.drivers import drive
from onceonly.errors import StoreUnavailable
from onceonly.plan import late_outcome
from onceonly.stores import open_store
from tests._clock import FakeClock
from tests._settling import Fault, FlakyStore


@pytest.fixture(name="real_ledger")
def fixture_real_ledger(store_url: str) -> Iterator[Ledger]:
    """A fresh ledger on each store, on real time (threads, leases, heartbeats)."""
    ledger = Ledger.open(store_url)
    yield ledger
    ledger.close()


def _wait_for(ledger: Ledger, key: str, done: Any) -> Any:
    """The record of ``key`` once ``done(record)`` holds (up to 5 s)."""
    for _ in range(100):
        rec = ledger.get(key)
        if rec is not None and done(rec):
            return rec
        time.sleep(0.05)
    raise AssertionError(f"{key}: never reached the expected state; last {ledger.get(key)}")


def _join_workers(tool: str) -> None:
    """Wait (up to 5 s each) for the worker threads of ``tool``'s timed-out attempts: a late outcome is
    recorded in its worker before the thread ends."""
    for thread in threading.enumerate():
        if thread.name == f"onceonly-{tool}"[:60]:
            thread.join(5)
            assert not thread.is_alive(), f"{thread.name} still runs"


def test_first_call_runs_then_replays(ledger: Ledger) -> None:
    """The tool runs once; the same call again returns the recorded result without running it."""
    runs: list[str] = []

    @ledger.tool(name="create")
    def create(title: str, *, idempotency_key: str) -> dict[str, Any]:
        runs.append(idempotency_key)
        return {"id": len(runs), "title": title}

    first = create.outcome("hello")
    again = create.outcome("hello")
    assert first.result == again.result == {"id": 1, "title": "hello"}
    assert (first.replayed, again.replayed) == (False, True)
    assert runs == [first.key] == [again.key]
    assert first.key.startswith("default:create:")
    rec = ledger.get(first.key)
    assert rec is not None and rec.state is State.CONFIRMED and rec.attempts == 1 and rec.fence == 1
    assert [(h["from"], h["to"]) for h in rec.history] == [(None, "in_flight"), ("in_flight", "confirmed")]


def test_positional_keyword_and_default_are_one_call(ledger: Ledger) -> None:
    """f(1), f(a=1) and f(1, b=2) with b defaulting to 2 are the same operation."""
    runs: list[int] = []

    @ledger.tool(name="f")
    def f(a: int, b: int = 2) -> int:
        runs.append(a)
        return a + b

    assert f(1) == f(a=1) == f(1, b=2) == f(1, 2) == 3
    assert runs == [1]


def test_a_wrong_call_is_pythons_own_type_error_and_runs_nothing(ledger: Ledger) -> None:
    """Binding has a fast path for all-positional calls; a call Python would refuse is refused the same way."""
    runs: list[int] = []

    @ledger.tool(name="g")
    def g(a: int, *, b: int) -> int:
        runs.append(a)
        return a + b

    with pytest.raises(TypeError, match="'b'"):
        g(1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        g(1, 2)  # type: ignore[misc]
    assert g(1, b=2) == 3 and runs == [1]


def test_key_fields_and_conflict(ledger: Ledger) -> None:
    """key= picks the fields of the operation; the same key with other arguments is a KeyConflict."""

    @ledger.tool(name="ticket", key=("session", "title"))
    def ticket(session: str, title: str, body: str) -> str:
        return body

    assert ticket("s", "t", "first body") == "first body"
    with pytest.raises(KeyConflict) as info:
        ticket("s", "t", "re-worded body")
    assert info.value.record is not None and info.value.record.args["body"] == "first body"
    assert "other arguments" in str(info.value) and info.value.key in str(info.value)
    assert ticket("s", "other title", "x") == "x"


def test_on_conflict_replay_keeps_both_argument_sets(ledger: Ledger) -> None:
    """on_conflict='replay' returns the earlier result, flagged, and notes the new arguments."""

    @ledger.tool(name="ticket", key=("session", "title"), on_conflict="replay")
    def ticket(session: str, title: str, body: str) -> str:
        return body

    ticket("s", "t", "first")
    out = ticket.outcome("s", "t", "second")
    assert (out.result, out.replayed, out.conflict) == ("first", True, True)
    rec = ledger.get(out.key)
    assert rec is not None and "second" in rec.history[-1]["reason"]


def test_ignore_and_normalize(ledger: Ledger) -> None:
    """ignore= fields are left out of the key; normalisers fold model noise before hashing."""
    runs: list[str] = []

    @ledger.tool(name="t", ignore=("requested_at",), normalize={"title": onceonly.normalize_text})
    def t(title: str, requested_at: float) -> str:
        runs.append(title)
        return title

    assert t("Printer  on fire", 1.0) == "Printer  on fire"
    assert t("printer on FIRE", 2.0) == "Printer  on fire"
    assert len(runs) == 1
    rec = ledger.get(t.key_for("printer on fire", 3.0))
    assert rec is not None and rec.args == {"title": "Printer  on fire"}


def test_occurrence_and_explicit_key(ledger: Ledger) -> None:
    """A call meant twice takes an occurrence number; an explicit key overrides the derived one."""
    runs: list[str] = []

    @ledger.tool(name="email")
    def email(to: str) -> int:
        runs.append(to)
        return len(runs)

    assert email("a") == 1
    assert email.using(occurrence=2)("a") == 2
    assert email.using(occurrence=2)("a") == 2
    assert email.using(key="order-42")("a") == 3
    assert email.using(key="order-42").outcome("a").key == "default:email:order-42"
    assert runs == ["a", "a", "a"]


def test_task_scopes_keys(ledger: Ledger) -> None:
    """The same call in two tasks is two operations; re-running a task replays its finished steps."""
    runs: list[str] = []

    @ledger.tool(name="step")
    def step(n: int) -> str:
        runs.append(f"{n}")
        return f"done {n}"

    with ledger.task("task-1"):
        assert step(1) == "done 1"
    with ledger.task("task-2"):
        assert step(1) == "done 1"
    with ledger.task("task-1"):
        out = step.outcome(1)
        assert out.replayed and out.key.startswith("task-1:")
    assert runs == ["1", "1"]


def test_not_sent_is_retried_with_backoff(ledger: Ledger, clock: FakeClock) -> None:
    """Refused connections are retried after a jittered backoff, attempts persisted."""
    calls: list[int] = []

    @ledger.tool(name="flaky", retry=Retry(attempts=4, base=1.0, cap=30.0))
    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionRefusedError("refused")
        return "ok"

    out = flaky.outcome()
    assert out.result == "ok" and out.attempts == 3 and out.fence == 3
    assert len(clock.sleeps) == 2
    assert 0 <= clock.sleeps[0] <= 1.0 and 0 <= clock.sleeps[1] <= 2.0
    rec = ledger.get(out.key)
    assert rec is not None
    assert [h["to"] for h in rec.history] == ["in_flight", "failed", "in_flight", "failed", "in_flight", "confirmed"]


def test_attempts_exhausted_then_reset(ledger: Ledger) -> None:
    """After the last attempt: abandoned, AttemptsExhausted with the last error, until a person resets it
    (the first attempt's outcome was unknown, so it may have happened: the record stays abandoned)."""
    calls: list[int] = []
    fail = True

    @ledger.tool(name="down", on_unknown="retry", retry=Retry(attempts=2, base=0.1))
    def down() -> str:
        calls.append(1)
        if fail:
            raise TimeoutError("read timed out") if len(calls) == 1 else ConnectionRefusedError("down")
        return "up"

    with pytest.raises(AttemptsExhausted) as info:
        down()
    assert isinstance(info.value.last_exception, ConnectionRefusedError)
    assert len(calls) == 2
    with pytest.raises(AttemptsExhausted, match="resolve"):
        down()
    assert len(calls) == 2
    rec = ledger.get(down.key_for())
    assert rec is not None and rec.state is State.ABANDONED
    ledger.resolve(rec.key, failed="service was down", reset=True, by="ops", why="fixed the DNS")
    fail = False
    assert down() == "up"
    assert len(calls) == 3


def test_definite_failure_is_reraised(ledger: Ledger) -> None:
    """The tool's own error is re-raised unchanged, recorded as failed; a later call may run again."""
    calls: list[int] = []

    @ledger.tool(name="strict")
    def strict(x: int) -> int:
        calls.append(x)
        if len(calls) == 1:
            raise ValueError("bad input")
        return x

    with pytest.raises(ValueError, match="bad input"):
        strict(1)
    rec = ledger.get(strict.key_for(1))
    assert rec is not None and rec.state is State.FAILED and "bad input" in (rec.error or "")
    assert strict(1) == 1
    assert calls == [1, 1]


def test_unknown_goes_to_review_and_a_person_resolves_it(ledger: Ledger) -> None:
    """on_unknown='review': parked, OutcomeUnknown, never re-run; resolve() settles it for every caller."""
    calls: list[int] = []

    @ledger.tool(name="charge")
    def charge(amount: int) -> str:
        calls.append(amount)
        raise TimeoutError("read timed out")

    with pytest.raises(OutcomeUnknown) as info:
        charge(5)
    assert info.value.state == "needs_review" and "onceonly resolve" in str(info.value)
    with pytest.raises(OutcomeUnknown):
        charge(5)
    assert calls == [5]
    ledger.resolve(info.value.key, confirmed={"charge": "ch_1"}, by="alice", why="seen in the PSP dashboard")
    out = charge.outcome(5)
    assert out.result == {"charge": "ch_1"} and out.replayed and out.via == "resolve"
    rec = ledger.get(out.key)
    assert rec is not None and rec.history[-1]["by"] == "alice"
    assert "seen in the PSP dashboard" in rec.history[-1]["reason"]
    assert calls == [5]


def test_probe_found_confirms_without_running_again(ledger: Ledger, clock: FakeClock) -> None:
    """on_unknown='probe': after settle seconds the probe finds the side effect; one side effect."""
    done: dict[str, int] = {}

    def find(args: dict[str, Any], key: str) -> Any:
        return {"id": done[args["title"]]} if args["title"] in done else NOT_FOUND

    @ledger.tool(name="create", on_unknown="probe", probe=find, settle=2.0)
    def create(title: str) -> dict[str, int]:
        done[title] = 7
        raise ConnectionResetError("answer lost")

    out = create.outcome("t")
    assert out.result == {"id": 7} and out.via == "probe" and out.attempts == 1
    assert 2.0 in clock.sleeps


def test_probe_not_found_runs_again(ledger: Ledger) -> None:
    """NOT_FOUND means it did not happen: run again while attempts remain."""
    calls: list[int] = []

    @ledger.tool(name="create", on_unknown="probe", probe=lambda a, k: NOT_FOUND)
    def create() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise TimeoutError("lost before arrival")
        return "made"

    out = create.outcome()
    assert out.result == "made" and out.attempts == 2 and len(calls) == 2


def test_probe_error_leaves_it_unknown(ledger: Ledger) -> None:
    """A probe that raises settles nothing: the record stays unknown for the reconciler."""

    def broken(args: dict[str, Any], key: str) -> Any:
        raise ConnectionRefusedError("search API down")

    @ledger.tool(name="create", on_unknown="probe", probe=broken)
    def create() -> str:
        raise TimeoutError("lost")

    with pytest.raises(OutcomeUnknown, match="probe failed") as info:
        create()
    rec = ledger.get(info.value.key)
    assert rec is not None and rec.state is State.UNKNOWN


def test_resend_uses_the_same_key(ledger: Ledger) -> None:
    """on_unknown='resend': the same key goes out again and a key-honouring server dedups it."""
    server: dict[str, str] = {}
    sent: list[str] = []

    @ledger.tool(name="post", on_unknown="resend")
    def post(body: str, *, idempotency_key: str) -> str:
        sent.append(idempotency_key)
        server.setdefault(idempotency_key, body)
        if len(sent) == 1:
            raise TimeoutError("response lost")
        return server[idempotency_key]

    assert post("hi") == "hi"
    assert len(set(sent)) == 1 and len(sent) == 2 and len(server) == 1


def test_unknown_with_attempts_exhausted_goes_to_review(ledger: Ledger) -> None:
    """resend/retry never turn an unknown into abandoned: it may have happened, so a person decides."""

    @ledger.tool(name="post", on_unknown="retry", retry=Retry(attempts=2, base=0.01))
    def post() -> str:
        raise TimeoutError("always lost")

    with pytest.raises(OutcomeUnknown, match="all attempts"):
        post()
    rec = ledger.get(post.key_for())
    assert rec is not None and rec.state is State.NEEDS_REVIEW and rec.attempts == 2


def test_expired_confirmed_record_runs_again_and_purge(ledger: Ledger, clock: FakeClock) -> None:
    """After ttl a confirmed record no longer replays; purge removes expired settled records only."""
    calls: list[int] = []

    @ledger.tool(name="daily", ttl=60)
    def daily() -> int:
        calls.append(1)
        return len(calls)

    @ledger.tool(name="lost")
    def lost() -> int:
        raise TimeoutError("x")

    assert daily() == 1
    with pytest.raises(OutcomeUnknown):
        lost()
    clock.now += 61
    assert daily() == 2
    clock.now += 61
    assert ledger.purge() == 1
    assert ledger.get(daily.key_for()) is None
    assert ledger.get(lost.key_for()) is not None


def test_unserialisable_result_is_kept_described(ledger: Ledger) -> None:
    """A result with no JSON form: the first caller gets it, the record keeps a description."""

    @ledger.tool(name="odd")
    def odd() -> object:
        return {1, 2}

    assert odd() == {1, 2}
    replay = odd.outcome()
    assert replay.result["$unserializable"] == "set"


class _Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


@pytest.mark.parametrize("value", [_Unprintable(), 10**5000], ids=["broken-repr", "int-too-long-to-print"])
def test_a_result_that_cannot_even_be_printed_is_still_kept_described(ledger: Ledger, value: object) -> None:
    """Neither JSON nor repr(): the side effect happened, so the first caller still gets the value and
    the record is confirmed with its type. Before, repr's own error reached the caller and the record
    stayed in_flight."""

    @ledger.tool(name="odd")
    def odd() -> object:
        return value

    assert odd() is value
    replay = odd.outcome()
    assert replay.state is State.CONFIRMED and replay.replayed
    assert replay.result["$unserializable"] == type(value).__name__
    assert replay.result["repr"].startswith("<repr failed: ")


def test_decode_on_replay(ledger: Ledger) -> None:
    """decode= turns the stored JSON back into the caller's type on a replay."""

    @ledger.tool(name="pair", decode=tuple)
    def pair() -> tuple[int, int]:
        return (1, 2)

    assert pair() == (1, 2)
    assert pair() == (1, 2)


def test_readonly_skips_the_ledger(ledger: Ledger) -> None:
    """readonly tools retry transient errors and write nothing."""
    calls: list[int] = []

    @ledger.tool(name="read", readonly=True, retry=Retry(attempts=3, base=0.01))
    def read() -> int:
        calls.append(1)
        if len(calls) < 2:
            raise TimeoutError("slow")
        return 42

    assert read() == 42
    assert ledger.stats()["confirmed"] == 0


def test_events_one_per_transition(ledger: Ledger) -> None:
    """Every transition is one event with key, tool, scope, from, to, attempt, fence, reason."""
    events: list[TransitionEvent] = []
    ledger.subscribe(events.append)

    @ledger.tool(name="ev")
    def ev() -> int:
        return 1

    ev()
    assert [(e.from_state, e.to_state, e.attempt, e.fence) for e in events] == [
        (None, "in_flight", 1, 1),
        ("in_flight", "confirmed", 1, 1),
    ]
    assert events[0].tool == "ev" and events[0].scope == "default"


def test_waiter_takes_over_an_expired_lease(ledger: Ledger, clock: FakeClock) -> None:
    """A caller that finds an in-flight record whose holder died settles it (here by probe)."""

    @ledger.tool(name="create", on_unknown="probe", probe=lambda a, k: {"found": True}, lease=10)
    def create() -> dict[str, bool]:
        raise AssertionError("must not run: the probe settles it")

    key = create.key_for()
    dead = st.new_record(
        key=key, scope="default", tool="create", fingerprint=create.spec.call((), {}, None, 1).fingerprint,
        args_json="{}", state=State.IN_FLIGHT, owner="dead-host:1:1", now=clock.now - 60, lease_seconds=10,
    )  # fmt: skip
    assert ledger.store.insert(dead)
    out = create.outcome()
    assert out.result == {"found": True} and out.via == "probe"
    rec = ledger.get(key)
    assert rec is not None
    assert [h["to"] for h in rec.history] == ["in_flight", "unknown", "confirmed"]
    assert "expired" in rec.history[1]["reason"]


def test_pending_record_of_a_dead_holder_runs_again(ledger: Ledger, clock: FakeClock) -> None:
    """A pending record (nothing was sent) whose lease expired is claimed again with no probe."""

    @ledger.tool(name="send", reports_dispatch=True, lease=10)
    def send() -> str:
        onceonly.mark_sent()
        return "sent"

    dead = st.new_record(
        key=send.key_for(), scope="default", tool="send", fingerprint=send.spec.call((), {}, None, 1).fingerprint,
        args_json="{}", state=State.PENDING, owner="dead-host:1:1", now=clock.now - 60, lease_seconds=10,
    )  # fmt: skip
    assert ledger.store.insert(dead)
    out = send.outcome()
    assert out.result == "sent" and out.attempts == 2 and out.fence == 2
    rec = ledger.get(out.key)
    assert rec is not None
    assert [h["to"] for h in rec.history] == ["pending", "pending", "in_flight", "confirmed"]


def test_error_before_dispatch_is_not_sent(ledger: Ledger) -> None:
    """With reports_dispatch, a timeout before mark_sent() cannot have happened: retried, no review."""
    calls: list[int] = []

    @ledger.tool(name="send", reports_dispatch=True, retry=Retry(attempts=3, base=0.01))
    def send() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise TimeoutError("DNS lookup timed out")
        onceonly.mark_sent()
        return "ok"

    assert send() == "ok" and len(calls) == 2


def test_an_expired_record_is_claimed_pending_by_a_tool_that_reports_dispatch(ledger: Ledger, clock: FakeClock) -> None:
    """Once its record expired, a call is a new operation, claimed like the first: ``pending`` until
    mark_sent(). An error before dispatch is then retried, not parked as unknown."""
    calls: list[str] = []

    @ledger.tool(name="send", reports_dispatch=True, ttl=60, retry=Retry(attempts=3, base=0.01))
    def send() -> str:
        calls.append(onceonly.current_call().state.value)  # type: ignore[union-attr]
        if len(calls) == 2:
            raise TimeoutError("DNS lookup timed out")
        onceonly.mark_sent()
        return "ok"

    assert send() == "ok"
    clock.now += 120  # the record expired
    assert send() == "ok"
    assert calls == ["pending", "pending", "pending"]
    rec = ledger.get(send.key_for())
    assert rec is not None and rec.state is State.CONFIRMED and rec.attempts == 2


def test_single_flight_second_caller_waits(real_ledger: Ledger) -> None:
    """Two callers at once: the second waits for the first's outcome and replays it."""
    started = threading.Event()
    release = threading.Event()
    calls: list[int] = []

    @real_ledger.tool(name="slow", wait=10)
    def slow() -> int:
        calls.append(1)
        started.set()
        release.wait(5)
        return 99

    results: list[Any] = []
    first = threading.Thread(target=lambda: results.append(slow.outcome()))
    first.start()
    started.wait(5)
    second = threading.Thread(target=lambda: results.append(slow.outcome()))
    second.start()
    time.sleep(0.2)
    release.set()
    first.join()
    second.join()
    assert calls == [1]
    assert sorted(o.replayed for o in results) == [False, True]
    assert {o.result for o in results} == {99}


def test_waiting_too_long_is_in_progress(real_ledger: Ledger) -> None:
    """A waiter gives up after wait= seconds with InProgress; the operation is not run twice."""
    release = threading.Event()
    started = threading.Event()

    @real_ledger.tool(name="slow", wait=0.2)
    def slow() -> int:
        started.set()
        release.wait(5)
        return 1

    t = threading.Thread(target=slow)
    t.start()
    started.wait(5)
    with pytest.raises(InProgress, match="another caller"):
        slow()
    release.set()
    t.join()
    assert slow() == 1


def test_heartbeats_keep_a_slow_tool_s_lease(real_ledger: Ledger) -> None:
    """A tool that runs past its lease keeps it by heartbeats: a waiter does not take over."""
    calls: list[int] = []
    started = threading.Event()

    @real_ledger.tool(name="slow", lease=0.3, wait=5, on_unknown="retry")
    def slow() -> int:
        calls.append(1)
        started.set()
        time.sleep(1.2)
        return 5

    t = threading.Thread(target=slow)
    t.start()
    started.wait(5)
    assert slow() == 5
    t.join()
    assert calls == [1]
    rec = real_ledger.get(slow.key_for())
    assert rec is not None and rec.version > 2  # heartbeats were written


def test_timeout_late_result_confirms(real_ledger: Ledger) -> None:
    """Past timeout= the caller stops waiting (unknown), but the call runs on and its result lands."""
    done = threading.Event()

    @real_ledger.tool(name="slow", timeout=0.1)
    def slow() -> str:
        time.sleep(0.4)
        done.set()
        return "late"

    with pytest.raises(OutcomeUnknown):
        slow()
    assert done.wait(5)
    rec = _wait_for(real_ledger, slow.key_for(), lambda r: r.state is State.CONFIRMED)
    assert rec.result == "late"
    assert slow.outcome().result == "late"


def test_bad_decorator_arguments(ledger: Ledger) -> None:
    """Misconfigurations are refused when the tool is defined, with what to change."""
    with pytest.raises(ValueError, match="needs probe"):
        ledger.tool(on_unknown="probe")(lambda: 1)
    with pytest.raises(ValueError, match="on_unknown"):
        ledger.tool(on_unknown="guess")(lambda: 1)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="not parameters"):
        ledger.tool(key=("nope",))(lambda a: a)
    with pytest.raises(TypeError, match="tuple of field names"):
        ledger.tool(key="a")(lambda a: a)  # type: ignore[call-overload]


def test_late_result_after_a_resend_is_counted_as_a_conflict(real_ledger: Ledger) -> None:
    """A timed-out attempt is re-sent and confirmed; when the first attempt's answer lands late, the
    duplicate is detected and counted on the record, and the recorded result stays the confirmed one."""
    executions: list[int] = []

    @real_ledger.tool(name="slow_first", timeout=0.1, on_unknown="resend", retry=Retry(attempts=3, base=0.01))
    def slow_first() -> int:
        executions.append(1)
        if len(executions) == 1:
            time.sleep(0.4)
        return len(executions)

    assert slow_first() == 2
    rec = _wait_for(real_ledger, slow_first.key_for(), lambda r: r.conflicts == 1)  # the late answer
    assert rec is not None and rec.state is State.CONFIRMED
    assert len(executions) == 2 and rec.conflicts == 1 and rec.result == 2 and rec.fence == 2


def test_late_failure_of_the_unknown_attempt_settles_it_failed(real_ledger: Ledger) -> None:
    """A timed-out attempt whose definite failure arrives while its record is still that attempt's
    unknown settles it as failed (nothing happened): the next attempt runs without asking the probe."""
    executions: list[int] = []
    probed: list[str] = []

    def probe(args: dict[str, Any], key: str) -> Any:
        probed.append(key)
        return onceonly.NOT_FOUND

    @real_ledger.tool(
        name="refused_late",
        timeout=0.1,
        on_unknown="probe",
        probe=probe,
        settle=1.5,
        retry=Retry(attempts=2, base=0.01),
    )
    def refused_late() -> str:
        executions.append(1)
        if len(executions) == 1:
            time.sleep(0.4)
            raise ValueError("refused")  # a definite failure, after the caller stopped waiting
        return "ok"

    assert refused_late() == "ok"
    rec = real_ledger.get(refused_late.key_for())
    assert rec is not None and rec.state is State.CONFIRMED and rec.fence == 2
    assert len(executions) == 2 and probed == []
    steps = [(h["from"], h["to"]) for h in rec.history]
    assert ("unknown", "failed") in steps, steps


def test_late_failure_of_a_superseded_attempt_changes_nothing(real_ledger: Ledger) -> None:
    """Once a resend took the record over (fence 2) and confirmed it, the first attempt's late failure
    says nothing about it: the record stays confirmed with its result, and nothing runs again."""
    executions: list[int] = []

    @real_ledger.tool(name="slow_refusal", timeout=0.1, on_unknown="resend", retry=Retry(attempts=3, base=0.01))
    def slow_refusal() -> int:
        executions.append(1)
        if len(executions) == 1:
            time.sleep(0.4)
            raise ValueError("refused")
        return len(executions)

    assert slow_refusal() == 2
    _join_workers("slow_refusal")  # the first attempt's failure has arrived and been handled
    rec = _wait_for(real_ledger, slow_refusal.key_for(), lambda r: r.state is State.CONFIRMED)
    assert rec.result == 2 and rec.fence == 2 and rec.conflicts == 0
    assert [h["to"] for h in rec.history][-1] == "confirmed"
    assert len(executions) == 2


@pytest.mark.parametrize("unknown_fence", [1, 2], ids=["same-attempt", "newer-attempt"])
def test_late_failure_settles_only_the_unknown_of_its_own_attempt(ledger: Ledger, unknown_fence: int) -> None:
    """The rule itself, on every store: attempt 1's late definite failure fails the record while it is
    attempt 1's unknown, and leaves the unknown of a newer attempt (fence 2) alone, since that attempt
    may have happened."""

    @ledger.tool(name="t")
    def t() -> int:
        return 1

    call = t.spec.call((), {}, None, 1)
    rec = st.new_record(
        key=call.key, scope=call.scope, tool=call.tool, fingerprint=call.fingerprint, args_json=call.args_json,
        state=State.IN_FLIGHT, owner="h:1:1", now=ledger.clock(), lease_seconds=30,
    )  # fmt: skip
    if unknown_fence == 2:
        rec = st.claim_again(
            rec, state=State.IN_FLIGHT, owner="h:1:2", now=ledger.clock(), lease_seconds=30, reason="x"
        )
    unknown = st.mark_unknown(rec, now=ledger.clock(), reason="timed out", by="h:1:1")
    assert ledger.store.insert(unknown)
    drive(ledger.runtime, late_outcome(call, 1, None, ValueError("refused")), t.spec, call, (), {})
    after = ledger.get(call.key)
    assert after is not None
    if unknown_fence == 1:
        assert after.state is State.FAILED and after.fence == 1 and "refused" in (after.error or "")
    else:
        assert after == unknown


def test_mark_sent_after_losing_the_lease_refuses_to_send(ledger: Ledger) -> None:
    """If another caller took the record over before dispatch, mark_sent() raises: do not send."""
    sent: list[int] = []

    @ledger.tool(name="send", reports_dispatch=True)
    def send() -> str:
        info = onceonly.current_call()
        assert info is not None
        rec = ledger.get(info.key)
        assert rec is not None
        ledger.store.swap(st.mark_unknown(rec, now=rec.updated_at, reason="taken over", by="other"), rec)
        onceonly.mark_sent()
        sent.append(1)
        return "sent"

    with pytest.raises(InProgress, match="do not send"):
        send()
    assert sent == []


def test_two_ledgers_in_one_process_never_take_each_others_claim_for_their_own(
    store_url: str, clock: FakeClock
) -> None:
    """Two ledgers in one process, on one store and one clock reading. B's claim fails in the store
    (nothing written), so B re-reads the record to learn whether its claim landed: it finds A's claim,
    made at the same instant. Owners are unique per process, not per ledger, so A's record is not
    byte for byte B's and B does not take it for its own: the tool runs once, B is told A holds it."""
    a = Ledger.open(store_url, clock=clock, sleep=clock.sleep)
    b = Ledger.open(store_url, clock=clock, sleep=clock.sleep)
    runs: list[str] = []

    def fail_claim(record: Any) -> None:
        raise StoreUnavailable("the claim's connection failed before anything was written")

    b.store.claim = fail_claim  # type: ignore[method-assign]

    @b.tool(name="pay", wait=0)
    def pay_b(n: int) -> str:
        runs.append("b")
        return "b"

    @a.tool(name="pay")
    def pay_a(n: int) -> str:
        runs.append("a")
        with pytest.raises(InProgress):
            # While A holds the claim, from a context of its own: another caller's, not a call inside A's.
            contextvars.Context().run(pay_b, n)
        return "a"

    try:
        assert pay_a(1) == "a"
    finally:
        a.close()
        b.close()
    assert runs == ["a"]


def test_an_error_or_result_with_no_utf8_form_is_recorded_not_lost(ledger: Ledger) -> None:
    """A tool's exception message and its result may hold a lone surrogate (bytes decoded with
    surrogateescape). Neither may cost the record: the caller gets its own exception and the failure is
    recorded (escaped); a result is returned and kept as a described value. Each ran once."""
    runs: list[str] = []
    text = b"caf\xe9".decode("utf-8", "surrogateescape")

    @ledger.tool(name="refuses", retry=Retry(attempts=1))
    def refuses() -> None:
        runs.append("refuses")
        raise ValueError(text)

    @ledger.tool(name="answers")
    def answers() -> str:
        runs.append("answers")
        return text

    with pytest.raises(ValueError, match="caf"):
        refuses()
    failed = ledger.get(refuses.key_for())
    assert failed is not None and failed.state is State.FAILED
    assert failed.error == "ValueError: caf\\udce9"
    assert answers() == text
    done = ledger.get(answers.key_for())
    assert done is not None and done.state is State.CONFIRMED
    assert done.result == {"$unserializable": "str", "repr": repr(text)}
    assert runs == ["refuses", "answers"]


def test_a_heartbeat_whose_answer_is_lost_keeps_the_lease(store_url: str) -> None:
    """The first heartbeat lands but its answer is lost. The ledger re-reads, finds its own write and
    keeps beating on it; it does not take the next beat's failed compare-and-set for a lost lease and
    stop. So the lease never runs out under the running tool, and a second caller, arriving after the
    lease would have run out without beats, waits and replays: the tool runs once."""
    flaky = FlakyStore(open_store(store_url), Fault("swap", frm=State.IN_FLIGHT, to=State.IN_FLIGHT, lands=True))
    holder = Ledger(flaky)
    other = Ledger.open(store_url)
    runs: list[str] = []

    def slow(n: int) -> str:
        runs.append("run")
        time.sleep(1.6)  # beats every 0.2 s; without them the 0.6 s lease runs out at ~0.8 s
        return "done"

    first = holder.tool(name="slow", lease=0.6)(slow)
    second = other.tool(name="slow", lease=0.6, on_unknown="retry", wait=5)(slow)
    later: list[str] = []
    waiter = threading.Timer(1.1, lambda: later.append(second(1)))
    waiter.start()
    try:
        assert first(1) == "done"
        waiter.join()
    finally:
        holder.close()
        other.close()
    assert flaky.raised == ["swap"], "the fault never hit a heartbeat: the test proved nothing"
    assert later == ["done"] and runs == ["run"]


@pytest.mark.parametrize("lands", [True, False])
def test_mark_sent_whose_answer_is_lost_sends_once(store_url: str, lands: bool) -> None:
    """``mark_sent()``'s write fails in the store. If it landed (its answer lost), the ledger re-reads,
    finds it, and the tool sends; if not, the record is still pending, mark_sent says so and the tool
    does not send, so the attempt is retried as one that never left. Either way: sent once, confirmed."""
    flaky = FlakyStore(open_store(store_url), Fault("swap", frm=State.PENDING, to=State.IN_FLIGHT, lands=lands))
    ledger = Ledger(flaky)
    sent: list[int] = []

    @ledger.tool(name="send", reports_dispatch=True, retry=Retry(attempts=3, base=0.001))
    def send(n: int) -> str:
        onceonly.mark_sent()
        sent.append(n)
        return "ok"

    try:
        assert send(1) == "ok"
        rec = ledger.get(send.key_for(1))
    finally:
        ledger.close()
    assert flaky.raised == ["swap"], "the fault never hit mark_sent: the test proved nothing"
    assert sent == [1]
    assert rec is not None and rec.state is State.CONFIRMED


@pytest.mark.parametrize("lands", [True, False])
@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_late_success_meeting_a_store_error_is_still_recorded(store_url: str, face: str, lands: bool) -> None:
    """The caller stops waiting (timeout), the record is parked for review; then the tool's success
    arrives, and the write recording it fails in the store (lands: it was written, its answer lost).
    The late outcome reads again and the success is recorded, not dropped: confirmed with its result,
    no conflict counted for our own write, and the tool ran once."""
    flaky = FlakyStore(open_store(store_url), Fault("swap", to=State.CONFIRMED, lands=lands))
    ledger = Ledger(flaky, sleep=lambda s: None)
    runs: list[int] = []

    def work(n: int) -> dict[str, int]:
        runs.append(n)
        time.sleep(0.3)
        return {"n": n}

    async def awork(n: int) -> dict[str, int]:
        runs.append(n)
        await asyncio.sleep(0.3)
        return {"n": n}

    tool = ledger.tool(name=f"late_{face}", timeout=0.05)(work if face == "sync" else awork)

    async def main() -> None:
        with pytest.raises(onceonly.OutcomeUnknown):
            await tool(1)
        await asyncio.sleep(0.5)  # the loop must outlive the late task

    try:
        if face == "sync":
            with pytest.raises(onceonly.OutcomeUnknown):
                tool(1)
        else:
            asyncio.run(main())
        rec = _wait_for(ledger, tool.key_for(1), lambda r: r.state is State.CONFIRMED)
    finally:
        ledger.close()
    assert flaky.raised == ["swap"], "the fault never hit the late write: the test proved nothing"
    assert rec.result == {"n": 1} and rec.conflicts == 0 and runs == [1]


def test_a_sync_tools_probe_that_returns_an_awaitable_is_an_error_not_an_answer(ledger: Ledger) -> None:
    """A sync tool's probe written as a lambda around an async function returns a coroutine, which a
    sync call cannot await. It is a probe error (the outcome stays unsettled), never an answer: the
    coroutine is not recorded as the result, nor taken as "found"."""

    async def afind(args: dict[str, Any]) -> Any:
        return onceonly.NOT_FOUND

    @ledger.tool(name="lost", on_unknown="probe", probe=lambda args, key: afind(args), retry=Retry(attempts=2))
    def lost(n: int) -> int:
        raise ConnectionResetError("the answer was lost")

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a coroutine never awaited would warn
        with pytest.raises(onceonly.OnceOnlyError, match="returned an awaitable"):
            lost(1)
    rec = ledger.get(lost.key_for(1))
    assert rec is not None and rec.state is not State.CONFIRMED and rec.result is None


def test_a_lease_held_while_the_heartbeat_looks_is_beaten_in_time(sqlite_url: str) -> None:
    """The heartbeat thread wakes on its own tick (a 6 s lease: every second) and, while it looks, a
    tool with a 0.9 s lease starts. That lease must wake it (it is due long before the next tick), or
    it runs out under the live tool and a second caller runs the tool again."""
    stall, looking = threading.Event(), threading.Event()

    def clock() -> float:
        if stall.is_set() and threading.current_thread().name == "onceonly-heartbeat":
            stall.clear()
            looking.set()
            time.sleep(0.3)  # the thread is between its snapshot and setting its next wake
        return time.time()

    ledger = Ledger.open(sqlite_url, clock=clock)
    other = Ledger.open(sqlite_url)
    runs: list[str] = []

    @ledger.tool(name="long", lease=6.0)
    def long_one(n: int) -> None:
        time.sleep(3.0)

    def short(n: int) -> str:
        runs.append("short")
        time.sleep(1.6)
        return "done"

    short_here = ledger.tool(name="short", lease=0.9)(short)
    short_there = other.tool(name="short", lease=0.9, on_unknown="retry", wait=0)(short)
    background = [threading.Thread(target=long_one, args=(1,))]
    try:
        background[0].start()
        time.sleep(0.5)
        stall.set()  # the thread's next look, on its own tick at ~1 s, stalls
        assert looking.wait(5)
        background.append(threading.Thread(target=short_here, args=(1,)))
        background[1].start()
        time.sleep(1.2)  # past the 0.9 s lease if no beat came
        with pytest.raises(InProgress):
            short_there(1)
    finally:
        for thread in background:
            thread.join()
        ledger.close()
        other.close()
    assert runs == ["short"]


@pytest.mark.parametrize("limit", [0, -1, 2**63, True, 2.5])
def test_list_takes_a_page_size_it_can_send(ledger: Ledger, limit: object) -> None:
    """A page size the store cannot take ended as OverflowError (SQLite) or StoreCorrupt (PostgreSQL)."""
    with pytest.raises(ValueError, match="give an int from 1"):
        ledger.list(limit=limit)  # type: ignore[arg-type]


def test_a_purge_during_a_backoff_does_not_reset_the_attempt_limit(store_url: str) -> None:
    """A failure scheduled for a retry later than its ttl: a purge that runs while the caller sleeps
    out the backoff must leave the record, so the attempts go on counting and stop at the limit.
    Purged, the record came back at attempt 1 on every retry and the limit was never reached."""
    clock = FakeClock()
    purged: list[int] = []

    def sleep_then_purge(seconds: float) -> None:
        clock.sleep(seconds)
        purged.append(ledger.purge())  # an operator's purge, while the call waits

    ledger = Ledger.open(store_url, clock=clock, sleep=sleep_then_purge)
    runs: list[int] = []

    @ledger.tool(name="call_api", ttl=0.001, retry=Retry(attempts=3, base=10, cap=10))
    def call_api(n: int) -> None:
        runs.append(n)
        if len(runs) > 6:  # the old behaviour never stopped by itself
            raise ValueError("too many runs")
        raise ConnectionRefusedError("not sent")

    try:
        with pytest.raises(onceonly.AttemptsExhausted):
            call_api(1)
        assert len(runs) == 3 and purged and set(purged) == {0}
        rec = ledger.get(call_api.key_for(1))
        assert rec is not None and rec.state is State.ABANDONED and rec.attempts == 3
    finally:
        ledger.close()


def test_scope_and_tool_names_with_colons_never_share_a_record(ledger: Ledger) -> None:
    """Scope ``a`` with tool ``b:c`` and scope ``a:b`` with tool ``c`` made the same key, so the second
    operation replayed the first's result and never ran. Scopes come from framework conversation ids
    (LangGraph thread ids hold ``:``): both are accepted, and each gets its own record."""
    runs: list[str] = []

    @ledger.tool(name="b:c")
    def first(x: int) -> str:
        runs.append("b:c")
        return "first"

    @ledger.tool(name="c")
    def second(x: int) -> str:
        runs.append("c")
        return "second"

    # An explicit key keeps the digest the same for both, whatever their argument hashes.
    with ledger.task("a"):
        out1 = first.using(key="same").outcome(1)
    with ledger.task("a:b"):
        out2 = second.using(key="same").outcome(1)
    assert (out1.result, out2.result) == ("first", "second")
    assert out1.key != out2.key and not out2.replayed
    assert runs == ["b:c", "c"]
    rec = ledger.get(out2.key)
    assert rec is not None and (rec.scope, rec.tool) == ("a:b", "c")


class _StalledClaim:
    """A store whose next claim lands, then stalls past the lease while ``meanwhile`` runs: the
    claimant's answer comes back after another caller may have taken the expired lease over."""

    def __init__(self, inner: Any, clock: FakeClock, stall: float, meanwhile: Any) -> None:
        self.inner, self.clock, self.stall, self.meanwhile = inner, clock, stall, meanwhile
        self.armed = True

    def claim(self, record: Any) -> Any:
        answer = self.inner.claim(record)
        if self.armed:
            self.armed = False
            self.clock.now += self.stall
            self.meanwhile()
        return answer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_claim_that_lands_after_its_lease_ran_out_does_not_run(store_url: str, clock: FakeClock) -> None:
    """A claim answered after its lease expired, while another caller took the record over and ran the
    tool, must not run the tool a second time: the claimant renews its lease first, and finds it lost."""
    effects: list[str] = []
    other = Ledger.open(store_url, clock=clock, sleep=clock.sleep)
    try:

        def run_elsewhere() -> None:
            @other.tool(name="charge", on_unknown="probe", probe=lambda a, k: onceonly.NOT_FOUND, lease=10)
            def charge(order: str) -> str:
                effects.append("other")
                return "charged by other"

            assert charge("o-1") == "charged by other"

        stalled = Ledger(_StalledClaim(open_store(store_url), clock, 11, run_elsewhere), clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]
        try:

            @stalled.tool(name="charge", on_unknown="probe", probe=lambda a, k: onceonly.NOT_FOUND, lease=10)
            def charge(order: str) -> str:
                effects.append("stalled")
                return "charged by stalled"

            assert charge("o-1") == "charged by other"
        finally:
            stalled.close()
        assert effects == ["other"]
    finally:
        other.close()


class _SlowConfirm:
    """The real store, passed through; a write that confirms a record waits until ``release`` is set."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.url = inner.url
        self.entered = threading.Event()
        self.release = threading.Event()

    def swap(self, record: Any, expected: Any) -> bool:
        if record.state is State.CONFIRMED:
            self.entered.set()
            self.release.wait(10)
        return bool(self.inner.swap(record, expected))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_closing_the_ledger_waits_for_a_late_outcome_being_written(store_url: str) -> None:
    """The caller stopped waiting (timeout) and closes the ledger while the tool's late success is being
    written from its worker thread: close() lets that write finish, so the success is recorded (a store
    closed under it would lose it, and SQLite could crash the process)."""
    slow = _SlowConfirm(open_store(store_url))
    ledger = Ledger(slow)
    runs: list[int] = []

    @ledger.tool(name="late_close", timeout=0.05)
    def work(n: int) -> dict[str, int]:
        time.sleep(0.2)
        runs.append(n)
        return {"n": n}

    key = work.key_for(1)
    with pytest.raises(onceonly.OutcomeUnknown):
        work(1)
    assert slow.entered.wait(10), "the late success never reached the store"
    threading.Timer(0.3, slow.release.set).start()
    ledger.close()
    with Ledger(open_store(store_url)) as again:
        rec = again.get(key)
    assert rec is not None and rec.state is State.CONFIRMED and rec.result == {"n": 1}
    assert runs == [1]
