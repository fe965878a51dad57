"""The ledger: ``Ledger.open``, the ``@ledger.tool`` guard, tasks, and the operations API.

The decisions are in ``guard.py``; this module does their I/O. ``_drive`` (sync) and ``_adrive``
(async) are the only two loops, and they differ only in what they await.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import itertools
import logging
import math
import os
import random
import socket
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, TypeVar, cast, get_args, overload

from onceonly import states as st
from onceonly.errors import InProgress, InvalidKey, OnceOnlyError, StoreError, StoreUnavailable
from onceonly.events import Listener, emit
from onceonly.events import log as _transitions_log
from onceonly.guard import (
    DEFAULT_TTL,
    NOT_FOUND,
    Action,
    Call,
    Claim,
    Execute,
    Executed,
    Get,
    Insert,
    OnConflict,
    OnUnknown,
    Outcome,
    Policy,
    Probe,
    Probed,
    Sleep,
    Swap,
    WaitChange,
    encode_result,
    landed,
    late_outcome,
    plan,
)
from onceonly.keys import MAX_KEY_LENGTH, Normalizer, canonical_json, compose_key, fingerprint, select, validate_name
from onceonly.policy import Classifier, Retry, Verdict, check_seconds, classify
from onceonly.states import HELD, Record, State
from onceonly.stores import open_store
from onceonly.stores.base import Query, Store

if TYPE_CHECKING:
    from onceonly.settle import ReconcileReport

__all__ = ["AsyncTool", "CallInfo", "Ledger", "Tool", "amark_sent", "current_call", "mark_sent"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

DEFAULT_URL = "sqlite:///.onceonly/ledger.db"
_log = logging.getLogger("onceonly")
_MISSING: Any = object()
_HOST = socket.gethostname()[:40]
_owner_prefix = f"{_HOST}:{os.getpid()}"
# One counter for the process, not one per Ledger: two ledgers in one process (two stores, or one
# re-opened) must never hand out the same owner, since an owner with the same clock reading makes a
# byte-identical record, and "did my write land?" (guard.landed) would then take another's for ours.
_owners = itertools.count(1)


# Every ledger's heartbeats, so that a forked child can start its own (weakly held: a closed, dropped
# ledger goes away as before).
_all_heartbeats: weakref.WeakSet[_Heartbeats] = weakref.WeakSet()


#: The most records one ``Ledger.list`` returns (a page; ``after=`` gives the next).
_MAX_LIST = 1_000_000_000


def _after_fork() -> None:
    global _owner_prefix
    _owner_prefix = f"{_HOST}:{os.getpid()}"
    # The child has only the forking thread: no other thread can hold a heartbeat's lock while we reset.
    for beats in list(_all_heartbeats):
        beats._after_fork()


os.register_at_fork(after_in_child=_after_fork)
_SCOPE: contextvars.ContextVar[str | None] = contextvars.ContextVar("onceonly_scope", default=None)
_CURRENT: contextvars.ContextVar[_Lease | None] = contextvars.ContextVar("onceonly_call", default=None)


# --- leases and heartbeats ------------------------------------------------------------------------


class _Lease:
    """A lease this process holds while a tool runs. ``record`` is the latest version we wrote.

    It is also the running tool's current call (``current_call()``, ``mark_sent()``), through ``ledger``.
    """

    __slots__ = ("beat_at", "keyed", "ledger", "lock", "lost", "record", "released", "seconds")

    def __init__(self, record: Record, seconds: float, now: float, ledger: Ledger) -> None:
        self.ledger = ledger
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
    is the one written (``guard.landed``). Returns (written, the record as it now is); a re-read that
    fails too raises its ``StoreError``.
    """
    try:
        ok = store.swap(new, old)
    except StoreError:
        cur = store.get(new.key)
        return landed(new, cur), cur
    return (True, new) if ok else (False, store.get(new.key))


