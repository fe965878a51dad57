"""The rules every face of ``onceonly.http`` shares, with no transport of its own: the options, the
key of a request (the ledger's, numbered, or hashed), what each answer means (409, 422, Retry-After,
unknown outcomes), the lookup of a used key's result, and the two loops that send (``run``, ``arun``).

The faces (``_httpx``: ``Client``, ``Transport`` and their async twins; ``_requests``:
``RequestsAdapter``) import what they need from here and nothing from each other. The names without
an underscore that are not in ``onceonly.http.__all__`` are for those faces only.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import inspect
import os
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from typing import Any, Literal, Protocol, TypedDict, TypeVar, Unpack
from urllib.parse import quote, urljoin, urlsplit

from onceonly import runtime as _runtime
from onceonly.errors import InProgress, KeyConflict, NotSerializable, OnceOnlyError, OutcomeUnknown
from onceonly.events import key_conflict, short_key
from onceonly.keys import canonical_json, is_wire_key
from onceonly.keystatus import STATUS_PATH, ServerSays, Told, read_status, status_url
from onceonly.policy import (
    ConflictMeaning,
    Retry,
    Verdict,
    check_conflict_means,
    check_seconds,
    classify,
    classify_status,
    retry_after_seconds,
)
from onceonly.states import State

__all__ = [
    "DEFAULT_RETRY",
    "HASH_SECRET_ENV",
    "REPLAYED",
    "SAFE_METHODS",
    "Attempts",
    "KeyAlreadyUsed",
    "Lookup",
    "NotRun",
    "Options",
    "Rules",
    "ServerSays",
    "Told",
    "aclose_response",
    "arun",
    "close_response",
    "hash_key",
    "header_key",
    "is_replayed",
    "ledger_key",
    "lookup_headers",
    "maybe_await",
    "needs_mark_sent",
    "new_key",
    "read_status",
    "request_identity",
    "route_of",
    "run",
    "status_url",
]

#: Four attempts, backoff ceilings 0.5, 1, 2 s (full jitter).
DEFAULT_RETRY = Retry(attempts=4, base=0.5, cap=8.0)
#: Methods that change nothing on the server (RFC 9110 section 9.2.1): re-sending one whose outcome is
#: unknown is safe without a key.
SAFE_METHODS: frozenset[str] = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
# The least pause between two asks after a 409, doubled at each 409 of a call up to the cap: a server
# that answers ``Retry-After: 0`` (or a date in the past) must not turn the wait into a busy loop.
_BUSY_FLOOR = 0.05
_BUSY_FLOOR_CAP = 1.0
#: The environment variable that holds the secret of ``hash_keys=True`` when ``hash_secret=`` is not given.
HASH_SECRET_ENV = "ONCEONLY_HASH_SECRET"
# Without a secret the hash still hides scopes and tool names from reading, not from guessing.
_PUBLIC_SECRET = b"onceonly.http.hash_keys"
REPLAYED = "Idempotent-Replayed"
# Headers of the keyed request that a lookup of its result must not copy: they describe its body or
# its key (the lookup is a GET with no body), or its host (a lookup URL may name another).
_NOT_FOR_LOOKUP = frozenset({"content-length", "content-type", "transfer-encoding", "host"})


def header_key(key: str) -> str:
    """A key as it can travel in the header: itself if 1-255 visible ASCII, else ``sha256:HEX`` of it.

    Ledger keys may hold non-ASCII scope names; the hash keeps them stable and valid.

    .. versionadded:: 0.1
    """
    if is_wire_key(key):
        return key
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def hash_key(key: str, secret: str | bytes | None = None) -> str:
    """The header form of a ledger key under ``hash_keys=True``: 32 hex digits of its HMAC-SHA256.

    Args:
        key: the ledger key (``onceonly.current_call().key``, or ``f"{key}#2"`` for a tool's second request).
        secret: the secret every process of the application shares; default ``$ONCEONLY_HASH_SECRET``,
            else a fixed one (the hash then hides the key from reading, not from guessing).

    A probe that looks a result up by its key (``/…/by-idempotency-key/{key}``) asks with this.

    .. versionadded:: 0.1
    """
    digest = hmac.new(_secret(secret), key.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return digest.hexdigest()[:32]


def _secret(given: str | bytes | None) -> bytes:
    if given is None:
        return os.environ.get(HASH_SECRET_ENV, "").encode("utf-8") or _PUBLIC_SECRET
    wanted = f"give a non-empty str or bytes that every process shares, or None (${HASH_SECRET_ENV}, else a fixed one)"
    if not isinstance(given, str | bytes):
        raise TypeError(f"hash_secret of type {type(given).__name__} is not a secret; {wanted}")
    if not given:
        raise ValueError(f"hash_secret is empty; {wanted}")
    return given.encode("utf-8") if isinstance(given, str) else given


def new_key() -> str:
    return uuid.uuid4().hex


def is_replayed(response: Any) -> bool:
    """``True`` when the server answered from its stored response (``Idempotent-Replayed: true``), or
    the answer is the result a ``lookup=`` found for a key the server said was used already.

    Takes any response with ``headers`` (httpx, httpx2, requests).

    .. versionadded:: 0.1
    """
    value: str = response.headers.get("idempotent-replayed", "")
    return value.strip().lower() == "true"


class KeyAlreadyUsed(OutcomeUnknown):
    """The server answered 409 meaning "this key was used already" (``conflict_means="exists"``), and
    its result could not be looked up: the operation happened, and this call does not have its result.

    Classified as unknown: inside a guarded tool the ledger settles it (``on_unknown``: a probe that
    looks the result up by the key, or review).

    .. versionadded:: 0.1
    """

    onceonly_verdict = Verdict.UNKNOWN


class NotRun(OnceOnlyError):
    """The server says a request with this key never ran (``probe="server"``: its key status is 404),
    and no attempt is left to send it again. Classified as not executed: a retry with the same key is
    safe, and the ledger's retry of a guarded tool sends it.

    .. versionadded:: 0.1
    """

    onceonly_verdict = Verdict.NOT_EXECUTED

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(message)
        self.key = key


#: ``lookup=``: a URL template with ``{key}`` (relative to the request's URL), or a function of the key
#: that returns the existing result (JSON data) or ``None`` (an async function for the async faces).
Lookup = str | Callable[[str], Any]


class Options(TypedDict, total=False):
    """The options every face takes (``Client``, ``Transport``, ``RequestsAdapter``), as keywords.

    Attributes:
        retry: attempts and backoff of one keyed request (default ``DEFAULT_RETRY``: 4 attempts).
        wait: the most seconds one request waits on 409 (in progress) before ``InProgress`` (30).
        max_retry_after: a ``Retry-After`` longer than this is not waited for: the call ends (60).
        header: ``Idempotency-Key`` (or ``X-Idempotency-Key`` for older servers).
        quoted: send the key as the draft's sf-string (``"key"``) instead of a bare token.
        resend_unknown: re-send with the same key when the outcome is unknown (timeout, reset, 5xx).
            Right for a server that honours the key; turn it off for one that does not.
        key_methods: methods that get a key (default POST, PUT, PATCH, DELETE).
        replace_keys: (transports and the adapter) inside a guarded call, the ledger's key replaces a
            key the request already carries: an SDK's own, made afresh for each of its calls, which a
            re-run of the tool would not send again. Default ``False``: a key on the request is kept.
        hash_keys: send a keyed hash of the ledger's keys (``hash_key``), not the keys, which hold
            scopes and tool names. A key the caller names is sent as named.
        hash_secret: the secret of ``hash_keys`` (default ``$ONCEONLY_HASH_SECRET``, else a fixed one).
        conflict_means: what the server means by 409 to a keyed request: ``"in_progress"`` (default,
            the IETF draft: wait and ask again) or ``"exists"`` (the key was used already).
        lookup: with ``"exists"``: how to fetch the existing result. A URL template such as
            ``"/tickets/by-idempotency-key/{key}"`` (resolved against the request's URL, asked with
            a GET that carries the request's other headers, and its 2xx answer returned marked as a
            replay), or a function of the key returning the result as JSON data or ``None``.
        probe: ``"server"``: settle an unknown outcome of a keyed request (timeout, reset, 500/502/504)
            by asking the server what happened to the key (``GET {status_path}/{key}``, served by
            ``onceonly.server.IdempotencyMiddleware(status_path=...)``) with the request's other
            headers (its credentials: the server scopes keys per client). Completed: the request is
            sent again with its key and the server replays the stored response. Processing: ask again
            after ``Retry-After`` for up to ``wait`` seconds, then ``InProgress``. 404: it never ran, or
            was released: sent again with its key. Unknown (the server stopped mid-request):
            ``OutcomeUnknown``, never sent again. A server that cannot tell (no such endpoint, down):
            the rule without a probe (``resend_unknown``). Default ``None``: no asking.
        status_path: where the server answers it: an absolute path on the request's origin, or a full
            URL (default ``onceonly.keystatus.STATUS_PATH``, ``"/idempotency-keys"``).
        sleep: the sleep between attempts (injectable for tests); default ``time.sleep``, or
            ``asyncio.sleep`` for the async faces.
        rng: the random source of the jitter.

    .. versionadded:: 0.1
    """

    retry: Retry
    wait: float
    max_retry_after: float
    header: str
    quoted: bool
    resend_unknown: bool
    key_methods: Iterable[str]
    replace_keys: bool
    hash_keys: bool
    hash_secret: str | bytes | None
    conflict_means: ConflictMeaning
    lookup: Lookup | None
    probe: Literal["server"] | None
    status_path: str
    sleep: Callable[[float], Any] | None
    rng: random.Random | None


class _Answer(Protocol):
    """What the rules read of a response: httpx's, httpx2's and requests' all have it."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Any: ...

    def json(self) -> Any: ...

    def raise_for_status(self) -> Any: ...


_A = TypeVar("_A", bound=_Answer)


class Attempts:
    """The state of one logical call: its key, which attempt, how long it waited on 409s."""

    __slots__ = (
        "attempt", "busy", "busy_since", "key", "pause", "probes", "repeatable", "resendable", "route", "safe",
        "waited",
    )  # fmt: skip

    def __init__(
        self, key: str | None, *, safe: bool, resendable: bool, repeatable: bool = True, route: str = ""
    ) -> None:
        self.key = key
        #: ``METHOD /path`` (no query: it may hold secrets), for the alert of a key conflict.
        self.route = route
        #: A safe method (``SAFE_METHODS``): it changes nothing on the server, with or without a key.
        self.safe = safe
        #: Whether an unknown outcome may be sent again: the key makes it safe, or the method is.
        self.resendable = resendable
        #: Whether the request can be sent again at all (a streamed body cannot).
        self.repeatable = repeatable
        self.attempt = 0
        #: The pauses asked for after 409s, and how many 409s, since when (``time.monotonic``).
        self.waited = 0.0
        self.busy = 0
        self.busy_since = 0.0
        #: Status asks made (``probe="server"``), and the pause before the next one (processing).
        self.probes = 0
        self.pause = 0.0


class _Next(enum.Enum):
    LOOKUP = "lookup"  # the 409 says the key was used already: fetch the existing result
    PROBE = "probe"  # unknown: ask the server what happened to the key (probe="server")
    FALLBACK = "fallback"  # the server could not tell: the rule without a probe


def _digest(parts: list[str]) -> str:
    return hashlib.sha256("\x1f".join(parts).encode("utf-8", "surrogatepass")).hexdigest()


def request_identity(method: str, url: Any, kwargs: dict[str, Any]) -> str:
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
    return _digest(parts)


def _sent_identity(method: str, url: str, body: bytes | None, content_type: str | None) -> str:
    """``request_identity`` of a request as it goes out (a transport's view): method, URL and body.

    A multipart body's boundary is random on every build (an SDK's retry builds the request again), so
    it is left out: the same upload is the same operation.
    """
    body = body or b""
    if body and content_type and "boundary=" in content_type:
        boundary = content_type.split("boundary=", 1)[1].split(";", 1)[0].strip().strip('"')
        if boundary:
            body = body.replace(boundary.encode("utf-8", "replace"), b"")
    return _digest([method, url, hashlib.sha256(body).hexdigest()])


def ledger_key(lease: _runtime.Lease, identity: str) -> str:
    """The key of a keyed request of the running attempt: the ledger's for the first request, then
    ``key#2``, ``key#3``… for each other one, in the order they are first sent; the same request sent
    again (the tool's own retry, an SDK's) keeps its key.

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


def lookup_headers(headers: Mapping[str, Any], key_header: str) -> dict[str, Any]:
    """The headers of a lookup: the keyed request's (its credentials), but for its key and its body's."""
    drop = _NOT_FOR_LOOKUP | {key_header.lower()}
    return {name: value for name, value in headers.items() if name.lower() not in drop}


class Rules:
    """The options and every decision the faces share: which key, and what to do with each answer.

    The faces (``Client``, ``Transport``, ``RequestsAdapter``, their async twins) only send, and run
    one of the two loops below (``run``, ``arun``).
    """

    _default_sleep: Callable[[float], Any]

    def __init__(self, *, raise_for_status: bool = False, **options: Unpack[Options]) -> None:
        unknown = set(options) - Options.__optional_keys__
        if unknown:
            raise TypeError(
                f"{type(self).__name__}: unknown option(s) {', '.join(sorted(unknown))}; "
                f"the options are {', '.join(sorted(Options.__optional_keys__))}"
            )
        self.retry = options.get("retry", DEFAULT_RETRY)
        self.wait = options.get("wait", 30.0)
        self.max_retry_after = options.get("max_retry_after", 60.0)
        check_seconds(self.wait, f"wait={self.wait!r}")
        check_seconds(self.max_retry_after, f"max_retry_after={self.max_retry_after!r}")
        self.header = options.get("header", "Idempotency-Key")
        self.quoted = options.get("quoted", False)
        self.resend_unknown = options.get("resend_unknown", True)
        self.raise_for_status = raise_for_status
        self.key_methods = frozenset(m.upper() for m in options.get("key_methods", ("POST", "PUT", "PATCH", "DELETE")))
        self.replace_keys = options.get("replace_keys", False)
        self.rng = options.get("rng") or random.Random()
        sleep = options.get("sleep")
        self.sleep: Callable[[float], Any] = sleep if sleep is not None else self._default_sleep
        hash_secret = options.get("hash_secret")
        if hash_secret is not None and not options.get("hash_keys", False):
            raise TypeError("hash_secret= is the secret of hash_keys=True: give hash_keys=True too, or no secret")
        # Kept private and out of every message: the secret is what makes the hash unguessable.
        self._secret = _secret(hash_secret) if options.get("hash_keys", False) else None
        self.conflict_means = check_conflict_means(options.get("conflict_means", "in_progress"))
        self.lookup = options.get("lookup")
        self._check_lookup()
        self.probe = options.get("probe")
        if self.probe not in (None, "server"):
            raise ValueError(
                f"probe={self.probe!r}: give 'server' (ask the server's key status endpoint about an unknown "
                "outcome) or None"
            )
        self.status_path = options.get("status_path", STATUS_PATH)
        if not isinstance(self.status_path, str) or not self.status_path.startswith(("/", "http://", "https://")):
            raise ValueError(
                f"status_path={self.status_path!r}: give an absolute path such as {STATUS_PATH!r} or a full "
                "http(s) URL, where the server answers GET {status_path}/{key}"
            )

    @property
    def hash_keys(self) -> bool:
        return self._secret is not None

    def _check_lookup(self) -> None:
        lookup = self.lookup
        if lookup is None:
            return
        if self.conflict_means != "exists":
            raise TypeError(
                "lookup= fetches the result of a key the server says was used already: it goes with "
                "conflict_means='exists' (with 'in_progress' a 409 is waited out)"
            )
        if isinstance(lookup, str):
            try:
                lookup.format(key="k")
            except (KeyError, IndexError, ValueError) as exc:
                raise ValueError(
                    f"lookup={lookup!r}: a URL template with {{key}} and no other field, such as "
                    f"'/tickets/by-idempotency-key/{{key}}' ({type(exc).__name__}: {exc})"
                ) from exc
            if "{key}" not in lookup:
                raise ValueError(f"lookup={lookup!r}: the template must hold {{key}}, where the key goes")
        elif not callable(lookup):
            raise TypeError(
                f"lookup={lookup!r}: give a URL template with {{key}}, or a function of the key that "
                "returns the existing result (or None)"
            )

    # --- the key ------------------------------------------------------------------------------

    def _wire(self, ledger_key: str) -> str:
        """What a ledger key is on the wire: its keyed hash under ``hash_keys``, else ``header_key``."""
        return header_key(ledger_key) if self._secret is None else hash_key(ledger_key, self._secret)

    def _put(self, headers: MutableMapping[str, Any], wire: str) -> None:
        headers[self.header] = f'"{wire}"' if self.quoted else wire

    def _named(self, given: str | bytes | None) -> str | None:
        """The key in a key header's value (inside the quotes of the draft's sf-string when ``quoted``)."""
        if isinstance(given, bytes):  # requests lets a header value be bytes
            given = given.decode("latin-1")
        if given is not None and self.quoted and len(given) >= 2 and given[0] == given[-1] == '"':
            given = given[1:-1]
        if given is not None and not given:
            raise TypeError(f"idempotency key {given!r}: a key is a non-empty string, e.g. 'order-42'")
        return given

    def _is_keyed(self, method: str, headers: Mapping[str, Any]) -> bool:
        """Whether a transport sends this request with a key (and so may send it more than once)."""
        if headers.get(self.header) is not None:
            return True
        return _runtime.CURRENT.get() is not None and method.upper() in self.key_methods

    def _begin(
        self, method: str, url: str, headers: MutableMapping[str, Any], body: Callable[[], bytes | None]
    ) -> Attempts:
        """A transport's call for one request: the key it already carries (the caller's or an SDK's),
        else, in a guarded call, the ledger's (numbered, put in ``headers``); else none."""
        method = method.upper()
        safe = method in SAFE_METHODS
        key = self._named(headers.get(self.header))
        lease = _runtime.CURRENT.get()
        if key is None or (self.replace_keys and lease is not None and method in self.key_methods):
            if lease is None or method not in self.key_methods:
                return Attempts(None, safe=safe, resendable=safe)
            content_type = headers.get("content-type")
            identity = _sent_identity(method, url, body(), content_type if isinstance(content_type, str) else None)
            key = self._wire(ledger_key(lease, identity))
            self._put(headers, key)
        return Attempts(key, safe=safe, resendable=self.resend_unknown or safe, route=route_of(method, url))

    # --- each answer --------------------------------------------------------------------------

    def _on_response(self, call: Attempts, response: _Answer) -> float | _Next | None:
        """``None``: return ``response``. Seconds: try again after them. ``PROBE``: ask the server about
        the key (``probe="server"``, an unknown outcome). ``LOOKUP``: fetch the result of
        the used key. Raises for the rest."""
        status = response.status_code
        if status < 400:
            return None
        retry_after = retry_after_seconds(response.headers.get("retry-after"))
        if call.key is not None and status == 409:
            if self.conflict_means == "exists":
                if self.lookup is None:
                    raise self._used(call, "no lookup= is set to fetch its result")
                return _Next.LOOKUP
            return self._busy(call, retry_after)
        if call.key is not None and status == 422 and _is_key_problem(response):
            conflict = KeyConflict(
                f"the server refused key {call.key!r}: it was used with another request "
                f"({_detail(response)}). Use a new key for a new operation",
                key=call.key,
                record=None,
                fingerprint="",
            )
            _alert_conflict(conflict, call.route)
            raise conflict
        verdict = classify_status(status, response.headers.get("retry-after")).verdict
        if verdict is Verdict.UNKNOWN and self._probes(call):
            return _Next.PROBE
        if self._again(call, verdict, retry_after):
            return self.retry.backoff(call.attempt, self.rng, floor=retry_after)
        if self.raise_for_status:
            response.raise_for_status()
        return None

    def _busy(self, call: Attempts, retry_after: float | None) -> float:
        """The pause after a 409 meaning "in progress": another request with this key is running.

        Waiting costs no attempt, only time. Time on the clock since the first 409 (the answers take
        time too), or the pauses asked for if more (an injected sleep may not sleep); each pause at
        least a floor that grows, so a Retry-After of 0 or in the past still ends in InProgress after
        ``wait`` seconds.
        """
        assert call.key is not None
        now = time.monotonic()
        if not call.busy:
            call.busy_since = now
        floor = min(_BUSY_FLOOR * 2**call.busy, _BUSY_FLOOR_CAP)
        call.busy += 1
        seconds = max(retry_after, floor) if retry_after is not None else self.retry.backoff(1, self.rng, floor=floor)
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

    def _on_error(self, call: Attempts, exc: Exception) -> float | _Next:
        """Seconds to wait before trying again, ``PROBE`` (an unknown outcome the server is asked about),
        or raises ``exc`` when it is final."""
        got = classify(exc)
        if got.verdict is Verdict.UNKNOWN and self._probes(call):
            return _Next.PROBE
        if self._again(call, got.verdict, got.retry_after):
            return self.retry.backoff(call.attempt, self.rng, floor=got.retry_after)
        raise exc

    # --- asking the server (probe="server") ----------------------------------------------------

    def _probes(self, call: Attempts) -> bool:
        """Whether an unknown outcome of ``call`` is settled by asking the server: a keyed request, a
        probing face, and fewer asks than attempts (a replay lost again and again must end)."""
        return self.probe == "server" and call.key is not None and call.probes < self.retry.attempts

    def _target(self, call: Attempts, method: str, request_url: str) -> dict[str, str] | None:
        """What a dispatch reports of a keyed request under ``probe="server"`` (``runtime.mark_sent``):
        the method, the URL without query or fragment (they may hold secrets), the key and where the
        server tells its status; ``None`` otherwise. Never a header: credentials stay out of records."""
        if self.probe != "server" or call.key is None:
            return None
        parts = urlsplit(request_url)
        url = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}{parts.path}"
        return {"method": method.upper(), "url": url, "key": call.key, "status": self._status_url(call, url)}

    def _status_url(self, call: Attempts, request_url: str) -> str:
        assert call.key is not None
        return status_url(request_url, call.key, self.status_path)

    def _on_probe(self, call: Attempts, says: ServerSays) -> float | _Next:
        """What the server's word on the key means: seconds before sending again (completed: to get
        the replay; not run), ``PROBE`` (ask again after ``call.pause``), ``FALLBACK``; or raises."""
        call.probes += 1
        call.pause = 0.0
        told = says.told
        if told is Told.NO_ANSWER or not call.repeatable:
            return _Next.FALLBACK
        if told is Told.COMPLETED:
            call.attempt -= 1  # the replay is what the lost answer was: it costs no attempt
            return 0.0
        if told is Told.NOT_RUN:
            if call.attempt < self.retry.attempts:
                return self.retry.backoff(call.attempt, self.rng)
            raise NotRun(
                f"{says.detail}: the request with key {call.key!r} did not run, and no attempt is left; "
                "send it again with the same key",
                key=call.key or "",
            )
        if told is Told.PROCESSING:
            call.probes -= 1  # waiting costs no ask, only time (bounded by wait=)
            call.pause = self._busy(call, says.retry_after)
            return _Next.PROBE
        raise OutcomeUnknown(
            f"{says.detail}: whether the request with key {call.key!r} took effect is not known, and sending "
            "it again would run it again. Inside a guarded tool the ledger settles it (on_unknown); outside "
            "one, check the effect on the server before sending a new request",
            key=call.key or "",
        )

    def _fallback(self, call: Attempts) -> float | None:
        """The rule without a probe for an unknown outcome: seconds before resending, or ``None`` (final)."""
        if self._again(call, Verdict.UNKNOWN, None):
            return self.retry.backoff(call.attempt, self.rng)
        return None

    def _final(self, last: Any) -> Any:
        """The last answer of a call the server could not settle: raised (an error, or a status with
        ``raise_for_status``), else returned."""
        if isinstance(last, BaseException):
            raise last
        if self.raise_for_status:
            last.raise_for_status()
        return last

    def _again(self, call: Attempts, verdict: Verdict, retry_after: float | None) -> bool:
        if call.attempt >= self.retry.attempts or not call.repeatable:
            return False
        if retry_after is not None and retry_after > self.max_retry_after:
            return False
        if verdict in (Verdict.NOT_SENT, Verdict.NOT_EXECUTED):
            return True
        # Unknown: the request may have run. Sending it again is safe only with its key or a safe method.
        return verdict is Verdict.UNKNOWN and call.resendable

    # --- the result of a used key -------------------------------------------------------------

    def _used(self, call: Attempts, why: str) -> KeyAlreadyUsed:
        return KeyAlreadyUsed(
            f"the server answered 409 to key {call.key!r}: the key was used already, so the operation "
            f"happened, and {why}. Inside a guarded tool the ledger settles it (on_unknown: a probe that "
            "looks the result up by the key, or review); outside one, look the result up by the key",
            key=call.key or "",
        )

    def _lookup_url(self, call: Attempts, request_url: str) -> str:
        assert isinstance(self.lookup, str) and call.key is not None
        return urljoin(request_url, self.lookup.format(key=quote(call.key, safe="")))

    def _found(self, call: Attempts, answer: _Answer) -> bool:
        """Whether a lookup's answer is the result (marked a replay); else the caller closes it and
        raises ``_not_found``."""
        if 200 <= answer.status_code < 300:
            answer.headers[REPLAYED] = "true"
            return True
        return False

    def _not_found(self, call: Attempts, answer: _Answer) -> KeyAlreadyUsed:
        status = answer.status_code
        return self._used(call, "the lookup found nothing" if status == 404 else f"the lookup answered HTTP {status}")

    def _given(self, call: Attempts, found: Any) -> Any:
        """The result a ``lookup=`` function returned; ``None`` raises ``KeyAlreadyUsed``."""
        if found is None:
            raise self._used(call, "the lookup returned None")
        return found


