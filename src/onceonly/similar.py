"""Near-duplicate calls: a re-plan that rewords an operation is the operation already asked for.

Exact keys cannot catch "Printer on fire" re-issued as "The printer is on fire!": the words differ, so
the key does. ``Similar`` names the fields compared by meaning rather than by value; the tool's other
key fields still compare exactly and form the call's *group* (same tool, same scope, same exact
fields). A new key is looked up among the group's recent calls, and one whose fields score at least
``threshold`` is taken for the same operation. docs/similar.md says what that costs and risks.

Pure: scoring and choosing, no I/O. The guard (``guard.py``) asks the store for the group's
candidates under a short group lock and calls ``best_match`` on them. A group's candidates come back
call after call, so their prepared texts are kept in a bounded in-process cache, and the default score
runs only on the candidates that rapidfuzz's batch functions (in C) leave able to reach the threshold.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from onceonly._install import install_hint
from onceonly.keys import canonical_json, compose_key, fingerprint, normalize_text

__all__ = [
    "MAX_CANDIDATES",
    "Candidate",
    "Lookup",
    "Match",
    "OnSimilar",
    "Similar",
    "best_match",
    "fuzzy_score",
    "group_of",
    "similarity",
]

#: The most candidates one lookup scores by default: the newest of the group within the window.
MAX_CANDIDATES = 100
#: The most a ``Similar`` may ask for (each is scored in Python while the group is locked).
_CANDIDATES_LIMIT = 1000

OnSimilar = Literal["replay", "review", "raise"]
Score = Callable[[str, str], float]

_WORD = re.compile(r"\w+")
_DIGITS = re.compile(r"\w*\d\w*")
_DIGIT = re.compile(r"\d")
_NO_DIGITS: frozenset[str] = frozenset()


class Candidate(NamedTuple):
    """An earlier call of a group, as a store returns it: its key, when it was claimed (seconds since
    the epoch), and its arguments' JSON.

    .. versionadded:: 0.1
    """

    key: str
    at: float
    args_json: str


def _fuzz() -> Any:
    try:
        from rapidfuzz import fuzz
    except ImportError:
        raise ImportError(
            "onceonly.Similar scores text with rapidfuzz, which is not installed: "
            f"{install_hint('similar')}, or pass Similar(..., score=your_function)"
        ) from None
    return fuzz


class _Text(NamedTuple):
    """A field's text, prepared once: as given, its words, its words that hold a digit, and what the
    default score compares: the words joined, the words sorted and joined (``token_sort_ratio``'s
    text), and the set of words."""

    raw: str
    words: list[str]
    digits: frozenset[str]
    joined: str
    sorted_text: str
    wordset: frozenset[str]


def _prepare(text: str) -> _Text:
    """``text``'s words after ``normalize_text`` (whitespace collapsed, case folded), punctuation dropped."""
    norm = normalize_text(text)
    # Most texts hold no digit: one search spares them the second pass.
    digits = frozenset(_DIGITS.findall(norm)) if _DIGIT.search(norm) else _NO_DIGITS
    words = _WORD.findall(norm)
    return _Text(text, words, digits, " ".join(words), " ".join(sorted(words)), frozenset(words))


#: Candidates' prepared texts, kept in-process per ``Similar.fields`` (a group's candidates come back on
#: each of its lookups). An argument set longer than ``_CACHED_CHARS`` is prepared each time and never
#: kept; the whole is emptied when it would hold more than ``_CACHED`` argument sets or ``_CACHED_TOTAL``
#: characters (argument sets and their prepared texts: about 10 MB at most).
_CACHED = 4096
_CACHED_CHARS = 4096
_CACHED_TOTAL = 4_000_000
_cache: dict[tuple[str, ...], dict[str, tuple[_Text, ...] | None]] = {}
_cached = [0, 0]  # sets, characters: a cell that threads may add to at once (it only bounds)
_MISSING: Any = object()


