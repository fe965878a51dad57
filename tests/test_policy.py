"""Retry policy (backoff with full jitter) and exception classification."""

from __future__ import annotations

import asyncio
import math
import random

import httpx
import pytest
import requests

from onceonly import Classification, Retry, Verdict, classify
from onceonly.policy import classify_status, retry_after_seconds


def test_backoff_ceiling_doubles_to_the_cap() -> None:
    """The n-th ceiling is base·2^(n-1), capped."""
    r = Retry(attempts=10, base=0.5, cap=3.0)
    assert [r.ceiling(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert r.ceiling(10_000) == 3.0


def test_backoff_is_full_jitter() -> None:
    """Waits spread over [0, ceiling], seeded for repeatability, floored by Retry-After."""
    r = Retry(attempts=5, base=1.0, cap=8.0)
    rng = random.Random(7)
    waits = [r.backoff(3, rng) for _ in range(2000)]
    assert 0.0 <= min(waits) < 0.2
    assert 3.8 < max(waits) <= 4.0
    assert r.backoff(1, random.Random(1), floor=5.0) == 5.0
    assert [r.backoff(2, random.Random(3)) for _ in range(2)] == [r.backoff(2, random.Random(3))] * 2


def test_retry_rejects_nonsense() -> None:
    """Zero attempts or negative seconds are refused."""
    with pytest.raises(ValueError, match="at least 1"):
        Retry(attempts=0)
    with pytest.raises(ValueError, match="negative"):
        Retry(base=-1)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [({"attempts": 2.5}, TypeError, r"attempts=2\.5\): give a whole number"),
     ({"attempts": math.nan}, TypeError, "whole number"),
     ({"attempts": True}, TypeError, r"attempts=True\): give a whole number"),
     ({"attempts": "3"}, TypeError, "whole number"),
     ({"base": math.nan}, ValueError, r"base=nan\): not a finite number"),
     ({"cap": math.inf}, ValueError, r"cap=inf\): not a finite"),
     ({"cap": -math.inf}, ValueError, "not a finite number"),
     ({"base": "1"}, TypeError, "a str is not a number of seconds")],
)  # fmt: skip
def test_retry_rejects_what_is_not_a_count_or_finite_seconds(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    """A fractional, nan or bool attempt limit, and backoff seconds that are nan, infinite or not numbers,
    are refused when the Retry is made, saying what to give instead."""
    with pytest.raises(error, match=message):
        Retry(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("status", "verdict"),
    [(500, Verdict.UNKNOWN), (502, Verdict.UNKNOWN), (504, Verdict.UNKNOWN), (408, Verdict.NOT_EXECUTED),
     (429, Verdict.NOT_EXECUTED), (503, Verdict.NOT_EXECUTED), (400, Verdict.FAILED), (404, Verdict.FAILED),
     (422, Verdict.FAILED)],
)  # fmt: skip
def test_status_classes(status: int, verdict: Verdict) -> None:
    """DESIGN.md section 4, status by status."""
    assert classify_status(status).verdict is verdict


def test_retry_after_header() -> None:
    """Retry-After in seconds or as an HTTP date."""
    assert classify_status(429, "7").retry_after == 7.0
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    assert retry_after_seconds("soon") is None


def test_builtins() -> None:
    """Refused → not sent; timeouts and resets → unknown; anything else → the tool's own failure."""
    assert classify(ConnectionRefusedError()).verdict is Verdict.NOT_SENT
    assert classify(TimeoutError()).verdict is Verdict.UNKNOWN
    assert classify(ConnectionResetError()).verdict is Verdict.UNKNOWN
    assert classify(BrokenPipeError()).verdict is Verdict.UNKNOWN
    assert classify(ValueError("bad")).verdict is Verdict.FAILED


def test_cancelled_task_is_unknown() -> None:
    """A cancelled async task may have been stopped after its request left: unknown, never failed."""
    got = classify(asyncio.CancelledError())
    assert got.verdict is Verdict.UNKNOWN and got.reason == "CancelledError"


@pytest.mark.parametrize(
    ("members", "verdict"),
    [([TimeoutError()], Verdict.UNKNOWN), ([ConnectionResetError()], Verdict.UNKNOWN),
     ([ValueError(), TimeoutError()], Verdict.UNKNOWN), ([ConnectionRefusedError(), ValueError()], Verdict.FAILED),
     ([ConnectionRefusedError(), ConnectionRefusedError()], Verdict.NOT_SENT), ([ValueError()], Verdict.FAILED),
     ([ExceptionGroup("inner", [ConnectionRefusedError(), OSError()]), ConnectionResetError()], Verdict.UNKNOWN),
     ([ConnectionRefusedError(), ExceptionGroup("inner", [ConnectionRefusedError(), KeyError()])], Verdict.FAILED)],
)  # fmt: skip
def test_exception_group_takes_its_most_cautious_member(members: list[Exception], verdict: Verdict) -> None:
    """asyncio.TaskGroup raises groups: a group is unknown if any member (at any depth) may have happened,
    else failed if any failed, else retryable."""
    assert classify(ExceptionGroup("io", members)).verdict is verdict


def test_exception_group_keeps_the_longest_retry_after_and_asks_the_override() -> None:
    """A group of refusals waits the longest Retry-After among them; a tool's classify= is asked of the
    group first, then of each member."""

    class Busy(Exception):
        onceonly_verdict = Verdict.NOT_EXECUTED

        def __init__(self, retry_after: float | None) -> None:
            self.retry_after = retry_after

    got = classify(ExceptionGroup("io", [Busy(2.0), ConnectionRefusedError(), Busy(7.0), Busy(None)]))
    assert got.verdict is Verdict.NOT_EXECUTED and got.retry_after == 7.0
    assert got.reason == "Busy in ExceptionGroup"

    asked: list[type[BaseException]] = []

    def override(exc: BaseException) -> Classification | None:
        asked.append(type(exc))
        return Classification(Verdict.NOT_SENT) if isinstance(exc, KeyError) else None

    assert classify(ExceptionGroup("io", [KeyError("x")]), override).verdict is Verdict.NOT_SENT
    assert asked == [ExceptionGroup, KeyError]
    whole = lambda exc: Classification(Verdict.FAILED) if isinstance(exc, ExceptionGroup) else None  # noqa: E731
    assert classify(ExceptionGroup("io", [TimeoutError()]), whole).verdict is Verdict.FAILED


def test_httpx_exceptions() -> None:
    """httpx: connect errors are not sent; read timeouts unknown; status errors by status."""
    req = httpx.Request("POST", "http://x/tickets")
    assert classify(httpx.ConnectError("no", request=req)).verdict is Verdict.NOT_SENT
    assert classify(httpx.ConnectTimeout("no", request=req)).verdict is Verdict.NOT_SENT
    assert classify(httpx.ReadTimeout("slow", request=req)).verdict is Verdict.UNKNOWN
    assert classify(httpx.RemoteProtocolError("gone", request=req)).verdict is Verdict.UNKNOWN
    resp = httpx.Response(429, headers={"Retry-After": "3"}, request=req)
    got = classify(httpx.HTTPStatusError("429", request=req, response=resp))
    assert got == Classification(Verdict.NOT_EXECUTED, 3.0, "HTTP 429")
    resp = httpx.Response(502, request=req)
    assert classify(httpx.HTTPStatusError("502", request=req, response=resp)).verdict is Verdict.UNKNOWN


def test_requests_exceptions() -> None:
    """requests: connect timeout and refused connection are not sent; read timeouts unknown."""
    assert classify(requests.ConnectTimeout()).verdict is Verdict.NOT_SENT
    assert classify(requests.ReadTimeout()).verdict is Verdict.UNKNOWN
    assert classify(requests.ConnectionError("reset")).verdict is Verdict.UNKNOWN
    resp = requests.Response()
    resp.status_code = 409
    assert classify(requests.HTTPError(response=resp)).verdict is Verdict.FAILED


def test_override_and_explicit_verdict() -> None:
    """A tool's classify= is asked first; an exception may carry its own verdict."""

    class Refused(Exception):
        onceonly_verdict = Verdict.NOT_SENT

    assert classify(Refused()).verdict is Verdict.NOT_SENT
    override = lambda exc: Classification(Verdict.UNKNOWN) if isinstance(exc, KeyError) else None  # noqa: E731
    assert classify(KeyError("x"), override).verdict is Verdict.UNKNOWN
    assert classify(ValueError("x"), override).verdict is Verdict.FAILED


def test_aiohttp_exceptions() -> None:
    """aiohttp, with its real exceptions: a refused connection is not sent, a 503 with Retry-After is
    not executed, a 502 and a dropped connection are unknown, a 404 failed."""
    import asyncio

    import aiohttp
    from multidict import CIMultiDict, CIMultiDictProxy
    from yarl import URL

    async def refused() -> BaseException:
        async with aiohttp.ClientSession() as session:
            try:
                await session.get("http://127.0.0.1:1/")
            except aiohttp.ClientError as exc:
                return exc
        raise AssertionError("port 1 answered")

    exc = asyncio.run(refused())
    assert isinstance(exc, aiohttp.ClientConnectorError)
    assert classify(exc).verdict is Verdict.NOT_SENT

    info = aiohttp.RequestInfo(URL("http://x/t"), "POST", CIMultiDictProxy(CIMultiDict()), URL("http://x/t"))

    def response_error(status: int, **headers: str) -> aiohttp.ClientResponseError:
        return aiohttp.ClientResponseError(info, (), status=status, headers=CIMultiDictProxy(CIMultiDict(headers)))

    busy = classify(response_error(503, **{"Retry-After": "2"}))
    assert busy.verdict is Verdict.NOT_EXECUTED and busy.retry_after == 2.0
    assert classify(response_error(502)).verdict is Verdict.UNKNOWN
    assert classify(response_error(404)).verdict is Verdict.FAILED
    assert classify(aiohttp.ServerDisconnectedError()).verdict is Verdict.UNKNOWN


@pytest.mark.parametrize(
    "exc",
    [KeyboardInterrupt(), SystemExit(1), BaseExceptionGroup("g", [SystemExit(1), ValueError("x")])],
    ids=["KeyboardInterrupt", "SystemExit", "group-with-SystemExit"],
)
def test_an_interrupted_attempt_is_unknown(exc: BaseException) -> None:
    """A BaseException that is not an Exception interrupted the attempt, before or after its request:
    unknown, as a cancelled task is (a late outcome of a timed-out sync tool whose thread called
    sys.exit() was classified failed, and so retried)."""
    assert classify(exc).verdict is Verdict.UNKNOWN


@pytest.mark.parametrize(
    ("header", "seconds"),
    [("inf", 86400.0), ("1e400", 86400.0), ("Infinity", 86400.0), ("9" * 40, 86400.0), ("86400", 86400.0),
     ("90000", 86400.0), ("7", 7.0), ("1.5", 1.5), ("-5", 0.0), ("nan", 0.0), ("soon", None), ("", None),
     ("Fri, 31 Dec 9999 23:59:59 GMT", 86400.0)],
)  # fmt: skip
def test_retry_after_is_finite_and_at_most_a_day(header: str, seconds: float | None) -> None:
    """``inf`` and ``1e400`` parsed as infinity, which reached the ledger's due times and its store. Every
    parsed Retry-After is a finite number of seconds within ``[0, MAX_RETRY_AFTER]``, or None."""
    got = retry_after_seconds(header)
    assert got == seconds if seconds is None or seconds < 86400 else got == pytest.approx(86400.0)
    resp = httpx.Response(503, headers={"Retry-After": header}, request=httpx.Request("POST", "http://x"))
    classified = classify(httpx.HTTPStatusError("503", request=resp.request, response=resp))
    assert classified.retry_after is None or math.isfinite(classified.retry_after)


def test_a_classification_keeps_its_retry_after_finite_whoever_made_it() -> None:
    """A ``classify=`` override or an exception's own ``retry_after`` may say ``inf`` or ``nan``: the
    Classification holds a day at most, no wait for NaN or a negative, nothing for a non-number."""
    assert Classification(Verdict.NOT_EXECUTED, math.inf).retry_after == 86400.0
    assert Classification(Verdict.NOT_EXECUTED, math.nan).retry_after == 0.0
    assert Classification(Verdict.NOT_EXECUTED, -3).retry_after == 0.0
    assert Classification(Verdict.NOT_EXECUTED, "soon").retry_after is None  # type: ignore[arg-type]

    class Busy(Exception):
        onceonly_verdict = Verdict.NOT_EXECUTED
        retry_after = float("inf")

    assert classify(Busy()).retry_after == 86400.0
