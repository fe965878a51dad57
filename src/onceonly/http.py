"""HTTP clients that carry one idempotency key per logical call: ``Client`` and ``AsyncClient`` (httpx).

One logical call (``client.post(...)``) gets one key, sent as ``Idempotency-Key`` on every attempt
(``idempotency_key=``, or that header passed by the caller, names it; else it is made):

    attempt ──2xx/3xx──────────────▶ the response
       │  ├─409 (in progress)──────▶ wait Retry-After (at least a growing floor), same key, again,
       │  │                           for up to ``wait`` seconds of the clock
       │  ├─422 problem on the key─▶ KeyConflict (the key was used with another request)
       │  ├─408/429/503────────────▶ not executed: backoff (at least Retry-After), same key, again
       │  ├─500/502/504, other 5xx─▶ unknown: re-send with the same key (the server replays or runs once)
       │  └─other 4xx──────────────▶ a definite failure: httpx.HTTPStatusError
       ├─connect error / timeout───▶ not sent: backoff, same key, again
       └─read timeout, reset───────▶ unknown: re-send with the same key

Methods outside ``key_methods`` (GET…) carry no key and follow the same rules, except on an unknown
outcome: only the safe methods (``SAFE_METHODS``: GET, HEAD, OPTIONS, TRACE) are sent again then.

Errors are classified by ``onceonly.classify`` (docs/design.md#classifying-a-failed-attempt).
Backoff is exponential with full jitter (``onceonly.Retry``); ``sleep`` is injectable. Inside a
guarded tool the key is the ledger's (``onceonly.current_call().key``; the n-th keyed request of one
attempt, n >= 2, gets ``key#n``), so a retry by the ledger, after a crash or by another process,
sends the same keys; and a tool declared
``reports_dispatch=True`` is marked sent (``pending`` → ``in_flight``) just before a request that
may change something (any method but ``SAFE_METHODS``, keyed or not) is handed to httpx (so before
its DNS lookup and connect: a crash there is treated as possibly sent, the safe side).

Needs the ``http`` extra (httpx). See docs/http.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Generic, TypeVar

import httpx

from onceonly import drivers as _drivers
from onceonly.errors import InProgress, KeyConflict, NotSerializable
from onceonly.keys import canonical_json, is_wire_key
from onceonly.policy import Retry, Verdict, check_seconds, classify, classify_status, retry_after_seconds
from onceonly.states import State

__all__ = ["DEFAULT_RETRY", "SAFE_METHODS", "AsyncClient", "Client", "header_key", "is_replayed"]

#: Four attempts, backoff ceilings 0.5, 1, 2 s (full jitter).
DEFAULT_RETRY = Retry(attempts=4, base=0.5, cap=8.0)
#: Methods that change nothing on the server (RFC 9110 section 9.2.1): re-sending one whose outcome is
#: unknown is safe without a key.
SAFE_METHODS: frozenset[str] = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# The least pause between two asks after a 409, doubled at each 409 of a call up to the cap: a server
# that answers ``Retry-After: 0`` (or a date in the past) must not turn the wait into a busy loop.
_BUSY_FLOOR = 0.05
_BUSY_FLOOR_CAP = 1.0


def header_key(key: str) -> str:
    """A key as it can travel in the header: itself if 1-255 visible ASCII, else ``sha256:HEX`` of it.

    Ledger keys may hold non-ASCII scope names; the hash keeps them stable and valid.

    .. versionadded:: 0.1
    """
    if is_wire_key(key):
        return key
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def _new_key() -> str:
    return uuid.uuid4().hex


def is_replayed(response: httpx.Response) -> bool:
    """``True`` when the server answered from its stored response (``Idempotent-Replayed: true``).

    .. versionadded:: 0.1
    """
    value: str = response.headers.get("idempotent-replayed", "")
    return value.strip().lower() == "true"


_H = TypeVar("_H", httpx.Client, httpx.AsyncClient)
_R = TypeVar("_R")  # what ``sleep`` returns: None, or an awaitable for AsyncClient


class _Attempts:
    """The state of one logical call: its key, which attempt, how long it waited on 409s."""

    __slots__ = ("attempt", "busy", "busy_since", "key", "resendable", "safe", "waited")

    def __init__(self, key: str | None, *, safe: bool, resendable: bool) -> None:
        self.key = key
        #: A safe method (``SAFE_METHODS``): it changes nothing on the server, with or without a key.
        self.safe = safe
        #: Whether an unknown outcome may be sent again: the key makes it safe, or the method is.
        self.resendable = resendable
        self.attempt = 0
        #: The pauses asked for after 409s, and how many 409s, since when (``time.monotonic``).
        self.waited = 0.0
        self.busy = 0
        self.busy_since = 0.0


def _request_identity(method: str, url: Any, kwargs: dict[str, Any]) -> str:
    """What a request is, for telling a repeat of it from another operation in one attempt: the method,
    the URL, the query and the body as given (``content``, ``json``, ``data``, the files' names)."""
    parts = [method, str(url)]
    for name in ("params", "content", "json", "data", "files"):
        value = kwargs.get(name)
        if value is None:
            continue
        if name == "files":
            value = [(field, getattr(f, "name", f) if not isinstance(f, tuple) else f[0]) for field, f in (
                value.items() if isinstance(value, dict) else value)]  # fmt: skip
        try:
            text = canonical_json(value) if not isinstance(value, bytes | str) else None
        except NotSerializable:
            text = repr(value)
        parts.append(f"{name}={value!r}" if text is None else f"{name}={text}")
    return hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).hexdigest()


