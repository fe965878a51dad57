"""Moving a ledger between stores: ``onceonly copy``, ``export`` and ``import``.

What to do with each record is decided by ``plan``, a pure function of the source's record and the
target's; ``copy_records`` applies the plans through the target store's own compare-and-set
primitives (``insert``: only if absent; ``swap``: only if unchanged since it was read), so a copy
racing another copy, or an application already writing to the target, never overwrites a record it
did not read. A plan whose write lost such a race is made again from what the target now holds.

A record is copied verbatim: every field, its history, its version. Rules:

- absent in the target: inserted;
- the same in the target (every field but the version): skipped;
- the target holds an older version of the same record (same incarnation, and its history is an
  earlier stretch of the source's): updated, with a version above the target's so that a caller that
  read the target's copy cannot write over the update;
- the target holds a later version (the record moved on there): kept, reported as newer;
- anything else with the same key is a conflict: reported, nothing written;
- a record held in the source (``pending``, ``in_flight``) may be running right now: by default it is
  not copied and is reported; ``in_flight="unknown"`` copies it as ``unknown`` so that the target
  settles it (probe, review) instead of running it again.

The export file is JSON lines: a header, one record per line, an end line with the count (a file cut
short is refused rather than half imported).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any, Literal

from onceonly.errors import OnceOnlyError, StoreCorrupt
from onceonly.keys import validate_name
from onceonly.states import (
    HELD,
    HISTORY_LIMIT,
    Record,
    State,
    approved_unclaimed,
    mark_unknown,
    misplaced,
    replace,
)
from onceonly.stores.base import Query, Store

__all__ = [
    "COPIED_MARK",
    "FORMAT",
    "FORMAT_VERSION",
    "Action",
    "BadFile",
    "InFlight",
    "Outcome",
    "Report",
    "Step",
    "as_unknown",
    "copy_records",
    "export_lines",
    "plan",
    "read_export",
    "store_records",
]

#: What the header line names, and the version of the line format it describes.
FORMAT = "onceonly-ledger"
FORMAT_VERSION = 1
#: The reason of the history entry a copy adds when it copies a held record as ``unknown``.
COPIED_MARK = "copied while held in the source store"
_COPIER = "onceonly copy"
#: Attempts at one record whose writes keep losing races before it is reported as contended.
_ROUNDS = 8

InFlight = Literal["report", "unknown"]


class Action(Enum):
    """What ``plan`` decided for one record."""

    INSERT = "copied"  # absent in the target
    SKIP = "identical"  # the target holds the same record
    UPDATE = "updated"  # the target holds an older version of it
    NEWER = "newer_in_target"  # the target holds a later version of it: kept
    IN_FLIGHT = "in_flight"  # held in the source: not copied
    CONFLICT = "conflict"  # the target holds another record under this key: kept


@dataclass(frozen=True, slots=True)
class Step:
    """One plan: the action, the record to write (INSERT, UPDATE), and why (for the report)."""

    action: Action
    write: Record | None = None
    why: str = ""
    as_unknown: bool = False


# --- the plan: pure ---------------------------------------------------------------------------------

_CONTENT = tuple(f.name for f in fields(Record) if f.name != "version")


def _same_content(a: Record, b: Record) -> bool:
    return all(getattr(a, n) == getattr(b, n) for n in _CONTENT)


def _entries(rec: Record) -> list[dict[str, Any]]:
    return rec.history  # decoded: the stores may format the same entries differently (trimmed histories)


def _strip_copy_mark(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history without a trailing entry of a copy that wrote the record as unknown."""
    if entries and entries[-1].get("reason") == COPIED_MARK and entries[-1].get("by") == _COPIER:
        return entries[:-1]
    return entries


