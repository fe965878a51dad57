"""Reading a ledger as an operator does: pages with filters, keys by a unique prefix, the figures of
``onceonly stats`` (counts, the oldest unsettled record, call durations and the timeout they suggest)
and the audit of settled records against each tool's probe. Reads only, except for the alert events.

Durations come from the history a record already keeps: the entry that claims an attempt and the
entry that ends it (confirmed, failed, unknown) carry the same fence and their times, so a guarded
call pays nothing more to have its duration measured.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import math
import queue
import shlex
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from onceonly import states as st
from onceonly.budgets import usage as budget_usage
from onceonly.drivers import aprobe, probe
from onceonly.errors import StoreError
from onceonly.events import alert
from onceonly.keys import canonical_json, fingerprint
from onceonly.plan import NOT_FOUND
from onceonly.settle import _spec_of
from onceonly.states import Record, State
from onceonly.stores.base import BudgetUse, Query

if TYPE_CHECKING:
    from onceonly.ledger import Ledger

__all__ = [
    "SORTS",
    "AmbiguousKey",
    "AuditReport",
    "Disagreement",
    "LedgerStats",
    "Page",
    "ToolStats",
    "args_match",
    "attempt_durations",
    "attempt_spans",
    "attention",
    "audit",
    "error_summary",
    "find",
    "iso",
    "json_type",
    "key_arguments",
    "latency",
    "matches_args",
    "oldest_unsettled",
    "page",
    "percentile",
    "record_json",
    "records",
    "result_mismatch",
    "search",
    "short_keys",
    "stats",
    "suggest_timeout",
    "tool_names",
]

#: Records read per store query while paging through a ledger.
_BATCH = 500
#: How far past a page ``page()`` counts the records still to come before saying "more than".
_COUNT_CAP = 1000


# --- pages ------------------------------------------------------------------------------------------


@dataclass
class Page:
    """One page of records, and what follows it.

    ``more`` counts the matching records after the page, up to a cap (``more_capped`` then says there
    are at least that many); ``next_after`` is the key to pass as ``after`` for the next page.
    """

    records: list[Record]
    more: int = 0
    more_capped: bool = False
    next_after: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The page as JSON (``onceonly ls --json``, the dashboard's ``/api/records``)."""
        return {
            "records": [record_json(r) for r in self.records],
            "more": self.more,
            "more_capped": self.more_capped,
            "next_after": self.next_after,
        }


def _walk(ledger: Ledger, query: Query, keep: Callable[[Record], bool], prefix: str = "") -> Iterator[Record]:
    after = query.after
    if prefix and (after is None or after < prefix):
        # The key that is the prefix itself sorts before every longer key starting with it, and a
        # scan from after=prefix leaves it out: read it alone, with the query's filters.
        rec = ledger.store.get(prefix)
        if rec is not None and _in_query(rec, query) and keep(rec):
            yield rec
        after = prefix
    while True:
        batch = ledger.store.scan(
            Query(states=query.states, tool=query.tool, scope=query.scope, after=after, limit=_BATCH)
        )
        for rec in batch:
            if not rec.key.startswith(prefix):
                return  # keys are in code point order: those starting with the prefix are together
            if keep(rec):
                yield rec
        if len(batch) < _BATCH:
            return
        after = batch[-1].key


def _keep(since: float | None, args: Mapping[str, Any] | None) -> Callable[[Record], bool]:
    def keep(rec: Record) -> bool:
        return (since is None or rec.updated_at >= since) and (not args or matches_args(rec, args))

    return keep


def _in_query(rec: Record, query: Query) -> bool:
    return (
        (query.states is None or rec.state in query.states)
        and query.tool in (None, rec.tool)
        and query.scope in (None, rec.scope)
    )


