"""What the middleware, the transactional mode and the ticket service share: the key header and its
rules, the fingerprint, the stored response and problem details. Pure, no I/O beyond building ASGI
messages. The rule for a key on the wire itself is in ``onceonly.keys``, where the HTTP client
(``onceonly.http``) takes it from without loading the server.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, Collection, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from onceonly.callers import MIN_SECRET, check_secret
from onceonly.keys import MAX_KEY_LENGTH, is_wire_key

__all__ = [
    "CONTEXT_KEY",
    "DEFAULT_PROBLEM_DOCS",
    "DEFAULT_REPLAY_HEADERS",
    "KEY_HEADERS",
    "BadKey",
    "IdempotencyContext",
    "Replay",
    "StoredResponse",
    "authorization_identity",
    "client_hash",
    "idempotency_context",
    "parse_key",
    "problem_messages",
    "request_key",
    "store_key",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: The page that documents the middleware's answers, if any: each problem's ``type`` is then this URL
#: plus ``#`` and the problem's name (``#missing-key``), as the Idempotency-Key draft asks for a link to
#: documentation. onceonly publishes no such page of its own, so none is assumed: an application passes
#: ``IdempotencyMiddleware(problem_docs="https://…")``, the page where its API documents them.
DEFAULT_PROBLEM_DOCS: str | None = None

#: Where the middleware puts the request's ``IdempotencyContext`` in the ASGI scope.
CONTEXT_KEY = "onceonly.idempotency"

#: Response headers a replay repeats; every other header of the first response is dropped, since
#: some (Set-Cookie, Date, a request id) must never be sent twice or to another request.
#: ``content-encoding`` and ``vary`` travel with the body they describe: a body compressed inside
#: the middleware is stored compressed, and a replay without them would be unreadable.
DEFAULT_REPLAY_HEADERS: frozenset[str] = frozenset(
    {
        "content-encoding",
        "content-language",
        "content-location",
        "content-type",
        "etag",
        "last-modified",
        "link",
        "location",
        "vary",
    }
)

#: Statuses whose responses have no body and, for 204, must not carry Content-Length (RFC 9110 8.6).
_NO_BODY_STATUSES = frozenset({*range(100, 200), 204, 304})

#: The request headers that carry a key (lower case, as in an ASGI scope): the draft's and the older form.
KEY_HEADERS: tuple[bytes, ...] = (b"idempotency-key", b"x-idempotency-key")


class BadKey(ValueError):
    """An ``Idempotency-Key`` header that is not a key; the message says what is wrong with it."""


def parse_key(raw: bytes) -> str:
    """The key of one ``Idempotency-Key`` header value.

    Both forms are accepted: the IETF draft's structured-field string (``"8e03978e"``, RFC 8941
    section 3.3.3, with ``\\"`` and ``\\\\`` escapes) and a bare token (``8e03978e``, as Stripe
    takes it). After unquoting, a key is 1-255 visible ASCII characters (no space, no control).

    Raises:
        BadKey: anything else; the message names the problem and the position.

    .. versionadded:: 0.1
    """
    try:
        text = raw.decode("ascii").strip(" \t")
    except UnicodeDecodeError:
        raise BadKey("the key has non-ASCII bytes: a key is 1-255 visible ASCII characters") from None
    if text.startswith('"'):
        text = _unquote(text)
    if is_wire_key(text):
        return text
    if not text:
        raise BadKey("the key is empty: a key is 1-255 visible ASCII characters")
    if len(text) > MAX_KEY_LENGTH:
        raise BadKey(f"the key is {len(text)} characters long; the limit is {MAX_KEY_LENGTH}")
    pos = next(i for i, ch in enumerate(text) if not "!" <= ch <= "~")
    raise BadKey(f"the key has {text[pos]!r} at position {pos}: a key is visible ASCII, without spaces")


def request_key(scope: Scope) -> str | None:
    """The key of a request: its ``Idempotency-Key`` or ``X-Idempotency-Key`` header, else ``None``.

    Raises:
        BadKey: a header that is not a key, or several headers with keys that differ.
    """
    found: str | None = None
    for name, value in scope.get("headers", ()):
        if name in KEY_HEADERS:
            key = parse_key(value)
            if found is not None and key != found:
                raise BadKey("the request has several idempotency keys that differ: send exactly one")
            found = key
    return found


def _unquote(text: str) -> str:
    """The content of an sf-string: ``"`` ... ``"`` with only ``\\"`` and ``\\\\`` escaped."""
    if len(text) < 2 or not text.endswith('"'):
        raise BadKey("the key opens a quoted string and does not close it")
    out: list[str] = []
    i, end = 1, len(text) - 1
    while i < end:
        ch = text[i]
        if ch == "\\":
            if i + 1 >= end or text[i + 1] not in '"\\':
                raise BadKey(f'the quoted key has a bad escape at position {i}: only \\" and \\\\ may be escaped')
            out.append(text[i + 1])
            i += 2
            continue
        if ch == '"':
            raise BadKey(f"the quoted key has an unescaped quote at position {i}")
        out.append(ch)
        i += 1
    return "".join(out)


