"""LangChain and LangGraph: tools whose calls go through an onceonly ledger, and a middleware for agents.

    from onceonly.langchain import OnceOnlyMiddleware, guard_tools

    agent = create_agent(model, guard_tools([create_ticket, send_email], ledger), checkpointer=saver)
    agent = create_agent(model, [create_ticket, send_email], middleware=[OnceOnlyMiddleware(ledger)])

A guarded tool keeps the original's name, description and argument schema, so the model sees the same
tool and LangGraph injects the same arguments (``ToolRuntime``, ``InjectedState``, ``InjectedToolCallId``,
``config``). The guard sits below LangChain's error handling: the tool's own exception reaches the
ledger (a failed attempt), and only then does ``handle_tool_error`` or the ``ToolNode`` turn it into a
``ToolMessage(status="error")``, so an error is never recorded as a result and replayed.

A call's key is the conversation (``thread_id``, and the subgraph the tool node runs in; without one,
the ``ledger.task()`` around the run, else the graph run itself, with one warning), the tool's name and
its canonical arguments, without the injected ones. Never the tool-call id: providers reuse
``call_0``, and a model that re-plans sends the same call under a new id, which must replay.

.. versionadded:: 0.1
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import json
import logging
import threading
import typing
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from onceonly._install import install_hint

try:
    from langchain_core.callbacks import AsyncCallbackManagerForToolRun, CallbackManagerForToolRun
    from langchain_core.messages import BaseMessage, ToolMessage, message_to_dict, messages_from_dict
    from langchain_core.messages.tool import ToolOutputMixin
    from langchain_core.runnables import RunnableConfig
    from langchain_core.runnables.config import run_in_executor
    from langchain_core.tools import BaseTool, StructuredTool, Tool
    from langchain_core.tools import tool as _as_tool
    from pydantic import ConfigDict, PrivateAttr, SkipValidation, create_model
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(
        f"onceonly.langchain needs langchain-core, langgraph and langchain: {install_hint('langchain')}"
    ) from exc

from onceonly import edge
from onceonly.errors import KeyConflict
from onceonly.keys import canonical_json, safe_name
from onceonly.plan import Outcome
from onceonly.policy import Verdict
from onceonly.tell import TOLD
from onceonly.tools import Wrappers, make_tool, same_definition

if TYPE_CHECKING:
    from langchain.agents.middleware import AgentMiddleware, ModelRequest
    from langgraph.prebuilt.tool_node import ToolCallRequest
    from langgraph.types import Command, Send

    from onceonly.ledger import Ledger
else:
    try:
        from langgraph.types import Command, Send
    except ImportError:  # pragma: no cover - langchain-core alone: no tool can return a Command
        Command = Send = type("_Absent", (), {})
    try:
        from langchain.agents.middleware import AgentMiddleware
    except ImportError:  # pragma: no cover - guard() needs only langchain-core; the middleware needs langchain

        class AgentMiddleware:
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise ImportError(f"OnceOnlyMiddleware needs langchain: {install_hint('langchain')}")


__all__ = ["GuardedTool", "OnceOnlyMiddleware", "graph_run_scope", "guard", "guard_tools", "thread_scope"]

_log = logging.getLogger("onceonly.langchain")

#: The guarded body's hidden parameter: what one invocation needs besides the model's arguments. It is
#: left out of the key and the fingerprint (``ignore=``), like the injected arguments it carries.
_CALL = "_onceonly_call"
#: The argument through which a function gets the ledger's key (``@ledger.tool``'s convention).
_KEY = "idempotency_key"
#: The tag of a stored result that is not plain text (an artifact, a message, a ``Command``...).
_TAG = "$langchain"
#: Outcomes the model is told about instead of a result (the operator's text goes to the log).
# LangGraph's checkpoint namespace: "node:task_id" segments joined by "|" (langgraph's NS_SEP, NS_END).
_NS_SEP, _NS_END = "|", ":"
#: The longest scope used as it is; a longer one (or one with whitespace) is hashed.
_MAX_SCOPE = 100

_TOOL_CALL_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("onceonly_tool_call_id", default=None)


# --- scope: the conversation ----------------------------------------------------------------------


#: Where LangGraph puts a run's ``Runtime`` in the config it gives a node (``langgraph.runtime.get_runtime``).
_RUNTIME = "__pregel_runtime"


def thread_scope(config: RunnableConfig | None) -> str | None:
    """The ledger scope of a LangGraph call: its ``thread_id``, and the subgraph its node runs in.

    The tool node's own segment of ``checkpoint_ns`` (``tools:<task_id>``) is left out: its task id
    changes at every step, and a re-planned call, one step later, must find the first. The segments
    above it name the subgraph (``agent:<task_id>|tools:<task_id>`` → ``agent``), without their task
    ids, as LangGraph itself stores a subgraph's own history. ``None`` without a thread: the
    ``ledger.task(...)`` around the call applies, else, inside a graph run, the run's own scope
    (``graph_run_scope``), else (code called the tool) the ledger's.

    A scope longer than 100 characters, or with whitespace in the thread id, is hashed.

    .. versionadded:: 0.1
    """
    configurable = (config or {}).get("configurable") or {}
    thread = configurable.get("thread_id")
    if thread is None or thread == "":
        return None
    return _scope_of(str(thread), str(configurable.get("checkpoint_ns") or ""))


def graph_run_scope(config: RunnableConfig | None) -> str | None:
    """The scope of a call in a LangGraph run that has no ``thread_id``: the run's own, so that a re-plan
    inside the run replays and another run (another user, maybe) runs its own; one warning names
    ``thread_id``. ``None`` outside a graph (code called the tool): the ledger's scope applies.

    The run is told by its ``Runtime``'s stream writer, which LangGraph makes once per run.

    .. versionadded:: 0.1
    """
    configurable = (config or {}).get("configurable") or {}
    runtime = configurable.get(_RUNTIME)
    writer = getattr(runtime, "stream_writer", None)
    if writer is None:
        return None
    return edge.run_scope(
        edge.run_identity(writer), integration="langchain", setting='config={"configurable": {"thread_id": ...}}'
    )


@functools.lru_cache(maxsize=1024)  # a conversation asks again and again, and the ns repeats within a step
def _scope_of(thread: str, ns: str) -> str:
    parts = [thread]
    if ns:
        segments = ns.split(_NS_SEP)
        if _NS_END in segments[-1]:
            segments.pop()  # the running node's task: a new id every step
        parts += [segment.split(_NS_END, 1)[0] for segment in segments]
    return safe_name(_NS_SEP.join(parts), limit=_MAX_SCOPE, prefix="thread-")


# --- what is stored, and what a replay re-emits -----------------------------------------------------


def _freeze(value: Any) -> Any:
    """A JSON form of what a tool returned: messages, ``Command`` and ``Send`` tagged, anything else
    without a JSON form as a described marker (its type and repr), as the ledger keeps any result."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, BaseMessage):
        return {_TAG: "message", "message": _freeze(message_to_dict(value))}
    if isinstance(value, Command):
        fields = {f.name: _freeze(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {_TAG: "command", **fields}
    if isinstance(value, Send):
        return {_TAG: "send", "node": value.node, "arg": _freeze(value.arg)}
    if isinstance(value, list | tuple):
        return [_freeze(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _freeze(v) for k, v in value.items()}
    try:
        canonical_json(value, path="result")
    except TypeError:  # NotSerializable is a TypeError
        return {"$unserializable": type(value).__name__, "repr": _repr(value)}
    return value


def _repr(value: Any) -> str:
    try:
        return repr(value)[:2000]
    except Exception as exc:  # a broken __repr__: the type must do
        return f"<repr failed: {type(exc).__name__}>"


def _thaw(value: Any) -> Any:
    if isinstance(value, list):
        return [_thaw(v) for v in value]
    if not isinstance(value, dict):
        return value
    tag = value.get(_TAG)
    if tag == "message":
        return messages_from_dict([_thaw(value["message"])])[0]
    if tag == "command":
        return Command(**{k: _thaw(v) for k, v in value.items() if k != _TAG})
    if tag == "send":
        return Send(value["node"], _thaw(value["arg"]))
    return {k: _thaw(v) for k, v in value.items()}


def _shown(content: Any) -> Any:
    """The content of the ``ToolMessage`` LangChain makes of a plain result (``BaseTool.run``): text
    and content blocks as they are, anything else as JSON text (``ensure_ascii=False``) or ``str``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list | tuple) and all(
        isinstance(b, str) or (isinstance(b, dict) and "type" in b) for b in content
    ):
        return list(content)
    try:
        return json.dumps(content, ensure_ascii=False)
    except Exception:
        return str(content)


def _retarget(value: Any, old_id: str | None, new_id: str, told: Callable[[Any], Any] | None) -> Any:
    """``value`` (a stored message, ``Command`` or list of them) answering ``new_id``: the message that
    answered ``old_id`` carries the new id, and, with ``told``, the text the model is told."""
    if isinstance(value, ToolMessage):
        if value.tool_call_id == old_id or old_id is None:
            update: dict[str, Any] = {"tool_call_id": new_id}
            if told is not None:
                update["content"] = told(value.content)
            return value.model_copy(update=update)
        return value
    if isinstance(value, Command):
        update_value = value.update
        if isinstance(update_value, dict):
            update_value = {k: _retarget(v, old_id, new_id, told) for k, v in update_value.items()}
        elif isinstance(update_value, list):
            update_value = [_retarget(v, old_id, new_id, told) for v in update_value]
        return dataclasses.replace(value, update=update_value)
    if isinstance(value, list):
        return [_retarget(v, old_id, new_id, told) for v in value]
    return value


class _ReturnedError(Exception):
    """The tool returned an error ``ToolMessage`` itself: a failed attempt, never a result to replay."""

    onceonly_verdict = Verdict.FAILED

    def __init__(self, response: Any) -> None:
        super().__init__("the tool returned an error message")
        self.response = response


def _is_error(response: Any, tool_call_id: str | None) -> bool:
    if isinstance(response, ToolMessage):
        return response.status == "error"
    if isinstance(response, Command) and isinstance(response.update, dict | list):
        items = response.update.get("messages", []) if isinstance(response.update, dict) else response.update
        return any(
            isinstance(m, ToolMessage) and m.status == "error" and m.tool_call_id == tool_call_id
            for m in (items if isinstance(items, list) else [])
        )
    if isinstance(response, list):
        return any(_is_error(r, tool_call_id) for r in response)
    return False


# --- one call of a guarded tool ---------------------------------------------------------------------


class _Invocation:
    """What one call needs besides the model's arguments: the injected ones, LangChain's own (config,
    run manager), the tool-call id; and, once the tool ran, what it returned."""

    __slots__ = ("args", "extras", "has_raw", "injected", "model_args", "raw", "spec", "tool_call_id")

    def __init__(
        self,
        spec: _Spec,
        args: tuple[Any, ...],
        model_args: dict[str, Any],
        injected: dict[str, Any],
        extras: dict[str, Any],
        tool_call_id: str | None,
    ) -> None:
        self.spec = spec
        self.args = args
        self.model_args = model_args
        self.injected = injected
        self.extras = extras
        self.tool_call_id = tool_call_id
        self.raw: Any = None
        self.has_raw = False

    def keep(self, response: Any) -> Any:
        """Keep what the tool returned for this caller; return its stored (JSON) form."""
        if _is_error(response, self.tool_call_id):
            raise _ReturnedError(response)
        self.raw, self.has_raw = response, True
        if isinstance(response, str):
            return response  # the common case, stored as the text itself
        stored: dict[str, Any] = {_TAG: "output", "response": _freeze(response), "tool_call_id": self.tool_call_id}
        content = response
        if self.spec.with_artifact and isinstance(response, tuple):
            stored["pair"] = True  # (content, artifact)
            content = response[0]
        if not (isinstance(content, str | ToolOutputMixin) or _all_outputs(content)):
            # The model read this text (a dict in the tool's own key order): a replay reads it too.
            stored["shown"] = _shown(content)
        return stored


def _all_outputs(value: Any) -> bool:
    """A list of messages and ``Command``s: what a tool returns to answer its call itself."""
    return isinstance(value, list) and bool(value) and all(isinstance(v, ToolOutputMixin) for v in value)


class _Definition:
    """What makes two guarded LangChain tools one operation in the ledger: the tool as the model sees it
    (name, description, argument schema) and the guard's settings.

    The ledger refuses a second function under a registered name unless it is the same definition, and
    tells that from the functions' closures (``onceonly.tools.same_definition``). The guarded body's only
    closure value is this, so the same tool guarded again, or made again (a factory per request, an MCP
    adapter per session), is the same operation, and another tool under the same name is refused.
    """

    __slots__ = ("settings", "shown")

    def __init__(self, shown: str, settings: dict[str, Any]) -> None:
        self.shown = shown
        self.settings = settings

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Definition) or self.shown != other.shown:
            return False
        mine, theirs = self.settings, other.settings
        return mine.keys() == theirs.keys() and all(_same_setting(mine[k], theirs[k]) for k in mine)

    def __hash__(self) -> int:
        return hash(self.shown)


def _same_setting(a: Any, b: Any) -> bool:
    if callable(a) and callable(b) and not isinstance(a, type):
        return same_definition(a, b)  # a probe or key function made again by the same factory is the same
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _body(definition: _Definition, asynchronous: bool, spec: _Spec) -> Callable[..., Any]:
    """The function the ledger guards: the model's arguments are its parameters (so ``key=``,
    ``ignore=`` and ``normalize=`` name them); the invocation, its hidden one, says what to run."""
    if asynchronous:

        async def body(**kwargs: Any) -> Any:
            _ = definition  # keeps it in the closure (its one value): what the ledger compares
            call: _Invocation = kwargs.pop(_CALL)
            return call.keep(await call.spec.arun_inner(call, kwargs))

        fn: Callable[..., Any] = body
    else:

        def sbody(**kwargs: Any) -> Any:
            _ = definition
            call: _Invocation = kwargs.pop(_CALL)
            return call.keep(call.spec.run_inner(call, kwargs))

        fn = sbody
    # An argument the model left out has its default (the schema's, else None) in the key, as it does
    # in the call: the same call with and without a default spelled out is one operation.
    params = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=spec.defaults.get(n)) for n in spec.named]
    if spec.takes_key:  # the ledger passes its key here, as to any function that declares it
        params.append(inspect.Parameter(_KEY, inspect.Parameter.KEYWORD_ONLY))
    params.append(inspect.Parameter(_CALL, inspect.Parameter.KEYWORD_ONLY, default=None))
    if spec.open_ended:  # a JSON-schema tool takes what the model sends: all of it is the operation
        params.append(inspect.Parameter("arguments", inspect.Parameter.VAR_KEYWORD))
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    fn.__name__ = fn.__qualname__ = spec.inner.name
    fn.__module__ = __name__
    fn.__doc__ = spec.inner.description
    return fn


def _model_view(tool: BaseTool) -> str:
    """The tool as a model is shown it: name, description, argument schema (canonical JSON)."""
    schema: Any = tool.tool_call_schema
    if not isinstance(schema, dict):  # a pydantic model class (v2, or v1's schema())
        schema = (getattr(schema, "model_json_schema", None) or schema.schema)()
    return canonical_json({"name": tool.name, "description": tool.description, "schema": schema}, path="tool")


def _model_names(tool: BaseTool) -> list[str]:
    """The names of the arguments a model is asked for."""
    schema = tool.tool_call_schema
    return list(schema.get("properties") or {}) if isinstance(schema, dict) else _field_names(schema)


def _defaults(schema: Any) -> dict[str, Any]:
    """The defaults a tool's schema declares (pydantic fields, or a JSON schema's ``default``)."""
    if isinstance(schema, dict):
        props = schema.get("properties") or {}
        return {n: p["default"] for n, p in props.items() if isinstance(p, dict) and "default" in p}
    fields = getattr(schema, "model_fields", None) or {}
    return {n: f.get_default(call_default_factory=True) for n, f in fields.items() if not f.is_required()}


def _field_names(schema: Any) -> list[str]:
    """The fields of a pydantic model class (v2, or v1 as LangChain still accepts)."""
    fields = getattr(schema, "model_fields", None)
    if fields is None:
        fields = getattr(schema, "__fields__", {})
    return list(fields)


def _takes(method: Callable[..., Any]) -> tuple[bool, str | None]:
    """Whether a tool's ``_run``/``_arun`` takes ``run_manager``, and its ``RunnableConfig`` parameter."""
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False, None
    try:
        hints = typing.get_type_hints(method)
    except Exception:  # an annotation that does not resolve: name it by its text
        hints = {n: p.annotation for n, p in params.items()}
    config = next((n for n, t in hints.items() if t is RunnableConfig or t == "RunnableConfig"), None)
    return "run_manager" in params, config


class _Spec:
    """One guarded tool: the ledger's functions (sync, async) and what a call needs to reach the original."""

    def __init__(
        self,
        inner: BaseTool,
        shown: BaseTool,
        ledger: Ledger,
        name: str,
        tell: bool,
        scope: Callable[[RunnableConfig | None], str | None],
        policy: dict[str, Any],
    ) -> None:
        self.inner = inner
        self.ledger = ledger
        self.tell_model = tell
        self.scope = scope
        self.with_artifact = inner.response_format == "content_and_artifact"
        # The arguments are the ones the model is shown (the guarded tool's schema); the rest of the
        # input schema is injected.
        schema = shown.args_schema
        visible = shown.tool_call_schema
        names = _model_names(shown)
        if isinstance(visible, dict):
            self.injected_names: frozenset[str] = frozenset(inner._injected_args_keys)
        else:
            full = set(_field_names(schema)) if schema is not None and not isinstance(schema, dict) else set()
            self.injected_names = frozenset(full - set(names)) | frozenset(inner._injected_args_keys)
        self.defaults = _defaults(visible)
        # A tool that takes the ledger's key gets it from the ledger, never from the model.
        self.takes_key = _KEY in _model_names(inner)
        names = [n for n in names if n != _KEY]
        identifiers = all(n.isidentifier() and n != _CALL for n in names)
        self.named = names if identifiers else []
        # A JSON schema does not stop the model sending more; a name that is not an identifier cannot
        # be a parameter: then the whole of what the model sent is the operation.
        self.open_ended = isinstance(visible, dict) or not identifiers
        self.run_manager, self.config = _takes(inner._run)
        self.arun_manager, self.aconfig = _takes(inner._arun)
        self.has_sync = not (isinstance(inner, StructuredTool) and inner.func is None)
        if isinstance(inner, StructuredTool):
            self.has_async = inner.coroutine is not None
        else:
            self.has_async = type(inner)._arun is not BaseTool._arun
        probe = policy.get("probe")
        if probe is not None and inspect.iscoroutinefunction(probe):
            self.has_sync = False  # an async probe is awaited: the sync path has none to run
        if not (self.has_sync or self.has_async):
            raise TypeError(f"tool {inner.name!r}: an async probe needs an async tool (a coroutine) to guard")
        definition = _Definition(_model_view(shown), dict(policy))
        ignore = (*policy.pop("ignore", ()), _CALL)
        # One operation, one registered function: the sync body when there is one, else the async one.
        # The other is its twin over the same settings and name, made without registering again.
        first = ledger.tool(name=name, ignore=ignore, **policy)(_body(definition, not self.has_sync, self))
        self.sync_fn: Any = first if self.has_sync else None
        self.async_fn: Any = None if self.has_sync else first
        if self.has_sync and self.has_async:
            self.async_fn = make_tool(first.spec.over(_body(definition, True, self), ignore=ignore))

    def run_inner(self, call: _Invocation, kwargs: dict[str, Any]) -> Any:
        """Run the original tool's ``_run`` with this call's arguments (the ledger decided it runs)."""
        if call.args:  # a single string input, as LangChain passes it on
            return self.inner._run(*call.args, **call.injected, **self.extras(call))
        return self.inner._run(**kwargs, **call.injected, **self.extras(call))

    async def arun_inner(self, call: _Invocation, kwargs: dict[str, Any]) -> Any:
        """The same with the original's ``_arun``."""
        if call.args:
            return await self.inner._arun(*call.args, **call.injected, **self.aextras(call))
        return await self.inner._arun(**kwargs, **call.injected, **self.aextras(call))

    def extras(self, call: _Invocation) -> dict[str, Any]:
        out = {}
        if self.run_manager and "run_manager" in call.extras:
            out["run_manager"] = call.extras["run_manager"]
        if self.config:
            out[self.config] = call.extras.get("config")
        return out

    def aextras(self, call: _Invocation) -> dict[str, Any]:
        out = {}
        if self.arun_manager and "run_manager" in call.extras:
            out["run_manager"] = call.extras["run_manager"]
        if self.aconfig:
            out[self.aconfig] = call.extras.get("config")
        return out

    def invocation(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], config: RunnableConfig | None, run_manager: Any
    ) -> _Invocation:
        injected = {k: v for k, v in kwargs.items() if k in self.injected_names}
        if args:  # a single string input: the key names it as the schema's first field
            model_args = {(self.named[0] if self.named else "input"): args[0]}
        elif injected:
            model_args = {k: v for k, v in kwargs.items() if k not in self.injected_names}
        else:
            model_args = kwargs
        if self.takes_key and _KEY in model_args:  # sent anyway (a JSON-schema tool checks nothing)
            model_args = {k: v for k, v in model_args.items() if k != _KEY}
        extras: dict[str, Any] = {"config": config}
        if run_manager is not None:
            extras["run_manager"] = run_manager
        return _Invocation(self, args, model_args, injected, extras, _TOOL_CALL_ID.get())

    def scoped(self, config: RunnableConfig | None) -> contextlib.AbstractContextManager[Any]:
        scope = self.scope(config)
        if scope is None and edge.task_scope() is None:
            scope = graph_run_scope(config)
        return contextlib.nullcontext() if scope is None else self.ledger.task(scope)

    # --- what the caller gets ---------------------------------------------------------------------

    def respond(self, out: Outcome, call: _Invocation) -> Any:
        """What ``_run`` returns to LangChain: the tool's own response when this call ran it, else the
        recorded one, answering this call's id (and, for a model, saying that it was a replay)."""
        if not out.replayed and call.has_raw:
            return call.raw
        stored = out.result
        tagged = isinstance(stored, dict) and stored.get(_TAG) == "output"
        response = _thaw(stored["response"]) if tagged else stored
        if tagged and stored.get("pair"):
            content, artifact = response
        else:  # the content only (a probe's answer, a person's resolution included)
            content, artifact = response, None
        new_id = call.tool_call_id
        if new_id is None:  # code called the tool, not a model: the recorded value as it was
            return (content, artifact) if self.with_artifact else content
        notice: Callable[[Any], Any] | None = None
        if self.tell_model and out.replayed:

            def notice(result: Any) -> Any:
                return edge.envelope(dataclasses.replace(out, result=result)).text

        if isinstance(content, ToolOutputMixin) or _all_outputs(content):
            old_id = stored.get("tool_call_id") if tagged else None
            message = _retarget(content, old_id, new_id, notice)
            return (message, artifact) if self.with_artifact else message
        if notice is not None:
            shown = notice(content)
        elif tagged and "shown" in stored:
            shown = stored["shown"]
        else:
            shown = content
        return (shown, artifact) if self.with_artifact else shown

    def told(self, err: Exception, call: _Invocation) -> Any:
        """An outcome the model must hear about (unknown, in progress, conflict, exhausted): an error
        ``ToolMessage`` with the model's text; the operator's (``onceonly resolve ...``) to the log."""
        _log.warning("onceonly %s: %s", getattr(err, "key", "?"), err)
        if call.tool_call_id is None:  # code called the tool: it handles the error itself
            raise err
        message = ToolMessage(
            content=edge.envelope(_for_model(err)).text,
            tool_call_id=call.tool_call_id,
            name=self.inner.name,
            status="error",
        )
        return (message, None) if self.with_artifact else message


