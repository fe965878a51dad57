"""Running guarded calls: leases and heartbeats, the current call, and the two driver loops.

The decisions are in ``onceonly.plan``; this module does their I/O. ``drive`` (sync) and ``adrive``
(async) are the only two loops, and they differ only in what they await. ``ledger.py`` (the facade)
and ``settle.py`` (the reconciler) both drive plans through them.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import itertools
import logging
import math
import os
import socket
import threading
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from onceonly import states as st
from onceonly.errors import InProgress, KeyConflict, OnceOnlyError, StoreError, StoreUnavailable
from onceonly.events import alerting, emit, key_conflict
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
from onceonly.policy import Verdict
from onceonly.states import HELD, Record, State
from onceonly.stores.base import Store

if TYPE_CHECKING:
    from onceonly.ledger import Ledger
    from onceonly.tools import ToolSpec

__all__ = [
    "CURRENT",
    "CallInfo",
    "Heartbeats",
    "Lease",
    "adrive",
    "amark_sent",
    "aprobe",
    "current_call",
    "drive",
    "mark_sent",
    "new_owner",
    "probe",
    "swap_now",
]

T = TypeVar("T")

_log = logging.getLogger("onceonly")

_HOST = socket.gethostname()[:40]
_owner_prefix = f"{_HOST}:{os.getpid()}"
# One counter for the process, not one per Ledger: two ledgers in one process (two stores, or one
# re-opened) must never hand out the same owner, since an owner with the same clock reading makes a
# byte-identical record, and "did my write land?" (plan.landed) would then take another's for ours.
_owners = itertools.count(1)


# Every ledger's heartbeats, so that a forked child can start its own (weakly held: a closed, dropped
# ledger goes away as before).
_all_heartbeats: weakref.WeakSet[Heartbeats] = weakref.WeakSet()


def _after_fork() -> None:
    global _owner_prefix
    _owner_prefix = f"{_HOST}:{os.getpid()}"
    # The child has only the forking thread: no other thread can hold a heartbeat's lock while we reset.
    for beats in list(_all_heartbeats):
        beats._after_fork()


os.register_at_fork(after_in_child=_after_fork)
#: The guarded call running in this context (``current_call()``, ``onceonly.http``).
CURRENT: contextvars.ContextVar[Lease | None] = contextvars.ContextVar("onceonly_call", default=None)


def new_owner() -> str:
    """A lease owner unique to this call: host, process (kept right across fork) and the process's counter."""
    return f"{_owner_prefix}:{next(_owners)}"


# --- leases and heartbeats ------------------------------------------------------------------------


class Lease:
    """A lease this process holds while a tool runs. ``record`` is the latest version we wrote.

    It is also the running tool's current call (``current_call()``, ``mark_sent()``), through ``ledger``.
    """

    __slots__ = ("beat_at", "keyed", "ledger", "lock", "lost", "outer", "record", "released", "seconds")

    def __init__(self, record: Record, seconds: float, now: float, ledger: Ledger) -> None:
        self.ledger = ledger
        #: The guarded call this one runs inside, if any: the chain a re-entered key is looked up in.
        self.outer = CURRENT.get()
        self.record = record
        self.seconds = seconds
        self.beat_at = now
        self.lock = threading.Lock()
        self.released = False
        self.lost = False
        #: The keyed HTTP requests this attempt sent (``onceonly.http``): what each is → its key.
        self.keyed: dict[str, str] | None = None


def swap_now(store: Store, new: Record, old: Record) -> tuple[bool, Record | None]:
    """One compare-and-set outside a guarded call (a heartbeat, ``mark_sent``, the reconciler), with the
    plan's rule for a write whose answer was lost: re-read, and it landed exactly when the stored record
    is the one written (``plan.landed``). Returns (written, the record as it now is); a re-read that
    fails too raises its ``StoreError``.
    """
    try:
        ok = store.swap(new, old)
    except StoreError:
        cur = store.get(new.key)
        return landed(new, cur), cur
    return (True, new) if ok else (False, store.get(new.key))


