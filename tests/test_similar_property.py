"""Properties: whatever the threshold and the score, a call is only ever taken for an earlier call of its own
group: the same scope, the same tool, the same exact key fields; texts that share no meaningful word never
match; and a short text never swallows a longer one that holds all its words. The store properties run on
every store, on a fake clock."""

from __future__ import annotations

import uuid
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st_

from onceonly import Ledger, Similar
from onceonly.similar import STOP_WORDS, similarity
from tests._clock import FakeClock

TITLES = ["Printer on fire", "The printer is on fire!", "printer fire", "Email is down", "order 12", "order 13"]
CALLS = st_.lists(
    st_.tuples(
        st_.sampled_from(["scope-a", "scope-b"]),
        st_.sampled_from(["tool_one", "tool_two"]),
        st_.sampled_from(["s1", "s2"]),
        st_.sampled_from(TITLES),
    ),
    min_size=1,
    max_size=12,
)


def _always(a: str, b: str) -> float:
    """The most permissive score: every text is like every other."""
    return 1.0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls=CALLS, threshold=st_.floats(min_value=0.01, max_value=1.0), permissive=st_.booleans())
def test_a_match_never_crosses_scope_tool_or_exact_key(
    store_url: str, calls: list[tuple[str, str, str, str]], threshold: float, permissive: bool
) -> None:
    """Every ``similar_to`` names a record of the call's scope, tool and session, or none at all."""
    clock = FakeClock()
    ledger = Ledger.open(store_url, clock=clock, sleep=clock.sleep)
    sim = Similar(fields=("title",), threshold=threshold, score=_always if permissive else None)
    tools: dict[str, Any] = {}
    for name in ("tool_one", "tool_two"):

        def body(session_id: str, title: str) -> str:
            return title

        tools[name] = ledger.tool(name=name, key=("session_id", "title"), similar=sim)(body)
    try:
        for scope, tool, session, title in calls:
            with ledger.task(scope):
                out = tools[tool].outcome(session, title)
            clock.now += 1
            if out.similar_to is None:
                continue
            earlier = ledger.get(out.similar_to)
            assert earlier is not None
            assert (earlier.scope, earlier.tool, earlier.args["session_id"]) == (scope, tool, session)
    finally:
        ledger.close()


# --- meaningful words: what a text is about ------------------------------------------------------------

#: Words that name what an operation is about, chosen unlike each other: no two groups of them, sorted
#: and joined, are alike enough (``fuzz.ratio`` below 0.7) to pass for a re-typing of each other.
MEANINGFUL = ["invoice", "meeting", "contract", "printer", "laptop", "refund", "password", "shipment", "lunch",
              "payroll", "monitor", "firewall", "calendar", "budget", "keyboard", "vpn", "license", "backup",
              "router", "parking", "holiday", "expense", "webinar"]  # fmt: skip
STOPS = sorted(STOP_WORDS)


@st_.composite
def said(draw: st_.DrawFn, words: list[str]) -> str:
    """A text of ``words`` and any stop-words, in any order, case and punctuation."""
    mixed = words + draw(st_.lists(st_.sampled_from(STOPS), max_size=6))
    mixed = [w.upper() if draw(st_.booleans()) else w for w in draw(st_.permutations(mixed))]
    return " ".join(mixed) + draw(st_.sampled_from(["", "!", ".", "?", " ..."]))


@st_.composite
def apart(draw: st_.DrawFn, n: int, least: int = 1) -> list[list[str]]:
    """``n`` lists of at least ``least`` meaningful words each, no word in two of them."""
    pool = draw(st_.permutations(MEANINGFUL))
    sizes = draw(st_.lists(st_.integers(least, 4), min_size=n, max_size=n).filter(lambda s: sum(s) <= len(pool)))
    starts = [sum(sizes[:i]) for i in range(n)]
    return [list(pool[s : s + k]) for s, k in zip(starts, sizes, strict=True)]


