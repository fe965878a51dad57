"""Claude Agent SDK: in-process MCP tools whose calls go through an onceonly ledger.

    from onceonly.claude_agent_sdk import create_sdk_mcp_server, session_hooks

    def charge(customer: str, cents: int) -> str:  # a plain function, sync or async, or an @ledger.tool
        '''Charge a customer.'''

    billing = create_sdk_mcp_server("billing", [charge], ledger)
    options = ClaudeAgentOptions(mcp_servers={"billing": billing}, allowed_tools=["mcp__billing__charge"],
                                 hooks=session_hooks())
    async for message in query(prompt=text, options=options): ...

A plain function becomes an ``SdkMcpTool`` with its name, its docstring as the description, and the
JSON Schema MCP servers build from its signature (``mcp``'s ``func_metadata``, as ``MCPServer`` does),
without ``idempotency_key``. The model's arguments are validated and coerced by that schema
(``onceonly.schema.coerce``: ``500``, ``"500"`` and ``500.0`` are one charge) before they are keyed, and
reach the function as those JSON values. A sync function runs in a worker thread that sees the caller's
context. An ``SdkMcpTool`` made with the SDK's ``@tool`` is guarded as it is: its whole argument object
is the operation, its content is what is recorded and replayed.

**Who is calling.** The ``ledger.task(...)`` around the client or ``query()``, when there is one (the
tool handler runs in the context the client was connected in). Else the Claude session: the CLI sends
each MCP call's tool-use id (``_meta["claudecode/toolUseId"]``) and the ``PreToolUse`` hook of
``session_hooks()`` sees that id with the session's id, so the call is keyed by
``session_scope(session_id)``, and a resumed session replays its calls. Without the hook, the
connection: one client (one CLI process) is one run (``edge.run_scope``, one warning); another client
runs its own. A tool handed to the SDK's own ``create_sdk_mcp_server`` sees neither, so outside a
``ledger.task(...)`` it refuses to run (never one scope shared by the whole process).

**What the model reads.** A fresh result as the tool returned it; a replay, the text that it was done
already and not repeated, with its result; an unknown outcome, a call in progress elsewhere, a conflict
or exhausted attempts, ``onceonly.tell_model``'s text as an error result (``is_error``), which says not
to issue the call again. Never the operator's ``onceonly resolve …`` (it goes to the
``onceonly.claude_agent_sdk`` log). A tool's own error result is an unknown outcome unless the tool is
read-only (``edge.error_result_verdict``): it may have acted before it failed.

A call the SDK's permission check denies (``can_use_tool`` returning ``PermissionResultDeny``, a hook's
``deny``) never reaches the handler, so nothing is claimed and a later allowed call runs.

.. versionadded:: 0.1
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import inspect
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from onceonly._install import install_hint

try:
    import claude_agent_sdk as _sdk
    import mcp.types as _mt
    from claude_agent_sdk import HookContext, HookInput, HookJSONOutput, HookMatcher, McpSdkServerConfig, SdkMcpTool
    from mcp.server import Server
    from mcp.server.mcpserver.utilities.func_metadata import func_metadata
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        f"onceonly.claude_agent_sdk needs the Claude Agent SDK and mcp 2 ({exc}): {install_hint('claude-agent-sdk')}"
    ) from exc

from onceonly import edge
from onceonly.errors import OnceOnlyError
from onceonly.plan import Outcome
from onceonly.policy import Verdict
from onceonly.schema import SchemaError, coerce
from onceonly.tell import TOLD
from onceonly.tools import Wrappers

if TYPE_CHECKING:
    from onceonly.ledger import Ledger

__all__ = ["SETTING", "create_sdk_mcp_server", "guard", "guard_tools", "session_hooks", "session_scope"]

_log = logging.getLogger("onceonly.claude_agent_sdk")

#: What to set so that calls are keyed by the Claude session (named in the run-scope warning).
SETTING = "ClaudeAgentOptions(hooks=onceonly.claude_agent_sdk.session_hooks())"

#: The ``_meta`` key under which the CLI sends an MCP call's tool-use id.
TOOL_USE_META = "claudecode/toolUseId"

#: The argument through which a function gets the ledger's key (``@ledger.tool``'s convention).
_KEY = "idempotency_key"
#: The parameter of a guarded ``SdkMcpTool``'s body: the tool's whole argument object.
_WHOLE = "arguments"

# What the model reads when a guarded tool is served where no caller can be told apart (the SDK's own
# server, outside ledger.task): it did not run, and calling again will not help.
_UNSERVED = (
    "This tool is not available here: the call was not run. Do not issue it again; tell the user "
    "the tool could not be used."
)


# --- who is calling ---------------------------------------------------------------------------------


def session_scope(session_id: str) -> str:
    """The ledger scope of the calls of one Claude session (``SystemMessage`` ``init``'s ``session_id``,
    ``ResultMessage.session_id``): what a guarded call is keyed by when ``session_hooks()`` is installed.

    .. versionadded:: 0.1
    """
    return edge.caller_scope("c", session_id, base="claude")


class _Sessions:
    """Tool-use id → the session it belongs to, as the ``PreToolUse`` hook saw them. Tool-use ids are the
    API's own unique ids, so one table serves every client; the newest ids are kept (a call's handler
    runs right after its hook)."""

    def __init__(self, size: int = 4096) -> None:
        self._size = size
        self._ids: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, tool_use_id: str, session_id: str) -> None:
        with self._lock:
            self._ids[tool_use_id] = session_id
            self._ids.move_to_end(tool_use_id)
            while len(self._ids) > self._size:
                self._ids.popitem(last=False)

    def get(self, tool_use_id: str) -> str | None:
        with self._lock:
            return self._ids.get(tool_use_id)


_sessions = _Sessions()


async def _note_session(hook_input: HookInput, tool_use_id: str | None, context: HookContext) -> HookJSONOutput:
    """The ``PreToolUse`` hook: remember which session a tool-use id belongs to. It decides nothing."""
    session_id = hook_input.get("session_id") if isinstance(hook_input, Mapping) else None
    use_id = tool_use_id or (hook_input.get("tool_use_id") if isinstance(hook_input, Mapping) else None)
    if isinstance(use_id, str) and use_id and isinstance(session_id, str) and session_id:
        _sessions.note(use_id, session_id)
    return {}


def session_hooks(hooks: Mapping[Any, Sequence[HookMatcher]] | None = None) -> dict[Any, list[HookMatcher]]:
    """``hooks`` (the ``ClaudeAgentOptions.hooks`` mapping, or none) with onceonly's ``PreToolUse`` hook
    added: it tells the guarded tools which session each call belongs to, so that they are keyed by the
    session (``session_scope``) rather than by the connection. It allows and denies nothing.

    .. versionadded:: 0.1
    """
    merged: dict[Any, list[HookMatcher]] = {event: list(matchers) for event, matchers in (hooks or {}).items()}
    mine = HookMatcher(matcher=None, hooks=[_note_session])
    merged["PreToolUse"] = [*merged.get("PreToolUse", []), mine]
    return merged


@dataclasses.dataclass(frozen=True, slots=True)
class _Call:
    """What onceonly's server knows of the call it is serving: its tool-use id and its connection."""

    tool_use_id: str | None
    connection: object


