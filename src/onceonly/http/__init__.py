"""HTTP that carries one idempotency key per operation: clients, transports, a requests adapter.

Three faces over one set of rules:

- ``Client`` / ``AsyncClient``: a client of their own (around an httpx client). One logical call
  (``client.post(...)``) gets one key: ``idempotency_key=`` or the key header if the caller names one,
  else the guarded call's, else a new one.
- ``Transport`` / ``AsyncTransport``: an httpx transport (httpx2 too: duck-typed) wrapping another,
  so that any client built on it carries the keys, SDK clients included
  (``httpx.Client(transport=Transport())``, ``openai.OpenAI(http_client=httpx2.Client(transport=...))``).
- ``RequestsAdapter``: the same for ``requests.Session.mount(...)`` (the ``requests`` extra).

Inside a guarded tool the key is the ledger's (``onceonly.current_call().key``; the n-th different
keyed request of one attempt, n >= 2, gets ``key#n``), so a retry by the ledger, after a crash or by
another process, sends the same keys. A transport outside a guarded call hands a request on untouched
and once, unless it already carries a key (the caller's, or the SDK's). A keyed request is sent, and
sent again, under its one key:

    attempt ──2xx/3xx──────────────▶ the response
       │  ├─409, conflict_means=────▶ "in_progress" (default, the IETF draft): wait Retry-After (at least
       │  │                           a growing floor), same key, again, for up to ``wait`` seconds;
       │  │                           "exists": the key was used already: ``lookup=`` fetches the result
       │  │                           (answered as a replay), else ``KeyAlreadyUsed`` (unknown)
       │  ├─422 problem on the key─▶ KeyConflict (the key was used with another request)
       │  ├─408/429/503────────────▶ not executed: backoff (at least Retry-After), same key, again
       │  ├─500/502/504, other 5xx─▶ unknown: re-send with the same key (the server replays or runs once)
       │  └─other 4xx──────────────▶ a definite failure (the client raises httpx.HTTPStatusError)
       ├─connect error / timeout───▶ not sent: backoff, same key, again
       └─read timeout, reset───────▶ unknown: re-send with the same key

With ``probe="server"`` an unknown outcome of a keyed request is settled by asking the server what
happened to the key (``GET /idempotency-keys/{key}``, ``onceonly.server``'s ``status_path=``):
completed → sent again and replayed, processing → waited, 404 → sent again, unknown → ``OutcomeUnknown``;
a server that cannot tell gets the rule above.

``Client`` sends requests without a key by the same rules, except on an unknown outcome: only the
safe methods (``SAFE_METHODS``: GET, HEAD, OPTIONS, TRACE) are sent again then.

Errors are classified by ``onceonly.classify`` (docs/design.md#classifying-a-failed-attempt).
Backoff is exponential with full jitter (``onceonly.Retry``); ``sleep`` is injectable. A tool
declared ``reports_dispatch=True`` is marked sent (``pending`` → ``in_flight``) just before a request
that may change something (any method but ``SAFE_METHODS``, keyed or not) is handed on (so before its
DNS lookup and connect: a crash there is treated as possibly sent, the safe side). ``hash_keys=True``
sends a keyed hash of the ledger's keys, so that the other side never sees scopes or tool names.

Needs the ``http`` extra (httpx); ``RequestsAdapter`` the ``requests`` extra. See docs/http.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from onceonly.http._httpx import AsyncClient, AsyncTransport, Client, Transport
from onceonly.http._rules import (
    DEFAULT_RETRY,
    HASH_SECRET_ENV,
    SAFE_METHODS,
    KeyAlreadyUsed,
    Lookup,
    NotRun,
    Options,
    hash_key,
    header_key,
    is_replayed,
)

if TYPE_CHECKING:
    from onceonly.http._requests import RequestsAdapter

__all__ = [
    "DEFAULT_RETRY",
    "HASH_SECRET_ENV",
    "SAFE_METHODS",
    "AsyncClient",
    "AsyncTransport",
    "Client",
    "KeyAlreadyUsed",
    "Lookup",
    "NotRun",
    "Options",
    "RequestsAdapter",
    "Transport",
    "hash_key",
    "header_key",
    "is_replayed",
]

# Public classes and functions name the module users import them from (in reprs, tracebacks and
# pickles), not the private one that defines them.
for _public in (
    AsyncClient,
    AsyncTransport,
    Client,
    KeyAlreadyUsed,
    NotRun,
    Options,
    Transport,
    hash_key,
    header_key,
    is_replayed,
):
    _public.__module__ = __name__
del _public


def __getattr__(name: str) -> Any:
    # RequestsAdapter subclasses requests' HTTPAdapter: requests is imported when it is first asked for.
    if name == "RequestsAdapter":
        from onceonly.http._requests import RequestsAdapter

        RequestsAdapter.__module__ = __name__
        return RequestsAdapter
    raise AttributeError(f"module 'onceonly.http' has no attribute {name!r}")
