"""Guarded tools: what ``@ledger.tool`` makes of a function.

A guarded tool is a real function: a plain ``def``, or an ``async def`` for a coroutine function, with
the original's name, docstring, module, annotations and a ``__signature__`` without the injected
``idempotency_key``. Frameworks that build a JSON schema from a function's signature (LangChain, the
OpenAI Agents SDK, MCP servers) therefore take it as they would the original, and never show a model
the key. Its ``spec`` (a ``ToolSpec``) holds how a call becomes a ledger key and how it is run.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import itertools
import logging
import threading
import types
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import replace
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    Literal,
    NoReturn,
    ParamSpec,
    Protocol,
    TypeVar,
    cast,
    get_args,
    runtime_checkable,
)

from onceonly import drivers
from onceonly.budgets import Budget, BudgetGuard, bind
from onceonly.dryrun import DRY_VIA, dry_outcome
from onceonly.edge import KEY_PARAM, envelope, scope_here
from onceonly.errors import InvalidKey, OnceOnlyError, Refused
from onceonly.keys import Normalizer, canonical_json, compose_key, fingerprint, select, validate_name
from onceonly.plan import Call, Outcome, plan
from onceonly.policy import Policy, Verdict, classify
from onceonly.runtime import new_owner
from onceonly.similar import Lookup, OnSimilar, Similar, field_text, group_of
from onceonly.states import Record, State, ask_approval
from onceonly.tell import TOLD

if TYPE_CHECKING:
    from onceonly.ledger import Ledger

__all__ = ["EFFECTS", "Approve", "AsyncTool", "Effect", "Tool", "ToolSpec", "Wrappers", "make_tool"]

#: ``approve=``: whether a call needs a person's approval, for every call or per call's arguments.
Approve = bool | Callable[[dict[str, Any]], bool]

#: What repeating a tool's call does: ``write`` (it happens again), ``idempotent`` (harmless), ``read`` (nothing).
Effect = Literal["write", "idempotent", "read"]
EFFECTS: tuple[str, ...] = get_args(Effect)

P = ParamSpec("P")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)

_log = logging.getLogger("onceonly")

#: The argument the guard fills in with the call's key: never the caller's to give.


# Framework tool objects: decorating one is a mistake with a better way in (the module's top package
# → what to use instead).
_INTEGRATIONS = {
    "langchain_core": "onceonly.langchain.guard(tool, ledger) (or guard_tools / OnceOnlyMiddleware)",
    "langchain": "onceonly.langchain.guard(tool, ledger) (or guard_tools / OnceOnlyMiddleware)",
    "agents": "onceonly.openai_agents.guard_tools([tool], ledger), or @onceonly.openai_agents.function_tool(ledger) "
    "on the plain function",
    "fastmcp": "onceonly.mcp.OnceOnlyMiddleware(ledger) on the server, or @ledger.tool on the plain function",
    "mcp": "onceonly.mcp.OnceOnlyMiddleware(ledger) on the server, or @ledger.tool on the plain function",
    "autogen_core": "onceonly.autogen.guard(tool, ledger) (or guard_tools)",
    "autogen_agentchat": "onceonly.autogen.guard(tool, ledger) (or guard_tools)",
    "crewai": "onceonly.crewai.guard(tool, ledger) (or guard_tools)",
    "smolagents": "@ledger.tool(tell_model=True) on the plain function, under smolagents' @tool",
    "llama_index": "onceonly.llamaindex.guard(tool, ledger) (or guard_tools)",
    "agno": "onceonly.agno.guard(tool, ledger) (or guard_tools)",
    "claude_agent_sdk": "onceonly.claude_agent_sdk.guard(tool, ledger), or create_sdk_mcp_server(name, tools, ledger)",
    "pydantic_ai": "onceonly.pydantic_ai.guard(tool, ledger) (or guard_tools, or guarded(toolset, ledger))",
}


@runtime_checkable
class Tool(Protocol[P, R_co]):
    """The type of a sync guarded tool: the function, plus ``outcome``, ``using``, ``key_for``.

    .. versionadded:: 0.1
    """

    name: str
    ledger: Ledger
    spec: ToolSpec

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...
    def outcome(self, *args: P.args, **kwargs: P.kwargs) -> Outcome: ...
    def using(self, *, key: str | None = None, occurrence: int = 1) -> Using[P, R_co]: ...
    def key_for(self, *args: P.args, **kwargs: P.kwargs) -> str: ...


@runtime_checkable
class AsyncTool(Protocol[P, R_co]):
    """The type of an ``async def`` guarded tool: the same as ``Tool``, awaited.

    .. versionadded:: 0.1
    """

    name: str
    ledger: Ledger
    spec: ToolSpec

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R_co]: ...
    def outcome(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, Outcome]: ...
    def using(self, *, key: str | None = None, occurrence: int = 1) -> AsyncUsing[P, R_co]: ...
    def key_for(self, *args: P.args, **kwargs: P.kwargs) -> str: ...


class _Binder:
    """Maps a call's arguments to parameter names, defaults applied: the input of the key."""

    def __init__(self, fn: Callable[..., Any], skip: frozenset[str]) -> None:
        full = inspect.signature(fn)
        # The injected key is not an argument of the operation: bind as if it were not declared.
        params = [p for p in full.parameters.values() if p.name != KEY_PARAM]
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


