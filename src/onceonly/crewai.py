"""CrewAI (crewai 1.x): tools whose calls go through an onceonly ledger.

    from onceonly.crewai import guard_tools

    agent = Agent(role="helpdesk", goal=..., backstory=..., tools=guard_tools([create_ticket], ledger))
    crew = Crew(agents=[agent], tasks=[...])
    with ledger.task(conversation_id):
        crew.kickoff()

A guarded tool is a CrewAI ``BaseTool`` with the original's name, description, argument schema and result
settings. CrewAI validates the model's arguments with that schema (``"500"`` becomes ``500`` for an ``int``)
before the ledger keys them.

**Why it is needed.** CrewAI retries a tool that raised: ``ToolUsage`` calls it again with the same
arguments, twice per attempt and up to three attempts, so a timeout after the side effect makes up to six
tickets for one ``Action``. A guarded tool never raises an outcome: the first lost answer becomes an
unknown outcome in the ledger, and CrewAI reads the text saying so as the tool's result, so its retry loop
never starts.

**Who is calling.** The ``ledger.task(...)`` around the kickoff, when there is one (the conversation's id).
Else the run itself: CrewAI gives every crew, flow and agent kickoff an execution id
(``crewai.execution.get_execution_uuid()``) that nested kickoffs inherit and a resumed human-feedback flow
keeps, so a re-plan inside a run replays and another kickoff (of the same ``Crew`` object too) runs its
own; one warning says to wrap the kickoff in ``ledger.task(...)`` to share records across a conversation's
runs. Outside any kickoff (``tool.run(...)`` from one's own code) a call has the ledger's own scope, as a
plain ``@ledger.tool`` call does.

**The scope travels.** CrewAI's async path runs a sync tool with ``loop.run_in_executor``, whose thread
does not see the caller's context: the guarded tool runs it with ``asyncio.to_thread`` instead, which
carries the ``ledger.task`` and the execution id.

**What the model reads.** A fresh result as the tool returned it; a replay, ``onceonly.tell_model``'s
text ("already done at …, not repeated; its result: …"); an unknown outcome, a call in progress, a
conflict or exhausted attempts, the envelope's text as the tool's result (a ``Told`` string), never the
operator's ``onceonly resolve …``, which goes to the ``onceonly`` log. CrewAI's own result cache is off
for a guarded tool: it is keyed by the tool's name and input alone and kept per ``Crew`` object across
kickoffs, so it would hand one conversation another's result; the ledger replays instead.

.. versionadded:: 0.1
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from onceonly._install import install_hint

try:
    from crewai.execution import get_execution_uuid
    from crewai.flow.async_feedback.types import HumanFeedbackPending
    from crewai.hooks.dispatch import HookAborted
    from crewai.tools import BaseTool
    from crewai.tools.base_tool import Tool as FunctionTool
    from crewai.tools.base_tool import tool as crewai_tool
    from crewai.tools.structured_tool import CrewStructuredTool
    from crewai.utilities.string_utils import sanitize_tool_name
    from pydantic import PrivateAttr
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(f"onceonly.crewai needs crewai: {install_hint('crewai')}") from exc

from onceonly.edge import EnvelopeState, envelope, is_guarded, run_scope, task_scope
from onceonly.tell import TOLD

if TYPE_CHECKING:
    from onceonly.ledger import Ledger

__all__ = ["PASSTHROUGH", "SETTING", "GuardedTool", "Told", "guard", "guard_tools", "run_id"]

_log = logging.getLogger("onceonly.crewai")

#: What to set so that the runs of one conversation share records (named in the run-scope warning).
SETTING = "ledger.task(conversation_id) around crew.kickoff() / flow.kickoff()"

#: CrewAI's control flow, not outcomes: a flow pausing for human feedback, a hook aborting the call.
#: They propagate with the claim released and no attempt counted.
PASSTHROUGH: tuple[type[BaseException], ...] = (HumanFeedbackPending, HookAborted)


def run_id() -> str | None:
    """The id of the CrewAI kickoff running this code (its execution id), or ``None`` outside one.

    .. versionadded:: 0.1
    """
    found = get_execution_uuid()
    return found if isinstance(found, str) and found else None


class Told(str):
    """A guarded call that neither ran now nor replayed a result: its outcome is unknown, it is in
    progress elsewhere, it conflicts with an earlier call, or its attempts are exhausted. The string is
    what the model reads (CrewAI hands it over as the tool's observation).

    Attributes:
        state: the envelope's state (``unknown``, ``in_progress``, ``not_run``, ``conflict``, ``exhausted``).
        key: the ledger key, for logs and ``onceonly show`` (not for the model).

    .. versionadded:: 0.1
    """

    state: EnvelopeState
    key: str | None

    def __new__(cls, text: str, state: EnvelopeState = "unknown", key: str | None = None) -> Told:
        made = super().__new__(cls, text)
        made.state = state
        made.key = key
        return made


def _never_cache(_args: Any = None, _result: Any = None) -> bool:
    """CrewAI's ``cache_function`` of a guarded tool: its cache is blind to the caller (see the module)."""
    return False


class _Door:
    """One guarded function and how a CrewAI call reaches it: in the run's scope, told as an envelope."""

    def __init__(self, guarded: Any, ledger: Ledger) -> None:
        self.guarded = guarded
        self.ledger = ledger
        self.asynchronous = inspect.iscoroutinefunction(guarded)

    def scoped(self) -> contextlib.AbstractContextManager[Any]:
        if task_scope() is not None:  # the caller's ledger.task() around the kickoff
            return contextlib.nullcontext()
        run = run_id()
        if run is None:  # not inside a kickoff: a plain call, in the ledger's own scope
            return contextlib.nullcontext()
        return self.ledger.task(run_scope(run, integration="crewai", setting=SETTING))

    def told(self, err: BaseException) -> Told:
        _log.warning("onceonly %s: %s", self.guarded.name, err)  # the operator's next step: the log only
        made = envelope(err)
        return Told(made.text, made.state, made.key)

    def call(self, fields: dict[str, Any]) -> Any:
        """A sync call (CrewAI's sync paths, and a sync function's worker thread on its async path)."""
        if self.asynchronous:
            return _run_coroutine(self.acall(fields))
        with self.scoped():
            try:
                out = self.guarded.outcome(**fields)
            except TOLD as err:
                return self.told(err)
        return envelope(out).text if out.replayed else out.result

    async def acall(self, fields: dict[str, Any]) -> Any:
        """An async call: an async function awaited here; a sync one in a thread that sees this context."""
        if not self.asynchronous:
            # to_thread, not CrewAI's run_in_executor: it copies the context (scope, execution id).
            return await asyncio.to_thread(self.call, fields)
        with self.scoped():
            try:
                out = await self.guarded.outcome(**fields)
            except TOLD as err:
                return self.told(err)
        return envelope(out).text if out.replayed else out.result


def _run_coroutine(coro: Any) -> Any:
    """Run an async guarded call from sync code: here when no loop runs in this thread, else in a worker
    thread (with this context) as CrewAI does for an async ``@tool``."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(contextvars.copy_context().run, asyncio.run, coro).result()


class _StructuredTool(CrewStructuredTool):  # type: ignore[misc]
    """CrewAI's structured form of a guarded tool, whose async path keeps the caller's context."""

    _door: _Door = PrivateAttr()

    async def ainvoke(self, input: Any, config: Any = None, **kwargs: Any) -> Any:
        if self._door.asynchronous:
            return await super().ainvoke(input, config, **kwargs)
        # CrewAI runs a sync function with run_in_executor (no context): its sync invoke, in a thread that
        # has the context, validates, counts usage and calls the same function.
        return await asyncio.to_thread(self.invoke, input, config, **kwargs)


class GuardedTool(BaseTool):  # type: ignore[misc]
    """A CrewAI tool whose calls go through an onceonly ledger (made by ``guard``).

    .. versionadded:: 0.1
    """

    _onceonly: _Door | None = PrivateAttr(default=None)

    @property
    def _door(self) -> _Door:
        door = self._onceonly
        if door is None:  # rebuilt by CrewAI from a checkpoint's JSON: the ledger is not part of it
            raise RuntimeError(
                f"tool {self.name!r} was rebuilt without its ledger (from a CrewAI checkpoint?): guard the original "
                "tool again with onceonly.crewai.guard(tool, ledger) and give the agent that"
            )
        return door

    def _run(self, **kwargs: Any) -> Any:
        return self._door.call(kwargs)

    async def _arun(self, **kwargs: Any) -> Any:
        return await self._door.acall(kwargs)

    @property
    def guarded(self) -> Any:
        """The ``@ledger.tool`` function behind this tool (``.key_for``, ``.outcome``, ``.name``)."""
        return self._door.guarded

    def to_structured_tool(self) -> CrewStructuredTool:
        door = self._door
        made = _StructuredTool(
            name=self.name,
            description=self.description,
            args_schema=self.args_schema,
            result_schema=self.result_schema,
            func=self._arun if door.asynchronous else self._run,
            result_as_answer=self.result_as_answer,
            max_usage_count=self.max_usage_count,
            current_usage_count=self.current_usage_count,
            cache_function=self.cache_function,
            tool_failure_policy=self.tool_failure_policy,
        )
        made._door = door
        # CrewAI finds the tool a structured tool came from by this attribute (its own to_structured_tool
        # sets it): result_as_answer, usage counts and the cache setting are read there.
        made._original_tool = self
        return made


def _method_body(tool: Any) -> Callable[..., Any]:
    """The function behind a ``BaseTool`` subclass: its ``_run`` (the method a subclass implements), with
    the argument schema's fields as its keyword parameters, so that ``key=`` and ``ignore=`` name them."""
    run = tool._run
    fields = list(tool.args_schema.model_fields)

    if inspect.iscoroutinefunction(run):

        async def abody(**kwargs: Any) -> Any:
            return await run(**kwargs)

        body: Any = abody
    else:

        def sbody(**kwargs: Any) -> Any:
            return run(**kwargs)

        body = sbody
    body.__signature__ = inspect.Signature([inspect.Parameter(f, inspect.Parameter.KEYWORD_ONLY) for f in fields])
    body.__name__ = body.__qualname__ = sanitize_tool_name(tool.name)
    body.__doc__ = tool.description
    return body  # type: ignore[no-any-return]


def _settings(tool: Any) -> dict[str, Any]:
    """What a guarded tool keeps of a CrewAI tool: what the model is shown and how CrewAI treats results."""
    return {
        "name": tool.name,
        "description": tool.description,
        "args_schema": tool.args_schema,
        "result_schema": tool.result_schema,
        "env_vars": tool.env_vars,
        "result_as_answer": tool.result_as_answer,
        "max_usage_count": tool.max_usage_count,
        "tool_failure_policy": tool.tool_failure_policy,
    }


def guard(tool: BaseTool | Callable[..., Any], ledger: Ledger, **policy: Any) -> GuardedTool:
    """A CrewAI tool whose calls go through ``ledger``.

    Args:
        tool: a CrewAI tool (``@tool``'s ``Tool``, a ``BaseTool`` subclass), a plain function (sync or async,
            with a docstring: CrewAI's description), or an ``@ledger.tool`` function (then its decorator's
            settings apply, and ``policy`` must be empty).
        ledger: the ledger the calls go through.
        **policy: ``@ledger.tool``'s settings (``key=``, ``on_unknown=``, ``probe=``, ``timeout=``…). The
            ledger's name of the tool defaults to CrewAI's (sanitized: ``Create Ticket`` is ``create_ticket``).
            CrewAI's pause and abort (``PASSTHROUGH``) are added to ``passthrough=``.

    Returns:
        A ``GuardedTool`` with the original's name, description, argument schema and result settings;
        CrewAI's result cache is off for it.

    .. versionadded:: 0.1
    """
    if isinstance(tool, GuardedTool):
        raise TypeError(f"{tool.name!r} is guarded already: give it to the agent as it is")
    if isinstance(tool, FunctionTool):
        fn: Any = tool.func
        shown = _settings(tool)
    elif isinstance(tool, BaseTool):
        fn = _method_body(tool)
        shown = _settings(tool)
    elif callable(tool):
        fn, shown = tool, None
    else:
        raise TypeError(f"onceonly.crewai.guard takes a CrewAI tool or a function, not {tool!r}")
    if is_guarded(fn):
        if policy:
            raise TypeError(
                f"{getattr(fn, 'name', fn)!r} is already an @ledger.tool function: its settings are its decorator's; "
                "pass the plain function to guard(..., **policy), or no settings"
            )
        guarded: Any = fn
        if guarded.ledger is not ledger:
            raise TypeError(f"{guarded.name!r} is guarded by another ledger ({guarded.ledger!r}) than the one given")
    else:
        if shown is not None:
            policy.setdefault("name", sanitize_tool_name(shown["name"]))
        policy["passthrough"] = (*policy.get("passthrough", ()), *PASSTHROUGH)
        guarded = ledger.tool(**policy)(fn)
    if shown is None:
        if not (getattr(fn, "__doc__", None) or "").strip():
            raise ValueError(
                f"{getattr(fn, '__name__', fn)!r} has no docstring: CrewAI shows it to the model as the tool's "
                "description; write one, or pass a crewai Tool with a description"
            )
        # CrewAI's own @tool makes the schema the model sees, from the guarded signature (no idempotency_key).
        shown = _settings(crewai_tool(getattr(fn, "__name__", guarded.name))(guarded))
    made = GuardedTool(**shown, cache_function=_never_cache)
    made._onceonly = _Door(guarded, ledger)
    return made


def guard_tools(tools: Sequence[BaseTool | Callable[..., Any]], ledger: Ledger, **policy: Any) -> list[GuardedTool]:
    """``guard`` for each of ``tools``, with the same settings.

    .. versionadded:: 0.1
    """
    return [guard(t, ledger, **dict(policy)) for t in tools]
