"""Running guarded calls: the two driver loops, running a tool, and asking its probe.

The decisions are in ``onceonly.plan``; this module does their I/O, over one ledger's ``Runtime``
(``runtime.py``: the store, clocks, listeners, leases). ``drive`` (sync) and ``adrive`` (async) are the
only two loops, and they differ only in what they await. The guarded functions (``tools.py``) and the
reconciler (``settle.py``) both drive plans through them.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import threading
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, TypeVar

from onceonly.errors import KeyConflict, StoreError
from onceonly.events import alerting, key_conflict
from onceonly.plan import (
    Action,
    Call,
    Claim,
    Execute,
    Executed,
    Get,
    Insert,
    Probe,
    Probed,
    Running,
    SimilarClaim,
    SimilarLock,
    SimilarUnlock,
    Sleep,
    Swap,
    WaitChange,
    landed,
    late_outcome,
)
from onceonly.runtime import CURRENT, Runtime
from onceonly.states import Record, State

if TYPE_CHECKING:
    from onceonly.tools import ToolSpec

__all__ = ["adrive", "aprobe", "drive", "probe"]

T = TypeVar("T")

_log = logging.getLogger("onceonly")

# --- the drivers: the only I/O loops --------------------------------------------------------------


def drive(
    runtime: Runtime,
    gen: Generator[Action, Any, T],
    spec: ToolSpec | None,
    call: Call,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> T:
    """Run a plan (``plan.plan``, ``plan.late_outcome``…) to its end, doing each action it yields."""
    send: Any = None
    error: BaseException | None = None
    lost: Record | None = None  # a write whose answer the store lost
    store = runtime.store
    while True:
        try:
            action = gen.throw(error) if error is not None else gen.send(send)
        except StopIteration as stop:
            done: T = stop.value
            return done
        except KeyConflict as exc:
            _alert_conflict(exc)
            raise
        error = None
        kind = type(action)
        try:
            if kind is Claim:
                send = store.claim(action.record)  # type: ignore[union-attr]
                if send is None and runtime.observed():
                    runtime.announce(action.record)  # type: ignore[union-attr]
            elif kind is Get:
                send = store.get(action.key)  # type: ignore[union-attr]
                if lost is not None:
                    _emit_if_landed(runtime, lost, send)
                    lost = None
            elif kind is Swap or kind is Insert:
                rec = action.record  # type: ignore[union-attr]
                ok = store.swap(rec, action.expected) if kind is Swap else store.insert(rec)  # type: ignore[union-attr]
                # Inlined alerting(rec): two attribute checks, on every write.
                if ok and (runtime.observed() or rec.conflicts or rec.state is _REVIEW):
                    runtime.announce(rec)
                send = ok
            elif kind is Execute:
                assert spec is not None
                send = _execute(runtime, spec, call, action.record, args, kwargs)  # type: ignore[union-attr]
            elif kind is Probe:
                assert spec is not None
                send = probe(spec, action.record)  # type: ignore[union-attr]
            elif kind is Sleep:
                runtime.sleep(action.seconds)  # type: ignore[union-attr]
                send = None
            elif kind is WaitChange:
                store.wait_for_change(action.key, action.version, action.seconds)  # type: ignore[union-attr]
                send = None
            elif kind is Running:
                send = _running(action.owner)  # type: ignore[union-attr]
            else:
                send = _similar(runtime, store, action)
        except StoreError as exc:
            error = exc
            if kind is Claim or kind is Insert or kind is Swap or kind is SimilarClaim:
                # The plan re-reads next (it never guesses); if this write landed, it is announced then.
                lost = action.record  # type: ignore[union-attr]


async def adrive(
    runtime: Runtime,
    gen: Generator[Action, Any, T],
    spec: ToolSpec | None,
    call: Call,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> T:
    """``drive`` for async tools: the same loop, awaiting the store's async methods."""
    send: Any = None
    error: BaseException | None = None
    lost: Record | None = None  # a write whose answer the store lost
    store: Any = runtime.store
    while True:
        try:
            action = gen.throw(error) if error is not None else gen.send(send)
        except StopIteration as stop:
            done: T = stop.value
            return done
        except KeyConflict as exc:
            _alert_conflict(exc)
            raise
        error = None
        kind = type(action)
        try:
            if kind is Claim:
                send = await store.aclaim(action.record)  # type: ignore[union-attr]
                if send is None and runtime.observed():
                    runtime.announce(action.record)  # type: ignore[union-attr]
            elif kind is Get:
                send = await store.aget(action.key)  # type: ignore[union-attr]
                if lost is not None:
                    _emit_if_landed(runtime, lost, send)
                    lost = None
            elif kind is Swap or kind is Insert:
                rec = action.record  # type: ignore[union-attr]
                ok = await (store.aswap(rec, action.expected) if kind is Swap else store.ainsert(rec))  # type: ignore[union-attr]
                # Inlined alerting(rec): two attribute checks, on every write.
                if ok and (runtime.observed() or rec.conflicts or rec.state is _REVIEW):
                    runtime.announce(rec)
                send = ok
            elif kind is Execute:
                assert spec is not None
                send = await _aexecute(runtime, spec, call, action.record, args, kwargs)  # type: ignore[union-attr]
            elif kind is Probe:
                assert spec is not None
                send = await aprobe(spec, action.record)  # type: ignore[union-attr]
            elif kind is Sleep:
                await runtime.asleep(action.seconds)  # type: ignore[union-attr]
                send = None
            elif kind is WaitChange:
                await store.await_for_change(action.key, action.version, action.seconds)  # type: ignore[union-attr]
                send = None
            elif kind is Running:
                send = _running(action.owner)  # type: ignore[union-attr]
            else:
                send = await _asimilar(runtime, store, action)
        except StoreError as exc:
            error = exc
            if kind is Claim or kind is Insert or kind is Swap or kind is SimilarClaim:
                # The plan re-reads next (it never guesses); if this write landed, it is announced then.
                lost = action.record  # type: ignore[union-attr]


