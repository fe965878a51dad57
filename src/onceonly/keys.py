"""Keys: canonical JSON of arguments, their SHA-256 fingerprint, and key validation. Pure, no I/O.

A key is ``scope:tool:digest`` (``compose_key``, which percent-encodes the scope and the tool name):
re-derivable from the same call after a crash, with no cache. The digest hashes the ``key=`` fields
(default: all arguments but the ``ignore=`` ones); the fingerprint hashes all of them, so the same key
with other arguments is detected as a ``KeyConflict``.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime as _dt
import decimal
import enum
import hashlib
import itertools
import json
import math
import re
import sys
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from onceonly.errors import InvalidKey, NotSerializable

__all__ = [
    "KEY_PATTERN",
    "MAX_DEPTH",
    "MAX_KEY_LENGTH",
    "canonical_json",
    "compose_key",
    "fingerprint",
    "is_wire_key",
    "normalize_number",
    "normalize_text",
    "normalize_whitespace",
    "safe_name",
    "validate_name",
]

MAX_KEY_LENGTH = 255

# Printable (so unicode letters are fine), no whitespace of any kind. `isprintable()` already rejects
# control characters, line and paragraph separators.
_WHITESPACE = re.compile(r"\s")


def validate_name(value: object, what: str = "key") -> str:
    """Check a key, scope or tool name, and return it.

    Raises:
        InvalidKey: empty, longer than 255 characters, whitespace or non-printable characters.

    .. versionadded:: 0.1
    """
    if not isinstance(value, str):
        raise InvalidKey(
            f"the {what} must be a str, got {type(value).__name__}: {_shown(value)[:80]}; give it as text, "
            "such as 'order-42'"
        )
    if not value:
        raise InvalidKey(f"the {what} is empty: give a non-empty name such as 'order-42'")
    if len(value) > MAX_KEY_LENGTH:
        raise InvalidKey(
            f"the {what} {value[:40]!r}... is {len(value)} characters; the limit is {MAX_KEY_LENGTH}: "
            f"shorten it, or pass a hash of it"
        )
    bad = _WHITESPACE.search(value)
    if bad is not None:
        raise InvalidKey(
            f"the {what} {value!r} has whitespace at position {bad.start()}: "
            f"use '-' or '_' instead of spaces, tabs or newlines"
        )
    if not value.isprintable():
        pos = next(i for i, ch in enumerate(value) if not ch.isprintable())
        raise InvalidKey(
            f"the {what} {value!r} has a non-printable character {value[pos]!r} at position {pos}: remove it"
        )
    return value


def _key_part(name: str) -> str:
    """A scope or tool name as a key part: ``%`` and ``:`` percent-encoded, everything else as it is."""
    return name.replace("%", "%25").replace(":", "%3A")


def safe_name(value: str, *, limit: int = 100, prefix: str = "h-") -> str:
    """``value`` as a scope or name when it is one (printable, no whitespace, at most ``limit``
    characters), else ``prefix`` and a SHA-256 of it: a conversation id from a framework (a thread id,
    a group id, an MCP session) becomes a valid, stable scope whatever it holds.

    .. versionadded:: 0.1
    """
    if len(value) <= limit and value and value.isprintable() and _WHITESPACE.search(value) is None:
        return value
    return prefix + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def compose_key(scope: str, tool: str, digest: str) -> str:
    """The ledger key of a call: ``scope:tool:digest``, with ``%`` and ``:`` percent-encoded in the scope
    and the tool name, so that every key has exactly one reading (scope ``a`` with tool ``b:c`` and scope
    ``a:b`` with tool ``c`` are two keys). Scopes come from conversation ids that may hold ``:``, so the
    separator is encoded rather than refused. The digest (or an explicit key) is the last part and is
    kept as it is. Names without ``%`` or ``:`` give the same key as they always did.

    Raises:
        InvalidKey: the key is longer than 255 characters; the message says which part to shorten.

    .. versionadded:: 0.1
    """
    # Inline checks rather than a helper call per part: this runs on every guarded call.
    part_scope = _key_part(scope) if "%" in scope or ":" in scope else scope
    part_tool = _key_part(tool) if "%" in tool or ":" in tool else tool
    key = f"{part_scope}:{part_tool}:{digest}"
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKey(
            f"the key {key[:60]!r}... is {len(key)} characters; the limit is {MAX_KEY_LENGTH}: "
            f"shorten the scope ({len(scope)} chars), the tool name ({len(tool)}) or the explicit key"
        )
    return key


def _default(value: Any) -> Any:
    """`json.dumps` hook for the types the canonical form knows beyond plain JSON."""
    # Enum before the str/int checks inside json: StrEnum/IntEnum never reach here anyway.
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump) and hasattr(type(value), "model_fields"):
        return model_dump(mode="json")
    if isinstance(value, _dt.datetime):
        return value.isoformat()
    if isinstance(value, _dt.date | _dt.time):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, decimal.Decimal):
        if not value.is_finite():
            raise ValueError("non-finite Decimal")
        return str(value)
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    raise TypeError(type(value).__name__)


def _make_encoder() -> Callable[[Any], str]:
    # json.dumps() with options builds a JSONEncoder, and JSONEncoder.encode a C encoder, on every
    # call: ~3 µs for a small dict, twice per guarded call. Build the C encoder once (~1 µs a call).
    # No circular-reference markers: a cycle ends in RecursionError, reported like any other refusal.
    c_make = getattr(json.encoder, "c_make_encoder", None)
    if c_make is None:  # pragma: no cover - Pythons without the C accelerator
        return json.JSONEncoder(
            sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False, default=_default
        ).encode
    make = c_make(None, _default, json.encoder.encode_basestring, None, ":", ",", True, False, False)

    def encode(value: Any) -> str:
        return "".join(make(value, 0))

    return encode


_encode = _make_encoder()

_KNOWN = "dict, list, tuple, str, int, float, bool, None, dataclasses, pydantic models, datetime, date, "
_KNOWN += "time, UUID, Decimal, Enum and bytes"


def _lone_surrogate(text: str) -> str | None:
    """Why ``text`` has no UTF-8 form (a lone surrogate, as bytes decoded with ``surrogateescape`` leave
    behind), or None when it has one."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"it holds a lone surrogate {text[exc.start]!r} at position {exc.start}, which has no UTF-8 "
            "form (bytes decoded with errors='surrogateescape'?); decode them with errors='replace', "
            "or pass the bytes themselves"
        )
    return None


