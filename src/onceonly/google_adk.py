"""Google ADK (google-adk 2.x): function tools whose calls go through an onceonly ledger.

    from onceonly.google_adk import OnceOnlyPlugin, guard_tools

    agent = LlmAgent(name="billing", model=model, tools=guard_tools([charge], ledger))
    app = App(name="shop", root_agent=agent)                                  # or, for every agent's tools:
    app = App(name="shop", root_agent=agent, plugins=[OnceOnlyPlugin(ledger)])
    runner = Runner(app=app, session_service=sessions)

A guarded tool is ADK's own ``FunctionTool`` (or ``LongRunningFunctionTool``) over a function with the
original's name, docstring and parameters, so ADK builds the same declaration, injects the same
``ToolContext``, asks for the same confirmation and runs its callbacks as before. The ``ToolContext``
and an ``idempotency_key`` parameter are never in the declaration or the key.

**Who is calling.** The ``ledger.task(...)`` around the run, when there is one. Else the ADK session:
its app, user and id (``session_scope``), so that two users never share records and a re-plan, a new
message of the same session or a sub-agent of it acting again replays. Else (a ``scope=`` that names
nothing) the invocation itself, with one warning.

**What the model reads.** A fresh result as the tool returned it; for a replay, an unknown outcome, a
call in progress, a conflict or exhausted attempts, the function response
``{"status": <state>, "message": <onceonly.tell_model's text>}``: the run goes on (an exception from a
tool aborts an ADK run), and the model never reads the operator's ``onceonly resolve ...`` (it goes to
the ``onceonly.google_adk`` log). The tool's own error is raised as it is, to ADK's
``on_tool_error_callback``.

**Pauses are not outcomes.** A long-running tool that returns nothing (ADK waits for the client's
function response) and a tool that asks for a confirmation or a credential (``tool_context.
request_confirmation``, ``request_credential``) give the claim back: nothing is recorded, and the call
made again (the confirmed one, say) runs.

.. versionadded:: 0.1
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import typing
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from onceonly._install import install_hint

try:
    from google.adk.plugins.base_plugin import BasePlugin
    from google.adk.tools.base_tool import BaseTool
    from google.adk.tools.function_tool import FunctionTool
    from google.adk.tools.long_running_tool import LongRunningFunctionTool
    from google.adk.tools.tool_context import ToolContext
    from google.adk.utils.context_utils import find_context_parameter
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(f"onceonly.google_adk needs Google ADK: {install_hint('google-adk')}") from exc

from onceonly import edge
from onceonly.keys import canonical_json
from onceonly.plan import Outcome
from onceonly.schema import SchemaError, coerce
from onceonly.tell import TOLD
from onceonly.tools import Wrappers

if TYPE_CHECKING:
    from onceonly.ledger import Ledger

__all__ = ["SETTING", "OnceOnlyPlugin", "guard", "guard_tools", "session_scope"]

_log = logging.getLogger("onceonly.google_adk")

#: What to set so that records are shared across invocations (named in the run-scope warning).
SETTING = "scope=onceonly.google_adk.session_scope (the default), or ledger.task(conversation_id) around the run"

#: The guarded body's hidden parameter: this call's ToolContext and what the function returned. Left out of
#: the key and the fingerprint (``ignore=``).
_CALL = "_onceonly_call"
#: The argument through which a function gets the ledger's key (``@ledger.tool``'s convention).
_KEY = "idempotency_key"
#: ADK's name for the injected context when a function declares none (``FunctionTool``'s fallback).
_CONTEXT = "tool_context"

ScopeFunction = Callable[[Any], "str | None"]


# --- scope: the session ---------------------------------------------------------------------------


def session_scope(tool_context: Any) -> str | None:
    """The ledger scope of a tool call: its ADK session, as app, user and session id.

    Session services make a session id unique per app and user, not across them: the app and the user
    are part of the scope, so two users with the same session id never share records. Sub-agents of one
    session share its scope: the same operation done by two of them is one side effect (give a tool its
    own ``name=`` or ``key=`` where two agents mean two). ``None`` without a session id.

    .. versionadded:: 0.1
    """
    session = getattr(tool_context, "session", None)
    session_id = getattr(session, "id", None)
    if not isinstance(session_id, str) or not session_id:
        return None
    app = getattr(session, "app_name", "") or ""
    user = getattr(session, "user_id", "") or ""
    return edge.caller_scope("c", f"{app}/{user}/{session_id}")


# --- one call of a guarded tool ---------------------------------------------------------------------


class _Paused(Exception):
    """The tool paused the run (no result yet, a confirmation or credential asked for): not an outcome,
    so the ledger gives the claim back (``passthrough=``) and the value goes to ADK as it is."""

    def __init__(self, value: Any) -> None:
        super().__init__("the tool paused for its answer")
        self.value = value


def _storable(value: Any) -> Any:
    """What the ledger keeps of a result: JSON as it is, a pydantic model's JSON form, else a description
    (the side effect happened: a result with no JSON form must not make it a failed attempt)."""
    try:
        canonical_json(value, path="result")
    except (TypeError, ValueError):
        dump = getattr(value, "model_dump", None)
        if callable(dump):
            with contextlib.suppress(Exception):
                dumped = dump(mode="json")
                canonical_json(dumped, path="result")
                return dumped
        try:
            shown = repr(value)[:500]
        except Exception:  # a broken __repr__: the type must do
            shown = "?"
        return {"$unstorable": type(value).__name__, "repr": shown}
    return value


class _Invocation:
    """One call: its ToolContext, and once the tool ran, what it returned."""

    __slots__ = ("ctx", "has_raw", "long_running", "raw")

    def __init__(self, ctx: Any, long_running: bool) -> None:
        self.ctx = ctx
        self.long_running = long_running
        self.raw: Any = None
        self.has_raw = False

    def keep(self, value: Any) -> Any:
        """Keep the value for this caller and return its stored form; a pause raises ``_Paused``."""
        if self.paused(value):
            raise _Paused(value)
        self.raw, self.has_raw = value, True
        return _storable(value)

    def paused(self, value: Any) -> bool:
        if self.long_running and not value:  # ADK sends no response: the client's comes later
            return True
        actions = getattr(self.ctx, "actions", None)
        call_id = getattr(self.ctx, "function_call_id", None)
        if actions is None or call_id is None:
            return False
        asked = ("requested_tool_confirmations", "requested_auth_configs")
        return any(call_id in (getattr(actions, field, None) or {}) for field in asked)


def _told(state: str, text: str) -> dict[str, str]:
    return {"status": state, "message": text}


class _Guard:
    """One guarded function: the ledger's function, and how ADK's keyword arguments reach it."""

    def __init__(
        self,
        fn: Callable[..., Any],
        ledger: Ledger,
        name: str,
        tell_model: bool,
        scope: ScopeFunction,
        long_running: bool,
        policy: dict[str, Any],
    ) -> None:
        self.ledger = ledger
        self.name = name
        self.tell_model = tell_model
        self.scope = scope
        self.long_running = long_running
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"tool {name!r} is a generator: ADK streams its items, and onceonly records one result per call; "
                "make it return its result"
            )
        self.is_async = inspect.iscoroutinefunction(fn)
        self.sig, self.hints = _resolved(fn)
        for p in self.sig.parameters.values():
            if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
                raise TypeError(
                    f"tool {name!r} takes *{p.name}: ADK declares named parameters only, and so does the key; give "
                    "the function named parameters"
                )
        found = find_context_parameter(fn)
        self.context = found or _CONTEXT
        self.takes_context = self.context in self.sig.parameters
        self.schema = _arguments_schema(self.sig, self.hints, skip={self.context, edge.KEY_PARAM})
        self.pre_guarded = edge.is_guarded(fn)
        if self.pre_guarded:
            if policy:
                raise TypeError(
                    f"{name!r} is already an @ledger.tool function: its settings are its decorator's; pass the plain "
                    "function to guard(..., **policy), or no settings"
                )
            if fn.ledger is not ledger:  # type: ignore[attr-defined]
                raise TypeError(f"{name!r} is guarded by another ledger ({fn.ledger!r}) than the one given")  # type: ignore[attr-defined]
            if long_running:
                raise TypeError(
                    f"{name!r} is an @ledger.tool function in a LongRunningFunctionTool: its empty answer (ADK waits "
                    "for the client's) would be recorded as its result; pass the plain function, whose pause gives "
                    "the claim back"
                )
            if self.takes_context:
                raise TypeError(
                    f"{name!r} is an @ledger.tool function that takes ADK's {self.context!r}: it would be part of "
                    "the key; pass the plain function to onceonly.google_adk.guard(), which leaves it out"
                )
            self.fn: Any = fn
            return
        body = _body(fn, self.sig, self.context if self.takes_context else None, self.is_async)
        ignore = (*policy.pop("ignore", ()), _CALL)
        passthrough = (*policy.pop("passthrough", ()), _Paused)
        self.fn = ledger.tool(name=name, ignore=ignore, passthrough=passthrough, **policy)(body)

    def fields(self, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The ToolContext ADK injected, and the model's arguments."""
        ctx = kwargs.get(self.context) if self.takes_context else kwargs.pop(self.context, None)
        fields = {k: v for k, v in kwargs.items() if k != self.context}
        try:
            # ADK hands the model's JSON on unchecked (unless its arg-validation feature is on): keyed as
            # the function's types read it, "500" and 500 for an int are one call (the edge contract).
            return ctx, coerce(self.schema, fields)
        except SchemaError:
            return ctx, fields  # arguments the types do not take: keyed, and passed on, as ADK gave them

    def scoped(self, ctx: Any) -> contextlib.AbstractContextManager[Any]:
        if edge.task_scope() is not None:  # the caller's ledger.task() around the run wins
            return contextlib.nullcontext()
        scope = self.scope(ctx) if ctx is not None else None
        if scope is None:
            run = getattr(ctx, "invocation_id", None)
            if not isinstance(run, str) or not run:
                return contextlib.nullcontext()  # code called the function itself: the ledger's scope
            scope = edge.run_scope(run, integration="google-adk", setting=SETTING)
        return self.ledger.task(scope)

    def arguments(self, ctx: Any, fields: dict[str, Any]) -> tuple[dict[str, Any], _Invocation]:
        call = _Invocation(ctx, self.long_running)
        if self.pre_guarded:
            return fields, call
        return {**fields, _CALL: call}, call

    def respond(self, out: Outcome, call: _Invocation) -> Any:
        """The tool's own result when this call ran it; for a replay, the text that says it was not repeated."""
        if not out.replayed and call.has_raw:
            return call.raw
        if out.replayed and self.tell_model:
            told = edge.envelope(out)
            return _told(told.state, told.text)
        return out.result

    def refused(self, err: BaseException) -> dict[str, str]:
        # The operator's next step (onceonly resolve ...) goes to the log, the model's text to the model.
        _log.warning("onceonly %s: %s", getattr(err, "key", self.name), err)
        told = edge.envelope(err)
        return _told(told.state, told.text)

    def call(self, kwargs: dict[str, Any]) -> Any:
        ctx, fields = self.fields(kwargs)
        arguments, call = self.arguments(ctx, fields)
        try:
            with self.scoped(ctx):
                out: Outcome = self.fn.outcome(**arguments)
        except _Paused as paused:
            return paused.value
        except TOLD as err:
            return self.refused(err)
        return self.respond(out, call)

    async def acall(self, kwargs: dict[str, Any]) -> Any:
        ctx, fields = self.fields(kwargs)
        arguments, call = self.arguments(ctx, fields)
        try:
            with self.scoped(ctx):
                out: Outcome = await self.fn.outcome(**arguments)
        except _Paused as paused:
            return paused.value
        except TOLD as err:
            return self.refused(err)
        return self.respond(out, call)