_CALL: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("onceonly_claude_call", default=None)


class _Connection:
    """One connection of a client to onceonly's server (the lifespan of one ``Server.run``): the run a
    call belongs to when the session is not known."""

    __slots__ = ("__weakref__",)


class _Unserved(Exception):
    """No caller can be told apart: not onceonly's server, and no ``ledger.task(...)``."""


def _scope() -> str | None:
    """The scope to enter for this call, or ``None`` when the ``ledger.task(...)`` around it applies."""
    if edge.task_scope() is not None:
        return None
    call = _CALL.get()
    if call is None:
        raise _Unserved
    if call.tool_use_id:
        session = _sessions.get(call.tool_use_id)
        if session is not None:
            return session_scope(session)
    return edge.run_scope(edge.run_identity(call.connection), integration="claude-agent-sdk", setting=SETTING)


# --- results ----------------------------------------------------------------------------------------


def _text(value: str, *, error: bool = False) -> dict[str, Any]:
    made: dict[str, Any] = {"content": [{"type": "text", "text": value}]}
    if error:
        made["is_error"] = True
    return made


def _shown(content: Any) -> Any:
    """Recorded content as the model read it, for the replay text: the text of text blocks."""
    if (
        isinstance(content, list)
        and content
        and all(isinstance(b, Mapping) and b.get("type") == "text" for b in content)
    ):
        return "\n".join(str(b.get("text", "")) for b in content)
    return content