class _Heartbeats:
    """One daemon thread per ledger extends the leases of tools that run longer than a third of it.

    A fast call never waits for it and never writes because of it: registering is a set insert.
    """

    def __init__(self, store: Store, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock
        self._leases: set[_Lease] = set()
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

    def hold(self, record: Record, seconds: float, ledger: Ledger) -> _Lease:
        now = self._clock()
        lease = _Lease(record, seconds, now, ledger)
        # set.add/discard and the thread's list(set) are each atomic under the GIL (a _Lease hashes by
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

    def release(self, lease: _Lease) -> Record:
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
            leases = list(self._leases)
            now = self._clock()
            tick = max(0.01, min(lease.seconds for lease in leases) / 6) if leases else 1.0
            for lease in leases:
                if now - lease.beat_at >= lease.seconds / 3:
                    self._beat(lease, now)
            self._next_wake = now + tick
            self._wake.wait(tick)
            self._wake.clear()

    def _beat(self, lease: _Lease, now: float) -> None:
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


def _info(lease: _Lease) -> CallInfo:
    rec = lease.record
    return CallInfo(rec.key, rec.tool, rec.scope, rec.fence, rec.attempts, rec.state)


def current_call() -> CallInfo | None:
    """The guarded call this code runs in, or ``None`` outside one.

    .. versionadded:: 0.1
    """
    cur = _CURRENT.get()
    return None if cur is None else _info(cur)


def mark_sent() -> None:
    """Tell the ledger the request is about to leave (``pending`` → ``in_flight``).

    Call it just before the side effect in a tool declared with ``reports_dispatch=True``. Until
    then a crash is safe to retry without a probe. Raises ``InProgress`` if this attempt lost its
    lease (another caller took over): then do not send.

    .. versionadded:: 0.1
    """
    cur = _CURRENT.get()
    if cur is None:
        raise OnceOnlyError("mark_sent() is called from inside a guarded tool, and this code is not in one")
    cur.ledger._mark_sent(cur)


async def amark_sent() -> None:
    """``mark_sent()`` for async tools.

    .. versionadded:: 0.1
    """
    cur = _CURRENT.get()
    if cur is None:
        raise OnceOnlyError("amark_sent() is called from inside a guarded tool, and this code is not in one")
    await asyncio.to_thread(cur.ledger._mark_sent, cur)


# --- tools ----------------------------------------------------------------------------------------


class _Binder:
    """Maps a call's arguments to parameter names, defaults applied: the input of the key."""

    def __init__(self, fn: Callable[..., Any], skip: frozenset[str]) -> None:
        full = inspect.signature(fn)
        # The injected key is not an argument of the operation: bind as if it were not declared.
        params = [p for p in full.parameters.values() if p.name != "idempotency_key"]
        self.sig = full.replace(parameters=params)
        kinds = {p.kind for p in params}
        self.simple = not kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD,
                                   inspect.Parameter.POSITIONAL_ONLY}  # fmt: skip
        self.positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        self.names = frozenset(p.name for p in params)
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.required = frozenset(p.name for p in params if p.default is inspect.Parameter.empty)
        self.skip = skip
        # Every parameter given positionally, nothing to skip: the common agent tool call.
        plain = self.simple and len(self.positional) == len(params) and not skip & self.names
        self.all_positional = len(params) if plain else -1

    def bind(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        if not kwargs and len(args) == self.all_positional:
            return dict(zip(self.positional, args, strict=True))
        if self.simple and len(args) <= len(self.positional) and kwargs.keys() <= self.names:
            bound = dict(self.defaults)
            bound.update(zip(self.positional, args, strict=False))
            if not kwargs or kwargs.keys().isdisjoint(self.positional[: len(args)]):
                bound.update(kwargs)
                if self.required <= bound.keys():
                    for name in self.skip:
                        bound.pop(name, None)
                    return bound
        # The slow path also produces Python's own TypeError for a wrong call.
        ba = self.sig.bind(*args, **kwargs)
        ba.apply_defaults()
        out = dict(ba.arguments)
        for name in self.skip:
            out.pop(name, None)
        return out


class _BaseTool(Generic[P, R]):
    """What sync and async tools share: the spec and how a call becomes a ledger ``Call``."""

    def __init__(
        self,
        ledger: Ledger,
        fn: Callable[..., Any],
        *,
        name: str,
        key: Sequence[str] | Callable[[dict[str, Any]], str] | None,
        ignore: Sequence[str],
        normalize: Mapping[str, Normalizer] | None,
        policy: Policy,
        probe: Callable[[dict[str, Any], str], Any] | None,
        timeout: float | None,
        readonly: bool,
        decode: Callable[[Any], Any] | None,
    ) -> None:
        self.ledger = ledger
        self.fn = fn
        self.name = validate_name(name, "tool name")
        params = inspect.signature(fn).parameters
        self.takes_key = "idempotency_key" in params
        skip = {"idempotency_key"} | set(ignore)
        first = next(iter(params), None)
        if first in ("self", "cls"):
            skip.add(first)  # a method's receiver is not part of the operation
        self.binder = _Binder(fn, frozenset(skip))
        unknown = [f for f in (*ignore, *(normalize or {})) if f not in params]
        if isinstance(key, str):
            raise TypeError(f"key={key!r}: give a tuple of field names, as key=({key!r},)")
        if key is not None and not callable(key):
            unknown += [f for f in key if f not in params]
        if unknown:
            raise TypeError(f"tool {name!r}: {unknown} are not parameters of {fn.__qualname__}{inspect.signature(fn)}")
        self.key_fields = key
        self.normalize = dict(normalize or {})
        self.policy = policy
        self.probe = probe
        self.timeout = timeout
        self.readonly = readonly
        self.decode = decode
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any], key: str | None, occurrence: int) -> Call:
        explicit = kwargs.pop("idempotency_key", None) if self.takes_key else None
        explicit = key or explicit
        fields = self.binder.bind(args, kwargs)
        args_json = canonical_json(fields)
        if self.normalize:
            hashed = dict(fields)
            for name, norm in self.normalize.items():
                hashed[name] = norm(hashed[name])
            fp = fingerprint(canonical_json(hashed))
        else:
            hashed = fields
            fp = fingerprint(args_json)
        if explicit is not None:
            digest = validate_name(explicit, "explicit key")
        elif self.key_fields is None:
            digest = fp[:32]
        elif callable(self.key_fields):
            digest = validate_name(str(self.key_fields(hashed)), "key returned by key=")
        else:
            digest = fingerprint(canonical_json(select(hashed, self.key_fields), path="key"))[:32]
        if occurrence != 1:  # an int from 1: using() checked it
            digest = f"{digest}#{occurrence}"
        ledger = self.ledger
        scope = _SCOPE.get() or ledger.scope
        key = f"{scope}:{self.name}:{digest}"
        if len(key) > MAX_KEY_LENGTH:
            compose_key(scope, self.name, digest)  # raises, saying which part to shorten
        # Positional: built on every call (key, scope, tool, fingerprint, args, owner, policy, clock, rng).
        return Call(key, scope, self.name, fp, args_json, ledger._new_owner(), self.policy, ledger.clock, ledger.rng)

    def _tool_kwargs(self, call: Call, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.takes_key:
            return {**kwargs, "idempotency_key": call.key}
        return kwargs

    def _finish(self, out: Outcome) -> Outcome:
        if out.replayed and self.decode is not None:
            return _replace_result(out, self.decode(out.result))
        return out

    def key_for(self, *args: P.args, **kwargs: P.kwargs) -> str:
        """The ledger key this call would use, without calling anything.

        .. versionadded:: 0.1
        """
        return self._call(args, dict(kwargs), None, 1).key

    def __repr__(self) -> str:
        return f"<onceonly tool {self.name!r} on {self.ledger.url}>"


def _check_occurrence(occurrence: int) -> int:
    # The number is part of the key: True would be occurrence 1 and 2.0 a key other than 2's, so that a
    # second occurrence could run twice. Only an int is the same number in every call.
    if type(occurrence) is not int or occurrence < 1:
        raise InvalidKey(f"occurrence={occurrence!r}: give an int from 1 (the n-th time the same call is meant)")
    return occurrence


def _replace_result(out: Outcome, result: Any) -> Outcome:
    from dataclasses import replace

    return replace(out, result=result)


class Tool(_BaseTool[P, R]):
    """A sync function guarded by the ledger. Calling it returns the result; ``.outcome()`` the ``Outcome``.

    .. versionadded:: 0.1
    """

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return cast(R, self._outcome(args, kwargs, None, 1).result)  # kwargs: a fresh dict already

    def outcome(self, *args: P.args, **kwargs: P.kwargs) -> Outcome:
        """Run (or replay) the call and return its ``Outcome``."""
        return self._outcome(args, kwargs, None, 1)

    def using(self, *, key: str | None = None, occurrence: int = 1) -> _Using[P, R]:
        """This tool with an explicit key, or the n-th occurrence of the same call (meant twice).

        ``send_email.using(occurrence=2)(to, body)`` sends a second, distinct email; run again after
        a crash it replays that second one.
        """
        return _Using(self, key, _check_occurrence(occurrence))

    def _outcome(self, args: tuple[Any, ...], kwargs: dict[str, Any], key: str | None, occurrence: int) -> Outcome:
        if self.readonly:
            return _readonly(self, args, kwargs)
        call = self._call(args, kwargs, key, occurrence)
        return self._finish(self.ledger._drive(plan(call), self, call, args, kwargs))


class _Using(Generic[P, R]):
    def __init__(self, tool: Tool[P, R], key: str | None, occurrence: int) -> None:
        self.tool, self.key, self.occurrence = tool, key, occurrence

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return cast(R, self.outcome(*args, **kwargs).result)

    def outcome(self, *args: P.args, **kwargs: P.kwargs) -> Outcome:
        return self.tool._outcome(args, dict(kwargs), self.key, self.occurrence)


class AsyncTool(_BaseTool[P, R]):
    """An ``async def`` function guarded by the ledger: the same semantics as ``Tool``, awaited.

    .. versionadded:: 0.1
    """

    async def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return cast(R, (await self.outcome(*args, **kwargs)).result)

    async def outcome(self, *args: P.args, **kwargs: P.kwargs) -> Outcome:
        """Run (or replay) the call and return its ``Outcome``."""
        return await self._aoutcome(args, dict(kwargs), None, 1)

    def using(self, *, key: str | None = None, occurrence: int = 1) -> _AsyncUsing[P, R]:
        """See ``Tool.using``."""
        return _AsyncUsing(self, key, _check_occurrence(occurrence))

    async def _aoutcome(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], key: str | None, occurrence: int
    ) -> Outcome:
        if self.readonly:
            return await _areadonly(self, args, kwargs)
        call = self._call(args, kwargs, key, occurrence)
        return self._finish(await self.ledger._adrive(plan(call), self, call, args, kwargs))


