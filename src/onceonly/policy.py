"""A tool's policy: its settings (``Policy``), retries and exception classification. Pure, no I/O.

Classification answers one question about a failed attempt: could the side effect have happened?
Connect errors → not sent (safe to retry); read/write timeouts, resets, 500/502/504 → unknown (must
be settled); 408/429/503 → not executed (retry after ``Retry-After``); other 4xx and the tool's own
errors → a definite failure (docs/design.md#classifying-a-failed-attempt). A cancelled async tool is
unknown; an exception group takes the most cautious verdict of its members.
"""

from __future__ import annotations

import enum
import math
import numbers
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any, Literal

__all__ = [
    "DEFAULT_TTL",
    "MAX_RETRY_AFTER",
    "Classification",
    "ConflictMeaning",
    "OnConflict",
    "OnUnknown",
    "Policy",
    "Retry",
    "Verdict",
    "check_conflict_means",
    "clamp_retry_after",
    "classify",
    "conflict_classifier",
    "retry_after_seconds",
]

#: The longest wait a ``Retry-After`` (or a classifier's ``retry_after``) can ask for, in seconds: a day.
#: More is taken as a day, so that a server's answer cannot lock an operation for years.
MAX_RETRY_AFTER = 86400.0


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
    """A verdict and, for ``NOT_EXECUTED``, how long the other side asked us to wait.

    ``retry_after`` is kept within ``[0, MAX_RETRY_AFTER]`` (``clamp_retry_after``), whoever made the
    classification: a classifier's infinity or NaN never becomes a due time.
    """

    verdict: Verdict
    retry_after: float | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if self.retry_after is not None:
            object.__setattr__(self, "retry_after", clamp_retry_after(self.retry_after))

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
        # The limit is compared with a persisted count: 2.5 or nan would compare oddly, True is 1 by accident.
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int):
            raise TypeError(f"Retry(attempts={self.attempts!r}): give a whole number (an int), such as attempts=3")
        if self.attempts < 1:
            raise ValueError(f"Retry(attempts={self.attempts}): at least 1 attempt is needed")
        check_seconds(self.base, f"Retry(base={self.base!r})")
        check_seconds(self.cap, f"Retry(cap={self.cap!r})")

    def ceiling(self, attempt: int) -> float:
        """The upper bound of the wait after ``attempt`` (1-based) failed."""
        # min() before the power would overflow for huge attempt numbers; clamp the exponent instead.
        return min(self.cap, self.base * 2.0 ** min(max(attempt - 1, 0), 62))

    def backoff(self, attempt: int, rng: random.Random | None = None, *, floor: float | None = None) -> float:
        """Seconds to wait after ``attempt`` failed; never less than ``floor`` (a ``Retry-After``)."""
        wait = (rng or random).uniform(0.0, self.ceiling(attempt))
        return max(wait, floor) if floor is not None else wait


