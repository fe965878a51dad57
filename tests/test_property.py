"""Property: any interleaving of claims, outcomes, timeouts, lease expiries and retries for one key runs
the side effect at most once while the record is unsettled, and every caller gets the recorded result.

The guard is a generator of actions, so a test can be its scheduler: several callers' plans advance
one action at a time in an order hypothesis picks, against a real SQLite store, on a fake clock.
Hypothesis also picks what each attempt does (succeeds, loses its answer, is refused, fails, times
out with the work done or still landing, or its process dies) and when time jumps. The world
answers probes truthfully. Heartbeats run for attempts in progress, as the ledger's thread does.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st_

from onceonly import NOT_FOUND, OnceOnlyError, Retry, State
from onceonly import states as st
from onceonly.plan import (
    Call,
    Claim,
    Execute,
    Executed,
    Get,
    Insert,
    Outcome,
    Probe,
    Probed,
    Running,
    Sleep,
    Swap,
    WaitChange,
    late_outcome,
    plan,
)
from onceonly.policy import Policy
from onceonly.stores.sqlite import SQLiteStore

LEASE = 10.0
SETTLE = 5.0
OUTCOMES = ["ok", "lost", "refused", "fails", "timeout_done", "timeout_landing", "dies_done", "dies_undone"]


@pytest.fixture(scope="module", name="store")
def fixture_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SQLiteStore]:
    """One real SQLite ledger; every example uses its own key."""
    store = SQLiteStore(f"sqlite:///{tmp_path_factory.mktemp('prop') / 'ledger.db'}")
    yield store
    store.close()


@dataclass
class Actor:
    name: str
    gen: Any
    call: Call
    pending: Any = None
    wake_at: float = 0.0
    done: bool = False
    outcome: Outcome | None = None
    error: BaseException | None = None
    held: st.Record | None = None  # the record it holds while its attempt runs (heartbeats update it)


@dataclass
class World:
    store: SQLiteStore
    key: str
    clock: float = 1_800_000_000.0
    effects: list[dict[str, Any]] = field(default_factory=list)
    actors: list[Actor] = field(default_factory=list)
    landings: list[tuple[float, Actor, int]] = field(default_factory=list)  # (when, late actor, fence)

    def now(self) -> float:
        return self.clock


def _call(world: World, owner: str, on_unknown: str) -> Call:
    policy = Policy(
        retry=Retry(attempts=3, base=1.0, cap=4.0), on_unknown=on_unknown,  # type: ignore[arg-type]
        has_probe=True, settle=SETTLE, ttl=None, lease=LEASE, wait=60.0,
    )  # fmt: skip
    return Call(
        key=world.key, scope="p", tool="t", fingerprint="f" * 64, args_json="{}", owner=owner,
        policy=policy, clock=world.now, rng=random.Random(owner),
    )  # fmt: skip


def _advance(actor: Actor, send: Any = None, error: BaseException | None = None) -> None:
    try:
        actor.pending = actor.gen.throw(error) if error is not None else actor.gen.send(send)
    except StopIteration as stop:
        actor.done, actor.outcome = True, stop.value
    except OnceOnlyError as exc:
        actor.done, actor.error = True, exc
    except (ConnectionError, TimeoutError, ValueError) as exc:  # the tool's own error, re-raised
        actor.done, actor.error = True, exc


def _perform(world: World, actor: Actor, data: st_.DataObject) -> None:
    """Run the actor's pending action; an Execute asks hypothesis what the attempt does."""
    action = actor.pending
    store = world.store
    if isinstance(action, Claim):
        _advance(actor, store.claim(action.record))
    elif isinstance(action, Get):
        _advance(actor, store.get(action.key))
    elif isinstance(action, Insert):
        _advance(actor, store.insert(action.record))
    elif isinstance(action, Swap):
        _advance(actor, store.swap(action.record, action.expected))
    elif isinstance(action, Running):
        _advance(actor, False)  # no actor here runs inside another's call
    elif isinstance(action, Sleep | WaitChange):
        actor.wake_at = world.clock + max(action.seconds, 1e-3)
        _advance(actor)
    elif isinstance(action, Probe):
        if data.draw(st_.integers(0, 9), label="probe fails") == 0:
            _advance(actor, Probed(error=ConnectionRefusedError("search down")))
        else:
            found = world.effects[0] if world.effects else NOT_FOUND
            _advance(actor, Probed(value=found))
    elif isinstance(action, Execute):
        fence = action.record.fence
        latest = actor.held or action.record
        actor.held = None
        what = data.draw(st_.sampled_from(OUTCOMES), label=f"{actor.name} attempt {fence}")
        result = {"fence": fence}
        if what in ("ok", "lost", "timeout_done", "dies_done"):
            world.effects.append(result)
        if what == "ok":
            _advance(actor, Executed(value=result, record=latest))
        elif what == "lost":
            _advance(actor, Executed(error=ConnectionResetError("answer lost"), record=latest))
        elif what == "refused":
            _advance(actor, Executed(error=ConnectionRefusedError("refused"), record=latest))
        elif what == "fails":
            _advance(actor, Executed(error=ValueError("rejected"), record=latest))
        elif what in ("timeout_done", "timeout_landing"):
            # The call runs on past the caller's timeout; its answer (and, for "landing", its work)
            # arrives within the settle window: the contract of settle=.
            delay = data.draw(st_.floats(0.0, SETTLE * 0.9), label="landing after")
            late = Actor(f"{actor.name}-late", late_outcome(actor.call, fence, result), actor.call)
            world.landings.append((world.clock + delay, late, fence if what == "timeout_landing" else -1))
            _advance(actor, Executed(timed_out=True, record=latest))
        else:  # the process dies mid-attempt: no outcome ever, the lease just runs out
            actor.done = True
    else:  # pragma: no cover
        raise TypeError(f"not an action: {action!r}")