def _ledger_key(lease: _drivers.Lease, identity: str) -> str:
    """The key of a keyed request of the running attempt: the ledger's for the first request, then
    ``key#2``, ``key#3``… for each other one, in the order they are first sent; the same request sent
    again (the tool's own retry) keeps its key.

    Two different requests of one tool are two operations: under one key the server would refuse the
    second (422) or answer it with the first's response. The map lives on the attempt's lease, which
    the tool's tasks and threads share, so a re-run of the tool (the ledger's retry, a resend after a
    crash) sends the same keys for the same requests in the same order.
    """
    with lease.lock:
        keyed = lease.keyed
        if keyed is None:
            keyed = lease.keyed = {}
        key = keyed.get(identity)
        if key is None:
            n = len(keyed) + 1
            key = keyed[identity] = lease.record.key if n == 1 else f"{lease.record.key}#{n}"
    return key


class _BaseClient(Generic[_H, _R]):
    """What ``Client`` and ``AsyncClient`` share: the arguments, the key of a call and every decision.

    The two subclasses only name their httpx client class and default sleep, and drive the requests.
    """

    _httpx_class: type[_H]
    _default_sleep: Callable[[float], _R]

    def __init__(
        self,
        base_url: str = "",
        *,
        client: _H | None = None,
        retry: Retry = DEFAULT_RETRY,
        wait: float = 30.0,
        max_retry_after: float = 60.0,
        header: str = "Idempotency-Key",
        quoted: bool = False,
        resend_unknown: bool = True,
        raise_for_status: bool = True,
        key_methods: Iterable[str] = ("POST", "PUT", "PATCH", "DELETE"),
        sleep: Callable[[float], _R] | None = None,
        rng: random.Random | None = None,
        key_factory: Callable[[], str] = _new_key,
        **httpx_kwargs: Any,
    ) -> None:
        """A client; every argument but ``base_url`` is keyword-only.

        Args:
            base_url: prefix of relative URLs.
            client: an httpx client to use (then ``base_url`` and ``httpx_kwargs`` are ignored);
                default: one made here and closed by ``close()`` / ``aclose()``.
            retry: attempts and backoff of one logical call (default ``DEFAULT_RETRY``: 4 attempts).
            wait: the most seconds one call waits on 409 (in progress) before ``InProgress``.
            max_retry_after: a ``Retry-After`` longer than this is not waited for: the call ends.
            header: ``Idempotency-Key`` (or ``X-Idempotency-Key`` for older servers).
            quoted: send the key as the draft's sf-string (``"key"``) instead of a bare token.
            resend_unknown: re-send with the same key when the outcome is unknown (timeout, reset, 5xx).
                Right for a server that honours the key; turn it off for one that does not. Safe methods
                (``SAFE_METHODS``: GET, HEAD, OPTIONS, TRACE) without a key are re-sent either way.
            raise_for_status: raise ``httpx.HTTPStatusError`` for a final 4xx/5xx (so a guarded tool's
                ledger classifies it); ``False`` returns the response.
            key_methods: methods that get a key. Others are sent without one: retried when not sent or
                not executed, and re-sent on an unknown outcome only if they are safe methods.
            sleep: the sleep between attempts (injectable for tests); default ``time.sleep``, or
                ``asyncio.sleep`` for ``AsyncClient``.
            rng: the random source of the jitter.
            key_factory: makes the key of a call outside a guarded tool (default: a UUID4 hex).
            **httpx_kwargs: passed to the httpx client (``timeout``, ``auth``, ``headers``, ``transport``…).
        """
        check_seconds(wait, f"wait={wait!r}")
        check_seconds(max_retry_after, f"max_retry_after={max_retry_after!r}")
        self.retry = retry
        self.wait = wait
        self.max_retry_after = max_retry_after
        self.header = header
        self.quoted = quoted
        self.resend_unknown = resend_unknown
        self.raise_for_status = raise_for_status
        self.key_methods = frozenset(m.upper() for m in key_methods)
        self.rng = rng or random.Random()
        self.key_factory = key_factory
        self.sleep: Callable[[float], _R] = sleep if sleep is not None else self._default_sleep
        self._owns = client is None
        self.httpx: _H = client if client is not None else self._httpx_class(base_url=base_url, **httpx_kwargs)

    def _start(
        self, method: str, url: Any, explicit: str | None, headers: httpx.Headers, kwargs: dict[str, Any]
    ) -> _Attempts:
        """The key of a new logical call: explicit (the argument or the caller's header), else the
        guarded call's (``_ledger_key``), else a fresh one. Puts it in ``headers``."""
        method = method.upper()
        safe = method in SAFE_METHODS
        if method not in self.key_methods and explicit is None:
            # A header the caller gave goes as it is; a key given as idempotency_key= is sent (and
            # makes the request keyed) whatever the method: dropping it silently would surprise.
            return _Attempts(None, safe=safe, resendable=safe)
        explicit = self._explicit(explicit, headers)
        if explicit is not None:
            key = explicit
        else:
            lease = _drivers.CURRENT.get()
            key = self.key_factory() if lease is None else _ledger_key(lease, _request_identity(method, url, kwargs))
        wire = header_key(key)
        headers[self.header] = f'"{wire}"' if self.quoted else wire
        return _Attempts(wire, safe=safe, resendable=self.resend_unknown or safe)

    def _explicit(self, argument: str | None, headers: httpx.Headers) -> str | None:
        """The key the caller named: ``idempotency_key=``, else the key header of this request, else
        the one among the client's default headers (Stripe's habit). Replacing it with a key of our
        own would make the caller's retry of the same operation a second one."""
        given = headers.get(self.header)
        if given is None and argument is None:
            given = self.httpx.headers.get(self.header)
        if given is not None and self.quoted and len(given) >= 2 and given[0] == given[-1] == '"':
            given = given[1:-1]  # the draft's sf-string form: the key is inside the quotes
        if argument is None:
            argument = given
        elif given is not None and given != argument:
            raise TypeError(
                f"two idempotency keys for one request: idempotency_key={argument!r} and the {self.header} "
                f"header {given!r}; give one of them"
            )
        if argument is not None and (not isinstance(argument, str) or not argument):
            raise TypeError(f"idempotency key {argument!r}: a key is a non-empty string, e.g. 'order-42'")
        return argument

    def _on_response(self, call: _Attempts, response: httpx.Response) -> float | None:
        """``None``: return ``response``. Seconds: try again after them. Raises for the rest."""
        status = response.status_code
        if status < 400:
            return None
        retry_after = retry_after_seconds(response.headers.get("retry-after"))
        if call.key is not None and status == 409:
            # Another request with this key is running: waiting costs no attempt, only time. Time on the
            # clock since the first 409 (the answers take time too), or the pauses asked for if more (an
            # injected sleep may not sleep); each pause at least a floor that grows, so a Retry-After of
            # 0 or in the past still ends in InProgress after ``wait`` seconds.
            now = time.monotonic()
            if not call.busy:
                call.busy_since = now
            floor = min(_BUSY_FLOOR * 2**call.busy, _BUSY_FLOOR_CAP)
            call.busy += 1
            seconds = (
                max(retry_after, floor) if retry_after is not None else self.retry.backoff(1, self.rng, floor=floor)
            )
            waited = max(call.waited, now - call.busy_since)
            if waited + seconds > self.wait:
                raise InProgress(
                    f"the server still processes a request with key {call.key!r} after {waited:.1f} s "
                    f"of waiting: call again later with the same key (idempotency_key={call.key!r})",
                    key=call.key,
                )
            call.waited += seconds
            call.attempt -= 1  # nothing ran: a 409 is a wait, not a spent attempt
            return seconds
        if call.key is not None and status == 422 and _is_key_problem(response):
            raise KeyConflict(
                f"the server refused key {call.key!r}: it was used with another request "
                f"({_detail(response)}). Use a new key for a new operation",
                key=call.key,
                record=None,
                fingerprint="",
            )
        verdict = classify_status(status, response.headers.get("retry-after")).verdict
        if self._again(call, verdict, retry_after):
            return self.retry.backoff(call.attempt, self.rng, floor=retry_after)
        if self.raise_for_status:
            response.raise_for_status()
        return None

    def _on_error(self, call: _Attempts, exc: Exception) -> float:
        """Seconds to wait before trying again, or raises ``exc`` when it is final."""
        got = classify(exc)
        if self._again(call, got.verdict, got.retry_after):
            return self.retry.backoff(call.attempt, self.rng, floor=got.retry_after)
        raise exc

    def _again(self, call: _Attempts, verdict: Verdict, retry_after: float | None) -> bool:
        if call.attempt >= self.retry.attempts:
            return False
        if retry_after is not None and retry_after > self.max_retry_after:
            return False
        if verdict in (Verdict.NOT_SENT, Verdict.NOT_EXECUTED):
            return True
        # Unknown: the request may have run. Sending it again is safe only with its key or a safe method.
        return verdict is Verdict.UNKNOWN and call.resendable


