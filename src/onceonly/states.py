"""Ledger records, their states and every transition between them. Pure, no I/O.

A store applies a transition as a compare-and-set on ``version``: read a record, compute the next one
here, write it only if nobody wrote in between. Each function returns a new ``Record``; none mutates.
docs/design.md#states has the states and their transitions; ``ALLOWED`` below is that table in code.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from json.encoder import encode_basestring as _quote
from typing import Any

from onceonly.errors import StoreCorrupt

__all__ = [
    "ALLOWED",
    "APPROVED_BY",
    "DENIED_BY",
    "HISTORY_LIMIT",
    "REDACTED_SECRET",
    "SECRET_FINGERPRINT",
    "SETTLED",
    "UNSETTLED",
    "IllegalTransition",
    "Record",
    "State",
    "approval_of",
    "approve",
    "approved_unclaimed",
    "ask_again",
    "ask_approval",
    "asked_at",
    "denial_of",
    "deny",
    "holds_secret",
    "may_have_happened",
    "misplaced",
    "new_record",
    "not_finite_time",
    "out_of_range",
    "restart",
    "shown_result",
    "transition",
]


class State(enum.Enum):
    """The state of one ledger record.

    .. versionadded:: 0.1
    """

    PENDING = "pending"  # claimed; the tool said nothing was sent yet: a crash here is safe to retry
    IN_FLIGHT = "in_flight"  # claimed; the side effect may have started
    CONFIRMED = "confirmed"  # done, result recorded
    FAILED = "failed"  # definitely did not happen
    UNKNOWN = "unknown"  # sent, outcome unknown: must be settled, never re-run blindly
    NEEDS_REVIEW = "needs_review"  # parked for a person
    ABANDONED = "abandoned"  # attempts exhausted
    AWAITING_APPROVAL = "awaiting_approval"  # a person's approval is asked for; nothing ran (approve=)

    # Enum hashes in Python (hash of the name); members are singletons compared by identity, so the
    # identity hash agrees with equality and keeps the state tables' lookups in C (~7 per call).
    __hash__ = object.__hash__


#: States in which a caller holds a lease.
HELD = frozenset({State.PENDING, State.IN_FLIGHT})
#: States whose side effect may have happened without a recorded outcome.
UNSETTLED = frozenset({State.PENDING, State.IN_FLIGHT, State.UNKNOWN, State.NEEDS_REVIEW})
SETTLED = frozenset({State.CONFIRMED, State.FAILED, State.ABANDONED})

# from → the states it may move to. A claim of a new key has no "from". CONFIRMED → IN_FLIGHT/PENDING
# only happens once the record expired (its ttl passed): a fresh claim replaces it. ABANDONED →
# IN_FLIGHT/PENDING only when none of its attempts may have happened (``restart``). AWAITING_APPROVAL
# holds no lease and is neither settled nor unsettled (nothing ran): ``approve`` moves it to PENDING
# with a lease already run out (the next call takes it over), ``deny`` to FAILED; a record of an
# ``approve=`` tool goes (back) to it when a new operation would start (``ask_approval``).
ALLOWED: Mapping[State, frozenset[State]] = {
    State.PENDING: frozenset(
        {State.PENDING, State.IN_FLIGHT, State.CONFIRMED, State.FAILED, State.UNKNOWN, State.ABANDONED}
    ),
    State.IN_FLIGHT: frozenset({State.IN_FLIGHT, State.CONFIRMED, State.FAILED, State.UNKNOWN}),
    State.UNKNOWN: frozenset(
        {State.PENDING, State.IN_FLIGHT, State.CONFIRMED, State.FAILED, State.NEEDS_REVIEW, State.ABANDONED}
    ),
    State.NEEDS_REVIEW: frozenset({State.CONFIRMED, State.FAILED}),
    State.FAILED: frozenset(
        {State.PENDING, State.IN_FLIGHT, State.CONFIRMED, State.FAILED, State.ABANDONED, State.AWAITING_APPROVAL}
    ),
    State.ABANDONED: frozenset(
        {State.CONFIRMED, State.FAILED, State.PENDING, State.IN_FLIGHT, State.AWAITING_APPROVAL}
    ),
    State.CONFIRMED: frozenset({State.CONFIRMED, State.PENDING, State.IN_FLIGHT, State.AWAITING_APPROVAL}),
    State.AWAITING_APPROVAL: frozenset({State.PENDING, State.FAILED, State.CONFIRMED}),
}


#: How many transitions a record keeps in its history; older ones are dropped.
HISTORY_LIMIT = 32


class IllegalTransition(ValueError):
    """A transition the ledger does not allow (the state table, or a time that is not a finite number):
    a bug in the caller, never an outcome."""


_isfinite = math.isfinite
#: The record's fields that hold times: each is a finite number or None, never inf or NaN (which
#: some stores would keep as ``Infinity`` and every later call would then trip over).
_TIMES = frozenset({"lease_until", "next_attempt_at", "expires_at", "created_at", "updated_at"})


def _not_finite(key: str, **times: float | None) -> IllegalTransition:
    """The error for the first of ``times`` that is not finite (the hot paths check a sum of them)."""
    name, value = next(((n, v) for n, v in times.items() if v is not None and not _isfinite(v)), ("time", None))
    return IllegalTransition(
        f"{key}: {name}={value!r} is not a finite time; a record never holds one (a clock or a wait that "
        "produced it is wrong)"
    )


#: The fingerprint of a record that keeps a secret (the key of the hash that scopes network callers,
#: ``onceonly.callers``): no call's fingerprint (a SHA-256 hex digest) can be this.
SECRET_FINGERPRINT = "client-secret"
#: What every output shows for the result of a record that keeps a secret.
REDACTED_SECRET = "<secret: redacted>"


def holds_secret(rec: Record) -> bool:
    """Whether ``rec`` keeps a secret as its result, which no output may show.

    .. versionadded:: 0.1
    """
    return rec.fingerprint == SECRET_FINGERPRINT


def shown_result(rec: Record) -> Any:
    """The result of ``rec`` as an output shows it (the CLI, the dashboard, logs): decoded, or
    ``REDACTED_SECRET`` when the record keeps a secret. The stored result is unchanged.

    .. versionadded:: 0.1
    """
    if holds_secret(rec):
        return None if rec.result_json is None else REDACTED_SECRET
    return rec.result


@dataclass(slots=True, repr=False)
class Record:
    """One ledger record: one logical operation.

    ``result_json``, ``args_json`` and ``history_json`` hold JSON text as stored, so the hot path never
    decodes what it does not read. ``result``, ``args`` and ``history`` decode them.

    Treat a record as immutable: every transition returns a new one. (Not ``frozen=True`` only
    because a frozen dataclass costs several microseconds per construction on the hot path.)

    .. versionadded:: 0.1
    """

    key: str
    scope: str
    tool: str
    fingerprint: str
    state: State
    attempts: int = 0
    fence: int = 0
    version: int = 1
    lease_owner: str | None = None
    lease_until: float | None = None
    next_attempt_at: float | None = None
    expires_at: float | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    result_json: str | None = None
    error: str | None = None
    args_json: str = "{}"
    history_json: str = "[]"
    via: str | None = None
    conflicts: int = 0

    @property
    def result(self) -> Any:
        """The recorded result, decoded. Raises ``StoreCorrupt`` when the stored text is not JSON."""
        return None if self.result_json is None else _decoded(self.key, "result", self.result_json)

    @property
    def args(self) -> dict[str, Any]:
        """The call's arguments, decoded. Raises ``StoreCorrupt`` when the stored text is not a JSON object."""
        loaded = _decoded(self.key, "args", self.args_json)
        if type(loaded) is not dict:
            raise _misshapen(self.key, "args", "a JSON object of the call's arguments", self.args_json)
        return loaded

    @property
    def history(self) -> list[dict[str, Any]]:
        """The transitions, oldest first. Raises ``StoreCorrupt`` when the stored text is not a JSON list
        of transitions as onceonly writes them."""
        return _history(self.key, self.history_json)

    def is_expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    def lease_expired(self, now: float) -> bool:
        return self.state in HELD and (self.lease_until is None or self.lease_until <= now)

    def __repr__(self) -> str:
        # A repr reaches logs and error messages: a kept secret is never in it (``shown_result``).
        shown = {f: getattr(self, f) for f in _FIELDS}
        if holds_secret(self) and self.result_json is not None:
            shown["result_json"] = REDACTED_SECRET
        return f"Record({', '.join(f'{f}={v!r}' for f, v in shown.items())})"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view, for the CLI, the dashboard and logs; a kept secret shows as
        ``REDACTED_SECRET`` (``shown_result``)."""
        return {
            "key": self.key,
            "scope": self.scope,
            "tool": self.tool,
            "fingerprint": self.fingerprint,
            "state": self.state.value,
            "attempts": self.attempts,
            "fence": self.fence,
            "version": self.version,
            "lease_owner": self.lease_owner,
            "lease_until": self.lease_until,
            "next_attempt_at": self.next_attempt_at,
            "expires_at": self.expires_at,
            "created_at": self.created_at,
            "updated_at": self.updated_at,
            "result": shown_result(self),
            "error": self.error,
            "args": self.args,
            "history": self.history,
            "via": self.via,
            "conflicts": self.conflicts,
        }


def _decoded(key: str, field: str, text: Any) -> Any:
    """``text`` decoded from JSON, or ``StoreCorrupt`` naming the record and the field."""
    try:
        return json.loads(text)
    # Not JSON (JSONDecodeError), not text at all, or nested deeper than onceonly writes (MAX_DEPTH):
    # the decoder recurses once per level, and past the recursion limit the text cannot be read.
    except (ValueError, TypeError, RecursionError) as exc:
        raise StoreCorrupt(
            f"the record of {key!r} holds a {field} that is not JSON ({type(exc).__name__}: {exc}): something "
            f"other than onceonly wrote it, or it was damaged. Nothing was changed: restore the stored {field}, "
            "or delete the record if its operation may run again"
        ) from None


def _misshapen(key: str, field: str, what: str, text: str) -> StoreCorrupt:
    shown = text if len(text) <= 80 else text[:77] + "..."
    return StoreCorrupt(
        f"the record of {key!r} holds {field} that are not {what} ({shown!r}): something other than onceonly "
        f"wrote it, or it was damaged. Nothing was changed: restore the stored {field}, or delete the record if "
        "its operation may run again"
    )


def _is_entry(entry: Any) -> bool:
    """Whether ``entry`` is a transition as ``_entry`` writes it (what every reader of a history relies on)."""
    if type(entry) is not dict:
        return False
    at: Any = entry.get("at")
    frm = entry.get("from")
    return (
        type(at) in (int, float)
        and _isfinite(at)
        and type(entry.get("to")) is str
        and type(entry.get("fence")) is int
        and (frm is None or type(frm) is str)
    )


def _history(key: str, text: str) -> list[dict[str, Any]]:
    """A stored history decoded, or ``StoreCorrupt`` when it is not a list of transitions."""
    loaded = _decoded(key, "history", text)
    if type(loaded) is not list or not all(map(_is_entry, loaded)):
        raise _misshapen(key, "history", "a list of transitions", text)
    return loaded


_NONE = type(None)
_OPTIONAL_FLOAT = frozenset({float, _NONE})
_OPTIONAL_TEXT = frozenset({str, _NONE})
# The slow path's rule per field (a number may be an int where a float belongs: JSON keeps 5.0 as 5).
_KINDS = (
    ("scope", (str,)), ("tool", (str,)), ("fingerprint", (str,)), ("attempts", (int,)), ("fence", (int,)),
    ("version", (int,)), ("lease_owner", (str, _NONE)), ("lease_until", (float, int, _NONE)),
    ("next_attempt_at", (float, int, _NONE)), ("expires_at", (float, int, _NONE)), ("created_at", (float, int)),
    ("updated_at", (float, int)), ("result_json", (str, _NONE)), ("error", (str, _NONE)), ("args_json", (str,)),
    ("history_json", (str,)), ("via", (str, _NONE)), ("conflicts", (int,)),
)  # fmt: skip


def misplaced(rec: Record) -> tuple[str, Any] | None:
    """The first field of ``rec`` that does not hold a value of its type, as (name, value); else None.

    Stores whose fields take any type (SQLite's columns, the JSON of a Redis record) check each record
    they decode, so that text where a number belongs is reported as ``StoreCorrupt`` naming the key,
    not as a ``TypeError`` deep in the guard. The state is the store's own check.

    .. versionadded:: 0.1
    """
    # The shape of nearly every record, in a few chained comparisons: this runs on every read.
    if (
        type(rec.attempts) is type(rec.fence) is type(rec.version) is type(rec.conflicts) is int
        and type(rec.created_at) is type(rec.updated_at) is float
        and type(rec.scope) is type(rec.tool) is type(rec.fingerprint) is type(rec.args_json) is str
        and type(rec.history_json) is str
        and type(rec.lease_until) in _OPTIONAL_FLOAT
        and type(rec.next_attempt_at) in _OPTIONAL_FLOAT
        and type(rec.expires_at) in _OPTIONAL_FLOAT
        and type(rec.lease_owner) in _OPTIONAL_TEXT
        and type(rec.result_json) in _OPTIONAL_TEXT
        and type(rec.error) in _OPTIONAL_TEXT
        and type(rec.via) in _OPTIONAL_TEXT
    ):
        return out_of_range(rec)
    for name, kinds in _KINDS:
        value = getattr(rec, name)
        if type(value) not in kinds:
            return name, value
    return out_of_range(rec)


def out_of_range(rec: Record) -> tuple[str, Any] | None:
    """The first field of ``rec`` that holds a value onceonly never writes, as (name, value); else None:
    a time that is not finite (``not_finite_time``), or a counter below where it starts (attempts,
    fence and conflicts count up from 0, the version from 1).

    A negative fence would pass every fence comparison a later claim makes, and negative attempts
    would grant a retry that the limit forbids: a record holding one is reported, never acted on.

    .. versionadded:: 0.1
    """
    if rec.attempts < 0 or rec.fence < 0 or rec.conflicts < 0 or rec.version < 1:
        for name, low in (("attempts", 0), ("fence", 0), ("version", 1), ("conflicts", 0)):
            if getattr(rec, name) < low:
                return name, getattr(rec, name)
    return not_finite_time(rec)


def not_finite_time(rec: Record) -> tuple[str, float] | None:
    """The first time of ``rec`` that is NaN or infinite, as (name, value); else None.

    onceonly never writes one (``transition`` refuses it), but a store's number fields take them
    (PostgreSQL's ``double precision``, SQLite's ``REAL``, and Python's JSON reads ``NaN``): read as
    a time it would compare false with every other, and a lease that never ends is a key held forever.

    .. versionadded:: 0.1
    """
    total = rec.created_at + rec.updated_at  # one check of a sum on every read; each field only then
    for value in (rec.lease_until, rec.next_attempt_at, rec.expires_at):
        if value is not None:
            total += value
    if _isfinite(total):
        return None
    for name in ("created_at", "updated_at", "lease_until", "next_attempt_at", "expires_at"):
        value = getattr(rec, name)
        if value is not None and not _isfinite(value):
            return name, value
    return None  # each is finite; only their sum was not


#: Each state's JSON string, and null for "no state" (Enum.value is a descriptor call; this runs
#: twice per guarded call).
_FROM: dict[State | None, str] = {s: f'"{s.value}"' for s in State}
_FROM[None] = "null"
_REASONS: dict[str, str] = {}  # reason → its JSON member; the hot path's reasons are a few constants


def _storable(text: str) -> str:
    """``text`` as every store can hold it: NUL (which PostgreSQL text refuses) as U+FFFD, and a lone
    surrogate (which has no UTF-8 form; ``surrogateescape`` leaves them in decoded bytes) as its
    ``\\udcxx`` escape. Exception messages and people's notes reach records through here.
    """
    if "\x00" in text:
        text = text.replace("\x00", "\ufffd")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _entry(frm: State | None, to: State, now: float, reason: str, fence: int, by: str | None, extra: str = "") -> str:
    # Built by hand: this runs twice per guarded call. Floats print as valid JSON via repr; strings
    # are escaped by the json module's C helper (which keeps lone surrogates: _storable() escapes them).
    why = _REASONS.get(reason)
    if why is None:
        why = f',"reason":{_quote(_storable(reason))}' if reason else ""
        if len(_REASONS) < 1024:  # reasons that carry errors vary: keep the cache bounded
            _REASONS[reason] = why
    who = f',"by":{_quote(by if by.isascii() else _storable(by))}' if by else ""
    return f'{{"at":{now!r},"from":{_FROM[frm]},"to":{_FROM[to]},"fence":{fence}{why}{who}{extra}}}'


_FIELDS = tuple(f.name for f in fields(Record))


def _make_replace() -> Callable[..., Record]:
    # dataclasses.replace() inspects the class on every call; this runs on every transition of every
    # guarded call, so it is generated once, as plain code: Record(c.get("key", r.key), ...).
    args = ", ".join(f'c["{n}"] if "{n}" in c else r.{n}' for n in _FIELDS)
    namespace: dict[str, Any] = {"Record": Record}
    exec(f"def replace(r, c):\n    return Record({args})", namespace)
    fn: Callable[..., Record] = namespace["replace"]
    return fn


_replace = _make_replace()


def replace(rec: Record, **changes: Any) -> Record:
    """A copy of ``rec`` with ``changes`` (``dataclasses.replace``, without its per-call introspection)."""
    return _replace(rec, changes)


#: The history member that marks an attempt's end as one that cannot have had an effect.
_NO_EFFECT = ',"effect":false'


def _append(history_json: str, entry: str, version: int, key: str) -> str:
    # String append keeps the hot path free of a decode; only long histories are decoded and trimmed,
    # and text that does not even look like what onceonly writes, so that a damaged history is refused
    # (StoreCorrupt, the record kept as it is) rather than written over with more damage.
    if version < HISTORY_LIMIT:
        if history_json == "[]":
            return f"[{entry}]"
        if history_json[:2] == "[{" and history_json[-2:] == "}]":
            return f"{history_json[:-1]},{entry}]"
    items = _history(key, history_json)
    items.append(json.loads(entry))
    return json.dumps(items[-HISTORY_LIMIT:], separators=(",", ":"), ensure_ascii=False)


def new_record(
    *,
    key: str,
    scope: str,
    tool: str,
    fingerprint: str,
    args_json: str,
    state: State,
    owner: str,
    now: float,
    lease_seconds: float,
    reason: str = "claim",
) -> Record:
    """The first claim of a key: attempt 1, fence 1, version 1, held by ``owner``.

    .. versionadded:: 0.1
    """
    if state not in HELD:
        raise IllegalTransition(f"a new record is claimed into pending or in_flight, not {state.value}")
    lease_until = now + lease_seconds
    if not _isfinite(lease_until):  # inf or NaN in either
        raise _not_finite(key, now=now, lease_until=lease_until)
    # Positional: the first write of every guarded call; keyword construction costs more.
    return Record(
        key, scope, tool, fingerprint, state, 1, 1, 1, owner, lease_until, None, None, now, now, None,
        None, args_json, f"[{_entry(None, state, now, reason, 1, owner)}]", None, 0,
    )  # fmt: skip


def dispatch_target(rec: Record) -> dict[str, str] | None:
    """What the current attempt of ``rec`` was dispatched to (``transition(target=...)``), if it said:
    ``{"method", "url", "key", "status"}`` of an HTTP request whose server serves key statuses.

    .. versionadded:: 0.1
    """
    if '"target"' not in rec.history_json:
        return None
    for entry in reversed(rec.history):
        found = entry.get("target")
        if entry.get("fence") == rec.fence and isinstance(found, dict) and isinstance(found.get("status"), str):
            return {str(k): str(v) for k, v in found.items()}
    return None


def transition(
    rec: Record,
    to: State,
    *,
    now: float,
    reason: str = "",
    by: str | None = None,
    effect: bool | None = None,
    similar_to: str | None = None,
    target: Mapping[str, str] | None = None,
    note: Mapping[str, str] | None = None,
    **changes: Any,
) -> Record:
    """Move ``rec`` to ``to``: checks the table, bumps ``version``, appends one history entry.

    ``target`` puts what a dispatch was sent to in the entry (``dispatch_target``): an HTTP request's
    method, URL without its query, key and key status URL, so that a reconciler can ask that server.

    ``changes`` sets other fields (``result_json``, ``error``, ``lease_until``…). ``effect=False`` marks
    the entry as the end of an attempt that cannot have had an effect (``may_have_happened``); ``None``
    (the default) and ``True`` leave it unmarked. ``similar_to`` links the entry to the key of another
    record (a call taken for a near-duplicate of it, ``onceonly.Similar``). ``note`` adds text members
    to the entry (a person's approval: ``approved_by``).

    Raises:
        IllegalTransition: the table in ``ALLOWED`` does not allow it, or a time is not finite.

    .. versionadded:: 0.1
    """
    if to not in ALLOWED[rec.state]:
        raise IllegalTransition(f"{rec.key}: {rec.state.value} → {to.value} is not a transition of the ledger")
    if not _isfinite(now):
        raise _not_finite(rec.key, now=now)
    for name, value in changes.items():
        if value is not None and name in _TIMES and not _isfinite(value):
            raise _not_finite(rec.key, **{name: value})
    version = rec.version + 1
    fence = changes.get("fence", rec.fence)
    mark = _NO_EFFECT if effect is False else ""
    if similar_to is not None:
        mark += f',"similar_to":{_quote(_storable(similar_to))}'
    if target is not None:
        mark += ',"target":' + json.dumps({str(k): str(v) for k, v in target.items()}, ensure_ascii=True)
    if note is not None:
        mark += "".join(f",{_quote(str(k))}:{_quote(_storable(str(v)))}" for k, v in note.items())
    if changes.get("error") is not None:
        changes["error"] = _storable(changes["error"])
    return replace(
        rec,
        state=to,
        version=version,
        updated_at=now,
        history_json=_append(rec.history_json, _entry(rec.state, to, now, reason, fence, by, mark), version, rec.key),
        **changes,
    )


# --- the transitions the ledger uses, named -----------------------------------------------------


def claim_again(rec: Record, *, state: State, owner: str, now: float, lease_seconds: float, reason: str) -> Record:
    """Reclaim an existing record for a new attempt: fence and attempts go up by one."""
    if state not in HELD:
        raise IllegalTransition(f"a claim is into pending or in_flight, not {state.value}")
    return transition(
        rec,
        state,
        now=now,
        reason=reason,
        by=owner,
        fence=rec.fence + 1,
        attempts=rec.attempts + 1,
        lease_owner=owner,
        lease_until=now + lease_seconds,
        next_attempt_at=None,
        error=None,
    )


def renew(rec: Record, *, state: State, owner: str, now: float, lease_seconds: float, reason: str) -> Record:
    """An expired confirmed record is claimed as new, into ``state`` like any claim (``pending`` for a
    tool that reports its dispatch): attempts start again at 1, fence keeps rising."""
    if not rec.is_expired(now):
        raise IllegalTransition(f"{rec.key}: a confirmed record is only claimed again after it expired")
    fresh = replace(rec, attempts=0, result_json=None, via=None, expires_at=None, conflicts=0)
    return claim_again(fresh, state=state, owner=owner, now=now, lease_seconds=lease_seconds, reason=reason)


#: Where an attempt that may have had an effect leaves a trace: its outcome was open, or it happened.
_EFFECT_STATES = frozenset({State.UNKNOWN.value, State.NEEDS_REVIEW.value, State.CONFIRMED.value})
_HELD_VALUES = frozenset({State.PENDING.value, State.IN_FLIGHT.value})


def may_have_happened(rec: Record) -> bool:
    """Whether any attempt that counts toward ``rec.attempts`` may have had an effect, judged from the
    history.

    The counted attempts are the last ``rec.attempts`` claims (entries into ``pending`` or ``in_flight``
    under a new fence), found walking back from the newest entry; an attempt given back as control flow
    (a ``failed`` entry whose reason starts with ``RELEASED``, which uncounts it) is skipped. A renewal
    or a reset sets the count back to 0, so the attempts before it are never read.

    An attempt had no effect when it failed before reaching the other side (its ``failed`` entry is
    marked ``"effect": false``: not sent, or refused before it ran) or ended while still ``pending`` (the
    tool had not dispatched). Any other end (unknown, confirmed, the tool's own error, a person's
    resolve) may have had one. A history trimmed (``HISTORY_LIMIT``) past the first counted claim cannot
    tell: then ``True``, the cautious answer.

    .. versionadded:: 0.1
    """
    if rec.attempts < 1:
        return True
    entries = rec.history
    need = rec.attempts
    start = None
    for i in range(len(entries) - 1, -1, -1):
        entry = entries[i]
        if _released(entry):
            need += 1  # its claim, met further back, is not one of the counted attempts
            continue
        # A claim raises the fence; the first entry of a trimmed history may be anything, so only a
        # first entry that claims a new key (from nothing) is taken as a claim there.
        fresh = entry.get("from") is None if i == 0 else entry.get("fence") != entries[i - 1].get("fence")
        if entry.get("to") in _HELD_VALUES and fresh:
            need -= 1
            if need == 0:
                start = i
                break
    if start is None:
        return True
    for entry in entries[start:]:
        to = entry.get("to")
        if to in _EFFECT_STATES:
            return True
        if to == State.FAILED.value and entry.get("effect") is not False and not _released(entry):
            return True
    return False


#: How the reason of a claim given back as control flow begins (``onceonly.plan.attempt``): that attempt is
#: not counted and is not an outcome.
RELEASED = "released:"


def _released(entry: Mapping[str, Any]) -> bool:
    reason = entry.get("reason")
    return entry.get("to") == State.FAILED.value and isinstance(reason, str) and reason.startswith(RELEASED)


def restart(rec: Record, *, state: State, owner: str, now: float, lease_seconds: float, reason: str) -> Record:
    """Claim an ``abandoned`` record afresh, with a new attempt budget, because none of its attempts may
    have had an effect (``may_have_happened``): nothing happened, so nothing stands in the way. Attempts
    start again at 1; the fence keeps rising.

    Raises:
        IllegalTransition: the record is not abandoned, or one of its attempts may have had an effect.
    """
    if rec.state is not State.ABANDONED or may_have_happened(rec):
        raise IllegalTransition(
            f"{rec.key}: only an abandoned record none of whose attempts may have happened starts afresh"
        )
    fresh = replace(rec, attempts=0)
    return claim_again(fresh, state=state, owner=owner, now=now, lease_seconds=lease_seconds, reason=reason)


def replace_args(rec: Record, *, fingerprint: str, args_json: str) -> Record:
    """A reclaim by a call with other arguments (``on_conflict="replay"``): the record takes them."""
    return replace(rec, fingerprint=fingerprint, args_json=args_json)


def confirm(rec: Record, *, result_json: str | None, now: float, ttl: float | None, via: str, by: str | None) -> Record:
    """The outcome is known and happened: record the result, release the lease."""
    if State.CONFIRMED not in ALLOWED[rec.state]:
        raise IllegalTransition(f"{rec.key}: {rec.state.value} → confirmed is not a transition of the ledger")
    # Built field by field rather than through transition(): this is the second write of every
    # guarded call, and the generic path's keyword dictionaries cost several microseconds.
    expires_at = None if ttl is None else now + ttl
    if not _isfinite(now if expires_at is None else expires_at):
        raise _not_finite(rec.key, now=now, expires_at=expires_at)
    version = rec.version + 1
    entry = _entry(rec.state, State.CONFIRMED, now, f"confirmed via {via}", rec.fence, by)
    return Record(
        rec.key, rec.scope, rec.tool, rec.fingerprint, State.CONFIRMED, rec.attempts, rec.fence, version,
        None, None, None, expires_at, rec.created_at, now, result_json, None,
        rec.args_json, _append(rec.history_json, entry, version, rec.key), via, rec.conflicts,
    )  # fmt: skip


def fail(
    rec: Record,
    *,
    error: str,
    now: float,
    retry_at: float | None,
    ttl: float | None,
    by: str | None,
    effect: bool = True,
) -> Record:
    """It definitely did not happen. ``retry_at`` schedules the next attempt (persisted).

    A record waiting for its retry is kept ``ttl`` past that retry: purged during the backoff, it
    would come back as a new record at attempt 1, and the attempt limit would never be reached.
    ``effect=False``: the attempt never reached the other side (not sent, or refused before it ran),
    so it cannot have had an effect of any kind; kept in the history for ``may_have_happened``.
    """
    return transition(
        rec,
        State.FAILED,
        now=now,
        reason=error[:200],
        by=by,
        effect=effect,
        error=error,
        lease_owner=None,
        lease_until=None,
        next_attempt_at=retry_at,
        expires_at=None if ttl is None else max(now, retry_at or now) + ttl,
    )


def mark_unknown(rec: Record, *, now: float, reason: str, by: str | None, error: str | None = None) -> Record:
    """It may have happened: keep the fence (a late outcome of that attempt still counts). ``error``:
    the attempt's error, message included (the reason may name only its type)."""
    if error is None:  # keep what the record holds
        return transition(rec, State.UNKNOWN, now=now, reason=reason, by=by, lease_owner=None, lease_until=None)
    return transition(
        rec, State.UNKNOWN, now=now, reason=reason, by=by, lease_owner=None, lease_until=None, error=error
    )


def park(rec: Record, *, now: float, reason: str, by: str | None) -> Record:
    """Hand the record to a person."""
    return transition(rec, State.NEEDS_REVIEW, now=now, reason=reason, by=by, lease_owner=None, lease_until=None)


def abandon(rec: Record, *, now: float, reason: str, by: str | None) -> Record:
    """No attempts left."""
    return transition(
        rec, State.ABANDONED, now=now, reason=reason, by=by, lease_owner=None, lease_until=None, next_attempt_at=None
    )


def extend_lease(rec: Record, *, now: float, lease_seconds: float) -> Record:
    """A heartbeat: same state, same fence, a later ``lease_until``. Not written to the history."""
    if rec.state not in HELD:
        raise IllegalTransition(f"{rec.key}: only a held record has a lease to extend, not {rec.state.value}")
    if not _isfinite(now + lease_seconds):
        raise _not_finite(rec.key, now=now, lease_until=now + lease_seconds)
    return replace(rec, version=rec.version + 1, updated_at=now, lease_until=now + lease_seconds)


def note_conflict(rec: Record, *, now: float, reason: str, by: str | None) -> Record:
    """A late outcome arrived for a record already settled otherwise: a duplicate, counted and kept."""
    return transition(rec, rec.state, now=now, reason=reason, by=by, conflicts=rec.conflicts + 1)


#: A confirmation made by the attempt itself or by probing the other side for this very operation.
_SAME_ATTEMPT = frozenset({"run", "probe", "reconcile-probe"})


def late_success(
    rec: Record,
    *,
    fence: int,
    result_json: str | None,
    now: float,
    ttl: float | None,
    by: str | None,
    created_at: float | None = None,
) -> Record:
    """The outcome of attempt ``fence`` arrived after the record moved on.

    On a record whose outcome is still open it is the truth and confirms it. On a record that was
    confirmed by another attempt, or failed definitely, it means the side effect happened twice (or
    once, where the record said none): it is kept as a counted conflict, never dropped silently.

    ``created_at`` is that of the record the attempt held. A record lost from the store (a restart
    without persistence, a failover) and made again by another caller starts again at fence 1, so a
    fence alone would take the other caller's attempt for this one: another ``created_at`` means
    another record, and this side effect is counted as a conflict on it whatever its state: noted
    beside a live attempt or a confirmed result, and confirming a record whose outcome is open.
    """
    if created_at is not None and rec.created_at != created_at:
        if rec.state in HELD or rec.state is State.CONFIRMED:
            reason = (
                f"late outcome of attempt {fence} of an earlier record of this key (created at {created_at!r}; "
                "the record was lost and made again): possible duplicate"
            )
            return note_conflict(rec, now=now, reason=reason, by=by)
        return replace(
            confirm(rec, result_json=result_json, now=now, ttl=ttl, via=f"late:{fence}", by=by),
            conflicts=rec.conflicts + 1,
        )
    if rec.state in HELD and rec.fence == fence:
        return confirm(rec, result_json=result_json, now=now, ttl=ttl, via="run", by=by)
    if rec.state is State.CONFIRMED and rec.fence == fence:
        if rec.via in _SAME_ATTEMPT or rec.via == f"late:{fence}":
            return rec  # this attempt's own result, or its probe's finding: nothing happened twice
        if rec.via == "resolve":
            if rec.result_json == result_json:
                return rec
            # Someone confirmed it by hand; this is what the attempt really returned: keep it beside.
            real = (result_json or "null")[:500]
            reason = f"late outcome of attempt {fence} after it was resolved by hand: {real}"
            return transition(rec, State.CONFIRMED, now=now, reason=reason, by=by)
        # Confirmed by another attempt's late outcome while this one held the record (it keeps the
        # holder's fence): this attempt's side effect is a second one.
    if rec.state in (State.UNKNOWN, State.NEEDS_REVIEW, State.PENDING, State.IN_FLIGHT, State.ABANDONED):
        return confirm(rec, result_json=result_json, now=now, ttl=ttl, via=f"late:{fence}", by=by)
    if rec.state is State.FAILED:
        return replace(
            confirm(rec, result_json=result_json, now=now, ttl=ttl, via=f"late:{fence}", by=by),
            conflicts=rec.conflicts + 1,
        )
    return note_conflict(rec, now=now, reason=f"late outcome of attempt {fence}: possible duplicate", by=by)


# --- approvals (``@ledger.tool(approve=...)``): a person's yes or no, kept in the record ----------
#
# The request, the approval and the denial are transitions of the operation's own record, so every
# store's compare-and-set carries them: racing first callers make one request, and racing callers
# after an approval run one attempt. An approval is bound to the record's key and fingerprint and is
# spent by the first attempt that may have had an effect (``approval_of``).

#: The history member that names who approved an operation (the entry's ``reason`` is theirs).
APPROVED_BY = "approved_by"
#: The history member that names who denied one.
DENIED_BY = "denied_by"

_AWAITING = State.AWAITING_APPROVAL.value
#: Where an attempt that may have had an effect ends, or a new request begins: the approval is spent.
_SPENDS = frozenset(
    {State.UNKNOWN.value, State.NEEDS_REVIEW.value, State.CONFIRMED.value, State.ABANDONED.value, _AWAITING}
)


def ask_approval(*, key: str, scope: str, tool: str, fingerprint: str, args_json: str, by: str, now: float) -> Record:
    """The first call of an operation that needs a person's approval: its record, awaiting it. No lease,
    no attempt, fence 0 (the approved call's claim is attempt 1, fence 1).

    .. versionadded:: 0.1
    """
    if not _isfinite(now):
        raise _not_finite(key, now=now)
    entry = _entry(None, State.AWAITING_APPROVAL, now, "approval asked", 0, by)
    return Record(
        key, scope, tool, fingerprint, State.AWAITING_APPROVAL, 0, 0, 1, None, None, None, None, now, now,
        None, None, args_json, f"[{entry}]", None, 0,
    )  # fmt: skip


def ask_again(
    rec: Record, *, now: float, by: str, fingerprint: str, args_json: str, reason: str, fresh: bool = False
) -> Record:
    """An operation of an ``approve=`` tool would start again on ``rec`` (its approved run failed, its
    confirmed record expired, its attempts ran out with no effect): it awaits a new approval, for the
    arguments given. ``fresh``: its attempts start again at 0 and its result is dropped.

    .. versionadded:: 0.1
    """
    changes: dict[str, Any] = {}
    if fresh:
        changes = {"attempts": 0, "result_json": None, "via": None, "conflicts": 0}
    return transition(
        rec, State.AWAITING_APPROVAL, now=now, reason=reason, by=by, lease_owner=None, lease_until=None,
        next_attempt_at=None, expires_at=None, error=None, fingerprint=fingerprint, args_json=args_json, **changes,
    )  # fmt: skip


def _decision(rec: Record, by: object, reason: object, fingerprint: str | None, what: str) -> None:
    """Refuse a person's approval or denial that does not fit ``rec``."""
    if not isinstance(by, str) or not by.strip():
        raise ValueError(f"{what} needs by=NAME: who decides is kept in the record's history")
    if reason is not None and not isinstance(reason, str):
        raise TypeError(f"reason={reason!r}: give a str, or None")
    if rec.state is not State.AWAITING_APPROVAL:
        if denial_of(rec) is not None:
            said = " (it was denied)"
        elif approval_of(rec) is not None:
            said = " (it was approved, and waits for its next call to run it)"
        else:
            said = ""
        raise IllegalTransition(
            f"{rec.key!r} is {rec.state.value}{said}, not awaiting approval: there is nothing to {what}. "
            "Only a tool with approve= asks for an approval, at its first call"
        )
    if fingerprint is not None and fingerprint != rec.fingerprint:
        raise IllegalTransition(
            f"{rec.key!r} awaits approval for other arguments (fingerprint {rec.fingerprint[:16]}, not "
            f"{fingerprint[:16]}): nothing was changed; look at it again with `onceonly show`"
        )


def approve(rec: Record, *, now: float, by: str, reason: str | None = None, fingerprint: str | None = None) -> Record:
    """A person approves the operation ``rec`` awaits approval for: ``pending`` with its lease already run
    out, which the next call takes over by compare-and-set and runs once. The history entry holds
    ``approved_by`` and the person's ``reason``.

    Raises:
        IllegalTransition: ``rec`` does not await approval, or ``fingerprint`` is not its own.

    .. versionadded:: 0.1
    """
    _decision(rec, by, reason, fingerprint, "approve")
    return transition(
        rec, State.PENDING, now=now, reason=reason or "", by=by, note={APPROVED_BY: by},
        lease_owner=None, lease_until=now, next_attempt_at=None,
    )  # fmt: skip


def deny(rec: Record, *, now: float, by: str, reason: str | None = None, fingerprint: str | None = None) -> Record:
    """A person denies the operation ``rec`` awaits approval for: ``failed``, nothing ran (``effect:
    false``), and every later call of it raises ``ApprovalDenied``. It never expires by itself.

    Raises:
        IllegalTransition: ``rec`` does not await approval, or ``fingerprint`` is not its own.

    .. versionadded:: 0.1
    """
    _decision(rec, by, reason, fingerprint, "deny")
    return transition(
        rec, State.FAILED, now=now, reason=reason or "", by=by, effect=False, note={DENIED_BY: by},
        error=f"denied by {by}" + (f": {reason}" if reason else ""), lease_owner=None, lease_until=None,
        next_attempt_at=None, expires_at=None,
    )  # fmt: skip


def approval_of(rec: Record) -> dict[str, Any] | None:
    """The approval that still stands for the operation of ``rec`` (its history entry), else ``None``.

    Walking back from the newest entry, an approval counts when it comes before any end of an attempt
    that may have had an effect (unknown, confirmed, parked, abandoned, a failure not marked ``effect:
    false`` or given back as control flow) and before a new request. An attempt that never reached the
    other side leaves it standing. A history trimmed past it has none: the careful answer.

    .. versionadded:: 0.1
    """
    if APPROVED_BY not in rec.history_json:
        return None  # nearly every record: decided without decoding the history
    for entry in reversed(rec.history):
        to = entry.get("to")
        if APPROVED_BY in entry and entry.get("from") == _AWAITING:
            found: dict[str, Any] = entry
            return found
        if to in _SPENDS:
            return None
        if to == State.FAILED.value and entry.get("effect") is not False and not _released(entry):
            return None
    return None


def approved_unclaimed(rec: Record) -> bool:
    """Whether ``rec`` was approved and no call has taken it over yet (its last entry is the approval).

    .. versionadded:: 0.1
    """
    if rec.state is not State.PENDING or APPROVED_BY not in rec.history_json:
        return False
    last = rec.history[-1]
    return last.get("from") == _AWAITING and APPROVED_BY in last


def denial_of(rec: Record) -> dict[str, Any] | None:
    """The history entry of the denial ``rec`` ends with (a failed record a person denied), else ``None``.

    .. versionadded:: 0.1
    """
    if rec.state is not State.FAILED or DENIED_BY not in rec.history_json:
        return None
    last = rec.history[-1]
    return last if last.get("from") == _AWAITING and DENIED_BY in last else None


def asked_at(rec: Record) -> float | None:
    """When the approval ``rec`` awaits was asked for (its newest request's time), else ``None``.

    .. versionadded:: 0.1
    """
    for entry in reversed(rec.history):
        if entry.get("to") == _AWAITING:
            at: float = entry["at"]
            return at
    return None
