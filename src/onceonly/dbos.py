"""DBOS: guarded calls inside a DBOS workflow are keyed by the workflow, so recovery finds them.

DBOS recovers a workflow that a dead process left pending by running its function again in a new
process: finished steps return their recorded results, the rest run again. A guarded call inside it
(in a step, or in workflow code, where pydantic-ai's function tools run under ``DBOSDurability``) must
get the same key there, or it runs twice. The scope a caller set with ``ledger.task()`` around the
workflow is not there on recovery; the workflow id is. So, once ``install()`` has run:

- a guarded call inside a DBOS workflow is scoped to ``dbos:<workflow id>`` (with ``per="step"``,
  ``dbos:<workflow id>/step:<step id>`` inside a step), whatever task surrounds the workflow;
- a ``ledger.task(name)`` entered *inside* the workflow function wins (recovery enters it again): use it
  to share records across the workflows of one conversation or order;
- outside a workflow nothing changes.

    import onceonly.dbos

    onceonly.dbos.install()          # before DBOS.launch(); once per process
    charge = onceonly.dbos.guard(charge_card, ledger, tell_model=True)

``dbos`` is imported when ``install()`` runs (the ``onceonly[dbos]`` extra).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from onceonly._install import install_hint
from onceonly.edge import MAX_SCOPE, DurableUnit, register_durable
from onceonly.keys import safe_name

if TYPE_CHECKING:
    from onceonly.ledger import Ledger

__all__ = ["ENGINE", "guard", "install", "installed", "uninstall", "unit"]

#: The name this integration registers its scope under (``onceonly.edge.register_durable``).
ENGINE = "dbos"

Per = Literal["workflow", "step"]

_lock = threading.Lock()
_per: Per | None = None


def _load() -> Any:
    try:
        from dbos import DBOS
    except ImportError as exc:
        raise ImportError(f"onceonly.dbos needs dbos (3.x): {install_hint('dbos')}") from exc
    return DBOS


def _resolver(dbos: Any, per: Per) -> Callable[[], DurableUnit | None]:
    def here() -> DurableUnit | None:
        workflow = dbos.workflow_id  # None outside a workflow, or before DBOS is launched
        if not workflow:
            return None
        # Workflow ids are the application's text (SetWorkflowID): hashed when they are no valid scope.
        whole = safe_name(f"dbos:{workflow}", limit=MAX_SCOPE, prefix="h-")
        step = dbos.step_id if per == "step" else None
        if step is None:
            return DurableUnit(whole, whole)
        return DurableUnit(whole, safe_name(f"dbos:{workflow}/step:{step}", limit=MAX_SCOPE, prefix="h-"))

    return here


def install(*, per: Per = "workflow") -> None:
    """Scope every guarded call made inside a DBOS workflow, on every ledger of this process, by that
    workflow (see the module's text). Call it once, before ``DBOS.launch()`` recovers pending workflows;
    calling it again with the same ``per`` does nothing.

    Args:
        per: ``"workflow"`` (default): one scope per workflow, so the same call made twice in one
            workflow (a re-planned tool call of an agent) replays; ``"step"``: inside a DBOS step, one
            scope per step, so the same call in two steps runs twice, as DBOS runs two steps (in workflow
            code, where there is no step id, the workflow's scope).

    Raises:
        ImportError: dbos is not installed.
        ValueError: ``per`` is neither, or another ``per`` was installed already (the keys of calls
            already made would change: ``uninstall()`` first, on purpose).

    .. versionadded:: 0.1
    """
    global _per
    if per not in ("workflow", "step"):
        raise ValueError(f"per={per!r}: use 'workflow' (one scope per workflow) or 'step' (one per DBOS step)")
    dbos = _load()
    with _lock:
        if _per == per:
            return
        if _per is not None:
            raise ValueError(
                f"onceonly.dbos is installed with per={_per!r}: installing per={per!r} would change the keys "
                "of calls already recorded; call onceonly.dbos.uninstall() first if that is what you mean"
            )
        register_durable(ENGINE, _resolver(dbos, per))
        _per = per


def uninstall() -> None:
    """Stop scoping guarded calls by DBOS workflows (tests; a process that stops using DBOS).

    .. versionadded:: 0.1
    """
    global _per
    with _lock:
        register_durable(ENGINE, None)
        _per = None


def installed() -> Per | None:
    """The ``per`` this process installed, or ``None``.

    .. versionadded:: 0.1
    """
    return _per


def unit() -> DurableUnit | None:
    """The DBOS workflow (and scope) guarded calls made here are keyed by, or ``None``: outside a
    workflow, or before ``install()``. For logs and tests.

    .. versionadded:: 0.1
    """
    if _per is None:
        return None
    return _resolver(_load(), _per)()


def guard(fn: Callable[..., Any], ledger: Ledger, *, per: Per = "workflow", **policy: Any) -> Any:
    """``ledger.tool(**policy)(fn)``, after ``install(per=per)``: the usual way to guard a function that a
    DBOS workflow (or a pydantic-ai agent under ``DBOSDurability``) calls.

    .. versionadded:: 0.1
    """
    install(per=per)
    return ledger.tool(**policy)(fn)
