"""Keys: canonical JSON, fingerprints, validation, normalisers."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import decimal
import enum
import uuid

import pydantic
import pytest

from onceonly import InvalidKey, NotSerializable
from onceonly.keys import (
    canonical_json,
    compose_key,
    fingerprint,
    normalize_number,
    normalize_text,
    normalize_whitespace,
    validate_name,
)


class Color(enum.Enum):
    RED = "red"


@dataclasses.dataclass
class Item:
    sku: str
    qty: int


class Order(pydantic.BaseModel):
    id: int
    items: list[str]


def test_sorted_compact_utf8() -> None:
    """Keys are sorted at every depth, no spaces, non-ASCII kept as is."""
    assert canonical_json({"b": 1, "a": {"d": [1, 2], "c": "é"}}) == '{"a":{"c":"é","d":[1,2]},"b":1}'


def test_same_value_same_text_whatever_the_order() -> None:
    """Insertion order does not change the fingerprint."""
    assert fingerprint(canonical_json({"x": 1, "y": 2})) == fingerprint(canonical_json({"y": 2, "x": 1}))


def test_known_types() -> None:
    """Dataclasses, pydantic models, datetime, date, UUID, Decimal, Enum, bytes and tuples encode."""
    value = {
        "item": Item("a", 2),
        "order": Order(id=1, items=["x"]),
        "when": dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC),
        "day": dt.date(2026, 1, 2),
        "id": uuid.UUID(int=1),
        "price": decimal.Decimal("1.50"),
        "color": Color.RED,
        "raw": b"\x00\xff",
        "pair": (1, 2),
    }
    text = canonical_json(value)
    assert '"item":{"qty":2,"sku":"a"}' in text
    assert '"order":{"id":1,"items":["x"]}' in text
    assert '"when":"2026-01-02T03:04:05+00:00"' in text
    assert '"day":"2026-01-02"' in text
    assert '"id":"00000000-0000-0000-0000-000000000001"' in text
    assert '"price":"1.50"' in text
    assert '"color":"red"' in text
    assert '"raw":{"$bytes":"AP8="}' in text
    assert '"pair":[1,2]' in text


def test_unknown_type_names_the_field() -> None:
    """Anything else is a TypeError that names the field and says what to do."""
    with pytest.raises(NotSerializable) as info:
        canonical_json({"order": {"items": [1, object()]}})
    assert info.value.path == "args.order.items[1]"
    assert isinstance(info.value, TypeError)
    assert "ignore=" in str(info.value)


def test_nan_and_non_str_keys_are_refused() -> None:
    """NaN has no JSON form; mapping keys must be strings."""
    with pytest.raises(NotSerializable, match="NaN"):
        canonical_json({"x": float("nan")})
    with pytest.raises(NotSerializable, match="keys must be str"):
        canonical_json({"x": {(1, 2): "a"}})


def test_cycle_is_refused() -> None:
    """A structure that contains itself is a clear error, not a hang."""
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(NotSerializable, match="cycle"):
        canonical_json({"x": loop})


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("", "empty"),
        ("a b", "whitespace"),
        ("a\tb", "whitespace"),
        ("a\x00b", "non-printable"),
        ("x" * 256, "256 characters"),
        (7, "must be a str"),
    ],
)
def test_validate_name_says_what_to_change(value: object, fragment: str) -> None:
    """Bad names are refused with the reason."""
    with pytest.raises(InvalidKey, match=fragment):
        validate_name(value, "key")


def test_validate_name_accepts_unicode_and_punctuation() -> None:
    """Printable unicode and punctuation are fine."""
    assert validate_name("tâche-42:{x}*?") == "tâche-42:{x}*?"


def test_compose_key_limit() -> None:
    """The composed key obeys the same 255 limit and says which part to shorten."""
    assert compose_key("s", "t", "d") == "s:t:d"
    with pytest.raises(InvalidKey, match="shorten the scope"):
        compose_key("s" * 200, "t" * 50, "d" * 32)


def test_normalisers() -> None:
    """Opt-in normalisers fold model noise."""
    assert normalize_whitespace("  a \n b ") == "a b"
    assert normalize_text("Printer  ON fire") == normalize_text("printer on fire")
    assert normalize_number(1) == normalize_number(1.0) == normalize_number("1.00") == "1"
    assert normalize_number("abc") == "abc"
    assert normalize_number(True) is True


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (("a", "b:c", "d"), ("a:b", "c", "d")),
        (("a", "b%3Ac", "d"), ("a", "b:c", "d")),
        (("a%", "b", "d"), ("a%25", "b", "d")),
        (("thread:1", "send", "d"), ("thread", "1:send", "d")),
    ],
)
def test_compose_key_never_joins_two_different_calls_into_one_key(
    first: tuple[str, str, str], second: tuple[str, str, str]
) -> None:
    """Scope ``a`` + tool ``b:c`` and scope ``a:b`` + tool ``c`` were both ``a:b:c:d``: one record for
    two operations. The parts are percent-encoded (``%`` and ``:``), so each key has one reading."""
    assert compose_key(*first) != compose_key(*second)


def test_compose_key_keeps_plain_parts_as_they_are_and_encodes_the_rest() -> None:
    """Scopes and tool names without ``:`` or ``%`` give the keys they always gave; a LangGraph thread id
    such as ``user:42:thread:7`` is accepted and encoded, not refused."""
    assert compose_key("default", "create_ticket", "ab12") == "default:create_ticket:ab12"
    assert compose_key("user:42:thread:7", "send", "ab12") == "user%3A42%3Athread%3A7:send:ab12"
    assert compose_key("50%", "a:b", "x:y") == "50%25:a%3Ab:x:y"  # the digest is the last part: kept
    scope, tool, digest = compose_key("user:42", "a%b:c", "x:y").split(":", 2)
    assert (scope, tool, digest) == ("user%3A42", "a%25b%3Ac", "x:y")


def test_compose_key_limit_counts_the_encoded_key() -> None:
    """The 255 limit is on the key as stored: an encoded scope that grows past it is refused."""
    with pytest.raises(InvalidKey, match="shorten the scope"):
        compose_key(":" * 80, "t", "d" * 32)  # 80 characters, 240 once encoded


def test_the_mcp_guard_measures_a_clients_key_against_the_encoded_key() -> None:
    """The MCP guard checks that a client's own key fits beside its scope and tool name. Counting the
    scope unencoded let a key through that the ledger then refused (a scope full of ``:`` grows three
    times once encoded): the client now gets its BadRequest up front, with the room that is left."""
    from onceonly.mcp.core import META_KEY, BadRequest, Guard, Hints, Request, Transport

    async def never() -> None:
        raise AssertionError("not called")

    guard = Guard(object(), scope="s:" * 40, single_tenant=True)  # type: ignore[arg-type]  # 80 chars, 160 encoded
    req = Request(name="t", arguments={}, meta={META_KEY: "k" * 170}, transport=Transport(), hints=Hints(),
                  call=never, to_wire=dict)  # fmt: skip
    with pytest.raises(BadRequest, match="the limit is 92"):
        asyncio.run(guard.scope_and_key(req, "server"))
    req.meta = {META_KEY: "k" * 92}
    scope, key = asyncio.run(guard.scope_and_key(req, "server"))
    assert key is not None and len(compose_key(scope, "t", key)) == 255


def test_safe_name_keeps_a_valid_name_and_hashes_any_other() -> None:
    """A conversation id that is a valid name is the scope itself; one with whitespace, control
    characters or too long becomes a stable hash with the given prefix."""
    from onceonly.keys import safe_name, validate_name

    assert safe_name("user:42/thread-7") == "user:42/thread-7"
    for raw in ("two words", "tab\there", "x" * 101, "", "bell\x07"):
        hashed = safe_name(raw, prefix="thread-")
        assert hashed.startswith("thread-") and hashed == safe_name(raw, prefix="thread-")
        assert validate_name(hashed) == hashed
    assert safe_name("a" * 101) != safe_name("a" * 102)