def page(
    ledger: Ledger,
    *,
    states: Sequence[State] | None = None,
    tool: str | None = None,
    scope: str | None = None,
    since: float | None = None,
    prefix: str | None = None,
    after: str | None = None,
    limit: int = 50,
    args: Mapping[str, Any] | None = None,
) -> Page:
    """Records in key order matching the filters (``since``: updated at or after this time;
    ``prefix``: keys starting with it; ``args``: ``matches_args``), at most ``limit``, and a count of
    those after them (up to ``_COUNT_CAP`` more are read to count)."""
    query = Query(states=states, tool=tool, scope=scope, after=after)
    found: list[Record] = []
    more = 0
    for rec in _walk(ledger, query, _keep(since, args), prefix or ""):
        if len(found) < limit:
            found.append(rec)
            continue
        more += 1
        if more >= _COUNT_CAP:
            return Page(found, more, True, found[-1].key)
    return Page(found, more, False, found[-1].key if more else None)


# --- records as JSON --------------------------------------------------------------------------------


def iso(ts: float | None) -> str | None:
    """An ISO 8601 time in UTC, to the millisecond (``2026-01-31T08:00:00.000Z``)."""
    if ts is None:
        return None
    try:
        return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    except (OverflowError, ValueError, OSError):  # past year 9999 (a huge ttl=): the number itself
        return repr(ts)


def record_json(rec: Record) -> dict[str, Any]:
    """The record as JSON, its times also as ISO 8601 (UTC), with its attempts' durations."""
    out = rec.to_dict()
    for name in ("created_at", "updated_at", "lease_until", "next_attempt_at", "expires_at"):
        out[f"{name}_iso"] = iso(out[name])
    for entry in out["history"]:
        if isinstance(entry, dict) and isinstance(entry.get("at"), int | float):
            entry["at_iso"] = iso(entry["at"])
    out["attempt_durations"] = attempt_durations(rec)
    return out


# --- keys by prefix ---------------------------------------------------------------------------------


class AmbiguousKey(LookupError):
    """A prefix that several keys start with: ``candidates`` holds the first of them in key order
    (at most ``CANDIDATES``), ``more`` whether other keys start with it too, ``prefix`` the prefix given."""

    def __init__(self, message: str, *, prefix: str = "", candidates: Sequence[str] = (), more: bool = False) -> None:
        super().__init__(message)
        self.prefix = prefix
        self.candidates = list(candidates)
        self.more = more


#: How many of the keys an ambiguous prefix starts with ``find`` names.
CANDIDATES = 10


def _starting_with(ledger: Ledger, prefix: str, limit: int) -> list[str]:
    """Up to ``limit`` keys that start with ``prefix``: the keys after it come first in key order."""
    keys = [] if ledger.store.get(prefix) is None else [prefix]
    for rec in ledger.store.scan(Query(after=prefix, limit=limit)):
        if not rec.key.startswith(prefix):
            break
        keys.append(rec.key)
    return keys[:limit]


def find(ledger: Ledger, key_or_prefix: str) -> Record:
    """The record of a key, or of the one key that starts with ``key_or_prefix``.

    Raises:
        KeyError: no key is or starts with it.
        AmbiguousKey: several keys start with it.
    """
    rec = ledger.get(key_or_prefix)
    if rec is not None:
        return rec
    keys = _starting_with(ledger, key_or_prefix, CANDIDATES + 1)
    if not keys:
        raise KeyError(
            f"no record with key {key_or_prefix!r} (nor a key starting with it): check it with `onceonly ls`"
        )
    if len(keys) > 1:
        shown = ", ".join(repr(k) for k in keys[:2])
        raise AmbiguousKey(
            f"{key_or_prefix!r} starts several keys ({shown}…): give more of the key",
            prefix=key_or_prefix,
            candidates=keys[:CANDIDATES],
            more=len(keys) > CANDIDATES,
        )
    found = ledger.get(keys[0])
    if found is None:
        raise KeyError(f"the record of {keys[0]!r} was removed while it was read")
    return found


def _floor(key: str) -> int:
    # scope:tool:digest keys: the scope and tool, then 8 characters of the digest, like a short commit.
    colon = key.rfind(":")
    return min(len(key), colon + 9 if colon >= 0 else 12)


