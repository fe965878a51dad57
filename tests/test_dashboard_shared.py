"""Every open dashboard page reads the ledger's figures (``/api/stats``: ``ops.stats``, which reads every
record) again when its event stream shows new counts. Those readings are one computation per dashboard
process: one at a time, shared by every page that asks for the same counts, each page still shown the
latest. Counted here by the store's own ``scan`` calls (one per reading of this small ledger), on each
store."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from onceonly import Ledger, State
from onceonly import states as st
from onceonly.dashboard.app import create_app
from onceonly.tickets import serve_in_thread

PAGES = 4
CHANGES = 5


class Counted:
    """One of the store's own methods (``scan``, ``count_by_state``), counted: how many calls ran, and how
    many at once at most. ``hold`` makes the first call wait, once it has read, until ``release`` is set."""

    def __init__(self, method: Callable[..., Any], *, hold: bool = False) -> None:
        self.method = method
        self.calls = 0
        self.running = self.most = 0
        self.hold = hold
        self.read = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        with self._lock:
            self.calls += 1
            first = self.calls == 1
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            found = self.method(*args)
            if self.hold and first:
                self.read.set()
                assert self.release.wait(60), "the test never released the first reading"
            return found
        finally:
            with self._lock:
                self.running -= 1


@pytest.fixture(name="ledger")
def fixture_ledger(store_url: str) -> Iterator[Ledger]:
    with Ledger.open(store_url) as ledger:
        yield ledger


def _pages(stack: ExitStack, ledger: Ledger) -> list[TestClient]:
    app = create_app(ledger, poll_seconds=0.01)
    return [stack.enter_context(TestClient(app, base_url="http://127.0.0.1")) for _ in range(PAGES)]


def _stats(page: TestClient, seen: dict[str, int]) -> dict[str, Any]:
    """What a page asks when its event stream shows ``seen``: the figures, for the counts it saw."""
    answer = page.get("/api/stats", params={"seen": json.dumps(seen)})
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def test_four_pages_share_one_reading_per_change(ledger: Ledger) -> None:
    """Four pages open, five changes: each change makes every page ask for the figures, and the store is
    read once per change (not four times), each page shown that change."""
    charge = ledger.tool(name="charge")(lambda order: {"order": order})
    charge(0)
    scans = Counted(ledger.store.scan)
    ledger.store.scan = scans  # type: ignore[method-assign]
    shown: list[list[int]] = [[] for _ in range(PAGES)]
    change = threading.Barrier(PAGES + 1)
    errors: list[BaseException] = []
    with ExitStack() as stack:
        pages = _pages(stack, ledger)
        seen: dict[str, int] = {}

        def page(i: int) -> None:
            try:
                for _ in range(CHANGES):
                    change.wait(60)  # the change is made: the event stream shows its counts
                    shown[i].append(_stats(pages[i], seen)["total"])
                    change.wait(60)
            except BaseException as exc:
                errors.append(exc)
                change.abort()

        threads = [threading.Thread(target=page, args=(i,)) for i in range(PAGES)]
        for t in threads:
            t.start()
        for n in range(1, CHANGES + 1):
            charge(n)
            seen = ledger.stats()  # what the shared event stream sends every page
            change.wait(60)
            change.wait(60)
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert shown == [list(range(2, CHANGES + 2))] * PAGES, "a page was not shown the change it saw"
    assert scans.calls == CHANGES, f"{scans.calls} readings of the ledger for {CHANGES} changes"
    assert scans.most == 1


def test_pages_that_ask_during_a_reading_share_the_next_one(ledger: Ledger) -> None:
    """A reading is running (held once it has read) while three changes land and the other pages ask
    for the figures with the new counts: no second reading runs beside it, and one more reading then
    answers all three pages with the latest counts, however many changes it covers."""
    charge = ledger.tool(name="charge")(lambda order: {"order": order})
    charge(0)
    scans = Counted(ledger.store.scan, hold=True)
    ledger.store.scan = scans  # type: ignore[method-assign]
    before = ledger.stats()
    with ExitStack() as stack:
        pages = _pages(stack, ledger)
        got: dict[int, dict[str, Any]] = {}
        first = threading.Thread(target=lambda: got.__setitem__(0, _stats(pages[0], before)))
        first.start()
        assert scans.read.wait(60)
        for n in range(1, 4):
            charge(n)
        after = ledger.stats()
        others = [threading.Thread(target=lambda i=i: got.__setitem__(i, _stats(pages[i], after))) for i in (1, 2, 3)]
        for t in others:
            t.start()
        scans.release.set()
        for t in [first, *others]:
            t.join(60)
    assert got[0]["total"] == 1
    assert [got[i]["total"] for i in (1, 2, 3)] == [4, 4, 4], "a page was not shown the latest counts"
    assert scans.most == 1, "two readings of the ledger ran at once"
    assert scans.calls == 2, f"{scans.calls} readings for one page and three that asked together"


def _one_write(ledger: Ledger, n: int) -> None:
    """A confirmed record made in one write (a claim of it as confirmed): its counts change once, so every
    page's event stream shows exactly one change for it."""
    now = ledger.clock()
    rec = st.new_record(
        key=f"made:{n}", scope="s", tool="made", fingerprint="f" * 64, args_json="{}", state=State.IN_FLIGHT,
        owner="test", now=now, lease_seconds=30,
    )  # fmt: skip
    assert ledger.store.claim(st.confirm(rec, result_json=str(n), now=now, ttl=None, via="run", by="test")) is None