def _decode_texts(args_json: str, fields: tuple[str, ...]) -> tuple[_Text, ...] | None:
    """The prepared texts of ``fields`` in a candidate's arguments; ``None`` when they are not
    comparable: damaged JSON, or another shape of call (the tool's signature changed)."""
    try:
        args = json.loads(args_json)
    except ValueError:
        return None
    if not isinstance(args, dict) or not all(name in args for name in fields):
        return None
    return tuple(_prepare(field_text(args[name])) for name in fields)


def _rows(candidates: Sequence[Candidate], fields: tuple[str, ...]) -> list[_Row]:
    """Each comparable candidate with the prepared texts of its fields, from the cache where it can."""
    kept = _cache.get(fields, {})
    rows: list[_Row] = []
    for cand in candidates:
        theirs = kept.get(cand.args_json, _MISSING)
        if theirs is _MISSING:
            theirs = _decode_texts(cand.args_json, fields)
            if len(cand.args_json) <= _CACHED_CHARS:
                _keep(fields, cand.args_json, theirs)
        if theirs is not None:
            rows.append((cand, theirs))
    return rows


def _keep(fields: tuple[str, ...], args_json: str, texts: tuple[_Text, ...] | None) -> None:
    """Keep one candidate's prepared texts, emptying the cache first when it is full (not LRU: a clear
    is safe under threads, and refilling costs one decoding per candidate)."""
    # Each text is held about five times (as given, its words, joined, sorted, as a set).
    chars = len(args_json) + 5 * sum(len(t.raw) for t in texts or ())
    if _cached[0] >= _CACHED or _cached[1] + chars > _CACHED_TOTAL:
        _cache.clear()
        _cached[0] = _cached[1] = 0
    _cache.setdefault(fields, {})[args_json] = texts
    _cached[0] += 1
    _cached[1] += chars


#: A candidate and the prepared texts of its fields (``Similar.fields`` order).
_Row = tuple[Candidate, tuple[_Text, ...]]


def fuzzy_score(a: str, b: str) -> float:
    """The default score, 0..1: rapidfuzz's token-based fuzzy ratios on the normalised words.

    - The words of one text are all among the other's (a re-plan that adds words: "Printer on fire" and
      "The printer is on fire!"): ``token_set_ratio``, which scores that 1.0.
    - Each text has words of its own, and those are alike (a typo, a plural: "fier" for "fire"):
      ``token_sort_ratio``, how much of the whole text is the same.
    - Each has words of its own, and those differ (another name, another place: "alice" for "bob"):
      the share of words the two have in common, so one changed word in five scores 0.67, not the 0.85
      that a character ratio gives a long shared phrase.

    .. versionadded:: 0.1
    """
    return _fuzzy(_prepare(a), _prepare(b))


def _fuzzy(a: _Text, b: _Text) -> float:
    ta, tb = a.words, b.words
    if not ta or not tb:
        return 1.0 if ta == tb else 0.0
    fuzz = _fuzz()
    sa, sb = a.wordset, b.wordset
    if sa <= sb or sb <= sa:
        return float(fuzz.token_set_ratio(a.joined, b.joined)) / 100.0
    changed = fuzz.ratio(" ".join(sorted(sa - sb)), " ".join(sorted(sb - sa))) / 100.0
    if changed >= _ALIKE:
        return float(fuzz.token_sort_ratio(a.joined, b.joined)) / 100.0
    return len(sa & sb) / len(sa | sb)


#: Slack on the threshold when ruling candidates out, so that float rounding never rules out one that
#: the exact score would keep.
_SLACK = 1e-9


