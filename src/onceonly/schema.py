"""Arguments in their real form: a tool call's JSON arguments, validated and coerced by the tool's own JSON
Schema before they are fingerprinted.

A model (or a client) sends ``500``, ``"500"`` and ``500.0`` for one integer parameter; the tool sees the
same ``500`` each time (pydantic, which builds the schemas of FastMCP, the MCP SDK and the Agents SDK,
coerces them in its default lax mode), so they are one operation and must have one key. ``coerce``
applies the same rules as pydantic's lax mode for what a JSON Schema can say: ``integer``, ``number``,
``boolean``, ``string``, ``null``, ``array``, ``object`` (``properties``, ``required``, defaults,
``additionalProperties``), ``enum``, ``const``, ``anyOf``/``oneOf``, ``allOf`` of objects, and local
``$ref`` (``#/$defs/…``). What the schema does not constrain is kept as it came.

Pure: no I/O, no framework.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["SchemaError", "coerce"]

_INT_TEXT = re.compile(r"[+-]?\d+")
_TRUE = frozenset({"true", "1", "yes", "on", "t", "y"})
_FALSE = frozenset({"false", "0", "no", "off", "f", "n"})
# How deep references may nest before a schema is taken for a cycle.
_MAX_DEPTH = 64


class SchemaError(ValueError):
    """Arguments the tool's schema refuses. ``path`` names the field (``arguments.items[2].cents``).

    .. versionadded:: 0.1
    """

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (str(self), self.path))


def _rebuild(text: str, path: str) -> SchemaError:
    error = SchemaError.__new__(SchemaError)
    ValueError.__init__(error, text)
    error.path = path
    return error


def coerce(schema: Mapping[str, Any] | None, arguments: Any, *, path: str = "arguments") -> Any:
    """``arguments`` as the tool will see them: validated against ``schema`` and coerced as pydantic's lax
    mode does (``"500"`` and ``500.0`` are the integer ``500``; a missing property with a default gets it).

    Raises:
        SchemaError: the schema refuses them (a missing required property, ``"abc"`` for an integer…);
            the message names the field and what was expected.

    .. versionadded:: 0.1
    """
    if not schema:
        return arguments
    return _Coercer(schema).value(schema, arguments, path, 0)


class _Coercer:
    __slots__ = ("root",)

    def __init__(self, root: Mapping[str, Any]) -> None:
        self.root = root

    def resolve(self, schema: Mapping[str, Any], path: str, depth: int) -> Mapping[str, Any]:
        while "$ref" in schema:
            if depth > _MAX_DEPTH:
                raise SchemaError("the schema's references nest too deep (a cycle?)", path=path)
            ref = schema["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#"):
                return {}  # a remote reference: not followed, the value is kept as it came
            target: Any = self.root
            for raw in filter(None, ref[1:].split("/")):
                part = raw.replace("~1", "/").replace("~0", "~")
                target = target.get(part) if isinstance(target, Mapping) else None
            if not isinstance(target, Mapping):
                return {}
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**target, **rest}
            depth += 1
        return schema

    def value(self, schema: Any, value: Any, path: str, depth: int) -> Any:
        if schema is True or not isinstance(schema, Mapping):
            return value
        schema = self.resolve(schema, path, depth)
        for union in ("anyOf", "oneOf"):
            branches = schema.get(union)
            if isinstance(branches, list) and branches:
                value = self.first_match(branches, value, path, depth + 1)
        if isinstance(schema.get("allOf"), list):
            for part in schema["allOf"]:
                value = self.value(part, value, path, depth + 1)
        types = schema.get("type")
        if types is not None:
            value = self.typed(schema, [types] if isinstance(types, str) else list(types), value, path, depth)
        if "const" in schema and not _same(value, schema["const"]):
            raise SchemaError(f"expected {schema['const']!r}, got {value!r}"[:300], path=path)
        if isinstance(schema.get("enum"), list):
            value = self.member(schema["enum"], value, path)
        return value

    def first_match(self, branches: list[Any], value: Any, path: str, depth: int) -> Any:
        # Exact-type branches first (pydantic's smart mode: "5" stays a string for int | str).
        for strict in (True, False):
            for branch in branches:
                try:
                    made = self.value(branch, value, path, depth)
                except SchemaError:
                    continue
                if not strict or _same(made, value):
                    return made
        raise SchemaError(f"{_shown(value)} matches none of the allowed forms", path=path)

    def member(self, allowed: list[Any], value: Any, path: str) -> Any:
        for option in allowed:
            if _same(value, option):
                return option
        for option in allowed:  # a number sent as text for a numeric enum, as pydantic takes it
            if isinstance(option, int | float) and not isinstance(option, bool) and isinstance(value, str):
                try:
                    if float(value) == option:
                        return option
                except ValueError:
                    continue
        raise SchemaError(f"{_shown(value)} is not one of {allowed!r}"[:300], path=path)

    def typed(self, schema: Mapping[str, Any], types: list[Any], value: Any, path: str, depth: int) -> Any:
        # A value already of one of the types is kept (coercion only when none matches exactly).
        for t in types:
            if _is(t, value):
                return self.inner(schema, t, value, path, depth)
        for t in types:
            made = _convert(t, value)
            if made is not _NO:
                return self.inner(schema, t, made, path, depth)
        names = " or ".join(str(t) for t in types)
        raise SchemaError(f"expected {names}, got {_shown(value)}", path=path)

    def inner(self, schema: Mapping[str, Any], t: str, value: Any, path: str, depth: int) -> Any:
        if t == "object":
            return self.object(schema, value, path, depth)
        if t == "array":
            items = schema.get("items")
            prefix = schema.get("prefixItems")
            out = []
            for i, item in enumerate(value):
                sub = prefix[i] if isinstance(prefix, list) and i < len(prefix) else items
                out.append(self.value(sub, item, f"{path}[{i}]", depth + 1))
            return out
        if t == "number" and isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            return int(value)  # 500.0 and 500 are one number to the tool (a float field takes either)
        return value

    def object(self, schema: Mapping[str, Any], value: Mapping[str, Any], path: str, depth: int) -> dict[str, Any]:
        props = schema.get("properties")
        props = props if isinstance(props, Mapping) else {}
        required = schema.get("required")
        required = required if isinstance(required, list) else []
        extra = schema.get("additionalProperties", True)
        out: dict[str, Any] = {}
        for name, item in value.items():
            where = f"{path}.{name}"
            if name in props:
                out[name] = self.value(props[name], item, where, depth + 1)
            elif extra is False:
                raise SchemaError(f"unexpected property {name!r}: the tool takes {sorted(props)}"[:300], path=path)
            else:
                out[name] = self.value(extra, item, where, depth + 1) if isinstance(extra, Mapping) else item
        for name, sub in props.items():
            if name in out:
                continue
            if isinstance(sub, Mapping) and "default" in sub:
                out[name] = sub["default"]
            elif name in required:
                raise SchemaError(f"the required property {name!r} is missing", path=path)
        return out


class _No:
    pass


_NO: Any = _No()


def _is(t: Any, value: Any) -> bool:
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if t == "boolean":
        return isinstance(value, bool)
    if t == "string":
        return isinstance(value, str)
    if t == "null":
        return value is None
    if t == "array":
        return isinstance(value, list)
    if t == "object":
        return isinstance(value, Mapping)
    return True  # a type this does not know: not constrained here


def _convert(t: Any, value: Any) -> Any:
    """``value`` as JSON type ``t`` by pydantic's lax rules, or ``_NO``."""
    if t == "integer":
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            text = value.strip()
            if _INT_TEXT.fullmatch(text):
                return int(text)
            try:
                number = float(text)
            except ValueError:
                return _NO
            return int(number) if math.isfinite(number) and number.is_integer() else _NO
        return _NO
    if t == "number":
        if isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                return _NO
            return number if math.isfinite(number) else _NO
        return _NO
    if t == "boolean":
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        if isinstance(value, int | float) and not isinstance(value, bool) and value in (0, 1):
            return bool(value)
        return _NO
    if t == "array" and isinstance(value, tuple):
        return list(value)
    return _NO


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON values: ``1`` is not ``True``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return bool(a == b)


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'…' if len(text) > 80 else ''}"
