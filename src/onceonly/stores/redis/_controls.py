"""Operators' control documents (``onceonly.stores.base.ControlStore``): one hash per namespace,
``P:ctl:<namespace>``, a field per document holding its JSON. One key, so one node of a Redis Cluster
serves a whole namespace, read with one ``HGETALL``."""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from onceonly.stores._controls import decode_doc, encode_doc
from onceonly.stores.redis._plans import one

T = TypeVar("T")


def _fields(answer: Any) -> dict[str, Any]:
    """``HGETALL``'s answer as name → stored text: a dict from redis-py's callback, a flat list without it."""
    if isinstance(answer, dict):
        pairs = list(answer.items())
    else:
        items = list(answer or [])
        pairs = list(zip(items[::2], items[1::2], strict=True))
    return {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in pairs}


class Controls:
    """``RedisStore``'s control documents."""

    if TYPE_CHECKING:  # the store's
        prefix: str
        _where: str

        def _run(self, gen: Generator[list[tuple[Any, ...]], list[Any], T], what: str) -> T: ...
        async def _arun(self, gen: Generator[list[tuple[Any, ...]], list[Any], T], what: str) -> T: ...

    def _controls_key(self, namespace: str) -> str:
        return f"{self.prefix}:ctl:{namespace}"

    def _decode_controls(self, answer: Any) -> dict[str, dict[str, Any]]:
        return {name: decode_doc(name, text, self._where) for name, text in _fields(answer).items()}

    def controls(self, namespace: str) -> dict[str, dict[str, Any]]:
        command = ("HGETALL", self._controls_key(namespace))
        return self._decode_controls(self._run(one(command), f"reading the {namespace!r} controls"))

    async def acontrols(self, namespace: str) -> dict[str, dict[str, Any]]:
        command = ("HGETALL", self._controls_key(namespace))
        return self._decode_controls(await self._arun(one(command), f"reading the {namespace!r} controls"))

    def put_control(self, namespace: str, name: str, doc: Mapping[str, Any]) -> None:
        # HSET sets the field to the same text whether it runs once or twice: a re-run after a lost
        # connection (``_run``) writes nothing new.
        command = ("HSET", self._controls_key(namespace), name, encode_doc(namespace, name, doc))
        self._run(one(command), f"writing the control {namespace}/{name}")

    def delete_control(self, namespace: str, name: str) -> bool:
        encode_doc(namespace, name, {})  # the same checks of the names as a write
        gone = self._run(one(("HDEL", self._controls_key(namespace), name)), f"deleting the control {namespace}/{name}")
        return bool(gone)