def short_keys(ledger: Ledger, keys: Sequence[str]) -> dict[str, str]:
    """Each key's shortest prefix (not shorter than its scope, tool and 8 characters) that no other key
    in the ledger starts with, so that ``find`` (``onceonly show``) takes it."""
    shown: dict[str, str] = {}
    ordered = sorted(set(keys))
    for i, key in enumerate(ordered):
        size = _floor(key)
        for other in (ordered[i - 1] if i else None, ordered[i + 1] if i + 1 < len(ordered) else None):
            if other is not None:
                size = max(size, _common(key, other) + 1)
        while size < len(key):
            prefix = key[:size]
            clash = [k for k in _starting_with(ledger, prefix, 2) if k != key]
            if not clash:
                break
            size = max(size + 1, _common(key, clash[0]) + 1)
        shown[key] = key[: min(size, len(key))]
    return shown


def _common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# --- stats ------------------------------------------------------------------------------------------


def attempt_spans(rec: Record) -> list[tuple[float, float]]:
    """When each attempt the history shows from its claim to its end (confirmed, failed or unknown by
    the attempt's own outcome) began, and the seconds it took, oldest first."""
    started: dict[int, float] = {}
    spans: list[tuple[float, float]] = []
    for entry in rec.history:
        fence, to, at = entry.get("fence"), entry.get("to"), entry.get("at")
        if not isinstance(fence, int) or not isinstance(at, int | float):
            continue
        if to in ("pending", "in_flight"):
            started.setdefault(fence, at)  # pending → in_flight is the same attempt
        elif to in ("confirmed", "failed", "unknown") and fence in started:
            began = started.pop(fence)
            reason = str(entry.get("reason", ""))
            # Ended by the attempt itself; not by a lease that ran out, a release or a person.
            if to == "confirmed" and reason != "confirmed via run":
                continue
            if reason.startswith(("lease of ", "the lease of ", "resolved by ", "released: ")):
                continue
            spans.append((began, max(0.0, at - began)))
    return spans


def attempt_durations(rec: Record) -> list[float]:
    """Seconds each attempt took (``attempt_spans`` without their start), oldest first."""
    return [took for _, took in attempt_spans(rec)]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass
class ToolStats:
    """One tool's records by state, its conflicts and its attempts' durations."""

    tool: str
    states: dict[str, int] = field(default_factory=dict)
    conflicts: int = 0
    durations: list[float] = field(default_factory=list)
    #: Each timed attempt's start and duration (``attempt_spans``), for ``latency``.
    spans: list[tuple[float, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tool": self.tool, "states": self.states, "conflicts": self.conflicts}
        out["attempts_timed"] = len(self.durations)
        if self.durations:
            p99 = percentile(self.durations, 0.99)
            out.update(
                p50=percentile(self.durations, 0.5),
                p95=percentile(self.durations, 0.95),
                p99=p99,
                suggested_timeout=suggest_timeout(p99),
            )
        return out


def suggest_timeout(p99: float) -> float:
    """A ``timeout=`` of 1.5 to 2 times the p99 (2x for short calls, whose p99 is noisier), rounded up
    to two significant digits, and at least 10 ms."""
    raw = max(p99 * (2.0 if p99 < 1.0 else 1.5), 0.01)
    digits = 1 - math.floor(math.log10(raw))
    step = 10.0**-digits
    return round(math.ceil(raw / step - 1e-9) * step, max(digits, 0))


@dataclass
class LedgerStats:
    """The figures of ``onceonly stats``."""

    states: dict[str, int]
    tools: dict[str, ToolStats]
    conflicts: int
    records_with_conflicts: int
    oldest_unsettled: Record | None
    now: float
    #: Each budget's current window (``budget=``): what it holds of its limit.
    budgets: list[BudgetUse] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        oldest = self.oldest_unsettled
        return {
            "states": self.states,
            "total": sum(self.states.values()),
            "conflicts": self.conflicts,
            "records_with_conflicts": self.records_with_conflicts,
            "oldest_unsettled": None
            if oldest is None
            else {
                "key": oldest.key,
                "state": oldest.state.value,
                "tool": oldest.tool,
                "age_seconds": round(self.now - oldest.created_at, 3),
            },
            "tools": [t.to_dict() for t in sorted(self.tools.values(), key=lambda t: t.tool)],
            "budgets": [budget_json(u) for u in self.budgets],
        }


def budget_json(use: BudgetUse) -> dict[str, Any]:
    """One budget's current window, as ``stats --json`` and the dashboard show it."""
    return {
        "budget": use.budget,
        "window_start": iso(use.start),
        "window_end": iso(use.until),
        "used": round(use.used, 9),  # float sums of added and freed amounts: no 1e-17 left over
        "limit": use.limit,
    }


def stats(ledger: Ledger, *, tool: str | None = None, scope: str | None = None) -> LedgerStats:
    """Reads every record (of ``tool``/``scope`` when given) once, in pages."""
    tools: dict[str, ToolStats] = {}
    states = dict.fromkeys((s.value for s in State), 0)
    conflicts = with_conflicts = 0
    oldest: Record | None = None
    for rec in _walk(ledger, Query(tool=tool, scope=scope), lambda r: True):
        states[rec.state.value] += 1
        t = tools.get(rec.tool)
        if t is None:
            t = tools[rec.tool] = ToolStats(rec.tool, dict.fromkeys((s.value for s in State), 0))
        t.states[rec.state.value] += 1
        t.conflicts += rec.conflicts
        conflicts += rec.conflicts
        with_conflicts += rec.conflicts > 0
        spans = attempt_spans(rec)
        t.spans.extend(spans)
        t.durations.extend(took for _, took in spans)
        if rec.state in st.UNSETTLED and (oldest is None or rec.created_at < oldest.created_at):
            oldest = rec
    now = ledger.clock()
    return LedgerStats(states, tools, conflicts, with_conflicts, oldest, now, budget_usage(ledger.store, now))


#: Bucket sizes ``latency`` picks from, in seconds: a minute up to a day.
_BUCKETS = (60, 300, 900, 3600, 6 * 3600, 86400)


def latency(
    spans: Mapping[str, Sequence[tuple[float, float]]], *, bucket_seconds: float | None = None, buckets: int = 48
) -> dict[str, Any]:
    """Each tool's p50 and p99 of its attempts' durations by when they began, for a chart.

    ``spans`` are each tool's ``(start, seconds)`` (``attempt_spans``, ``ToolStats.spans``). Attempts
    are grouped by start into buckets of ``bucket_seconds``, aligned to UTC and the same for every tool
    (default: the smallest of a minute, 5 and 15 minutes, an hour, 6 hours and a day that covers all
    the spans in at most ``buckets`` buckets). Buckets without an attempt are left out.
    """
    starts = [start for tool_spans in spans.values() for start, _ in tool_spans]
    if bucket_seconds is None:
        width = max(starts) - min(starts) if starts else 0.0
        bucket_seconds = next((b for b in _BUCKETS if width / b < buckets), _BUCKETS[-1])
    if not (math.isfinite(bucket_seconds) and bucket_seconds > 0):
        raise ValueError(f"bucket_seconds={bucket_seconds!r}: give a positive number of seconds")
    tools: dict[str, list[dict[str, Any]]] = {}
    for tool, tool_spans in sorted(spans.items()):
        grouped: dict[float, list[float]] = {}
        for start, took in tool_spans:
            grouped.setdefault(math.floor(start / bucket_seconds) * bucket_seconds, []).append(took)
        tools[tool] = [
            {
                "start": start,
                "start_iso": iso(start),
                "count": len(took),
                "p50": percentile(took, 0.5),
                "p99": percentile(took, 0.99),
            }
            for start, took in sorted(grouped.items())
        ]
    return {"bucket_seconds": bucket_seconds, "tools": tools}


# --- audit ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Disagreement:
    """A settled record its tool's probe contradicts, or could not check."""

    key: str
    tool: str
    state: str
    finding: str  # "missing": confirmed, probe finds nothing; "found": failed/abandoned, probe finds it; "error"
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "tool": self.tool, "state": self.state, "finding": self.finding, "detail": self.detail}


@dataclass
class AuditReport:
    """What one audit run checked and found."""

    checked: int = 0
    agreed: int = 0
    without_probe: dict[str, int] = field(default_factory=dict)
    disagreements: list[Disagreement] = field(default_factory=list)
    errors: list[Disagreement] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "checked": self.checked,
            "agreed": self.agreed,
            "without_probe": self.without_probe,
            "disagreements": [d.to_dict() for d in self.disagreements],
            "errors": [d.to_dict() for d in self.errors],
        }


