"""LlamaIndex (llama-index-core 0.14, on llama-index-workflows): function tools whose calls go through an
onceonly ledger.

    from onceonly.llamaindex import guard_tools

    agent = FunctionAgent(tools=guard_tools([create_ticket], ledger), llm=llm)
    with ledger.task(conversation_id):
        await agent.run("The printer on floor 3 is out of toner")

A guarded tool is a LlamaIndex ``FunctionTool`` with the original's name, description, argument schema,
``return_direct`` and ``partial_params``. A ``ctx: Context`` parameter, which LlamaIndex injects for a
workflow agent, still reaches the function, and is left out of the key and of the schema the model sees.
LlamaIndex hands a tool the model's arguments as they came (``"500"`` for an ``int``): the guard coerces
them by the tool's own schema first, so that ``500``, ``"500"`` and ``500.0`` are one operation.

**Who is calling.** The ``ledger.task(...)`` around the run, when there is one (the conversation's id).
Else the workflow run itself: LlamaIndex names no conversation, but every step of one ``agent.run()``
runs under that run's id (``handler.run_id``), so a re-plan inside a run replays and another run runs its
own, with one warning saying to wrap the run in ``ledger.task(...)`` to share records across a
conversation's runs. A sync tool runs in a worker thread that carries the caller's context (the scope,
and the current call for ``onceonly.http`` and ``mark_sent()`` inside the tool).

**What the model reads.** A fresh result as the tool returned it; a replay, ``onceonly.tell_model``'s
text ("already done at …, not repeated; its result: …"); an unknown outcome, a call in progress, a
conflict or exhausted attempts, a ``ToolOutput`` with ``is_error=True`` whose content is the model's text
("do not issue it again"): the run goes on, and the operator's ``onceonly resolve …`` goes to the
``onceonly`` log, never to the model.

**Pauses.** ``await ctx.wait_for_event(...)`` inside a tool (a person's approval) raises the workflow's
``WaitingForEvent``, and the workflow runs the step again once the event arrives: it passes through with
the claim given back, so that the call made again runs (``PASSTHROUGH``).

.. versionadded:: 0.1
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from onceonly._install import install_hint

try:
    from llama_index.core.bridge.pydantic import BaseModel, create_model
    from llama_index.core.tools import FunctionTool, ToolMetadata, ToolOutput
    from llama_index_instrumentation.dispatcher import active_instrument_tags
    from workflows.plugins.basic import get_current_run_id
    from workflows.runtime.types.results import WaitingForEvent
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(f"onceonly.llamaindex needs llama-index-core: {install_hint('llamaindex')}") from exc

from onceonly.edge import EnvelopeState, envelope, is_guarded, run_scope, task_scope
from onceonly.schema import SchemaError, coerce
from onceonly.tell import TOLD

if TYPE_CHECKING:
    from onceonly.ledger import Ledger

__all__ = ["PASSTHROUGH", "SETTING", "GuardedTool", "Told", "guard", "guard_tools", "run_id"]

_log = logging.getLogger("onceonly.llamaindex")

#: What to set so that the runs of one conversation share records (named in the run-scope warning).
SETTING = "ledger.task(conversation_id) around agent.run()"

#: The workflow's control flow, not outcomes: a tool waiting for an event is run again when it arrives.
#: Give it to ``@ledger.tool(passthrough=PASSTHROUGH)`` for a function guarded before ``guard()``.
PASSTHROUGH: tuple[type[BaseException], ...] = (WaitingForEvent,)

#: The argument through which a function gets the ledger's key (``@ledger.tool``'s convention).
_KEY = "idempotency_key"


def run_id() -> str | None:
    """The id of the workflow run this code runs in (``handler.run_id`` of ``agent.run()``), or ``None``
    outside a run. Set by the workflow runtime for every step of the run, and carried into the worker
    thread of a sync tool.

    .. versionadded:: 0.1
    """
    found = get_current_run_id()
    if found is None:  # another runtime than the basic one: the run's instrumentation tag
        tagged = active_instrument_tags.get().get("llamaindex.run_id")
        found = tagged if isinstance(tagged, str) and tagged else None
    return found


class Told(Exception):
    """A guarded call that neither ran now nor replayed a result: its outcome is unknown, it is in
    progress elsewhere, it conflicts with an earlier call, or its attempts are exhausted. ``str()`` is
    what the model reads; a ``GuardedTool`` returns it as a ``ToolOutput`` with ``is_error=True``.

    Attributes:
        state: the envelope's state (``unknown``, ``in_progress``, ``not_run``, ``conflict``, ``exhausted``).
        key: the ledger key, for logs and ``onceonly show`` (not for the model).

    .. versionadded:: 0.1
    """

    def __init__(self, text: str, state: EnvelopeState = "unknown", key: str | None = None) -> None:
        super().__init__(text)
        self.state: EnvelopeState = state
        self.key = key

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.state, self.key))


class GuardedTool(FunctionTool):
    """A ``FunctionTool`` whose calls go through an onceonly ledger (made by ``guard``). A call that is not
    an outcome to report as a result (``Told``), or arguments its schema refuses, is a ``ToolOutput`` with
    ``is_error=True`` and the model's text, not an exception: whoever calls the tool (an agent, a step of
    one's own) reads it, and the run goes on.

    .. versionadded:: 0.1
    """

    def _refused(self, err: Told | SchemaError, kwargs: dict[str, Any]) -> ToolOutput:
        text = str(err) if isinstance(err, Told) else f"Invalid arguments for tool {self.metadata.get_name()}: {err}"
        shown = {k: v for k, v in kwargs.items() if k != self.ctx_param_name}
        return ToolOutput(
            content=text,
            tool_name=self.metadata.get_name(),
            raw_input={"args": (), "kwargs": shown},
            raw_output=text,
            is_error=True,
        )

    def call(self, *args: Any, **kwargs: Any) -> ToolOutput:
        try:
            return super().call(*args, **kwargs)
        except (Told, SchemaError) as err:
            return self._refused(err, kwargs)

    async def acall(self, *args: Any, **kwargs: Any) -> ToolOutput:
        try:
            return await super().acall(*args, **kwargs)
        except (Told, SchemaError) as err:
            return self._refused(err, kwargs)


def _base(tool: Any) -> FunctionTool:
    """The ``FunctionTool`` to guard: the one given, or LlamaIndex's own for a function."""
    if isinstance(tool, GuardedTool):
        raise TypeError(f"{tool.metadata.name!r} is guarded already: give the original tool or function")
    if isinstance(tool, FunctionTool):
        # A callback rewrites the result LlamaIndex reports, and would rewrite a replay's text: refused
        # rather than dropped (FunctionTool keeps it private).
        if getattr(tool, "_callback", None) is not None or getattr(tool, "_async_callback", None) is not None:
            raise TypeError(
                f"{tool.metadata.name!r} has a callback, which onceonly.llamaindex.guard cannot carry: guard the "
                "function, and shape its result inside it"
            )
        return tool
    if not callable(tool) or isinstance(tool, type):
        raise TypeError(f"onceonly.llamaindex.guard takes a FunctionTool or a function, not {tool!r}")
    if hasattr(tool, "metadata") and hasattr(tool, "acall"):
        raise TypeError(
            f"onceonly.llamaindex.guard takes a FunctionTool or a function, not {type(tool).__qualname__}: guard "
            "the function behind it"
        )
    return FunctionTool.from_defaults(fn=tool)