def _shown(value: Any) -> str:
    """``repr(value)``, or its type when it has none that prints (an int past Python's digit limit)."""
    try:
        return repr(value)
    except Exception:
        return f"<{type(value).__name__}>"


def _scalar_problem(value: Any) -> str | None:
    """Why a str, int or float (a value or a mapping key) has no JSON form, or None when it has one."""
    if isinstance(value, str):
        return _lone_surrogate(value)
    if isinstance(value, float):
        return None if math.isfinite(value) else "NaN and infinity have no JSON form"
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            int.__repr__(value)
        except ValueError:
            return (
                f"an int of more than {sys.get_int_max_str_digits()} digits has no text form in Python "
                "(sys.set_int_max_str_digits); pass it as a str"
            )
    return None


def _find_bad(value: Any, path: str) -> tuple[str, Any, str] | None:
    """Walk a value the fast encoder refused and name the first field it cannot encode (slow path)."""
    if value is None or isinstance(value, str | int | float):
        why = _scalar_problem(value)
        return None if why is None else (path, value, why)
    if isinstance(value, Mapping):
        for k, v in value.items():
            where = f"{path}[{_shown(k)}]"
            if not isinstance(k, str | int | float | bool) and k is not None:
                return (where, k, f"mapping keys must be str (or int), got {type(k).__name__}")
            if (why := _scalar_problem(k)) is not None:
                return (where, k, why)
            found = _find_bad(v, f"{path}.{k}" if isinstance(k, str) else where)
            if found:
                return found
        try:
            sorted(value)
        except TypeError:
            kinds = " and ".join(sorted({type(k).__name__ for k in value}))
            return (path, value, f"its keys mix {kinds}, which have no one sorted order: make them all str")
        return None
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            found = _find_bad(v, f"{path}[{i}]")
            if found:
                return found
        return None
    try:
        inner = _default(value)
    except (TypeError, ValueError):
        return (path, value, f"{type(value).__name__} has no canonical JSON form; onceonly encodes {_KNOWN}")
    return _find_bad(inner, path)


