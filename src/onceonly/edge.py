"""The edge contract: how a call that enters from a framework or a protocol becomes a ledger call.

Every integration (LangChain, the OpenAI Agents SDK, MCP, and the guarded function's own
``tell_model=True``) goes through this module, so that four things are decided once:

- **who is calling** (``caller_scope``, ``run_scope``, ``client_scope``): the conversation id the framework
  gives; else the authenticated principal or the protocol session; else the run's own id, with one
  warning naming the setting that shares records across runs. Never a process-wide scope by silent
  fallback. A scope a client chooses is bound under its caller, so it never reaches another caller's
  records. Inside a durable engine's unit (a DBOS workflow: ``register_durable``, ``scope_here``) the
  unit's id, which the engine's recovery in another process brings back, unlike the caller's task;
- **the arguments in their real form**: ``onceonly.schema.coerce`` (validated and coerced by the tool's
  own JSON Schema before the fingerprint);
- **what a result means** (``error_result_verdict``): a tool that reported an error after it may have
  acted is an unknown outcome unless it is read-only; a protocol error before it ran is a failure;
- **what the model reads** (``Envelope``, ``envelope``): the state and ``tell_model``'s text, never
  ``str(exception)``; onceonly's own result marks (``OWN_META_PREFIX``) are set by onceonly alone
  (``strip_own_meta``).

Pure, framework-free and without I/O, apart from the one warning a run scope logs (and one for a task
entered outside a durable unit).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import threading
import types
import uuid
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from onceonly.errors import (
    ApprovalPending,
    AttemptsExhausted,
    InProgress,
    KeyConflict,
    OnceOnlyError,
    OutcomeUnknown,
    Refused,
    RetryScheduled,
    SimilarCall,
)
from onceonly.keys import safe_name, validate_name
from onceonly.plan import Outcome
from onceonly.policy import Verdict
from onceonly.runtime import current_call
from onceonly.tell import TOLD, tell_model

__all__ = [
    "KEY_PARAM",
    "OWN_META_PREFIX",
    "STATES",
    "DurableUnit",
    "Envelope",
    "EnvelopeState",
    "caller_scope",
    "client_scope",
    "durable_unit",
    "entered_task",
    "envelope",
    "error_result_verdict",
    "is_guarded",
    "key_filled",
    "register_durable",
    "run_identity",
    "run_scope",
    "scope_here",
    "strip_own_meta",
    "task_scope",
]

_log = logging.getLogger("onceonly")

#: The prefix of onceonly's own ``_meta`` keys on a result (``dev.onceonly/replayed``, ``dev.onceonly/key``).
OWN_META_PREFIX = "dev.onceonly/"

# The scope ``ledger.task()`` sets: here, below the ledger, so that the doors can tell "the caller chose a
# task" from "nothing was chosen" without reading the ledger's private state.
TASK_SCOPE: contextvars.ContextVar[str | None] = contextvars.ContextVar("onceonly_scope", default=None)

# Scopes longer than this (or not valid names) are hashed, so that scope:tool:digest fits the key limit.
MAX_SCOPE = 96


def task_scope() -> str | None:
    """The scope of the innermost ``ledger.task()`` around this call, or ``None`` outside any.

    .. versionadded:: 0.1
    """
    return TASK_SCOPE.get()


# --- durable engines ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DurableUnit:
    """The unit of a durable engine that is running this code (a DBOS workflow, or a step of one).

    Attributes:
        unit: the id of what the engine recovers and runs again in a new process (``dbos:<workflow id>``):
            a ``ledger.task()`` entered inside it is entered again on recovery, one entered outside is not.
        scope: the scope of guarded calls made here when no task entered inside the unit names one.

    .. versionadded:: 0.1
    """

    unit: str
    scope: str


# name -> a function of no arguments that returns the running unit of that engine, or None outside one.
# Registered by the engine's integration (onceonly.dbos.install); asked on every guarded call.
_durable: dict[str, Callable[[], DurableUnit | None]] = {}
_durable_lock = threading.Lock()

# The durable unit the innermost ``ledger.task()`` was entered in (None: outside any), set with TASK_SCOPE.
TASK_UNIT: contextvars.ContextVar[str | None] = contextvars.ContextVar("onceonly_task_unit", default=None)


def register_durable(engine: str, resolver: Callable[[], DurableUnit | None] | None) -> None:
    """Make guarded calls inside ``engine``'s durable units take their scope from ``resolver``
    (``None`` removes it). The resolver must be cheap and must not raise: it runs on every guarded call.

    .. versionadded:: 0.1
    """
    with _durable_lock:
        if resolver is None:
            _durable.pop(engine, None)
        else:
            _durable[engine] = resolver


def durable_unit() -> DurableUnit | None:
    """The durable unit running this code, by the first registered engine that names one, or ``None``.

    .. versionadded:: 0.1
    """
    for resolver in tuple(_durable.values()):
        found = resolver()
        if found is not None:
            return found
    return None


@contextlib.contextmanager
def entered_task(name: str) -> Iterator[str]:
    """Set the task scope (``ledger.task``), noting the durable unit it is entered in."""
    here = durable_unit()
    scope_token = TASK_SCOPE.set(validate_name(name, "task name"))
    unit_token = TASK_UNIT.set(None if here is None else here.unit)
    try:
        yield name
    finally:
        TASK_UNIT.reset(unit_token)
        TASK_SCOPE.reset(scope_token)


def scope_here(default: str) -> str:
    """The scope of a guarded call made here: outside a durable unit, the innermost ``ledger.task()``,
    else ``default`` (the ledger's). Inside one, a task entered inside the same unit (recovery enters it
    again), else the unit's own scope: a task entered outside the unit (the caller's) is not there when
    the engine recovers the unit in a new process, so keying by it would give the recovered call a new
    key and run it twice. That case logs one warning.

    .. versionadded:: 0.1
    """
    task = TASK_SCOPE.get()
    if not _durable:  # no durable engine installed: the plain rule, at no cost
        return task or default
    here = durable_unit()
    if here is None:
        return task or default
    if task is None:
        return here.scope
    if TASK_UNIT.get() == here.unit:
        return task
    with _warned_lock:
        first = ("durable", "task outside") not in _warned
        _warned.add(("durable", "task outside"))
    if first:
        _log.warning(
            "onceonly: ledger.task(%r) was entered outside the durable unit %s, and recovery does not enter it "
            "again, so guarded calls inside are scoped to the unit (%s); enter ledger.task inside the workflow "
            "function to share records across workflows",
            task,
            here.unit,
            here.scope,
        )
    return here.scope


# --- who is calling -------------------------------------------------------------------------------


def caller_scope(kind: Literal["c", "p", "s", "r", "local"], value: str = "", *, base: str | None = None) -> str:
    """The scope of one caller: ``kind`` says where the identity came from — ``c`` a conversation the
    application named, ``p`` an authenticated principal (already a keyed hash), ``s`` a protocol session,
    ``r`` one run of a framework, ``local`` the one client of a transport that has exactly one (stdio,
    in memory). ``base`` (a server's name) comes first, so that two servers on one ledger stay apart.

    The parts are fixed-form (``base/p:…``), so no caller's value can spell another kind's scope.

    .. versionadded:: 0.1
    """
    part = "local" if kind == "local" else f"{kind}:{value}"
    text = part if base is None else f"{base}/{part}"
    return safe_name(text, limit=MAX_SCOPE, prefix="h-")


def client_scope(caller: str, chosen: str) -> str:
    """A scope the client chose (``_meta["dev.onceonly/scope"]``, a conversation id it sent), bound under
    its caller's scope: the same text sent by another caller names another scope.

    .. versionadded:: 0.1
    """
    return safe_name(f"{caller}/c:{chosen}", limit=MAX_SCOPE, prefix="h-")


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def run_scope(run_id: str, *, integration: str, setting: str) -> str:
    """The scope of a call made inside a framework run that names no conversation: that run's own id.

    Calls of one run (a re-plan, a retry inside it) replay each other; another run — maybe another
    user — runs its own. Logs one warning per integration and setting, naming what to set so that
    records are shared across the runs of one conversation.

    .. versionadded:: 0.1
    """
    with _warned_lock:
        first = (integration, setting) not in _warned
        _warned.add((integration, setting))
    if first:
        _log.warning(
            "onceonly %s: this run names no conversation, so guarded calls are scoped to the run itself and a "
            "later run (a resumed conversation, another process) runs them again; set %s to the conversation's "
            "id to share records across its runs, or wrap the run in ledger.task(conversation_id)",
            integration,
            setting,
        )
    return caller_scope("r", run_id)


class _RunIds:
    """A random id per live object, held weakly: a framework's per-run object (a LangGraph run's stream
    writer, an Agents SDK run's usage) names its run without onceonly keeping it alive. Objects that
    compare by value (dataclasses) are told apart by identity."""

    def __init__(self) -> None:
        self._ids: dict[int, tuple[weakref.ref[Any], str]] = {}
        self._lock = threading.Lock()

    def __call__(self, obj: object) -> str:
        key = id(obj)
        with self._lock:
            hit = self._ids.get(key)
            if hit is not None and hit[0]() is obj:
                return hit[1]
            made = uuid.uuid4().hex

            def gone(ref: weakref.ref[Any], key: int = key) -> None:
                with self._lock:
                    if self._ids.get(key, (None,))[0] is ref:
                        del self._ids[key]

            self._ids[key] = (weakref.ref(obj, gone), made)
            return made


_run_ids = _RunIds()


def run_identity(run: object) -> str:
    """A random id for ``run``, an object a framework makes once per run and hands to every call in it:
    the same object gives the same id while it lives, another object another id.

    Raises:
        TypeError: ``run`` cannot be referenced weakly (an int, a str): give the run's own object.

    .. versionadded:: 0.1
    """
    return _run_ids(run)


# --- what a result means ----------------------------------------------------------------------------


def error_result_verdict(*, read_only: bool) -> Verdict:
    """What a tool's own error result (MCP ``isError: true``, a framework's "the tool ran and failed")
    means for the ledger: a read-only tool failed (``FAILED``); any other may have acted before it
    failed (``UNKNOWN``), so it is settled by its policy and never re-run blindly. A protocol error before
    the tool ran (unknown tool, invalid params) is not a result: it is a failure, classified where it is
    raised.

    .. versionadded:: 0.1
    """
    return Verdict.FAILED if read_only else Verdict.UNKNOWN


def strip_own_meta(meta: Mapping[str, Any] | None) -> dict[str, Any]:
    """``meta`` without onceonly's own keys: only onceonly sets them, so an upstream's are dropped (a forged
    replay mark must not reach the client).

    .. versionadded:: 0.1
    """
    if not meta:
        return {}
    return {k: v for k, v in meta.items() if not (isinstance(k, str) and k.startswith(OWN_META_PREFIX))}


# --- what the model reads -----------------------------------------------------------------------------

EnvelopeState = Literal[
    "done", "replayed", "unknown", "in_progress", "not_run", "conflict", "exhausted", "awaiting_approval", "refused"
]  # fmt: skip

#: Every state an envelope can have: ``not_run`` is the one that is safe to call again.
STATES: tuple[EnvelopeState, ...] = (
    "done", "replayed", "unknown", "in_progress", "not_run", "conflict", "exhausted", "awaiting_approval", "refused"
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Envelope:
    """What happened to one guarded call, as every integration tells it to a model.

    Attributes:
        state: ``done`` (it ran now), ``replayed`` (done earlier, not repeated), ``unknown`` (it may have
            happened; being checked: do not issue it again), ``in_progress`` (another call is doing it),
            ``not_run`` (it did not happen: safe to call again, after ``retry_at`` when given),
            ``conflict`` (the same operation was done with other details, or a similar one was),
            ``exhausted`` (it failed and will not be retried automatically), ``awaiting_approval`` (it waits
            for a person's approval), ``refused`` (a guardrail stopped it: a pause, a budget, a denial).
        text: ``tell_model``'s text for the model: never an operator instruction.
        result: the result for ``done``, ``replayed`` and a ``conflict`` replayed by ``on_conflict="replay"``
            or a near-duplicate (``None`` otherwise).
        key: the ledger key, for logs and ``onceonly show`` (not for the model).

    .. versionadded:: 0.1
    """

    state: EnvelopeState
    text: str
    result: Any = None
    key: str | None = None


def _state_of(error: OnceOnlyError) -> EnvelopeState:
    if isinstance(error, ApprovalPending):
        return "awaiting_approval"
    if isinstance(error, Refused):
        return "refused"
    if isinstance(error, OutcomeUnknown):
        return "unknown"
    if isinstance(error, RetryScheduled):  # before InProgress, its base: nobody is running it
        return "not_run"
    if isinstance(error, InProgress):
        return "in_progress"
    if isinstance(error, KeyConflict | SimilarCall):
        return "conflict"
    if isinstance(error, AttemptsExhausted):
        return "exhausted"
    raise TypeError(f"{type(error).__name__} is not an outcome a model is told about: it is raised")


def envelope(what: Outcome | BaseException) -> Envelope:
    """The envelope of an ``Outcome``, or of one of the outcome errors (``onceonly.tell.TOLD``).

    Raises:
        TypeError: ``what`` is another exception (a store fault, the tool's own error): not an outcome,
            so the caller raises it rather than telling the model.

    .. versionadded:: 0.1
    """
    if isinstance(what, Outcome):
        if what.replayed and what.similar_to is not None:
            state: EnvelopeState = "conflict"
        elif what.replayed:
            state = "conflict" if what.conflict else "replayed"
        else:
            state = "done"
        return Envelope(state, tell_model(what), what.result, what.key or None)
    if isinstance(what, TOLD):
        key = getattr(what, "key", None)
        return Envelope(_state_of(what), tell_model(what), None, key if isinstance(key, str) else None)
    raise TypeError(f"envelope() takes an Outcome or an outcome error, not {type(what).__name__}: raise it")


# --- the guarded function at the door ----------------------------------------------------------------

#: The parameter a function may declare to be handed its ledger key: filled in by the ledger, never
#: chosen by the caller or shown to a model.
KEY_PARAM = "idempotency_key"


def is_guarded(fn: object) -> bool:
    """Whether ``fn`` is already an ``@ledger.tool`` function (it has the guard's public members), so an
    integration uses it as it is rather than guarding it a second time.

    .. versionadded:: 0.1
    """
    return callable(getattr(fn, "outcome", None)) and callable(getattr(fn, "key_for", None)) and hasattr(fn, "spec")


def key_filled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as a framework should see it: without an ``idempotency_key`` parameter, which is filled in
    with the running guarded call's key, so that the model neither sees nor chooses it. ``fn`` itself
    when it has no such parameter (or no signature).

    .. versionadded:: 0.1
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn
    if KEY_PARAM not in sig.parameters:
        return fn
    key_of, key_param = current_call, KEY_PARAM
    if inspect.iscoroutinefunction(fn):

        async def with_key_async(*args: Any, **kwargs: Any) -> Any:
            running = key_of()
            if running is not None:
                kwargs[key_param] = running.key
            return await fn(*args, **kwargs)

        made: Any = with_key_async
    else:

        def with_key(*args: Any, **kwargs: Any) -> Any:
            running = key_of()
            if running is not None:
                kwargs[key_param] = running.key
            return fn(*args, **kwargs)

        made = with_key
    # Over the function's own globals, so that the framework resolves its annotations (strings under
    # `from __future__ import annotations`) where the function's module defines them.
    user_globals = getattr(fn, "__globals__", None)
    if isinstance(user_globals, dict):
        made = types.FunctionType(made.__code__, user_globals, made.__name__, None, made.__closure__)
    functools.update_wrapper(made, fn)
    made.__dict__.pop("__wrapped__", None)
    made.__signature__ = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != KEY_PARAM])
    made.__annotations__ = {k: v for k, v in (getattr(fn, "__annotations__", None) or {}).items() if k != KEY_PARAM}
    return made  # type: ignore[no-any-return]