def audit(
    ledger: Ledger,
    tools: Mapping[str, Any],
    *,
    since: float | None = None,
    tool: str | None = None,
    scope: str | None = None,
    concurrency: int = 1,
    report: AuditReport | None = None,
    progress: Callable[[AuditReport], None] | None = None,
) -> AuditReport:
    """Ask each settled record's tool probe whether the operation happened, and report where the
    ledger and the other side disagree: ``confirmed`` but the probe finds nothing, ``failed`` or
    ``abandoned`` but the probe finds it. Writes nothing to the ledger; logs an ``AuditDisagreement``
    alert for each. ``since``: only records updated at or after this time.

    ``concurrency``: probes asked at once (each in a thread of its own, at most that many; records
    are read as the probes answer). ``report``: filled as the audit goes, so that a caller
    interrupted (Ctrl-C) still has what was checked; ``progress(report)`` is called after each record.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency={concurrency!r}: give 1 or more probes at once")
    specs = {name: _spec_of(t) for name, t in tools.items()}
    report = AuditReport() if report is None else report
    settled = sorted(st.SETTLED, key=list(State).index)
    query = Query(states=settled, tool=tool, scope=scope)
    records = _walk(ledger, query, lambda r: since is None or r.updated_at >= since)

    # Each probe in a daemon thread of its own, at most ``concurrency`` at once: a probe that hangs
    # neither holds up a Ctrl-C nor keeps the process from exiting (a pool's threads are joined at exit).
    answers: queue.SimpleQueue[tuple[Record, Any, BaseException | None]] = queue.SimpleQueue()

    def ask(rec: Record, spec: Any) -> None:
        try:
            answers.put((rec, asyncio.run(aprobe(spec, rec)) if spec.is_async else probe(spec, rec), None))
        except BaseException as exc:  # handed to the caller's thread, which raises it
            answers.put((rec, None, exc))

    running = 0
    for rec in records:
        spec = specs.get(rec.tool)
        if spec is None or spec.probe is None:
            report.without_probe[rec.tool] = report.without_probe.get(rec.tool, 0) + 1
            if progress is not None:
                progress(report)
            continue
        threading.Thread(target=ask, args=(rec, spec), name="onceonly-audit", daemon=True).start()
        running += 1
        if running >= concurrency:  # read on only as fast as the probes answer
            _audited(report, answers.get(), progress)
            running -= 1
    while running:
        _audited(report, answers.get(), progress)
        running -= 1
    report.disagreements.sort(key=lambda d: d.key)
    report.errors.sort(key=lambda d: d.key)
    return report


def _audited(
    report: AuditReport, done: tuple[Record, Any, BaseException | None], progress: Callable[[AuditReport], None] | None
) -> None:
    rec, answer, failure = done
    if failure is not None:
        raise failure
    report.checked += 1
    if answer.error is not None:
        err = answer.error
        report.errors.append(Disagreement(rec.key, rec.tool, rec.state.value, "error", f"{type(err).__name__}: {err}"))
    else:
        found = answer.value is not NOT_FOUND
        if found == (rec.state is State.CONFIRMED):
            report.agreed += 1
        else:
            if found:
                detail = f"{rec.state.value} here, but the probe finds it: {str(answer.value)[:200]}"
            else:
                detail = "confirmed here, but the probe finds nothing"
            d = Disagreement(rec.key, rec.tool, rec.state.value, "found" if found else "missing", detail)
            report.disagreements.append(d)
            alert("AuditDisagreement", f"{rec.key}: {detail}", key=rec.key, tool=rec.tool, state=rec.state.value)
    if progress is not None:
        progress(report)


def error_summary(errors: Sequence[Disagreement]) -> list[tuple[int, str, str, str]]:
    """Probe errors grouped by tool and message (its first line): ``(count, tool, message, a key)``,
    most frequent first. A flaky probe then is one line, not one (multi-line) error per record."""
    groups: dict[tuple[str, str], list[str]] = {}
    for d in errors:
        first = d.detail.strip().splitlines()[0] if d.detail.strip() else d.detail
        groups.setdefault((d.tool, first[:300]), []).append(d.key)
    rows = [(len(keys), tool, text, keys[0]) for (tool, text), keys in groups.items()]
    return sorted(rows, key=lambda row: (-row[0], row[1], row[2]))


# --- searching by arguments, selections, tool names -------------------------------------------------


def matches_args(rec: Record, wanted: Mapping[str, Any]) -> bool:
    """Whether the call of ``rec`` had each of ``wanted``'s arguments with that value:
    ``matches_args(rec, {"order": "ord-17"})``.

    A wanted value matches an argument equal to it, or, given as a string (what a command line or a
    search box gives), an argument whose JSON text it is: ``"30"`` matches ``30``, ``"true"``
    matches ``True``, ``'{"a": 1}'`` matches ``{"a": 1}``. A record whose arguments cannot be
    decoded matches nothing.
    """
    try:
        args = rec.args
    except Exception:  # a damaged record: found by `show`, not by a search
        return False
    for name, value in wanted.items():
        if name not in args:
            return False
        have = args[name]
        if have == value and type(have) is type(value):
            continue
        if isinstance(value, str) and not isinstance(have, str) and _json_equal(value, have):
            continue
        return False
    return True


def _json_equal(text: str, value: Any) -> bool:
    try:
        parsed = json.loads(text)
    except ValueError:
        return False
    return bool(parsed == value and type(parsed) is type(value))


def records(
    ledger: Ledger,
    *,
    states: Sequence[State] | None = None,
    tool: str | None = None,
    scope: str | None = None,
    since: float | None = None,
    args: Mapping[str, Any] | None = None,
) -> Iterator[Record]:
    """Every record matching the filters (those of ``page``), in key order, read in pages: what a
    bulk ``onceonly resolve`` settles."""
    yield from _walk(ledger, Query(states=states, tool=tool, scope=scope), _keep(since, args))


def tool_names(ledger: Ledger) -> set[str]:
    """The tools the ledger holds records of. Reads every record: for telling a mistyped ``--tool``
    from a tool without records, once a filter found nothing."""
    return {rec.tool for rec in _walk(ledger, Query(), lambda r: True)}


def oldest_unsettled(ledger: Ledger, *, scope: str | None = None) -> Record | None:
    """The unsettled record (pending, in flight, unknown, in review) made longest ago, or ``None``.
    Reads only the unsettled records (an index on Redis and PostgreSQL)."""
    unsettled = sorted(st.UNSETTLED, key=list(State).index)
    oldest: Record | None = None
    for rec in _walk(ledger, Query(states=unsettled, scope=scope), lambda r: True):
        if oldest is None or rec.created_at < oldest.created_at:
            oldest = rec
    return oldest


# --- the shape of a confirmed result ----------------------------------------------------------------

#: How many of a tool's earlier confirmed results ``result_mismatch`` reads.
_SHAPE_SAMPLE = 50

_JSON_TYPES = ((bool, "a boolean"), (int | float, "a number"), (str, "a string"), (list, "an array"),
               (dict, "an object"), (type(None), "null"))  # fmt: skip


def json_type(value: Any) -> str:
    """``value``'s JSON type, with its article: ``"an object"``, ``"a string"``…"""
    for kind, name in _JSON_TYPES:
        if isinstance(value, kind):
            return name
    return type(value).__name__


