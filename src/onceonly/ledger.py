"""The ledger: ``Ledger.open``, the ``@ledger.tool`` decorator, tasks, and the operations API.

The decisions are in ``onceonly.plan``; ``drivers.py`` does their I/O; ``tools.py`` makes the guarded
functions. This module is the facade over them.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import inspect
import logging
import os
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar, get_args, overload
from urllib.parse import urlsplit

from onceonly import states as st
from onceonly.budgets import Budget
from onceonly.budgets import free as free_budget
from onceonly.clock import StoreClock
from onceonly.dryrun import DryRunLog, DryRuns
from onceonly.edge import entered_task, scope_here
from onceonly.errors import InProgress, OnceOnlyError, StoreCorrupt
from onceonly.events import Listener
from onceonly.keys import Normalizer, canonical_json, validate_name
from onceonly.pause import Pause, check_target, default_by
from onceonly.plan import NOT_FOUND
from onceonly.policy import DEFAULT_TTL, Classifier, OnConflict, OnUnknown, Policy, Retry, check_seconds
from onceonly.runtime import CallInfo, Runtime, amark_sent, current_call, mark_sent
from onceonly.settle import ReconcileReport, reconcile
from onceonly.similar import OnSimilar, Similar
from onceonly.states import HELD, Record, State
from onceonly.stores import open_store, redact_url
from onceonly.stores.base import ClockedStore, Query, SimilarStore, Store
from onceonly.tools import (
    EFFECTS,
    Approve,
    AsyncTool,
    Effect,
    Tool,
    ToolSpec,
    default_name,
    make_tool,
    refuse_framework_object,
    same_definition,
)

__all__ = ["AsyncTool", "CallInfo", "Ledger", "Tool", "amark_sent", "current_call", "mark_sent"]

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_URL = "sqlite:///.onceonly/ledger.db"
_log = logging.getLogger("onceonly")
_MISSING: Any = object()

#: The most records one ``Ledger.list`` returns (a page; ``after=`` gives the next).
_MAX_LIST = 1_000_000_000


# --- the ledger -----------------------------------------------------------------------------------


class Ledger:
    """A durable ledger of tool calls, over one store.

    Args:
        store: a store (``SQLiteStore``, ``RedisStore``, ``PostgresStore``, or your own ``Store``).
        scope: the scope of keys outside any ``ledger.task()``.
        clock: this host's clock, seconds since the epoch (injectable for tests).
        store_clock: read leases, due times and settle times on the store's clock where the store has
            one (Redis, PostgreSQL; ``onceonly.clock``), as ``clock`` plus an offset measured at open,
            every minute and at once when ``clock`` steps, so that hosts whose clocks differ agree.
            Default: on for the host's clock (``time.time``), off for an injected ``clock`` (a test's
            fake time is used as it is); pass ``True`` to correct an injected clock too (on SQLite, to
            this host's clock). ``ledger.clock`` is the clock the ledger reads.
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
        store_clock: bool | None = None,
    ) -> None:
        #: The store's URL as it may be shown, password masked (``store.url`` is the one to connect with).
        self.url: str = redact_url(getattr(store, "url", repr(store)))
        self.scope = validate_name(scope, "scope")
        store_time = store.time if isinstance(store, ClockedStore) else None
        use_store = (clock is time.time) if store_clock is None else store_clock
        if store_time is None and store_clock and clock is not time.time:
            # A store with no clock of its own (SQLite) is on one host: this host's clock is its clock.
            store_time = time.time
        measured = StoreClock(store_time, clock, where=self.url) if use_store and store_time else None
        #: What every guarded call on this ledger shares: the store, the clocks, listeners, leases.
        self.runtime = Runtime(
            store,
            clock=clock if measured is None else measured.now,
            sleep=sleep,
            asleep=asleep,
            rng=rng or random.Random(),
            store_clock=measured,
        )
        #: The guarded tools made on this ledger, by name (the reconciler finds their probes here).
        self.tools: dict[str, Any] = {}
        self._dry_lock = threading.Lock()

    @property
    def store(self) -> Store:
        """The store this ledger writes through.

        .. versionadded:: 0.1
        """
        return self.runtime.store

    @property
    def clock(self) -> Callable[[], float]:
        """The clock the ledger reads: the store's where it has one (``store_clock``), else ``clock``.

        .. versionadded:: 0.1
        """
        return self.runtime.clock

    @property
    def sleep(self) -> Callable[[float], None]:
        """The blocking sleep of backoffs and waits.

        .. versionadded:: 0.1
        """
        return self.runtime.sleep

    @property
    def asleep(self) -> Callable[[float], Awaitable[None]]:
        """The async sleep of backoffs and waits.

        .. versionadded:: 0.1
        """
        return self.runtime.asleep

    @property
    def rng(self) -> random.Random:
        """The random source of backoff jitter.

        .. versionadded:: 0.1
        """
        return self.runtime.rng

    @property
    def clock_offset(self) -> float:
        """Seconds added to this host's clock to read the store's (0 without a store clock).

        .. versionadded:: 0.1
        """
        measured = self.runtime.store_clock
        return 0.0 if measured is None else measured.offset

    @classmethod
    def open(cls, url: str | None = None, **kwargs: Any) -> Ledger:
        """Open the ledger at ``url``; default ``$ONCEONLY_URL``, else ``sqlite:///.onceonly/ledger.db``.

        Args:
            url: ``sqlite:///relative.db``, ``sqlite:////abs/path.db``, ``redis://host:6379/0``,
                ``postgresql://host/db``.
            **kwargs: passed to ``Ledger`` (``scope``, ``clock``…).

        .. versionadded:: 0.1
        """
        env = os.environ.get("ONCEONLY_URL")
        source = "the url given" if url else "$ONCEONLY_URL" if env else "the default URL; set $ONCEONLY_URL to choose"
        url = url or env or DEFAULT_URL
        ledger = cls(open_store(url), **kwargs)
        if os.environ.get("ONCEONLY_DRY_RUN", "").strip().lower() in ("1", "true", "yes", "on"):
            ledger.runtime.dry = DryRuns(always=DryRunLog())
            _log.warning("onceonly: ONCEONLY_DRY_RUN is set: guarded calls on %s run nothing", _where_url(url))
        # A relative SQLite path depends on the working directory: say which file this is, so that an
        # agent started from another folder does not silently get an empty ledger.
        _log.info("onceonly: ledger at %s (%s)", _where_url(url), source)
        return ledger

    def current_scope(self) -> str:
        """The scope of keys here: the innermost ``task()``, else the ledger's; inside a durable engine's
        unit (``onceonly.dbos.install``), the unit's unless a task was entered inside it
        (``edge.scope_here``).

        .. versionadded:: 0.1
        """
        return scope_here(self.scope)

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
        on_unknown: OnUnknown | None = None,
        on_conflict: OnConflict = "raise",
        probe: Callable[[dict[str, Any], str], Any] | None = None,
        settle: float = 0.0,
        ttl: float | None = DEFAULT_TTL,
        lease: float = 30.0,
        wait: float = 10.0,
        timeout: float | None = None,
        readonly: bool = False,
        effect: Effect | None = None,
        reports_dispatch: bool = False,
        classify: Classifier | None = None,
        decode: Callable[[Any], Any] | None = None,
        passthrough: Sequence[type[BaseException]] = (),
        similar: Similar | None = None,
        on_similar: OnSimilar = "replay",
        tell_model: bool = False,
        approve: Approve = False,
        budget: Budget | None = None,
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
        on_unknown: OnUnknown | None = None,
        on_conflict: OnConflict = "raise",
        probe: Callable[[dict[str, Any], str], Any] | None = None,
        settle: float = 0.0,
        ttl: float | None = DEFAULT_TTL,
        lease: float = 30.0,
        wait: float = 10.0,
        timeout: float | None = None,
        readonly: bool = False,
        effect: Effect | None = None,
        reports_dispatch: bool = False,
        classify: Classifier | None = None,
        decode: Callable[[Any], Any] | None = None,
        passthrough: Sequence[type[BaseException]] = (),
        similar: Similar | None = None,
        on_similar: OnSimilar = "replay",
        tell_model: bool = False,
        approve: Approve = False,
        budget: Budget | None = None,
    ) -> Any:
        """Guard a function with side effects so that each logical call happens once (every option, its
        default and what it means for the guarantee: docs/reference.md, "@ledger.tool").

        Args:
            name: the tool's name in keys; default the function's ``__qualname__``. One name, one function.
            key: the fields that identify the operation (default: all but ``ignore``), or a function of them.
            ignore: fields left out of the key and the fingerprint.
            normalize: field → function applied before hashing (``onceonly.normalize_text``…).
            retry: the persisted attempt limit and backoff; default ``Retry()`` (3 attempts, 1 s, cap 30 s).
            on_unknown: how an unknown outcome is settled: ``"review"`` (a write's default), ``"probe"``,
                ``"resend"`` or ``"retry"`` (an idempotent tool's default: run again with the same key).
            on_conflict: same key, other arguments: ``"raise"`` ``KeyConflict``, or ``"replay"``.
            probe: ``(args, key) -> result | onceonly.NOT_FOUND``: asks the other side.
            settle: seconds to wait after an unknown before probing or re-sending; default 0.
            ttl: seconds a settled record is kept and replayed (default a day; ``None``: forever).
            lease: seconds a claim holds; heartbeats extend it while the tool runs.
            wait: the most seconds any one wait of a call lasts (then ``InProgress``, ``RetryScheduled``
                or ``OutcomeUnknown``, saying when).
            timeout: seconds per attempt; past it the outcome is unknown, and a late result still confirms.
            readonly: the same as ``effect="read"``.
            effect: ``"write"`` (default), ``"idempotent"`` or ``"read"`` (no record): docs/guardrails.md.
            reports_dispatch: the tool calls ``onceonly.mark_sent()`` before its side effect.
            classify: ``exception -> Classification | None``, asked before the built-in rules.
            decode: applied to a replayed result (stored as JSON), e.g. ``Ticket.model_validate``.
            passthrough: exception types that are control flow, not outcomes (LangGraph's always are).
            similar: an ``onceonly.Similar``: near-duplicates are taken for the earlier call (docs/similar.md).
            on_similar: ``"replay"`` (default), ``"review"`` or ``"raise"`` (``SimilarCall``).
            tell_model: the plain call returns the model's text (``onceonly.tell_model``) for every outcome
                but a fresh result, instead of raising; ``.outcome()`` still raises.
            approve: ``True`` or ``(args) -> bool``: a person approves the operation before it runs.
            budget: an ``onceonly.Budget``: a call over its window's limit is refused before it runs.

        Returns:
            The guarded function (``async`` for a coroutine function), with ``.outcome()``, ``.using()``…

        .. versionadded:: 0.1
        """
        effect = _check_effect(effect, readonly=readonly, on_unknown=on_unknown, probe=probe, similar=similar)
        _check_approve(approve, effect)
        readonly = effect == "read"
        on_unknown = on_unknown or ("retry" if effect == "idempotent" else "review")
        _check_settings(
            self.store, on_unknown=on_unknown, on_conflict=on_conflict, on_similar=on_similar, similar=similar,
            readonly=readonly, probe=probe, retry=retry, lease=lease, wait=wait, settle=settle, timeout=timeout,
            ttl=ttl, passthrough=passthrough,
        )  # fmt: skip
        policy = Policy(
            retry=retry or Retry(), on_unknown=on_unknown, on_conflict=on_conflict, has_probe=probe is not None,
            settle=settle, ttl=ttl, lease=lease, wait=wait, reports_dispatch=reports_dispatch, classify=classify,
        )  # fmt: skip
        options: dict[str, Any] = {
            "key": key, "ignore": ignore, "normalize": normalize, "policy": policy, "probe": probe,
            "timeout": timeout, "readonly": readonly, "effect": effect, "decode": decode,
            "passthrough": tuple(passthrough), "similar": similar, "on_similar": on_similar,
            "tell_model": tell_model, "approve": approve, "budget": budget,
        }  # fmt: skip
        if fn is not None:
            return self._decorate(fn, name, options)
        return lambda f: self._decorate(f, name, options)

    def _decorate(self, f: Callable[..., Any], name: str | None, options: dict[str, Any]) -> Any:
        """The guarded tool of ``f`` under ``name``, with ``tool()``'s checked ``options``."""
        refuse_framework_object(f)
        if not callable(f):
            raise TypeError(f"@ledger.tool decorates a function, and got {type(f).__name__}: {f!r}")
        probe = options["probe"]
        if probe is not None and not inspect.iscoroutinefunction(f) and inspect.iscoroutinefunction(probe):
            raise TypeError(f"{default_name(f)} is sync, so its probe must be sync too")
        # name="" is refused as an empty name (ToolSpec), not taken as "no name given".
        spec = ToolSpec(self, f, name=default_name(f) if name is None else name, **options)
        self._register(spec)
        made = make_tool(spec)
        self.tools[spec.name] = made
        return made

    def _register(self, spec: ToolSpec) -> None:
        """Refuse a second function under a name this ledger has: the two would share records, and one
        would replay the other's results. The same definition again (re-decorated) is fine."""
        known = self.tools.get(spec.name)
        if known is None or same_definition(known.spec.fn, spec.fn):
            return
        where = _where(known.spec.fn)
        raise ValueError(
            f"another tool named {spec.name!r} is guarded on this ledger already ({where}): the two would share "
            "records and replay each other's results; pass name='...' to give this one its own (or guard it "
            "once and reuse it)"
        )

    @contextlib.contextmanager
    def task(self, name: str) -> Iterator[str]:
        """Scope every key inside to one task or session.

        Re-running the same task after a crash replays its finished steps and continues at the first
        unfinished one. Works across threads and asyncio tasks (a ``contextvars`` variable). Inside a
        DBOS workflow (``onceonly.dbos.install``) only a task entered inside the workflow applies: one
        entered outside it is not there when DBOS recovers the workflow (docs/integrations.md).

        .. versionadded:: 0.1
        """
        with entered_task(name):
            yield name

    @contextlib.contextmanager
    def dry_run(self) -> Iterator[DryRunLog]:
        """Inside, guarded calls of this ledger run nothing and write no record: each reads its record
        once (``store.get``, never a claim) and returns a ``DryRun`` saying what it would have done,
        also listed in the ``DryRunLog`` this yields. Read tools (``effect="read"``) run as usual. Only
        this context (thread, asyncio task) is in the dry run; other callers of the ledger run as usual.

        ``ONCEONLY_DRY_RUN=1`` at ``Ledger.open`` puts the whole ledger in one; ``dry_run()`` then lists
        its block's calls apart.

        .. versionadded:: 0.1
        """
        rt = self.runtime
        log = DryRunLog()
        with self._dry_lock:
            dry = rt.dry or DryRuns()
            rt.dry = dry
            dry.entered += 1
        token = dry.here.set(log)
        try:
            yield log
        finally:
            dry.here.reset(token)
            with self._dry_lock:
                dry.entered -= 1
                if dry.entered == 0 and dry.always is None:
                    rt.dry = None  # back to the plain call's one attribute read

    # --- the operations API (CLI, dashboard) -----------------------------------------------------

    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(event)`` after every transition this process writes.

        .. versionadded:: 0.1
        """
        self.runtime.listeners.append(listener)

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
        version: int | None = None,
    ) -> Record:
        """Settle a record by hand: it happened (``confirmed=result``) or it did not (``failed=reason``).

        ``reset=True`` with ``failed`` also sets the attempts back to 0, so the operation may run again.
        Who (``by``) and why are kept in the record's history. ``version``: settle it only if it is still
        at this version (the one the person looked at): a reconciler or a colleague may have settled it
        meanwhile.

        Raises:
            KeyError: no such record.
            InProgress: a caller holds a live lease on it.
            OnceOnlyError: the record is already confirmed, is no longer at ``version``, or neither
                outcome was given.
            NotSerializable: ``confirmed`` has no strict JSON form (NaN, a set…): nothing is written.

        .. versionadded:: 0.1
        """
        if (confirmed is _MISSING) == (failed is None):
            raise OnceOnlyError("resolve needs exactly one of confirmed=RESULT or failed=REASON")
        # A person states the result: it must be storable as it is (no NaN, no set), not a description.
        result_json = None if confirmed is _MISSING else canonical_json(confirmed, path="confirmed")
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
            if version is not None and rec.version != version:
                raise OnceOnlyError(
                    f"{key!r} changed since it was read (version {version}, now {rec.version}, {rec.state.value}):"
                    " look at it again with `onceonly show`"
                )
            reason = f"resolved by {who}" + (f": {why}" if why else "")
            known = self.tools.get(rec.tool)
            ttl = known.spec.policy.ttl if known is not None else DEFAULT_TTL
            released = {"lease_owner": None, "lease_until": None, "next_attempt_at": None}
            if confirmed is not _MISSING:
                new = st.transition(
                    rec, State.CONFIRMED, now=now, reason=reason, by=who, result_json=result_json,
                    via="resolve", error=None, expires_at=None if ttl is None else now + ttl, **released,
                )  # fmt: skip
            else:
                new = st.transition(
                    rec, State.FAILED, now=now, reason=reason, by=who, error=str(failed), via="resolve",
                    attempts=0 if reset else rec.attempts, expires_at=None if ttl is None else now + ttl, **released,
                )  # fmt: skip
            if self.store.swap(new, rec):
                self.runtime.announce(new)
                if failed is not None:
                    free_budget(self.store, key)  # it did not happen: its budget amount is freed
                return new

    def approve(self, key: str, *, by: str, reason: str | None = None, fingerprint: str | None = None) -> Record:
        """A person approves the operation ``key`` awaits approval for (``@ledger.tool(approve=...)``): the
        next call of it runs it, exactly once however many callers race; later calls replay its result.
        Who (``by``) and why (``reason``) are kept in the record's history (``approved_by``).

        ``fingerprint``: approve only if the record still holds these arguments (the ones the person
        looked at: ``Record.fingerprint``).

        Raises:
            KeyError: no such record.
            OnceOnlyError: the record does not await approval (already approved, denied, run…), or it
                holds other arguments than ``fingerprint``; nothing is changed.

        .. versionadded:: 0.1
        """
        return self._decide(key, st.approve, by=by, reason=reason, fingerprint=fingerprint)

    def deny(self, key: str, *, by: str, reason: str | None = None, fingerprint: str | None = None) -> Record:
        """A person denies the operation ``key`` awaits approval for: it does not run, and every later call
        of it (with these arguments) raises ``ApprovalDenied``, which a model is told about. Who and why
        are kept in the record's history (``denied_by``). Arguments and errors as for ``approve``.

        .. versionadded:: 0.1
        """
        return self._decide(key, st.deny, by=by, reason=reason, fingerprint=fingerprint)

    def _decide(
        self, key: str, step: Callable[..., Record], *, by: str, reason: str | None, fingerprint: str | None
    ) -> Record:
        while True:
            rec = self.get(key)
            if rec is None:
                raise KeyError(f"no record with key {key!r}: check it with `onceonly ls --state awaiting_approval`")
            try:
                new = step(rec, now=self.clock(), by=by, reason=reason, fingerprint=fingerprint)
            except st.IllegalTransition as exc:
                raise OnceOnlyError(str(exc)) from None
            if self.store.swap(new, rec):
                self.runtime.announce(new)
                return new

    def purge(
        self, *, before: float | None = None, batch: int = 500, progress: Callable[[int], None] | None = None
    ) -> int:
        """Delete settled records whose ``expires_at`` passed. Unknown and in-review ones never expire.
        A record whose stored result, arguments or history do not decode is left, with a warning.

        The records are read a page of ``batch`` at a time and deleted one by one (each at the version
        read: one that changed meanwhile is kept); ``progress(n)`` is called after each deletion with
        the count so far, so that a caller interrupted (Ctrl-C) knows how many are gone.

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
                try:
                    rec.to_dict()  # a record damaged under the ledger is kept for a person, not purged
                except StoreCorrupt as exc:
                    _log.warning("onceonly purge: left %s in place: %s", rec.key, exc)
                    continue
                if self.store.delete(rec.key, rec.version, rec.created_at):
                    removed += 1
                    if progress is not None:
                        progress(removed)
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
        return reconcile(self, **kwargs)

    # --- the kill switch (onceonly.pause) ---------------------------------------------------------

    def pause(self, *, tool: str | None = None, scope: str | None = None, reason: str, by: str | None = None) -> Pause:
        """Refuse new guarded calls of ``tool`` (default: every tool) in ``scope`` (default: every scope),
        on every process that shares the store, within half a second: each raises ``Paused`` before it
        claims (nothing runs, nothing is recorded). Calls already running finish as usual; read-only
        tools (``effect="read"``) are never paused. Setting it again replaces the reason.

        Args:
            reason: why, for the people who see it (``onceonly pauses``, the dashboard, the error's
                message); never shown to a model.
            by: who pauses (default: this host's user, ``user@host``).

        .. versionadded:: 0.1
        """
        check_target(tool, scope)
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError(
                "reason=: say why the calls are paused (it is shown with the pause, and when a call is refused)"
            )
        return self.runtime.pauses.set(Pause(tool, scope, reason.strip(), by or default_by(), self.clock()))

    def resume(self, *, tool: str | None = None, scope: str | None = None, every: bool = False) -> int:
        """Lift the pause of ``tool`` in ``scope`` (as they were given to ``pause``), or every pause
        (``every=True``); return how many were lifted (0: there was none such, see ``pauses()``).

        .. versionadded:: 0.1
        """
        check_target(tool, scope)
        return len(self.runtime.pauses.lift(tool, scope, every))

    def pauses(self) -> builtins.list[Pause]:  # `list` here is Ledger.list
        """The pauses in force now, read from the store, oldest first.

        .. versionadded:: 0.1
        """
        return self.runtime.pauses.read()

    def close(self) -> None:
        """Stop the heartbeat thread and close the store.

        .. versionadded:: 0.1
        """
        self.runtime.close()
        self.store.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({self.url!r}, scope={self.scope!r})"