def _for_model(err: Exception) -> Exception:
    """A conflict's earlier result as the model read it (the content, not the stored envelope)."""
    record = getattr(err, "record", None)
    if not isinstance(err, KeyConflict) or record is None or record.result_json is None:
        return err
    stored = record.result
    if not (isinstance(stored, dict) and stored.get(_TAG) == "output"):
        return err
    content = _thaw(stored["response"])
    if stored.get("pair"):
        content = content[0]  # (content, artifact): the model read the content
    shown = dataclasses.replace(record, result_json=canonical_json(_freeze(content), path="result"))
    return KeyConflict(str(err), key=err.key, record=shown, fingerprint=err.fingerprint)


# --- the tool ---------------------------------------------------------------------------------------


class GuardedTool(BaseTool):
    """A LangChain tool whose calls go through an onceonly ledger. Made by ``guard()``.

    It has the original's name, description, argument schema, response format and error handling;
    LangChain validates and injects arguments as for the original, then the ledger decides whether
    the original runs (``_run``/``_arun``) or its recorded result is re-emitted.

    ``func`` and ``coroutine`` are the original's, for the frameworks that read their annotations to
    inject arguments; calling them directly bypasses the ledger.

    .. versionadded:: 0.1
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    inner: typing.Annotated[BaseTool, SkipValidation()]
    """The original tool."""

    _spec: _Spec = PrivateAttr()

    @property
    def ledger(self) -> Ledger:
        """The ledger the calls go through."""
        return self._spec.ledger

    @property
    def func(self) -> Callable[..., Any] | None:
        return getattr(self.inner, "func", None)

    @property
    def coroutine(self) -> Callable[..., Any] | None:
        return getattr(self.inner, "coroutine", None)

    @property
    def _injected_args_keys(self) -> frozenset[str]:
        # LangChain passes injected arguments (ToolRuntime, InjectedToolArg...) to the tool's _run only
        # when it knows them: they are the original's.
        keys: frozenset[str] = self.inner._injected_args_keys
        return keys

    def _to_args_and_kwargs(
        self, tool_input: str | dict[str, Any], tool_call_id: str | None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # The original parses, validates and injects its own input (a single-input Tool passes it on
        # positionally): its _run gets what it would get unguarded.
        if self._spec.takes_key and isinstance(tool_input, dict):
            # Shown without idempotency_key, so not sent: a stand-in passes validation, and the ledger's
            # key replaces it before the tool runs.
            tool_input = {**tool_input, _KEY: "onceonly"}
        return self.inner._to_args_and_kwargs(tool_input, tool_call_id)

    def run(self, tool_input: Any, *args: Any, **kwargs: Any) -> Any:
        token = _TOOL_CALL_ID.set(kwargs.get("tool_call_id"))
        try:
            return super().run(tool_input, *args, **kwargs)
        finally:
            _TOOL_CALL_ID.reset(token)

    async def arun(self, tool_input: Any, *args: Any, **kwargs: Any) -> Any:
        token = _TOOL_CALL_ID.set(kwargs.get("tool_call_id"))
        try:
            return await super().arun(tool_input, *args, **kwargs)
        finally:
            _TOOL_CALL_ID.reset(token)

    def _run(
        self,
        *args: Any,
        config: RunnableConfig,
        run_manager: CallbackManagerForToolRun | None = None,
        **kwargs: Any,
    ) -> Any:
        spec = self._spec
        if spec.sync_fn is None:
            raise NotImplementedError(f"tool {self.name!r} has only an async implementation: call it with ainvoke")
        call = spec.invocation(args, kwargs, config, run_manager)
        try:
            with spec.scoped(config):
                out = spec.sync_fn.outcome(**call.model_args, **{_CALL: call})
        except _ReturnedError as returned:
            return returned.response
        except TOLD as err:
            return spec.told(err, call)
        return spec.respond(out, call)

    async def _arun(
        self,
        *args: Any,
        config: RunnableConfig,
        run_manager: AsyncCallbackManagerForToolRun | None = None,
        **kwargs: Any,
    ) -> Any:
        spec = self._spec
        if spec.async_fn is None:  # sync only: the sync path in a worker thread, as LangChain does
            sync_manager = run_manager.get_sync() if run_manager is not None else None
            return await run_in_executor(None, self._run, *args, config=config, run_manager=sync_manager, **kwargs)
        call = spec.invocation(args, kwargs, config, run_manager)
        try:
            with spec.scoped(config):
                out = await spec.async_fn.outcome(**call.model_args, **{_CALL: call})
        except _ReturnedError as returned:
            return returned.response
        except TOLD as err:
            return spec.told(err, call)
        return spec.respond(out, call)


def _input_schema(tool: BaseTool) -> Any:
    """The tool's input schema, for the guarded tool to show: its own, else the one LangChain derives."""
    if tool.args_schema is not None:
        return tool.args_schema
    if isinstance(tool, Tool):
        # A single-input Tool: LangChain shows the model one string argument (__arg1) and passes it on.
        return {
            "type": "object",
            "properties": {"__arg1": {"title": "__arg1", "type": "string"}},
            "required": ["__arg1"],
        }
    return tool.get_input_schema()  # from the tool's _run: the original's, not the guarded tool's


