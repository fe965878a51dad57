"""pydantic-ai (2.x): tools whose calls go through an onceonly ledger.

    from onceonly.pydantic_ai import guard_tools, guarded

    agent = Agent(model, tools=guard_tools([charge, refund], ledger))        # functions or Tool objects
    agent = Agent(model, toolsets=[guarded(FunctionToolset([charge]), ledger)])  # any toolset (MCP too)
    await agent.run(text, conversation_id=conversation_id)

A guarded tool is pydantic-ai's own ``Tool`` with the original's name, description, argument schema and
settings; a guarded toolset is a ``WrapperToolset`` whose ``call_tool`` goes through the ledger. Either
way pydantic-ai validates the model's arguments first (``"5"`` becomes ``5`` for an ``int``), so the key
is made of the arguments the tool sees. An injected ``RunContext`` is not part of the schema, nor of the
key; an ``idempotency_key`` parameter is filled in with the call's key and left out of the schema.

**Who is calling.** The ``ledger.task(...)`` around the run, when there is one; else the run's
``RunContext.conversation_id`` (``agent.run(..., conversation_id=...)``, else the one on
``message_history``, else a fresh one per run, which makes the run its own scope); else (a context
without one) the run's ``run_id``, with one warning. Inside a durable engine's unit that onceonly knows
(``onceonly.dbos.install()``), the unit's scope, which recovery in a new process brings back.

**What the model reads.** A fresh result as the tool returned it; a replay, ``onceonly.tell_model``'s
text ("already done at ..., not repeated; its result: ..."); an unknown outcome, a call in progress, a
conflict or exhausted attempts, that text as a failed tool result (``ToolFailed``: the model reads it,
the run goes on, and no retry is spent, unlike ``ModelRetry``, whose "fix the errors and try again"
would invite the very call the text forbids). The operator's ``onceonly resolve ...`` goes to the log.

**Control flow** (``CallDeferred``, ``ApprovalRequired``, and ``ModelRetry``, which says the tool did not
act) passes through with the claim given back: a later call (after the approval) runs once.

.. versionadded:: 0.1
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import inspect
import keyword
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from onceonly._install import install_hint

try:
    from pydantic_ai import RunContext, Tool
    from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, ModelRetry, ToolFailed
    from pydantic_ai.toolsets import AbstractToolset, ToolsetTool, WrapperToolset
    from pydantic_core import to_jsonable_python
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(f"onceonly.pydantic_ai needs pydantic-ai (2.x): {install_hint('pydantic-ai')}") from exc

from onceonly import edge
from onceonly.plan import Outcome
from onceonly.tell import TOLD
from onceonly.tools import Wrappers

if TYPE_CHECKING:
    from onceonly.ledger import Ledger

__all__ = [
    "PASSTHROUGH",
    "SETTING",
    "GuardedToolset",
    "conversation_scope",
    "guard",
    "guard_tools",
    "guarded",
    "run_scope",
]

_log = logging.getLogger("onceonly.pydantic_ai")

#: pydantic-ai's control flow, not outcomes: the claim is given back and the exception propagates.
#: ``ModelRetry`` asks the model for another call: the tool did not act. Add these to ``passthrough=``
#: of an ``@ledger.tool`` function that raises them.
PASSTHROUGH: tuple[type[BaseException], ...] = (CallDeferred, ApprovalRequired, ModelRetry)

#: What to set so that the runs of one conversation share records (named in the run-scope warning).
SETTING = "agent.run(..., conversation_id=...)"

#: The guarded body's hidden parameter (the call's context and how to run it): not part of the key.
_CALL = "_onceonly_call"
#: The parameter of arguments that are not a set of named fields: the whole object.
_WHOLE = "arguments"

ScopeFunction = Callable[[RunContext[Any]], "str | None"]


# --- scope ----------------------------------------------------------------------------------------


def conversation_scope(ctx: RunContext[Any]) -> str | None:
    """The scope of a tool call: the run's ``conversation_id``, or ``None`` when the context has none.

    pydantic-ai resolves it at the start of every run: the ``conversation_id`` given to ``agent.run``,
    else the latest one on ``message_history``, else a fresh one, so a run that continues no
    conversation is a scope of its own. Under a durable capability the fresh one derives from the run's
    id, which the engine keeps on replay.

    .. versionadded:: 0.1
    """
    found = getattr(ctx, "conversation_id", None)
    if not isinstance(found, str) or not found:
        return None
    return edge.caller_scope("c", found)


def run_scope(ctx: RunContext[Any]) -> str:
    """The scope of a call whose context names no conversation: the run's ``run_id``, else its usage
    object (made once per run). Logs one warning naming ``SETTING``.

    .. versionadded:: 0.1
    """
    run = getattr(ctx, "run_id", None)
    if not isinstance(run, str) or not run:
        run = edge.run_identity(ctx.usage)
    return edge.run_scope(run, integration="pydantic-ai", setting=SETTING)


# --- one guarded call -------------------------------------------------------------------------------


class _Target:
    """What a guarded body runs, compared by identity: two bodies over one target are one definition
    (the ledger's check that a tool name stands for one function)."""

    __slots__ = ("identity",)

    def __init__(self, identity: object) -> None:
        self.identity = identity

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Target) and self.identity is other.identity

    def __hash__(self) -> int:
        return id(self.identity)