def _is_problem(response: _Answer) -> bool:
    value: str = response.headers.get("content-type", "")
    return value.split(";", maxsplit=1)[0].strip().lower() == "application/problem+json"


def _is_key_problem(response: _Answer) -> bool:
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


def route_of(method: str, url: Any) -> str:
    return f"{method} {urlsplit(str(url)).path or '/'}"


def _alert_conflict(conflict: KeyConflict, route: str) -> None:
    """The KeyConflict alert of a server's 422: the request's method and path and a hash of the key;
    inside a guarded call, its tool and scope too."""
    lease = _runtime.CURRENT.get()
    rec = None if lease is None else lease.record
    key_conflict(
        conflict,
        f"{route}: the server refused a key used before with another request (422)",
        source="http",
        key=short_key(conflict.key),
        tool=None if rec is None else rec.tool,
        scope=None if rec is None else rec.scope,
        route=route,
    )


def _detail(response: _Answer) -> str:
    try:
        doc = response.json()
    except ValueError:
        return f"HTTP {response.status_code}"
    return str(doc.get("detail") or doc.get("title") or f"HTTP {response.status_code}")


def needs_mark_sent(call: Attempts) -> bool:
    """Whether a request that may change something runs in a guarded call still ``pending`` (a
    ``reports_dispatch`` tool).

    Decided by the method, not by the key: a PUT outside ``key_methods`` changes things all the same,
    and left ``pending`` its unknown outcome would read as "never sent" and be run again. A safe
    method (a lookup before the side effect) does not mark. Asks the ledger's current call, so that a
    call already ``in_flight`` costs nothing (the async ``amark_sent`` would hop to a thread for a no-op).
    """
    if call.safe:
        return False
    info = _runtime.current_call()
    return info is not None and info.state is State.PENDING


