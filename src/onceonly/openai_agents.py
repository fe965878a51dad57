"""OpenAI Agents SDK: function tools whose calls go through an onceonly ledger, and MCP calls that carry a key.

    from onceonly.openai_agents import function_tool, guard_tools, mcp_meta_resolver

    @function_tool(ledger)
    async def charge(customer: str, cents: int) -> str: ...  # its docstring is the tool's description

    agent = Agent(name="billing", tools=[charge, *guard_tools([refund], ledger)])
    result = await Runner.run(agent, text, run_config=RunConfig(group_id=conversation_id))

A guarded tool is the SDK's own ``FunctionTool``, with the same name, description and strict argument
schema. The guard sits inside the tool's invoker, below the SDK's ``failure_error_function``: the
tool's exception reaches the ledger (a failed attempt) before the SDK turns it into the text the model
reads, so an error is never recorded as a result and replayed. The argument JSON reaches the tool
unchanged; ``ToolContext`` is not part of it, so it is never part of a key.

A call's key is the conversation (``RunConfig.group_id``, else the trace's group, else the
``ledger.task()`` around the run, else the run itself, with one warning), the tool's name and its
canonical arguments. Never the call id: the model that re-plans a call after the SDK's time limit sends it under
a new id, and the call must replay.

.. versionadded:: 0.1
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import json
import keyword
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from onceonly._install import install_hint

try:
    import agents
    from agents import (
        FunctionTool,
        ModelBehaviorError,
        RunContextWrapper,
        ToolOutputFileContent,
        ToolOutputImage,
        ToolOutputText,
    )

    # The failure-handling invoker and its markers are the SDK's internals (hence the tight pin): the guard
    # must sit under the failure handler, and a copied tool must keep what the SDK reads off its invoker.
    from agents.tool import (
        _FUNCTION_TOOL_WRAPPED_CALLABLE_MARKER,
        _SYNC_FUNCTION_TOOL_MARKER,
        ValidToolOutputPydanticModelsTypeAdapter,
        _FailureHandlingFunctionToolInvoker,
        _get_function_tool_invoke_context,
    )
    from agents.tool_context import ToolContext
    from agents.tracing import get_current_trace
    from pydantic import TypeAdapter, ValidationError
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(f"onceonly.openai_agents needs the OpenAI Agents SDK: {install_hint('openai-agents')}") from exc

from onceonly import edge
from onceonly.errors import OutcomeUnknown
from onceonly.keys import canonical_json, fingerprint, safe_name
from onceonly.mcp.core import meta as mcp_meta
from onceonly.plan import Outcome
from onceonly.plan.approval import needs_person
from onceonly.schema import SchemaError, coerce
from onceonly.tell import TOLD
from onceonly.tools import Wrappers

if TYPE_CHECKING:
    from agents.mcp import MCPToolMetaContext

    from onceonly.ledger import Ledger

__all__ = ["conversation_scope", "function_tool", "guard", "guard_tools", "mcp_meta_resolver", "run_scope"]

_log = logging.getLogger("onceonly.openai_agents")

#: The guarded body's hidden parameter: this invocation's context and raw arguments. It is left out of
#: the key and the fingerprint (``ignore=``).
_CALL = "_onceonly_call"
#: The parameter of an argument schema that is not a set of named fields: the whole JSON object.
_WHOLE = "arguments"
#: The argument through which a function gets the ledger's key (``@ledger.tool``'s convention).
_KEY = "idempotency_key"
#: Outcomes the model is told about instead of a result (the operator's text goes to the log).
#: The longest conversation id used as a scope as it is; a longer one (or one with whitespace) is hashed.
_MAX_SCOPE = 100

ScopeFunction = Callable[[RunContextWrapper[Any]], "str | None"]


# --- scope: the conversation ----------------------------------------------------------------------


def conversation_scope(ctx: RunContextWrapper[Any]) -> str | None:
    """The ledger scope of a tool call: the run's ``RunConfig.group_id``, else the group of the trace it
    runs in (``with agents.trace(name, group_id=...)``).

    ``None`` when the run names no conversation: the ``ledger.task(...)`` around the run applies, else
    the run's own scope (``run_scope``), so that two runs — maybe two users — never share records
    unless told to. The SDK does not show a tool the run's ``session``: with a session and no
    ``group_id``, pass ``RunConfig(group_id=session.session_id)``, or run inside
    ``ledger.task(session.session_id)``.

    An id longer than 100 characters, or with whitespace, is hashed.

    .. versionadded:: 0.1
    """
    run_config = getattr(ctx, "run_config", None)
    group = getattr(run_config, "group_id", None)
    if not group:
        group = getattr(get_current_trace(), "group_id", None)
    if not isinstance(group, str) or not group.strip():
        return None
    return _scope_text(group)


def run_scope(ctx: RunContextWrapper[Any]) -> str:
    """The scope of a call in a run that names no conversation: the run's own — its trace's id, or, with
    tracing off, the run's own context — so that a re-plan inside the run replays and another run
    (another user, maybe) runs its own. Logs one warning naming ``RunConfig(group_id=...)``.

    .. versionadded:: 0.1
    """
    trace_id = getattr(get_current_trace(), "trace_id", None)
    if isinstance(trace_id, str) and trace_id and trace_id != "no-op":
        run = trace_id
    else:  # tracing off: the run's usage counter, made once per run and shared by its every tool context
        usage = getattr(ctx, "usage", None)
        run = edge.run_identity(usage if usage is not None else ctx)
    return edge.run_scope(run, integration="openai-agents", setting="RunConfig(group_id=conversation_id)")


@functools.lru_cache(maxsize=1024)  # a conversation asks again at every call
def _scope_text(group: str) -> str:
    return safe_name(group, limit=_MAX_SCOPE, prefix="group-")


# --- what is stored, and what the model reads ---------------------------------------------------------

_STRUCTURED = (ToolOutputText, ToolOutputImage, ToolOutputFileContent)


def _structured(value: Any) -> Any:
    """The JSON form of one structured output (``ToolOutputText``... or its dict form), or ``None``."""
    if isinstance(value, _STRUCTURED):
        return value.model_dump(mode="json", exclude_none=True)
    if isinstance(value, dict) and "type" in value:
        try:
            ValidToolOutputPydanticModelsTypeAdapter.validate_python(value)
            canonical_json(value, path="result")
        except (ValidationError, TypeError, ValueError):
            return None
        return value
    return None


_ANY = TypeAdapter(Any)


def _stored(value: Any, with_schema: bool) -> Any:
    """What the ledger keeps of a tool's output: what the model read, as JSON.

    A string as it is; structured outputs (text, image, file, or a list of them) in their dict form,
    which the SDK takes back as the same output; for a tool with an output schema, its JSON form (the
    SDK validates it again); anything else as the text the SDK made of it (``str``)."""
    if isinstance(value, str):
        return value
    if with_schema:
        return _ANY.dump_python(value, mode="json")
    if isinstance(value, list | tuple):
        parts = [_structured(v) for v in value]
        if parts and all(p is not None for p in parts):
            return parts
        return str(value)
    one = _structured(value)
    return one if one is not None else str(value)


def _shown(stored: Any) -> Any:
    """A stored output as the model read it, for ``tell_model``: the text of text outputs."""
    if isinstance(stored, dict) and stored.get("type") == "text" and isinstance(stored.get("text"), str):
        return stored["text"]
    if isinstance(stored, list) and stored and all(isinstance(s, dict) and s.get("type") == "text" for s in stored):
        return "\n".join(str(s.get("text", "")) for s in stored)
    return stored


# --- one call of a guarded tool ---------------------------------------------------------------------


class _Target:
    """The invoker a guarded body runs. Two are one definition (the ledger's check that a tool name
    stands for one function) when they invoke the same function: a tool built again from it."""

    __slots__ = ("identity", "invoke")

    def __init__(self, identity: object, invoke: Callable[[Any, str], Awaitable[Any]]) -> None:
        self.identity = identity
        self.invoke = invoke

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Target) and self.identity is other.identity

    def __hash__(self) -> int:
        return id(self.identity)


class _Invocation:
    """One call: its context and raw arguments, and, once the tool ran, what it returned."""

    __slots__ = ("args_json", "ctx", "has_raw", "raw", "with_schema")

    def __init__(self, ctx: Any, args_json: str, with_schema: bool) -> None:
        self.ctx = ctx
        self.args_json = args_json
        self.with_schema = with_schema
        self.raw: Any = None
        self.has_raw = False

    def keep(self, output: Any) -> Any:
        """Keep the output for this caller; return the form the ledger stores."""
        self.raw, self.has_raw = output, True
        try:
            return _stored(output, self.with_schema)
        except Exception as exc:
            # The side effect happened: an output with no stored form must not make it a failed attempt
            # (which would run again), so the record keeps a description of it.
            return {"$unstorable": type(output).__name__, "error": f"{type(exc).__name__}: {exc}"[:500]}


def _body(target: _Target) -> Callable[..., Awaitable[Any]]:
    """The function the ledger guards: the model's arguments are its parameters (so ``key=``,
    ``ignore=`` and ``normalize=`` name them), the invocation its hidden one."""

    async def body(**fields: Any) -> Any:
        call: _Invocation = fields[_CALL]
        return call.keep(await target.invoke(call.ctx, call.args_json))

    return body


def _param_names(tool: FunctionTool, sdk_built: bool) -> tuple[str, ...] | None:
    """The named fields a call's key is made of, or ``None`` when the whole JSON object is.

    A tool made by ``function_tool`` passes its function only the fields of its schema (pydantic drops
    others), so those are the operation. A hand-made tool whose schema is open may use what else the
    model sends: then the whole object is."""
    schema = tool.params_json_schema
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return None
    names = tuple(props)
    if not (sdk_built or schema.get("additionalProperties") is False):
        return None
    if all(n.isidentifier() and not keyword.iskeyword(n) and n != _CALL for n in names):
        return names
    return None


class _Guard:
    """One guarded tool: the ledger's function, and how a call reaches the original invoker."""

    def __init__(
        self,
        tool: FunctionTool,
        ledger: Ledger,
        name: str,
        tell_model: bool,
        scope: ScopeFunction,
        policy: dict[str, Any],
        identity: object,
    ) -> None:
        self.ledger = ledger
        self.tell_model = tell_model
        self.scope = scope
        #: ``approve=`` of the policy: the SDK's approval flow asks a person, and its yes is the ledger's.
        self.approve = policy.get("approve", False) is not False
        #: The scope each recent run's calls took (``scoped``), by the run's identity.
        self.run_scopes: dict[str, str] = {}
        self.with_schema = tool.output_json_schema is not None
        self.params_schema: dict[str, Any] | None = tool.params_json_schema or None
        invoker = tool.on_invoke_tool
        self.sdk_built = isinstance(invoker, _FailureHandlingFunctionToolInvoker)
        if isinstance(invoker, _FailureHandlingFunctionToolInvoker):
            # Below the failure handler: the tool's exception reaches the ledger, not its error text.
            self.inner: Callable[[Any, str], Awaitable[Any]] = invoker._invoke_tool_impl
        else:
            self.inner = _with_context(tool, invoker)
        self.named = _param_names(tool, self.sdk_built)
        target = _Target(identity, self.inner)
        body: Any = _body(target)
        fields = self.named if self.named is not None else (_WHOLE,)
        params = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in fields]
        params.append(inspect.Parameter(_CALL, inspect.Parameter.KEYWORD_ONLY))
        body.__signature__ = inspect.Signature(params)
        body.__name__ = body.__qualname__ = name
        body.__doc__ = tool.description
        ignore = (*policy.pop("ignore", ()), _CALL)
        try:
            self.fn: Any = ledger.tool(name=name, ignore=ignore, **policy)(body)
        except TypeError as err:
            if "are not parameters of" not in str(err):
                raise
            takes = f"the fields {list(self.named)}" if self.named is not None else f"one JSON object, {_WHOLE!r}"
            raise TypeError(
                f"tool {name!r}: key=, ignore= and normalize= name its arguments, and it takes {takes} ({err})"
            ) from None

    def fields(self, parsed: dict[str, Any]) -> dict[str, Any]:
        if self.named is None:
            return {_WHOLE: parsed}
        return {n: parsed[n] for n in self.named if n in parsed}

    def scoped(self, ctx: Any, *, asking: bool = False) -> contextlib.AbstractContextManager[Any]:
        """The scope of a call of this tool in the run of ``ctx``. ``asking``: for the approval hook,
        which the SDK hands the run's context without its ``RunConfig``: a ``group_id`` it cannot read
        there is the one the run's earlier calls took."""
        scope = self.scope(ctx)
        run = _run_of(ctx)
        if scope is None and asking and run is not None:
            scope = self.run_scopes.get(run)
        if scope is None:
            if edge.task_scope() is not None:  # the caller's ledger.task() around the run
                return contextlib.nullcontext()
            scope = run_scope(ctx)
        elif run is not None and not asking:
            if len(self.run_scopes) >= _RUNS_KEPT:
                self.run_scopes.pop(next(iter(self.run_scopes)))
            self.run_scopes[run] = scope
        return self.ledger.task(scope)

    async def invoke(self, ctx: ToolContext[Any], args_json: str) -> Any:
        """What the SDK calls with the model's arguments: the ledger decides whether the tool runs."""
        try:
            parsed = json.loads(args_json) if args_json else {}
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            if self.sdk_built:
                return await self.inner(ctx, args_json)  # it refuses them before the function runs
            # A hand-made invoker might act on them: not without the ledger.
            raise ModelBehaviorError(f"Invalid JSON input for tool {ctx.tool_name}: expected a JSON object")
        try:  # keyed as the tool will see them: 500, "500" and 500.0 are one charge
            parsed = coerce(self.params_schema, parsed)
        except SchemaError as err:  # nothing recorded; the SDK's failure handler tells the model
            raise ModelBehaviorError(f"Invalid arguments for tool {ctx.tool_name}: {err}") from None
        call = _Invocation(ctx, args_json, self.with_schema)
        try:
            with self.scoped(ctx):
                if self.approve and _approved_here(ctx):
                    self._record_approval(ctx, parsed)
                out: Outcome = await self.fn.outcome(**self.fields(parsed), **{_CALL: call})
        except TOLD as err:
            # The operator's next step (onceonly resolve ...) goes to the log, the model's to the model.
            _log.warning("onceonly %s: %s", getattr(err, "key", "?"), err)
            return edge.envelope(err).text
        return self.respond(out, call)

    def _record_approval(self, ctx: ToolContext[Any], parsed: dict[str, Any]) -> None:
        """The SDK's approval flow approved this call (``RunState.approve``): the ledger's record of the
        operation is approved too, so that it runs once and a replay asks no one."""
        spec = self.fn.spec
        ledger_call = spec.call((), {**self.fields(parsed), _CALL: None}, None, 1)
        if ledger_call.approve:
            call_id = getattr(ctx, "tool_call_id", "?")
            why = f"approved in the Agents SDK run (call {call_id})"
            spec.approve_call(ledger_call, by="openai-agents", reason=why)

    async def asks(self, ctx: RunContextWrapper[Any], params: dict[str, Any]) -> tuple[bool, bool]:
        """Whether this call would start its operation anew with no approval standing (``needs_person``),
        and whether its tool's ``approve=`` asks for one: read from its record, nothing written."""
        try:
            parsed = coerce(self.params_schema, params)
        except SchemaError:
            return True, self.approve  # the SDK refuses them after its approval, and the ledger never sees them
        spec = self.fn.spec
        with self.scoped(ctx, asking=True):
            ledger_call = spec.call((), {**self.fields(parsed), _CALL: None}, None, 1)
        store: Any = self.ledger.store
        rec = await store.aget(ledger_call.key)
        return needs_person(rec, self.ledger.clock(), spec.policy.retry.attempts), ledger_call.approve

    def respond(self, out: Outcome, call: _Invocation) -> Any:
        """The tool's own output when this call ran it; else the recorded one, and for a replay the
        text that says the action was not repeated."""
        if not out.replayed and call.has_raw:
            return call.raw
        stored = out.result
        if out.replayed and self.tell_model and not self.with_schema:
            return edge.envelope(_replace_result(out, _shown(stored))).text
        return stored


