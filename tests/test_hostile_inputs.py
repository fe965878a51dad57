"""Hostile input, generated: tool names, scopes, explicit keys, arguments and results that hypothesis
draws (deep nesting, huge strings and numbers, NaN, lone surrogates, NUL, control and bidi characters,
keys of other types, objects with no JSON form...) go through ``@ledger.tool`` on each real store.

Each is either refused with a clear onceonly error (it says what was wrong and what to do) before
anything runs, or handled: the call runs once, a second call replays the same result, and the record
reads back as written. Never another kind of exception (``UnicodeEncodeError``, ``RecursionError``, a
driver's error), and a sentinel record planted first keeps every stored byte.

How many examples, and why they are derandomized under CI: tests/_hostile.py.
"""

from __future__ import annotations

import decimal
import itertools
import json
import math
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from onceonly import Ledger, NotSerializable, OnceOnlyError
from onceonly.keys import MAX_KEY_LENGTH, canonical_json
from tests._hostile import hostile, plant_sentinel, store_kind

# --- what is drawn ----------------------------------------------------------------------------------

#: Every code point, lone surrogates included (hypothesis leaves them out unless asked).
ANY_CHAR = st.characters(exclude_categories=())

#: Names chosen by hand: each has tripped some system somewhere.
NASTY_NAMES = [
    "", " ", "a b", "\t", "a\nb", "\ud800", "a\udfffb", "\udce9", "a\x00b", "\x00", "\x7f", "\x1b[31m",
    "\u200f", "\u202eabc", "\u200b", "\ufeff", "\xa0", "\u2028", "a#b", "a#2", "#", "a/b", "../x", "/", "a%3Ab",
    "%", "%25", "a:b", ":", "::", "a\\b", '"', "'", "{tag}", "*", "?", "[a]", "x" * MAX_KEY_LENGTH,
    "x" * (MAX_KEY_LENGTH + 1), "é" * MAX_KEY_LENGTH, "\U0001f600" * 200, "x" * 3_000_000, "ß", "İ", "\u0130",
    "\u00c5", "A\u030a",  # NFC and NFD: two names, never one
]  # fmt: skip

NAMES = st.one_of(st.sampled_from(NASTY_NAMES), st.text(ANY_CHAR, max_size=40), st.text(ANY_CHAR, min_size=250))

#: Numbers at the edges: 64-bit bounds, past them, past Python's 4300-digit text limit (drawn as
#: powers: hypothesis prints what it samples, and such an int has no text form to print).
BIG_INTS = st.one_of(
    st.sampled_from([2**63 - 1, 2**63, -(2**63) - 1, 2**64]),
    st.sampled_from([400, 4299, 4300, 5000]).map(lambda n: 10**n),
    st.sampled_from([4299, 4300]).map(lambda n: -(10**n)),
)
#: Values with no JSON form (or none onceonly chooses), and some with one.
ODD_VALUES = [
    set(), {1, 2}, frozenset({"a"}), object(), 1 + 2j, Ellipsis, range(3), decimal.Decimal("NaN"),
    decimal.Decimal("-Infinity"), decimal.Decimal("1.10"), b"\xff\x00", bytearray(b"\x00"), memoryview(b"ab"),
    type, print, iter([]), NotImplemented,
]  # fmt: skip

LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    BIG_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    st.just(-0.0),
    st.text(ANY_CHAR, max_size=12),
    st.sampled_from(["\x00", "\ud800", "a\udcffb", "\u202eevil", "#/%:", "\r\n\x1b[31m", "\ufffe", "\U0010ffff"]),
    st.binary(max_size=12),
    st.sampled_from(ODD_VALUES),
)
DICT_KEYS = st.one_of(
    st.text(ANY_CHAR, max_size=8),
    st.integers(),
    st.floats(allow_nan=True),
    st.none(),
    st.booleans(),
    st.tuples(st.integers()),
    st.binary(max_size=4),
    BIG_INTS,
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.tuples(inner, inner), st.dictionaries(DICT_KEYS, inner, max_size=4)
    ),
    max_leaves=10,
)


def nested(depth: int, leaf: Any = 1, *, as_dict: bool = False) -> Any:
    """``leaf`` inside ``depth`` lists (or one-key dicts)."""
    value = leaf
    for _ in range(depth):
        value = {"k": value} if as_dict else [value]
    return value