_REVIEW = State.NEEDS_REVIEW


def _running(owner: str | None) -> bool:
    """Whether the call holding ``owner``'s lease is one this code runs inside (``plan.Running``)."""
    lease = CURRENT.get()
    while lease is not None:
        if lease.record.lease_owner == owner:
            return True
        lease = lease.outer
    return False


def _similar(runtime: Runtime, store: Any, action: Action) -> Any:
    """The store calls of a near-duplicate lookup (``onceonly.Similar``): off the path of other tools."""
    if isinstance(action, SimilarLock):
        return store.similar_lock(action.group, action.token, action.now, action.until, action.since, action.limit)
    if isinstance(action, SimilarClaim):
        got = store.similar_claim(action.record, action.group, action.token)
        if got is None:
            runtime.announce(action.record)
        return got
    assert isinstance(action, SimilarUnlock)
    store.similar_unlock(action.group, action.token)
    return None


async def _asimilar(runtime: Runtime, store: Any, action: Action) -> Any:
    """``_similar`` for async tools."""
    if isinstance(action, SimilarLock):
        return await store.asimilar_lock(
            action.group, action.token, action.now, action.until, action.since, action.limit
        )
    if isinstance(action, SimilarClaim):
        got = await store.asimilar_claim(action.record, action.group, action.token)
        if got is None:
            runtime.announce(action.record)
        return got
    assert isinstance(action, SimilarUnlock)
    await store.asimilar_unlock(action.group, action.token)
    return None


def _alert_conflict(exc: KeyConflict) -> None:
    rec = exc.record
    key_conflict(
        exc,
        f"{exc.key}: the key was used before with other arguments",
        source="guard",
        key=exc.key,
        tool=None if rec is None else rec.tool,
        scope=None if rec is None else rec.scope,
    )


def _emit_if_landed(runtime: Runtime, written: Record, now_stored: Record | None) -> None:
    """At the plan's re-read after a write whose answer was lost: announce the write if it landed,
    as every transition this process writes is (``subscribe``)."""
    if landed(written, now_stored) and (runtime.observed() or alerting(written)):
        runtime.announce(written)


# --- running a tool ------------------------------------------------------------------------------


def _raised(spec: ToolSpec, exc: BaseException, latest: Record) -> Executed:
    # Control flow (a LangGraph interrupt, a passthrough= type) is not an outcome: the plan gives the
    # claim back uncounted and re-raises it. An interrupt (KeyboardInterrupt, SystemExit: not an
    # Exception) is recorded at once and re-raised; anything else is the attempt's outcome.
    if spec.is_control_flow(exc):
        return Executed(error=exc, record=latest, released=True)
    return Executed(error=exc, record=latest, interrupted=not isinstance(exc, Exception))


