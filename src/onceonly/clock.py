"""The store's clock, read through this host's: leases, backoffs and settle times in one time for all hosts.

Leases, due times and settle times are compared across hosts: a host whose clock runs two minutes
ahead sees another's live lease as expired and takes it over; one 30 s behind sees every due time 30 s
later than it is. A store that has a clock of its own (Redis ``TIME``, PostgreSQL ``clock_timestamp()``)
reports it through an optional ``time()`` method, and the ledger reads the store's time as this host's
clock plus an offset: measured when the ledger opens, again every ``every`` seconds (by the ledger's
heartbeat thread), and at once when this host's clock steps. A step (NTP, a VM resumed, a clock set by
hand) is seen for free: each reading compares this host's clock with ``time.monotonic``, which no step
moves, and a gap beyond ``STEP_SECONDS`` since the last measurement is one. SQLite has no server and no
clock of its own: its hosts are one host, with one clock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from onceonly.errors import StoreError

__all__ = ["DEFAULT_SYNC_SECONDS", "STEP_SECONDS", "StoreClock"]

log = logging.getLogger("onceonly")

#: How often the offset to the store's clock is measured again, in seconds: clocks drift slowly, and a
#: stepped clock (NTP) is followed within this time.
DEFAULT_SYNC_SECONDS = 60.0

#: How far this host's clock may move against ``time.monotonic`` between two measurements before it counts
#: as stepped and the offset is measured again at once. A clock that NTP slews (at most 500 ppm) moves
#: 0.03 s in the minute between two measurements; a lease is seconds long.
STEP_SECONDS = 0.25

#: An offset beyond this is worth a line in the log: this host's clock is off.
_NOTEWORTHY_SECONDS = 1.0

_monotonic = time.monotonic


class StoreClock:
    """Seconds since the epoch on the store's clock: ``local() + offset``.

    Args:
        store_time: the store's ``time()``: its clock, one round trip.
        local: this host's clock (``time.time``, or a test's).
        every: seconds (of ``time.monotonic``) between two measurements of the offset.
        where: the store, as the log names it.

    The first measurement is made here. A store that cannot answer leaves the offset at its last
    value (0 at first), logged once, and is asked again within a few seconds. ``local`` stepping
    (``STEP_SECONDS`` against ``time.monotonic``) makes the reading that sees it measure again first.

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        store_time: Callable[[], float],
        local: Callable[[], float],
        *,
        every: float = DEFAULT_SYNC_SECONDS,
        where: str = "the store",
    ) -> None:
        self._store_time = store_time
        self._local = local
        self.every = every
        self.where = where
        #: Seconds to add to this host's clock to read the store's.
        self.offset = 0.0
        #: Whether the offset was ever measured (else it is 0: this host's clock as it is).
        self.measured = False
        self._tried_at = 0.0  # time.monotonic() of the last measurement, or attempt at one
        self._failing = False
        #: ``local() - time.monotonic()`` at the last measurement: a reading far from it is a step.
        self._gap = 0.0
        self._stepping = threading.Lock()
        self.sync()

    def now(self) -> float:
        """The store's time now, in seconds since the epoch: no round trip, but after a step of this
        host's clock (then one measurement, for every thread that reads the clock meanwhile)."""
        local = self._local()
        if -STEP_SECONDS <= local - _monotonic() - self._gap <= STEP_SECONDS:  # no abs(): a call less
            return local + self.offset
        return self._stepped()

    def _stepped(self) -> float:
        with self._stepping:
            if abs(self._local() - _monotonic() - self._gap) > STEP_SECONDS:  # not measured by another thread
                self.sync()
        return self._local() + self.offset

    def sync(self) -> None:
        """Measure the offset: the store's time against the middle of the round trip that read it."""
        self._tried_at = time.monotonic()
        before = self._local()
        try:
            theirs = self._store_time()
        except StoreError as exc:
            # Keep the last offset; sync_if_due tries again soon rather than at the next full period.
            if not self._failing:
                self._failing = True
                log.warning(
                    "onceonly: could not read the clock of %s (%s); leases and due times use %s",
                    self.where,
                    exc,
                    "the last measured offset" if self.measured else "this host's clock until it answers",
                )
            # Readings stop seeing a step here: each one would try again, and sync_if_due does within seconds.
            self._gap = self._local() - _monotonic()
            return
        after = self._local()
        offset = theirs - (before + after) / 2
        if abs(offset - self.offset) > _NOTEWORTHY_SECONDS:  # the first time, against 0
            log.info("onceonly: this host's clock is %+.3f s off the clock of %s; the ledger uses the store's",
                     -offset, self.where)  # fmt: skip
        self.offset = offset
        # Only now, after the offset: a reading meanwhile still sees the step, and waits for this one.
        self._gap = after - _monotonic()
        self.measured = True
        self._failing = False

    def sync_if_due(self) -> None:
        """Measure again when ``every`` seconds passed since the last measurement, or a few seconds since
        one that failed (the heartbeat thread calls it at every look)."""
        period = min(self.every, 5.0) if self._failing else self.every
        if time.monotonic() - self._tried_at >= period:
            self.sync()