def _heartbeat(world: World) -> None:
    """Attempts in progress keep their lease, as the ledger's heartbeat thread does."""
    for actor in world.actors:
        if actor.done or not isinstance(actor.pending, Execute):
            continue
        held = actor.held or actor.pending.record
        new = st.extend_lease(held, now=world.clock, lease_seconds=LEASE)
        if world.store.swap(new, held):
            actor.held = new


def _check(world: World) -> None:
    assert len(world.effects) <= 1, f"the side effect ran {len(world.effects)} times: {world.effects}"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st_.data(), on_unknown=st_.sampled_from(["probe", "review"]), callers=st_.integers(1, 4))
def test_at_most_once_and_one_result(store: SQLiteStore, data: st_.DataObject, on_unknown: str, callers: int) -> None:
    """At most one side effect, ever; every caller that got a result got the recorded one."""
    world = World(store=store, key=f"p:t:{uuid.uuid4().hex}")
    started = 0
    for _ in range(400):
        # Late answers whose time has come start landing.
        for when, late, fence in list(world.landings):
            if when <= world.clock:
                world.landings.remove((when, late, fence))
                if fence >= 0:
                    world.effects.append({"fence": fence})
                world.actors.append(late)
                _advance(late)
        _check(world)
        live = [a for a in world.actors if not a.done]
        runnable = [a for a in live if a.wake_at <= world.clock]
        moves = ["advance"] if live or world.landings else []
        moves += ["step"] * 3 if runnable else []
        moves += ["start"] if started < callers else []
        if not moves:
            break
        move = data.draw(st_.sampled_from(moves), label="move")
        if move == "start":
            started += 1
            actor = Actor(f"c{started}", None, _call(world, f"c{started}", on_unknown))
            actor.gen = plan(actor.call)
            world.actors.append(actor)
            _advance(actor)
        elif move == "step":
            actor = data.draw(st_.sampled_from(runnable), label="who")
            _perform(world, actor, data)
        else:
            waits = [a.wake_at for a in live if a.wake_at > world.clock] + [w for w, _, _ in world.landings]
            jump = data.draw(st_.floats(0.0, 2.5 * LEASE), label="time passes")
            world.clock += max(jump, min(waits) - world.clock if waits and not runnable else 0.0)
            _heartbeat(world)
    _check(world)

    rec = store.get(world.key)
    answers = [a.outcome for a in world.actors if a.outcome is not None and a.outcome.key == world.key]
    for out in answers:
        assert rec is not None and rec.state is State.CONFIRMED
        assert out.result == rec.result, "a caller got something other than the recorded result"
    if rec is not None and rec.state is State.CONFIRMED:
        assert world.effects and rec.result == world.effects[0], "confirmed, but not with what happened"
    if rec is not None and rec.state in (State.FAILED, State.ABANDONED):
        assert not world.effects, f"recorded {rec.state.value}, yet the side effect happened"


def test_scheduler_sees_real_duplicates(store: SQLiteStore) -> None:
    """The harness can fail: with on_unknown='retry' (at-least-once) a lost answer runs twice."""
    world = World(store=store, key=f"p:t:{uuid.uuid4().hex}")
    actor = Actor("c1", None, _call(world, "c1", "retry"))
    actor.gen = plan(actor.call)
    _advance(actor)
    answers = iter(["lost", "ok"])

    class Scripted:
        def draw(self, strategy: Any, label: str = "") -> Any:
            return next(answers) if label.startswith("c1 attempt") else 1

    while not actor.done:
        world.clock = max(world.clock, actor.wake_at)
        _perform(world, actor, Scripted())  # type: ignore[arg-type]
    assert len(world.effects) == 2