def default_name(fn: Callable[..., Any]) -> str:
    """A function's tool name: its ``__qualname__``, without the module, so that the same function run as
    a script (``__main__``) and imported gets the same name and the same records."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if not isinstance(name, str):
        raise TypeError(f"{fn!r} has no __qualname__ or __name__ to name the tool by: pass name='...'")
    return name


def frozen(value: Any) -> Any:
    """A hashable form of an integration's settings (dicts, lists and sets by content), so that guarding
    the same tool with the same settings again finds the wrapper made before. A value that cannot be
    hashed raises ``TypeError``: then nothing is reused."""
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), frozen(v)) for k, v in value.items())))
    if isinstance(value, list | tuple | set | frozenset):
        return ("seq", tuple(frozen(v) for v in value))
    hash(value)  # a callable, a number, a Retry: by value or identity
    return value


W = TypeVar("W")


class Wrappers(Generic[W]):
    """One wrapper per (ledger, framework tool, settings), for integrations: guarding the same tool with
    the same settings again returns the wrapper made before, so the ledger sees one definition under the
    tool's name. Held weakly: a dropped ledger or tool takes its wrappers with it."""

    def __init__(self) -> None:
        self._made: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], tuple[weakref.ref[Any], W]]]
        self._made = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self, ledger: Any, original: Any, settings: tuple[Any, ...], make: Callable[[], W]) -> W:
        """The wrapper of ``original`` under ``settings`` (made by ``make()`` the first time)."""
        try:
            key: tuple[Any, ...] | None = (id(original), *frozen(settings))
        except TypeError:  # settings that cannot be compared: make a new one every time
            key = None
        if key is not None:
            with self._lock:
                found = self._made.get(ledger, {}).get(key)
            if found is not None and found[0]() is original:
                return found[1]
        made = make()
        if key is not None:
            with self._lock:
                self._made.setdefault(ledger, {})[key] = (weakref.ref(original), made)
        return made


def refuse_framework_object(fn: object) -> None:
    """A framework's tool object is not a function to decorate: say which integration guards it."""
    for cls in type(fn).__mro__:
        use = _INTEGRATIONS.get(cls.__module__.partition(".")[0])
        if use is not None:
            raise TypeError(
                f"@ledger.tool decorates a plain function, and {type(fn).__module__}.{type(fn).__qualname__} is a "
                f"framework's tool object: use {use}"
            )


