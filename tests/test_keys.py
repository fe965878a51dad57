"""Keys: canonical JSON, fingerprints, validation, normalisers."""

from __future__ import annotations

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