def result_mismatch(ledger: Ledger, tool: str, value: Any) -> str | None:
    """Why ``value`` does not look like the results ``tool``'s confirmed records hold (up to
    ``_SHAPE_SAMPLE`` of them), or ``None`` when it does or there are none to compare with.

    A guarded call that replays a record returns its result to the caller as if the tool had
    returned it, so a result given by hand should have the tool's own shape: the same JSON type,
    and for an object, the keys every earlier result had and none that no earlier result had.
    """
    earlier: list[Any] = []
    for rec in ledger.store.scan(Query(states=[State.CONFIRMED], tool=tool, limit=_SHAPE_SAMPLE)):
        if rec.result_json is None or st.holds_secret(rec):
            continue
        try:
            earlier.append(json.loads(rec.result_json))
        except ValueError:
            continue
    if not earlier:
        return None
    seen = f"{len(earlier)} earlier confirmed result(s) of {tool!r}"
    kinds = {json_type(v) for v in earlier}
    if json_type(value) not in kinds:
        example = json.dumps(earlier[0], ensure_ascii=False)[:120]
        return f"it is {json_type(value)}, but the {seen} are {' or '.join(sorted(kinds))} (e.g. {example})"
    if not isinstance(value, dict):
        return None
    objects = [set(v) for v in earlier if isinstance(v, dict)]
    common = set.intersection(*objects)
    known = set.union(*objects)
    missing, unknown = sorted(common - set(value)), sorted(set(value) - known)
    problems = []
    if missing:
        problems.append(f"it lacks {', '.join(map(repr, missing))}, which every one of the {seen} has")
    if unknown:
        problems.append(f"it has {', '.join(map(repr, unknown))}, which none of the {seen} has")
    return "; ".join(problems) or None