class _Invocation:
    """One call: how to run the tool, and, once it ran, what it returned."""

    __slots__ = ("has_raw", "invoke", "raw")

    def __init__(self, invoke: Callable[[], Awaitable[Any]]) -> None:
        self.invoke = invoke
        self.raw: Any = None
        self.has_raw = False

    def keep(self, output: Any) -> Any:
        """Keep the output for this caller; return its JSON form, which the ledger stores."""
        self.raw, self.has_raw = output, True
        try:
            return to_jsonable_python(output)
        except Exception as exc:
            # The side effect happened: an output with no JSON form must not make it a failed attempt
            # (which would run again), so the record keeps a description of it.
            return {"$unstorable": type(output).__name__, "error": f"{type(exc).__name__}: {exc}"[:500]}


def _field_names(schema: Any) -> tuple[str, ...] | None:
    """The named fields of an argument schema, or ``None`` when the whole object is the operation."""
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return None
    names = tuple(props)
    if all(isinstance(n, str) and n.isidentifier() and not keyword.iskeyword(n) and n != _CALL for n in names):
        return names
    return None


class _Guard:
    """One guarded tool on one ledger: the ledger's function, and how a call reaches the tool."""

    def __init__(
        self,
        ledger: Ledger,
        name: str,
        schema: Any,
        description: str | None,
        identity: object,
        tell_model: bool,
        scope: ScopeFunction,
        policy: dict[str, Any],
    ) -> None:
        self.ledger = ledger
        self.tell_model = tell_model
        self.scope = scope
        if edge.KEY_PARAM in ((schema or {}).get("properties") or {}):
            raise TypeError(
                f"tool {name!r} asks the model for idempotency_key, so the model would choose keys: guard the "
                "function with onceonly.pydantic_ai.guard(fn, ledger), which fills the key in and leaves it "
                "out of the schema"
            )
        self.named = _field_names(schema)
        target = _Target(identity)

        async def body(**fields: Any) -> Any:
            call: _Invocation = fields[_CALL]
            _ = target  # part of the closure: what makes two bodies one definition
            return call.keep(await call.invoke())

        names = self.named if self.named is not None else (_WHOLE,)
        params = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in names]
        params.append(inspect.Parameter(_CALL, inspect.Parameter.KEYWORD_ONLY))
        made: Any = body
        made.__signature__ = inspect.Signature(params)
        made.__name__ = made.__qualname__ = name
        made.__doc__ = description
        policy = dict(policy)
        ignore = (*policy.pop("ignore", ()), _CALL)
        passthrough = (*policy.pop("passthrough", ()), *PASSTHROUGH)
        try:
            self.fn: Any = ledger.tool(name=name, ignore=ignore, passthrough=passthrough, **policy)(made)
        except TypeError as err:
            if "are not parameters of" not in str(err):
                raise
            takes = f"the fields {list(self.named)}" if self.named is not None else f"one object, {_WHOLE!r}"
            raise TypeError(
                f"tool {name!r}: key=, ignore= and normalize= name its arguments, and it takes {takes} ({err})"
            ) from None

    def fields(self, args: dict[str, Any]) -> dict[str, Any]:
        """The validated arguments in their JSON form, as the key reads them."""
        shown = to_jsonable_python(args)
        if self.named is None:
            return {_WHOLE: shown}
        return {n: shown[n] for n in self.named if n in shown}

    async def run(self, ctx: RunContext[Any], args: dict[str, Any], invoke: Callable[[], Awaitable[Any]]) -> Any:
        call = _Invocation(invoke)
        with _scoped(self.ledger, self.scope, ctx):
            try:
                out: Outcome = await self.fn.outcome(**self.fields(args), **{_CALL: call})
            except TOLD as err:
                raise _told(err) from None
        if not out.replayed and call.has_raw:
            return call.raw
        if out.replayed and self.tell_model:
            return edge.envelope(out).text
        return out.result