@settings(max_examples=300, deadline=None)
@given(data=st_.data(), threshold=st_.floats(min_value=0.01, max_value=1.0), stop_only=st_.booleans())
def test_disjoint_meaningful_content_scores_zero(data: st_.DataObject, threshold: float, stop_only: bool) -> None:
    """Two texts that share no meaningful word (stop-words shared freely) score 0, so they never match,
    whatever the threshold; a text of stop-words alone scores 0 against anything, itself included."""
    one, two = data.draw(apart(2))
    a = data.draw(said([] if stop_only else one))
    b = data.draw(said(two if data.draw(st_.booleans()) else []))
    sim = Similar(fields=("title",), threshold=threshold)
    assert sim.field_score(a, b) == sim.field_score(b, a) == 0.0
    assert similarity(sim, {"title": a}, {"title": b}) < threshold


@settings(max_examples=300, deadline=None)
@given(data=st_.data(), threshold=st_.floats(min_value=0.7, max_value=1.0))
def test_a_short_text_never_swallows_a_long_one(data: st_.DataObject, threshold: float) -> None:
    """A text whose meaningful words are all inside another's, and at most half as many, scores at most
    2/3 against it in either order: above that threshold (the default 0.85 among them) it never matches."""
    (long_words,) = data.draw(apart(1, least=2))
    short_words = data.draw(st_.lists(st_.sampled_from(long_words), unique=True, max_size=len(long_words) // 2))
    short, long = data.draw(said(short_words)), data.draw(said(long_words))
    sim = Similar(fields=("title",), threshold=threshold)
    assert sim.field_score(short, long) <= 2 / 3 + 1e-9 and sim.field_score(long, short) <= 2 / 3 + 1e-9
    assert similarity(sim, {"title": short}, {"title": long}) < threshold


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st_.data(), threshold=st_.floats(min_value=0.01, max_value=1.0), n=st_.integers(2, 5))
def test_calls_of_disjoint_meaningful_content_all_run(
    store_url: str, data: st_.DataObject, threshold: float, n: int
) -> None:
    """In one group, calls whose subjects share no meaningful word (one may have none) each run, whatever
    the threshold."""
    groups = data.draw(apart(n))
    if data.draw(st_.booleans()):
        groups[0] = []  # a subject of stop-words alone, such as "the"
    subjects = [data.draw(said(words)) for words in groups]
    assert _runs_of(store_url, threshold, subjects) == len(subjects)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st_.data(), threshold=st_.floats(min_value=0.7, max_value=1.0), n=st_.integers(1, 3))
def test_a_short_subject_never_swallows_the_group(
    store_url: str, data: st_.DataObject, threshold: float, n: int
) -> None:
    """A short subject (no meaningful word, or a few) and longer ones that each hold all its words and at
    least as many of their own, called in any order in one group: every call runs."""
    k = data.draw(st_.integers(0, 2))
    short_words, *own = data.draw(apart(n + 1, least=max(k, 1)))
    short_words = short_words[:k]
    subjects = [data.draw(said(short_words))] + [data.draw(said(short_words + words)) for words in own]
    assert _runs_of(store_url, threshold, data.draw(st_.permutations(subjects))) == len(subjects)


def _runs_of(store_url: str, threshold: float, subjects: list[str]) -> int:
    """How many times the tool's body ran when each subject was sent once, in order, to one customer (a
    new one each time: the examples share the store)."""
    customer = f"{uuid.uuid4().hex}@example.com"
    clock = FakeClock()
    ledger = Ledger.open(store_url, clock=clock, sleep=clock.sleep)
    sent: list[str] = []

    @ledger.tool(key=("customer", "subject"), similar=Similar(fields=("subject",), threshold=threshold))
    def send_email(customer: str, subject: str) -> str:
        sent.append(subject)
        return subject

    try:
        for subject in subjects:
            assert send_email.outcome(customer, subject).similar_to is None, (subject, sent)
            clock.now += 1
        return len(sent)
    finally:
        ledger.close()