def _earlier(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Whether history ``a`` is an earlier stretch of history ``b`` (or the same): b is a plus what
    came after, both trimmed to their last ``HISTORY_LIMIT`` entries as the store keeps them."""
    if not a:
        return True
    last = a[-1]
    for p in range(len(b) - 1, -1, -1):
        if b[p] != last:
            continue
        n = p + 1
        if n > len(a):
            continue  # b holds entries from before a's first one: a cannot be its earlier stretch
        if b[:n] == a[len(a) - n :] and (n == len(a) or len(b) >= HISTORY_LIMIT):
            return True
    return False


def as_unknown(rec: Record, now: float) -> Record:
    """A held record as a copy writes it: ``unknown``, its lease dropped, an entry that says why."""
    return mark_unknown(rec, now=now, reason=COPIED_MARK, by=_COPIER)


def plan(source: Record, target: Record | None, *, in_flight: InFlight = "report", now: float) -> Step:
    """What to do with ``source`` given the target's record of its key (``None``: absent).

    Pure: reads nothing, writes nothing. ``now`` dates the entry of a held record copied as unknown.
    Raises ``StoreCorrupt`` when a history is not one onceonly writes.
    """
    # An approved record no call took over yet holds no one's lease (nothing ran): copied as it is.
    held = source.state in HELD and not approved_unclaimed(source)
    if target is None:
        if not held:
            return Step(Action.INSERT, source)
        if in_flight == "report":
            return Step(Action.IN_FLIGHT, why=_held_why(source))
        return Step(Action.INSERT, as_unknown(source, now), as_unknown=True)
    if _same_content(source, target):
        return Step(Action.SKIP)
    if (target.created_at, target.scope, target.tool) != (source.created_at, source.scope, source.tool):
        return Step(Action.CONFLICT, why=_other_record_why(source, target))
    theirs = _strip_copy_mark(_entries(target))
    ours = _entries(source)
    older = _earlier(theirs, ours)
    newer = _earlier(ours, _entries(target))
    if newer and not (older and theirs == ours):
        return Step(Action.NEWER, why=f"the target holds a later version ({target.state.value})")
    if target.state in HELD and not approved_unclaimed(target):
        # A caller of the target holds it now: its attempt is not the source's to overwrite.
        return Step(Action.CONFLICT, why=f"{target.state.value} in the target, held by {target.lease_owner or '?'}")
    if not older:
        return Step(
            Action.CONFLICT,
            why=(
                f"the record moved on in both stores since they parted (source {source.state.value}, "
                f"target {target.state.value}): settle it in one of them by hand"
            ),
        )
    if held:
        if in_flight == "report":
            return Step(Action.IN_FLIGHT, why=_held_why(source))
        if theirs == ours:
            return Step(Action.SKIP)  # this very attempt was copied as unknown already
        return Step(Action.UPDATE, _above(as_unknown(source, now), target), as_unknown=True)
    if theirs == ours:
        # Same history, other fields: nothing onceonly writes; do not guess which is right.
        return Step(Action.CONFLICT, why="the same history with other fields: compare them with `onceonly show`")
    return Step(Action.UPDATE, _above(source, target))


def _above(rec: Record, target: Record) -> Record:
    """``rec`` with a version above the target's: every other writer's compare-and-set on the copy it
    read then fails, and re-reads this one."""
    return rec if rec.version > target.version else replace(rec, version=target.version + 1)


def _held_why(rec: Record) -> str:
    lease = "no lease" if rec.lease_until is None else f"lease until {_iso(rec.lease_until)}"
    return f"{rec.state.value}, held by {rec.lease_owner or '?'} ({lease}): let it settle, then copy again"


def _other_record_why(source: Record, target: Record) -> str:
    if target.created_at != source.created_at:
        return (
            f"another record of this key (made at {_iso(target.created_at)} in the target, "
            f"{_iso(source.created_at)} in the source)"
        )
    return f"another operation under this key (target: tool {target.tool!r}, scope {target.scope!r})"


def _iso(ts: float) -> str:
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
    except (OverflowError, ValueError, OSError):
        return repr(ts)


# --- applying the plans: I/O on the target ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one record that a person may need to know about."""

    key: str
    action: Action
    why: str = ""
    as_unknown: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "action": self.action.value, "why": self.why, "as_unknown": self.as_unknown}