def _is_problem(response: httpx.Response) -> bool:
    value: str = response.headers.get("content-type", "")
    return value.split(";", maxsplit=1)[0].strip().lower() == "application/problem+json"


def _is_key_problem(response: httpx.Response) -> bool:
    """A 422 problem document about the key (onceonly's ``#key-reused``, the draft's "Idempotency-Key
    is already used"); one about the request's content (a field missing) is the server refusing the
    request, not the key."""
    if not _is_problem(response):
        return False
    try:
        doc = response.json()
    except ValueError:
        return False
    if not isinstance(doc, dict):
        return False
    named = f"{doc.get('type', '')} {doc.get('title', '')}".lower()
    return "idempot" in named or "key-reused" in named


def _detail(response: httpx.Response) -> str:
    try:
        doc = response.json()
    except ValueError:
        return f"HTTP {response.status_code}"
    return str(doc.get("detail") or doc.get("title") or f"HTTP {response.status_code}")


def _needs_mark_sent(call: _Attempts) -> bool:
    """Whether a request that may change something runs in a guarded call still ``pending`` (a
    ``reports_dispatch`` tool).

    Decided by the method, not by the key: a PUT outside ``key_methods`` changes things all the same,
    and left ``pending`` its unknown outcome would read as "never sent" and be run again. A safe
    method (a lookup before the side effect) does not mark. Asks the ledger's current call, so that a
    call already ``in_flight`` costs nothing (the async ``amark_sent`` would hop to a thread for a no-op).
    """
    if call.safe:
        return False
    info = _drivers.current_call()
    return info is not None and info.state is State.PENDING