#: Sizes that no hand-written test tries, built once.
HUGE = {
    "deep-list": nested(100_000),
    "deep-dict": nested(5_000, as_dict=True),
    "deep-with-set": nested(600, {1}),
    "near-the-limit": nested(sys.getrecursionlimit() - 120),
    "2mb-text": "x" * (2 << 20),
    "2mb-text-with-nul": "\x00" * (2 << 20),
    "wide-list": list(range(200_000)),
    "wide-dict": {str(i): i for i in range(50_000)},
    "int-past-the-digit-limit": [10**5000],
    "int-key-past-the-digit-limit": {10**5000: 1},
}


# --- what must hold ----------------------------------------------------------------------------------

#: Words of an instruction: a clear error says what to do, not only what went wrong.
_DO = re.compile(r"\b(give|use|remove|shorten|convert|pass|leave|decode|return|send|flatten|choose)\b", re.I)


def assert_clear(exc: BaseException) -> None:
    """``exc`` is a refusal onceonly means (an ``OnceOnlyError``: ``InvalidKey`` and ``NotSerializable``
    are also a ``ValueError`` and a ``TypeError``), whose message says what was wrong and what to do."""
    assert isinstance(exc, OnceOnlyError), f"{type(exc).__name__} leaked: {exc}"
    message = str(exc)
    assert len(message) < 5_000, f"the message is {len(message)} characters long"
    assert _DO.search(message), f"the message says nothing to do: {message}"


def name_refused_rightly(value: str) -> bool:
    """Whether a refusal of ``value`` as a name is right: no name is empty, longer than the limit, or
    holds whitespace or characters that do not print (controls, format marks, lone surrogates)."""
    return not value or len(value) > MAX_KEY_LENGTH or not value.isprintable() or any(c.isspace() for c in value)


@pytest.fixture(name="sentinel")
def fixture_sentinel(ledger: Ledger) -> Iterator[Callable[[], None]]:
    """A record written before any hostile input; the check asserts it kept every stored byte."""
    check = plant_sentinel(ledger)
    yield check
    check()


_fresh = itertools.count()


def fresh(prefix: str) -> str:
    """A name no other example used: each example starts from no record."""
    return f"{prefix}-{next(_fresh)}"


def run_twice(call: Callable[[], Any], runs: list[int]) -> tuple[Any, Any] | None:
    """Call twice: ``None`` when the first call is refused (clearly, and before the tool ran), else the
    two outcomes, after checking that the tool ran once and the second call replayed it."""
    try:
        first = call()
    except (OnceOnlyError, TypeError, ValueError) as exc:
        assert_clear(exc)
        assert runs == [], "the tool ran, then the call was refused"
        return None
    second = call()
    assert runs == [1], f"the tool ran {len(runs)} times"
    assert not first.replayed and second.replayed and second.key == first.key
    return first, second


# --- names: tool names, scopes (tasks) and explicit keys ---------------------------------------------


@pytest.mark.parametrize("part", ["tool", "scope", "key"])
def test_hostile_names_are_refused_clearly_or_stored_as_given(
    ledger: Ledger, sentinel: Callable[[], None], part: str
) -> None:
    """A drawn tool name, task scope or explicit key is refused with InvalidKey saying what to change,
    for exactly the names that cannot be one (empty, too long, whitespace, non-printable, no UTF-8
    form), or the call runs once, replays, and its record holds the name as given."""

    runs: list[int] = []
    drawn = [""]

    def _act(n: int) -> dict[str, Any]:
        runs.append(1)
        return {"n": n, "name": drawn[0][:100]}

    @hostile(store_kind(ledger))
    @given(value=NAMES)
    @example(value="")  # name="" was taken as "no name given" and became the function's name
    @example(value="\ud800")
    @example(value="a\x00b")
    @example(value="a#2")
    @example(value="a:b%")
    @example(value="x" * 3_000_000)
    def check(value: str) -> None:
        tool, scope, key = fresh("tool"), fresh("scope"), None
        if part == "tool":
            tool = value
        elif part == "scope":
            scope = value
        else:
            key = value
        runs.clear()
        drawn[0] = value

        def call() -> Any:
            # One definition (the same code and cells) for every example, so that a name drawn twice
            # is the same tool again, not a second function under a name already taken.
            act = ledger.tool(name=tool)(_act)
            with ledger.task(scope):
                return act.using(key=key).outcome(7)

        got = run_twice(call, runs)
        if got is None:
            assert name_refused_rightly(value) or len(f"{scope}:{tool}:{key or 'd' * 32}") > MAX_KEY_LENGTH
            return
        first, second = got
        assert not name_refused_rightly(value)
        assert second.result == first.result == {"n": 7, "name": value[:100]}
        rec = ledger.get(first.key)
        assert rec is not None and (rec.tool, rec.scope) == (tool, scope) and rec.args == {"n": 7}
        assert first.key.endswith(":" + key) if key is not None else True
        listed = ledger.list(tool=tool, scope=scope)
        assert [r.key for r in listed] == [first.key]
        sentinel()

    check()