class Heartbeats:
    """One daemon thread per ledger extends the leases of tools that run longer than a third of it.

    A fast call never waits for it and never writes because of it: registering is a set insert.
    """

    def __init__(self, store: Store, clock: Callable[[], float], on_tick: Callable[[], None] | None = None) -> None:
        self._store = store
        self._clock = clock
        self._on_tick = on_tick  # called at every look (the store clock's re-measurement when due)
        self._leases: set[Lease] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._next_wake = 0.0  # when the thread looks next; a lease due sooner wakes it
        _all_heartbeats.add(self)

    def _after_fork(self) -> None:
        """In a forked child: the parent's thread is not here, so the next ``hold`` starts one. The
        parent's leases stay the parent's to extend (two writers of one lease would each see the other's
        beat as a takeover), and its lock and event may have been held at the fork: take fresh ones."""
        self._leases = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread = None
        self._next_wake = 0.0

    def hold(self, record: Record, seconds: float, ledger: Ledger) -> Lease:
        now = self._clock()
        lease = Lease(record, seconds, now, ledger)
        # set.add/discard and the thread's list(set) are each atomic under the GIL (a Lease hashes by
        # identity, no Python code runs inside them): the hot path takes no lock for the set.
        self._leases.add(lease)
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="onceonly-heartbeat", daemon=True)
                    self._thread.start()
        # Waking the thread costs a context switch per call; only a lease due before it looks needs it.
        if now + seconds / 3 < self._next_wake:
            self._wake.set()
        return lease

    def release(self, lease: Lease) -> Record:
        with lease.lock:  # waits for a heartbeat in progress, so that lease.record is the latest
            lease.released = True
        self._leases.discard(lease)
        return lease.record

    def close(self) -> None:
        self._closed = True
        self._wake.set()

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            # A thread ended by an error (not by close) is started again by the next hold.
            with self._lock:
                if not self._closed and self._thread is threading.current_thread():
                    self._thread = None

    def _loop(self) -> None:
        while not self._closed:
            # While it looks, any new lease wakes it: the last look's wake time is stale by now, and a
            # lease held after the snapshot below would otherwise wait a whole tick of the others.
            self._next_wake = math.inf
            if self._on_tick is not None:
                self._on_tick()
            leases = list(self._leases)
            now = self._clock()
            tick = max(0.01, min(lease.seconds for lease in leases) / 6) if leases else 1.0
            for lease in leases:
                if now - lease.beat_at >= lease.seconds / 3:
                    self._beat(lease, now)
            self._next_wake = now + tick
            self._wake.wait(tick)
            self._wake.clear()

    def _beat(self, lease: Lease, now: float) -> None:
        with lease.lock:
            if lease.released or lease.lost or lease.record.state not in HELD:
                return
            new = st.extend_lease(lease.record, now=now, lease_seconds=lease.seconds)
            try:
                ok, cur = swap_now(self._store, new, lease.record)
            except StoreError:
                return  # not even a re-read: try again next tick; the lease still has two thirds left
            if ok:  # written, or its answer was lost and it landed: the next beat builds on it
                lease.record = new
                lease.beat_at = now
            elif not landed(lease.record, cur):
                lease.lost = True  # someone else moved the record: our attempt's outcome is now late
            # else the store failed and the record is still ours, unchanged: try again next tick