def _replace_result(out: Outcome, result: Any) -> Outcome:
    return dataclasses.replace(out, result=result)


def _with_context(tool: FunctionTool, invoker: Callable[..., Awaitable[Any]]) -> Callable[[Any, str], Awaitable[Any]]:
    """A hand-made invoker, passed the context it declares (the SDK narrows a ``ToolContext`` to a
    ``RunContextWrapper`` for an invoker that asks for one)."""

    async def invoke(ctx: Any, args_json: str) -> Any:
        return await invoker(_get_function_tool_invoke_context(tool, ctx), args_json)

    return invoke


#: Runs whose scope a guarded tool remembers for its approval hook (the oldest is dropped first).
_RUNS_KEPT = 1024


def _run_of(ctx: Any) -> str | None:
    """The identity of the run ``ctx`` belongs to: its usage counter, shared by the run's every context."""
    usage = getattr(ctx, "usage", None)
    if usage is None:
        return None
    try:
        return edge.run_identity(usage)
    except TypeError:
        return None


def _approved_here(ctx: Any) -> bool:
    """Whether the SDK's own approval flow approved this very call (its call id)."""
    check = getattr(ctx, "is_tool_approved", None)
    name, call_id = getattr(ctx, "tool_name", None), getattr(ctx, "tool_call_id", None)
    if not callable(check) or not name or not call_id:
        return False
    return check(name, call_id) is True