class Client(_BaseClient[httpx.Client, None]):
    """A sync httpx client that sends one idempotency key per logical call and retries with it.

    Its arguments are documented on ``__init__``; ``sleep`` blocks (default ``time.sleep``).

    .. versionadded:: 0.1
    """

    _httpx_class = httpx.Client
    _default_sleep = staticmethod(time.sleep)

    def request(
        self, method: str, url: str | httpx.URL, *, idempotency_key: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        """Send one logical call, with retries; ``kwargs`` as for ``httpx.Client.request``.

        The body must be re-sendable (``json=``, ``content=`` bytes, ``data=``, ``files=``), since a
        retry sends it again. ``response.request.headers["Idempotency-Key"]`` is the key used: the one
        named by ``idempotency_key=`` or by that header in ``headers=`` (or the client's), else the
        guarded call's, else a new one.

        Raises:
            TypeError: ``idempotency_key=`` and the key header name two different keys, or an empty one.
            KeyConflict: the server saw this key with another request (422 problem).
            InProgress: the server still ran a request with this key after ``wait`` seconds (409).
            httpx.HTTPStatusError: a final 4xx/5xx (with ``raise_for_status=True``).
            httpx.HTTPError: the last transport error, once no retry is left or it is definite.
        """
        headers = httpx.Headers(kwargs.pop("headers", None))
        call = self._start(method, url, idempotency_key, headers, kwargs)
        if _needs_mark_sent(call):
            _drivers.mark_sent()  # pending → in_flight, or InProgress when our lease was lost
        while True:
            call.attempt += 1
            try:
                response = self.httpx.request(method, url, headers=headers, **kwargs)
            except httpx.HTTPError as exc:
                seconds = self._on_error(call, exc)
            else:
                got = self._on_response(call, response)
                if got is None:
                    return response
                response.close()
                seconds = got
            self.sleep(seconds)

    def get(self, url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def put(self, url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
        return self.request("PUT", url, **kwargs)

    def patch(self, url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
        return self.request("PATCH", url, **kwargs)

    def delete(self, url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
        return self.request("DELETE", url, **kwargs)

    def close(self) -> None:
        """Close the httpx client if this object made it."""
        if self._owns:
            self.httpx.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_BaseClient[httpx.AsyncClient, Awaitable[None]]):
    """``Client`` for asyncio: the same arguments (``sleep`` is an async function), awaited methods.

    .. versionadded:: 0.1
    """

    _httpx_class = httpx.AsyncClient
    _default_sleep = staticmethod(asyncio.sleep)

    async def request(
        self, method: str, url: str | httpx.URL, *, idempotency_key: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        """See ``Client.request``."""
        headers = httpx.Headers(kwargs.pop("headers", None))
        call = self._start(method, url, idempotency_key, headers, kwargs)
        if _needs_mark_sent(call):
            await _drivers.amark_sent()
        while True:
            call.attempt += 1
            try:
                response = await self.httpx.request(method, url, headers=headers, **kwargs)
            except httpx.HTTPError as exc:
                seconds = self._on_error(call, exc)
            else:
                got = self._on_response(call, response)
                if got is None:
                    return response
                await response.aclose()
                seconds = got
            await self.sleep(seconds)

    async def get(self, url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
        return await self.request("GET", url, **kwargs)

    async def post(self, url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
        return await self.request("POST", url, **kwargs)

    async def put(self, url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
        return await self.request("PUT", url, **kwargs)

    async def patch(self, url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
        return await self.request("PATCH", url, **kwargs)

    async def delete(self, url: str | httpx.URL, **kwargs: Any) -> httpx.Response:
        return await self.request("DELETE", url, **kwargs)

    async def aclose(self) -> None:
        """Close the httpx client if this object made it."""
        if self._owns:
            await self.httpx.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