def _told(err: BaseException) -> ToolFailed:
    """What the model reads of an outcome that is not a result: the envelope's text, as a failed tool
    result (no retry spent); the operator's next step goes to the log."""
    _log.warning("onceonly %s: %s", getattr(err, "key", "?"), err)
    return ToolFailed(edge.envelope(err).text)


def _scoped(ledger: Ledger, scope: ScopeFunction, ctx: RunContext[Any]) -> contextlib.AbstractContextManager[Any]:
    """The ``ledger.task`` a call runs in: none when the caller entered one or a durable unit decides
    (its scope must be the same when the engine recovers the unit, where the caller's task is gone), else
    the conversation's, else the run's."""
    if edge.task_scope() is not None or edge.durable_unit() is not None:
        return contextlib.nullcontext()
    return ledger.task(scope(ctx) or run_scope(ctx))


# --- guard(), guard_tools(): Tool objects and functions -------------------------------------------

# One guarded Tool per (ledger, original, settings): guarding the same one again returns it.
_wrappers: Wrappers[Tool[Any]] = Wrappers()


def _marked(tool: Tool[Any]) -> bool:
    return getattr(tool.function, "__onceonly_guard__", None) is not None


def _ledger_tool_runner(fn: Any, tool: Tool[Any], tell_model: bool, scope: ScopeFunction) -> Any:
    """The function of a Tool over an ``@ledger.tool`` function: its own settings decide, its
    ``.outcome()`` runs, the conversation's scope around it."""
    schema = tool.function_schema
    if schema.takes_ctx:
        first = next(iter(inspect.signature(fn).parameters))
        if first not in fn.spec.binder.skip:
            raise TypeError(
                f"{fn.name!r} takes the RunContext {first!r}, which would be part of its key: decorate it with "
                f"@ledger.tool(ignore=({first!r},), passthrough=onceonly.pydantic_ai.PASSTHROUGH), or pass the "
                "plain function to guard()"
            )
    if fn.spec.is_async:
        outcome = fn.outcome
    else:

        async def outcome(*args: Any, **kwargs: Any) -> Outcome:
            return await asyncio.to_thread(fn.outcome, *args, **kwargs)  # to_thread carries the scope

    calls = dataclasses.replace(schema, function=outcome, is_async=True)
    ledger = fn.ledger

    async def run(ctx: RunContext[Any], **args: Any) -> Any:
        with _scoped(ledger, scope, ctx):
            try:
                out: Outcome = await calls.call(args, ctx)
            except TOLD as err:
                raise _told(err) from None
        if out.replayed and tell_model:
            return edge.envelope(out).text
        return out.result

    return run


def guard(
    tool: Tool[Any] | Callable[..., Any],
    ledger: Ledger,
    *,
    name: str | None = None,
    tell_model: bool = True,
    scope: ScopeFunction = conversation_scope,
    **policy: Any,
) -> Tool[Any]:
    """A pydantic-ai ``Tool`` whose calls happen once per conversation: the same call again replays.

    Args:
        tool: a ``Tool``, a plain function (sync or async, with or without a ``RunContext`` first
            parameter), or an ``@ledger.tool`` function (its decorator's settings apply: ``policy`` must
            be empty, and a ``RunContext`` parameter must be in its ``ignore=``).
        ledger: the ledger the calls go through.
        name: the tool's name in the ledger's keys; default the tool's name.
        tell_model: a replay reaches the model as ``onceonly.tell_model``'s text ("already done at ...,
            not repeated; its result: ..."); ``False``: the recorded result as it is.
        scope: ``RunContext -> scope | None`` (default ``conversation_scope``).
        policy: the keyword arguments of ``@ledger.tool`` (``key=``, ``on_unknown=``, ``probe=``,
            ``timeout=``...), naming the tool's arguments. ``passthrough=`` adds to ``PASSTHROUGH``.

    Returns:
        A ``Tool`` with the original's name, description, schema and settings.

    .. versionadded:: 0.1
    """
    if isinstance(tool, Tool):
        if _marked(tool):
            raise TypeError(f"tool {tool.name!r} is guarded already; guard the original once, with all its settings")
        original: Tool[Any] = tool
        fn: Any = tool.function
    elif callable(tool):
        fn = tool
        if edge.is_guarded(fn):
            if policy or name is not None:
                raise TypeError(
                    f"{fn.name!r} is already an @ledger.tool function: its settings are its decorator's; pass the "
                    "plain function to guard(..., **policy), or no settings"
                )
            if fn.ledger is not ledger:
                raise TypeError(f"{fn.name!r} is guarded by another ledger ({fn.ledger!r}) than the one given")
        original = Tool(fn) if edge.is_guarded(fn) else Tool(edge.key_filled(fn))
    else:
        raise TypeError(f"onceonly.pydantic_ai.guard takes a pydantic-ai Tool or a function, not {tool!r}")

    def make() -> Tool[Any]:
        schema = original.function_schema
        runner: Any
        if edge.is_guarded(fn):
            runner = _ledger_tool_runner(fn, original, tell_model, scope)
        else:
            spec = _Guard(
                ledger, name or original.name, schema.json_schema, original.description, fn, tell_model, scope, policy
            )

            async def runner(ctx: RunContext[Any], **args: Any) -> Any:
                return await spec.run(ctx, args, lambda: schema.call(args, ctx))

        runner.__name__ = runner.__qualname__ = original.name
        runner.__doc__ = original.description
        runner.__onceonly_guard__ = True
        made = copy.copy(original)
        # Handed the whole validated arguments and the context: the original schema's call() places them.
        made.function_schema = dataclasses.replace(
            schema, function=runner, takes_ctx=True, is_async=True, positional_fields=[], var_positional_field=None
        )
        made.function = runner
        made.takes_ctx = True
        return made

    return _wrappers.get(ledger, tool, (name, tell_model, scope, policy), make)