def _approval_hook(spec: _Guard, setting: Any) -> Callable[..., Awaitable[bool]]:
    """The tool's ``needs_approval``: a person is asked only for a call that would start its operation
    anew with no approval standing in the ledger. A replay, a call already approved (by the SDK or
    ``onceonly approve``), one another caller runs, a denial: nobody is asked, and the guard answers.
    Then ``approve=`` decides (the SDK asks), else the tool's own ``needs_approval`` (``setting``)."""

    async def needs_approval(ctx: RunContextWrapper[Any], params: dict[str, Any], call_id: str) -> bool:
        would, approve = await spec.asks(ctx, params)
        if not would:
            return False
        if approve or setting is True:
            return True
        if not callable(setting):
            return False
        said = setting(ctx, params, call_id)
        return bool(await said if inspect.isawaitable(said) else said)

    return needs_approval


def _timeout_text(ctx: RunContextWrapper[Any], error: Exception) -> str:
    """What the model reads when the SDK's time limit passes: the call runs on and its outcome is
    recorded, so the outcome is unknown, not failed ("timed out" invites the same call again)."""
    return edge.envelope(OutcomeUnknown(str(error), key=getattr(ctx, "tool_name", ""))).text


def _marked(invoker: object) -> _Guard | None:
    impl = getattr(invoker, "_invoke_tool_impl", invoker)
    found = getattr(impl, "__onceonly_guard__", None)
    return found if isinstance(found, _Guard) else None


