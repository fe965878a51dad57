"""For the dashboard's tests: ``running``, ``onceonly dashboard`` in a process of its own; ``seed``, a
ledger with records in several states, for the dashboard's tests, made by real guarded calls:
confirmed charges, refunds whose outcome was lost and parked for review, a failed email, a shipment
left unknown by a probe that raised, and older charges whose histories spread over a few hours (for the
latency chart)."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from onceonly import Ledger, State
from onceonly.states import Record


@dataclass
class Seeded:
    """The keys ``seed`` made, by what they are."""

    confirmed: list[str] = field(default_factory=list)
    review: list[str] = field(default_factory=list)
    failed: str = ""
    unknown: str = ""


def timed_charge(key: str, began: float, took: float) -> Record:
    """A charge confirmed by its run ``began`` seconds since the epoch, after ``took`` seconds."""
    history = [
        {"at": began, "from": None, "to": "in_flight", "fence": 1, "reason": "claim", "by": "worker-1"},
        {"at": began + took, "from": "in_flight", "to": "confirmed", "fence": 1, "reason": "confirmed via run"},
    ]
    return Record(
        key=key, scope="default", tool="charge", fingerprint="f", state=State.CONFIRMED, attempts=1, fence=1,
        created_at=began, updated_at=began + took, args_json=json.dumps({"order": key[-4:]}),
        result_json=json.dumps({"charged": key[-4:]}), history_json=json.dumps(history), via="run",
    )  # fmt: skip


def seed(url: str, *, orders: int = 3, reviews: int = 2, spread_hours: int = 6) -> Seeded:
    """Fill the (empty) ledger at ``url``; return its keys."""
    made = Seeded()
    with Ledger.open(url) as ledger:

        @ledger.tool(name="charge")
        def charge(order: str, amount: int) -> dict[str, Any]:
            time.sleep(0.002 * amount)
            return {"charged": order}

        @ledger.tool(name="refund", on_unknown="review")
        def refund(order: str) -> None:
            raise TimeoutError("read timed out")

        @ledger.tool(name="email")
        def email(to: str) -> None:
            raise ValueError("no such mailbox")

        def ask(args: dict[str, Any], key: str) -> Any:
            raise ConnectionError("the carrier's API is down")

        @ledger.tool(name="ship", on_unknown="probe", probe=ask)
        def ship(order: str) -> None:
            raise TimeoutError("read timed out")

        for n in range(1, orders + 1):
            charge(f"o-{n}", n)
            made.confirmed.append(charge.key_for(f"o-{n}", n))
        for n in range(1, reviews + 1):
            with pytest.raises(Exception, match="unknown"):
                refund(f"o-{n}")
            made.review.append(refund.key_for(f"o-{n}"))
        with pytest.raises(ValueError, match="mailbox"):
            email("nobody@example.com")
        made.failed = email.key_for("nobody@example.com")
        with pytest.raises(Exception, match="unknown"):
            ship("o-1")
        made.unknown = ship.key_for("o-1")
        hour_start = time.time() // 3600 * 3600  # each hour's three charges in one 15-minute bucket
        for hour in range(spread_hours):
            for n in range(3):
                rec = timed_charge(
                    f"default:charge:h{hour:02d}n{n}",
                    hour_start - 3600 * (hour + 1) + 60 * n,
                    0.05 * (n + 1) + 0.01 * hour,
                )
                assert ledger.store.insert(rec)
                made.confirmed.append(rec.key)
    return made


ONCEONLY = str(Path(sys.executable).parent / "onceonly")
_READY = re.compile(r" at (?P<url>http://\S+?)/(?:\?token=<token>)? ")


@dataclass(frozen=True)
class Running:
    """A dashboard process: its base URL, and the line it printed when it began to listen."""

    url: str
    banner: str


@contextmanager
def running(url: str, *args: str, env: dict[str, str] | None = None, timeout: float = 30) -> Iterator[Running]:
    """``onceonly dashboard --url URL --port 0 ARGS`` in its own process, once it listens; stopped
    (SIGTERM to its PID) at the end of the block."""
    proc = subprocess.Popen(
        [ONCEONLY, "dashboard", "--url", url, "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        found = _READY.search(line)
        if found is None:
            proc.kill()
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"onceonly dashboard did not start: {line!r} {err}")
        yield Running(found["url"], line)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=15)  # and close its pipes
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


class Events:
    """The events of a server-sent event stream (an httpx streaming response), one at a time."""

    def __init__(self, response: httpx.Response) -> None:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        self._chunks = response.iter_text()
        self._buffer = ""

    def next(self) -> tuple[str, Any]:
        """The next event's name and its data (JSON); retry lines and comments are passed over."""
        while True:
            while "\n\n" in self._buffer:
                block, self._buffer = self._buffer.split("\n\n", 1)
                lines = [line.split(": ", 1) for line in block.splitlines() if not line.startswith(":")]
                fields = {pair[0]: pair[1] for pair in lines if len(pair) == 2}
                if "event" in fields:
                    return fields["event"], json.loads(fields["data"])
            self._buffer += next(self._chunks)