def _fresh_text(value: Any) -> str:
    """A function's fresh result as the model reads it, whole: a string as it is, anything else as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except ValueError:  # a circular structure: its repr is all there is
        return repr(value)


class _ErrorResult(Exception):
    """A tool's own error result (``is_error``): it may have acted before it failed, unless read-only."""

    def __init__(self, content: list[Any], verdict: Verdict) -> None:
        super().__init__("the tool returned an error result")
        self.content = content
        self.onceonly_verdict = verdict


# --- one guarded tool -------------------------------------------------------------------------------


class _Handler:
    """The handler of a guarded ``SdkMcpTool``: the ledger decides whether the tool runs."""

    def __init__(self, guarded: Any, schema: dict[str, Any], name: str, whole: bool) -> None:
        self.guarded = guarded
        self.schema = schema
        self.name = name
        self.whole = whole  # an SdkMcpTool: one argument object, content blocks as its result
        self.is_async = inspect.iscoroutinefunction(guarded)

    async def __call__(self, args: dict[str, Any]) -> dict[str, Any]:
        try:  # keyed as the tool will see them
            parsed = coerce(self.schema, args if isinstance(args, Mapping) else {})
        except SchemaError as err:
            return _text(f"Invalid arguments for tool {self.name}: {err}", error=True)
        try:
            scope = _scope()
        except _Unserved:
            _log.error(
                "onceonly: tool %r was called with no way to tell its callers apart, so it did not run: serve it "
                "with onceonly.claude_agent_sdk.create_sdk_mcp_server(name, tools, ledger), or run the client "
                "inside ledger.task(session_id)",
                self.name,
            )
            return _text(_UNSERVED, error=True)
        kwargs = {_WHOLE: dict(parsed)} if self.whole else dict(parsed)
        try:
            with contextlib.nullcontext() if scope is None else self.guarded.ledger.task(scope):
                if self.is_async:
                    out: Outcome = await self.guarded.outcome(**kwargs)
                else:  # to_thread copies the context: the scope and the current call travel
                    out = await asyncio.to_thread(self.guarded.outcome, **kwargs)
        except TOLD as err:
            # The operator's next step (onceonly resolve ...) goes to the log, the model's to the model.
            _log.warning("onceonly %s: %s", getattr(err, "key", self.name), err)
            return _text(edge.envelope(err).text, error=True)
        except _ErrorResult as err:  # a read-only tool's own error: as it said
            return {"content": err.content, "is_error": True}
        except OnceOnlyError as err:  # a fault of the ledger (a store down...), not an outcome
            _log.error("onceonly %s: %s", self.name, err)
            return _text(
                f"The call of {self.name} could not be completed ({type(err).__name__}); whether it took effect is "
                "not known. Do not issue it again; tell the user.",
                error=True,
            )
        except Exception as err:  # the tool's own failure: its message, as the SDK shows it
            return _text(str(err) or type(err).__name__, error=True)
        if out.replayed:
            shown = dataclasses.replace(out, result=_shown(out.result)) if self.whole else out
            return _text(edge.envelope(shown).text)
        if self.whole:
            return {"content": out.result}
        return _text(_fresh_text(out.result))


def _marked(tool: object) -> bool:
    return isinstance(tool, SdkMcpTool) and isinstance(tool.handler, _Handler)


def _from_function(fn: Callable[..., Any], ledger: Ledger, name: str | None, description: str | None,
                   policy: dict[str, Any]) -> SdkMcpTool[Any]:  # fmt: skip
    if edge.is_guarded(fn):
        if policy:
            raise TypeError(
                f"{getattr(fn, 'name', fn)!r} is already an @ledger.tool function: its settings are its decorator's; "
                "pass the plain function to guard(..., **policy), or no settings"
            )
        if getattr(fn, "ledger", None) is not ledger:
            raise TypeError(f"{getattr(fn, 'name', fn)!r} is guarded by another ledger than the one given")
        guarded: Any = fn
    else:
        if name is not None:
            policy.setdefault("name", name)
        guarded = ledger.tool(**policy)(fn)
    shown = name or getattr(fn, "__name__", None) or guarded.name
    # The schema MCP servers build from a signature (MCPServer's): the guarded function's, without the key.
    schema = func_metadata(guarded, structured_output=False).arg_model.model_json_schema(by_alias=True)
    text = description if description is not None else inspect.getdoc(fn) or ""
    return SdkMcpTool(
        name=shown, description=text, input_schema=schema, handler=_Handler(guarded, schema, shown, False)
    )