def _without_key(schema: Any) -> Any:
    """The argument schema without ``idempotency_key``: the ledger gives the key, the model never sees it."""
    if isinstance(schema, dict):
        props = schema.get("properties") or {}
        if _KEY not in props:
            return schema
        required = [n for n in schema.get("required", []) if n != _KEY]
        return {**schema, "properties": {n: p for n, p in props.items() if n != _KEY}, "required": required}
    fields = getattr(schema, "model_fields", None)
    if not fields or _KEY not in fields:
        return schema
    kept = {n: (f.annotation, f) for n, f in fields.items() if n != _KEY}
    # The fields keep their metadata, so InjectedToolArg & co. stay injected (LangChain reads them).
    make: Any = create_model  # the fields are built at run time: no overload can see them
    return make(schema.__name__, __config__=ConfigDict(arbitrary_types_allowed=True), __doc__=schema.__doc__, **kept)


# LangChain reads these two signatures' annotations on every call (to pass the config and the run
# manager): real objects, not the strings that `from __future__ import annotations` leaves, which
# typing.get_type_hints would compile again on every call.
GuardedTool._run.__annotations__ = {"config": RunnableConfig, "run_manager": CallbackManagerForToolRun | None}
GuardedTool._arun.__annotations__ = {"config": RunnableConfig, "run_manager": AsyncCallbackManagerForToolRun | None}