def _resolved(fn: Callable[..., Any]) -> tuple[inspect.Signature, dict[str, Any]]:
    """``fn``'s signature with its annotations resolved (they may be strings of the user's module), so
    that ADK, reading them off another function, declares the same parameters."""
    sig = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception:  # an unresolvable forward reference: ADK reads what is written, as for the original
        hints = {}
    params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()]
    return sig.replace(parameters=params, return_annotation=hints.get("return", sig.return_annotation)), hints


def _body(
    fn: Callable[..., Any], sig: inspect.Signature, context: str | None, asynchronous: bool
) -> Callable[..., Any]:
    """The function the ledger guards: the model's arguments are its parameters (so ``key=``,
    ``ignore=`` and ``normalize=`` name them), the invocation its hidden one."""
    positional = tuple(p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.POSITIONAL_ONLY)

    def split(kwargs: dict[str, Any]) -> tuple[list[Any], _Invocation]:
        call: _Invocation = kwargs.pop(_CALL)
        if context is not None:
            kwargs[context] = call.ctx
        return [kwargs.pop(n) for n in positional if n in kwargs], call

    if asynchronous:

        async def abody(**kwargs: Any) -> Any:
            args, call = split(kwargs)
            return call.keep(await fn(*args, **kwargs))

        made: Any = abody
    else:

        def body(**kwargs: Any) -> Any:
            args, call = split(kwargs)
            return call.keep(fn(*args, **kwargs))

        made = body
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in sig.parameters.values() if p.name != context]
    params.append(inspect.Parameter(_CALL, inspect.Parameter.KEYWORD_ONLY, default=None))
    made.__signature__ = inspect.Signature(params)
    made.__name__ = made.__qualname__ = getattr(fn, "__name__", "tool")
    made.__doc__ = fn.__doc__
    return made  # type: ignore[no-any-return]