@dataclass
class Report:
    """The counts of one copy or import, and the records listed by name (held, conflicts, copied as
    unknown)."""

    counts: dict[Action, int] = field(default_factory=lambda: dict.fromkeys(Action, 0))
    listed: list[Outcome] = field(default_factory=list)
    as_unknown: int = 0

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "read": self.total,
            **{a.value: n for a, n in self.counts.items()},
            "copied_as_unknown": self.as_unknown,
            "records": [o.to_dict() for o in self.listed],
        }


def copy_records(
    records: Iterable[Record],
    target: Store,
    *,
    in_flight: InFlight = "report",
    clock: Callable[[], float] = time.time,
    progress: Callable[[Report], None] | None = None,
) -> Report:
    """Copy ``records`` into ``target``, one plan per record, each write a compare-and-set.

    Raises what the target raises (``StoreUnavailable``…): the records before it are copied, and
    running it again carries on (what is there already is skipped).
    """
    report = Report()
    for rec in records:
        step = _apply(rec, target, in_flight, clock)
        report.counts[step.action] += 1
        if step.as_unknown:
            report.as_unknown += 1
        if step.action in (Action.IN_FLIGHT, Action.CONFLICT) or step.as_unknown:
            report.listed.append(Outcome(rec.key, step.action, step.why, step.as_unknown))
        if progress is not None:
            progress(report)
    return report


def _apply(rec: Record, target: Store, in_flight: InFlight, clock: Callable[[], float]) -> Step:
    for _ in range(_ROUNDS):
        current = target.get(rec.key)
        try:
            step = plan(rec, current, in_flight=in_flight, now=clock())
        except StoreCorrupt as exc:
            return Step(Action.CONFLICT, why=str(exc))
        if step.write is None:
            return step
        if step.action is Action.INSERT and target.insert(step.write):
            return step
        if step.action is Action.UPDATE and current is not None and target.swap(step.write, current):
            return step
        # Another writer got there between our read and our write: plan again from what it wrote.
    return Step(Action.CONFLICT, why=f"the target's record kept changing during {_ROUNDS} attempts: copy again")


def store_records(store: Store, *, batch: int = 500) -> Iterator[Record]:
    """Every record of ``store``, in key order, read a page at a time."""
    after: str | None = None
    while True:
        page = store.scan(Query(after=after, limit=batch))
        yield from page
        if len(page) < batch:
            return
        after = page[-1].key


# --- the export file ----------------------------------------------------------------------------------

_FIELDS = tuple(f.name for f in fields(Record))
_NUMBERS = frozenset({"lease_until", "next_attempt_at", "expires_at", "created_at", "updated_at"})


class BadFile(OnceOnlyError, ValueError):
    """An export file that cannot be imported: the message names the line and what is wrong with it."""


def export_lines(records: Iterable[Record], *, source: str, now: float) -> Iterator[str]:
    """The export file, line by line (each without its newline): header, records, end line.

    ``source`` is the store's URL as it may be shown (without its password).
    """
    yield json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "source": source, "exported_at": now})
    n = 0
    for rec in records:
        line = {name: getattr(rec, name) for name in _FIELDS}
        line["state"] = rec.state.value
        yield json.dumps(line, ensure_ascii=False, allow_nan=False)
        n += 1
    yield json.dumps({"end": FORMAT, "records": n})