@pytest.mark.parametrize("field", ["tool", "scope", "after", "key"])
def test_lookups_with_hostile_names_are_refused_clearly_or_find_nothing(
    ledger: Ledger, sentinel: Callable[[], None], field: str
) -> None:
    """``ledger.get`` and ``ledger.list`` with a drawn name (what a person types at the CLI or a
    dashboard sends): a clear InvalidKey for one no record can have, else what matches (nothing here);
    never a driver's error or a ``UnicodeEncodeError``, and no other record touched."""

    @hostile(store_kind(ledger))
    @given(value=st.one_of(NAMES, st.sampled_from([5, 2.5, b"bytes", None])))
    @example(value="\x00")
    @example(value="\ud800")
    @example(value=5)
    def check(value: Any) -> None:
        try:
            found = ledger.get(value) if field == "key" else ledger.list(**{field: value})
        except (OnceOnlyError, TypeError, ValueError) as exc:
            assert_clear(exc)
            return
        if field == "after" or value is None:  # None: no filter
            assert all(r.key > value for r in found) if value is not None else True
        else:
            assert not found
        sentinel()

    check()


# --- arguments and results ----------------------------------------------------------------------------


def _json_form(value: Any) -> Any:
    """``value`` as JSON gives it back. (Compared as values: the canonical text of a mapping with keys
    that are not str sorts them as Python does, before they become text, so the text is no test.)"""
    return json.loads(canonical_json(value, path="result"))


@pytest.fixture(name="echo")
def fixture_echo(ledger: Ledger) -> tuple[Callable[..., Any], list[int]]:
    """A guarded ``echo(x)`` that returns its argument, and the list of its runs."""
    runs: list[int] = []

    @ledger.tool(name="echo")
    def echo(x: Any) -> Any:
        runs.append(1)
        return x

    return echo, runs


def test_hostile_arguments_are_refused_clearly_or_run_once(
    ledger: Ledger, sentinel: Callable[[], None], echo: tuple[Callable[..., Any], list[int]]
) -> None:
    """A drawn argument (which the tool returns as its result) is refused with NotSerializable naming
    the field and the fix, before anything runs; or the call runs once, a replay returns the result's
    JSON form, and the stored arguments decode to the canonical JSON of the call."""
    tool, runs = echo

    @hostile(store_kind(ledger))
    @given(value=VALUES)
    @example(value={1: "a", "b": 2})  # keys that cannot be sorted
    @example(value={math.nan: 1})
    @example(value=-0.0)
    @example(value="\x00\u202e\ud800")
    def check(value: Any) -> None:
        runs.clear()
        with ledger.task(fresh("args")):
            got = run_twice(lambda: tool.outcome(value), runs)
        if got is None:
            return
        first, second = got
        assert first.result is value
        assert _json_form(second.result) == _json_form(value)
        rec = ledger.get(first.key)
        assert rec is not None and rec.args == _json_form({"x": value})
        sentinel()

    check()


@pytest.mark.parametrize("name", sorted(HUGE))
def test_huge_and_deep_arguments_are_refused_clearly_or_run_once(
    ledger: Ledger, sentinel: Callable[[], None], echo: tuple[Callable[..., Any], list[int]], name: str
) -> None:
    """Values no strategy draws quickly (100 000 levels deep, megabytes of text, 200 000 items): refused
    clearly before anything runs, or run once and replayed, on each store."""
    tool, runs = echo
    value = HUGE[name]
    with ledger.task(fresh("huge")):
        got = run_twice(lambda: tool.outcome(value), runs)
    if got is not None:
        assert _json_form(got[1].result) == _json_form(value)
    sentinel()