def _guarded_tool(tool: FunctionTool, spec: _Guard) -> FunctionTool:
    """A copy of ``tool`` whose invoker goes through ``spec``: the SDK's failure handler, approval
    argument preparation and wrapped callable kept."""
    invoker = tool.on_invoke_tool

    async def on_invoke(ctx: ToolContext[Any], args_json: str) -> Any:
        return await spec.invoke(ctx, args_json)

    made_invoker: Any = on_invoke
    if isinstance(invoker, _FailureHandlingFunctionToolInvoker):
        impl = invoker._invoke_tool_impl
        for attr in ("__agents_prepare_arguments__", _FUNCTION_TOOL_WRAPPED_CALLABLE_MARKER):
            if hasattr(impl, attr):
                setattr(on_invoke, attr, getattr(impl, attr))
        made_invoker = _FailureHandlingFunctionToolInvoker(on_invoke, invoker._on_handled_error)
        if getattr(invoker, _SYNC_FUNCTION_TOOL_MARKER, False):
            setattr(made_invoker, _SYNC_FUNCTION_TOOL_MARKER, True)
    cast_on_invoke: Any = on_invoke
    cast_on_invoke.__onceonly_guard__ = spec
    made = copy.copy(tool)  # FunctionTool.__copy__: subclasses too, normalised again
    bind = getattr(made_invoker, "__agents_bind_function_tool__", None)
    made.on_invoke_tool = bind(made) if callable(bind) else made_invoker
    if made.timeout_seconds is not None and made.timeout_error_function is None:
        made.timeout_error_function = _timeout_text
    if spec.approve or tool.needs_approval is not False:
        made.needs_approval = _approval_hook(spec, tool.needs_approval)
    return made