def authorization_identity(scope: Scope) -> str:
    """The default client identity: the ``Authorization`` header as sent ("" when absent).

    The middleware hashes what this returns before it stores or logs anything, so credentials never
    reach the store. Requests without ``Authorization`` all share one anonymous namespace: pass your
    own ``client_identity=`` when clients are told apart otherwise (a cookie, mTLS, an API key header).

    .. versionadded:: 0.1
    """
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return str(value.decode("latin-1"))
    return ""


#: The shortest client secret: 128 bits.
MIN_CLIENT_SECRET = MIN_SECRET


def check_client_secret(secret: object) -> bytes:
    """``secret`` as bytes if it can key the client hash (bytes or text, 16 bytes or more), else an error."""
    return check_secret(secret, "client_secret=")


def client_hash(identity: str, secret: bytes) -> str:
    """The 128-bit hex digest of a client identity, keyed by ``secret`` (HMAC-SHA256): what the store
    and the logs see. Without the secret a digest cannot be matched against guessed credentials.

    ``secret`` is the middleware's ``client_secret`` (16 bytes or more).

    .. versionadded:: 0.1
    """
    return ClientHasher(check_client_secret(secret))(identity)


class ClientHasher:
    """``client_hash`` with one secret, for every request: an HMAC-SHA256 keyed once, copied per call
    (``hmac``'s copy skips the key's setup; the digest is ``hmac.new``'s)."""

    __slots__ = ("_keyed",)

    def __init__(self, secret: bytes) -> None:
        self._keyed = hmac.new(secret, digestmod=hashlib.sha256)

    def __call__(self, identity: str) -> str:
        mac = self._keyed.copy()
        mac.update(identity.encode("utf-8", "surrogatepass"))
        return mac.hexdigest()[:32]


def store_key(prefix: str, client: str, key: str) -> str:
    """``prefix:client:k:KEY``, or ``prefix:client:h:SHA256(KEY)`` when that would pass 255 characters.

    The ``k``/``h`` marker keeps a client's literal key apart from another key's hash.
    """
    literal = f"{prefix}:{client}:k:{key}"
    if len(literal) <= MAX_KEY_LENGTH:
        return literal
    return f"{prefix}:{client}:h:{hashlib.sha256(key.encode('ascii')).hexdigest()}"


def fingerprint_start(method: str, path: str, query: bytes) -> Any:
    """A SHA-256 over method, path and query (length-prefixed); the body is fed to it after."""
    digest = hashlib.sha256()
    for part in (method.encode("ascii", "replace"), path.encode("utf-8", "surrogateescape"), query):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest


@dataclass(frozen=True, slots=True)
class IdempotencyContext:
    """What the middleware learnt about a request with a key; in ``scope["onceonly.idempotency"]``.

    Attributes:
        key: the key as the client sent it, unquoted.
        client: the keyed hash of the client's identity (``client_hash``).
        store_key: the key under which this client's key is kept (``http:CLIENT:k:KEY``).
        fingerprint: SHA-256 of method, path, query and body.

    .. versionadded:: 0.1
    """

    key: str
    client: str
    store_key: str
    fingerprint: str