def _read_only_hint(annotations: object) -> bool:
    """The tool's own ``readOnlyHint`` (mcp 2 spells the attribute ``read_only_hint``, mcp 1 the wire name)."""
    return any(getattr(annotations, n, None) is True for n in ("read_only_hint", "readOnlyHint"))


def _from_tool(tool: SdkMcpTool[Any], ledger: Ledger, name: str | None, policy: dict[str, Any]) -> SdkMcpTool[Any]:
    # The SDK's own conversion of a declared input_schema (a JSON Schema, a dict of types, a TypedDict):
    # what it sends on the wire, hence the tight pin.
    schema = _sdk._build_input_schema(tool)
    if _KEY in (schema.get("properties") or {}):
        raise TypeError(
            f"tool {tool.name!r} asks the model for idempotency_key, so the model would choose keys: guard the "
            "plain function instead (the ledger fills the key in and leaves it out of the schema)"
        )
    read_only = bool(policy.get("readonly", False) or _read_only_hint(tool.annotations))
    handler = tool.handler
    verdict = edge.error_result_verdict(read_only=read_only)

    async def body(arguments: dict[str, Any]) -> list[Any]:
        result = await handler(arguments)
        content = list(result.get("content") or []) if isinstance(result, Mapping) else []
        if isinstance(result, Mapping) and (result.get("is_error") or result.get("isError")):
            raise _ErrorResult(content, verdict)
        return content

    ledger_name = name or tool.name
    body.__name__ = body.__qualname__ = ledger_name
    body.__doc__ = tool.description
    policy.setdefault("readonly", read_only)
    guarded = ledger.tool(name=ledger_name, **policy)(body)
    shown = name or tool.name
    return dataclasses.replace(tool, name=shown, input_schema=schema, handler=_Handler(guarded, schema, shown, True))


# One guarded tool per (ledger, original, settings): guarding the same tool again returns it.
_wrappers: Wrappers[SdkMcpTool[Any]] = Wrappers()


def guard(
    tool: SdkMcpTool[Any] | Callable[..., Any],
    ledger: Ledger,
    *,
    name: str | None = None,
    description: str | None = None,
    **policy: Any,
) -> SdkMcpTool[Any]:
    """An ``SdkMcpTool`` whose calls go through ``ledger``: the same call again, in the same session,
    replays.

    Args:
        tool: a plain function (sync or async; its docstring is the description), an ``@ledger.tool``
            function (its decorator's settings apply, and ``policy`` must be empty), or an ``SdkMcpTool``
            made with the SDK's ``@tool`` (its argument object is the operation; ``readOnlyHint`` or
            ``readonly=True`` make its error results failures rather than unknown outcomes).
        ledger: the ledger the calls go through.
        name: the tool's name (default the function's, or the tool's); also its name in the ledger's keys.
        description: what the model reads about the tool (default the docstring).
        **policy: ``@ledger.tool``'s settings (``key=``, ``on_unknown=``, ``probe=``, ``timeout=``…), naming
            the function's parameters (for an ``SdkMcpTool``, its one parameter ``arguments``).

    Serve it with ``create_sdk_mcp_server(name, tools, ledger)``, which tells it who is calling; under the
    SDK's own ``create_sdk_mcp_server`` it runs only inside a ``ledger.task(...)``.

    .. versionadded:: 0.1
    """
    if _marked(tool):
        raise TypeError(f"tool {getattr(tool, 'name', tool)!r} is guarded already; guard the original once")
    if "decode" in policy:
        raise TypeError("decode= does not apply here: a replay re-emits the recorded result as text")
    original: Any = tool

    def make() -> SdkMcpTool[Any]:
        if isinstance(original, SdkMcpTool):
            if description is not None:
                raise TypeError("description= is for a function; an SdkMcpTool has its own")
            return _from_tool(original, ledger, name, dict(policy))
        if not callable(original):
            raise TypeError(f"guard() takes an SdkMcpTool or a function, not {type(original).__name__}: {original!r}")
        return _from_function(original, ledger, name, description, dict(policy))

    return _wrappers.get(ledger, original, (name, description, policy), make)