# --- the two loops: every face sends through one of them -------------------------------------------


def run(
    rules: Rules,
    call: Attempts,
    send: Callable[[], _A],
    close: Callable[[_A], object],
    lookup: Callable[[_A], _A],
    errors: tuple[type[Exception], ...],
    probe: Callable[[], ServerSays] | None = None,
) -> _A:
    """Send one keyed call until ``rules`` say it is done: its response, or raises. ``lookup`` gets the
    (closed) 409 that says the key was used already, and returns the existing result's answer;
    ``probe`` asks the server's key status endpoint (``probe="server"``)."""
    while True:
        call.attempt += 1
        last: Any
        got: float | _Next | None
        try:
            response = send()
        except errors as exc:
            got = rules._on_error(call, exc)
            last = exc
        else:
            try:
                got = rules._on_response(call, response)
            except Exception:
                close(response)  # a final answer raised as an error: its connection goes back
                raise
            if got is None:
                return response
            if got is not _Next.PROBE:
                close(response)
            if got is _Next.LOOKUP:
                return lookup(response)
            last = response
        if got is _Next.PROBE:
            assert probe is not None
            try:
                while got is _Next.PROBE:
                    if call.pause:
                        rules.sleep(call.pause)
                    got = rules._on_probe(call, probe())
                if got is _Next.FALLBACK:
                    got = rules._fallback(call)
                    if got is None:
                        result: _A = rules._final(last)  # the answer the server could not settle
                        last = None
                        return result
            except BaseException as exc:
                if isinstance(last, BaseException) and exc is not last:
                    raise exc from last
                raise
            finally:
                if last is not None and not isinstance(last, BaseException):
                    close(last)
        assert isinstance(got, float | int)
        rules.sleep(got)


