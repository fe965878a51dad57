"""How a lookup scores its candidates (pure, no store): the same choice as scoring every candidate in full
with the default score, while the Python score runs only on candidates that can reach the threshold and
each candidate's arguments are decoded once per process."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st_

from onceonly import Similar
from onceonly import similar as sim_mod
from onceonly.keys import canonical_json
from onceonly.similar import Candidate, Match, best_match, field_text, similarity

# Words that make every branch of the default score likely: short shared words beside long distinct
# ones (the share of common words above the sorted-text ratio), typos and plurals ("fier", "fires"),
# digit words (exact tokens), case, punctuation, other scripts and astral characters (code point order),
# stop-words (which carry no weight, and may leave a text without a meaningful word).
WORDS = ["printer", "printr", "on", "fire", "fier", "fires", "x", "y", "1234", "1235", "a1", "émail",
         "ß", "\U0001d523ire", "PRINTER", "!", "extraordinarily", "notwithstanding", "the", "Is", "a"]  # fmt: skip
TYPOS = {"printer": "printr", "fire": "fier", "fier": "fires", "extraordinarily": "extraordinary", "1234": "1243"}


@st_.composite
def texts(draw: st_.DrawFn, like: str = "") -> str:
    """A text of some of ``like``'s words (a subset, a reordering, typos) and some others, or any text."""
    kept = draw(st_.lists(st_.sampled_from(like.split()), max_size=5)) if like.split() else []
    kept = [TYPOS.get(w, w) if draw(st_.booleans()) else w for w in kept]
    words = kept + draw(st_.lists(st_.sampled_from(WORDS), max_size=4 if kept else 6))
    return " ".join(draw(st_.permutations(words)))


@st_.composite
def candidates(draw: st_.DrawFn, new: dict[str, str]) -> list[Candidate]:
    """Up to 12 earlier calls around ``new``: some with its words, some other-shaped or damaged, a few
    claimed at the same time (ties)."""
    made = []
    for i in range(draw(st_.integers(0, 12))):
        shape = draw(st_.sampled_from(["both", "both", "both", "title only", "number", "damaged"]))
        args: dict[str, Any] = {"title": draw(texts(new["title"])), "body": draw(texts(new["body"]))}
        if shape == "title only":
            del args["body"]
        elif shape == "number":
            args["title"] = draw(st_.integers(0, 3))
        at = float(draw(st_.integers(0, 4)))
        made.append(Candidate(f"k{i}", at, "{damaged" if shape == "damaged" else canonical_json(args)))
    return made


def reference(sim: Similar, texts: dict[str, str], candidates: list[Candidate], own_key: str) -> Match | None:
    """The lookup by its definition: every candidate, newest first, scored in full with ``similarity``."""
    best: Match | None = None
    for cand in sorted(candidates, key=lambda c: -c.at):
        try:
            args = json.loads(cand.args_json)
        except ValueError:
            continue
        if cand.key == own_key:
            return Match(cand.key, 1.0, args if isinstance(args, dict) else {})
        if not isinstance(args, dict) or not all(name in args for name in sim.fields):
            continue
        score = similarity(sim, {name: field_text(args[name]) for name in sim.fields}, texts)
        if score >= sim.threshold and (best is None or score > best.score):
            best = Match(cand.key, score, args)
    return best


@settings(max_examples=400, deadline=None)
@given(
    data=st_.data(),
    new=st_.fixed_dictionaries({"title": texts(), "body": texts()}),
    threshold=st_.sampled_from([0.01, 0.2, 1 / 3, 0.5, 0.6, 0.75, 0.85, 0.9, 0.93, 1.0]),
    two_fields=st_.booleans(),
    exact_tokens=st_.booleans(),
    own=st_.integers(-1, 12),
    min_words=st_.integers(1, 3),
)
def test_the_choice_is_that_of_scoring_every_candidate(
    data: st_.DataObject,
    new: dict[str, str],
    threshold: float,
    two_fields: bool,
    exact_tokens: bool,
    own: int,
    min_words: int,
) -> None:
    """Whatever the texts, threshold, fields and min_words, best_match picks the same candidate, with the same
    score and arguments, as scoring each candidate in full (ties: the newest; damaged or other-shaped
    candidates left out; the call's own key wins outright)."""
    fields = ("title", "body") if two_fields else ("title",)
    sim = Similar(fields=fields, threshold=threshold, exact_tokens=exact_tokens, min_words=min_words)
    group = data.draw(candidates(new))
    assert best_match(sim, new, group, f"k{own}") == reference(sim, new, group, f"k{own}")


def _unlike(n: int) -> list[Candidate]:
    """``n`` candidates that share no word with each other or with 'printer on fire'."""
    return [Candidate(f"k{i}", float(i), canonical_json({"title": f"ticket number{i} word{i}"})) for i in range(n)]


def test_the_python_score_runs_only_where_the_threshold_is_in_reach(monkeypatch: pytest.MonkeyPatch) -> None:
    """Among 100 unlike candidates and one reworded one, the full Python score runs once: the batch
    bounds in C rule the others out."""
    calls: list[str] = []
    full = sim_mod._fuzzy

    def counted(a: Any, b: Any) -> float:
        calls.append(a.raw)
        return full(a, b)

    monkeypatch.setattr(sim_mod, "_fuzzy", counted)
    reworded = Candidate("near", 50.5, canonical_json({"title": "Printer on fire"}))
    found = best_match(Similar(fields=("title",)), {"title": "The printer is on fire!"}, [*_unlike(100), reworded], "x")
    assert found is not None and (found.key, found.score) == ("near", 1.0)
    assert calls == ["Printer on fire"]


def test_candidates_are_decoded_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group's candidates come back on each lookup: the second lookup decodes none of them again,
    except an argument set too large to keep."""
    decoded: list[str] = []
    decode = sim_mod._decode_texts

    def counted(args_json: str, kind: Any) -> Any:
        decoded.append(args_json)
        return decode(args_json, kind)

    monkeypatch.setattr(sim_mod, "_decode_texts", counted)
    sim = Similar(fields=("title",))
    large = Candidate("large", 0.0, canonical_json({"title": "y " * sim_mod._CACHED_CHARS}))
    group = [*_unlike(100), large]
    best_match(sim, {"title": "printer on fire"}, group, "x")
    decoded.clear()
    best_match(sim, {"title": "printer is on fire"}, group, "x")
    assert decoded == [large.args_json]


@pytest.mark.parametrize("limit", [{"_CACHED": 10}, {"_CACHED_TOTAL": 2000}])
def test_the_cache_stays_bounded(monkeypatch: pytest.MonkeyPatch, limit: dict[str, int]) -> None:
    """Past its bound (argument sets or characters) the cache is emptied and filled again, and a
    lookup's answer is the same."""
    monkeypatch.setattr(sim_mod, "_cache", {})
    monkeypatch.setattr(sim_mod, "_cached", [0, 0])
    for name, value in limit.items():
        monkeypatch.setattr(sim_mod, name, value)
    sim = Similar(fields=("title",))
    group = [*_unlike(40), Candidate("near", 50.5, canonical_json({"title": "Printer on fire"}))]
    for _ in range(3):
        found = best_match(sim, {"title": "The printer is on fire!"}, group, "x")
        assert found is not None and found.key == "near"
        assert sum(map(len, sim_mod._cache.values())) <= 10 if "_CACHED" in limit else True
        assert sim_mod._cached[1] <= 2000 if "_CACHED_TOTAL" in limit else True