def _adk_function(spec: _Guard, fn: Callable[..., Any], shown: str) -> Callable[..., Any]:
    """The function ADK's tool calls: ``fn``'s name, docstring and parameters (less ``idempotency_key``,
    plus a ``ToolContext`` when ``fn`` takes none), as keyword arguments."""
    if spec.is_async:

        async def acall(**kwargs: Any) -> Any:
            return await spec.acall(kwargs)

        made: Any = acall
    else:

        def call(**kwargs: Any) -> Any:
            return spec.call(kwargs)

        made = call
    params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in spec.sig.parameters.values() if p.name != _KEY]
    hints = {k: v for k, v in spec.hints.items() if k != _KEY}
    if not spec.takes_context:
        params.append(inspect.Parameter(_CONTEXT, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=ToolContext))
        hints[_CONTEXT] = ToolContext
    made.__signature__ = spec.sig.replace(parameters=params)
    made.__annotations__ = hints
    made.__name__ = made.__qualname__ = shown  # ADK's tool name: name= is the ledger's alone
    made.__module__ = getattr(fn, "__module__", __name__)
    made.__doc__ = fn.__doc__
    made.__onceonly_guard__ = spec
    return made  # type: ignore[no-any-return]


# --- guard(), guard_tools() -------------------------------------------------------------------------

