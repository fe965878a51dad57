"""Near-duplicate calls: a re-plan that rewords an operation is the operation already asked for.

Exact keys cannot catch "Printer on fire" re-issued as "The printer is on fire!": the words differ, so
the key does. ``Similar`` names the fields compared by meaning rather than by value; the tool's other
key fields still compare exactly and form the call's *group* (same tool, same scope, same exact
fields). A new key is looked up among the group's recent calls, and one whose fields score at least
``threshold`` is taken for the same operation. docs/similar.md says what that costs and risks.

Pure: scoring and choosing, no I/O. The guard (``guard.py``) asks the store for the group's
candidates under a short group lock and calls ``best_match`` on them.
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
    """A field's text, prepared once per lookup: as given, its words, and its words that hold a digit."""

    raw: str
    words: list[str]
    digits: frozenset[str]


def _prepare(text: str) -> _Text:
    """``text``'s words after ``normalize_text`` (whitespace collapsed, case folded), punctuation dropped."""
    norm = normalize_text(text)
    # Most texts hold no digit: one search spares them the second pass.
    digits = frozenset(_DIGITS.findall(norm)) if _DIGIT.search(norm) else _NO_DIGITS
    return _Text(text, _WORD.findall(norm), digits)


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
    sa, sb = set(ta), set(tb)
    if sa <= sb or sb <= sa:
        return float(fuzz.token_set_ratio(" ".join(ta), " ".join(tb))) / 100.0
    changed = fuzz.ratio(" ".join(sorted(sa - sb)), " ".join(sorted(sb - sa))) / 100.0
    if changed >= _ALIKE:
        return float(fuzz.token_sort_ratio(" ".join(ta), " ".join(tb))) / 100.0
    return len(sa & sb) / len(sa | sb)


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
    return _similarity(sim, {n: _prepare(earlier[n]) for n in sim.fields}, {n: _prepare(new[n]) for n in sim.fields})


def _similarity(sim: Similar, earlier: Mapping[str, _Text], new: Mapping[str, _Text]) -> float:
    lowest = 1.0
    for name in sim.fields:
        lowest = min(lowest, sim._score(earlier[name], new[name]))
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
    best: Match | None = None
    mine = {name: _prepare(texts[name]) for name in sim.fields}  # once, not per candidate
    for cand in sorted(candidates, key=lambda c: -c.at):
        try:
            args = json.loads(cand.args_json)
        except ValueError:
            continue  # damaged arguments: not comparable, so not a match
        if cand.key == own_key:
            return Match(cand.key, 1.0, args if isinstance(args, dict) else {})
        if not isinstance(args, dict) or not all(name in args for name in sim.fields):
            continue  # another shape of call (the tool's signature changed): not comparable
        earlier = {name: _prepare(field_text(args[name])) for name in sim.fields}
        score = _similarity(sim, earlier, mine)
        if score >= sim.threshold and (best is None or score > best.score):
            best = Match(cand.key, score, args)
    return best


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
