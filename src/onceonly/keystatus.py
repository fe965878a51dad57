"""What a server's key status endpoint says (``IdempotencyMiddleware(status_path=...)``): the URL of
``GET {status_path}/{key}`` and the reading of its answer. Pure, no I/O: the HTTP clients
(``onceonly.http``'s ``probe="server"``) and the reconciler ask, and both read the answer here.

    completed  ─▶ the request ran; resending it with the same key gets the stored response (a replay)
    processing ─▶ it runs now: ask again after Retry-After, or leave the outcome unknown
    unknown    ─▶ it started and its end was not recorded (the server stopped mid-request): unknown
    not run    ─▶ 404: no record (never arrived, released after a failure, or expired): send again
    no answer  ─▶ the server has no such endpoint, or could not be asked: settle as before
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urljoin

__all__ = ["STATUS_PATH", "ServerSays", "Told", "read_status", "status_url"]

#: Where ``IdempotencyMiddleware(status_path=...)`` serves the endpoint by default, and where the
#: clients ask unless told otherwise (``onceonly.server.DEFAULT_STATUS_PATH`` is this).
STATUS_PATH = "/idempotency-keys"


class Told(enum.Enum):
    """What the server said of a key.

    .. versionadded:: 0.1
    """

    COMPLETED = "completed"
    PROCESSING = "processing"
    UNKNOWN = "unknown"
    NOT_RUN = "not_run"
    NO_ANSWER = "no_answer"


@dataclass(frozen=True, slots=True)
class ServerSays:
    """The reading of one status answer: ``told``, the stored ``status`` code (completed), the
    seconds ``retry_after`` (processing), and ``detail``, a sentence for logs and records.

    .. versionadded:: 0.1
    """

    told: Told
    status: int | None = None
    retry_after: float | None = None
    detail: str = ""


def status_url(request_url: str, key: str, path: str = STATUS_PATH) -> str:
    """The URL that asks for ``key`` on the server of ``request_url``: ``path`` (absolute, on the
    request's origin, or a full URL) and the key, percent-encoded."""
    return urljoin(request_url, f"{path.rstrip('/')}/{quote(key, safe='')}")


def read_status(status_code: int, headers: Mapping[str, Any], body: bytes) -> ServerSays:
    """What one answer of ``GET {status_path}/{key}`` says. An answer that is not the endpoint's (a
    server without it answers its own 404, or 405, or HTML) is ``NO_ANSWER``, never ``NOT_RUN``."""
    kind = str(headers.get("content-type", "")).split(";", 1)[0].strip().lower()
    try:
        doc = json.loads(body) if kind in ("application/json", "application/problem+json") else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict):
        return ServerSays(Told.NO_ANSWER, detail=f"the server answered HTTP {status_code}, not a key status")
    if status_code == 404 and kind == "application/problem+json" and str(doc.get("type", "")).endswith("unknown-key"):
        state = doc.get("state")
        why = "its record expired" if state == "expired" else "it has no record of the key"
        return ServerSays(Told.NOT_RUN, detail=f"the server says {why}: a retry with the key runs")
    state = doc.get("state")
    if status_code != 200 or state not in ("completed", "processing", "unknown"):
        return ServerSays(Told.NO_ANSWER, detail=f"the server answered HTTP {status_code}, not a key status")
    if state == "completed":
        code = doc.get("status")
        if type(code) is not int or doc.get("replay") is not True:
            return ServerSays(Told.UNKNOWN, detail="the server says completed, but will not replay it")
        return ServerSays(Told.COMPLETED, code, detail=f"the server says completed with HTTP {code}")
    if state == "processing":
        wait = _seconds(headers.get("retry-after"))
        return ServerSays(Told.PROCESSING, retry_after=wait, detail="the server says a request with the key runs now")
    return ServerSays(
        Told.UNKNOWN,
        detail="the server says the request started and its end was not recorded (it stopped mid-request)",
    )


def _seconds(value: Any) -> float | None:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if 0 <= seconds < 86400 else None
