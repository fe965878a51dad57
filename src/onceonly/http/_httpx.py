"""The httpx faces of ``onceonly.http``: ``Client``, ``AsyncClient``, ``Transport``, ``AsyncTransport``."""

from __future__ import annotations

import asyncio
import importlib
import random
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Generic, Literal, TypeVar, Unpack

import httpx

from onceonly import runtime as _runtime
from onceonly.http._rules import (
    DEFAULT_RETRY,
    REPLAYED,
    SAFE_METHODS,
    Attempts,
    Lookup,
    Options,
    Rules,
    ServerSays,
    Told,
    aclose_response,
    arun,
    close_response,
    header_key,
    ledger_key,
    lookup_headers,
    maybe_await,
    needs_mark_sent,
    new_key,
    read_status,
    request_identity,
    route_of,
    run,
)
from onceonly.keystatus import STATUS_PATH
from onceonly.policy import ConflictMeaning, Retry

__all__ = ["AsyncClient", "AsyncTransport", "Client", "Transport"]


def _library(request: httpx.Request) -> Any:
    """The module of the request's classes: ``httpx``, or ``httpx2`` (the same names, its own classes)."""
    return importlib.import_module(type(request).__module__.partition(".")[0])


def _json_response(found: Any, request: httpx.Request) -> httpx.Response:
    """The answer made of a result a ``lookup=`` function found: 200, JSON, marked a replay."""
    response: httpx.Response = _library(request).Response(200, json=found, headers={REPLAYED: "true"}, request=request)
    return response


def _said(answer: httpx.Response) -> ServerSays:
    """What a read answer of the key status endpoint says."""
    return read_status(answer.status_code, answer.headers, answer.content)


def _unasked(exc: Exception) -> ServerSays:
    return ServerSays(Told.NO_ANSWER, detail=f"the server could not be asked ({type(exc).__name__})")


# --- the clients -------------------------------------------------------------------------------------

_H = TypeVar("_H", httpx.Client, httpx.AsyncClient)


