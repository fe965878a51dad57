"""Agno (agno 3.x): function tools whose calls go through an onceonly ledger.

    from onceonly.agno import guard_tools

    agent = Agent(model=model, tools=guard_tools([create_ticket], ledger))
    agent.run("The printer on floor 3 is out of toner", session_id=conversation_id, user_id=user_id)

A guarded tool is an Agno ``Function`` with the original's name, description, settings (``requires_confirmation``,
``external_execution``, hooks, ``stop_after_tool_call``…) and argument schema, less ``idempotency_key``. Agno
validates the model's arguments with the function's signature (``"500"`` becomes ``500`` for an ``int``) before
the ledger keys them; the parameters Agno injects (``agent``, ``team``, ``run_context``, ``fc``, media, and those
typed ``RunContext``/``Agent``/``Team``) still reach the function and stay out of the key and the schema.

**Who is calling.** The ``ledger.task(...)`` around the run, when there is one. Else Agno's session: the run's
``session_id`` with its ``user_id``, so that two users never share records even under one session id. A session
id names a conversation when it was given to ``run()``, or the agent keeps sessions in a database, or the run
has a user; an agent without a database that made one up for itself names none, and then the run itself
(``run_id``) is the scope, with one warning naming ``agent.run(session_id=..., user_id=...)``.

**What the model reads.** A fresh result as the tool returned it; a replay, ``onceonly.tell_model``'s text
("already done at …, not repeated; its result: …"); an unknown outcome, a call in progress, a conflict or
exhausted attempts, the model's text ("do not issue it again") as the tool's result: the run goes on, and the
operator's ``onceonly resolve …`` goes to the ``onceonly.agno`` log, never to the model.

**Agno's control flow.** ``StopAgentRun``, ``RetryAgentRun`` (any ``AgentRunException``) and a cancelled run
pass through with the claim given back and no attempt counted (``PASSTHROUGH``). A tool that requires
confirmation, user input or external execution is paused by Agno before it is called: the guard runs when it is
called, after the pause.

Why no ``tool_hooks`` entry: a hook wraps every tool of the agent with one policy (read-only lookups included),
and sees each call as a fresh closure; ``guard`` gives each tool its own ``@ledger.tool`` settings.

.. versionadded:: 0.1
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import typing
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from onceonly._install import install_hint

try:
    from agno.exceptions import AgentRunException, RunCancelledException
    from agno.run import RunContext
    from agno.tools.function import Function
    from agno.tools.toolkit import Toolkit
    from agno.utils.schema import AGNO_INJECTED_PARAMS, FRAMEWORK_INJECTED_PARAMS, is_framework_typed
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError(f"onceonly.agno needs agno: {install_hint('agno')}") from exc

from onceonly.edge import caller_scope, envelope, is_guarded, run_scope, task_scope
from onceonly.schema import coerce
from onceonly.tell import TOLD

if TYPE_CHECKING:
    from onceonly.ledger import Ledger

__all__ = ["PASSTHROUGH", "SETTING", "conversation_scope", "guard", "guard_tools"]

_log = logging.getLogger("onceonly.agno")

#: What to set so that the runs of one conversation share records (named in the run-scope warning).
SETTING = "agent.run(session_id=..., user_id=...)"

#: Agno's control flow, not outcomes: they propagate with the claim given back.
#: Give it to ``@ledger.tool(passthrough=PASSTHROUGH)`` for a function guarded before ``guard()``.
PASSTHROUGH: tuple[type[BaseException], ...] = (AgentRunException, RunCancelledException)

#: The argument through which a function gets the ledger's key (``@ledger.tool``'s convention).
_KEY = "idempotency_key"
#: The channels through which Agno hands an internal wrapper the run's objects, whatever the tool's own
#: parameters are called (Agno keeps them out of the schema and drops a model's value for them).
_RUN, _AGENT, _TEAM = "_agno_run_context", "_agno_agent", "_agno_team"
_INJECTED_BY_NAME = frozenset({*FRAMEWORK_INJECTED_PARAMS, *AGNO_INJECTED_PARAMS, "fc"})
#: The fields of a ``Function`` a guarded copy keeps (all but what the guard replaces).
_REPLACED = frozenset({"entrypoint", "parameters", "name"})


def conversation_scope(run_context: RunContext | None, owner: Any = None) -> str | None:
    """The ledger scope of a tool call in an Agno run: its session with its user, or ``None`` when the run
    names no conversation (no session, or one the agent made up for itself: no database, no user, not
    given to ``run()``).

    Args:
        run_context: the run's ``RunContext``.
        owner: the ``Agent`` or ``Team`` running the tool, if known.

    .. versionadded:: 0.1
    """
    session = getattr(run_context, "session_id", None)
    if not isinstance(session, str) or not session:
        return None
    user = getattr(run_context, "user_id", None)
    user = user if isinstance(user, str) and user else None
    # A session id the agent made sticky to itself (no database, no user) is every caller's of that agent.
    own = owner is not None and getattr(owner, "db", None) is None and getattr(owner, "session_id", None) == session
    if own and user is None:
        return None
    # JSON, so that no user id and session id can spell another pair's scope.
    return caller_scope("c", json.dumps([user, session], separators=(",", ":")))


def _scoped(ledger: Ledger, run_context: Any, owner: Any) -> contextlib.AbstractContextManager[Any]:
    """The ``ledger.task(...)`` around the run wins; else the session; else the run (one warning);
    outside a run, the ledger's own scope, as for the plain function."""
    if task_scope() is not None or run_context is None:
        return contextlib.nullcontext()
    scope = conversation_scope(run_context, owner)
    if scope is None:
        run = getattr(run_context, "run_id", None)
        if not isinstance(run, str) or not run:
            return contextlib.nullcontext()
        scope = run_scope(run, integration="agno", setting=SETTING)
    return ledger.task(scope)