# --- the current call, for tools that report their dispatch or want their fence -------------------


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What a running tool can know about its own call (``onceonly.current_call()``).

    Attributes:
        key: the idempotency key: send it to the other side.
        fence: the fencing token of this attempt: a higher one means a newer attempt.
        attempt: the attempt number (1-based, persisted).
        state: ``pending`` until the tool reports its dispatch (``mark_sent()``), then ``in_flight``.

    .. versionadded:: 0.1
    """

    key: str
    tool: str
    scope: str
    fence: int
    attempt: int
    state: State


def _info(lease: Lease) -> CallInfo:
    rec = lease.record
    return CallInfo(rec.key, rec.tool, rec.scope, rec.fence, rec.attempts, rec.state)


def current_call() -> CallInfo | None:
    """The guarded call this code runs in, or ``None`` outside one.

    .. versionadded:: 0.1
    """
    cur = CURRENT.get()
    return None if cur is None else _info(cur)


def mark_sent() -> None:
    """Tell the ledger the request is about to leave (``pending`` → ``in_flight``).

    Call it just before the side effect in a tool declared with ``reports_dispatch=True``. Until
    then a crash is safe to retry without a probe. Raises ``InProgress`` if this attempt lost its
    lease (another caller took over): then do not send.

    .. versionadded:: 0.1
    """
    cur = CURRENT.get()
    if cur is None:
        raise OnceOnlyError("mark_sent() is called from inside a guarded tool, and this code is not in one")
    _mark_sent(cur.ledger, cur)


async def amark_sent() -> None:
    """``mark_sent()`` for async tools.

    .. versionadded:: 0.1
    """
    cur = CURRENT.get()
    if cur is None:
        raise OnceOnlyError("amark_sent() is called from inside a guarded tool, and this code is not in one")
    await asyncio.to_thread(_mark_sent, cur.ledger, cur)


# --- the drivers: the only I/O loops --------------------------------------------------------------


def drive(
    ledger: Ledger,
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
    store = ledger.store
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
                if send is None and ledger._observed():
                    emit(action.record, ledger._listeners)  # type: ignore[union-attr]
            elif kind is Get:
                send = store.get(action.key)  # type: ignore[union-attr]
                if lost is not None:
                    _emit_if_landed(ledger, lost, send)
                    lost = None
            elif kind is Swap or kind is Insert:
                rec = action.record  # type: ignore[union-attr]
                ok = store.swap(rec, action.expected) if kind is Swap else store.insert(rec)  # type: ignore[union-attr]
                # Inlined alerting(rec): two attribute checks, on every write.
                if ok and (ledger._observed() or rec.conflicts or rec.state is _REVIEW):
                    emit(rec, ledger._listeners)
                send = ok
            elif kind is Execute:
                assert spec is not None
                send = _execute(ledger, spec, call, action.record, args, kwargs)  # type: ignore[union-attr]
            elif kind is Probe:
                assert spec is not None
                send = probe(spec, action.record)  # type: ignore[union-attr]
            elif kind is Sleep:
                ledger.sleep(action.seconds)  # type: ignore[union-attr]
                send = None
            elif kind is WaitChange:
                store.wait_for_change(action.key, action.version, action.seconds)  # type: ignore[union-attr]
                send = None
            elif kind is Running:
                send = _running(action.owner)  # type: ignore[union-attr]
            else:
                send = _similar(ledger, store, action)
        except StoreError as exc:
            error = exc
            if kind is Claim or kind is Insert or kind is Swap or kind is SimilarClaim:
                # The plan re-reads next (it never guesses); if this write landed, it is announced then.
                lost = action.record  # type: ignore[union-attr]


async def adrive(
    ledger: Ledger,
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
    store: Any = ledger.store
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
                if send is None and ledger._observed():
                    emit(action.record, ledger._listeners)  # type: ignore[union-attr]
            elif kind is Get:
                send = await store.aget(action.key)  # type: ignore[union-attr]
                if lost is not None:
                    _emit_if_landed(ledger, lost, send)
                    lost = None
            elif kind is Swap or kind is Insert:
                rec = action.record  # type: ignore[union-attr]
                ok = await (store.aswap(rec, action.expected) if kind is Swap else store.ainsert(rec))  # type: ignore[union-attr]
                # Inlined alerting(rec): two attribute checks, on every write.
                if ok and (ledger._observed() or rec.conflicts or rec.state is _REVIEW):
                    emit(rec, ledger._listeners)
                send = ok
            elif kind is Execute:
                assert spec is not None
                send = await _aexecute(ledger, spec, call, action.record, args, kwargs)  # type: ignore[union-attr]
            elif kind is Probe:
                assert spec is not None
                send = await aprobe(spec, action.record)  # type: ignore[union-attr]
            elif kind is Sleep:
                await ledger.asleep(action.seconds)  # type: ignore[union-attr]
                send = None
            elif kind is WaitChange:
                await store.await_for_change(action.key, action.version, action.seconds)  # type: ignore[union-attr]
                send = None
            elif kind is Running:
                send = _running(action.owner)  # type: ignore[union-attr]
            else:
                send = await _asimilar(ledger, store, action)
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


def _similar(ledger: Ledger, store: Any, action: Action) -> Any:
    """The store calls of a near-duplicate lookup (``onceonly.Similar``): off the path of other tools."""
    if isinstance(action, SimilarLock):
        return store.similar_lock(action.group, action.token, action.now, action.until, action.since, action.limit)
    if isinstance(action, SimilarClaim):
        got = store.similar_claim(action.record, action.group, action.token)
        if got is None:
            emit(action.record, ledger._listeners)
        return got
    assert isinstance(action, SimilarUnlock)
    store.similar_unlock(action.group, action.token)
    return None


async def _asimilar(ledger: Ledger, store: Any, action: Action) -> Any:
    """``_similar`` for async tools."""
    if isinstance(action, SimilarLock):
        return await store.asimilar_lock(
            action.group, action.token, action.now, action.until, action.since, action.limit
        )
    if isinstance(action, SimilarClaim):
        got = await store.asimilar_claim(action.record, action.group, action.token)
        if got is None:
            emit(action.record, ledger._listeners)
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


def _emit_if_landed(ledger: Ledger, written: Record, now_stored: Record | None) -> None:
    """At the plan's re-read after a write whose answer was lost: announce the write if it landed,
    as every transition this process writes is (``subscribe``)."""
    if landed(written, now_stored) and (ledger._observed() or alerting(written)):
        emit(written, ledger._listeners)


# --- running a tool ------------------------------------------------------------------------------


def _raised(spec: ToolSpec, exc: BaseException, latest: Record) -> Executed:
    # Control flow (a LangGraph interrupt, a passthrough= type) is not an outcome: the plan gives the
    # claim back uncounted and re-raises it. An interrupt (KeyboardInterrupt, SystemExit: not an
    # Exception) is recorded at once and re-raised; anything else is the attempt's outcome.
    if spec.is_control_flow(exc):
        return Executed(error=exc, record=latest, released=True)
    return Executed(error=exc, record=latest, interrupted=not isinstance(exc, Exception))


def _execute(
    ledger: Ledger, spec: ToolSpec, call: Call, rec: Record, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Executed:
    beats = ledger._beats
    lease = beats.hold(rec, call.policy.lease, ledger)
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
            _settle_late(ledger, call, rec.fence, box.get("value"), box.get("error"))

    threading.Thread(target=run, name=f"onceonly-{spec.name}"[:60], daemon=True).start()
    try:
        finished.wait(spec.timeout)
    except BaseException as exc:  # Ctrl-C while waiting: the tool runs on, and its outcome is recorded late
        with guard:
            ended = box.get("finished", False)
            box["timed_out"] = True
        latest = beats.release(lease)
        if ended:  # it finished just before: nobody else records what it returned
            _settle_late(ledger, call, rec.fence, box.get("value"), box.get("error"))
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
    ledger: Ledger, spec: ToolSpec, call: Call, rec: Record, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Executed:
    beats = ledger._beats
    lease = beats.hold(rec, call.policy.lease, ledger)
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
        _settle_late_async(ledger, task, call, rec.fence)
        return Executed(error=exc, record=latest, interrupted=True)
    latest = beats.release(lease)
    if not done:
        _settle_late_async(ledger, task, call, rec.fence)
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


def _settle_late(ledger: Ledger, call: Call, fence: int, value: Any, error: BaseException | None) -> None:
    try:
        drive(ledger, late_outcome(call, fence, value, error), None, call, (), {})
    except Exception:
        _log_late_failure(call, fence)


def _settle_late_async(ledger: Ledger, task: asyncio.Future[Any], call: Call, fence: int) -> None:
    def done(t: asyncio.Future[Any]) -> None:
        if t.cancelled():
            return  # nothing known: the record stays unknown for the probe or a person
        err = t.exception()
        late = asyncio.ensure_future(
            adrive(ledger, late_outcome(call, fence, None if err else t.result(), err), None, call, (), {})
        )
        ledger._late_tasks.add(late)
        late.add_done_callback(_late_done(ledger, call, fence))

    task.add_done_callback(done)


def _late_done(ledger: Ledger, call: Call, fence: int) -> Callable[[asyncio.Future[Any]], None]:
    """When an async late outcome is recorded: forget its task; a failure is logged as the sync one's."""

    def done(late: asyncio.Future[Any]) -> None:
        ledger._late_tasks.discard(late)
        if not late.cancelled() and late.exception() is not None:
            _log_late_failure(call, fence, late.exception())

    return done


def _mark_sent(ledger: Ledger, lease: Lease) -> None:
    with lease.lock:
        rec = lease.record
        if rec.state is not State.PENDING:
            return
        new = st.transition(
            rec, State.IN_FLIGHT, now=ledger.clock(), reason="dispatched", by=rec.lease_owner,
            lease_until=ledger.clock() + lease.seconds,
        )  # fmt: skip
        try:
            ok, cur = swap_now(ledger.store, new, rec)
            if not ok and landed(rec, cur):  # the store failed, and the record is still ours, pending
                raise StoreUnavailable(f"could not mark {rec.key!r} sent (the store failed): do not send")
        except StoreError as exc:
            # The tool stops here, so nothing was sent whatever the record says: the attempt may be
            # retried (as "not sent") rather than settled as a definite failure.
            exc.onceonly_verdict = Verdict.NOT_SENT  # type: ignore[attr-defined]
            raise
        if not ok:
            lease.lost = True
            raise InProgress(
                f"the lease on {rec.key!r} was lost before dispatch (another caller took over): do not send",
                key=rec.key,
                record=rec,
            )
        lease.record = new
        lease.beat_at = ledger.clock()
    emit(new, ledger._listeners)


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