# --- guard(), guard_tools() -------------------------------------------------------------------------

# One guarded tool per (ledger, original, settings): guarding the same tool again returns it, so the
# ledger sees one definition under the tool's name.
_wrappers: Wrappers[GuardedTool] = Wrappers()


def guard(
    tool: BaseTool | Callable[..., Any],
    ledger: Ledger,
    *,
    name: str | None = None,
    tell_model: bool = True,
    scope: Callable[[RunnableConfig | None], str | None] = thread_scope,
    **policy: Any,
) -> GuardedTool:
    """A LangChain tool whose calls happen once per conversation: the same call again replays.

    Args:
        tool: a ``BaseTool`` (``@tool``, ``StructuredTool``, an MCP adapter's tool...) or a function
            (made a tool with LangChain's ``@tool``: it needs a docstring).
        ledger: the ledger the calls go through.
        name: the tool's name in the ledger's keys; default the tool's name.
        tell_model: a replay reaches the model as ``onceonly.tell_model(outcome)`` ("This action was
            already done at ... and was not repeated. Its result: ..."); ``False``: exactly as the
            original result read.
        scope: ``config -> scope | None`` (default ``thread_scope``: ``thread_id`` and subgraph).
        policy: the keyword arguments of ``@ledger.tool`` (``key=``, ``normalize=``, ``on_conflict=``,
            ``on_unknown=``, ``probe=``, ``retry=``, ``timeout=``...), naming the tool's arguments.

    An outcome the model must hear about (unknown, in progress, a conflict, attempts exhausted)
    becomes a ``ToolMessage(status="error")`` with ``onceonly.tell_model``'s text; the operator's
    instructions go to the ``onceonly.langchain`` log. Called by code (no tool-call id), the error is
    raised.

    A tool is the operation the model sees (name, description, arguments) under these settings: the
    same tool guarded again, or made again (a factory per request, an MCP adapter per session), shares
    its records; another tool under a name this ledger has is refused (pass ``name=``).

    .. versionadded:: 0.1
    """
    if isinstance(tool, GuardedTool):
        raise TypeError(
            f"tool {tool.name!r} is guarded already (on {tool.ledger.url}); guard the original once, "
            "with all its settings"
        )
    if "decode" in policy:
        raise TypeError("decode= does not apply here: a replay re-emits the recorded message content")
    if not isinstance(tool, BaseTool):
        if not callable(tool):
            raise TypeError(f"guard() takes a LangChain BaseTool or a function, not {type(tool).__name__}")
        if hasattr(tool, "ledger") and hasattr(tool, "outcome"):
            raise TypeError(
                f"{getattr(tool, '__name__', tool)!r} is a function guarded by @ledger.tool already: pass the "
                "plain function to guard(), or the guarded one to LangChain's @tool (then without the "
                "conversation's scope and the model's replay text)"
            )
        tool = _as_tool(tool)
    settings = (name, tell_model, scope, policy)
    return _wrappers.get(ledger, tool, settings, lambda: _make(tool, ledger, name, tell_model, scope, policy))


