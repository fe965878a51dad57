"""Budgets: a limit on what a tool's calls may add up to per fixed window of time (``budget=``).

``@ledger.tool(budget=onceonly.Budget(amount="cents", limit=100_000, per="1d"))``: before a call runs,
its amount is reserved in the budget's current window (``BudgetStore.budget_reserve``: checked and
recorded in one atomic step), and a call that would take the window past the limit is refused with
``BudgetExceeded``, nothing claimed or run. The window's total counts every call that may have
happened: confirmed, running, unknown and parked for review. An amount is freed only when its call is
settled as failed (the tool's own error, the reconciler, a person's ``resolve --failed``), or when the
call did not run here (a replay of an operation reserved in an earlier window, a conflict).

Windows are fixed and aligned to the epoch in UTC: window ``floor(now / per)`` on the ledger's clock,
so ``per="1d"`` resets at midnight UTC. A call counts in the window it was reserved in.

A process that dies between the reservation and its claim leaves the amount held until the window
ends: the safe side (a call that may have happened is never forgotten).
"""

from __future__ import annotations

import asyncio
import decimal
import logging
import math
import numbers
import re
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from onceonly.errors import (
    ApprovalPending,
    BudgetExceeded,
    KeyConflict,
    OnceOnlyError,
    Refused,
    SimilarCall,
    StoreError,
)
from onceonly.keys import validate_name
from onceonly.plan import Call, Outcome
from onceonly.states import State
from onceonly.stores.base import BudgetStore, BudgetUse, Reservation

if TYPE_CHECKING:
    from onceonly.tools import ToolSpec

__all__ = ["Budget", "BudgetGuard", "bind", "free", "parse_per", "usage", "window_of"]

_log = logging.getLogger("onceonly")

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0, "": 1.0}
_PER = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|m|h|d|w|)\s*$")
_BY = ("scope", "tool")
#: How the store names of ``by="scope"`` / ``by="tool"`` budgets begin; refused as a shared name.
_TOOL_PREFIX = "tool:"

Drive = Callable[[Call, tuple[Any, ...], dict[str, Any]], Outcome]
AsyncDrive = Callable[[Call, tuple[Any, ...], dict[str, Any]], Awaitable[Outcome]]


def parse_per(value: object) -> float:
    """Seconds in a window: ``"1d"``, ``"12h"``, ``"30m"``, ``"45s"``, ``"1w"`` or a number of seconds.

    .. versionadded:: 0.1
    """
    if isinstance(value, str):
        match = _PER.match(value)
        seconds = float(match.group(1)) * _UNITS[match.group(2)] if match else math.nan
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"per={value!r}: give the window as a duration such as '1d', '1h', '30m', or seconds")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"per={value!r}: give a window above 0 such as '1d', '1h', '30m', or a number of seconds")
    return seconds


@dataclass(frozen=True)
class Budget:
    """A limit on what a tool's calls may add up to per window (``@ledger.tool(budget=...)``).

    Args:
        amount: what one call costs: the name of one of the tool's arguments (its value must be a
            finite number, 0 or more), or a function of the call's arguments (a dict) that returns it.
        limit: what one window may hold, above 0.
        per: the window: ``"1d"``, ``"1h"``, ``"30m"``, ``"1w"``, or seconds. Windows are fixed and
            aligned to the epoch in UTC (``"1d"`` resets at midnight UTC).
        by: ``"scope"`` (default: one budget per tool and scope, ``ledger.task(...)``), ``"tool"``
            (one per tool, across scopes), or any other name: one budget shared by every tool that
            names it, across scopes (give those tools the same ``limit`` and ``per``).

    .. versionadded:: 0.1
    """

    amount: str | Callable[[dict[str, Any]], Any]
    limit: float
    per: str | float = "1d"
    by: str = "scope"
    #: ``per`` in seconds.
    seconds: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.amount, str):
            if not self.amount.isidentifier():
                raise ValueError(f"Budget(amount={self.amount!r}): give the name of one of the tool's arguments")
        elif not callable(self.amount):
            raise TypeError(
                f"Budget(amount={self.amount!r}): give an argument's name (amount='cents') or a function of the "
                "arguments (amount=lambda args: args['quantity'] * 5)"
            )
        limit = self.limit
        if isinstance(limit, bool) or not isinstance(limit, numbers.Real) or not (math.isfinite(limit) and limit > 0):
            raise ValueError(f"Budget(limit={limit!r}): give a finite number above 0, in the amount's unit")
        object.__setattr__(self, "seconds", parse_per(self.per))
        if not isinstance(self.by, str) or not self.by:
            raise TypeError(f"Budget(by={self.by!r}): give 'scope', 'tool', or the name of a shared budget")
        if self.by not in _BY:
            validate_name(self.by, "shared budget name (by=)")
            if self.by.startswith(_TOOL_PREFIX):
                raise ValueError(
                    f"Budget(by={self.by!r}): names starting with {_TOOL_PREFIX!r} are the per-tool budgets' own: "
                    "give the shared budget another name"
                )