def same_definition(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    """Whether two functions define the same operation: the same object, or the same code with the same
    captured values (a factory run again with the same arguments). Two closures of one factory over other
    values (a notifier per channel) are different operations, and must not share records."""
    if a is b:
        return True
    code_a, code_b = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if code_a is None or code_a is not code_b:
        return False
    cells_a, cells_b = getattr(a, "__closure__", None) or (), getattr(b, "__closure__", None) or ()
    if len(cells_a) != len(cells_b):
        return False
    for x, y in zip(cells_a, cells_b, strict=True):
        try:
            va, vb = x.cell_contents, y.cell_contents
        except ValueError:  # an empty cell (a name not bound yet)
            return False
        if va is not vb:
            try:
                if not bool(va == vb):
                    return False
            except Exception:
                return False
    return getattr(a, "__defaults__", None) == getattr(b, "__defaults__", None)


class ToolSpec:
    """How one guarded function is called: its name, key, policy, and the function itself.

    The guarded function (``make_tool``) is a thin real function over it; integrations and the
    reconciler use the spec.

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        ledger: Ledger,
        fn: Callable[..., Any],
        *,
        name: str,
        key: Sequence[str] | Callable[[dict[str, Any]], Any] | None,
        ignore: Sequence[str],
        normalize: Mapping[str, Normalizer] | None,
        policy: Policy,
        probe: Callable[[dict[str, Any], str], Any] | None,
        timeout: float | None,
        readonly: bool,
        decode: Callable[[Any], Any] | None,
        passthrough: tuple[type[BaseException], ...] = (),
        similar: Similar | None = None,
        on_similar: OnSimilar = "replay",
        tell_model: bool = False,
        effect: Effect | None = None,
        approve: Approve = False,
        budget: Budget | None = None,
    ) -> None:
        self.ledger = ledger
        self.runtime = ledger.runtime
        self.fn = fn
        self.name = validate_name(name, "tool name")
        self.is_async = inspect.iscoroutinefunction(fn)
        params = inspect.signature(fn).parameters
        self.takes_key = KEY_PARAM in params
        skip = {KEY_PARAM} | set(ignore)
        first = next(iter(params), None)
        if first in ("self", "cls"):
            skip.add(first)  # a method's receiver is not part of the operation
        self.binder = _Binder(fn, frozenset(skip))
        qualname = getattr(fn, "__qualname__", type(fn).__qualname__)
        unknown = [f for f in (*ignore, *(normalize or {})) if f not in params]
        if isinstance(key, str):
            raise TypeError(f"key={key!r}: give a tuple of field names, as key=({key!r},)")
        if key is not None and not callable(key):
            unknown += [f for f in key if f not in params]
        if unknown:
            raise TypeError(f"tool {name!r}: {unknown} are not parameters of {qualname}{inspect.signature(fn)}")
        self.key_fields = key
        self.normalize = dict(normalize or {})
        self.policy = policy
        self.probe = probe
        self.timeout = timeout
        #: ``write``, ``idempotent`` or ``read`` (``readonly``: the call skips the ledger).
        self.effect: Effect = effect or ("read" if readonly else "write")
        self.readonly = self.effect == "read"
        self.decode = decode
        self.passthrough = passthrough
        self.similar = similar
        self.on_similar = on_similar
        #: The plain call returns the model's text for every state but a fresh result (``tell_model=True``).
        self.tell_model = bool(tell_model)
        #: Whether a call needs a person's approval before it runs: ``True``, or decided per call by a
        #: function of the call's arguments (``approve=``).
        self.approve: Approve = approve
        #: The key fields compared exactly when ``similar`` is set: they form a call's group.
        self.exact_fields: tuple[str, ...] = ()
        if similar is not None:
            self.exact_fields = _exact_fields(similar, key, self.binder, name)
        #: ``budget=``: reserves each call's amount before it runs (``onceonly.budgets``).
        self.budget: BudgetGuard | None = None
        if budget is not None:
            self.budget = bind(budget, store=ledger.store, tool=self.name, params=list(params), ignore=ignore,
                               others=ledger.tools.values(), readonly=self.readonly)  # fmt: skip

    def over(self, fn: Callable[..., Any], *, ignore: Sequence[str] = ()) -> ToolSpec:
        """The same operation, with every setting of this spec, over another function with the same
        parameters (an integration's async twin of a sync body): one call copies them all, so that no
        integration keeps its own list of the fields.

        .. versionadded:: 0.1
        """
        return ToolSpec(
            self.ledger, fn, name=self.name, key=self.key_fields, ignore=ignore, normalize=self.normalize,
            policy=self.policy, probe=self.probe, timeout=self.timeout, readonly=self.readonly,
            decode=self.decode, passthrough=self.passthrough, similar=self.similar, on_similar=self.on_similar,
            tell_model=self.tell_model, effect=self.effect, approve=self.approve,
            budget=None if self.budget is None else self.budget.budget,
        )  # fmt: skip

    def call(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], key: str | None, occurrence: int) -> Call:
        """The ledger ``Call`` of one invocation: its key, fingerprint and arguments."""
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
        if key is not None:
            digest = validate_name(key, "explicit key")
        elif self.key_fields is None:
            digest = fp[:32]
        elif callable(self.key_fields):
            digest = _key_from_function(self.key_fields(hashed), self.name)
        else:
            digest = fingerprint(canonical_json(select(hashed, self.key_fields), path="key"))[:32]
        if occurrence != 1:  # an int from 1: using() checked it
            digest = f"{digest}#{occurrence}"
        scope = scope_here(self.ledger.scope)  # Ledger.current_scope(), without the method call
        full = compose_key(scope, self.name, digest)
        rt = self.runtime
        # Positional: built on every call (key, scope, tool, fingerprint, args, owner, policy, clock, rng).
        made = Call(full, scope, self.name, fp, args_json, new_owner(), self.policy, rt.clock, rt.rng)
        if self.similar is not None and key is None and occurrence == 1:
            # An explicit key or a later occurrence names its operation: only derived keys look for near-duplicates.
            sim = self.similar
            made.similar = Lookup(
                sim, self.on_similar, group_of(scope, self.name, select(hashed, self.exact_fields)),
                {name: field_text(fields[name]) for name in sim.fields},
            )  # fmt: skip
        if self.approve is not False:
            made.approve = self.approve is True or _asks(self.approve, fields, self.name)
        return made

    def approve_call(self, call: Call, *, by: str, reason: str | None = None) -> Record | None:
        """Record a person's approval of ``call``'s operation given elsewhere (a framework's own approval
        flow, for a tool with ``approve=``): its request is made first if no call made it yet. The
        approved record, or ``None`` when there is nothing to approve (it ran, it is held, another
        decision came first, the record holds other arguments).

        .. versionadded:: 0.1
        """
        store = self.runtime.store
        rec = store.get(call.key)
        if rec is None:
            first = ask_approval(
                key=call.key, scope=call.scope, tool=call.tool, fingerprint=call.fingerprint,
                args_json=call.args_json, by=call.owner, now=self.runtime.clock(),
            )  # fmt: skip
            rec = store.claim(first)
            if rec is None:
                self.runtime.announce(first)
                rec = first
        if rec.state is not State.AWAITING_APPROVAL or rec.fingerprint != call.fingerprint:
            return None
        try:
            return self.ledger.approve(call.key, by=by, reason=reason, fingerprint=call.fingerprint)
        except OnceOnlyError:  # decided meanwhile by someone else: the plan goes by what is there
            return None

    def tool_kwargs(self, call: Call, kwargs: dict[str, Any]) -> dict[str, Any]:
        if self.takes_key:
            return {**kwargs, KEY_PARAM: call.key}
        return kwargs

    def finish(self, out: Outcome, call: Call | None = None) -> Outcome:
        look = None if call is None else call.similar
        if look is not None and look.joined is not None:
            out = replace(out, similar_to=look.joined, similar_args=look.earlier)
        if out.replayed and self.decode is not None:
            return replace(out, result=self.decode(out.result))
        return out

    def is_control_flow(self, exc: BaseException) -> bool:
        """Whether ``exc`` pauses or redirects the caller (not an outcome): a ``passthrough=`` type, or
        LangGraph's ``GraphBubbleUp`` family (``GraphInterrupt``, ``ParentCommand``), told by name so
        that the core never imports langgraph."""
        if self.passthrough and isinstance(exc, self.passthrough):
            return True
        return any(c.__name__ == "GraphBubbleUp" and c.__module__.startswith("langgraph") for c in type(exc).__mro__)

    def key_for(self, *args: Any, **kwargs: Any) -> str:
        """The ledger key this call would use, without calling anything."""
        return self.call(args, kwargs, None, 1).key

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any], key: str | None, occurrence: int) -> Outcome:
        """Run (or replay) one call of a sync tool."""
        if self.readonly:
            return _readonly(self, args, kwargs)
        call = self.call(args, kwargs, key, occurrence)
        paused = self.runtime.pauses.matching(call)  # a clock read; the store's pauses every 0.5 s (pause.py)
        if self.runtime.dry is not None:  # a dry run is on somewhere: one read, no claim, nothing run
            log = self.runtime.dry.log_here()
            if log is not None:
                over = self.budget is not None and self.budget.over_limit(self, call, args, kwargs)  # a read
                rec = self.runtime.store.get(call.key)
                return dry_outcome(call, rec, log, over_budget=over, paused=paused is not None)
        if paused is not None:
            self.refused(call, paused)
        if self.budget is not None:  # reserve its amount first; free it after if it did not happen
            return self.budget.run(self, call, args, kwargs, self.drive)
        return self.drive(call, args, kwargs)

    async def arun(self, args: tuple[Any, ...], kwargs: dict[str, Any], key: str | None, occurrence: int) -> Outcome:
        """Run (or replay) one call of an async tool."""
        if self.readonly:
            return await _areadonly(self, args, kwargs)
        call = self.call(args, kwargs, key, occurrence)
        watch = self.runtime.pauses
        paused = await watch.amatching(call) if watch.due() else watch.matching(call)
        if self.runtime.dry is not None:
            log = self.runtime.dry.log_here()
            if log is not None:
                store: Any = self.runtime.store
                over = self.budget is not None and await asyncio.to_thread(
                    self.budget.over_limit, self, call, args, kwargs
                )
                return dry_outcome(call, await store.aget(call.key), log, over_budget=over, paused=paused is not None)
        if paused is not None:
            self.refused(call, paused)
        if self.budget is not None:
            return await self.budget.arun(self, call, args, kwargs, self.adrive)
        return await self.adrive(call, args, kwargs)

    def refused(self, call: Call, error: Refused) -> NoReturn:
        """Raise a guardrail's refusal (a pause, a budget) before anything ran, counted as the call's
        outcome where metrics are on (``paused``, ``over_budget``)."""
        counted = self.runtime.count_call
        if counted is not None:
            with counted(self, call):
                raise error
        raise error

    def drive(self, call: Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
        """The end of ``run`` once its call is built (a budgeted call runs it between reserve and free)."""
        counted = self.runtime.count_call
        if counted is None:  # no metrics: the call pays one attribute read for them
            return self.finish(drivers.drive(self.runtime, plan(call), self, call, args, kwargs), call)
        with counted(self, call) as seen:
            seen.outcome = out = drivers.drive(self.runtime, plan(call), self, call, args, kwargs)
        return self.finish(out, call)

    async def adrive(self, call: Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
        """``drive``, awaited: the end of ``arun``."""
        counted = self.runtime.count_call
        if counted is None:
            return self.finish(await drivers.adrive(self.runtime, plan(call), self, call, args, kwargs), call)
        with counted(self, call) as seen:
            seen.outcome = out = await drivers.adrive(self.runtime, plan(call), self, call, args, kwargs)
        return self.finish(out, call)

    def __repr__(self) -> str:
        return f"<onceonly tool {self.name!r} on {self.ledger.url}>"


def _exact_fields(
    similar: Similar, key: Sequence[str] | Callable[[dict[str, Any]], Any] | None, binder: _Binder, tool: str
) -> tuple[str, ...]:
    """The key fields that are not ``similar.fields``: compared exactly, they form a call's group."""
    if not isinstance(similar, Similar):
        raise TypeError(f"similar={similar!r}: give an onceonly.Similar, such as Similar(fields=('title',))")
    if callable(key):
        raise TypeError(
            f"tool {tool!r}: similar= compares key fields, and key= is a function: give key= as a tuple of "
            "field names, such as key=('session_id', 'title')"
        )
    fields = tuple(key) if key is not None else tuple(n for n in binder.sig.parameters if n not in binder.skip)
    outside = [f for f in similar.fields if f not in fields]
    if outside:
        raise TypeError(
            f"tool {tool!r}: Similar(fields={similar.fields!r}) names {outside}, which are not key fields "
            f"{fields!r}: the similar fields are the key fields compared by meaning, so add them to key="
        )
    return tuple(f for f in fields if f not in similar.fields)


def _asks(decide: Callable[[dict[str, Any]], bool], fields: Mapping[str, Any], tool: str) -> bool:
    """What an ``approve=`` function says of one call's arguments (a copy: it cannot change them)."""
    said = decide(dict(fields))
    if not isinstance(said, bool):
        raise TypeError(
            f"the approve= function of tool {tool!r} returned {said!r}: return True (this call needs a person's "
            "approval) or False (it runs as it is)"
        )
    return said


def _key_from_function(value: Any, tool: str) -> str:
    # None (or "") is no key at all: as the key "None", every such call would share one record.
    if value is None or value == "":
        raise InvalidKey(
            f"the key= function of tool {tool!r} returned {value!r}: return a non-empty str that names the "
            "operation (an order id, a message id); a call that needs no guard belongs in a function that is "
            "not guarded"
        )
    return validate_name(value if isinstance(value, str) else str(value), "key returned by key=")


def check_occurrence(occurrence: int) -> int:
    # The number is part of the key: True would be occurrence 1 and 2.0 a key other than 2's, so that a
    # second occurrence could run twice. Only an int is the same number in every call.
    if type(occurrence) is not int or occurrence < 1:
        raise InvalidKey(f"occurrence={occurrence!r}: give an int from 1 (the n-th time the same call is meant)")
    return occurrence


def _check_key(key: str | None) -> str | None:
    if key is not None:
        validate_name(key, "explicit key")  # "" included: an empty key is a mistake, not "derive one"
    return key


def key_refused(name: str) -> TypeError:
    return TypeError(
        f"tool {name!r}: idempotency_key is filled in by the ledger, not passed by the caller; to choose the "
        f"key, call {name}.using(key='...')(...)"
    )


class Using(Generic[P, R_co]):
    """A sync tool with an explicit key or occurrence: ``tool.using(key=...)``."""

    def __init__(self, spec: ToolSpec, key: str | None, occurrence: int) -> None:
        self.spec, self.key, self.occurrence = spec, key, occurrence

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co:
        if self.spec.tell_model:  # the plain call with a chosen key: what the model reads, as without one
            try:
                return cast(R_co, answered(self.outcome(*args, **kwargs)))
            except TOLD as err:
                return cast(R_co, told(self.spec, err))
        return cast(R_co, self.outcome(*args, **kwargs).result)

    def outcome(self, *args: P.args, **kwargs: P.kwargs) -> Outcome:
        if KEY_PARAM in kwargs:
            raise key_refused(self.spec.name)
        return self.spec.run(args, dict(kwargs), self.key, self.occurrence)


class AsyncUsing(Generic[P, R_co]):
    """An async tool with an explicit key or occurrence: ``tool.using(key=...)``."""

    def __init__(self, spec: ToolSpec, key: str | None, occurrence: int) -> None:
        self.spec, self.key, self.occurrence = spec, key, occurrence

    async def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co:
        if self.spec.tell_model:
            try:
                return cast(R_co, answered(await self.outcome(*args, **kwargs)))
            except TOLD as err:
                return cast(R_co, told(self.spec, err))
        return cast(R_co, (await self.outcome(*args, **kwargs)).result)

    async def outcome(self, *args: P.args, **kwargs: P.kwargs) -> Outcome:
        if KEY_PARAM in kwargs:
            raise key_refused(self.spec.name)
        return await self.spec.arun(args, dict(kwargs), self.key, self.occurrence)


def told(spec: ToolSpec, error: OnceOnlyError) -> str:
    """The model's text for an outcome error of a ``tell_model=True`` tool; the operator's text is logged."""
    _log.warning("onceonly %s: %s", spec.name, error)
    return envelope(error).text


def answered(out: Outcome) -> Any:
    """What a ``tell_model=True`` tool returns for an outcome: a fresh result as it is, else the text."""
    return out.result if not out.replayed and out.via != DRY_VIA else envelope(out).text


def _sync_function(spec: ToolSpec) -> Callable[..., Any]:
    # Everything the body uses is a closure variable: the function is rebuilt over the original's
    # globals (see make_tool), where none of these names exist.
    run = spec.run
    refused = key_refused
    key_param = KEY_PARAM
    name = spec.name
    answer, tell, outcome_errors = answered, told, TOLD

    if spec.tell_model:

        def guarded_told(*args: Any, **kwargs: Any) -> Any:
            if key_param in kwargs:
                raise refused(name)
            try:
                return answer(run(args, kwargs, None, 1))
            except outcome_errors as err:
                return tell(spec, err)

        return guarded_told

    def guarded(*args: Any, **kwargs: Any) -> Any:
        if key_param in kwargs:
            raise refused(name)
        return run(args, kwargs, None, 1).result

    return guarded


def _async_function(spec: ToolSpec) -> Callable[..., Any]:
    arun = spec.arun
    refused = key_refused
    key_param = KEY_PARAM
    name = spec.name
    answer, tell, outcome_errors = answered, told, TOLD

    if spec.tell_model:

        async def guarded_told(*args: Any, **kwargs: Any) -> Any:
            if key_param in kwargs:
                raise refused(name)
            try:
                return answer(await arun(args, kwargs, None, 1))
            except outcome_errors as err:
                return tell(spec, err)

        return guarded_told

    async def guarded(*args: Any, **kwargs: Any) -> Any:
        if key_param in kwargs:
            raise refused(name)
        return (await arun(args, kwargs, None, 1)).result

    return guarded


def make_tool(spec: ToolSpec) -> Any:
    """The guarded function of ``spec``: a real ``def`` or ``async def`` that looks like the original.

    Its ``__globals__`` are the original's, so a framework that resolves the annotations (written as
    strings under ``from __future__ import annotations``) finds the user's types where the original would.
    It has no ``__wrapped__``: unwrapping it would reach the unguarded original.
    """
    fn = spec.fn
    inner = _async_function(spec) if spec.is_async else _sync_function(spec)
    user_globals = getattr(fn, "__globals__", None)
    if isinstance(user_globals, dict):
        inner = types.FunctionType(inner.__code__, user_globals, inner.__name__, None, inner.__closure__)
    functools.update_wrapper(inner, fn)
    made: Any = inner
    made.__dict__.pop("__wrapped__", None)
    annotations = dict(getattr(fn, "__annotations__", None) or {})
    annotations.pop(KEY_PARAM, None)
    made.__annotations__ = annotations
    made.__signature__ = spec.binder.sig
    made.__kwdefaults__ = None
    made.name = spec.name
    made.ledger = spec.ledger
    made.spec = spec
    made.key_for = spec.key_for
    if spec.is_async:

        async def outcome(*args: Any, **kwargs: Any) -> Outcome:
            """Run (or replay) the call and return its ``Outcome``."""
            if KEY_PARAM in kwargs:
                raise key_refused(spec.name)
            return await spec.arun(args, kwargs, None, 1)

        def using_async(*, key: str | None = None, occurrence: int = 1) -> AsyncUsing[Any, Any]:
            """This tool with an explicit key, or the n-th occurrence of the same call (meant twice)."""
            return AsyncUsing(spec, _check_key(key), check_occurrence(occurrence))

        made.outcome, made.using = outcome, using_async
    else:

        def outcome_sync(*args: Any, **kwargs: Any) -> Outcome:
            """Run (or replay) the call and return its ``Outcome``."""
            if KEY_PARAM in kwargs:
                raise key_refused(spec.name)
            return spec.run(args, kwargs, None, 1)

        def using(*, key: str | None = None, occurrence: int = 1) -> Using[Any, Any]:
            """This tool with an explicit key, or the n-th occurrence of the same call (meant twice).

            ``send_email.using(occurrence=2)(to, body)`` sends a second, distinct email; run again after
            a crash it replays that second one.
            """
            return Using(spec, _check_key(key), check_occurrence(occurrence))

        made.outcome, made.using = outcome_sync, using
    return made


# --- read-only tools: no ledger ---------------------------------------------------------------------


def _readonly_outcome(value: Any, attempt: int) -> Outcome:
    return Outcome(result=value, key="", state=State.CONFIRMED, replayed=False, attempts=attempt, via="readonly")


def _read_within(spec: ToolSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One attempt of a sync read, given up (``TimeoutError``) past ``timeout=``: a read has nothing to
    record, so the worker thread that runs on is left to finish on its own."""
    if spec.timeout is None:
        return spec.fn(*args, **kwargs)
    box: dict[str, Any] = {}
    done = threading.Event()
    context = contextvars.copy_context()

    def run() -> None:
        try:
            box["value"] = context.run(spec.fn, *args, **kwargs)
        except BaseException as exc:
            box["error"] = exc
        done.set()

    threading.Thread(target=run, name=f"onceonly-read-{spec.name}"[:60], daemon=True).start()
    if not done.wait(spec.timeout):
        raise TimeoutError(f"the read {spec.name!r} took longer than timeout={spec.timeout!r} seconds")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _readonly(spec: ToolSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
    """A read has no side effect: plain retry on anything that may be transient, no ledger."""
    retry = spec.policy.retry
    for attempt in itertools.count(1):
        try:
            return _readonly_outcome(_read_within(spec, args, kwargs), attempt)
        except Exception as exc:
            verdict = classify(exc, spec.policy.classify)
            pause = retry.backoff(attempt, spec.runtime.rng, floor=verdict.retry_after)
            # A wait longer than wait= is not waited for (a Retry-After of an hour): the read fails now.
            if verdict.verdict is Verdict.FAILED or attempt >= retry.attempts or pause > spec.policy.wait:
                raise
            spec.runtime.sleep(pause)
    raise AssertionError("unreachable")  # pragma: no cover


async def _areadonly(spec: ToolSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
    retry = spec.policy.retry
    fn = cast(Callable[..., Awaitable[Any]], spec.fn)
    for attempt in itertools.count(1):
        try:
            return _readonly_outcome(await asyncio.wait_for(fn(*args, **kwargs), spec.timeout), attempt)
        except Exception as exc:
            verdict = classify(exc, spec.policy.classify)
            pause = retry.backoff(attempt, spec.runtime.rng, floor=verdict.retry_after)
            if verdict.verdict is Verdict.FAILED or attempt >= retry.attempts or pause > spec.policy.wait:
                raise
            await spec.runtime.asleep(pause)
    raise AssertionError("unreachable")  # pragma: no cover