def check_seconds(value: object, shown: str, *, above_zero: bool = False, none: str = "") -> None:
    """Refuse a seconds option that is not a number (``TypeError``), or is not finite or below 0
    (``ValueError``; ``above_zero``: 0 too).

    ``shown`` is the option as written (``lease=nan``); ``none`` what ``None`` means, where it is allowed.
    """
    least = "above 0" if above_zero else "0 or more"
    wanted = f"give a finite number of seconds, {least}" + (f", or None ({none})" if none else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{shown}: a {type(value).__name__} is not a number of seconds; {wanted}")
    seconds = float(value)
    # nan passes every "< 0" check and inf never runs out: both are refused as well as the negative.
    if math.isfinite(seconds) and (seconds > 0 if above_zero else seconds >= 0):
        return
    if not math.isfinite(seconds):
        problem = "not a finite number"
    else:
        problem = "seconds cannot be negative" if seconds < 0 else "0 seconds is no time at all"
    raise ValueError(f"{shown}: {problem}; {wanted}")


Classifier = Callable[[BaseException], "Classification | None"]

_UNKNOWN_STATUS = frozenset({500, 502, 504})
_NOT_EXECUTED_STATUS = frozenset({408, 429, 503})


def clamp_retry_after(value: object) -> float | None:
    """A wait asked for by the other side, made safe to schedule: a finite number of seconds within
    ``[0, MAX_RETRY_AFTER]``. Infinity (and anything larger) is ``MAX_RETRY_AFTER``; a negative number
    or NaN asks for no wait (0); what is not a number is no hint at all (``None``).

    .. versionadded:: 0.1
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    seconds = float(value)
    if math.isnan(seconds):
        return 0.0
    return min(max(seconds, 0.0), MAX_RETRY_AFTER)


def retry_after_seconds(value: str | None) -> float | None:
    """Parse a ``Retry-After`` header: delta-seconds or an HTTP date, within ``[0, MAX_RETRY_AFTER]``
    (``clamp_retry_after``: ``inf`` or ``1e400`` is a day, ``-5`` no wait). Anything else: ``None``."""
    if not value:
        return None
    value = value.strip()
    try:
        return clamp_retry_after(float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
        return clamp_retry_after(when.timestamp() - time.time())
    except (TypeError, ValueError, OverflowError, OSError):
        return None


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
    # httpx2 (the fork the openai 3.x SDK and mcp 2.x use) has the same classes under its own name.
    for name in ("httpx", "httpx2"):
        httpx = sys.modules.get(name)
        if httpx is not None and isinstance(exc, httpx.HTTPError):
            return _classify_httpx_error(httpx, exc)
    return None


def _classify_httpx_error(httpx: Any, exc: BaseException) -> Classification:
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
    if isinstance(exc, TimeoutError | ConnectionError) or not isinstance(exc, Exception):
        # TimeoutError (socket and asyncio), resets, aborts, broken pipes: it may have arrived. An attempt
        # interrupted (a cancelled task, KeyboardInterrupt, SystemExit: a BaseException that is not an
        # Exception) may have been stopped before its request or after it: the interruption says neither.
        return Classification(Verdict.UNKNOWN, None, type(exc).__name__)
    got = _response_status(exc)
    if got:
        return classify_status(*got)
    return Classification(Verdict.FAILED, None, type(exc).__name__)


# Which verdict a group takes when its members disagree: the one that assumes the most happened.
_CAUTION = {Verdict.NOT_SENT: 0, Verdict.NOT_EXECUTED: 1, Verdict.FAILED: 2, Verdict.UNKNOWN: 3}


def _classify_group(group: BaseExceptionGroup[BaseException], override: Classifier | None) -> Classification:
    """An exception group (``asyncio.TaskGroup``, trio, anyio) is as unsafe as its least safe member: one
    sub-request that may have arrived makes the attempt unknown, one definite failure makes it failed;
    only a group of retryable members is retried, after the longest ``Retry-After`` among them."""
    parts = [classify(sub, override) for sub in group.exceptions]
    worst = max(parts, key=lambda part: _CAUTION[part.verdict])
    retry_after = None
    if worst.is_retryable:
        retry_after = max((p.retry_after for p in parts if p.retry_after is not None), default=None)
    return Classification(worst.verdict, retry_after, f"{worst.reason} in {type(group).__name__}")


def classify(exc: BaseException, override: Classifier | None = None) -> Classification:
    """Classify a failed attempt. ``override`` (the tool's ``classify=``) is asked first; ``None`` defers.

    An exception group the override leaves is classified member by member (each asked of the override
    too), and takes the most cautious verdict: unknown, then failed, then the retryable ones. An error
    that reads as a definite failure only because nothing here knows it, raised from another (``raise
    ... from err``), takes its cause's verdict when that one says more.

    .. versionadded:: 0.1
    """
    got = _stated(exc, override)
    if got is not None:
        return got
    if isinstance(exc, BaseExceptionGroup):
        return _classify_group(exc, override)
    got = _by_type(exc)
    if got.verdict is Verdict.FAILED and exc.__cause__ is not None:
        return _classify_cause(exc, override) or got
    return got


def _stated(exc: BaseException, override: Classifier | None) -> Classification | None:
    """What the tool's ``classify=`` says of ``exc``, else what ``exc`` says of itself (``onceonly_verdict``)."""
    if override is not None:
        got = override(exc)
        if got is not None:
            return got
    explicit = getattr(exc, "onceonly_verdict", None)
    if isinstance(explicit, Verdict):
        return Classification(explicit, clamp_retry_after(getattr(exc, "retry_after", None)), type(exc).__name__)
    return None


def _by_type(exc: BaseException) -> Classification:
    for library in (_classify_httpx, _classify_requests, _classify_aiohttp):
        got = library(exc)
        if got is not None:
            return got
    return _classify_builtin(exc)


def _classify_cause(exc: BaseException, override: Classifier | None) -> Classification | None:
    """What the causes of ``exc`` say, the nearest first, when one says more than "failed".

    SDKs wrap the HTTP client's errors in their own (the openai SDK: ``raise APIConnectionError(...)
    from err``): a reset answer wrapped so may have arrived all the same. Only the explicit cause
    counts (``raise ... from``), not an error met while handling another; a group is not looked into.
    """
    seen = {id(exc)}
    cause = exc.__cause__
    while cause is not None and id(cause) not in seen and not isinstance(cause, BaseExceptionGroup):
        seen.add(id(cause))  # a cause chain can be made to loop
        stated = _stated(cause, override)
        got = stated or _by_type(cause)
        if got.verdict is not Verdict.FAILED:
            return Classification(got.verdict, got.retry_after, f"{type(exc).__name__} from {got.reason}")
        if stated is not None:
            return None  # a definite failure by someone's word ends the search
        cause = cause.__cause__
    return None


#: What a server means by 409 to a request with an idempotency key.
ConflictMeaning = Literal["in_progress", "exists"]


def check_conflict_means(value: object) -> ConflictMeaning:
    """``value`` if it is a ``ConflictMeaning``; else ``ValueError`` saying what each one means."""
    if value == "in_progress" or value == "exists":  # noqa: PLR1714 (narrows the Literal for mypy)
        return value
    raise ValueError(
        f"conflict_means={value!r}: give 'in_progress' (the IETF draft: a request with this key is still "
        "running; ask again later) or 'exists' (the key was used already: the operation happened)"
    )


def conflict_classifier(conflict_means: ConflictMeaning) -> Classifier:
    """A tool's ``classify=`` hook for a tool that sends the key itself, to a server whose 409 says
    something about the key: ``@ledger.tool(classify=conflict_classifier("exists"), ...)``.

    ``"exists"`` (the key was used already: some servers answer so instead of replaying): the operation
    happened, and this attempt did not get its result: unknown, settled by the tool's ``on_unknown``;
    with ``on_unknown="probe"`` and a probe that looks the result up by the key, it is confirmed with
    that result. ``"in_progress"`` (the IETF draft: a request with this key still runs): this attempt
    did nothing, so it is not executed, tried again after ``Retry-After`` with the same key, and then
    answered with the first request's result. Other errors are left to the default classification.

    .. versionadded:: 0.1
    """
    meaning = check_conflict_means(conflict_means)

    def classify_409(exc: BaseException) -> Classification | None:
        got = _response_status(exc)
        if got is None or got[0] != 409:
            return None
        if meaning == "exists":
            return Classification(Verdict.UNKNOWN, None, "HTTP 409: the key was used already")
        return Classification(Verdict.NOT_EXECUTED, retry_after_seconds(got[1]), "HTTP 409: in progress")

    return classify_409


#: How long a settled record is kept (and replayed) by default: a day.
DEFAULT_TTL = 86400.0

OnUnknown = Literal["resend", "probe", "review", "retry"]
OnConflict = Literal["raise", "replay"]


@dataclass(frozen=True, slots=True)
class Policy:
    """A tool's settings that shape its decisions (the decorator's keyword arguments)."""

    retry: Retry = field(default_factory=Retry)
    on_unknown: OnUnknown = "review"
    on_conflict: OnConflict = "raise"
    has_probe: bool = False
    settle: float = 0.0
    ttl: float | None = DEFAULT_TTL
    lease: float = 30.0
    wait: float = 10.0
    reports_dispatch: bool = False
    classify: Classifier | None = None
