"""Hosts whose clocks differ, on every store: each caller gets a clock of its own (``clock=``), and the
ledger reads leases and due times on the store's clock where it has one (Redis ``TIME``, PostgreSQL
``clock_timestamp()``). SQLite has no clock of its own: its callers share one host and one clock, to
which ``store_clock=True`` corrects an injected clock."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from onceonly import InProgress, Ledger, Retry, State
from onceonly import states as st
from onceonly.stores import open_store
from tests._clock import FakeClock

#: Whether a skewed caller's ledger reads the store's clock. Every test below states the behaviour it
#: expects of a ledger that does; set this to False to watch them fail as a ledger on its host's clock.
STORE_CLOCK = True


def _skewed(url: str, clock: Callable[[], float], **kwargs: Any) -> Ledger:
    """A ledger on another host whose clock is ``clock``."""
    if STORE_CLOCK:
        kwargs["store_clock"] = True
    return Ledger.open(url, clock=clock, **kwargs)


def _has_clock(url: str) -> bool:
    return not url.startswith("sqlite")


@pytest.fixture(name="accurate")
def fixture_accurate(store_url: str) -> Iterator[Ledger]:
    """A ledger on a host whose clock is right (the real one)."""
    ledger = Ledger.open(store_url)
    yield ledger
    ledger.close()


def test_a_store_with_a_clock_reports_it_and_the_ledger_reads_it(store_url: str) -> None:
    """Redis and PostgreSQL report their own time; a ledger on a host two minutes ahead measures the
    offset at open and its ``clock`` reads the store's time. SQLite reports none: its ledger keeps the
    host's clock, as documented (one host, one clock)."""
    store = open_store(store_url)
    try:
        if not _has_clock(store_url):
            assert not hasattr(store, "time")
            return
        assert abs(store.time() - time.time()) < 5  # type: ignore[attr-defined]  # the same machine
    finally:
        store.close()
    ahead = _skewed(store_url, lambda: time.time() + 120)
    try:
        assert ahead.clock_offset == pytest.approx(-120, abs=2)
        assert ahead.clock() == pytest.approx(time.time(), abs=2)
    finally:
        ahead.close()


def test_a_caller_whose_clock_runs_ahead_does_not_take_over_a_live_lease(store_url: str, accurate: Ledger) -> None:
    """A host two minutes ahead saw a live lease as expired, marked the record unknown and ran the charge
    a second time (``on_unknown="retry"``). On the store's clock the lease is alive: it waits, then
    ends with ``InProgress``, and the holder's result is the only one."""
    _one_charge(store_url, accurate, _skewed(store_url, lambda: time.time() + 120))


def test_a_clock_stepped_after_open_is_followed_at_the_next_reading(store_url: str, accurate: Ledger) -> None:
    """A host whose clock stepped 10 minutes ahead after its ledger had measured the offset (NTP, a VM
    resumed) read the store's time 10 minutes off until the next measurement, a minute later: it took
    the holder's live lease for run out and ran the charge a second time. The reading that meets the
    step (the clock against ``time.monotonic``) measures the offset again first: the lease is alive."""
    step = [0.0]
    stepped = _skewed(store_url, lambda: time.time() + step[0])
    assert stepped.clock_offset == pytest.approx(0, abs=2)
    _one_charge(store_url, accurate, stepped, step=(step, 600.0))  # the step comes while the holder runs
    assert stepped.clock_offset == pytest.approx(-600, abs=2)
    assert stepped.clock() == pytest.approx(time.time(), abs=2)