async def arun(
    rules: Rules,
    call: Attempts,
    send: Callable[[], Awaitable[_A]],
    close: Callable[[_A], Awaitable[object]],
    lookup: Callable[[_A], Awaitable[_A]],
    errors: tuple[type[Exception], ...],
    probe: Callable[[], Awaitable[ServerSays]] | None = None,
) -> _A:
    """``run``, awaited."""
    while True:
        call.attempt += 1
        last: Any
        got: float | _Next | None
        try:
            response = await send()
        except errors as exc:
            got = rules._on_error(call, exc)
            last = exc
        else:
            try:
                got = rules._on_response(call, response)
            except Exception:
                await close(response)
                raise
            if got is None:
                return response
            if got is not _Next.PROBE:
                await close(response)
            if got is _Next.LOOKUP:
                return await lookup(response)
            last = response
        if got is _Next.PROBE:
            assert probe is not None
            try:
                while got is _Next.PROBE:
                    if call.pause:
                        await rules.sleep(call.pause)
                    got = rules._on_probe(call, await probe())
                if got is _Next.FALLBACK:
                    got = rules._fallback(call)
                    if got is None:
                        result: _A = rules._final(last)
                        last = None
                        return result
            except BaseException as exc:
                if isinstance(last, BaseException) and exc is not last:
                    raise exc from last
                raise
            finally:
                if last is not None and not isinstance(last, BaseException):
                    await close(last)
        assert isinstance(got, float | int)
        await rules.sleep(got)


def close_response(response: Any) -> None:
    response.close()


async def aclose_response(response: Any) -> None:
    await response.aclose()


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
