"""One structured event per transition: to the ``onceonly`` logger and to subscribers (metrics, tests)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from onceonly.states import Record

__all__ = ["TransitionEvent", "event_of"]

log = logging.getLogger("onceonly.transitions")


@dataclass(frozen=True, slots=True)
class TransitionEvent:
    """A record moved from one state to another.

    .. versionadded:: 0.1
    """

    key: str
    tool: str
    scope: str
    from_state: str | None
    to_state: str
    attempt: int
    fence: int
    reason: str
    by: str | None
    at: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


Listener = Callable[[TransitionEvent], None]


def event_of(record: Record) -> TransitionEvent:
    """The event of the transition that produced ``record``: its last history entry."""
    h = record.history_json
    # Entries are JSON objects that start with {"at": — a literal that cannot occur inside a JSON
    # string (its quotes would be escaped), so the last one is found without decoding the list.
    last: dict[str, Any] = json.loads(h[h.rfind('{"at":') : -1])
    return TransitionEvent(
        key=record.key,
        tool=record.tool,
        scope=record.scope,
        from_state=last.get("from"),
        to_state=last["to"],
        attempt=record.attempts,
        fence=last.get("fence", record.fence),
        reason=last.get("reason", ""),
        by=last.get("by"),
        at=last["at"],
    )


def emit(record: Record, listeners: list[Listener]) -> None:
    """Log the transition that produced ``record`` and hand it to each listener."""
    if not listeners and not log.isEnabledFor(logging.INFO):
        return  # nobody listens: the hot path pays nothing for the event
    event = event_of(record)
    if log.isEnabledFor(logging.INFO):
        log.info(
            "%s %s -> %s key=%s attempt=%d fence=%d reason=%s",
            event.tool,
            event.from_state,
            event.to_state,
            event.key,
            event.attempt,
            event.fence,
            event.reason,
            extra={"onceonly": event.as_dict()},
        )
    for listener in listeners:
        try:
            listener(event)
        except Exception:  # a broken listener must not break the ledger
            log.exception("onceonly: a transition listener failed")
