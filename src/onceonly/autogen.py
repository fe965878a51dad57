"""AutoGen (autogen-agentchat and autogen-core 0.7): function tools whose calls go through an onceonly ledger.

    from onceonly.autogen import guard_tools

    agent = AssistantAgent("assistant", model_client=client, tools=guard_tools([create_ticket], ledger))
    with ledger.task(conversation_id):
        await agent.run(task="The printer on floor 3 is out of toner")

A guarded tool is an AutoGen ``FunctionTool`` with the original's name, description and argument schema:
AutoGen validates the model's arguments with it (``"500"`` becomes ``500`` for an ``int``) before the
ledger keys them.

**The scope travels with the call.** AutoGen runs a sync tool with ``loop.run_in_executor``, in a worker
thread that does not see the caller's context: a plain ``FunctionTool`` over a guarded function loses the
``ledger.task(...)`` around ``agent.run()``, so every conversation shares one scope and the second one is
handed the first one's result. The guarded tool is async: it decides in the caller's task and runs a sync
function with ``asyncio.to_thread``, which carries the context (the task's scope, and the current call
for ``onceonly.http`` and ``mark_sent()`` inside the tool).

**Who is calling.** The ``ledger.task(...)`` around the run, when there is one (the conversation's id).
Else the run itself: AutoGen gives a tool no conversation id, but every tool call of one ``agent.run()``
gets that run's ``CancellationToken``, so a re-plan inside a run replays and another run runs its own,
and one warning says to wrap the run in ``ledger.task(...)`` to share records across a conversation's
runs. In a team, each agent's turn has its own token: wrap ``team.run()`` in ``ledger.task(...)``.

**What the model reads.** A fresh result as the tool returned it; a replay, ``onceonly.tell_model``'s
text ("already done at …, not repeated; its result: …"); an unknown outcome, a call in progress, a
conflict or exhausted attempts, a ``Told`` error whose text is the model's text, so that AutoGen reports
the call with ``is_error=True`` and the model never reads the operator's ``onceonly resolve …`` (which
goes to the ``onceonly`` log).

.. versionadded:: 0.1
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import typing
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from onceonly._install import install_hint

try:
    from autogen_core import CancellationToken
    from autogen_core.tools import BaseTool, FunctionTool
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(f"onceonly.autogen needs autogen-core and autogen-agentchat: {install_hint('autogen')}") from exc

from onceonly.edge import EnvelopeState, envelope, is_guarded, run_scope, task_scope
from onceonly.tell import TOLD

if TYPE_CHECKING:
    from onceonly.ledger import Ledger

__all__ = ["SETTING", "Told", "guard", "guard_tools", "run_id"]

_log = logging.getLogger("onceonly.autogen")

#: What to set so that the runs of one conversation share records (named in the run-scope warning).
SETTING = "ledger.task(conversation_id) around agent.run() / team.run()"

#: The parameter through which AutoGen hands a tool its run's cancellation token.
_TOKEN = "cancellation_token"

_runs: weakref.WeakKeyDictionary[CancellationToken, str] = weakref.WeakKeyDictionary()
_runs_lock = threading.Lock()


def run_id(token: CancellationToken) -> str:
    """The id of the run that ``token`` belongs to: a random id, the same for every call that gets this
    token object. Never ``id(token)``: a later run's token may be given the same address.

    .. versionadded:: 0.1
    """
    with _runs_lock:
        found = _runs.get(token)
        if found is None:
            found = _runs[token] = uuid.uuid4().hex
        return found


class Told(Exception):
    """A guarded call that neither ran now nor replayed a result: its outcome is unknown, it is in
    progress elsewhere, it conflicts with an earlier call, or its attempts are exhausted. ``str()`` is
    what the model reads (AutoGen puts it into the tool's result, ``is_error=True``).

    Attributes:
        state: the envelope's state (``unknown``, ``in_progress``, ``not_run``, ``conflict``, ``exhausted``).
        key: the ledger key, for logs and ``onceonly show`` (not for the model).

    .. versionadded:: 0.1
    """

    def __init__(self, text: str, state: EnvelopeState = "unknown", key: str | None = None) -> None:
        super().__init__(text)
        self.state: EnvelopeState = state
        self.key = key


def _original(tool: Any) -> tuple[Callable[..., Any], str | None, str | None, bool]:
    """The function behind a tool, and the tool's name, description and strictness (``None`` for a
    plain function: its own name and docstring)."""
    if isinstance(tool, FunctionTool):
        # FunctionTool keeps its function private; the pinned 0.7 line has it as ``_func``.
        fn = tool._func
        return fn, tool.name, tool.description, bool(tool.schema.get("strict", False))
    if isinstance(tool, BaseTool):
        raise TypeError(
            f"onceonly.autogen.guard takes a FunctionTool or a function, not {type(tool).__qualname__}: guard the "
            "function behind it"
        )
    if not callable(tool):
        raise TypeError(f"onceonly.autogen.guard takes a FunctionTool or a function, not {tool!r}")
    return tool, None, None, False


def _signature(guarded: Callable[..., Any], takes_token: bool) -> tuple[inspect.Signature, dict[str, Any]]:
    """The guarded function's signature with its annotations resolved (AutoGen resolves the wrapper's
    against its own module otherwise), plus the cancellation token AutoGen hands the tool."""
    hints = typing.get_type_hints(guarded, include_extras=True)
    sig = inspect.signature(guarded)
    params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()]
    if not takes_token:
        params.append(inspect.Parameter(_TOKEN, inspect.Parameter.KEYWORD_ONLY, annotation=CancellationToken))
        hints[_TOKEN] = CancellationToken
    ret = hints.get("return", sig.return_annotation)
    return sig.replace(parameters=params, return_annotation=ret), hints


async def _answer(guarded: Any, kwargs: dict[str, Any], asynchronous: bool) -> Any:
    """Run (or replay) the call and say what AutoGen hands the model."""
    try:
        if asynchronous:
            out = await guarded.outcome(**kwargs)
        else:
            # to_thread, not AutoGen's run_in_executor: it copies the context (scope, current call).
            out = await asyncio.to_thread(guarded.outcome, **kwargs)
    except TOLD as err:
        _log.warning("onceonly %s: %s", guarded.name, err)
        told = envelope(err)
        raise Told(told.text, told.state, told.key) from err
    return out.result if not out.replayed else envelope(out).text


def _tool_function(guarded: Any, ledger: Ledger, name: str, takes_token: bool) -> Callable[..., Any]:
    asynchronous = inspect.iscoroutinefunction(guarded)

    async def call(**kwargs: Any) -> Any:
        token = kwargs[_TOKEN] if takes_token else kwargs.pop(_TOKEN, None)
        if task_scope() is not None or token is None:
            return await _answer(guarded, kwargs, asynchronous)
        with ledger.task(run_scope(run_id(token), integration="autogen", setting=SETTING)):
            return await _answer(guarded, kwargs, asynchronous)

    sig, hints = _signature(guarded, takes_token)
    call.__signature__ = sig  # type: ignore[attr-defined]
    call.__annotations__ = hints
    call.__name__ = call.__qualname__ = name
    call.__doc__ = guarded.__doc__
    return call


def guard(tool: FunctionTool | Callable[..., Any], ledger: Ledger, **policy: Any) -> FunctionTool:
    """An AutoGen ``FunctionTool`` whose calls go through ``ledger``.

    Args:
        tool: a ``FunctionTool``, a plain function (sync or async), or an ``@ledger.tool`` function (then
            its decorator's settings apply, and ``policy`` must be empty).
        ledger: the ledger the calls go through.
        **policy: ``@ledger.tool``'s settings (``key=``, ``on_unknown=``, ``probe=``, ``timeout=``…). The
            tool's name defaults to the ``FunctionTool``'s, else the function's.

    Returns:
        A ``FunctionTool`` with the original's name, description, argument schema and strictness; a sync
        function runs in a worker thread that sees the caller's context.

    .. versionadded:: 0.1
    """
    fn, name, description, strict = _original(tool)
    takes_token = _TOKEN in inspect.signature(fn).parameters
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
        if takes_token:  # AutoGen's object, not part of the operation
            policy["ignore"] = (*policy.get("ignore", ()), _TOKEN)
        if name is not None:
            policy.setdefault("name", name)
        guarded = ledger.tool(**policy)(fn)
    shown = name or getattr(fn, "__name__", None) or guarded.name
    made = _tool_function(guarded, ledger, shown, takes_token)
    text = description if description is not None else fn.__doc__ or ""  # as AssistantAgent describes a function
    return FunctionTool(made, description=text, name=shown, strict=strict)


def guard_tools(
    tools: Sequence[FunctionTool | Callable[..., Any]], ledger: Ledger, **policy: Any
) -> list[FunctionTool]:
    """``guard`` for each of ``tools``, with the same settings.

    .. versionadded:: 0.1
    """
    return [guard(t, ledger, **dict(policy)) for t in tools]