def _one_charge(store_url: str, accurate: Ledger, ahead: Ledger, step: tuple[list[float], float] | None = None) -> None:
    """``accurate`` holds a charge while ``ahead`` asks for it (its clock first stepped by ``step``, when
    given): ``ahead`` must wait and end with ``InProgress``, the record still the holder's."""
    charges: list[str] = []
    started, release = threading.Event(), threading.Event()

    def make(ledger: Ledger, who: str) -> Any:
        @ledger.tool(name="charge", on_unknown="retry", lease=30, wait=0.3)
        def charge(amount: int) -> str:
            charges.append(who)
            if who == "accurate":
                started.set()
                release.wait(10)
            return f"charged by {who}"

        return charge

    holder, late = make(accurate, "accurate"), make(ahead, "ahead")
    result: list[str] = []
    thread = threading.Thread(target=lambda: result.append(holder(5)))
    thread.start()
    try:
        assert started.wait(5)
        if step is not None:
            step[0][0] = step[1]
        with pytest.raises(InProgress):
            late(5)
        rec = ahead.get(late.key_for(5))
        assert rec is not None and rec.state is State.IN_FLIGHT and rec.fence == 1
    finally:
        release.set()
        thread.join(10)
        ahead.close()
    assert result == ["charged by accurate"] and charges == ["accurate"]


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_caller_whose_clock_runs_behind_waits_no_longer_than_wait(
    store_url: str, accurate: Ledger, face: str
) -> None:
    """A host 30 s behind read a retry due in half a second as due in 30.5 s and slept it out despite
    ``wait=1``. On the store's clock (on SQLite: the host's) it sleeps the half second and runs, no
    sleep longer than ``wait``. The same for an ``async def`` tool, whose driver reads the same clock."""
    behind = FakeClock()
    behind.now = time.time() - 30

    async def asleep(seconds: float) -> None:
        behind.sleep(seconds)

    ledger = _skewed(store_url, behind, sleep=behind.sleep, asleep=asleep)
    runs: list[int] = []

    if face == "sync":

        @ledger.tool(name="notify", wait=1, retry=Retry(attempts=3))
        def notify() -> str:
            runs.append(1)
            return "sent"

        call: Callable[[], str] = notify
    else:

        @ledger.tool(name="notify", wait=1, retry=Retry(attempts=3))
        async def anotify() -> str:
            runs.append(1)
            return "sent"

        notify = anotify  # type: ignore[assignment]
        call = lambda: asyncio.run(anotify())  # noqa: E731

    # The accurate host's attempt was refused and scheduled its retry half a second from now.
    now = time.time()
    first = st.new_record(
        key=notify.key_for(), scope="default", tool="notify", fingerprint=notify.spec.call((), {}, None, 1).fingerprint,
        args_json="{}", state=State.IN_FLIGHT, owner="accurate:1:1", now=now, lease_seconds=30,
    )  # fmt: skip
    failed = st.fail(first, error="ConnectionRefusedError: refused", now=now, retry_at=now + 0.5, ttl=60, by="a")
    assert accurate.store.insert(failed)
    try:
        assert call() == "sent" and runs == [1]
        assert all(s <= 1 for s in behind.sleeps), behind.sleeps
    finally:
        ledger.close()


def test_the_offset_is_measured_again_now_and_then(store_url: str) -> None:
    """A host's clock that is stepped while the ledger runs (NTP) is followed: the heartbeat thread
    measures the offset again every ``every`` seconds, with no round trip on a guarded call."""
    if not _has_clock(store_url):
        pytest.skip("SQLite has no clock of its own")
    skew = [120.0]
    ledger = _skewed(store_url, lambda: time.time() + skew[0])
    try:
        assert ledger.clock_offset == pytest.approx(-120, abs=2)
        assert ledger.runtime.store_clock is not None
        ledger.runtime.store_clock.every = 0.05
        skew[0] = -30.0

        @ledger.tool(name="touch")
        def touch() -> int:
            return 1

        touch()  # starts the heartbeat thread
        for _ in range(100):
            if abs(ledger.clock_offset - 30) < 2:
                break
            time.sleep(0.05)
        assert ledger.clock_offset == pytest.approx(30, abs=2)
    finally:
        ledger.close()


def test_an_injected_clock_is_used_as_it_is_unless_asked(store_url: str) -> None:
    """A test's fake clock stays the ledger's clock (``store_clock`` defaults to off for an injected
    clock), so fake time moves only when the test moves it; the host's own clock is corrected."""
    fake = FakeClock()
    ledger = Ledger.open(store_url, clock=fake, sleep=fake.sleep)
    real = Ledger.open(store_url)
    try:
        assert ledger.clock() == fake.now and ledger.clock_offset == 0.0
        assert real.clock() == pytest.approx(time.time(), abs=2)
        assert (real.runtime.store_clock is not None) == _has_clock(store_url)
    finally:
        ledger.close()
        real.close()
