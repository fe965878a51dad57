"""The key status endpoint of ``IdempotencyMiddleware(status_path=...)``: ``GET {status_path}/{key}``
tells the calling client what the server knows of one of its keys, so that a client whose answer was
lost can settle the outcome instead of guessing.

What a status says is only what a retry with the same key will meet: replayed, refused while it runs,
or run. It never carries the stored body (that stays behind the replay, which the client gets by
resending the request with its key), and it is scoped like the guarded requests: another client's key
is not found. Both modes build their ``KeyStatus`` (``_stored.StoredMode.status``,
``IdempotencyTable.status``); this module turns it into the answer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Literal

from onceonly.keys import is_wire_key
from onceonly.keystatus import STATUS_PATH

from ._answers import Problems
from ._http import BadKey, Message

__all__ = ["DEFAULT_STATUS_PATH", "KeyStatus", "check_status_path", "key_of", "status_messages"]

#: The path the client side (``onceonly.http``'s ``probe="server"``) asks by default.
DEFAULT_STATUS_PATH = STATUS_PATH

Found = Literal["processing", "completed", "unknown"]
Missing = Literal["no-record", "expired"]
#: What a retry with the key meets: its stored response replayed, a 409 (in progress or held for a
#: person), a new run, or an error until the operator repairs the record.
Retry = Literal["replays", "waits", "runs", "refused"]


@dataclass(frozen=True, slots=True)
class KeyStatus:
    """What the server knows of one key of one client.

    Attributes:
        state: ``"processing"`` (a request with the key runs now), ``"completed"`` (its response is
            stored and replayed), ``"unknown"`` (a request started and its end was not recorded: the
            server stopped while it ran), or, answered as 404, ``"no-record"`` (never seen, or released
            after a failure: a retry runs) and ``"expired"`` (completed, and its ``ttl`` passed).
        retry: what a retry with the key meets (``"replays"``, ``"waits"``, ``"runs"``, ``"refused"``).
        status: the stored response's status code (completed only).
        stored_at: when the response was stored (seconds since the epoch).
        expires_at: when a completed key stops being replayed; for ``"processing"``, when the claim
            goes stale if the server stops renewing it.

    .. versionadded:: 0.1
    """

    state: Found | Missing
    retry: Retry
    status: int | None = None
    stored_at: float | None = None
    expires_at: float | None = None

    @property
    def found(self) -> bool:
        return self.state not in ("no-record", "expired")


def check_status_path(path: str | None) -> str | None:
    """``path`` if the endpoint can live there (``/a/b``: absolute, ASCII, no trailing ``/``, no query)."""
    if path is None:
        return None
    if not (
        isinstance(path, str)
        and path.startswith("/")
        and len(path) > 1
        and not path.endswith("/")
        and path.isascii()
        and path.isprintable()
        and not any(c in path for c in " ?#%")
    ):
        raise ValueError(
            f"status_path={path!r}: give an absolute path such as {DEFAULT_STATUS_PATH!r} (ASCII, no space, "
            "query, % or trailing /), under which GET {status_path}/{key} answers, or None to serve none"
        )
    return path


def key_of(path: str, prefix: str) -> str:
    """The key a status request asks about: the rest of the (percent-decoded) path after ``prefix``.

    Raises:
        BadKey: the rest is not a key (1-255 visible ASCII characters).
    """
    key = path[len(prefix) :]
    if is_wire_key(key):
        return key
    if not key:
        raise BadKey("the path names no key: ask GET {status_path}/{key}, the key percent-encoded")
    if not key.isascii():
        raise BadKey("the key has non-ASCII characters: a key is 1-255 visible ASCII characters")
    raise BadKey("the key is not 1-255 visible ASCII characters (percent-encode it in the path)")


def _when(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def status_messages(key: str, found: KeyStatus, problems: Problems) -> tuple[Message, Message]:
    """The answer to ``GET {status_path}/{key}``: the JSON document, or 404 problem+json."""
    no_store = [(b"cache-control", b"no-store")]
    if not found.found:
        if found.state == "expired":
            detail = (
                "this key was completed, and its stored response expired: the server keeps nothing of it, "
                "and a retry with this key runs the request again"
            )
        else:
            detail = (
                "the server has no record of this key for this client: a request with it never arrived, or "
                "it failed and was released (or its record expired and was removed); a retry with this key runs"
            )
        extra = {"key": key, "state": found.state, "retry": "runs", "expired_at": _when(found.expires_at)}
        return problems.problem(
            404, "Idempotency key not found", detail, slug="unknown-key", headers=no_store, extra=extra
        )
    doc = {
        "key": key,
        "state": found.state,
        "status": found.status,
        "stored_at": _when(found.stored_at),
        "expires_at": _when(found.expires_at),
        "replay": found.retry == "replays",
        "retry": found.retry,
    }
    body = json.dumps(doc, ensure_ascii=True).encode("ascii")
    head = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode("ascii")),
        *no_store,
    ]
    if found.retry == "waits":
        head.append((b"retry-after", str(problems.retry_after).encode("ascii")))
    start = {"type": "http.response.start", "status": 200, "headers": head}
    return start, {"type": "http.response.body", "body": body, "more_body": False}