def _execute(
    runtime: Runtime, spec: ToolSpec, call: Call, rec: Record, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Executed:
    beats = runtime.beats
    lease = beats.hold(rec, call.policy.lease, runtime)
    kw = spec.tool_kwargs(call, kwargs) if spec.takes_key else kwargs
    fn = spec.fn
    if spec.timeout is None:
        token = CURRENT.set(lease)
        try:
            value = fn(*args, **kw)
        except BaseException as exc:  # KeyboardInterrupt and SystemExit too: the plan records them at once
            return _raised(spec, exc, beats.release(lease))
        finally:
            CURRENT.reset(token)
        return Executed(value, None, False, beats.release(lease))

    # With a timeout the tool runs in a worker thread, so that the caller can stop waiting while
    # the call itself runs on: its late outcome must still reach the ledger.
    box: dict[str, Any] = {}
    guard = threading.Lock()
    finished = threading.Event()
    context = contextvars.copy_context()

    def run() -> None:
        context.run(CURRENT.set, lease)
        try:
            box["value"] = context.run(fn, *args, **kw)
        except BaseException as exc:
            box["error"] = exc
        with guard:
            box["finished"] = True
            late = box.get("timed_out", False)
        finished.set()
        if late:
            _settle_late(runtime, call, rec.fence, box.get("value"), box.get("error"))

    threading.Thread(target=run, name=f"onceonly-{spec.name}"[:60], daemon=True).start()
    try:
        finished.wait(spec.timeout)
    except BaseException as exc:  # Ctrl-C while waiting: the tool runs on, and its outcome is recorded late
        with guard:
            ended = box.get("finished", False)
            box["timed_out"] = True
        latest = beats.release(lease)
        if ended:  # it finished just before: nobody else records what it returned
            _settle_late(runtime, call, rec.fence, box.get("value"), box.get("error"))
        return Executed(error=exc, record=latest, interrupted=True)
    with guard:
        timed_out = not box.get("finished", False)
        box["timed_out"] = timed_out
    latest = beats.release(lease)
    if timed_out:
        return Executed(timed_out=True, record=latest)
    err = box.get("error")
    if err is None:
        return Executed(value=box.get("value"), record=latest)
    return _raised(spec, err, latest)


async def _aexecute(
    runtime: Runtime, spec: ToolSpec, call: Call, rec: Record, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Executed:
    beats = runtime.beats
    lease = beats.hold(rec, call.policy.lease, runtime)
    token = CURRENT.set(lease)
    try:
        # The task copies the context now, with the current call set in it.
        task = asyncio.ensure_future(spec.fn(*args, **spec.tool_kwargs(call, kwargs)))
    finally:
        CURRENT.reset(token)
    try:
        done, _ = await asyncio.wait({task}, timeout=spec.timeout)
    except asyncio.CancelledError as exc:
        # Our caller was cancelled, not the tool: the plan records the attempt unknown at once, and the
        # tool runs on, its outcome settling the record late (as after a timeout).
        latest = beats.release(lease)
        _settle_late_async(runtime, task, call, rec.fence)
        return Executed(error=exc, record=latest, interrupted=True)
    latest = beats.release(lease)
    if not done:
        _settle_late_async(runtime, task, call, rec.fence)
        return Executed(timed_out=True, record=latest)
    if task.cancelled():
        return Executed(error=asyncio.CancelledError("the tool's task was cancelled"), record=latest)
    err = task.exception()
    if err is None:
        return Executed(value=task.result(), record=latest)
    return _raised(spec, err, latest)


def _log_late_failure(call: Call, fence: int, exc: BaseException | None = None) -> None:
    # The caller is gone; the record stays unknown for the probe, the reconciler or a person.
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else True
    _log.error("onceonly %s: could not record the late outcome of attempt %d", call.key, fence, exc_info=exc_info)


def _settle_late(runtime: Runtime, call: Call, fence: int, value: Any, error: BaseException | None) -> None:
    try:
        with runtime.writing_late():
            drive(runtime, late_outcome(call, fence, value, error), None, call, (), {})
    except Exception:
        _log_late_failure(call, fence)


def _settle_late_async(runtime: Runtime, task: asyncio.Future[Any], call: Call, fence: int) -> None:
    def done(t: asyncio.Future[Any]) -> None:
        if t.cancelled():
            return  # nothing known: the record stays unknown for the probe or a person
        err = t.exception()
        late = asyncio.ensure_future(
            adrive(runtime, late_outcome(call, fence, None if err else t.result(), err), None, call, (), {})
        )
        runtime.late_tasks.add(late)
        late.add_done_callback(_late_done(runtime, call, fence))

    task.add_done_callback(done)


def _late_done(runtime: Runtime, call: Call, fence: int) -> Callable[[asyncio.Future[Any]], None]:
    """When an async late outcome is recorded: forget its task; a failure is logged as the sync one's."""

    def done(late: asyncio.Future[Any]) -> None:
        runtime.late_tasks.discard(late)
        if not late.cancelled() and late.exception() is not None:
            _log_late_failure(call, fence, late.exception())

    return done


def probe(spec: ToolSpec, rec: Record) -> Probed:
    """Ask a sync tool's probe about ``rec``; its error, or an awaitable it returns, is the answer's error."""
    assert spec.probe is not None
    try:
        value = spec.probe(rec.args, rec.key)
    except Exception as exc:
        return Probed(error=exc)
    if inspect.isawaitable(value):
        # A sync call cannot await it (a lambda around an async function escapes the decorator's
        # check): taken as an answer, the awaitable itself would be recorded as the result.
        close = getattr(value, "close", None)
        if close is not None:
            close()  # no "never awaited" warning
        return Probed(
            error=TypeError(
                f"the probe of {spec.name!r} returned an awaitable, and the tool is sync: make the probe "
                "a plain function, or the tool async"
            )
        )
    return Probed(value=value)


async def aprobe(spec: ToolSpec, rec: Record) -> Probed:
    """``probe`` for async tools: an awaitable answer is awaited."""
    assert spec.probe is not None
    try:
        value = spec.probe(rec.args, rec.key)
        if inspect.isawaitable(value):
            value = await value
        return Probed(value=value)
    except Exception as exc:
        return Probed(error=exc)