# --- what needs a person ----------------------------------------------------------------------------


def attention(needs_review: int, oldest: Record | None, now: float, max_age: float | None) -> list[str]:
    """Why a person is needed, one sentence each (none: nothing waits): records in review, and the
    oldest unsettled record when it is older than ``max_age`` seconds. What ``onceonly stats --check``
    and ``onceonly reconcile`` exit 3 on."""
    reasons = []
    if needs_review:
        reasons.append(
            f"{needs_review} record(s) wait for a person in needs_review: "
            "onceonly ls --state needs_review, then onceonly resolve"
        )
    if max_age is not None and oldest is not None and now - oldest.created_at > max_age:
        reasons.append(
            f"{oldest.key} is still {oldest.state.value}, {now - oldest.created_at:.0f}s after its call, "
            f"longer than --max-age {max_age:g}s: onceonly show {shlex.quote(oldest.key)}"
        )
    return reasons


# --- which arguments identify a call ----------------------------------------------------------------

#: Calls with more arguments than this are not searched for the ones their key was made of.
_KEY_SEARCH_ARGS = 8


def key_arguments(rec: Record) -> list[str]:
    """The names of the arguments ``rec``'s key was made of (a tool's ``key=`` fields), found by
    hashing them again as the key was: every argument, one, or two of them. Empty when none of those
    gives the key (an explicit key, a key function, normalised fields) or the call has many arguments.
    """
    digest = rec.key.rsplit(":", 1)[-1].split("#", 1)[0]
    try:
        args = rec.args
    except Exception:  # a damaged record: shown as stored
        return []
    if len(digest) != 32 or not args or len(args) > _KEY_SEARCH_ARGS:
        return []

    def gives(names: Sequence[str]) -> bool:
        try:
            text = canonical_json({n: args[n] for n in names}, path="key")
        except Exception:
            return False
        return fingerprint(text)[:32] == digest

    names = sorted(args)
    if gives(names):
        return names  # every argument is in the key: none comes first
    for size in (1, 2):
        for combo in itertools.combinations(names, size):
            if gives(combo):
                return list(combo)
    return []


# --- searching: by an argument's value, conflicts, sorted by age or state (the dashboard) ----------