def idempotency_context(scope_or_request: Any) -> IdempotencyContext | None:
    """The ``IdempotencyContext`` of a request (an ASGI scope, or anything with ``.scope``), if any.

    .. versionadded:: 0.1
    """
    scope = getattr(scope_or_request, "scope", scope_or_request)
    ctx = scope.get(CONTEXT_KEY)
    return ctx if isinstance(ctx, IdempotencyContext) else None


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as kept for replays: status, the allow-listed headers, the body.

    Stored as JSON: ``{"status": 201, "headers": [["content-type", "…"]], "body": "…",
    "encoding": "utf-8" | "base64"}``; a body that is not UTF-8 is kept in base64.

    .. versionadded:: 0.1
    """

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes

    def to_json(self) -> str:
        try:
            text, encoding = self.body.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            text, encoding = base64.b64encode(self.body).decode("ascii"), "base64"
        return json.dumps(
            {"status": self.status, "headers": [list(h) for h in self.headers], "body": text, "encoding": encoding},
            separators=(",", ":"),
            ensure_ascii=False,
        )

    @classmethod
    def from_json(cls, text: str) -> StoredResponse:
        """Decode a stored response. Raises ``ValueError`` for anything that is not one."""
        try:
            data = json.loads(text)
            body = data["body"]
            raw = base64.b64decode(body, validate=True) if data["encoding"] == "base64" else body.encode("utf-8")
            headers = tuple((str(k), str(v)) for k, v in data["headers"])
            return cls(int(data["status"]), headers, raw)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a stored response: {exc}") from exc

    @classmethod
    def build(
        cls,
        status: int,
        headers: Iterable[tuple[bytes | str, bytes | str]],
        body: bytes,
        allow: Collection[str] | None,
    ) -> StoredResponse:
        """A response with its header names lower-cased, keeping only those in ``allow`` (lower case;
        ``None`` keeps them all)."""
        kept = []
        for name, value in headers:
            n = name.decode("latin-1") if isinstance(name, bytes) else name
            n = n.lower()
            if allow is None or n in allow:
                kept.append((n, value.decode("latin-1") if isinstance(value, bytes) else value))
        return cls(status, tuple(kept), body)

    def messages(self, *, replayed: bool = True) -> tuple[Message, Message]:
        """The two ASGI messages that send this response, marked ``Idempotent-Replayed: true``."""
        headers = [(n.encode("latin-1"), v.encode("latin-1")) for n, v in self.headers]
        if self.status not in _NO_BODY_STATUSES:
            headers.append((b"content-length", str(len(self.body)).encode("ascii")))
        if replayed:
            headers.append((b"idempotent-replayed", b"true"))
        start = {"type": "http.response.start", "status": self.status, "headers": headers}
        return start, {"type": "http.response.body", "body": self.body, "more_body": False}


class Replay(Exception):
    """The key was already completed: answer with ``response`` and run nothing.

    The transactional mode raises it from ``IdempotencyTable.begin``; ``IdempotencyMiddleware``
    turns it into the replayed response. Without the middleware, catch it and send ``response``.

    .. versionadded:: 0.1
    """

    def __init__(self, key: str, response: StoredResponse) -> None:
        super().__init__(f"{key!r} was already completed: replay its response ({response.status})")
        self.key = key
        self.response = response


def check_problem_docs(url: str | None) -> str | None:
    """``url`` if it can be the documentation link of problems, else ``ValueError`` saying why."""
    if url is None:
        return None
    if not (
        isinstance(url, str)
        and url.startswith(("https://", "http://"))
        and url.isascii()
        and url.isprintable()
        and not any(c in url for c in ' #<>"')
    ):
        raise ValueError(
            f"problem_docs={url!r}: give the absolute http(s) URL of the page that documents your "
            "idempotency rules, in ASCII, without spaces or a #fragment (each problem adds its own, such "
            "as #missing-key), or None for urn: problem types without a link"
        )
    return url


def problem_messages(
    status: int,
    title: str,
    detail: str,
    *,
    slug: str,
    headers: Sequence[tuple[bytes, bytes]] = (),
    extra: dict[str, Any] | None = None,
    docs: str | None = DEFAULT_PROBLEM_DOCS,
) -> tuple[Message, Message]:
    """An ``application/problem+json`` response (RFC 9457), as two ASGI messages.

    With ``docs`` (an http(s) URL, see ``check_problem_docs``) the ``type`` is ``docs#slug`` and a
    ``Link: <docs#slug>; rel="describedby"`` header repeats it; without, ``urn:onceonly:problem:slug``.
    """
    kind = f"{docs}#{slug}" if docs else f"urn:onceonly:problem:{slug}"
    doc: dict[str, Any] = {"type": kind, "title": title, "status": status, "detail": detail}
    if extra:
        doc.update(extra)
    body = json.dumps(doc, ensure_ascii=False).encode("utf-8")
    head = [(b"content-type", b"application/problem+json"), (b"content-length", str(len(body)).encode("ascii"))]
    if docs:
        head.append((b"link", f'<{kind}>; rel="describedby"; type="text/html"'.encode("ascii")))
    start = {"type": "http.response.start", "status": status, "headers": [*head, *headers]}
    return start, {"type": "http.response.body", "body": body, "more_body": False}