def window_of(seconds: float, now: float) -> tuple[int, float, float]:
    """The fixed window at ``now``: (its number since the epoch, its start, its end)."""
    index = math.floor(now / seconds)
    return index, index * seconds, (index + 1) * seconds


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def number_text(value: float) -> str:
    """An amount as a person reads it: ``1000000``, ``2.5`` (never ``1e+06``)."""
    return str(int(value)) if float(value).is_integer() else f"{value:.10g}"


def bind(
    budget: object,
    *,
    store: object,
    tool: str,
    params: Sequence[str],
    ignore: Sequence[str],
    others: Iterable[Any],
    readonly: bool = False,
) -> BudgetGuard:
    """The guard of ``budget`` for tool ``tool``, refused with what to do at decoration time.

    ``params``: the tool's parameter names; ``others``: the ledger's guarded tools, whose shared budgets
    must have the same limit and window under one name.
    """
    if not isinstance(budget, Budget):
        raise TypeError(f"budget={budget!r}: give an onceonly.Budget, such as Budget(amount='cents', limit=100)")
    if not isinstance(store, BudgetStore):
        raise TypeError(
            f"budget= needs a store with the budget primitives (onceonly.stores.base.BudgetStore), and "
            f"{type(store).__name__} has none: use a SQLite, Redis or PostgreSQL ledger"
        )
    if readonly:
        raise TypeError(
            "budget= counts calls that have side effects, and effect='read' (readonly=True) keeps no record to count "
            "them by: drop one"
        )
    if isinstance(budget.amount, str):
        if budget.amount not in params:
            raise TypeError(
                f"tool {tool!r}: Budget(amount={budget.amount!r}) is not one of its parameters {list(params)}"
            )
        if budget.amount in ignore:
            raise TypeError(
                f"tool {tool!r}: Budget(amount={budget.amount!r}) is in ignore=, so two calls of other amounts would "
                "be one operation: take it out of ignore="
            )
    shared = (getattr(getattr(made, "spec", None), "budget", None) for made in others)
    known = next((g.budget for g in shared if isinstance(g, BudgetGuard) and g.budget.by == budget.by), None)
    if budget.by not in _BY and known is not None and (known.limit, known.seconds) != (budget.limit, budget.seconds):
        raise ValueError(
            f"tool {tool!r}: the shared budget {budget.by!r} has limit={known.limit!r}, per={known.per!r} on another "
            f"tool, and limit={budget.limit!r}, per={budget.per!r} here: give every tool that shares it the same "
            "Budget (one object)"
        )
    return BudgetGuard(budget, tool)