def _without_key(schema: type[BaseModel]) -> type[BaseModel]:
    """``schema`` less an ``idempotency_key`` field: the ledger supplies it, the model never does."""
    if _KEY not in schema.model_fields:
        return schema
    fields: dict[str, Any] = {n: (f.annotation, f) for n, f in schema.model_fields.items() if n != _KEY}
    made: type[BaseModel] = create_model(schema.__name__, **fields)
    return made


def _same_schema(a: type[BaseModel], b: type[BaseModel]) -> bool:
    return a.model_json_schema() == b.model_json_schema()


def _scoped(ledger: Ledger) -> contextlib.AbstractContextManager[Any]:
    """The ``ledger.task(...)`` around the run wins; else the workflow run's own scope (one warning);
    outside a run, the ledger's own scope, as for the plain function."""
    if task_scope() is not None:
        return contextlib.nullcontext()
    run = run_id()
    if run is None:
        return contextlib.nullcontext()
    return ledger.task(run_scope(run, integration="llamaindex", setting=SETTING))


def _answer(out: Any) -> Any:
    """What LlamaIndex reports for an outcome: a fresh result as it is, any other the model's text."""
    told = envelope(out)
    return out.result if told.state == "done" else told.text


def _told(guarded: Any, err: Exception) -> Told:
    _log.warning("onceonly %s: %s", guarded.name, err)  # the operator's next step, for the log
    told = envelope(err)
    return Told(told.text, told.state, told.key)