def _injected(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The parameters of ``fn`` that Agno supplies: by name, or by a framework type (``ctx: RunContext``)."""
    params = inspect.signature(fn).parameters
    found = [n for n in params if n in _INJECTED_BY_NAME]
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: Agno cannot type it either
        hints = {}
    for name, hint in hints.items():
        if name in params and name not in found:
            try:
                owned = is_framework_typed(hint)
            except Exception:
                owned = True  # as Agno: what cannot be classified is not the model's
            if owned:
                found.append(name)
    return tuple(found)


def _without_key(parameters: dict[str, Any]) -> dict[str, Any]:
    """A JSON Schema of arguments less ``idempotency_key``: the ledger supplies it, the model never does."""
    props = parameters.get("properties")
    if not isinstance(props, dict) or _KEY not in props:
        return parameters
    out = dict(parameters)
    out["properties"] = {k: v for k, v in props.items() if k != _KEY}
    if isinstance(out.get("required"), list):
        out["required"] = [r for r in out["required"] if r != _KEY]
    return out


def _answer(out: Any) -> Any:
    told = envelope(out)
    return out.result if told.state == "done" else told.text


def _told(name: str, err: Exception) -> str:
    _log.warning("onceonly %s: %s", name, err)  # the operator's next step, for the log
    return envelope(err).text


def _entrypoint(guarded: Any, ledger: Ledger, made: list[Function]) -> Callable[..., Any]:
    """The function Agno calls: the guarded function's parameters plus Agno's ``_agno_`` channels."""
    sig = inspect.signature(guarded)
    ours = [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Any)
        for n in (_RUN, _AGENT, _TEAM)
        if n not in sig.parameters
    ]
    shown = sig.replace(parameters=[*sig.parameters.values(), *ours])

    def split(kwargs: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
        run_context = kwargs.pop(_RUN, None)
        agent, team = kwargs.pop(_AGENT, None), kwargs.pop(_TEAM, None)
        parameters = made[0].parameters if made else {}
        props = parameters.get("properties") if isinstance(parameters, dict) else None
        if made and made[0].skip_entrypoint_processing and isinstance(props, dict):
            # Agno validates a processed Function's arguments itself; one it does not process (a
            # Toolkit's) reaches here as the model sent them: keyed as the tool will use them.
            given = {k: v for k, v in kwargs.items() if k in props}
            schema = {**parameters, "required": [r for r in parameters.get("required", ()) if r in given]}
            schema.pop("additionalProperties", None)
            kwargs.update(coerce(schema, given))
        return run_context, agent if agent is not None else team, kwargs

    if inspect.iscoroutinefunction(guarded):

        async def acall(**kwargs: Any) -> Any:
            run_context, owner, fields = split(kwargs)
            with _scoped(ledger, run_context, owner):
                try:
                    out = await guarded.outcome(**fields)
                except TOLD as err:
                    return _told(guarded.name, err)
            return _answer(out)

        call: Callable[..., Any] = acall
    else:

        def scall(**kwargs: Any) -> Any:
            run_context, owner, fields = split(kwargs)
            with _scoped(ledger, run_context, owner):
                try:
                    out = guarded.outcome(**fields)
                except TOLD as err:
                    return _told(guarded.name, err)
            return _answer(out)

        call = scall
    wrapper: Any = call
    wrapper.__signature__ = shown
    wrapper.__name__ = wrapper.__qualname__ = getattr(guarded, "__name__", guarded.name)
    wrapper.__doc__ = guarded.__doc__
    wrapper.__module__ = getattr(guarded, "__module__", __name__)
    # Agno reads the annotations with get_type_hints: resolved ones, whatever the tool's module imported.
    try:
        hints = typing.get_type_hints(guarded, include_extras=True)
    except Exception:
        hints = dict(getattr(guarded, "__annotations__", {}))
    wrapper.__annotations__ = {**{k: v for k, v in hints.items() if k != _KEY}, **{p.name: Any for p in ours}}
    return call


def guard(tool: Function | Callable[..., Any], ledger: Ledger, **policy: Any) -> Function:
    """An Agno ``Function`` whose calls go through ``ledger``.

    Args:
        tool: an Agno ``Function`` (``@tool``, a Toolkit's), a plain function (sync or async), or an
            ``@ledger.tool`` function (then its decorator's settings apply, and ``policy`` must be empty; give it
            ``passthrough=PASSTHROUGH``).
        ledger: the ledger the calls go through.
        **policy: ``@ledger.tool``'s settings (``key=``, ``on_unknown=``, ``probe=``, ``timeout=``…). The
            tool's name defaults to the ``Function``'s, else the function's.

    Returns:
        A ``Function`` with the original's name, description, settings and schema, less ``idempotency_key``.

    .. versionadded:: 0.1
    """
    base: Function | None = None
    if isinstance(tool, Function):
        base = tool
        if tool.entrypoint is None:
            raise TypeError(f"Function {tool.name!r} has no entrypoint to guard (an external tool runs elsewhere)")
        fn: Any = tool.entrypoint
    elif isinstance(tool, Toolkit) or not callable(tool) or isinstance(tool, type):
        raise TypeError(
            f"onceonly.agno.guard takes a Function or a function, not {type(tool).__qualname__}: give a Toolkit to "
            "guard_tools"
        )
    else:
        fn = tool
    if getattr(fn, "_onceonly_agno", False):
        raise TypeError(f"{getattr(base, 'name', fn)!r} is guarded already: give the original tool or function")
    name = base.name if base is not None else getattr(fn, "__name__", None)
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
        injected = _injected(fn)
        if injected:  # Agno's objects, not part of the operation
            policy["ignore"] = (*policy.get("ignore", ()), *injected)
        policy["passthrough"] = (*policy.get("passthrough", ()), *PASSTHROUGH)
        if name is not None:
            policy.setdefault("name", name)
        guarded = ledger.tool(**policy)(fn)

    made: list[Function] = []
    entry = _entrypoint(guarded, ledger, made)
    entry._onceonly_agno = True  # type: ignore[attr-defined]
    shown_name = name or guarded.name
    if base is None:
        function = Function.from_callable(entry, name=shown_name)
    else:
        kept = {f: getattr(base, f) for f in type(base).model_fields if f not in _REPLACED}
        parameters = base.parameters
        if base.skip_entrypoint_processing:
            parameters = _without_key(parameters)
        else:  # Agno derives them from the entrypoint: the guarded one has no idempotency_key
            parameters = {"type": "object", "properties": {}, "required": []}
        function = Function(name=shown_name, entrypoint=entry, parameters=parameters, **kept)
    made.append(function)
    return function


def guard_tools(tools: Sequence[Any], ledger: Ledger, **policy: Any) -> list[Function]:
    """``guard`` for each of ``tools``, with the same settings; a ``Toolkit`` gives each of its functions.

    .. versionadded:: 0.1
    """
    out: list[Function] = []
    for t in tools:
        if isinstance(t, Toolkit):
            out += [guard(f, ledger, **dict(policy)) for f in t.get_functions().values()]
        else:
            out.append(guard(t, ledger, **dict(policy)))
    return out