# One guarded tool per (ledger, original, settings): guarding the same tool again returns it.
_wrappers: Wrappers[Any] = Wrappers()


def _marked(tool: Any) -> _Guard | None:
    found = getattr(getattr(tool, "func", tool), "__onceonly_guard__", None)
    return found if isinstance(found, _Guard) else None


def _original(tool: Any) -> tuple[Callable[..., Any], str, bool, Any]:
    """The function behind ``tool``, its tool name, whether it runs long, and its confirmation setting."""
    if isinstance(tool, FunctionTool):
        if type(tool) not in (FunctionTool, LongRunningFunctionTool):
            raise TypeError(
                f"onceonly.google_adk.guard takes a FunctionTool, a LongRunningFunctionTool or a function, not "
                f"{type(tool).__qualname__} (it runs its function its own way): guard the function behind it"
            )
        # FunctionTool keeps its confirmation setting private; the pinned 2.x line has it as _require_confirmation.
        confirm = getattr(tool, "_require_confirmation", False)
        return tool.func, tool.name, bool(getattr(tool, "is_long_running", False)), confirm
    if isinstance(tool, BaseTool):
        raise TypeError(
            f"onceonly.google_adk.guard takes a FunctionTool or a function, not {type(tool).__qualname__}: guard the "
            "function behind it"
        )
    if not callable(tool):
        raise TypeError(f"onceonly.google_adk.guard takes a FunctionTool or a function, not {tool!r}")
    return tool, getattr(tool, "__name__", type(tool).__name__), False, False


