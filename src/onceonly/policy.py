"""Retry policy and exception classification. Pure, no I/O.

Classification answers one question about a failed attempt: could the side effect have happened?
Connect errors → not sent (safe to retry); read/write timeouts, resets, 500/502/504 → unknown (must
be settled); 408/429/503 → not executed (retry after ``Retry-After``); other 4xx and the tool's own
errors → a definite failure (docs/design.md#classifying-a-failed-attempt).
"""

from __future__ import annotations

import enum
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from typing import Any

__all__ = ["Classification", "Retry", "Verdict", "classify", "retry_after_seconds"]


class Verdict(enum.Enum):
    """What a failed attempt tells about its side effect.

    .. versionadded:: 0.1
    """

    NOT_SENT = "not_sent"  # the request never left: retry is safe
    NOT_EXECUTED = "not_executed"  # the other side refused before doing anything: retry later
    UNKNOWN = "unknown"  # it may have happened: settle, never re-run blindly
    FAILED = "failed"  # it definitely failed: re-raise


@dataclass(frozen=True, slots=True)
class Classification:
    """A verdict and, for ``NOT_EXECUTED``, how long the other side asked us to wait."""

    verdict: Verdict
    retry_after: float | None = None
    reason: str = ""

    @property
    def is_retryable(self) -> bool:
        return self.verdict in (Verdict.NOT_SENT, Verdict.NOT_EXECUTED)


@dataclass(frozen=True, slots=True)
class Retry:
    """Persisted attempt limit and exponential backoff with full jitter.

    The n-th wait (n >= 1) is uniform in ``[0, min(cap, base * 2 ** (n - 1))]``, the "full jitter" of
    AWS's backoff study, the same maths as tenacity's ``wait_random_exponential``.

    Args:
        attempts: total attempts of one operation, counted in the store across callers and restarts.
        base: seconds of the first backoff ceiling.
        cap: the largest backoff ceiling in seconds.

    .. versionadded:: 0.1
    """

    attempts: int = 3
    base: float = 1.0
    cap: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"Retry(attempts={self.attempts}): at least 1 attempt is needed")
        if self.base < 0 or self.cap < 0:
            raise ValueError(f"Retry(base={self.base}, cap={self.cap}): backoff seconds cannot be negative")

    def ceiling(self, attempt: int) -> float:
        """The upper bound of the wait after ``attempt`` (1-based) failed."""
        # min() before the power would overflow for huge attempt numbers; clamp the exponent instead.
        return min(self.cap, self.base * 2.0 ** min(max(attempt - 1, 0), 62))

    def backoff(self, attempt: int, rng: random.Random | None = None, *, floor: float | None = None) -> float:
        """Seconds to wait after ``attempt`` failed; never less than ``floor`` (a ``Retry-After``)."""
        wait = (rng or random).uniform(0.0, self.ceiling(attempt))
        return max(wait, floor) if floor is not None else wait


Classifier = Callable[[BaseException], "Classification | None"]

_UNKNOWN_STATUS = frozenset({500, 502, 504})
_NOT_EXECUTED_STATUS = frozenset({408, 429, 503})


def retry_after_seconds(value: str | None) -> float | None:
    """Parse a ``Retry-After`` header: delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    import time

    return max(0.0, when.timestamp() - time.time())


def classify_status(status: int, retry_after: str | None = None) -> Classification:
    """Classify an HTTP status of a response that came back.

    .. versionadded:: 0.1
    """
    if status in _NOT_EXECUTED_STATUS:
        return Classification(Verdict.NOT_EXECUTED, retry_after_seconds(retry_after), f"HTTP {status}")
    if status in _UNKNOWN_STATUS or status >= 500:
        # 501/505 and friends are rare; treating every other 5xx as unknown is the safe side.
        return Classification(Verdict.UNKNOWN, None, f"HTTP {status}")
    return Classification(Verdict.FAILED, None, f"HTTP {status}")


def _response_status(exc: BaseException) -> tuple[int, str | None] | None:
    """Status and Retry-After of an exception that carries a response (httpx, requests, aiohttp)."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if isinstance(status, int):
        headers = getattr(response, "headers", None) or {}
        return status, headers.get("Retry-After")
    status = getattr(exc, "status", None)  # aiohttp.ClientResponseError
    if isinstance(status, int):
        headers = getattr(exc, "headers", None) or {}
        return status, headers.get("Retry-After")
    return None


