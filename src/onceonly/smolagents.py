"""smolagents (1.x): tools whose calls go through an onceonly ledger, scoped to the agent's run.

    from onceonly.smolagents import guard_agent

    agent = guard_agent(ToolCallingAgent(tools=[create_ticket], model=model), ledger)
    agent.run("The printer on floor 3 is out of toner")

``guard_agent`` guards every tool of the agent (and of its managed agents) and scopes the calls of each
run to that run: a model that re-issues a call inside the run reads that it was already done; another
run — maybe another user's — runs its own. ``agent.run(..., reset=False)`` continues the conversation,
so it keeps the run's scope. A ``ledger.task(conversation_id)`` around the run wins (name the
conversation to share records across its runs and processes), and a managed agent runs inside its
manager's scope. ``guard``/``guard_tools`` make the tools alone, for an agent built later.

**What the model reads.** A fresh result as the tool returned it; a replay, ``onceonly.tell_model``'s text
("already done at …, not repeated; its result: …"); an unknown outcome, a call in progress, a conflict or
exhausted attempts, the model's text for that state as the tool's observation — never smolagents'
"Error executing tool … Please try again", and never the operator's ``onceonly resolve …`` (which goes
to the ``onceonly.smolagents`` log).

The tools run in-process: smolagents' remote executors (E2B, Docker, Modal) ship a tool's source code
elsewhere, without its guard.

.. versionadded:: 0.1
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from onceonly._install import install_hint

try:
    from smolagents import Tool
    from smolagents import tool as make_tool
    from smolagents.agents import MultiStepAgent
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(f"onceonly.smolagents needs smolagents: {install_hint('smolagents')}") from exc

from onceonly.edge import envelope, is_guarded, run_scope, task_scope
from onceonly.tell import TOLD

if TYPE_CHECKING:
    from onceonly.ledger import Ledger

__all__ = ["SETTING", "GuardedTool", "guard", "guard_agent", "guard_tools"]

_log = logging.getLogger("onceonly.smolagents")

#: What to set so that the runs of one conversation share records (named in the run-scope warning).
SETTING = "ledger.task(conversation_id) around agent.run()"

# smolagents' own tool that ends a run: never a side effect, never guarded.
_FINAL = "final_answer"


def _answer(guarded: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run (or replay) the call and say what smolagents hands the model as the observation."""
    try:
        out = guarded.outcome(*args, **kwargs)
    except TOLD as err:
        _log.warning("onceonly %s: %s", guarded.name, err)
        return envelope(err).text
    return out.result if not out.replayed else envelope(out).text


class GuardedTool(Tool):  # type: ignore[misc]  # smolagents ships no type information for Tool
    """A smolagents ``Tool`` whose calls go through an onceonly ledger: the original's name, description,
    inputs and output type, so the model is shown the same tool.

    .. versionadded:: 0.1
    """

    # forward takes the inputs as keywords, checked by smolagents against ``inputs`` before the call.
    skip_forward_signature_validation = True

    def __init__(self, guarded: Any, ledger: Ledger, shown: Tool) -> None:
        self.name = shown.name
        self.description = shown.description
        self.inputs = dict(shown.inputs)
        self.output_type = shown.output_type
        self.output_schema = getattr(shown, "output_schema", None)
        self.guarded = guarded
        self.ledger = ledger
        super().__init__()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if task_scope() is not None:
            return _answer(self.guarded, args, kwargs)
        # Called outside any run this module scoped (by hand, or by an agent guard_agent did not see):
        # the call is a run of its own, so it never replays another caller's result.
        with self.ledger.task(run_scope(uuid.uuid4().hex, integration="smolagents", setting=SETTING)):
            return _answer(self.guarded, args, kwargs)