def guard(
    tool: Any,
    ledger: Ledger,
    *,
    name: str | None = None,
    tell_model: bool = True,
    scope: ScopeFunction = session_scope,
    **policy: Any,
) -> Any:
    """An ADK ``FunctionTool`` whose calls happen once per session: the same call again replays.

    Args:
        tool: a plain function (sync or async; a ``tool_context: ToolContext`` parameter is injected by
            ADK as usual), an ``@ledger.tool`` function (then its decorator's settings apply), a
            ``FunctionTool`` or a ``LongRunningFunctionTool`` (its class and confirmation setting kept).
        ledger: the ledger the calls go through.
        name: the tool's name in the ledger's keys; default the tool's name.
        tell_model: a replay reaches the model as ``{"status": "replayed", "message": ...}`` ("already done
            at ..., not repeated; its result: ..."); ``False``: the recorded result, as the original read.
        scope: ``tool_context -> scope | None`` (default ``session_scope``: app, user and session id).
        policy: the keyword arguments of ``@ledger.tool`` (``key=``, ``normalize=``, ``on_conflict=``,
            ``on_unknown=``, ``probe=``, ``retry=``, ``timeout=``...), naming the function's parameters.

    Returns:
        A ``FunctionTool`` (a ``LongRunningFunctionTool`` for one) with the same declaration.

    .. versionadded:: 0.1
    """
    found = _marked(tool)
    if found is not None:
        raise TypeError(
            f"tool {found.name!r} is guarded already (on {found.ledger.url}); guard the original once, with all its "
            "settings"
        )
    fn, shown, long_running, confirm = _original(tool)
    if "decode" in policy:
        raise TypeError("decode= does not apply here: a replay re-emits the recorded result")

    def make() -> Any:
        spec = _Guard(fn, ledger, name or shown, tell_model, scope, long_running, dict(policy))
        function = _adk_function(spec, fn, shown)
        if long_running:
            made: Any = LongRunningFunctionTool(function)
            made._require_confirmation = confirm
        else:
            made = FunctionTool(function, require_confirmation=confirm)
        made.name = shown
        return made

    return _wrappers.get(ledger, tool, (name, tell_model, scope, policy), make)


def _guardable(tool: Any) -> bool:
    """A function, or one of the function tools guard() takes, not guarded yet."""
    if _marked(tool) is not None:
        return False
    if isinstance(tool, FunctionTool):
        return type(tool) in (FunctionTool, LongRunningFunctionTool)
    return callable(tool) and not isinstance(tool, BaseTool | type)