def canonical_json(value: Any, *, path: str = "args") -> str:
    """The canonical JSON text of a value: sorted keys, no spaces, UTF-8, no NaN.

    Raises:
        NotSerializable: a field has no canonical form; the message names the field and the fix.

    .. versionadded:: 0.1
    """
    try:
        text = _encode(value)
        if not text.isascii():
            text.encode("utf-8")  # the stores hold UTF-8: a lone surrogate must fail here, not in a store
    except RecursionError as exc:
        where = _deep_field(value, path)
        raise NotSerializable(
            f"{_cannot(where)}: it refers to itself (a cycle) or nests too deeply. {_fix(where, 'Flatten it')}",
            path=where,
            value=value,
        ) from exc
    except (TypeError, ValueError) as exc:  # UnicodeEncodeError is a ValueError
        try:
            found = _find_bad(value, path)
        except RecursionError:  # deep enough to pass the encoder, not this walk: name no field
            found = None
        where, bad, why = found if found else (path, value, str(exc))
        raise NotSerializable(
            f"{_cannot(where)} ({type(bad).__name__}): {why}. {_fix(where, 'Convert it')}",
            path=where,
            value=bad,
        ) from exc
    # The C decoder recurses once per level, so text nested near the recursion limit encodes here but
    # fails to decode in a call made from a deeper stack (a replay inside a framework): refused now,
    # rather than recorded and then unreadable. Only text with that many brackets is measured.
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth(text) > MAX_DEPTH:
        where = _deep_field(value, path, MAX_DEPTH)
        raise NotSerializable(
            f"{_cannot(where)}: it nests more than {MAX_DEPTH} levels deep, more than onceonly records. "
            f"{_fix(where, 'Flatten it')}",
            path=where,
            value=value,
        )
    return text


#: The deepest nesting of lists and objects a canonical JSON text may have.
MAX_DEPTH = 256

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")


def _depth(text: str) -> int:
    """How deep the lists and objects of a JSON text nest (brackets inside strings do not count)."""
    brackets = _NOT_BRACKETS.sub("", _STRINGS.sub("", text))
    return max(itertools.accumulate(1 if c in "[{" else -1 for c in brackets), default=0)


def _deep_field(value: Any, path: str, limit: int | None = None) -> str:
    """The path of the first top-level field of ``value`` (the arguments) that nests too deeply or in a
    cycle, else ``path``: the error path only, so each field is encoded again on its own."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            try:
                if limit is None:
                    _encode(v)
                elif _depth(_encode(v)) <= limit - 1:
                    continue
                else:
                    return f"{path}.{k}"
            except RecursionError:
                return f"{path}.{k}"
            except (TypeError, ValueError):
                continue
    return path


def _cannot(where: str) -> str:
    """The start of a refusal: a key is made from arguments; a result (or a resolution) is stored."""
    shown = where if len(where) <= 120 else f"{where[:60]}...{where[-40:]}"  # a path hundreds of levels deep
    return f"cannot make a key from {shown}" if where.startswith(("args", "key")) else f"cannot store {shown}"


_FIELD = re.compile(r"(?:args|key)\.([^.\[]+)")


def _fix(where: str, first: str) -> str:
    """What to do: ``first``, or leave the top-level field out of the key, when there is one."""
    field = _FIELD.match(where)
    return f"{first}, or leave the field out with ignore=({field.group(1)!r},)" if field else f"{first}."


#: A key as it travels in an ``Idempotency-Key`` header, unquoted: 1-255 visible ASCII characters
#: (VCHAR: no space, no control). The middleware, the HTTP client and the ticket service's OpenAPI share it.
KEY_PATTERN = f"[!-~]{{1,{MAX_KEY_LENGTH}}}"
_WIRE_KEY = re.compile(KEY_PATTERN)


def is_wire_key(text: str) -> bool:
    """Whether ``text`` can travel as an idempotency key header as it is (``KEY_PATTERN``).

    .. versionadded:: 0.1
    """
    return _WIRE_KEY.fullmatch(text) is not None


def fingerprint(canonical: str) -> str:
    """SHA-256 hex digest of a canonical JSON text.

    .. versionadded:: 0.1
    """
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def select(args: Mapping[str, Any], fields: Iterable[str]) -> dict[str, Any]:
    """The named fields of ``args``; a missing one is a clear error, not a silent other key."""
    out = {}
    for name in fields:
        if name not in args:
            raise InvalidKey(f"key field {name!r} is not an argument of this tool; its arguments are {sorted(args)}")
        out[name] = args[name]
    return out


# --- opt-in normalisers for model noise, applied to chosen fields before hashing -------------------


def normalize_whitespace(value: Any) -> Any:
    """Collapse runs of whitespace and strip the ends of a string. Other values pass through."""
    return " ".join(value.split()) if isinstance(value, str) else value


def normalize_text(value: Any) -> Any:
    """Whitespace collapsed and case folded: 'Printer  broken' == 'printer broken'."""
    return normalize_whitespace(value).casefold() if isinstance(value, str) else value


def normalize_number(value: Any) -> Any:
    """Numbers and numeric strings in one form: 1, 1.0, '1.00' all become '1'."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float | decimal.Decimal | str):
        try:
            d = decimal.Decimal(str(value).strip())
        except decimal.InvalidOperation:
            return value
        if d.is_finite():
            return format(d.normalize(), "f")
    return value


Normalizer = Callable[[Any], Any]