class _Call:
    """The functions the guarded ``FunctionTool`` runs: the model's arguments coerced by the tool's
    schema, in the run's scope, through the ledger."""

    def __init__(self, guarded: Any, ledger: Ledger, sig: inspect.Signature, schema: dict[str, Any], ctx: str | None):
        self.guarded, self.ledger, self.sig, self.ctx = guarded, ledger, sig, ctx
        self.schema = schema
        self.fields = frozenset(schema.get("properties", {}))

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        bound = self.sig.bind(*args, **kwargs).arguments
        shown = {k: v for k, v in bound.items() if k in self.fields}
        if shown:  # keyed as the tool will use them: 500, "500" and 500.0 are one charge
            schema = {**self.schema, "required": [r for r in self.schema.get("required", ()) if r in shown]}
            bound.update(coerce(schema, shown))
        return bound

    async def acall(self, *args: Any, **kwargs: Any) -> Any:
        fields = self.arguments(args, kwargs)
        with _scoped(self.ledger):
            try:
                if inspect.iscoroutinefunction(self.guarded):
                    out = await self.guarded.outcome(**fields)
                else:  # to_thread copies the context: the scope and the current call reach the thread
                    out = await asyncio.to_thread(self.guarded.outcome, **fields)
            except TOLD as err:
                raise _told(self.guarded, err) from err
        return _answer(out)

    def call(self, *args: Any, **kwargs: Any) -> Any:
        fields = self.arguments(args, kwargs)
        with _scoped(self.ledger):
            try:
                out = self.guarded.outcome(**fields)
            except TOLD as err:
                raise _told(self.guarded, err) from err
        return _answer(out)


def guard(tool: FunctionTool | Callable[..., Any], ledger: Ledger, **policy: Any) -> GuardedTool:
    """A LlamaIndex ``FunctionTool`` whose calls go through ``ledger``.

    Args:
        tool: a ``FunctionTool``, a plain function (sync or async), or an ``@ledger.tool`` function (then
            its decorator's settings apply, and ``policy`` must be empty; give it ``passthrough=PASSTHROUGH``
            if it waits for workflow events).
        ledger: the ledger the calls go through.
        **policy: ``@ledger.tool``'s settings (``key=``, ``on_unknown=``, ``probe=``, ``timeout=``…). The
            tool's name defaults to the ``FunctionTool``'s, else the function's.

    Returns:
        A ``GuardedTool`` (a ``FunctionTool``) with the original's name, description, argument schema less
        ``idempotency_key``, ``return_direct`` and ``partial_params``; a sync function runs in a worker
        thread that sees the caller's context.

    .. versionadded:: 0.1
    """
    base = _base(tool)
    fn: Any = base.real_fn
    ctx = base.ctx_param_name
    meta = base.metadata
    if is_guarded(fn):
        if policy:
            raise TypeError(
                f"{fn.name!r} is already an @ledger.tool function: its settings are its decorator's; pass the plain "
                "function to guard(..., **policy), or no settings"
            )
        if fn.ledger is not ledger:
            raise TypeError(f"{fn.name!r} is guarded by another ledger ({fn.ledger!r}) than the one given")
        guarded: Any = fn
    else:
        if ctx is not None:  # the workflow's object, not part of the operation
            policy["ignore"] = (*policy.get("ignore", ()), ctx)
        policy["passthrough"] = (*policy.get("passthrough", ()), *PASSTHROUGH)
        policy.setdefault("name", meta.get_name())
        guarded = ledger.tool(**policy)(fn)

    sig = inspect.signature(guarded)
    asynchronous = inspect.iscoroutinefunction(guarded)
    partial = dict(base.partial_params)
    # The schema and description LlamaIndex would make of the guarded function (no idempotency_key):
    # they replace the original's where those were LlamaIndex's own, made of the original function.
    fresh_schema = FunctionTool.from_defaults(fn=guarded, name=meta.get_name(), partial_params=partial).metadata
    own = FunctionTool.from_defaults(fn=fn, name=meta.get_name(), partial_params=partial).metadata
    description = fresh_schema.description if meta.description == own.description else meta.description
    schema = meta.fn_schema
    if schema is None or (
        own.fn_schema is not None and schema.model_json_schema() == own.fn_schema.model_json_schema()
    ):
        schema = fresh_schema.fn_schema
    schema = _without_key(schema) if schema is not None else None
    json_schema = schema.model_json_schema() if schema is not None else {}

    made = _Call(guarded, ledger, sig, json_schema, ctx)
    name = meta.get_name()

    async def acall(*args: Any, **kwargs: Any) -> Any:
        return await made.acall(*args, **kwargs)

    def call(*args: Any, **kwargs: Any) -> Any:
        return made.call(*args, **kwargs)

    wrapper: Any
    for wrapper in (acall, call):
        wrapper.__signature__ = sig
        wrapper.__name__ = wrapper.__qualname__ = name
        wrapper.__doc__ = guarded.__doc__
    metadata = ToolMetadata(name=name, description=description, fn_schema=schema, return_direct=meta.return_direct)
    if asynchronous:  # LlamaIndex's own sync path runs the async function to completion
        return GuardedTool(async_fn=acall, metadata=metadata, partial_params=partial)
    return GuardedTool(fn=call, async_fn=acall, metadata=metadata, partial_params=partial)


def guard_tools(tools: Sequence[FunctionTool | Callable[..., Any]], ledger: Ledger, **policy: Any) -> list[GuardedTool]:
    """``guard`` for each of ``tools``, with the same settings.

    .. versionadded:: 0.1
    """
    return [guard(t, ledger, **dict(policy)) for t in tools]
