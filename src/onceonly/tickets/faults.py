"""Fault injection for the ticket service: what goes wrong around a ticket's commit, on purpose.

One uniform draw per ``POST /tickets`` picks at most one fault. The draw is a hash of the seed, the
request (who sends it: its ``Authorization`` header; what it asks: its body) and how many times that
same request came before: so a retry meets its own faults, the nth time, and the same requests meet
the same faults in every run, whatever order their threads happen to send them in (``FaultInjector``).

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
import hashlib
import secrets
import socket
import struct
import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from onceonly.server._http import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "ABORT_KEY",
    "FAULT_KEY",
    "KINDS",
    "FaultInjector",
    "FaultMiddleware",
    "Faults",
    "abort_transport",
    "request_identity",
    "uniform",
]

#: The fault kinds, in the order their probabilities are stacked on the one draw. A new kind goes at
#: the end (and gets its field in ``Faults``): the kinds before it keep the same requests.
KINDS = ("fail", "crash", "crash_after_commit", "lost", "delay")
#: The ASGI scope key holding the fault drawn for this request (read by the handler).
FAULT_KEY = "onceonly.fault"
#: The ASGI scope key of a callable that resets the connection (set by the ticket server's protocol).
ABORT_KEY = "onceonly.abort"
#: The exit status of a process stopped by a ``crash`` fault.
CRASH_EXIT_CODE = 75
#: The longest ``delay_seconds``: a held answer past this is a stuck server, not a slow one.
MAX_DELAY_SECONDS = 600.0
#: How many distinct requests the injector counts the repeats of; past it, the oldest is forgotten
#: (its next repeat counts as a first time), so that a long-running service stays in bounded memory.
REMEMBERED_REQUESTS = 100_000
#: The bytes of a body that name its request (a ticket is far smaller): a huge body is not held.
MAX_IDENTITY_BODY = 64 * 1024


def uniform(seed: int, *parts: object) -> float:
    """A uniform draw in [0, 1) that is a pure function of ``seed`` and ``parts``.

    A named draw instead of the next number of a shared generator: a decision keeps its value
    whatever other decisions are drawn, and in whatever order threads ask for them. The fault
    injector and the demo's workload draw this way.

    .. versionadded:: 0.1
    """
    text = "\x1f".join(map(str, (seed, *parts)))
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def request_identity(scope: Scope, body: bytes) -> str:
    """What makes two requests "the same request" for the fault draw: the client (its
    ``Authorization`` header, as the service tells clients apart) and the body, as a digest.

    .. versionadded:: 0.1
    """
    digest = hashlib.blake2b(digest_size=16)
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            digest.update(value)
    digest.update(b"\0")
    digest.update(body)
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class Faults:
    """Probabilities (0 to 1, summing to at most 1) of each fault per ``POST /tickets``.

    Attributes:
        seed: seeds the draws: the same seed and the same requests give the same faults, in any
            order (``None``: a random seed per injector).
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
    """Draws the fault of each request from ``Faults``; counts what it injected.

    The draw of a request is ``uniform(seed, identity, n)``, stacked over ``KINDS``: ``identity``
    names the request (``request_identity``: its client and body) and ``n`` counts how many times
    that identity was drawn for, this one included. A retry of a request is its next repeat, not the
    next number of a shared generator: the faults do not depend on the order in which requests from
    concurrent clients arrive. ``draw()`` without an identity draws for one anonymous request again
    and again: a plain seeded sequence.

    Thread-safe: draws come from the event loop, ``configure`` from anywhere.

    .. versionadded:: 0.1
    """

    def __init__(self, faults: Faults | None = None) -> None:
        self._lock = threading.Lock()
        self.configure(faults or Faults())

    def configure(self, faults: Faults) -> None:
        """New probabilities; the draws restart from the new seed and the counts from zero."""
        with self._lock:
            self.faults = faults
            self._seed = faults.seed if faults.seed is not None else secrets.randbits(64)
            self._seen: dict[str, int] = {}
            self.counts: dict[str, int] = dict.fromkeys(KINDS, 0)
            self.requests = 0

    def draw(self, identity: str = "") -> str | None:
        """The fault of this request (``identity``, see ``request_identity``), or ``None``."""
        with self._lock:
            self.requests += 1
            n = self._seen.pop(identity, 0) + 1
            self._seen[identity] = n  # re-inserted: the most recently seen is forgotten last
            if len(self._seen) > REMEMBERED_REQUESTS:
                del self._seen[next(iter(self._seen))]
            u = uniform(self._seed, identity, n)
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
        # The body names the request for the draw: read it whole now, hand it on to the app unchanged.
        body, receive = await _read_body(receive)
        kind = self.injector.draw(request_identity(scope, body))
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


async def _read_body(receive: Receive) -> tuple[bytes, Receive]:
    """The request's body (its first ``MAX_IDENTITY_BODY`` bytes and a little more), and a ``receive``
    that hands the app the same messages, then the server's own (the rest of a long body, a
    disconnect). The app's own limits still apply: nothing is dropped or joined."""
    held: list[Message] = []
    size = 0
    while size <= MAX_IDENTITY_BODY:
        message = await receive()
        held.append(message)
        if message["type"] != "http.request":  # the client went away: the app sees it next
            break
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = b"".join(m.get("body", b"") for m in held if m["type"] == "http.request")[:MAX_IDENTITY_BODY]

    async def replay() -> Message:
        return held.pop(0) if held else await receive()

    return body, replay