def read_export(lines: Iterable[str]) -> list[Record]:
    """The records of an export file, all checked before any is returned: a line that is not JSON,
    not a record (a missing or unknown field, a value of the wrong type, a key onceonly refuses, a
    history that is not one), a second record of one key, or a file without its header or end line
    raises ``BadFile`` naming the line."""
    records: list[Record] = []
    seen: dict[str, int] = {}
    header = end = False
    number = 0
    for number, text in enumerate(lines, 1):
        if end:
            if not text.strip():
                continue  # a blank line an editor left at the end
            raise BadFile(f"line {number}: text after the end line; the file was put together wrongly")
        if not text.strip():
            raise BadFile(f"line {number}: an empty line; each line is one JSON object")
        try:
            obj = json.loads(text, parse_constant=_no_constant)
        except ValueError as exc:
            raise BadFile(f"line {number}: not JSON ({exc})") from None
        if not isinstance(obj, dict):
            raise BadFile(f"line {number}: a JSON {type(obj).__name__}, not an object")
        if not header:
            _check_header(obj, number)
            header = True
            continue
        if "end" in obj:
            if obj.get("end") != FORMAT or obj.get("records") != len(records) or len(obj) != 2:
                raise BadFile(
                    f"line {number}: the end line says {obj.get('records')!r} records, the file holds "
                    f"{len(records)}: it was cut or edited; export it again"
                )
            end = True
            continue
        rec = _record(obj, number)
        if rec.key in seen:
            raise BadFile(f"line {number}: a second record of key {rec.key!r} (the first is on line {seen[rec.key]})")
        seen[rec.key] = number
        records.append(rec)
    if not header:
        raise BadFile(f'the file is empty: it has no header line ({{"format": "{FORMAT}", ...}})')
    if not end:
        raise BadFile(f"the file ends at line {number} without its end line: it was cut short; export it again")
    return records


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _check_header(obj: dict[str, Any], number: int) -> None:
    if obj.get("format") != FORMAT:
        raise BadFile(
            f"line {number}: not an onceonly export (the first line must be the header "
            f'{{"format": "{FORMAT}", "version": {FORMAT_VERSION}, ...}})'
        )
    if obj.get("version") != FORMAT_VERSION:
        raise BadFile(
            f"line {number}: format version {obj.get('version')!r}; this onceonly reads version "
            f"{FORMAT_VERSION}: import it with the onceonly that exported it, or a newer one"
        )


def _record(obj: dict[str, Any], number: int) -> Record:
    missing = [n for n in _FIELDS if n not in obj]
    extra = sorted(set(obj) - set(_FIELDS))
    if missing or extra:
        what = []
        if missing:
            what.append(f"missing {', '.join(missing)}")
        if extra:
            what.append(f"unknown {', '.join(extra)}")
        raise BadFile(f"line {number}: not a record of format {FORMAT_VERSION} ({'; '.join(what)})")
    key = obj["key"]
    try:
        validate_name(key, "key")
        validate_name(obj["scope"], "scope")
        validate_name(obj["tool"], "tool")
    except OnceOnlyError as exc:
        raise BadFile(f"line {number}: {exc}") from None
    try:
        state = State(obj["state"])
    except ValueError:
        raise BadFile(
            f"line {number} ({key!r}): state {obj['state']!r} is not one of {', '.join(s.value for s in State)}"
        ) from None
    values = dict(obj)
    for name in _NUMBERS:  # JSON keeps 5.0 as 5; the stores keep floats
        if type(values[name]) is int:
            values[name] = float(values[name])
    values["state"] = state
    rec = Record(**values)
    wrong = misplaced(rec)
    if wrong is not None:
        name, value = wrong
        raise BadFile(f"line {number} ({key!r}): {name} holds {value!r:.80} ({type(value).__name__})")
    for name in ("attempts", "fence", "version", "conflicts"):
        value = getattr(rec, name)
        if not 0 <= value < 2**63 or (name == "version" and value < 1) or (name != "version" and value >= 2**31):
            raise BadFile(f"line {number} ({key!r}): {name}={value} is out of range")
    try:
        rec.result, rec.args, rec.history  # noqa: B018 - decoding is the check
    except StoreCorrupt as exc:
        raise BadFile(f"line {number}: {exc}") from None
    if any(not math.isfinite(e["at"]) for e in rec.history):
        raise BadFile(f"line {number} ({key!r}): a history entry with a time that is not finite")
    return rec
