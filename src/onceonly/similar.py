"""Near-duplicate calls: a re-plan that rewords an operation is the operation already asked for.

Exact keys cannot catch "Printer on fire" re-issued as "The printer is on fire!": the words differ, so
the key does. ``Similar`` names the fields compared by meaning rather than by value; the tool's other
key fields still compare exactly and form the call's *group* (same tool, same scope, same exact
fields). A new key is looked up among the group's recent calls, and one whose fields score at least
``threshold`` is taken for the same operation. docs/similar.md says what that costs and risks.

Pure: scoring and choosing, no I/O. The plan (``onceonly.plan.similar``) asks the store for the group's
candidates under a short group lock and calls ``best_match`` on them. A group's candidates come back
call after call, so their prepared texts are kept in a bounded in-process cache, and the default score
runs only on the candidates that rapidfuzz's batch functions (in C) leave able to reach the threshold.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from onceonly._install import install_hint
from onceonly.keys import canonical_json, compose_key, fingerprint, normalize_text

__all__ = [
    "MAX_CANDIDATES",
    "STOP_WORDS",
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

#: Words that carry no weight in the default score and are not counted by ``Similar.min_words``: English
#: articles, forms of "be", "do" and "have", a few auxiliaries, pronouns and determiners, "of", "for",
#: "at", "by", "and", and the courtesies a model adds. Left out on purpose, because adding or changing one
#: changes an operation: not, no, on, off, in, out, up, down, to, from, with, or. ``Similar(stop_words=...)``
#: replaces the list (``frozenset()``: every word counts).
STOP_WORDS: frozenset[str] = frozenset((
    "a", "an", "the", "am", "is", "are", "was", "were", "be", "been", "being", "do", "does", "did", "has",
    "have", "had", "will", "would", "shall", "should", "could", "i", "me", "my", "we", "our", "you", "your",
    "he", "him", "his", "she", "her", "it", "its", "they", "them", "their", "this", "that", "these", "those",
    "of", "for", "at", "by", "and", "please", "kindly", "thanks", "thank",
))  # fmt: skip


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
    """A field's text, prepared once: as given, its words that hold a digit, and what the default score
    compares: its meaningful words (stop-words left out) sorted and joined (``token_sort_ratio``'s
    text), and their set."""

    raw: str
    digits: frozenset[str]
    sorted_text: str
    wordset: frozenset[str]


def _prepare(text: str, stop: frozenset[str]) -> _Text:
    """``text``'s words after ``normalize_text`` (whitespace collapsed, case folded), punctuation and the
    words in ``stop`` dropped."""
    norm = normalize_text(text)
    # Most texts hold no digit: one search spares them the second pass.
    digits = frozenset(_DIGITS.findall(norm)) if _DIGIT.search(norm) else _NO_DIGITS
    words = [w for w in _WORD.findall(norm) if w not in stop]
    return _Text(text, digits, " ".join(sorted(words)), frozenset(words))


#: Candidates' prepared texts, kept in-process per ``Similar.fields`` and stop-words (a group's candidates come back on
#: each of its lookups). An argument set longer than ``_CACHED_CHARS`` is prepared each time and never
#: kept; the whole is emptied when it would hold more than ``_CACHED`` argument sets or ``_CACHED_TOTAL``
#: characters (argument sets and their prepared texts: about 10 MB at most).
_CACHED = 4096
_CACHED_CHARS = 4096
_CACHED_TOTAL = 4_000_000
_Kind = tuple[tuple[str, ...], frozenset[str]]  # the fields, the stop-words: what a prepared text depends on
_cache: dict[_Kind, dict[str, tuple[_Text, ...] | None]] = {}
_cached = [0, 0]  # sets, characters: a cell that threads may add to at once (it only bounds)
_MISSING: Any = object()


def _decode_texts(args_json: str, kind: _Kind) -> tuple[_Text, ...] | None:
    """The prepared texts of ``fields`` in a candidate's arguments; ``None`` when they are not
    comparable: damaged JSON, or another shape of call (the tool's signature changed)."""
    try:
        args = json.loads(args_json)
    except ValueError:
        return None
    fields, stop = kind
    if not isinstance(args, dict) or not all(name in args for name in fields):
        return None
    return tuple(_prepare(field_text(args[name]), stop) for name in fields)


def _rows(candidates: Sequence[Candidate], kind: _Kind) -> list[_Row]:
    """Each comparable candidate with the prepared texts of its fields, from the cache where it can."""
    kept = _cache.get(kind, {})
    rows: list[_Row] = []
    for cand in candidates:
        theirs = kept.get(cand.args_json, _MISSING)
        if theirs is _MISSING:
            theirs = _decode_texts(cand.args_json, kind)
            if len(cand.args_json) <= _CACHED_CHARS:
                _keep(kind, cand.args_json, theirs)
        if theirs is not None:
            rows.append((cand, theirs))
    return rows


def _keep(kind: _Kind, args_json: str, texts: tuple[_Text, ...] | None) -> None:
    """Keep one candidate's prepared texts, emptying the cache first when it is full (not LRU: a clear
    is safe under threads, and refilling costs one decoding per candidate)."""
    # Each text is held about three times (as given, its words sorted, as a set).
    chars = len(args_json) + 3 * sum(len(t.raw) for t in texts or ())
    if _cached[0] >= _CACHED or _cached[1] + chars > _CACHED_TOTAL:
        _cache.clear()
        _cached[0] = _cached[1] = 0
    _cache.setdefault(kind, {})[args_json] = texts
    _cached[0] += 1
    _cached[1] += chars


#: A candidate and the prepared texts of its fields (``Similar.fields`` order).
_Row = tuple[Candidate, tuple[_Text, ...]]


def fuzzy_score(a: str, b: str, *, stop_words: Collection[str] = STOP_WORDS) -> float:
    """The default score, 0..1: rapidfuzz's fuzzy ratios on the meaningful words, those left after
    ``normalize_text``, punctuation and ``stop_words`` are dropped. A text without one scores 0.

    - The words of one text are all among the other's (a re-plan that adds or drops words): how much
      the two have in common, in proportion to both (``2 * shared / (len(a) + len(b))``): "Printer on
      fire" and "The printer is on fire!" share all of theirs (1.0), three words and a fourth added
      score 0.86, one word of two 0.67, so a short text cannot swallow a longer one.
    - Each text has words of its own, and those are alike (a typo, a plural: "fier" for "fire"):
      ``token_sort_ratio``, how much of the whole meaningful text is the same.
    - Each has words of its own, and those differ (another name, another place: "alice" for "bob"):
      the share of all their words the two have in common, so one changed word in four scores 0.6.

    .. versionadded:: 0.1
    """
    stop = _stop_words(stop_words)
    return _fuzzy(_prepare(a, stop), _prepare(b, stop))


def _fuzzy(a: _Text, b: _Text) -> float:
    sa, sb = a.wordset, b.wordset
    if not sa or not sb:
        return 0.0  # nothing meaningful to compare: never the same operation
    shared = len(sa & sb)
    if shared == min(len(sa), len(sb)):  # one within the other
        return 2.0 * shared / (len(sa) + len(sb))
    fuzz = _fuzz()
    changed = fuzz.ratio(" ".join(sorted(sa - sb)), " ".join(sorted(sb - sa))) / 100.0
    if changed >= _ALIKE:
        return float(fuzz.ratio(a.sorted_text, b.sorted_text)) / 100.0
    return shared / (len(sa) + len(sb) - shared)


#: Slack on the threshold when ruling candidates out, so that float rounding never rules out one that
#: the exact score would keep.
_SLACK = 1e-9


def _may_reach(sim: Similar, mine: tuple[_Text, ...], rows: list[_Row]) -> list[_Row]:
    """The candidates whose default score may reach ``sim.threshold``, found mostly in C; the others
    score below it for sure. ``_fuzzy`` scores a pair with one of three numbers, and a candidate is
    ruled out when, for some field, it or the new call has fewer than ``sim.min_words`` meaningful
    words, or all three are below the threshold:

    - the share in proportion when one text's words are all among the other's, and the share of all
      words otherwise, both computed from the shared count (a candidate sharing no word scores 0 by
      both);
    - ``token_sort_ratio``, which is ``ratio`` of the sorted words: one batch call over all candidates.
    """
    from rapidfuzz import fuzz, process

    threshold, least = sim.threshold, sim.min_words
    for i, ours in enumerate(mine):
        if not rows:
            break
        words = ours.wordset
        if len(words) < least:
            return []  # the new call has too few meaningful words: it matches nothing
        near = {
            found[2]
            for found in process.extract(
                ours.sorted_text, [theirs[i].sorted_text for _, theirs in rows], scorer=fuzz.ratio,
                score_cutoff=max(threshold * 100.0 - 1e-6, 0.0), limit=None,
            )
        }  # fmt: skip
        kept: list[_Row] = []
        for n, row in enumerate(rows):
            theirs = row[1][i].wordset
            if len(theirs) >= least and (
                n in near or (not words.isdisjoint(theirs) and _overlap(words, theirs, threshold))
            ):
                kept.append(row)
        rows = kept
    return rows


def _overlap(a: frozenset[str], b: frozenset[str], threshold: float) -> bool:
    """Whether two word sets that share a word score at least ``threshold`` by the words they share:
    in proportion when one is within the other, as a share of all their words otherwise."""
    shared = len(a & b)
    if shared == min(len(a), len(b)):
        return 2.0 * shared / (len(a) + len(b)) >= threshold - _SLACK
    return shared / (len(a) + len(b) - shared) >= threshold - _SLACK


#: How alike the words only one text has must be to count as the same words re-typed (0..1).
_ALIKE = 0.75


def _stop_words(given: Collection[str]) -> frozenset[str]:
    """``given`` as the score sees words (case folded), each checked to be one word; the built-in list
    as it is."""
    if given is STOP_WORDS:
        return STOP_WORDS
    if isinstance(given, str) or not isinstance(given, Collection):
        raise TypeError(f"stop_words={given!r}: give a set of words, such as {{'the', 'a'}} (frozenset() for none)")
    words = set()
    for word in given:
        found = _WORD.findall(normalize_text(word)) if isinstance(word, str) else []
        if len(found) != 1 or found[0] != normalize_text(word):
            raise ValueError(
                f"stop_words: {word!r} is not one word; give words of letters, digits or '_' "
                "(the score splits a text at anything else)"
            )
        words.add(found[0])
    return frozenset(words)


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
        stop_words: words that carry no weight: the default score leaves them out, and ``min_words``
            does not count them; default ``STOP_WORDS`` (a small English list), ``frozenset()`` for none.
        min_words: the fewest meaningful words (not stop-words, counted once each) a field's text needs,
            in both calls, before they can match, with any ``score``; default 1, so a subject such as
            "the" matches nothing ("re" of "Re:" is a word, not a stop-word).

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
    stop_words: Collection[str] = field(default=STOP_WORDS, repr=False)  # a long list: left out of repr
    min_words: int = 1
    #: What a prepared text depends on: the fields and the stop-words (the cache's key).
    _kind: _Kind = field(init=False, repr=False, compare=False)

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
        m = self.min_words
        if type(m) is not int or m < 1:
            raise ValueError(f"Similar(min_words={m!r}): give an int of at least 1, such as 2")
        try:
            stop = _stop_words(self.stop_words)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"Similar({exc}") from None
        object.__setattr__(self, "stop_words", stop)
        object.__setattr__(self, "_kind", (self.fields, stop))
        if self.score is None:
            _fuzz()  # fail at decoration, not at the first call
        elif not callable(self.score):
            raise TypeError(f"Similar(score={self.score!r}): give a function (earlier_text, new_text) -> 0..1")

    def field_score(self, a: str, b: str) -> float:
        """One field's score, 0..1: ``score`` (or ``fuzzy_score`` with ``stop_words``), and 0 where the
        digit words differ or a text has fewer than ``min_words`` meaningful words."""
        stop = self._kind[1]
        return self._score(_prepare(a, stop), _prepare(b, stop))

    def _score(self, a: _Text, b: _Text) -> float:
        if self.exact_tokens and a.digits != b.digits:
            return 0.0
        if len(a.wordset) < self.min_words or len(b.wordset) < self.min_words:
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
    stop = sim._kind[1]
    return _similarity(
        sim, tuple(_prepare(earlier[n], stop) for n in sim.fields), tuple(_prepare(new[n], stop) for n in sim.fields)
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
    kind = sim._kind
    mine = tuple(_prepare(texts[name], kind[1]) for name in kind[0])  # once, not per candidate
    rows = _rows(candidates, kind)
    if sim.score is None:
        rows = _may_reach(sim, mine, rows)
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
    """One call's similarity question, carried on its ``plan.Call``; ``joined`` and ``score`` are set
    when the guard takes it for an earlier call."""

    similar: Similar
    on_similar: OnSimilar
    group: str
    texts: dict[str, str]
    joined: str | None = None
    score: float = 0.0
    earlier: dict[str, Any] | None = None