def _check_effect(
    effect: object,
    *,
    readonly: bool,
    on_unknown: str | None,
    probe: Callable[..., Any] | None,
    similar: Similar | None,
) -> Effect:
    """The tool's effect class, from ``effect=`` and the older ``readonly=``; a contradiction is refused."""
    if effect is None:
        return "read" if readonly else "write"
    if effect not in EFFECTS:
        raise ValueError(f"effect={effect!r}: use one of {', '.join(map(repr, EFFECTS))}")
    if readonly and effect != "read":
        raise TypeError(
            f"readonly=True says the tool has no side effect, and effect={effect!r} says it has one: pass "
            f"effect={effect!r} alone, or effect='read' (readonly=True is the same as effect='read')"
        )
    if effect == "read":
        given = [name for name, value in (("on_unknown", on_unknown), ("probe", probe), ("similar", similar)) if value]
        if given:
            raise TypeError(
                f"effect='read' keeps no record, so {', '.join(f'{n}=' for n in given)} would never be used: "
                f"drop {' and '.join(given)}, or pass effect='write' (or 'idempotent') if the call has a side effect"
            )
    return effect  # type: ignore[return-value]  # checked against EFFECTS above


def _check_settings(
    store: Store,
    *,
    on_unknown: str,
    on_conflict: str,
    on_similar: str,
    similar: Similar | None,
    readonly: bool,
    probe: Callable[..., Any] | None,
    retry: Retry | None,
    lease: float,
    wait: float,
    settle: float,
    timeout: float | None,
    ttl: float | None,
    passthrough: Sequence[type[BaseException]],
) -> None:
    """``@ledger.tool``'s settings, refused with what to give instead before any tool is made."""
    if on_unknown not in get_args(OnUnknown):
        raise ValueError(f"on_unknown={on_unknown!r}: use one of {', '.join(map(repr, get_args(OnUnknown)))}")
    if on_conflict not in get_args(OnConflict):
        raise ValueError(f"on_conflict={on_conflict!r}: use one of {', '.join(map(repr, get_args(OnConflict)))}")
    if on_similar not in get_args(OnSimilar):
        raise ValueError(f"on_similar={on_similar!r}: use one of {', '.join(map(repr, get_args(OnSimilar)))}")
    if similar is not None and not isinstance(similar, Similar):
        raise TypeError(f"similar={similar!r}: give an onceonly.Similar, such as Similar(fields=('title',))")
    if similar is not None and not isinstance(store, SimilarStore):
        raise TypeError(
            f"similar= needs a store with the near-duplicate primitives (onceonly.stores.base.SimilarStore), "
            f"and {type(store).__name__} has none: use a SQLite, Redis or PostgreSQL ledger"
        )
    if similar is not None and readonly:
        raise ValueError("similar= guards calls with side effects, and readonly=True skips the ledger: drop one")
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
    passing = tuple(passthrough)
    if not all(isinstance(t, type) and issubclass(t, BaseException) for t in passing):
        raise TypeError(f"passthrough={passthrough!r}: give a tuple of exception types, such as (MyInterrupt,)")