def _may_reach(threshold: float, mine: tuple[_Text, ...], rows: list[_Row]) -> list[_Row]:
    """The candidates whose default score may reach ``threshold``, found mostly in C; the others score
    below it for sure. ``_fuzzy`` scores a pair with one of three numbers, and a candidate is ruled out
    only when all three are below the threshold for some field:

    - 1.0 when one text's words are all among the other's (so a candidate sharing no word with ours
      is out, and one sharing some needs the two numbers below);
    - ``token_sort_ratio``, which is ``ratio`` of the sorted words: one batch call over all candidates;
    - the share of words in common, computed from the shared count.
    """
    from rapidfuzz import fuzz, process

    for i, ours in enumerate(mine):
        if not rows:
            break
        if not ours.words:
            continue  # an empty text matches only an empty one: the exact score decides
        near = {
            found[2]
            for found in process.extract(
                ours.sorted_text, [theirs[i].sorted_text for _, theirs in rows], scorer=fuzz.ratio,
                score_cutoff=max(threshold * 100.0 - 1e-6, 0.0), limit=None,
            )
        }  # fmt: skip
        words = ours.wordset
        rows = [
            row
            for n, row in enumerate(rows)
            if n in near or (not words.isdisjoint(row[1][i].wordset) and _overlap(words, row[1][i].wordset, threshold))
        ]
    return rows


def _overlap(a: frozenset[str], b: frozenset[str], threshold: float) -> bool:
    """Whether two word sets that share a word score 1.0 (one within the other) or share at least
    ``threshold`` of their words."""
    shared = len(a & b)
    return shared == min(len(a), len(b)) or shared / (len(a) + len(b) - shared) >= threshold - _SLACK


#: How alike the words only one text has must be to count as the same words re-typed (0..1).
_ALIKE = 0.75


@dataclass(frozen=True, slots=True)
class Similar:
    """Which fields of a call compare by similarity rather than by value (``@ledger.tool(similar=...)``).

    Args:
        fields: the fields compared by similarity; each must be one of the tool's ``key=`` fields. The
            other key fields still compare exactly: they form the group a call is compared within.
        threshold: the lowest score (0..1) at which two calls are the same operation; default 0.85.
        window: seconds after an earlier call's claim during which a new call may match it; default 3600.
        score: ``(earlier_text, new_text) -> float`` in 0..1, for one field's two values as text
            (an embedding model's cosine similarity, say); default ``fuzzy_score`` (rapidfuzz, the
            ``similar`` extra). Several fields: the lowest of their scores counts.
        exact_tokens: words holding a digit (numbers, ids, dates) must be equal for a match, whatever the
            score: "refund order 1234" never matches "refund order 1235". ``False`` leaves it to ``score``.
        candidates: the most earlier calls one lookup scores: the newest of the group within the window
            (default 100, at most 1000).

    Raises:
        ImportError: no ``score`` given and rapidfuzz is not installed (the message says how to add it).
        ValueError / TypeError: a setting out of range, with what to give instead.

    .. versionadded:: 0.1
    """

    fields: tuple[str, ...]
    threshold: float = 0.85
    window: float = 3600.0
    score: Score | None = None
    exact_tokens: bool = True
    candidates: int = field(default=MAX_CANDIDATES)

    def __post_init__(self) -> None:
        given = self.fields
        if isinstance(given, str) or not isinstance(given, Sequence) or not given:
            raise TypeError(f"Similar(fields={given!r}): give a tuple of field names, such as fields=('title',)")
        if not all(isinstance(f, str) and f for f in given):
            raise TypeError(f"Similar(fields={given!r}): every field is a parameter name (a non-empty str)")
        object.__setattr__(self, "fields", tuple(dict.fromkeys(given)))
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, int | float) or not 0.0 < t <= 1.0:
            raise ValueError(f"Similar(threshold={t!r}): give a number above 0 and at most 1, such as 0.85")
        w = self.window
        if isinstance(w, bool) or not isinstance(w, int | float) or not (math.isfinite(w) and w > 0):
            raise ValueError(f"Similar(window={w!r}): give the seconds an earlier call counts, above 0, such as 3600")
        n = self.candidates
        if type(n) is not int or not 1 <= n <= _CANDIDATES_LIMIT:
            raise ValueError(f"Similar(candidates={n!r}): give an int from 1 to {_CANDIDATES_LIMIT}")
        if self.score is None:
            _fuzz()  # fail at decoration, not at the first call
        elif not callable(self.score):
            raise TypeError(f"Similar(score={self.score!r}): give a function (earlier_text, new_text) -> 0..1")

    def field_score(self, a: str, b: str) -> float:
        """One field's score, 0..1: ``score`` (or ``fuzzy_score``), and 0 where the digit words differ."""
        return self._score(_prepare(a), _prepare(b))

    def _score(self, a: _Text, b: _Text) -> float:
        if self.exact_tokens and a.digits != b.digits:
            return 0.0
        if self.score is None:
            return _fuzzy(a, b)
        value = self.score(a.raw, b.raw)
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"the score function of Similar returned {value!r}: it must return a number 0..1") from None
        if not 0.0 <= value <= 1.0:  # NaN fails this too
            raise ValueError(f"the score function of Similar returned {value!r}: it must return a number 0..1")
        return value