class _AsyncUsing(Generic[P, R]):
    def __init__(self, tool: AsyncTool[P, R], key: str | None, occurrence: int) -> None:
        self.tool, self.key, self.occurrence = tool, key, occurrence

    async def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        return cast(R, (await self.outcome(*args, **kwargs)).result)

    async def outcome(self, *args: P.args, **kwargs: P.kwargs) -> Outcome:
        return await self.tool._aoutcome(args, dict(kwargs), self.key, self.occurrence)


def _log_late_failure(call: Call, fence: int, exc: BaseException | None = None) -> None:
    # The caller is gone; the record stays unknown for the probe, the reconciler or a person.
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else True
    _log.error("onceonly %s: could not record the late outcome of attempt %d", call.key, fence, exc_info=exc_info)


def _readonly_outcome(value: Any, attempt: int) -> Outcome:
    return Outcome(result=value, key="", state=State.CONFIRMED, replayed=False, attempts=attempt, via="readonly")


def _readonly(tool: Tool[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
    """A read has no side effect: plain retry on anything that may be transient, no ledger."""
    retry = tool.policy.retry
    for attempt in itertools.count(1):
        try:
            return _readonly_outcome(tool.fn(*args, **kwargs), attempt)
        except Exception as exc:
            verdict = classify(exc, tool.policy.classify)
            if verdict.verdict is Verdict.FAILED or attempt >= retry.attempts:
                raise
            tool.ledger.sleep(retry.backoff(attempt, tool.ledger.rng, floor=verdict.retry_after))
    raise AssertionError("unreachable")  # pragma: no cover


async def _areadonly(tool: AsyncTool[Any, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
    retry = tool.policy.retry
    for attempt in itertools.count(1):
        try:
            return _readonly_outcome(await tool.fn(*args, **kwargs), attempt)
        except Exception as exc:
            verdict = classify(exc, tool.policy.classify)
            if verdict.verdict is Verdict.FAILED or attempt >= retry.attempts:
                raise
            await tool.ledger.asleep(retry.backoff(attempt, tool.ledger.rng, floor=verdict.retry_after))
    raise AssertionError("unreachable")  # pragma: no cover


# --- the ledger -----------------------------------------------------------------------------------


class Ledger:
    """A durable ledger of tool calls, over one store.

    Args:
        store: a store (``SQLiteStore``, ``RedisStore``, ``PostgresStore``, or your own ``Store``).
        scope: the scope of keys outside any ``ledger.task()``.
        clock: seconds since the epoch (injectable for tests).
        sleep: blocking sleep (injectable for tests); ``asleep`` its async twin.
        rng: the random source of backoff jitter.

    Prefer ``Ledger.open(url)``.

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        store: Store,
        *,
        scope: str = "default",
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        asleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.store = store
        self.url: str = getattr(store, "url", repr(store))
        self.scope = validate_name(scope, "scope")
        self.clock = clock
        self.sleep = sleep
        self.asleep = asleep
        self.rng = rng or random.Random()
        self._listeners: list[Listener] = []
        self._beats = _Heartbeats(store, clock)
        self._late_tasks: set[asyncio.Task[Any]] = set()
        self.tools: dict[str, _BaseTool[Any, Any]] = {}

    @classmethod
    def open(cls, url: str | None = None, **kwargs: Any) -> Ledger:
        """Open the ledger at ``url``; default ``$ONCEONLY_URL``, else ``sqlite:///.onceonly/ledger.db``.

        Args:
            url: ``sqlite:///relative.db``, ``sqlite:////abs/path.db``, ``redis://host:6379/0``,
                ``postgresql://host/db``.
            **kwargs: passed to ``Ledger`` (``scope``, ``clock``…).

        .. versionadded:: 0.1
        """
        return cls(open_store(url or os.environ.get("ONCEONLY_URL") or DEFAULT_URL), **kwargs)

    def _observed(self) -> bool:
        return bool(self._listeners) or _transitions_log.isEnabledFor(logging.INFO)

    def _new_owner(self) -> str:
        # Unique per call: host, process (kept right across fork by _after_fork) and the process's counter.
        return f"{_owner_prefix}:{next(_owners)}"

    # --- the decorator ----------------------------------------------------------------------------

    @overload
    def tool(self, fn: Callable[P, Awaitable[R]], /) -> AsyncTool[P, R]: ...  # type: ignore[overload-overlap]
    @overload
    def tool(self, fn: Callable[P, R], /) -> Tool[P, R]: ...
    @overload
    def tool(
        self,
        fn: None = None,
        /,
        *,
        name: str | None = None,
        key: Sequence[str] | Callable[[dict[str, Any]], str] | None = None,
        ignore: Sequence[str] = (),
        normalize: Mapping[str, Normalizer] | None = None,
        retry: Retry | None = None,
        on_unknown: OnUnknown = "review",
        on_conflict: OnConflict = "raise",
        probe: Callable[[dict[str, Any], str], Any] | None = None,
        settle: float = 0.0,
        ttl: float | None = DEFAULT_TTL,
        lease: float = 30.0,
        wait: float = 10.0,
        timeout: float | None = None,
        readonly: bool = False,
        reports_dispatch: bool = False,
        classify: Classifier | None = None,
        decode: Callable[[Any], Any] | None = None,
    ) -> Callable[[Callable[P, R]], Any]: ...

    def tool(
        self,
        fn: Callable[..., Any] | None = None,
        /,
        *,
        name: str | None = None,
        key: Sequence[str] | Callable[[dict[str, Any]], str] | None = None,
        ignore: Sequence[str] = (),
        normalize: Mapping[str, Normalizer] | None = None,
        retry: Retry | None = None,
        on_unknown: OnUnknown = "review",
        on_conflict: OnConflict = "raise",
        probe: Callable[[dict[str, Any], str], Any] | None = None,
        settle: float = 0.0,
        ttl: float | None = DEFAULT_TTL,
        lease: float = 30.0,
        wait: float = 10.0,
        timeout: float | None = None,
        readonly: bool = False,
        reports_dispatch: bool = False,
        classify: Classifier | None = None,
        decode: Callable[[Any], Any] | None = None,
    ) -> Any:
        """Guard a function with side effects so that each logical call happens once.

        Args:
            name: the tool's name in keys; default ``module.qualname``.
            key: the fields that identify the operation (default: all arguments but ``ignore``),
                or a function of the arguments that returns the key.
            ignore: fields left out of the key and the fingerprint.
            normalize: field → function applied before hashing (``onceonly.normalize_text``…).
            retry: persisted attempt limit and backoff; default ``Retry()``: 3 attempts.
            on_unknown: how an unknown outcome is settled: ``"review"`` (default), ``"probe"``,
                ``"resend"`` (the other side honours the key), ``"retry"`` (naturally idempotent).
            on_conflict: same key, other arguments: ``"raise"`` ``KeyConflict``, or ``"replay"``.
            probe: ``(args, key) -> result | onceonly.NOT_FOUND``: asks the other side.
            settle: seconds to wait after an unknown before probing.
            ttl: seconds a settled record is kept (``None``: forever).
            lease: seconds a claim holds; heartbeats extend it while the tool runs.
            wait: seconds a second caller waits for an in-flight outcome before ``InProgress``.
            timeout: seconds per attempt; past it the outcome is unknown, the call runs on and its
                late result still confirms the record.
            readonly: no side effect: skip the ledger, plain retry.
            reports_dispatch: the tool calls ``onceonly.mark_sent()`` before its side effect, so a
                crash before that is retried without a probe.
            classify: ``exception -> Classification | None``, asked before the built-in rules.
            decode: applied to a replayed result (stored as JSON), e.g. ``Ticket.model_validate``.

        .. versionadded:: 0.1
        """
        if on_unknown not in get_args(OnUnknown):
            raise ValueError(f"on_unknown={on_unknown!r}: use one of {', '.join(map(repr, get_args(OnUnknown)))}")
        if on_conflict not in get_args(OnConflict):
            raise ValueError(f"on_conflict={on_conflict!r}: use one of {', '.join(map(repr, get_args(OnConflict)))}")
        if on_unknown == "probe" and probe is None:
            raise ValueError("on_unknown='probe' needs probe=(args, key) -> result | onceonly.NOT_FOUND")
        if retry is not None and not isinstance(retry, Retry):
            raise TypeError(f"retry={retry!r}: give an onceonly.Retry, such as Retry(attempts=3)")
        check_seconds(lease, f"lease={lease!r}", above_zero=True)
        check_seconds(wait, f"wait={wait!r}")
        check_seconds(settle, f"settle={settle!r}")
        if timeout is not None:
            check_seconds(timeout, f"timeout={timeout!r}", above_zero=True, none="no time limit")
        if ttl is not None:
            # ttl=0 would forget each result as it is recorded: every call would run again.
            check_seconds(ttl, f"ttl={ttl!r}", above_zero=True, none="keep settled records forever")

        def wrap(f: Callable[..., Any]) -> Any:
            policy = Policy(
                retry=retry or Retry(),
                on_unknown=on_unknown,
                on_conflict=on_conflict,
                has_probe=probe is not None,
                settle=settle,
                ttl=ttl,
                lease=lease,
                wait=wait,
                reports_dispatch=reports_dispatch,
                classify=classify,
            )
            cls = AsyncTool if inspect.iscoroutinefunction(f) else Tool
            if probe is not None and cls is Tool and inspect.iscoroutinefunction(probe):
                raise TypeError(f"{f.__qualname__} is sync, so its probe must be sync too")
            made: _BaseTool[Any, Any] = cls(
                self, f, name=name or f"{f.__module__}.{f.__qualname__}", key=key, ignore=ignore,
                normalize=normalize, policy=policy, probe=probe, timeout=timeout, readonly=readonly, decode=decode,
            )  # fmt: skip
            self.tools[made.name] = made
            return made

        return wrap(fn) if fn is not None else wrap

    @contextlib.contextmanager
    def task(self, name: str) -> Iterator[str]:
        """Scope every key inside to one task or session.

        Re-running the same task after a crash replays its finished steps and continues at the first
        unfinished one. Works across threads and asyncio tasks (a ``contextvars`` variable).

        .. versionadded:: 0.1
        """
        token = _SCOPE.set(validate_name(name, "task name"))
        try:
            yield name
        finally:
            _SCOPE.reset(token)

    # --- the drivers: the only I/O loops ------------------------------------------------------------

    def _drive(
        self,
        gen: Generator[Action, Any, T],
        tool: _BaseTool[Any, Any],
        call: Call,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> T:
        send: Any = None
        error: BaseException | None = None
        lost: Record | None = None  # a write whose answer the store lost
        store = self.store
        while True:
            try:
                action = gen.throw(error) if error is not None else gen.send(send)
            except StopIteration as stop:
                done: T = stop.value
                return done
            error = None
            kind = type(action)
            try:
                if kind is Claim:
                    send = store.claim(action.record)  # type: ignore[union-attr]
                    if send is None and self._observed():
                        emit(action.record, self._listeners)  # type: ignore[union-attr]
                elif kind is Get:
                    send = store.get(action.key)  # type: ignore[union-attr]
                    if lost is not None:
                        self._emit_if_landed(lost, send)
                        lost = None
                elif kind is Swap or kind is Insert:
                    rec = action.record  # type: ignore[union-attr]
                    ok = store.swap(rec, action.expected) if kind is Swap else store.insert(rec)  # type: ignore[union-attr]
                    if ok and self._observed():
                        emit(rec, self._listeners)
                    send = ok
                elif kind is Execute:
                    send = self._execute(cast(Tool[Any, Any], tool), call, action.record, args, kwargs)  # type: ignore[union-attr]
                elif kind is Probe:
                    send = self._probe(tool, action.record)  # type: ignore[union-attr]
                elif kind is Sleep:
                    self.sleep(action.seconds)  # type: ignore[union-attr]
                    send = None
                else:
                    assert isinstance(action, WaitChange)
                    store.wait_for_change(action.key, action.version, action.seconds)
                    send = None
            except StoreError as exc:
                error = exc
                if kind is Claim or kind is Insert or kind is Swap:
                    # The plan re-reads next (it never guesses); if this write landed, it is announced then.
                    lost = action.record  # type: ignore[union-attr]

    async def _adrive(
        self,
        gen: Generator[Action, Any, T],
        tool: _BaseTool[Any, Any],
        call: Call,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> T:
        send: Any = None
        error: BaseException | None = None
        lost: Record | None = None  # a write whose answer the store lost
        store: Any = self.store
        while True:
            try:
                action = gen.throw(error) if error is not None else gen.send(send)
            except StopIteration as stop:
                done: T = stop.value
                return done
            error = None
            kind = type(action)
            try:
                if kind is Claim:
                    send = await store.aclaim(action.record)  # type: ignore[union-attr]
                    if send is None and self._observed():
                        emit(action.record, self._listeners)  # type: ignore[union-attr]
                elif kind is Get:
                    send = await store.aget(action.key)  # type: ignore[union-attr]
                    if lost is not None:
                        self._emit_if_landed(lost, send)
                        lost = None
                elif kind is Swap or kind is Insert:
                    rec = action.record  # type: ignore[union-attr]
                    ok = await (store.aswap(rec, action.expected) if kind is Swap else store.ainsert(rec))  # type: ignore[union-attr]
                    if ok and self._observed():
                        emit(rec, self._listeners)
                    send = ok
                elif kind is Execute:
                    send = await self._aexecute(cast(AsyncTool[Any, Any], tool), call, action.record, args, kwargs)  # type: ignore[union-attr]
                elif kind is Probe:
                    send = await self._aprobe(tool, action.record)  # type: ignore[union-attr]
                elif kind is Sleep:
                    await self.asleep(action.seconds)  # type: ignore[union-attr]
                    send = None
                else:
                    assert isinstance(action, WaitChange)
                    await store.await_for_change(action.key, action.version, action.seconds)
                    send = None
            except StoreError as exc:
                error = exc
                if kind is Claim or kind is Insert or kind is Swap:
                    # The plan re-reads next (it never guesses); if this write landed, it is announced then.
                    lost = action.record  # type: ignore[union-attr]

    def _emit_if_landed(self, written: Record, now_stored: Record | None) -> None:
        """At the plan's re-read after a write whose answer was lost: announce the write if it landed,
        as every transition this process writes is (``subscribe``)."""
        if landed(written, now_stored) and self._observed():
            emit(written, self._listeners)

    # --- running a tool ------------------------------------------------------------------------------

    def _execute(
        self, tool: Tool[Any, Any], call: Call, rec: Record, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Executed:
        lease = self._beats.hold(rec, call.policy.lease, self)
        kw = tool._tool_kwargs(call, kwargs) if tool.takes_key else kwargs
        if tool.timeout is None:
            token = _CURRENT.set(lease)
            try:
                value = tool.fn(*args, **kw)
            except Exception as exc:
                return Executed(error=exc, record=self._beats.release(lease))
            except BaseException:
                # KeyboardInterrupt, SystemExit: stop beating; the lease runs out and the record
                # becomes unknown, to be settled by the next caller or the reconciler.
                self._beats.release(lease)
                raise
            finally:
                _CURRENT.reset(token)
            return Executed(value, None, False, self._beats.release(lease))

        # With a timeout the tool runs in a worker thread, so that the caller can stop waiting while
        # the call itself runs on: its late outcome must still reach the ledger.
        box: dict[str, Any] = {}
        guard = threading.Lock()
        finished = threading.Event()
        context = contextvars.copy_context()

        def run() -> None:
            context.run(_CURRENT.set, lease)
            try:
                box["value"] = context.run(tool.fn, *args, **kw)
            except BaseException as exc:
                box["error"] = exc
            with guard:
                box["finished"] = True
                late = box.get("timed_out", False)
            finished.set()
            if late:
                self._settle_late(call, rec.fence, box.get("value"), box.get("error"))

        threading.Thread(target=run, name=f"onceonly-{tool.name}"[:60], daemon=True).start()
        finished.wait(tool.timeout)
        with guard:
            timed_out = not box.get("finished", False)
            box["timed_out"] = timed_out
        latest = self._beats.release(lease)
        if timed_out:
            return Executed(timed_out=True, record=latest)
        err = box.get("error")
        if err is not None and not isinstance(err, Exception):
            raise err
        return Executed(value=box.get("value"), error=err, record=latest)

    async def _aexecute(
        self, tool: AsyncTool[Any, Any], call: Call, rec: Record, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Executed:
        lease = self._beats.hold(rec, call.policy.lease, self)
        token = _CURRENT.set(lease)
        try:
            # The task copies the context now, with the current call set in it.
            task = asyncio.ensure_future(tool.fn(*args, **tool._tool_kwargs(call, kwargs)))
        finally:
            _CURRENT.reset(token)
        try:
            done, _ = await asyncio.wait({task}, timeout=tool.timeout)
        except asyncio.CancelledError:
            # Our caller was cancelled, not the tool: it runs on and its outcome settles the record.
            self._beats.release(lease)
            self._settle_late_async(task, call, rec.fence)
            raise
        latest = self._beats.release(lease)
        if not done:
            self._settle_late_async(task, call, rec.fence)
            return Executed(timed_out=True, record=latest)
        if task.cancelled():
            return Executed(error=asyncio.CancelledError("the tool's task was cancelled"), record=latest)
        err = task.exception()
        if err is not None and not isinstance(err, Exception):
            raise err
        return Executed(value=None if err else task.result(), error=err, record=latest)

    def _settle_late(self, call: Call, fence: int, value: Any, error: BaseException | None) -> None:
        try:
            self._drive(late_outcome(call, fence, value, error), cast(Any, None), call, (), {})
        except Exception:
            _log_late_failure(call, fence)

    def _settle_late_async(self, task: asyncio.Future[Any], call: Call, fence: int) -> None:
        def done(t: asyncio.Future[Any]) -> None:
            if t.cancelled():
                return  # nothing known: the record stays unknown for the probe or a person
            err = t.exception()
            late = asyncio.ensure_future(
                self._adrive(late_outcome(call, fence, None if err else t.result(), err), cast(Any, None), call, (), {})
            )
            self._late_tasks.add(late)
            late.add_done_callback(self._late_done(call, fence))

        task.add_done_callback(done)

    def _late_done(self, call: Call, fence: int) -> Callable[[asyncio.Future[Any]], None]:
        """When an async late outcome is recorded: forget its task; a failure is logged as the sync one's."""

        def done(late: asyncio.Future[Any]) -> None:
            self._late_tasks.discard(late)
            if not late.cancelled() and late.exception() is not None:
                _log_late_failure(call, fence, late.exception())

        return done

    def _mark_sent(self, lease: _Lease) -> None:
        with lease.lock:
            rec = lease.record
            if rec.state is not State.PENDING:
                return
            new = st.transition(
                rec, State.IN_FLIGHT, now=self.clock(), reason="dispatched", by=rec.lease_owner,
                lease_until=self.clock() + lease.seconds,
            )  # fmt: skip
            try:
                ok, cur = swap_now(self.store, new, rec)
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
            lease.beat_at = self.clock()
        emit(new, self._listeners)

    def _probe(self, tool: _BaseTool[Any, Any], rec: Record) -> Probed:
        assert tool.probe is not None
        try:
            value = tool.probe(rec.args, rec.key)
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
                    f"the probe of {tool.name!r} returned an awaitable, and the tool is sync: make the probe "
                    "a plain function, or the tool async"
                )
            )
        return Probed(value=value)

    async def _aprobe(self, tool: _BaseTool[Any, Any], rec: Record) -> Probed:
        assert tool.probe is not None
        try:
            value = tool.probe(rec.args, rec.key)
            if inspect.isawaitable(value):
                value = await value
            return Probed(value=value)
        except Exception as exc:
            return Probed(error=exc)

    # --- the operations API (CLI, dashboard) -----------------------------------------------------

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(event)`` after every transition this process writes.

        .. versionadded:: 0.1
        """
        self._listeners.append(listener)

    def get(self, key: str) -> Record | None:
        """The record of ``key``, or ``None``.

        .. versionadded:: 0.1
        """
        return self.store.get(validate_name(key, "key"))

    def list(
        self,
        *,
        state: State | str | Sequence[State | str] | None = None,
        tool: str | None = None,
        scope: str | None = None,
        after: str | None = None,
        limit: int = 100,
    ) -> list[Record]:
        """Records, in key order, filtered by state(s), tool and scope; page with ``after=`` the last key.

        .. versionadded:: 0.1
        """
        if type(limit) is not int or not 1 <= limit <= _MAX_LIST:
            raise ValueError(f"limit={limit!r}: give an int from 1 to {_MAX_LIST:,}, and page with after=")
        states: list[State] | None = None
        if state is not None:
            raw = [state] if isinstance(state, State | str) else list(state)
            states = [s if isinstance(s, State) else _parse_state(s) for s in raw]
        return self.store.scan(Query(states=states, tool=tool, scope=scope, after=after, limit=limit))

    def stats(self) -> dict[str, int]:
        """How many records are in each state.

        .. versionadded:: 0.1
        """
        counts = self.store.count_by_state()
        return {s.value: counts.get(s, 0) for s in State}

    def resolve(
        self,
        key: str,
        *,
        confirmed: Any = _MISSING,
        failed: str | None = None,
        reset: bool = False,
        by: str | None = None,
        why: str | None = None,
    ) -> Record:
        """Settle a record by hand: it happened (``confirmed=result``) or it did not (``failed=reason``).

        ``reset=True`` with ``failed`` also sets the attempts back to 0, so the operation may run again.
        Who (``by``) and why are kept in the record's history.

        Raises:
            KeyError: no such record.
            InProgress: a caller holds a live lease on it.
            OnceOnlyError: the record is already confirmed, or neither outcome was given.

        .. versionadded:: 0.1
        """
        if (confirmed is _MISSING) == (failed is None):
            raise OnceOnlyError("resolve needs exactly one of confirmed=RESULT or failed=REASON")
        who = by or os.environ.get("USER") or "unknown"
        while True:
            rec = self.get(key)
            if rec is None:
                raise KeyError(f"no record with key {key!r}: check it with `onceonly ls`")
            now = self.clock()
            if rec.state in HELD and not rec.lease_expired(now):
                raise InProgress(
                    f"{key!r} is running now (lease held by {rec.lease_owner}); resolve it after", key=key, record=rec
                )
            if rec.state is State.CONFIRMED:
                raise OnceOnlyError(f"{key!r} is already confirmed (via {rec.via}); nothing to resolve")
            reason = f"resolved by {who}" + (f": {why}" if why else "")
            known = self.tools.get(rec.tool)
            ttl = known.policy.ttl if known is not None else DEFAULT_TTL
            released = {"lease_owner": None, "lease_until": None, "next_attempt_at": None}
            if confirmed is not _MISSING:
                new = st.transition(
                    rec, State.CONFIRMED, now=now, reason=reason, by=who, result_json=encode_result(confirmed, key),
                    via="resolve", error=None, expires_at=None if ttl is None else now + ttl, **released,
                )  # fmt: skip
            else:
                new = st.transition(
                    rec, State.FAILED, now=now, reason=reason, by=who, error=str(failed), via="resolve",
                    attempts=0 if reset else rec.attempts, expires_at=None if ttl is None else now + ttl, **released,
                )  # fmt: skip
            if self.store.swap(new, rec):
                emit(new, self._listeners)
                return new

    def purge(self, *, before: float | None = None, batch: int = 500) -> int:
        """Delete settled records whose ``expires_at`` passed. Unknown and in-review ones never expire.

        .. versionadded:: 0.1
        """
        cutoff = self.clock() if before is None else before
        removed = 0
        after: str | None = None
        while True:
            page = self.store.scan(
                Query(
                    states=sorted(st.SETTLED, key=list(State).index),
                    expires_before=cutoff,
                    after=after,
                    limit=batch,
                )
            )
            for rec in page:
                if self.store.delete(rec.key, rec.version):
                    removed += 1
            if len(page) < batch:
                return removed
            after = page[-1].key

    def reconcile(self, **kwargs: Any) -> ReconcileReport:
        """Settle what guarded calls left unsettled, once: ``onceonly.settle.reconcile(self, ...)``.

        Unknown records and records whose holder died are settled through their tools' probes (or
        re-sent, for ``resend``/``retry`` tools), or parked for review after ``review_after`` seconds.
        Safe to run in several processes at once. Keyword arguments: see ``onceonly.settle.reconcile``.

        .. versionadded:: 0.1
        """
        # The reconciler sits a layer above the ledger (it drives tools through it); importing it
        # here, lazily, keeps the module graph pointing down while giving the API its method.
        from onceonly.settle import reconcile

        return reconcile(self, **kwargs)

    def close(self) -> None:
        """Stop the heartbeat thread and close the store.

        .. versionadded:: 0.1
        """
        self._beats.close()
        self.store.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({self.url!r}, scope={self.scope!r})"


def _parse_state(value: str) -> State:
    try:
        return State(value)
    except ValueError:
        raise ValueError(f"unknown state {value!r}: use one of {[s.value for s in State]}") from None


__all__ += ["NOT_FOUND"]