def _check_approve(approve: object, effect: str) -> None:
    if not (isinstance(approve, bool) or callable(approve)):
        raise TypeError(
            f"approve={approve!r}: give True (every call needs a person's approval), False, or a function "
            "(args) -> bool that decides per call"
        )
    if approve is not False and effect == "read":
        raise ValueError(
            "approve= on a read tool (effect='read' or readonly=True): a read keeps no record, so there is "
            "nothing to approve; drop approve= or make it a write"
        )


def _where_url(url: str) -> str:
    """Where the ledger at ``url`` is, for a person: a SQLite file's absolute path, else the URL with
    its password masked."""
    if urlsplit(url).scheme.lower() == "sqlite":
        from onceonly.stores.sqlite import parse_sqlite_url

        return str(parse_sqlite_url(url)[0].resolve())
    return redact_url(url)


def _where(fn: Callable[..., Any]) -> str:
    """Where the function a tool guards was written, for a person; an integration's own body (it guards
    a framework's tool object) is named by the integration, since its source line is onceonly's."""
    code = getattr(fn, "__code__", None)
    qualname = getattr(fn, "__qualname__", type(fn).__qualname__)
    module = getattr(fn, "__module__", "?")
    if code is None:
        return f"{module}.{qualname}"
    if module.startswith("onceonly."):
        return f"a tool {module} made"
    return f"{qualname} at {code.co_filename}:{code.co_firstlineno}"


def _parse_state(value: str) -> State:
    try:
        return State(value)
    except ValueError:
        raise ValueError(f"unknown state {value!r}: use one of {[s.value for s in State]}") from None


__all__ += ["NOT_FOUND"]