def field_text(value: Any) -> str:
    """A field's value as the text that is scored: a string as it is, anything else as canonical JSON."""
    return value if isinstance(value, str) else canonical_json(value, path="similar field")


def similarity(sim: Similar, earlier: Mapping[str, str], new: Mapping[str, str]) -> float:
    """How similar two calls are, 0..1: the lowest score of their ``sim.fields`` (all must be alike).

    .. versionadded:: 0.1
    """
    return _similarity(
        sim, tuple(_prepare(earlier[n]) for n in sim.fields), tuple(_prepare(new[n]) for n in sim.fields)
    )


def _similarity(sim: Similar, earlier: Sequence[_Text], new: Sequence[_Text]) -> float:
    """The lowest score of the fields, in ``sim.fields`` order."""
    lowest = 1.0
    for a, b in zip(earlier, new, strict=True):
        lowest = min(lowest, sim._score(a, b))
        if lowest < sim.threshold:
            break  # one field unlike is enough: skip scoring the others
    return lowest


@dataclass(frozen=True, slots=True)
class Match:
    """The earlier call a new call is taken for: its key, the score, and its arguments."""

    key: str
    score: float
    args: dict[str, Any]


def best_match(sim: Similar, texts: Mapping[str, str], candidates: Sequence[Candidate], own_key: str) -> Match | None:
    """The candidate ``texts`` is most similar to, at or above the threshold (the newest of equals);
    ``None`` when none is. A candidate with ``own_key`` is this very call's key: it wins outright,
    since a key seen before is that operation whatever the scores.

    .. versionadded:: 0.1
    """
    for cand in candidates:
        if cand.key == own_key:
            try:
                args = json.loads(cand.args_json)
            except ValueError:
                break  # damaged arguments: not comparable, so not a match (and left out below)
            return Match(cand.key, 1.0, args if isinstance(args, dict) else {})
    fields = sim.fields
    mine = tuple(_prepare(texts[name]) for name in fields)  # once, not per candidate
    rows = _rows(candidates, fields)
    if sim.score is None:
        rows = _may_reach(sim.threshold, mine, rows)
    best: tuple[Candidate, float] | None = None
    for cand, theirs in sorted(rows, key=_newest_first):  # stable: the newest of equals wins
        score = _similarity(sim, theirs, mine)
        if score >= sim.threshold and (best is None or score > best[1]):
            best = cand, score
    if best is None:
        return None
    return Match(best[0].key, best[1], json.loads(best[0].args_json))


def _newest_first(row: _Row) -> float:
    return -row[0].at


def group_of(scope: str, tool: str, exact: Mapping[str, Any]) -> str:
    """The group a call is compared within: its scope, tool and the exact-key fields' values.

    .. versionadded:: 0.1
    """
    return compose_key(scope, tool, "~" + fingerprint(canonical_json(dict(exact), path="key"))[:32])


@dataclass(slots=True)
class Lookup:
    """One call's similarity question, carried on its ``guard.Call``; ``joined`` and ``score`` are set
    when the guard takes it for an earlier call."""

    similar: Similar
    on_similar: OnSimilar
    group: str
    texts: dict[str, str]
    joined: str | None = None
    score: float = 0.0
    earlier: dict[str, Any] | None = None