def guard_tools(tools: Sequence[Tool[Any] | Callable[..., Any]], ledger: Ledger, **options: Any) -> list[Tool[Any]]:
    """``guard()`` each of ``tools`` with the same settings; tools guarded already pass as they are.

    .. versionadded:: 0.1
    """
    if "name" in options:
        raise TypeError("guard_tools() gives every tool its own name: use guard(tool, ledger, name=...) for one")
    return [t if isinstance(t, Tool) and _marked(t) else guard(t, ledger, **dict(options)) for t in tools]


# --- the toolset wrapper ------------------------------------------------------------------------------


@dataclass
class GuardedToolset(WrapperToolset[Any]):
    """A toolset whose tool calls go through ``ledger``: any toolset (a ``FunctionToolset``, an MCP
    server's, a combined one). ``tools`` names the ones to guard (default all: list the side-effecting
    ones, so that reads are not recorded). Made by ``guarded()``.

    .. versionadded:: 0.1
    """

    ledger: Ledger = field(kw_only=True)
    tools: frozenset[str] | None = field(default=None, kw_only=True)
    tell_model: bool = field(default=True, kw_only=True)
    scope: ScopeFunction = field(default=conversation_scope, kw_only=True)
    policy: dict[str, Any] = field(default_factory=dict, kw_only=True)
    # name -> its guard, shared by the copies pydantic-ai makes for each run (dataclasses.replace).
    guards: dict[str, _Guard] = field(default_factory=dict, kw_only=True, repr=False)

    def _guard(self, name: str, tool: ToolsetTool[Any]) -> _Guard:
        found = self.guards.get(name)
        if found is None:
            found = self.guards[name] = _Guard(
                self.ledger, name, tool.tool_def.parameters_json_schema, tool.tool_def.description,
                self.guards, self.tell_model, self.scope, self.policy,
            )  # fmt: skip
        return found

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        found = await self.wrapped.get_tools(ctx)
        for name, tool in found.items():
            if self.tools is not None and name not in self.tools:
                continue
            if edge.KEY_PARAM in ((tool.tool_def.parameters_json_schema or {}).get("properties") or {}):
                raise TypeError(
                    f"tool {name!r} asks the model for idempotency_key, so the model would choose keys: guard its "
                    "function with onceonly.pydantic_ai.guard(fn, ledger) (it fills the key in and leaves it out of "
                    "the schema), or leave it out of tools="
                )
        return found

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        if self.tools is not None and name not in self.tools:
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)
        return await self._guard(name, tool).run(
            ctx, tool_args, lambda: self.wrapped.call_tool(name, tool_args, ctx, tool)
        )


def guarded(
    toolset: AbstractToolset[Any],
    ledger: Ledger,
    *,
    tools: Sequence[str] | None = None,
    tell_model: bool = True,
    scope: ScopeFunction = conversation_scope,
    **policy: Any,
) -> GuardedToolset:
    """``toolset`` with its calls (of ``tools``, default all) going through ``ledger``, one record per
    tool name: ``Agent(model, toolsets=[guarded(toolset, ledger, tools=["charge"])])``. The settings are
    ``guard()``'s, applied to each guarded tool.

    .. versionadded:: 0.1
    """
    if isinstance(tools, str):
        raise TypeError(f"tools={tools!r}: give a list of tool names, such as tools=[{tools!r}]")
    return GuardedToolset(
        toolset, ledger=ledger, tools=None if tools is None else frozenset(tools), tell_model=tell_model,
        scope=scope, policy=dict(policy),
    )  # fmt: skip