def guard_tools(
    tools: Sequence[SdkMcpTool[Any] | Callable[..., Any]], ledger: Ledger, **policy: Any
) -> list[SdkMcpTool[Any]]:
    """``guard()`` each of ``tools`` with the same settings; tools guarded already pass as they are.

    .. versionadded:: 0.1
    """
    if "name" in policy or "description" in policy:
        raise TypeError("guard_tools() gives every tool its own name: use guard(tool, ledger, name=...) for one")
    out: list[SdkMcpTool[Any]] = []
    for t in tools:
        out.append(t if isinstance(t, SdkMcpTool) and _marked(t) else guard(t, ledger, **dict(policy)))
    return out


# --- the server -------------------------------------------------------------------------------------


def create_sdk_mcp_server(
    name: str,
    tools: Sequence[SdkMcpTool[Any] | Callable[..., Any]],
    ledger: Ledger,
    *,
    version: str = "1.0.0",
    **policy: Any,
) -> McpSdkServerConfig:
    """An in-process MCP server (``ClaudeAgentOptions(mcp_servers={name: server})``) of guarded tools:
    the SDK's ``create_sdk_mcp_server``, which also tells each call who is calling (its session with
    ``session_hooks()``, else its connection).

    Args:
        name: the server's name (the model sees its tools as ``mcp__<name>__<tool>``).
        tools: functions, ``@ledger.tool`` functions, ``SdkMcpTool``\\ s, guarded or not (``guard_tools``).
        ledger: the ledger the calls go through.
        version: the server's version, for information.
        **policy: ``@ledger.tool``'s settings for the tools not guarded yet.

    .. versionadded:: 0.1
    """
    made = guard_tools(tools, ledger, **policy)
    by_name: dict[str, SdkMcpTool[Any]] = {}
    for t in made:
        if t.name in by_name:
            raise ValueError(
                f"server {name!r}: two tools are named {t.name!r}; give one another name (guard(..., name=))"
            )
        by_name[t.name] = t
    # Listed as the SDK lists a tool (its schema, annotations and Claude Code's result-size hint).
    wire = [
        _mt.Tool.model_validate({
            "name": t.name, "description": t.description, "inputSchema": _sdk._build_input_schema(t),
            "annotations": t.annotations, "_meta": _sdk._build_meta(t),
        })
        for t in made
    ]  # fmt: skip

    async def on_list_tools(ctx: Any, params: Any) -> _mt.ListToolsResult:
        return _mt.ListToolsResult(tools=wire)

    async def on_call_tool(ctx: Any, params: Any) -> _mt.CallToolResult:
        found = by_name.get(params.name)
        if found is None:
            return _result(_text(f"Tool '{params.name}' not found", error=True))
        meta = params.meta if isinstance(params.meta, Mapping) else {}
        use_id = meta.get(TOOL_USE_META)
        token = _CALL.set(_Call(use_id if isinstance(use_id, str) else None, ctx.lifespan_context))
        try:
            return _result(await found.handler(dict(params.arguments or {})))
        except Exception as err:  # the handler answers every outcome; this is a bug, not the model's to read
            _log.exception("onceonly: tool %r failed in its handler", params.name)
            return _result(_text(f"The tool {params.name} failed ({type(err).__name__}).", error=True))
        finally:
            _CALL.reset(token)

    @contextlib.asynccontextmanager
    async def connected(_: Any) -> AsyncIterator[_Connection]:
        yield _Connection()  # one per Server.run: one client (one CLI process) of this server

    server: Any = Server(
        name, version=version, lifespan=connected, on_list_tools=on_list_tools, on_call_tool=on_call_tool
    )
    return McpSdkServerConfig(type="sdk", name=name, instance=server)


def _result(made: Mapping[str, Any]) -> _mt.CallToolResult:
    # The SDK's mapping of a handler's content to MCP content blocks (text and images as they are).
    content = _sdk._convert_tool_content(list(made.get("content") or []))
    error = bool(made.get("is_error") or made.get("isError"))
    return _mt.CallToolResult.model_validate({"content": content, "isError": error})