def test_four_pages_on_their_event_streams_share_one_reading_per_change(ledger: Ledger) -> None:
    """The dashboard served, four pages each on their own event stream, as the page does: at each change
    of the counts a page asks for the figures with the counts it saw. Five changes read the ledger five
    times, and the counts behind the four streams are never read twice at once."""
    _one_write(ledger, 0)
    scans = Counted(ledger.store.scan)
    counts = Counted(ledger.store.count_by_state)
    ledger.store.scan = scans  # type: ignore[method-assign]
    ledger.store.count_by_state = counts  # type: ignore[method-assign]
    step = threading.Barrier(PAGES + 1)
    shown: list[list[int]] = [[] for _ in range(PAGES)]
    errors: list[BaseException] = []
    with serve_in_thread(create_app(ledger, poll_seconds=0.01)) as server:

        def page(i: int) -> None:
            try:
                with (
                    httpx.Client(base_url=server.url, timeout=60) as client,
                    client.stream("GET", "/api/events") as stream,
                ):
                    last = None
                    for line in stream.iter_lines():
                        if not line.startswith("data: "):
                            continue
                        states = json.loads(line[6:])["states"]
                        if last is not None and states != last:
                            stats = client.get("/api/stats", params={"seen": json.dumps(states)})
                            shown[i].append(stats.json()["total"])
                        last = states
                        step.wait(60)  # the first counts, or one change: shown
                        if len(shown[i]) == CHANGES:
                            return
            except BaseException as exc:
                errors.append(exc)
                step.abort()

        threads = [threading.Thread(target=page, args=(i,)) for i in range(PAGES)]
        for t in threads:
            t.start()
        step.wait(60)  # every page has its first counts
        for n in range(1, CHANGES + 1):
            _one_write(ledger, n)
            step.wait(60)
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert shown == [list(range(2, CHANGES + 2))] * PAGES, "a page was not shown the change it saw"
    assert scans.calls == CHANGES, f"{scans.calls} readings of the ledger for {CHANGES} changes on {PAGES} pages"
    assert scans.most == 1 and counts.most == 1


def test_pages_share_a_reading_newer_than_the_counts_they_saw(ledger: Ledger) -> None:
    """The counts change again between the event the pages saw and their asking: the first page's
    reading (which started after the count behind that event) is newer than what every page saw, so it
    answers all four, although its counts are not the ones they saw."""
    _one_write(ledger, 0)
    scans = Counted(ledger.store.scan, hold=True)
    ledger.store.scan = scans  # type: ignore[method-assign]
    saw = threading.Barrier(PAGES + 1)
    go = threading.Event()
    got: dict[int, int] = {}
    errors: list[BaseException] = []
    with serve_in_thread(create_app(ledger, poll_seconds=0.01)) as server:

        def page(i: int) -> None:
            try:
                with (
                    httpx.Client(base_url=server.url, timeout=60) as client,
                    client.stream("GET", "/api/events") as stream,
                ):
                    events = (json.loads(ln[6:])["states"] for ln in stream.iter_lines() if ln.startswith("data: "))
                    first = next(events)
                    saw.wait(60)  # listening
                    seen = next(s for s in events if s != first)  # the change: one more record
                    saw.wait(60)
                    assert (go if i == 0 else scans.read).wait(60)
                    got[i] = _stats(client, seen)["total"]  # type: ignore[arg-type]
            except BaseException as exc:
                errors.append(exc)
                saw.abort()

        threads = [threading.Thread(target=page, args=(i,)) for i in range(PAGES)]
        for t in threads:
            t.start()
        saw.wait(60)  # every page listens
        _one_write(ledger, 1)
        saw.wait(60)  # every page saw the counts of two records
        _one_write(ledger, 2)  # and the ledger moves on before they ask
        go.set()
        assert scans.read.wait(60)
        scans.release.set()
        for t in threads:
            t.join(60)
    assert not errors, errors
    assert got == dict.fromkeys(range(PAGES), 3)
    assert scans.calls == 1, f"{scans.calls} readings for four pages that saw the same counts"
    assert scans.most == 1