class _BaseClient(Rules, Generic[_H]):
    """What ``Client`` and ``AsyncClient`` share: the arguments and the key of a logical call.

    The two subclasses only name their httpx client class and default sleep, and drive the requests.
    """

    _httpx_class: type[_H]

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
        hash_keys: bool = False,
        hash_secret: str | bytes | None = None,
        conflict_means: ConflictMeaning = "in_progress",
        lookup: Lookup | None = None,
        probe: Literal["server"] | None = None,
        status_path: str = STATUS_PATH,
        sleep: Callable[[float], Any] | None = None,
        rng: random.Random | None = None,
        key_factory: Callable[[], str] = new_key,
        **httpx_kwargs: Any,
    ) -> None:
        """A client; every argument but ``base_url`` is keyword-only.

        Args:
            base_url: prefix of relative URLs.
            client: an httpx client to use (then ``base_url`` and ``httpx_kwargs`` are ignored);
                default: one made here and closed by ``close()`` / ``aclose()``.
            raise_for_status: raise ``httpx.HTTPStatusError`` for a final 4xx/5xx (so a guarded tool's
                ledger classifies it); ``False`` returns the response.
            key_factory: makes the key of a call outside a guarded tool (default: a UUID4 hex).
            **httpx_kwargs: passed to the httpx client (``timeout``, ``auth``, ``headers``, ``transport``…).

        The others are ``Options``: ``retry``, ``wait``, ``max_retry_after``, ``header``, ``quoted``,
        ``resend_unknown`` (safe methods without a key are re-sent either way), ``key_methods`` (others
        are sent without a key: retried when not sent or not executed, and re-sent on an unknown
        outcome only if they are safe methods), ``hash_keys``, ``hash_secret``, ``conflict_means``,
        ``lookup`` (a function must be async for ``AsyncClient``, or return the result), ``probe``
        (``"server"``: ask the server's key status endpoint about an unknown outcome), ``status_path``,
        ``sleep``, ``rng``.
        """
        super().__init__(
            raise_for_status=raise_for_status, retry=retry, wait=wait, max_retry_after=max_retry_after,
            header=header, quoted=quoted, resend_unknown=resend_unknown, key_methods=key_methods,
            hash_keys=hash_keys, hash_secret=hash_secret, conflict_means=conflict_means, lookup=lookup,
            probe=probe, status_path=status_path, sleep=sleep, rng=rng,
        )  # fmt: skip
        self.key_factory = key_factory
        self._owns = client is None
        self.httpx: _H = client if client is not None else self._httpx_class(base_url=base_url, **httpx_kwargs)

    def _start(
        self, method: str, url: Any, explicit: str | None, headers: httpx.Headers, kwargs: dict[str, Any]
    ) -> Attempts:
        """The key of a new logical call: explicit (the argument or the caller's header), else the
        guarded call's (``ledger_key``), else a fresh one. Puts it in ``headers``."""
        method = method.upper()
        safe = method in SAFE_METHODS
        if method not in self.key_methods and explicit is None:
            # A header the caller gave goes as it is; a key given as idempotency_key= is sent (and
            # makes the request keyed) whatever the method: dropping it silently would surprise.
            return Attempts(None, safe=safe, resendable=safe)
        explicit = self._explicit(explicit, headers)
        if explicit is not None:
            wire = header_key(explicit)
        else:
            lease = _runtime.CURRENT.get()
            if lease is None:
                wire = header_key(self.key_factory())
            else:
                wire = self._wire(ledger_key(lease, request_identity(method, url, kwargs)))
        self._put(headers, wire)
        return Attempts(wire, safe=safe, resendable=self.resend_unknown or safe, route=route_of(method, url))

    def _explicit(self, argument: str | None, headers: httpx.Headers) -> str | None:
        """The key the caller named: ``idempotency_key=``, else the key header of this request, else
        the one among the client's default headers (Stripe's habit). Replacing it with a key of our
        own would make the caller's retry of the same operation a second one."""
        given = headers.get(self.header)
        if given is None and argument is None:
            given = self.httpx.headers.get(self.header)
        given = self._named(given)
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

    def _lookup_request(self, call: Attempts, request: httpx.Request) -> httpx.Request:
        """The GET of a ``lookup=`` template, built by this client (its base URL, auth, cookies)."""
        url = self._lookup_url(call, str(request.url))
        return self.httpx.build_request("GET", url, headers=lookup_headers(request.headers, self.header))

    def _client_target(self, call: Attempts, method: str, url: Any) -> dict[str, str] | None:
        """``_target`` with the URL as this client resolves it (its base URL), built only when probing."""
        if self.probe is None or call.key is None:
            return None
        return self._target(call, method, str(self.httpx.build_request(method, url).url))

    def _status_request(self, call: Attempts, method: str, url: Any, headers: httpx.Headers) -> httpx.Request:
        """The GET of the key status endpoint (``probe="server"``), built by this client (its base URL,
        auth, cookies) with the request's other headers: the server scopes the key by them."""
        target = str(self.httpx.build_request(method, url).url)
        return self.httpx.build_request(
            "GET", self._status_url(call, target), headers=lookup_headers(headers, self.header)
        )