def _make(
    tool: BaseTool,
    ledger: Ledger,
    name: str | None,
    tell_model: bool,
    scope: Callable[[RunnableConfig | None], str | None],
    policy: dict[str, Any],
) -> GuardedTool:
    made = GuardedTool(
        inner=tool,
        name=tool.name,
        description=tool.description,
        args_schema=_without_key(_input_schema(tool)),
        return_direct=tool.return_direct,
        verbose=tool.verbose,
        callbacks=tool.callbacks,
        tags=tool.tags,
        metadata=tool.metadata,
        handle_tool_error=tool.handle_tool_error,
        handle_validation_error=tool.handle_validation_error,
        response_format=tool.response_format,
        extras=tool.extras,
    )
    made._spec = _Spec(tool, made, ledger, name or tool.name, tell_model, scope, dict(policy))
    return made


def guard_tools(tools: Sequence[Any], ledger: Ledger, **policy: Any) -> list[Any]:
    """``guard()`` each tool, with the same settings; a provider's built-in tool (a dict) and a tool
    guarded already pass as they are.

    .. versionadded:: 0.1
    """
    return [t if isinstance(t, dict | GuardedTool) else guard(t, ledger, **policy) for t in tools]


# --- the middleware ---------------------------------------------------------------------------------


class OnceOnlyMiddleware(AgentMiddleware):
    """Guards every tool call of a ``langchain.agents.create_agent`` agent with one ledger.

    ``create_agent(model, tools, middleware=[OnceOnlyMiddleware(ledger)], checkpointer=saver)``. Each
    call runs the tool through ``guard(tool, ledger, **policy)``, so the same rules hold: below the
    error handling, keyed by conversation and arguments, the model told of a replay; a tool that takes
    ``idempotency_key`` is shown to the model without it (``wrap_model_call``). Also a
    ``ToolNode`` wrapper: ``ToolNode(tools, wrap_tool_call=mw.wrap_tool_call, awrap_tool_call=mw.awrap_tool_call)``.

    Args:
        ledger: the ledger.
        tools: the names of the tools to guard (default: all); a tool guarded already with ``guard()``
            (its own settings) is left as it is.
        tell_model, scope, policy: as for ``guard()``, for every tool.

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        tools: Collection[str] | None = None,
        tell_model: bool = True,
        scope: Callable[[RunnableConfig | None], str | None] = thread_scope,
        **policy: Any,
    ) -> None:
        super().__init__()
        self.ledger = ledger
        self.only = frozenset(tools) if tools is not None else None
        self._settings: dict[str, Any] = {"tell_model": tell_model, "scope": scope, **policy}
        self._guarded: dict[int, tuple[BaseTool, GuardedTool]] = {}
        self._takes_key: dict[int, tuple[Any, bool]] = {}
        self._lock = threading.Lock()

    def _guarded_for(self, tool: Any) -> GuardedTool | None:
        """The guarded tool that runs ``tool``'s calls; ``None`` for one this middleware leaves alone."""
        if not isinstance(tool, BaseTool) or isinstance(tool, GuardedTool):
            return None
        if self.only is not None and tool.name not in self.only:
            return None
        found = self._guarded.get(id(tool))
        if found is None or found[0] is not tool:
            with self._lock:
                found = (tool, guard(tool, self.ledger, **self._settings))
                self._guarded[id(tool)] = found  # holds the tool: its id stays its own
        return found[1]

    def _tool(self, request: ToolCallRequest) -> ToolCallRequest:
        guarded = self._guarded_for(request.tool)
        return request if guarded is None else request.override(tool=guarded)

    def _model_request(self, request: ModelRequest) -> ModelRequest:
        # A tool that takes idempotency_key gets it from the ledger: the model is shown the guarded
        # tool's schema, without it. Any other tool is shown as it is (the request is left alone).
        if not any(self._hides_key(t) for t in request.tools):
            return request
        shown = [(self._guarded_for(t) or t) if self._hides_key(t) else t for t in request.tools]
        return request.override(tools=shown)

    def _hides_key(self, tool: Any) -> bool:
        known = self._takes_key.get(id(tool))
        if known is None or known[0] is not tool:
            takes = isinstance(tool, BaseTool) and not isinstance(tool, GuardedTool) and _KEY in _model_names(tool)
            takes = takes and (self.only is None or tool.name in self.only)
            known = self._takes_key[id(tool)] = (tool, takes)
        return known[1]

    def wrap_tool_call(self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], Any]) -> Any:
        """Run the call through the guarded tool."""
        return handler(self._tool(request))

    async def awrap_tool_call(self, request: ToolCallRequest, handler: Callable[[ToolCallRequest], Any]) -> Any:
        """Run the call through the guarded tool, async."""
        return await handler(self._tool(request))

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], Any]) -> Any:
        """Show the model no ``idempotency_key`` among a tool's arguments."""
        return handler(self._model_request(request))

    async def awrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], Any]) -> Any:
        """Show the model no ``idempotency_key`` among a tool's arguments, async."""
        return await handler(self._model_request(request))