def _classify_httpx(exc: BaseException) -> Classification | None:
    httpx = sys.modules.get("httpx")
    if httpx is None or not isinstance(exc, httpx.HTTPError):
        return None
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return Classification(Verdict.NOT_SENT, None, type(exc).__name__)
    if isinstance(exc, httpx.HTTPStatusError):
        got = _response_status(exc)
        if got:
            return classify_status(*got)
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL | httpx.LocalProtocolError):
        return Classification(Verdict.NOT_SENT, None, type(exc).__name__)
    # ReadTimeout, WriteTimeout, ReadError, WriteError, RemoteProtocolError: the request may have arrived.
    return Classification(Verdict.UNKNOWN, None, type(exc).__name__)


def _classify_requests(exc: BaseException) -> Classification | None:
    requests = sys.modules.get("requests")
    if requests is None or not isinstance(exc, requests.RequestException):
        return None
    if isinstance(exc, requests.ConnectTimeout):
        return Classification(Verdict.NOT_SENT, None, "ConnectTimeout")
    if isinstance(exc, requests.HTTPError):
        got = _response_status(exc)
        if got:
            return classify_status(*got)
    if isinstance(exc, requests.ConnectionError):
        # requests folds "refused" and "reset after sending" into one class; the cause tells them apart.
        urllib3 = sys.modules.get("urllib3")
        cause: Any = exc.args[0] if exc.args else None
        reason = getattr(cause, "reason", None)
        if urllib3 is not None and isinstance(reason, urllib3.exceptions.NewConnectionError):
            return Classification(Verdict.NOT_SENT, None, "NewConnectionError")
        if isinstance(reason, ConnectionRefusedError):
            return Classification(Verdict.NOT_SENT, None, "ConnectionRefusedError")
        return Classification(Verdict.UNKNOWN, None, "ConnectionError")
    if isinstance(exc, requests.Timeout):
        return Classification(Verdict.UNKNOWN, None, type(exc).__name__)
    if isinstance(exc, requests.exceptions.InvalidURL | requests.exceptions.MissingSchema):
        return Classification(Verdict.NOT_SENT, None, type(exc).__name__)
    return Classification(Verdict.UNKNOWN, None, type(exc).__name__)


def _classify_aiohttp(exc: BaseException) -> Classification | None:
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is None or not isinstance(exc, aiohttp.ClientError):
        return None
    if isinstance(exc, aiohttp.ClientConnectorError):
        return Classification(Verdict.NOT_SENT, None, type(exc).__name__)
    if isinstance(exc, aiohttp.ClientResponseError):
        got = _response_status(exc)
        if got:
            return classify_status(*got)
    return Classification(Verdict.UNKNOWN, None, type(exc).__name__)


def _classify_builtin(exc: BaseException) -> Classification:
    if isinstance(exc, ConnectionRefusedError):
        return Classification(Verdict.NOT_SENT, None, "ConnectionRefusedError")
    if isinstance(exc, TimeoutError | ConnectionError):
        # TimeoutError (socket and asyncio), resets, aborts, broken pipes: it may have arrived.
        return Classification(Verdict.UNKNOWN, None, type(exc).__name__)
    got = _response_status(exc)
    if got:
        return classify_status(*got)
    return Classification(Verdict.FAILED, None, type(exc).__name__)


def classify(exc: BaseException, override: Classifier | None = None) -> Classification:
    """Classify a failed attempt. ``override`` (the tool's ``classify=``) is asked first; ``None`` defers.

    .. versionadded:: 0.1
    """
    if override is not None:
        got = override(exc)
        if got is not None:
            return got
    explicit = getattr(exc, "onceonly_verdict", None)
    if isinstance(explicit, Verdict):
        return Classification(explicit, getattr(exc, "retry_after", None), type(exc).__name__)
    for library in (_classify_httpx, _classify_requests, _classify_aiohttp):
        got = library(exc)
        if got is not None:
            return got
    return _classify_builtin(exc)