class BudgetGuard:
    """One tool's budget: reserves before a call, frees what did not happen after it."""

    def __init__(self, budget: Budget, tool: str) -> None:
        self.budget = budget
        self.tool = tool

    def name(self, scope: str) -> str:
        """The budget's name in the store for a call in ``scope``."""
        by = self.budget.by
        if by == "scope":
            return f"{_TOOL_PREFIX}{self.tool}:scope:{scope}"
        if by == "tool":
            return f"{_TOOL_PREFIX}{self.tool}"
        return by

    def amount(self, fields: dict[str, Any]) -> float:
        """The call's amount, refused (``TypeError``/``ValueError``) before anything runs."""
        how = self.budget.amount
        value = fields.get(how) if isinstance(how, str) else how(dict(fields))
        shown = f"argument {how!r}" if isinstance(how, str) else "Budget(amount=...) function"
        if isinstance(value, bool) or not isinstance(value, numbers.Real | decimal.Decimal):
            raise TypeError(
                f"tool {self.tool!r}: the {shown} gave {value!r:.80} ({type(value).__name__}), and a budget counts "
                "numbers: give a finite number, 0 or more"
            )
        amount = float(value)
        if not (math.isfinite(amount) and amount >= 0):
            raise ValueError(f"tool {self.tool!r}: the {shown} gave {value!r}: give a finite number, 0 or more")
        return amount

    def reserve(self, store: Any, call: Call, fields: dict[str, Any]) -> Reservation | None:
        """Hold the call's amount in the current window; ``None`` when refused but the call is a replay
        (it runs nothing, so it costs nothing). Raises ``BudgetExceeded`` otherwise."""
        amount = self.amount(fields)
        name = self.name(call.scope)
        limit = float(self.budget.limit)
        window, start, until = window_of(self.budget.seconds, call.clock())
        got: Reservation = store.budget_reserve(name, window, call.key, amount, limit, start, until)
        if got.granted:
            return got
        # A confirmed operation is replayed whatever the budget: it ran (and counted) in an earlier window.
        rec = store.get(call.key)
        if rec is not None and rec.state is State.CONFIRMED and not rec.is_expired(call.clock()):
            return None
        used, wanted, most = number_text(got.used), number_text(amount), number_text(limit)
        raise BudgetExceeded(
            f"{call.key}: refused by budget {name!r}: {used} of {most} used in the window {_iso(start)} to "
            f"{_iso(until)} (per={self.budget.per!r}), and this call needs {wanted}. Nothing ran or was recorded. It "
            f"resets at {_iso(until)}; see what holds it with `onceonly stats`, free a call that did not happen with "
            "`onceonly resolve KEY --failed`, or raise limit=",
            key=call.key, budget=name, limit=limit, used=got.used, amount=amount, resets_at=until,
        )  # fmt: skip

    def over_limit(self, spec: ToolSpec, call: Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether the call's amount would take its window past the limit now: a read for a dry run, which
        reserves nothing."""
        amount = self.amount(spec.binder.bind(args, kwargs))
        name = self.name(call.scope)
        store: Any = spec.runtime.store
        used = next((u.used for u in store.budget_usage(call.clock()) if u.budget == name), 0.0)
        return bool(used + amount > float(self.budget.limit))

    def run(self, spec: ToolSpec, call: Call, args: tuple[Any, ...], kwargs: dict[str, Any], go: Drive) -> Outcome:
        """Reserve, run the call (``go``), free the amount if the call did not happen."""
        store = spec.runtime.store
        try:
            held = self.reserve(store, call, spec.binder.bind(args, kwargs))
        except BudgetExceeded as refused:
            spec.refused(call, refused)
        try:
            out = go(call, args, kwargs)
        except BaseException as exc:
            if _frees(held, exc) or (_tools_own(exc) and _failed(store, call.key)):
                free(store, call.key)
            raise
        if out.replayed and held is not None and held.new:
            free(store, call.key)  # reserved now for an operation that ran before: it ran nothing now
        return out

    async def arun(
        self, spec: ToolSpec, call: Call, args: tuple[Any, ...], kwargs: dict[str, Any], go: AsyncDrive
    ) -> Outcome:
        """``run`` for an async tool; the store's budget primitives run in a worker thread."""
        store = spec.runtime.store
        try:
            held = await asyncio.to_thread(self.reserve, store, call, spec.binder.bind(args, kwargs))
        except BudgetExceeded as refused:
            spec.refused(call, refused)
        try:
            out = await go(call, args, kwargs)
        except BaseException as exc:
            if _frees(held, exc) or (_tools_own(exc) and await asyncio.to_thread(_failed, store, call.key)):
                await asyncio.to_thread(free, store, call.key)
            raise
        if out.replayed and held is not None and held.new:
            await asyncio.to_thread(free, store, call.key)
        return out


def _frees(held: Reservation | None, exc: BaseException) -> bool:
    """Whether a call that raised ``exc`` did not run here, so that a reservation it made is freed: a
    conflict, a near-duplicate raised, a guardrail's refusal, or a wait for a person's approval (the
    approved call reserves again when it runs)."""
    return held is not None and held.new and isinstance(exc, KeyConflict | SimilarCall | Refused | ApprovalPending)


def _tools_own(exc: BaseException) -> bool:
    """The tool's own error (not onceonly's outcome errors, not an interrupt): the record may be failed."""
    return isinstance(exc, Exception) and not isinstance(exc, OnceOnlyError)


def _failed(store: Any, key: str) -> bool:
    """Whether the call of ``key`` ended settled as failed."""
    try:
        rec = store.get(key)
    except StoreError:
        return False  # unread: keep the amount held (the safe side)
    return rec is not None and rec.state is State.FAILED


def free(store: object, key: str) -> bool:
    """Free what ``key`` holds in any budget, if the store keeps budgets: called wherever a record is
    settled as failed. A store error is logged, not raised: the settlement stands, and the amount stays
    held until its window ends (the safe side)."""
    if not isinstance(store, BudgetStore):
        return False
    try:
        return store.budget_release(key)
    except StoreError as exc:
        _log.warning("onceonly %s: settled as failed, but its budget amount could not be freed: %s", key, exc)
        return False


def usage(store: object, now: float) -> list[BudgetUse]:
    """The current window of every budget in the store (none for a store without budgets)."""
    if not isinstance(store, BudgetStore):
        return []
    return sorted(store.budget_usage(now), key=lambda u: u.budget)
