"""The kill switch: pauses an operator sets (``onceonly pause``, ``Ledger.pause``, the dashboard) that
refuse new guarded calls before they claim anything, on every process that shares the store.

A pause is a control document in the store's namespace ``"pause"`` (``stores.base.ControlStore``),
one per (tool or every tool, scope or every scope). Each ledger keeps the pauses it last read
(``PauseWatch``) and reads them again at most every ``REFRESH_SECONDS``, lazily, on the call that finds
the reading due: a call pays a clock read, and a process one store read per half second while it calls.
A pause set anywhere therefore refuses calls everywhere within ``REFRESH_SECONDS`` (plus that read).
The first reading is made as the ledger opens, so a process's first call pays no read either.

What a pause does: a matching call raises ``Paused`` (a model is told "paused by an operator") before
its claim, so its tool does not run and nothing is written, no record, no attempt. Calls that had
started when the pause was set (their automatic retries too) finish and are recorded as usual. Tools
with ``effect="read"`` are never paused: they skip the ledger and have no side effect to stop.
A dry run reports a paused call as ``would="paused"``.
"""

from __future__ import annotations

import asyncio
import getpass
import json
import logging
import math
import shlex
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from onceonly.errors import OnceOnlyError, Paused, StoreError
from onceonly.keys import validate_name
from onceonly.stores.base import AsyncControlStore, ControlStore

if TYPE_CHECKING:
    from onceonly.plan import Call

__all__ = ["NAMESPACE", "REFRESH_SECONDS", "Pause", "PauseWatch", "matching_pause", "paused_error"]

#: The store namespace of the pauses (``ControlStore``).
NAMESPACE = "pause"
#: How stale a ledger's view of the pauses may be: it reads them again at most this often.
REFRESH_SECONDS = 0.5

_log = logging.getLogger("onceonly")


@dataclass(frozen=True, slots=True)
class Pause:
    """One pause: guarded calls of ``tool`` (``None``: every tool) in ``scope`` (``None``: every scope)
    are refused until it is lifted (``onceonly resume``, ``Ledger.resume``).

    Attributes:
        tool: the paused tool, or ``None`` for every tool.
        scope: the paused scope, or ``None`` for every scope.
        reason: why, as the operator gave it (shown to people, never to a model).
        by: who set it.
        at: when it was set (seconds since the epoch, the ledger's clock).

    .. versionadded:: 0.1
    """

    tool: str | None
    scope: str | None
    reason: str
    by: str | None
    at: float

    @property
    def name(self) -> str:
        """The document's name in the store: one pause per (tool, scope)."""
        return pause_name(self.tool, self.scope)

    def covers(self, tool: str, scope: str) -> bool:
        """Whether a call of ``tool`` in ``scope`` is refused by this pause."""
        return (self.tool is None or self.tool == tool) and (self.scope is None or self.scope == scope)

    def what(self) -> str:
        """What it pauses, in words: "tool 'send_email' in every scope"."""
        tool = "every tool" if self.tool is None else f"tool {self.tool!r}"
        scope = "every scope" if self.scope is None else f"scope {self.scope!r}"
        return f"{tool} in {scope}"

    def resume_command(self) -> str:
        """The command that lifts exactly this pause."""
        words = ["onceonly", "resume"]
        if self.tool is not None:
            words += ["--tool", self.tool]
        if self.scope is not None:
            words += ["--scope", self.scope]
        return shlex.join(words)

    def to_json(self) -> dict[str, Any]:
        """The stored document (and the CLI's and the dashboard's JSON)."""
        return {"tool": self.tool, "scope": self.scope, "reason": self.reason, "by": self.by, "at": self.at}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Pause:
        at = doc.get("at")
        return cls(
            tool=_text_or_none(doc.get("tool")),
            scope=_text_or_none(doc.get("scope")),
            reason=str(doc.get("reason", "")),
            by=_text_or_none(doc.get("by")),
            at=float(at) if isinstance(at, int | float) and math.isfinite(at) else 0.0,
        )


def _text_or_none(value: Any) -> str | None:
    return None if value is None else str(value)


def pause_name(tool: str | None, scope: str | None) -> str:
    """The name of the pause of (tool, scope): their JSON, which no two pairs share."""
    return json.dumps([tool, scope], separators=(",", ":"), ensure_ascii=False)


def matching_pause(pauses: Sequence[Pause], tool: str, scope: str) -> Pause | None:
    """The pause that refuses a call of ``tool`` in ``scope``, or ``None``: the most specific one
    (tool and scope, then tool, then scope, then every call), so the message names the narrowest."""
    found = [p for p in pauses if p.covers(tool, scope)]
    if not found:
        return None
    return min(found, key=lambda p: (p.tool is None, p.scope is None))