def test_hostile_results_are_stored_as_json_or_described(ledger: Ledger, sentinel: Callable[[], None]) -> None:
    """A tool that returns a drawn value: the call runs once and a replay gives the result's JSON form,
    or, for a result with no JSON form, the description the ledger records instead (the side effect
    happened, so the record is kept), never an exception."""
    result: list[Any] = [None]
    runs: list[int] = []

    @ledger.tool(name="give")
    def give(n: int) -> Any:
        runs.append(1)
        return result[0]

    @hostile(store_kind(ledger))
    @given(value=VALUES)
    @example(value={1, 2})
    @example(value=nested(5_000))
    @example(value=math.inf)
    def check(value: Any) -> None:
        result[0] = value
        runs.clear()
        with ledger.task(fresh("results")):
            first = give.outcome(1)
            second = give.outcome(1)
        assert runs == [1] and first.result is value and second.replayed
        try:
            expected = _json_form(value)
        except NotSerializable:
            assert isinstance(second.result, dict) and set(second.result) == {"$unserializable", "repr"}
        else:
            assert _json_form(second.result) == expected
        sentinel()

    check()


def test_scopes_keys_and_tools_that_differ_only_in_encoding_are_separate(ledger: Ledger) -> None:
    """Names that look alike (NFC and NFD forms, ``a:b`` as a scope or as part of the tool name, ``%``
    and its encoding) give different keys, so one never replays the other's result."""
    seen: dict[str, str] = {}
    now = [""]

    def named(n: int) -> str:  # one definition, so that a tool name met twice is the same tool
        return now[0]

    for scope, tool in [("a", "b:c"), ("a:b", "c"), ("a%3Ab", "c"), ("\u00c5", "t"), ("A\u030a", "t"), ("x", "a#2")]:
        now[0] = f"{scope}|{tool}"
        with ledger.task(scope):
            out = ledger.tool(name=tool)(named).outcome(1)
        assert out.key not in seen, f"{scope}|{tool} shares a key with {seen.get(out.key)}"
        seen[out.key] = f"{scope}|{tool}"
        assert out.result == f"{scope}|{tool}"


def _at_depth(frames: int, fn: Callable[[], Any]) -> Any:
    """``fn()`` called ``frames`` Python frames deeper than here (a call made inside a framework)."""
    return fn() if frames == 0 else _at_depth(frames - 1, fn)


@pytest.mark.parametrize("deeper", [0, 150])
def test_a_result_nested_near_the_recursion_limit_is_replayed_from_a_deeper_stack(
    ledger: Ledger, sentinel: Callable[[], None], deeper: int
) -> None:
    """A result as deep as the JSON encoder takes from here: JSON is read back one recursion per level,
    so a record written from a shallow stack and replayed from a deeper one (a framework's) would raise
    RecursionError on every replay. It is recorded as a description instead, and replays anywhere."""
    depth = sys.getrecursionlimit()
    while True:  # the deepest value the encoder takes at this stack depth
        try:
            json.dumps(nested(depth))
            break
        except RecursionError:
            depth -= 10
    runs: list[int] = []

    @ledger.tool(name="deep")
    def deep() -> Any:
        runs.append(1)
        return nested(depth)

    first = deep.outcome()
    second = _at_depth(deeper, deep.outcome)
    assert runs == [1] and second.replayed and first.result == nested(depth)
    assert isinstance(second.result, dict) and second.result["$unserializable"] == "list"
    rec = ledger.get(first.key)
    assert rec is not None and _at_depth(deeper, lambda: rec.to_dict())["result"] == second.result


@pytest.mark.parametrize(
    "value",
    [[10**5000], {10**5000: "a"}, {1: "a", "b": 2}, nested(5_000), {"k": {1, 2}}],
    ids=["int-past-the-digit-limit", "int-key-past-the-digit-limit", "mixed-keys", "too-deep", "set"],
)
def test_results_with_no_json_text_are_described(ledger: Ledger, sentinel: Callable[[], None], value: Any) -> None:
    """A result the tool returned after its side effect, which has no JSON text: the record is confirmed
    with a description of it (never an exception from the encoder, which would leave the side effect
    unrecorded), and the replay gives that description."""
    runs: list[int] = []

    @ledger.tool(name="odd")
    def odd() -> Any:
        runs.append(1)
        return value

    first = odd.outcome()
    second = odd.outcome()
    assert runs == [1] and first.result is value and second.replayed
    assert set(second.result) == {"$unserializable", "repr"}