# --- guard(), guard_tools() -------------------------------------------------------------------------

# One guarded tool per (ledger, original, settings): guarding the same tool again returns it.
_wrappers: Wrappers[FunctionTool] = Wrappers()


def _identity(tool: FunctionTool) -> object:
    """What a tool invokes, to tell one function from another under one name."""
    try:
        return tool.__wrapped__  # the function given to the SDK's function_tool
    except AttributeError:
        invoker = tool.on_invoke_tool
        return getattr(invoker, "_invoke_tool_impl", invoker)


def guard(
    tool: FunctionTool,
    ledger: Ledger,
    *,
    name: str | None = None,
    tell_model: bool = True,
    scope: ScopeFunction = conversation_scope,
    **policy: Any,
) -> FunctionTool:
    """A ``FunctionTool`` whose calls happen once per conversation: the same call again replays.

    Args:
        tool: a ``FunctionTool`` (``@agents.function_tool``, or made by hand).
        ledger: the ledger the calls go through.
        name: the tool's name in the ledger's keys; default the tool's name.
        tell_model: a replay reaches the model as ``onceonly.tell_model(outcome)`` ("already done at
            ..., not repeated; result: ..."); ``False``: exactly as the original output read.
        scope: ``context -> scope | None`` (default ``conversation_scope``: the run's ``group_id``).
        policy: the keyword arguments of ``@ledger.tool`` (``key=``, ``normalize=``, ``on_conflict=``,
            ``on_unknown=``, ``probe=``, ``retry=``, ``timeout=``...), naming the tool's arguments.

    An outcome the model must hear about (unknown, in progress, a conflict, attempts exhausted) is the
    tool's output in ``onceonly.tell_model``'s words; the operator's instructions go to the
    ``onceonly.openai_agents`` log. When the SDK's own time limit (``timeout_seconds``) passes, the call
    runs on and its late outcome is recorded; unless the tool has a ``timeout_error_function``, the model
    reads that the outcome is unknown and must not be issued again.

    .. versionadded:: 0.1
    """
    return _guard(tool, ledger, name, tell_model, scope, policy, None)


