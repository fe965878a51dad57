"""Fault injection for the ticket service: what goes wrong around a ticket's commit, on purpose.

One uniform draw per ``POST /tickets`` from a seeded RNG picks at most one fault:

- ``fail``: the handler fails before its commit: 503, no ticket (and the key is released).
- ``crash``: the process dies (``os._exit``) after the ticket's INSERT, before the commit.
- ``crash_after_commit``: the process dies after the commit, before the response.
- ``lost``: the answer is lost after the commit: the connection is reset, the client gets no response.
- ``delay``: the answer is held ``delay_seconds`` after the commit (past a client's timeout).

``lost`` and ``delay`` are applied by ``FaultMiddleware``, outside the idempotency middleware: the
server did all its work, stored the response, and only the network lost or slowed the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from onceonly.server._http import ASGIApp, Message, Receive, Scope, Send

__all__ = ["ABORT_KEY", "FAULT_KEY", "KINDS", "FaultInjector", "FaultMiddleware", "Faults", "abort_transport"]

#: The fault kinds, in the order their probabilities are stacked on the one draw.
KINDS = ("fail", "crash", "crash_after_commit", "lost", "delay")
#: The ASGI scope key holding the fault drawn for this request (read by the handler).
FAULT_KEY = "onceonly.fault"
#: The ASGI scope key of a callable that resets the connection (set by the ticket server's protocol).
ABORT_KEY = "onceonly.abort"
#: The exit status of a process stopped by a ``crash`` fault.
CRASH_EXIT_CODE = 75
#: The longest ``delay_seconds``: a held answer past this is a stuck server, not a slow one.
MAX_DELAY_SECONDS = 600.0


@dataclass(frozen=True, slots=True)
class Faults:
    """Probabilities (0 to 1, summing to at most 1) of each fault per ``POST /tickets``.

    Attributes:
        seed: seeds the RNG: the same seed and the same order of requests give the same faults.
        delay_seconds: how long ``delay`` holds an answer.

    Validated by ``__post_init__``, so also where pydantic builds one (``PUT /admin/faults`` takes it
    as its body): a bad value there is a 422, and unknown names are refused.

    .. versionadded:: 0.1
    """

    # Read by pydantic (no import needed here): unknown settings are an error, not ignored.
    __pydantic_config__: ClassVar[dict[str, Any]] = {"extra": "forbid"}

    fail: float = 0.0
    crash: float = 0.0
    crash_after_commit: float = 0.0
    lost: float = 0.0
    delay: float = 0.0
    delay_seconds: float = 3.0
    seed: int | None = None

    def __post_init__(self) -> None:
        total = 0.0
        for kind in KINDS:
            p = getattr(self, kind)
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"fault {kind}={p}: a probability is between 0 and 1")
            total += p
        if total > 1.0 + 1e-9:
            raise ValueError(f"the fault probabilities add up to {total:g}: at most 1 (one fault per request)")
        if not 0 <= self.delay_seconds <= MAX_DELAY_SECONDS:
            raise ValueError(f"delay_seconds={self.delay_seconds}: between 0 and {MAX_DELAY_SECONDS:g} seconds")

    @classmethod
    def parse(cls, specs: Iterable[str], *, seed: int | None = None, delay_seconds: float = 3.0) -> Faults:
        """``["lost=0.2", "delay=0.1"]`` (the CLI's ``--fault KIND=P``) → ``Faults``."""
        values: dict[str, Any] = {"seed": seed, "delay_seconds": delay_seconds}
        for spec in specs:
            kind, sep, p = spec.partition("=")
            kind = kind.strip().replace("-", "_")
            if not sep or kind not in KINDS:
                raise ValueError(f"--fault {spec!r}: use KIND=P with KIND one of {', '.join(KINDS)}")
            try:
                values[kind] = float(p)
            except ValueError:
                raise ValueError(f"--fault {spec!r}: P must be a number between 0 and 1") from None
        return cls(**values)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Faults:
        """A ``Faults`` from a dict such as ``{"lost": 0.2, "seed": 7}`` (names may use ``-``)."""
        known = {f.name for f in fields(cls)}
        values = {k.replace("-", "_"): v for k, v in data.items()}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown fault settings {unknown}: use {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class FaultInjector:
    """Draws the fault of each request from ``Faults`` with its seeded RNG; counts what it injected.

    Thread-safe: draws come from the event loop, ``configure`` from anywhere.

    .. versionadded:: 0.1
    """

    def __init__(self, faults: Faults | None = None) -> None:
        self._lock = threading.Lock()
        self.faults = faults or Faults()
        self._rng = random.Random(self.faults.seed)
        self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)
        self.requests = 0

    def configure(self, faults: Faults) -> None:
        """New probabilities; the RNG restarts from the new seed and the counts from zero."""
        with self._lock:
            self.faults = faults
            self._rng = random.Random(faults.seed)
            self.counts = dict.fromkeys(KINDS, 0)
            self.requests = 0

    def draw(self) -> str | None:
        """The fault of the next request, or ``None``."""
        with self._lock:
            self.requests += 1
            u = self._rng.random()
            edge = 0.0
            for kind in KINDS:
                edge += getattr(self.faults, kind)
                if u < edge:
                    self.counts[kind] += 1
                    return kind
            return None

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"faults": self.faults.to_dict(), "injected": dict(self.counts), "requests": self.requests}


def abort_transport(transport: asyncio.Transport) -> None:
    """Close a TCP connection with a reset (SO_LINGER 0): the peer sees ECONNRESET, no response."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # a socket already closed
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class FaultMiddleware:
    """Applies the drawn fault to ``POST /tickets``: marks ``fail``/``crash`` for the handler, and
    loses or delays the answer of ``lost``/``delay`` after the whole application has run.

    .. versionadded:: 0.1
    """

    def __init__(self, app: ASGIApp, injector: FaultInjector, *, path: str = "/tickets") -> None:
        self.app = app
        self.injector = injector
        self.path = path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != self.path:
            await self.app(scope, receive, send)
            return
        kind = self.injector.draw()
        if kind is None:
            await self.app(scope, receive, send)
            return
        scope[FAULT_KEY] = kind
        if kind not in ("lost", "delay"):
            await self.app(scope, receive, send)
            return
        held: list[Message] = []

        async def hold(message: Message) -> None:
            held.append(message)

        await self.app(scope, receive, hold)
        if kind == "delay":
            await asyncio.sleep(self.injector.faults.delay_seconds)
            for message in held:
                await send(message)
            return
        abort = scope.get(ABORT_KEY)
        if callable(abort):
            abort()
            await asyncio.sleep(0)  # let the server see the connection go before the app returns
            return
        # Not under the ticket server's protocol: start the response and break it off, so the client
        # still gets no usable answer (the server closes the connection mid-response).
        if held:
            await send(held[0])
        raise ConnectionAbortedError("fault 'lost': the answer was dropped after the commit")
