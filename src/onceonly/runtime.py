"""What every guarded call on one ledger shares, below the drivers: the store, the clocks, the
listeners, leases and their heartbeats, owner ids and the current call.

``Runtime`` is one ledger's; ``Ledger`` composes one and hands it to the drivers (``drivers.py``), the
guarded functions (``tools.py``) and the reconciler (``settle.py``), so that none of them reads the
ledger's private state. The current call (``current_call()``, ``mark_sent()``) is a context variable
here, read by ``onceonly.http`` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
import math
import os
import random
import socket
import threading
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from onceonly import states as st
from onceonly.clock import StoreClock
from onceonly.errors import InProgress, OnceOnlyError, StoreError, StoreUnavailable
from onceonly.events import Listener, emit
from onceonly.events import log as _transitions_log
from onceonly.pause import PauseWatch
from onceonly.plan import landed
from onceonly.policy import Verdict
from onceonly.states import HELD, Record, State
from onceonly.stores.base import Store

_INFO = logging.INFO
_info_on = _transitions_log.isEnabledFor  # whether every transition is logged (emit() does then)

if TYPE_CHECKING:
    from onceonly.dryrun import DryRuns
    from onceonly.plan import Call
    from onceonly.tools import ToolSpec

__all__ = [
    "CURRENT",
    "CallInfo",
    "Heartbeats",
    "Lease",
    "Runtime",
    "amark_sent",
    "current_call",
    "mark_sent",
    "new_owner",
    "swap_now",
]


class Runtime:
    """One ledger's shared state for running guarded calls.

    Attributes:
        store: the store every call writes through (``write_through`` replaces it, for all at once).
        clock: the clock the ledger reads (the store's, where it has one: ``store_clock``).
        sleep, asleep: blocking and async sleep (injectable for tests).
        rng: the random source of backoff jitter.
        store_clock: the offset to the store's clock, or ``None``.
        listeners: ``Ledger.subscribe``'s listeners, told of every transition this process writes.
        beats: the heartbeats that extend the leases of running tools.
        late_tasks: async late outcomes being recorded (kept so that they are not collected).
        count_call: ``(spec, call) -> context manager`` around each guarded call (``observe_calls``), or
            ``None`` when nobody observes calls. The context manager's ``outcome`` is set to the call's
            ``Outcome`` before it exits without an error.
        watchers: told of each record this process writes, as the record itself (``watch``), before
            any event is decoded from it.
        pauses: the pauses in force (``onceonly.pause.PauseWatch``): each call asks it first.

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        store: Store,
        *,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        asleep: Callable[[float], Awaitable[None]],
        rng: random.Random,
        store_clock: StoreClock | None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.sleep = sleep
        self.asleep = asleep
        self.rng = rng
        self.store_clock = store_clock
        self.listeners: list[Listener] = []
        self.watchers: list[Callable[[Record], None]] = []
        self.count_call: CallObserver | None = None
        self._call_observers: list[CallObserver] = []
        #: ``observe_passes``' observers, entered around each reconciler pass.
        self.pass_observers: list[Callable[[str | None], contextlib.AbstractContextManager[Any]]] = []
        #: The pauses in force (``onceonly.pause``), read from the store at most every half second. It keeps
        #: the store it was made with: ``write_through``'s wrappers time the calls' operations, not this.
        self.pauses = PauseWatch(store)
        #: The ledger's dry runs while one is on (``Ledger.dry_run``), else ``None``: a call reads only this.
        self.dry: DryRuns | None = None
        on_tick = None if store_clock is None else store_clock.sync_if_due
        self.beats = Heartbeats(store, clock, on_tick)
        self.late_tasks: set[asyncio.Task[Any]] = set()
        # Late outcomes being written from a tool's worker thread: close() lets them finish first, since
        # a store closed under a thread that is using it may fail that thread (SQLite: crash the process).
        self._writing = 0
        self._written = threading.Condition()

    def observed(self) -> bool:
        """Whether anyone hears of transitions (a listener, or the transitions log at INFO)."""
        return bool(self.listeners) or bool(self.watchers) or _transitions_log.isEnabledFor(logging.INFO)

    def announce(self, record: Record) -> None:
        """Tell the watchers, the listeners (and the transitions log) of a transition this process wrote."""
        for watcher in self.watchers:
            try:
                watcher(record)
            except Exception:  # a broken watcher must not break the ledger
                _transitions_log.exception("onceonly: a record watcher failed")
        # emit()'s own first checks, here: a ledger with only watchers (metrics) pays no call for it.
        if self.listeners or record.conflicts or record.state is State.NEEDS_REVIEW or _info_on(_INFO):
            emit(record, self.listeners)

    def watch(self, watcher: Callable[[Record], None]) -> None:
        """``watcher(record)`` for each record this process writes from now on: the raw record, for an
        observer that decides cheaply what it needs (``onceonly.metrics``), where ``Ledger.subscribe``'s
        listeners get a decoded ``TransitionEvent``."""
        self.watchers.append(watcher)

    def new_owner(self) -> str:
        """A lease owner unique to one call (``new_owner``)."""
        return new_owner()

    def sync_clock(self) -> None:
        """Measure the store clock's offset again if it is due (a process that runs no tool has no
        heartbeat to do it)."""
        if self.store_clock is not None:
            self.store_clock.sync_if_due()

    def write_through(self, store: Store) -> None:
        """From now on every call and heartbeat of this ledger uses ``store`` (a wrapper of the store that
        times each operation, say: ``onceonly.metrics.instrument``)."""
        self.store = store
        self.beats.store = store

    def observe_calls(self, observer: CallObserver) -> None:
        """``observer(spec, call)`` is entered around each guarded call from now on (``onceonly.metrics``,
        ``onceonly.otel``); several are entered in the order given."""
        self._call_observers.append(observer)
        self._compose()

    def unobserve_calls(self, observer: CallObserver) -> None:
        """No longer enter ``observer`` around calls."""
        self._call_observers = [o for o in self._call_observers if o != observer]
        self._compose()

    def observe_passes(self, observer: Callable[[str | None], contextlib.AbstractContextManager[Any]]) -> None:
        """``observer(scope)`` is entered around each reconciler pass over this ledger from now on; its
        context manager's ``report`` is set to the pass's ``ReconcileReport`` before it exits without
        an error (``onceonly.metrics``: the last pass's time; ``onceonly.otel``: a span per pass)."""
        self.pass_observers.append(observer)

    def _compose(self) -> None:
        # One observer is entered as it is (the hot path pays for nothing else); several through _Each.
        found = list(self._call_observers)
        self.count_call = None if not found else found[0] if len(found) == 1 else _Each.maker(found)

    @contextlib.contextmanager
    def writing_late(self) -> Iterator[None]:
        """Around recording a late outcome in a worker thread: ``close()`` waits for it."""
        with self._written:
            self._writing += 1
        try:
            yield
        finally:
            with self._written:
                self._writing -= 1
                self._written.notify_all()

    def close(self, wait: float = 5.0) -> None:
        """Stop the heartbeats, and wait up to ``wait`` seconds for late outcomes being written."""
        self.beats.close()
        with self._written:
            self._written.wait_for(lambda: self._writing == 0, timeout=wait)


#: Made around one guarded call: ``observer(spec, call)``; its context manager gets ``outcome`` set.
CallObserver = Callable[["ToolSpec", "Call"], contextlib.AbstractContextManager[Any]]


class _Each:
    """Several call observers entered as one: each one's ``outcome`` is set with this one's."""

    __slots__ = ("entered", "makers", "outcome")

    def __init__(self, makers: list[CallObserver], spec: ToolSpec, call: Call) -> None:
        self.entered = [make(spec, call) for make in makers]
        self.outcome: Any = None

    @classmethod
    def maker(cls, makers: list[CallObserver]) -> CallObserver:
        return lambda spec, call: cls(makers, spec, call)

    def __enter__(self) -> _Each:
        for n, cm in enumerate(self.entered):
            try:
                cm.__enter__()
            except BaseException as exc:
                for done in reversed(self.entered[:n]):
                    done.__exit__(type(exc), exc, exc.__traceback__)
                raise
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        for cm in reversed(self.entered):
            if exc is None:
                cm.outcome = self.outcome  # type: ignore[attr-defined]
            cm.__exit__(kind, exc, tb)


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

    It is also the running tool's current call (``current_call()``, ``mark_sent()``), through ``runtime``.
    """

    __slots__ = ("beat_at", "keyed", "lock", "lost", "outer", "record", "released", "runtime", "seconds")

    def __init__(self, record: Record, seconds: float, now: float, runtime: Runtime) -> None:
        self.runtime = runtime
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
        self.store = store  # Runtime.write_through replaces it
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

    def hold(self, record: Record, seconds: float, runtime: Runtime) -> Lease:
        now = self._clock()
        lease = Lease(record, seconds, now, runtime)
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
                ok, cur = swap_now(self.store, new, lease.record)
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


def mark_sent(*, target: Mapping[str, str] | None = None) -> None:
    """Tell the ledger the request is about to leave (``pending`` → ``in_flight``).

    Call it just before the side effect in a tool declared with ``reports_dispatch=True``. Until
    then a crash is safe to retry without a probe. Raises ``InProgress`` if this attempt lost its
    lease (another caller took over): then do not send.

    ``target``: where the request goes, kept in the record's history (``states.dispatch_target``):
    ``onceonly.http``'s ``probe="server"`` faces give the method, the URL without its query, the key
    and the server's key status URL, so that the reconciler can ask the server about a caller that
    died mid-request. Never credentials.

    .. versionadded:: 0.1
    """
    cur = CURRENT.get()
    if cur is None:
        raise OnceOnlyError("mark_sent() is called from inside a guarded tool, and this code is not in one")
    _mark_sent(cur.runtime, cur, target)


async def amark_sent(*, target: Mapping[str, str] | None = None) -> None:
    """``mark_sent()`` for async tools.

    .. versionadded:: 0.1
    """
    cur = CURRENT.get()
    if cur is None:
        raise OnceOnlyError("amark_sent() is called from inside a guarded tool, and this code is not in one")
    await asyncio.to_thread(_mark_sent, cur.runtime, cur, target)


def _mark_sent(runtime: Runtime, lease: Lease, target: Mapping[str, str] | None = None) -> None:
    with lease.lock:
        rec = lease.record
        if rec.state is not State.PENDING:
            return
        new = st.transition(
            rec, State.IN_FLIGHT, now=runtime.clock(), reason="dispatched", by=rec.lease_owner,
            lease_until=runtime.clock() + lease.seconds, target=target,
        )  # fmt: skip
        try:
            ok, cur = swap_now(runtime.store, new, rec)
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
        lease.beat_at = runtime.clock()
    runtime.announce(new)