def _guard(
    tool: FunctionTool,
    ledger: Ledger,
    name: str | None,
    tell_model: bool,
    scope: ScopeFunction,
    policy: dict[str, Any],
    identity: object,
) -> FunctionTool:
    if not isinstance(tool, FunctionTool):
        raise TypeError(
            f"guard() takes an Agents SDK FunctionTool, not {type(tool).__name__}; for a plain function use "
            "@onceonly.openai_agents.function_tool(ledger)"
        )
    found = _marked(tool.on_invoke_tool)
    if found is not None:
        raise TypeError(
            f"tool {tool.name!r} is guarded already (on {found.ledger.url}); guard the original once, "
            "with all its settings"
        )
    if tool._is_agent_tool or tool._is_codex_tool:
        raise TypeError(
            f"tool {tool.name!r} runs an agent: guard the tools that agent calls (guard_tools leaves an agent "
            "tool as it is)"
        )
    if "decode" in policy:
        raise TypeError("decode= does not apply here: a replay re-emits the recorded output")
    if _KEY in (tool.params_json_schema.get("properties") or {}):
        raise TypeError(
            f"tool {tool.name!r} asks the model for idempotency_key, so the model would choose keys: make it "
            "with @onceonly.openai_agents.function_tool(ledger), which fills the key in and leaves it out of "
            "the schema"
        )

    def make() -> FunctionTool:
        spec = _Guard(
            tool, ledger, name or tool.name, tell_model, scope, dict(policy),
            identity if identity is not None else _identity(tool),
        )  # fmt: skip
        return _guarded_tool(tool, spec)

    return _wrappers.get(ledger, tool, (name, tell_model, scope, policy), make)