#: The orders ``search`` lists records in: key order (pages by ``after``), oldest first, newest first,
#: and by state (those that need a person first, then the oldest of each state).
SORTS = ("key", "age", "-age", "state")
#: States in the order ``sort="state"`` lists them: what needs a person first, settled ones last.
_BY_STATE = (
    State.NEEDS_REVIEW, State.AWAITING_APPROVAL, State.UNKNOWN, State.IN_FLIGHT, State.PENDING, State.FAILED,
    State.ABANDONED,
)  # fmt: skip
_STATE_ORDER = {s: i for i, s in enumerate((*_BY_STATE, State.CONFIRMED))}


def _scalars(value: Any, name: str | None) -> Iterator[tuple[str | None, Any]]:
    """Every scalar in ``value`` (an argument's JSON), with the name of the field that holds it."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _scalars(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from _scalars(v, name)
    else:
        yield name, value


def _same(value: Any, text: str) -> bool:
    """Whether a stored scalar is ``text``: a string equal to it, or a number, bool or null whose JSON is."""
    if isinstance(value, str):
        return value == text
    if value is None or isinstance(value, bool):
        return text == {None: "null", True: "true", False: "false"}[value]
    return isinstance(value, int | float) and _number_text(text) == value


def _number_text(text: str) -> float | None:
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def args_match(rec: Record, term: str) -> bool:
    """Whether the record's arguments hold ``term``: ``NAME=VALUE`` (a field of that name, at any
    depth, whose value is VALUE) or ``VALUE`` (any field's). Values compare whole: a string equal to
    it, or a number, ``true``, ``false`` or ``null`` written as JSON writes it. A record whose stored
    arguments do not decode matches nothing."""
    name, sep, text = term.partition("=")
    wanted = (name.strip(), text.strip()) if sep and name.strip() else (None, term.strip())
    try:
        args = rec.args
    except StoreError:
        return False
    return any(
        (wanted[0] is None or field_name == wanted[0]) and _same(value, wanted[1])
        for field_name, value in _scalars(args, None)
    )


def search(
    ledger: Ledger,
    *,
    states: Sequence[State] | None = None,
    tool: str | None = None,
    scope: str | None = None,
    since: float | None = None,
    prefix: str | None = None,
    args: Sequence[str] = (),
    conflicts: bool = False,
    sort: str = "key",
    after: str | None = None,
    offset: int = 0,
    limit: int = 50,
) -> Page:
    """``page`` with more filters and orders: records whose arguments hold every term of ``args``
    (``args_match``), with conflicts only (``conflicts``), listed in ``sort`` order (``SORTS``).

    In key order it pages by ``after`` as ``page`` does. In the other orders it reads every matching
    record, pages by ``offset``, and ``more`` counts exactly the matching records after the page.
    """
    if sort not in SORTS:
        raise ValueError(f"sort={sort!r}: give one of {', '.join(SORTS)}")
    if sort != "key" and after is not None:
        raise ValueError(f"after= pages the key order; with sort={sort!r} page with offset=")

    def keep(rec: Record) -> bool:
        return (
            (since is None or rec.updated_at >= since)
            and (not conflicts or rec.conflicts > 0)
            and all(args_match(rec, term) for term in args)
        )

    query = Query(states=states, tool=tool, scope=scope, after=after if sort == "key" else None)
    matching = _walk(ledger, query, keep, prefix or "")
    if sort == "key":
        found = list(itertools.islice(matching, limit))
        more = sum(1 for _ in itertools.islice(matching, _COUNT_CAP))
        return Page(found, more, more >= _COUNT_CAP, found[-1].key if more else None)
    order: Callable[[Record], tuple[Any, ...]]
    if sort == "age":
        order = lambda r: (r.created_at, r.key)  # noqa: E731
    elif sort == "-age":
        order = lambda r: (-r.created_at, r.key)  # noqa: E731
    else:
        order = lambda r: (_STATE_ORDER[r.state], r.created_at, r.key)  # noqa: E731
    total = 0

    def counted() -> Iterator[Record]:
        nonlocal total
        for rec in matching:
            total += 1
            yield rec

    # Only the records up to the end of the page are kept, however many match.
    first = heapq.nsmallest(offset + limit, counted(), key=order)
    found = first[offset:]
    return Page(found, max(0, total - offset - len(found)), False, None)