def when_text(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC") if at > 0 else "an unknown time"


def paused_error(pause: Pause, key: str) -> Paused:
    """The ``Paused`` a call refused by ``pause`` raises: what is paused, why, by whom and since when,
    and how to lift it (the model reads its own text: ``onceonly.tell``)."""
    by = f" by {pause.by}" if pause.by else ""
    message = (
        f"{key!r} was not run: {pause.what()} is paused{by} since {when_text(pause.at)} ({pause.reason!r}). "
        f"Nothing was sent or recorded; lift the pause with `{pause.resume_command()}`"
    )
    return Paused(message, key=key, reason=pause.reason, tool=pause.tool, scope=pause.scope)


def default_by() -> str:
    """Who sets a pause when nobody says: this host's user, user@host."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no user name in the environment nor the password database
        user = "unknown"
    return f"{user}@{socket.gethostname()[:40]}"


def check_target(tool: str | None, scope: str | None) -> None:
    if tool is not None:
        validate_name(tool, "tool")
    if scope is not None:
        validate_name(scope, "scope")


def _decoded(docs: dict[str, dict[str, Any]]) -> tuple[Pause, ...]:
    return tuple(sorted((Pause.from_json(d) for d in docs.values()), key=lambda p: (p.at, p.name)))


class PauseWatch:
    """One ledger's view of the pauses: the last ones read, read again when ``REFRESH_SECONDS`` passed.

    ``matching(call)`` is the hot path: with no pause in view and the reading not due, a clock read and
    two attribute reads. A store without control documents is never read (nothing can be paused there).
    """

    __slots__ = ("_async", "_clock", "current", "due_at", "store")

    def __init__(self, store: Any, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.store: ControlStore | None = store if isinstance(store, ControlStore) else None
        self._async: AsyncControlStore | None = store if isinstance(store, AsyncControlStore) else None
        #: The pauses last read.
        self.current: tuple[Pause, ...] = ()
        #: When (monotonic clock) the pauses are read again; never, on a store without them.
        self.due_at = math.inf
        if self.store is not None:
            # Read once now, as the ledger opens (it reads the store's clock then too), so that a
            # process's first call pays no read either. A store that fails now is read on the first call.
            self.due_at = -math.inf
            try:
                self.read()
            except Exception as exc:  # a store of one's own may raise anything: opening must not fail on it
                _unread(exc)

    def matching(self, call: Call) -> Paused | None:
        """The ``Paused`` that refuses ``call``, or ``None``; reads the store when the reading is due."""
        now = self._clock()
        if now < self.due_at:
            if not self.current:
                return None
        elif self.store is not None:
            # Due again from now whether the read works or not: a store that fails is not asked on every
            # call (the call's own claim finds out soon enough), and the pauses last read stay in force.
            self.due_at = now + REFRESH_SECONDS
            try:
                self.current = _decoded(self.store.controls(NAMESPACE))
            except (StoreError, ValueError) as exc:
                _unread(exc)
        return self._refusal(call)

    def due(self) -> bool:
        """Whether the next call reads the store (an async call awaits ``amatching`` then)."""
        return self._clock() >= self.due_at

    async def amatching(self, call: Call) -> Paused | None:
        """``matching``, with the store read awaited."""
        now = self._clock()
        if now >= self.due_at and self.store is not None:
            self.due_at = now + REFRESH_SECONDS
            try:
                if self._async is not None:
                    docs = await self._async.acontrols(NAMESPACE)
                else:  # a store of one's own with only the sync face: read off the loop
                    docs = await asyncio.to_thread(self.store.controls, NAMESPACE)
                self.current = _decoded(docs)
            except (StoreError, ValueError) as exc:
                _unread(exc)
        return self._refusal(call)

    def _refusal(self, call: Call) -> Paused | None:
        if not self.current:
            return None
        found = matching_pause(self.current, call.tool, call.scope)
        return None if found is None else paused_error(found, call.key)

    # --- what Ledger.pause / resume / pauses do ---------------------------------------------------

    def _require(self) -> ControlStore:
        if self.store is None:
            raise OnceOnlyError(
                "this ledger's store keeps no control documents (onceonly.stores.base.ControlStore), so its calls "
                "cannot be paused: use a SQLite, Redis or PostgreSQL ledger, or add controls(), put_control() and "
                "delete_control() to the store"
            )
        return self.store

    def read(self) -> list[Pause]:
        """The pauses in the store now (one read), which this ledger then holds to."""
        self.due_at = self._clock() + REFRESH_SECONDS
        self.current = _decoded(self._require().controls(NAMESPACE))
        return list(self.current)

    def set(self, pause: Pause) -> Pause:
        """Write ``pause`` (replacing the one of the same tool and scope); in force here at once."""
        self._require().put_control(NAMESPACE, pause.name, pause.to_json())
        self.read()
        return pause

    def lift(self, tool: str | None, scope: str | None, every: bool = False) -> list[Pause]:
        """Delete the pause of (tool, scope), or every pause; return those lifted."""
        store = self._require()
        chosen = [p for p in _decoded(store.controls(NAMESPACE)) if every or (p.tool, p.scope) == (tool, scope)]
        lifted = [p for p in chosen if store.delete_control(NAMESPACE, p.name)]
        self.read()
        return lifted


def _unread(exc: Exception) -> None:
    _log.warning("onceonly: could not read the pauses (%s); the ones last read stay in force", exc)