def guard_tools(tools: Sequence[Any], ledger: Ledger, **options: Any) -> list[Any]:
    """``guard()`` each ``FunctionTool`` with the same settings (``tell_model=``, ``scope=`` and the
    policy of ``@ledger.tool``). Hosted tools (web search, file search...), tools guarded already and
    agents used as tools pass as they are: guard the tools of such an agent.

    .. versionadded:: 0.1
    """
    if "name" in options:
        raise TypeError("guard_tools() gives every tool its own name: use guard(tool, ledger, name=...) for one")
    out = []
    for tool in tools:
        if (
            not isinstance(tool, FunctionTool)
            or _marked(tool.on_invoke_tool) is not None
            or tool._is_agent_tool
            or tool._is_codex_tool
        ):
            out.append(tool)
        else:
            out.append(guard(tool, ledger, **options))
    return out


# --- function_tool() --------------------------------------------------------------------------------

# The SDK's keywords pass through; onceonly's keep their names. Both have timeout=: onceonly's is the
# per-attempt limit, the SDK's is tool_timeout=.
_SDK_OPTIONS = frozenset(inspect.signature(agents.function_tool).parameters) - {"func", "timeout"}


def _ledger_options() -> frozenset[str]:
    from onceonly.ledger import Ledger

    return frozenset(inspect.signature(Ledger.tool).parameters) - {"self", "fn", "name"}