class Client(_BaseClient[httpx.Client]):
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
            KeyAlreadyUsed: ``conflict_means="exists"``, and the result of the used key was not found.
            httpx.HTTPStatusError: a final 4xx/5xx (with ``raise_for_status=True``).
            httpx.HTTPError: the last transport error, once no retry is left or it is definite.
        """
        headers = httpx.Headers(kwargs.pop("headers", None))
        call = self._start(method, url, idempotency_key, headers, kwargs)
        if needs_mark_sent(call):
            # pending → in_flight (with where it goes, for the reconciler), or InProgress when our lease was lost
            _runtime.mark_sent(target=self._client_target(call, method, url))

        def send() -> httpx.Response:
            return self.httpx.request(method, url, headers=headers, **kwargs)

        def lookup(conflict: httpx.Response) -> httpx.Response:
            if callable(self.lookup):
                return _json_response(self._given(call, self.lookup(call.key or "")), conflict.request)
            answer = self.httpx.send(self._lookup_request(call, conflict.request))
            if self._found(call, answer):
                return answer
            raise self._not_found(call, answer)

        def probe() -> ServerSays:
            try:
                return _said(self.httpx.send(self._status_request(call, method, url, headers)))
            except httpx.HTTPError as exc:
                return _unasked(exc)

        return run(self, call, send, close_response, lookup, (httpx.HTTPError,), probe)

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


class AsyncClient(_BaseClient[httpx.AsyncClient]):
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
        if needs_mark_sent(call):
            await _runtime.amark_sent(target=self._client_target(call, method, url))

        async def send() -> httpx.Response:
            return await self.httpx.request(method, url, headers=headers, **kwargs)

        async def lookup(conflict: httpx.Response) -> httpx.Response:
            if callable(self.lookup):
                found = await maybe_await(self.lookup(call.key or ""))
                return _json_response(self._given(call, found), conflict.request)
            answer = await self.httpx.send(self._lookup_request(call, conflict.request))
            if self._found(call, answer):
                return answer
            raise self._not_found(call, answer)

        async def probe() -> ServerSays:
            try:
                return _said(await self.httpx.send(self._status_request(call, method, url, headers)))
            except httpx.HTTPError as exc:
                return _unasked(exc)

        return await arun(self, call, send, aclose_response, lookup, (httpx.HTTPError,), probe)

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


# --- the transports ----------------------------------------------------------------------------------


class _BaseTransport(Rules):
    """What ``Transport`` and ``AsyncTransport`` share: the inner transport, and the lookup's GET.

    The inner transport is the one given, else the default transport of the library of the first
    request (``httpx`` or ``httpx2``: a transport must answer with its client's own classes).
    """

    _inner_class: str

    def __init__(self, inner: Any = None, **options: Unpack[Options]) -> None:
        super().__init__(**options)
        self.inner = inner
        self._inner_lock = threading.Lock()

    def _inner_for(self, request: httpx.Request) -> Any:
        inner = self.inner
        if inner is None:
            with self._inner_lock:
                if self.inner is None:
                    self.inner = getattr(_library(request), self._inner_class)()
                inner = self.inner
        return inner

    def _begin_request(self, request: httpx.Request) -> Attempts:
        return self._begin(request.method, str(request.url), request.headers, lambda: request.content)

    def _lookup_request(self, call: Attempts, request: httpx.Request) -> httpx.Request:
        """The GET of a ``lookup=`` template: the request's library, headers and timeouts."""
        url = self._lookup_url(call, str(request.url))
        headers = lookup_headers(request.headers, self.header)
        return type(request)("GET", url, headers=headers, extensions=request.extensions)

    def _status_request(self, call: Attempts, request: httpx.Request) -> httpx.Request:
        """The GET of the key status endpoint (``probe="server"``): the request's library, other
        headers (the server scopes the key by them) and timeouts."""
        headers = lookup_headers(request.headers, self.header)
        return type(request)(
            "GET", self._status_url(call, str(request.url)), headers=headers, extensions=request.extensions
        )


class Transport(_BaseTransport, httpx.BaseTransport):
    """An httpx transport that carries the guarded call's key: ``httpx.Client(transport=Transport())``.

    It wraps ``inner`` (default: ``httpx.HTTPTransport()``, or ``httpx2.HTTPTransport()`` under an
    httpx2 client), so it composes with the transports you have, and SDK clients built on it carry keys.
    Inside a guarded tool each request of ``key_methods`` gets the ledger's key (``key#2``… for the
    tool's other requests, ``hash_keys`` to send a hash), and a ``reports_dispatch`` tool is marked sent
    just before a request that may change something goes. A request that already carries a key (the
    caller's, or the SDK's) keeps it. A keyed request is sent, and sent again, by the rules in
    ``onceonly.http``'s docstring; its final answer is returned as it is (the client or SDK raises for its
    status). A request without a key is handed on untouched, once.

    Args:
        inner: the transport that sends (default: the client library's ``HTTPTransport()``).
        **options: ``Options`` (``retry``, ``hash_keys``, ``conflict_means``, ``lookup``…).

    .. versionadded:: 0.1
    """

    _default_sleep = staticmethod(time.sleep)
    _inner_class = "HTTPTransport"

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self._is_keyed(request.method, request.headers):
            request.read()  # a streamed body becomes bytes: it is sent again, and its hash names it
        call = self._begin_request(request)
        if needs_mark_sent(call):
            _runtime.mark_sent(target=self._target(call, request.method, str(request.url)))
        inner = self._inner_for(request)
        if call.key is None:
            response: httpx.Response = inner.handle_request(request)
            return response

        def send() -> httpx.Response:
            response: httpx.Response = inner.handle_request(request)
            if response.status_code == 422:
                response.read()  # the problem document tells a key conflict from a validation error
            return response

        def lookup(_conflict: httpx.Response) -> httpx.Response:
            if callable(self.lookup):
                return _json_response(self._given(call, self.lookup(call.key or "")), request)
            answer: httpx.Response = inner.handle_request(self._lookup_request(call, request))
            if self._found(call, answer):
                return answer
            answer.close()
            raise self._not_found(call, answer)

        def probe() -> ServerSays:
            try:
                answer: httpx.Response = inner.handle_request(self._status_request(call, request))
                try:
                    answer.read()
                    return _said(answer)
                finally:
                    answer.close()
            except Exception as exc:  # the inner transport's own errors: httpx's, httpx2's
                return _unasked(exc)

        return run(self, call, send, close_response, lookup, (Exception,), probe)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


class AsyncTransport(_BaseTransport, httpx.AsyncBaseTransport):
    """``Transport`` for async clients: ``httpx.AsyncClient(transport=AsyncTransport())``.

    The same arguments (``sleep`` and a ``lookup=`` function may be async); the default inner
    transport is the client library's ``AsyncHTTPTransport()``.

    .. versionadded:: 0.1
    """

    _default_sleep = staticmethod(asyncio.sleep)
    _inner_class = "AsyncHTTPTransport"

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self._is_keyed(request.method, request.headers):
            await request.aread()  # a streamed body becomes bytes: it is sent again, and its hash names it
        call = self._begin_request(request)
        if needs_mark_sent(call):
            await _runtime.amark_sent(target=self._target(call, request.method, str(request.url)))
        inner = self._inner_for(request)
        if call.key is None:
            response: httpx.Response = await inner.handle_async_request(request)
            return response

        async def send() -> httpx.Response:
            response: httpx.Response = await inner.handle_async_request(request)
            if response.status_code == 422:
                await response.aread()  # the problem document tells a key conflict from a validation error
            return response

        async def lookup(_conflict: httpx.Response) -> httpx.Response:
            if callable(self.lookup):
                found = await maybe_await(self.lookup(call.key or ""))
                return _json_response(self._given(call, found), request)
            answer: httpx.Response = await inner.handle_async_request(self._lookup_request(call, request))
            if self._found(call, answer):
                return answer
            await answer.aclose()
            raise self._not_found(call, answer)

        async def probe() -> ServerSays:
            try:
                answer: httpx.Response = await inner.handle_async_request(self._status_request(call, request))
                try:
                    await answer.aread()
                    return _said(answer)
                finally:
                    await answer.aclose()
            except Exception as exc:
                return _unasked(exc)

        return await arun(self, call, send, aclose_response, lookup, (Exception,), probe)

    async def aclose(self) -> None:
        if self.inner is not None:
            await self.inner.aclose()
