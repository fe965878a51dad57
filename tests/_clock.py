"""A fake clock for tests: time moves only when the ledger sleeps, so backoffs are recorded, not waited."""

from __future__ import annotations

NOW = 1_800_000_000.0


class FakeClock:
    """Seconds since the epoch that advance only through ``sleep``; every sleep is recorded."""

    def __init__(self) -> None:
        self.now = NOW
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
