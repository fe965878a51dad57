"""``onceonly.http.RequestsAdapter``: the guarded call's key for requests, at the adapter seam.

``onceonly.http`` imports this module when ``RequestsAdapter`` is first asked for, so that requests
is imported only by those who use it. Needs the ``requests`` extra.
"""

from __future__ import annotations

import json
import time
from typing import Any, Unpack

from onceonly._install import install_hint

try:
    import requests
    from requests.adapters import HTTPAdapter
    from requests.structures import CaseInsensitiveDict
except ImportError as exc:  # pragma: no cover - the extra is installed wherever the tests run
    raise ImportError(f"onceonly.http.RequestsAdapter needs requests: {install_hint('requests')}") from exc

from onceonly import runtime as _runtime
from onceonly.http._rules import (
    REPLAYED,
    Options,
    Rules,
    ServerSays,
    Told,
    close_response,
    lookup_headers,
    needs_mark_sent,
    read_status,
    run,
)

__all__ = ["RequestsAdapter"]


class RequestsAdapter(Rules, HTTPAdapter):
    """A requests transport adapter that carries the guarded call's key:
    ``session.mount("https://", RequestsAdapter())``.

    The same behaviour as ``onceonly.http.Transport``: inside a guarded tool each request of
    ``key_methods`` gets the ledger's key (``key#2``… for the tool's other requests, ``hash_keys`` to
    send a hash), and a ``reports_dispatch`` tool is marked sent just before a request that may change
    something goes; a request that already carries a key keeps it; a keyed request is sent, and sent
    again, under its one key (409, 422, Retry-After, unknown outcomes: see ``onceonly.http``), and its
    final answer is returned as it is (``response.raise_for_status()`` is yours to call). A request
    without a key is handed on untouched, once. A body that is a stream (a generator, a file) cannot
    be sent again: such a request goes once.

    Args:
        pool_connections, pool_maxsize, max_retries, pool_block: as for ``requests.adapters.HTTPAdapter``
            (urllib3's own retries happen inside one attempt, with the same headers: the same key).
        **options: ``onceonly.http.Options`` (``retry``, ``hash_keys``, ``conflict_means``, ``lookup``…).

    .. versionadded:: 0.1
    """

    _default_sleep = staticmethod(time.sleep)

    def __init__(
        self,
        *,
        pool_connections: int = 10,
        pool_maxsize: int = 10,
        max_retries: Any = 0,
        pool_block: bool = False,
        **options: Unpack[Options],
    ) -> None:
        Rules.__init__(self, **options)
        HTTPAdapter.__init__(
            self,
            pool_connections=pool_connections,
            pool_maxsize=pool_maxsize,
            max_retries=max_retries,
            pool_block=pool_block,
        )

    def send(
        self,
        request: requests.PreparedRequest,
        stream: bool = False,
        timeout: Any = None,
        verify: Any = True,
        cert: Any = None,
        proxies: dict[str, str] | None = None,
    ) -> requests.Response:
        """Send ``request`` (a session calls this), under the guarded call's key when it gets one."""
        options: dict[str, Any] = {"stream": stream, "timeout": timeout, "verify": verify, "cert": cert}
        options["proxies"] = proxies
        body = request.body
        url = request.url or ""
        call = self._begin(request.method or "GET", url, request.headers, lambda: _bytes(body))
        call.repeatable = body is None or isinstance(body, bytes | str)
        if needs_mark_sent(call):
            _runtime.mark_sent(target=self._target(call, request.method or "GET", url))
        if call.key is None:
            return HTTPAdapter.send(self, request, **options)

        def send() -> requests.Response:
            return HTTPAdapter.send(self, request, **options)

        def lookup(_conflict: requests.Response) -> requests.Response:
            if callable(self.lookup):
                return _json_response(self._given(call, self.lookup(call.key or "")), request)
            headers = lookup_headers(request.headers, self.header)
            answer = HTTPAdapter.send(self, requests.Request("GET", self._lookup_url(call, url), headers).prepare())
            if self._found(call, answer):
                return answer
            answer.close()
            raise self._not_found(call, answer)

        def probe() -> ServerSays:
            headers = lookup_headers(request.headers, self.header)
            asking = requests.Request("GET", self._status_url(call, url), headers).prepare()
            try:
                answer = HTTPAdapter.send(self, asking, timeout=timeout, verify=verify, cert=cert, proxies=proxies)
                try:
                    return read_status(answer.status_code, answer.headers, answer.content)
                finally:
                    answer.close()
            except Exception as exc:
                return ServerSays(Told.NO_ANSWER, detail=f"the server could not be asked ({type(exc).__name__})")

        return run(self, call, send, close_response, lookup, (Exception,), probe)


def _bytes(body: object) -> bytes | None:
    if isinstance(body, str):
        return body.encode("utf-8")
    return body if isinstance(body, bytes) else None


def _json_response(found: Any, request: requests.PreparedRequest) -> requests.Response:
    """The answer made of a result a ``lookup=`` function found: 200, JSON, marked a replay."""
    response = requests.Response()
    response.status_code = 200
    response.reason = "OK"
    response._content = json.dumps(found).encode("utf-8")
    response.headers = CaseInsensitiveDict({"Content-Type": "application/json", REPLAYED: "true"})
    response.encoding = "utf-8"
    response.url = request.url or ""
    response.request = request
    return response