def guard(tool: Tool | Callable[..., Any], ledger: Ledger, **policy: Any) -> Tool:
    """A smolagents ``Tool`` whose calls go through ``ledger``.

    Args:
        tool: a smolagents ``Tool`` (its ``forward`` is guarded), a plain function with type hints and a
            docstring with an ``Args:`` section (as smolagents' ``@tool`` needs), or an ``@ledger.tool``
            function (then its decorator's settings apply, and ``policy`` must be empty).
        ledger: the ledger the calls go through.
        **policy: ``@ledger.tool``'s settings (``key=``, ``on_unknown=``, ``probe=``, ``timeout=``…). The
            ledger's tool name defaults to the ``Tool``'s name, else the function's.

    Returns:
        A ``GuardedTool``; a ``GuardedTool`` or smolagents' ``final_answer`` is returned as it is.

    .. versionadded:: 0.1
    """
    if isinstance(tool, GuardedTool) or (isinstance(tool, Tool) and tool.name == _FINAL):
        return tool
    shown: Tool | None = None
    fn: Any = tool
    if isinstance(tool, Tool):
        # smolagents' @tool keeps the function as forward's __wrapped__ (forward's own signature has a
        # ``self``); a Tool subclass has a bound forward.
        inner = getattr(tool.forward, "__wrapped__", None)
        shown, fn = tool, inner if callable(inner) else tool.forward
        if not is_guarded(fn):
            policy.setdefault("name", tool.name)
            return GuardedTool(ledger.tool(**policy)(fn), ledger, tool)
    elif not callable(tool):
        raise TypeError(f"onceonly.smolagents.guard takes a smolagents Tool or a function, not {tool!r}")
    if not is_guarded(fn):
        guarded = ledger.tool(**policy)(fn)
        return GuardedTool(guarded, ledger, make_tool(guarded))  # smolagents reads the guarded signature
    if policy:
        raise TypeError(
            f"{fn.name!r} is already an @ledger.tool function: its settings are its decorator's; pass the plain "
            "function to guard(..., **policy), or no settings"
        )
    if fn.ledger is not ledger:
        raise TypeError(f"{fn.name!r} is guarded by another ledger ({fn.ledger!r}) than the one given")
    return GuardedTool(fn, ledger, shown if shown is not None else make_tool(fn))


def guard_tools(tools: Sequence[Tool | Callable[..., Any]], ledger: Ledger, **policy: Any) -> list[Tool]:
    """``guard`` for each of ``tools``, with the same settings.

    .. versionadded:: 0.1
    """
    return [guard(t, ledger, **dict(policy)) for t in tools]


# agent -> the id of its current run: ``run(reset=False)`` continues it, ``reset=True`` starts another.
_runs: weakref.WeakKeyDictionary[MultiStepAgent, str] = weakref.WeakKeyDictionary()
_runs_lock = threading.Lock()


def _run_id(agent: MultiStepAgent, reset: bool) -> str:
    with _runs_lock:
        found = _runs.get(agent)
        if reset or found is None:
            found = _runs[agent] = uuid.uuid4().hex
        return found


def _stepped(steps: Iterator[Any], ledger: Ledger, scope: str) -> Generator[Any, None, Any]:
    """A streamed run: each step is taken inside the run's scope, which is left between steps (the
    caller's code between them is not part of the run)."""
    while True:
        with ledger.task(scope):
            try:
                step = next(steps)
            except StopIteration as stop:
                return stop.value
        yield step


def _scoped_run(agent: MultiStepAgent, ledger: Ledger, run: Callable[..., Any]) -> Callable[..., Any]:
    def scoped(task: str, *args: Any, **kwargs: Any) -> Any:
        if task_scope() is not None:  # a ledger.task around the run, or a manager's run: it wins
            return run(task, *args, **kwargs)
        reset = kwargs.get("reset", args[1] if len(args) > 1 else True)
        scope = run_scope(_run_id(agent, bool(reset)), integration="smolagents", setting=SETTING)
        with ledger.task(scope):
            result = run(task, *args, **kwargs)
        if isinstance(result, Generator):  # stream=True: the run happens as the caller iterates
            return _stepped(result, ledger, scope)
        return result

    scoped.__doc__ = run.__doc__
    scoped.__wrapped__ = run  # type: ignore[attr-defined]
    return scoped


def guard_agent(agent: MultiStepAgent, ledger: Ledger, **policy: Any) -> MultiStepAgent:
    """Guard every tool of ``agent`` and of its managed agents, and scope each of its runs.

    Each ``agent.run(...)`` (``reset=True``, smolagents' default) is a run of its own: the calls inside it
    replay each other, another run runs its own; ``reset=False`` continues the same run. A
    ``ledger.task(...)`` around the run wins. Guarding an agent twice changes nothing.

    Args:
        agent: a smolagents agent (``ToolCallingAgent``, ``CodeAgent`` with its local executor).
        ledger: the ledger the calls go through.
        **policy: ``@ledger.tool``'s settings for each tool that is not already an ``@ledger.tool``.

    Returns:
        ``agent`` itself, changed in place.

    .. versionadded:: 0.1
    """
    for name, tool in list(agent.tools.items()):
        agent.tools[name] = guard(tool, ledger, **dict(policy))
    for managed in agent.managed_agents.values():
        guard_agent(managed, ledger, **dict(policy))
    if not getattr(agent.run, "onceonly_scoped", False):
        scoped = _scoped_run(agent, ledger, agent.run)
        scoped.onceonly_scoped = True  # type: ignore[attr-defined]
        agent.run = scoped
    return agent