def function_tool(
    ledger: Ledger,
    /,
    *,
    name: str | None = None,
    tool_timeout: float | None = None,
    tell_model: bool = True,
    scope: ScopeFunction = conversation_scope,
    **options: Any,
) -> Callable[[Callable[..., Any]], FunctionTool]:
    """Make an Agents SDK ``FunctionTool`` of a plain function, sync or async, whose calls go through
    ``ledger``: the SDK's ``@function_tool`` with onceonly below its error handling.

    ``@function_tool(ledger, key=("order_id",))`` over ``def refund(order_id: str, cents: int) -> str``.
    The schema is the SDK's (strict by default); a ``ToolContext`` or ``RunContextWrapper`` first
    parameter is passed as the SDK does and is never part of the key; an ``idempotency_key`` parameter is
    filled in with the call's key and left out of the schema, so the model never sees it.

    Args:
        ledger: the ledger the calls go through.
        name: the tool's name in the ledger's keys (default the tool's name; the SDK's is
            ``name_override=``).
        tool_timeout: the SDK's ``timeout=`` (seconds; async functions only): past it the model is told
            the outcome is unknown while the call runs on, and its late outcome is recorded.
        tell_model, scope: as for ``guard()``.
        options: the keywords of ``@ledger.tool`` (``key=``, ``normalize=``, ``on_unknown=``, ``probe=``,
            ``timeout=`` onceonly's per-attempt limit...) and of the SDK's ``function_tool``
            (``name_override=``, ``failure_error_function=``, ``needs_approval=``, ``strict_mode=``...).

    .. versionadded:: 0.1
    """
    ours = _ledger_options()
    policy = {k: v for k, v in options.items() if k in ours}
    sdk = {k: v for k, v in options.items() if k in _SDK_OPTIONS and k not in ours}
    unknown = sorted(set(options) - policy.keys() - sdk.keys())
    if unknown:
        raise TypeError(
            f"function_tool() got unexpected keywords {unknown}: it takes onceonly's policy "
            f"({', '.join(sorted(ours))}) and the SDK's function_tool keywords ({', '.join(sorted(_SDK_OPTIONS))}; "
            "the SDK's timeout= is tool_timeout=)"
        )

    def make(fn: Callable[..., Any]) -> FunctionTool:
        if isinstance(fn, FunctionTool):
            raise TypeError(
                f"{fn.name!r} is a FunctionTool already: guard it with onceonly.openai_agents.guard_tools([tool], "
                "ledger), or put @function_tool(ledger) on the plain function instead of the SDK's"
            )
        if hasattr(fn, "spec") and hasattr(fn, "outcome") and hasattr(fn, "ledger"):
            raise TypeError(
                f"{getattr(fn, '__name__', fn)!r} is guarded by @ledger.tool already: put "
                "@onceonly.openai_agents.function_tool(ledger) on the plain function (it keys calls by the "
                "conversation and tells the model of a replay)"
            )
        if not callable(fn):
            raise TypeError(f"function_tool(ledger) decorates a function, and got {type(fn).__name__}: {fn!r}")
        if tool_timeout is not None and not inspect.iscoroutinefunction(fn):
            raise TypeError(
                f"tool_timeout= (the SDK's timeout) needs an async def, and {getattr(fn, '__name__', fn)!r} is "
                "sync: make it async, or use timeout= (onceonly's per-attempt limit, which works for both)"
            )
        tool = agents.function_tool(edge.key_filled(fn), timeout=tool_timeout, **sdk)
        return _guard(tool, ledger, name, tell_model, scope, dict(policy), fn)

    return make


# --- MCP --------------------------------------------------------------------------------------------


def mcp_meta_resolver(
    ledger: Ledger | None = None,
    *,
    scope: ScopeFunction = conversation_scope,
) -> Callable[[MCPToolMetaContext], dict[str, Any] | None]:
    """A ``tool_meta_resolver`` for the SDK's MCP servers that puts an idempotency key in each
    ``tools/call``'s ``_meta``: ``MCPServerStdio(params, tool_meta_resolver=mcp_meta_resolver())``.

    The key is made of the conversation (``scope``), the tool's name and its canonical arguments, so the
    same call re-planned under a new call id, or re-sent by the SDK's ``max_retry_attempts``, carries the
    same key, and an onceonly-guarded MCP server runs it once. It goes in
    ``_meta["dev.onceonly/idempotencyKey"]``, the scope in ``_meta["dev.onceonly/scope"]``.

    Args:
        ledger: when the run names no conversation, the scope of the ``ledger.task()`` around the run,
            else the run's own (``run_scope``); without a ledger, such a call carries no key and the
            server decides (by who is calling).
        scope: ``context -> scope | None`` (default ``conversation_scope``: the run's ``group_id``).

    .. versionadded:: 0.1
    """

    def resolve(context: MCPToolMetaContext) -> dict[str, Any] | None:
        conversation = scope(context.run_context)
        if conversation is None and ledger is not None:
            conversation = edge.task_scope() or run_scope(context.run_context)
        if conversation is None:
            return None
        operation = canonical_json([conversation, context.tool_name, context.arguments or {}])
        return mcp_meta(f"{context.tool_name}-{fingerprint(operation)[:40]}", scope=conversation)

    return resolve