def guard_tools(tools: Sequence[Any], ledger: Ledger, **options: Any) -> list[Any]:
    """``guard()`` each function and function tool with the same settings (``tell_model=``, ``scope=`` and
    the policy of ``@ledger.tool``). Tools guarded already, other tools (an ``AgentTool``, MCP or Google
    search tools) and toolsets pass as they are: guard the functions they run.

    .. versionadded:: 0.1
    """
    if "name" in options:
        raise TypeError("guard_tools() gives every tool its own name: use guard(tool, ledger, name=...) for one")
    return [guard(t, ledger, **options) if _guardable(t) else t for t in tools]


# --- the plugin: every function tool of every agent of a runner -------------------------------------


class OnceOnlyPlugin(BasePlugin):  # type: ignore[misc]
    """An ADK plugin that guards the function tools of every agent its app runs:
    ``App(name=..., root_agent=agent, plugins=[OnceOnlyPlugin(ledger)])``.

    Before a run it replaces, in the root agent and each sub-agent, the plain functions,
    ``FunctionTool``s and ``LongRunningFunctionTool``s of ``tools`` with guarded ones (guarding is
    idempotent: the same tool gives the same guarded tool); before each model call it does the same for
    the tools toolsets gave that request. Other tools pass as they are.

    Args:
        ledger: the ledger the calls go through.
        only: the names of the tools to guard (default every function tool): leave out the read-only ones.
        name: the plugin's name in the runner.
        options: as for ``guard_tools()`` (``tell_model=``, ``scope=`` and ``@ledger.tool``'s policy).

    .. versionadded:: 0.1
    """

    def __init__(
        self, ledger: Ledger, *, only: Collection[str] | None = None, name: str = "onceonly", **options: Any
    ) -> None:
        super().__init__(name=name)
        if "name" in options:
            raise TypeError(
                "OnceOnlyPlugin gives every tool its own name: guard one with guard(tool, ledger, name=...)"
            )
        self.ledger = ledger
        self.only = None if only is None else frozenset(only)
        self.options = options

    def _wanted(self, tool: Any) -> bool:
        if not _guardable(tool):
            return False
        tool_name = tool.name if isinstance(tool, BaseTool) else getattr(tool, "__name__", None)
        return self.only is None or tool_name in self.only

    def _guarded(self, tools: Sequence[Any]) -> list[Any]:
        return [guard(t, self.ledger, **self.options) if self._wanted(t) else t for t in tools]

    async def before_run_callback(self, *, invocation_context: Any) -> None:
        seen: set[int] = set()
        pending = [getattr(invocation_context, "agent", None)]
        while pending:
            agent = pending.pop()
            if agent is None or id(agent) in seen:
                continue
            seen.add(id(agent))
            tools = getattr(agent, "tools", None)
            if isinstance(tools, list) and any(self._wanted(t) for t in tools):
                agent.tools = self._guarded(tools)
            pending.extend(getattr(agent, "sub_agents", None) or ())

    async def before_model_callback(self, *, callback_context: Any, llm_request: Any) -> None:
        tools = getattr(llm_request, "tools_dict", None)
        if not isinstance(tools, dict):
            return
        for key, tool in list(tools.items()):
            if self._wanted(tool):
                tools[key] = guard(tool, self.ledger, **self.options)


def _arguments_schema(sig: inspect.Signature, hints: dict[str, Any], *, skip: Collection[str]) -> dict[str, Any] | None:
    """The JSON Schema of the model's arguments, from the function's signature (pydantic, which ADK builds
    its own declarations with); ``None`` when a type has none (the arguments are then keyed as given)."""
    import pydantic  # ADK's own dependency

    fields: dict[str, Any] = {}
    for p in sig.parameters.values():
        if p.name in skip:
            continue
        default = ... if p.default is inspect.Parameter.empty else p.default
        fields[p.name] = (hints.get(p.name, Any), default)
    try:
        schema: dict[str, Any] = pydantic.create_model("Arguments", **fields).model_json_schema()
    except (TypeError, ValueError, NameError, pydantic.PydanticUserError):
        return None
    return schema
