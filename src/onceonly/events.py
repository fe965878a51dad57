"""One structured event per transition: to the ``onceonly`` logger and to subscribers (metrics, tests);
and alerts: WARNING events on ``onceonly.alerts`` whose ``event`` name is stable, for log-based alerting.

Alert names: ``KeyConflict`` (a key reused with other arguments), ``LateDuplicate`` (a late outcome that
reveals the side effect happened twice, or where the record said it did not), ``ParkedForReview`` (a
record moved to needs_review: a person must settle it), ``AuditDisagreement`` (``onceonly audit``).
``KeyConflict`` comes from each place a key meets other arguments: the guard (``source="guard"``), the
server middleware's 422 (``"server"``) and ``onceonly.http``'s 422 from a server (``"http"``).
Alert listeners (``onceonly.metrics``) hear every alert of the process.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from onceonly.states import Record, State

__all__ = ["ALERTS", "TransitionEvent", "alert", "event_of", "key_conflict", "listen_alerts", "moved_from", "short_key"]

log = logging.getLogger("onceonly.transitions")
#: The logger of alerts: each record carries ``extra={"onceonly": {"event": NAME, ...}}``.
alerts = logging.getLogger("onceonly.alerts")
#: The alert names, stable.
ALERTS = ("KeyConflict", "LateDuplicate", "ParkedForReview", "AuditDisagreement")


AlertListener = Callable[[str, dict[str, Any]], None]
_alert_listeners: list[AlertListener] = []


def listen_alerts(listener: AlertListener) -> None:
    """Call ``listener(event, fields)`` after every alert of this process (the metrics count them).

    .. versionadded:: 0.1
    """
    _alert_listeners.append(listener)


def alert(event: str, message: str, **fields: Any) -> None:
    """Log an alert: a WARNING on ``onceonly.alerts``, ``extra={"onceonly": {"event": event, **fields}}``.

    .. versionadded:: 0.1
    """
    alerts.warning("%s: %s", event, message, extra={"onceonly": {"event": event, **fields}})
    for listener in _alert_listeners:
        try:
            listener(event, fields)
        except Exception:  # a broken listener must not break the caller
            log.exception("onceonly: an alert listener failed")


def short_key(key: str) -> str:
    """A key as an alert shows a key that came from outside (an HTTP client's, which may hold anything):
    16 hex digits of its SHA-256, enough to match it against a suspected key, never the key itself.

    .. versionadded:: 0.1
    """
    return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def key_conflict(exc: BaseException | None, message: str, *, source: str, **fields: Any) -> None:
    """The ``KeyConflict`` alert, once per exception ``exc`` (if there is one): a 422 that
    ``onceonly.http`` alerted inside a guarded tool reaches the guard again as the tool's own error, and
    must not count twice.

    .. versionadded:: 0.1
    """
    if exc is not None:
        if getattr(exc, "_onceonly_alerted", False):
            return
        with contextlib.suppress(AttributeError):  # an exception type with __slots__: alert anyway
            exc._onceonly_alerted = True  # type: ignore[attr-defined]
    alert("KeyConflict", message, source=source, **fields)


def alerting(record: Record) -> bool:
    """Whether the transition that produced ``record`` may be worth an alert (two cheap checks: the
    writers call this on every write, and emit() then decides)."""
    return record.state is State.NEEDS_REVIEW or record.conflicts > 0


def _alert_on(record: Record) -> None:
    last: dict[str, Any] = json.loads(record.history_json[record.history_json.rfind('{"at":') : -1])
    frm, to, reason = last.get("from"), last.get("to"), str(last.get("reason", ""))
    where = {"key": record.key, "tool": record.tool, "scope": record.scope}
    if to == "needs_review" and frm != "needs_review":
        alert("ParkedForReview", f"{record.key} ({record.tool}) needs a person: {reason}", reason=reason, **where)
    elif "possible duplicate" in reason or (frm == "failed" and reason.startswith("confirmed via late:")):
        alert(
            "LateDuplicate",
            f"{record.key} ({record.tool}): a late outcome shows the side effect happened more than the ledger "
            f"said ({reason}); conflicts={record.conflicts}",
            reason=reason,
            conflicts=record.conflicts,
            **where,
        )


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
    #: The record's ``via`` (how its outcome was settled: ``run``, ``probe``, ``late:N``…), if any.
    via: str | None = None

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
        via=record.via,
    )


def moved_from(record: Record) -> str | None:
    """The state the transition that produced ``record`` came from (``None``: it was made), read from
    its last history entry's fixed prefix (``{"at":T,"from":S,``, written by ``states``) without
    decoding it: the cheap part of ``event_of`` for a watcher on the hot path."""
    h = record.history_json
    start = h.rfind('{"at":')
    at = h.find(',"from":', start) + 8
    if h.startswith("null", at):
        return None
    return h[at + 1 : h.index('"', at + 1)]


def emit(record: Record, listeners: list[Listener]) -> None:
    """Log the transition that produced ``record`` and hand it to each listener; alert on a record
    parked for review or a late duplicate."""
    if alerting(record):
        _alert_on(record)
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
