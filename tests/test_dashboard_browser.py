"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright, against
``onceonly dashboard`` in a process of its own over a SQLite ledger.

Chromium is the system's (``/usr/bin/chromium``): Playwright never downloads a browser here. Under
``CI=true`` a missing Chromium is installed with apt-get when running as root, and anything still
missing fails the test; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import onceonly
from onceonly import Ledger, State
from onceonly import states as st
from tests._dashboard import running, seed, timed_charge
from tests._redis_server import PrivateRedis
from tests.conftest import IN_CI

CHROMIUM = "/usr/bin/chromium"
TOKEN = "browser-t0ken-of-the-dashboard"


def _unavailable(reason: str) -> None:
    if IN_CI:
        pytest.fail(f"CI=true and {reason}: CI must run the browser test", pytrace=False)
    pytest.skip(reason)


def _install_chromium() -> None:
    """apt-get install Debian's chromium, in CI as root only: a developer's machine is not changed."""
    if not (IN_CI and os.geteuid() == 0 and shutil.which("apt-get")):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update"], check=False, env=env, capture_output=True, timeout=600)
    done = subprocess.run(
        ["apt-get", "install", "-y", "--no-install-recommends", "chromium", "chromium-driver"],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        pytest.fail(f"apt-get install chromium failed: {done.stderr[-2000:]}", pytrace=False)


@pytest.fixture(name="browser", scope="module")
def fixture_browser() -> Iterator[Any]:
    """Headless Chromium from /usr/bin/chromium, through Playwright."""
    if not os.path.exists(CHROMIUM):
        _install_chromium()
    if not os.path.exists(CHROMIUM):
        _unavailable(f"{CHROMIUM} is missing: apt-get install chromium")
    if importlib.util.find_spec("playwright") is None:
        _unavailable("playwright is not installed: pip install 'playwright>=1.40,<2' (never `playwright install`)")
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=10_000)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()


def _extra_charges(url: str) -> None:
    """Two charges in the two 15-minute buckets after the one of two hours ago: three adjacent buckets
    with attempts, between stretches without any (the seed's charges are an hour apart)."""
    hour_start = time.time() // 3600 * 3600
    with Ledger.open(url) as ledger:
        for n in (1, 2):
            began = hour_start - 7200 + 900 * n + 60
            assert ledger.store.insert(timed_charge(f"default:charge:run{n}", began, 0.07 * n))


def _runs(series: list[dict[str, Any]], bucket: float) -> list[list[float]]:
    """The starts of the buckets, grouped in runs of adjacent ones."""
    runs: list[list[float]] = []
    for point in series:
        if runs and point["start"] - runs[-1][-1] == bucket:
            runs[-1].append(point["start"])
        else:
            runs.append([point["start"]])
    return runs


def _open(browser: Any, url: str) -> tuple[Any, list[str]]:
    """A page of the dashboard at ``url`` with its token, live; and the errors its console shows."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(f"{url}/?token={TOKEN}")
    page.wait_for_selector("#live.on")
    return page, problems


def _rows(page: Any) -> list[str]:
    return page.eval_on_selector_all("#records tr[data-key]", "rows => rows.map(r => r.dataset.key)")  # type: ignore[no-any-return]


def test_the_page_shows_filters_opens_resolves_and_updates_live(browser: Any, sqlite_url: str, tmp_path: Path) -> None:
    """The page opens on what needs a person, oldest first (a click on "age" turns it); a state filter
    lists the records in review; a row opens its timeline; resolving it with a reason and a name
    changes the store; a record made after the page loaded appears without a reload; the latency chart
    draws a line only across adjacent buckets with attempts, and marks the stretches without any; the
    page breaks none of its own security policy. A screenshot is kept under the test's folder."""
    from playwright.sync_api import expect

    made = seed(sqlite_url, orders=3, reviews=2, spread_hours=6)
    _extra_charges(sqlite_url)
    key = made.review[0]
    with running(sqlite_url, env={"ONCEONLY_DASHBOARD_TOKEN": TOKEN}) as dashboard:
        page, problems = _open(browser, dashboard.url)
        try:
            assert TOKEN not in page.url  # taken out of the address bar, kept for the tab
            assert page.inner_text('[data-count="needs_review"] b') == "2"
            assert page.inner_text('[data-count="total"] b') == "27"
            expect(page.locator("#records tr[data-key]")).to_have_count(3)
            assert _rows(page) == [*made.review, made.unknown]  # needs a person, oldest first
            assert page.get_attribute("#view-attention", "aria-pressed") == "true"
            page.click("#sort-age")
            expect(page.locator("#records tr[data-key]").first).to_have_attribute("data-key", made.unknown)
            assert _rows(page) == [made.unknown, *made.review[::-1]]
            page.click("#sort-age")
            expect(page.locator("#records tr[data-key]").first).to_have_attribute("data-key", key)

            page.wait_for_selector("#charts .chart[data-tool='charge'] svg polyline")
            auth = {"Authorization": f"Bearer {TOKEN}"}
            latency = httpx.get(f"{dashboard.url}/api/stats", headers=auth, timeout=30).json()["latency"]
            runs = _runs(latency["tools"]["charge"], latency["bucket_seconds"])
            chart = "#charts .chart[data-tool='charge']"
            lines = page.eval_on_selector_all(
                f"{chart} polyline.p50",
                "ls => ls.map(l => [+l.dataset.from, +l.dataset.to, l.getAttribute('points').split(' ').length])",
            )
            joined = [[run[0], run[-1], len(run)] for run in runs if len(run) > 1]
            assert lines == joined == [[runs[4][0], runs[4][-1], 3]]  # two hours ago: three adjacent buckets
            assert page.locator(f"{chart} polyline.p99").count() == 1
            assert page.locator(f"{chart} rect.gap").count() == len(runs) - 1 >= 6
            page.evaluate("window.notReloaded = true")

            page.select_option("#f-state", "needs_review")
            page.click("#filters button[type=submit]")
            expect(page.locator("#records tr[data-key]")).to_have_count(2)
            assert _rows(page) == made.review

            page.click(f'#records tr[data-key="{key}"] td.age')
            page.wait_for_selector("#resolve")
            timeline = page.inner_text("#detail-body ol.timeline")
            assert "(new) → in_flight" in timeline and "unknown → needs_review" in timeline
            assert "TimeoutError: read timed out" in page.inner_text("#detail-body")
            page.screenshot(path=str(tmp_path / "dashboard-review.png"), full_page=True)

            page.fill("#resolve-why", "the bank shows no refund")
            page.fill("#resolve-by", "alice")
            with Ledger.open(sqlite_url) as ledger:  # a call elsewhere, while the form is being filled

                @ledger.tool(name="charge")
                def charge(order: str, amount: int) -> dict[str, Any]:
                    return {"charged": order}

                charge("o-late", 5)
                late = charge.key_for("o-late", 5)
            expect(page.locator('[data-count="total"] b')).to_have_text("28")
            assert page.input_value("#resolve-why") == "the bank shows no refund"  # the update kept the form

            page.click("#resolve-confirm")
            page.wait_for_selector("#detail-body [data-state='failed'].state")
            expect(page.locator('[data-count="needs_review"] b')).to_have_text("1")
            with Ledger.open(sqlite_url) as ledger:
                rec = ledger.get(key)
            assert rec is not None and rec.state is State.FAILED and rec.via == "resolve"
            assert rec.history[-1]["by"] == "alice"
            assert rec.history[-1]["reason"] == "resolved by alice: the bank shows no refund"
            page.click("#f-clear")
            page.click("#view-all")
            page.select_option("#f-sort", "-age")
            expect(page.locator("#records tr[data-key]").first).to_have_attribute("data-key", late)
            assert page.evaluate("window.notReloaded") is True
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")
            assert not problems, problems
        finally:
            page.close()


def test_a_person_searches_reconciles_and_resolves_a_selection(browser: Any, sqlite_url: str, tmp_path: Path) -> None:
    """The search box finds the records of an order id; the unsettled view lists the oldest first;
    "Reconcile now" runs the reconciler (a dead holder's charge is failed, with the person's name in
    its history) and shows what it did; the
    conflicts view lists the record whose side effect happened twice; two records in review picked
    and resolved together, after a second, explicit click, are failed in the store with who and why."""
    from playwright.sync_api import expect

    made = seed(sqlite_url, orders=3, reviews=2, spread_hours=1)
    twice = timed_charge("default:charge:twice", time.time() - 60, 0.1)
    with Ledger.open(sqlite_url) as ledger:
        assert ledger.store.insert(dataclasses.replace(twice, conflicts=2))
        now = time.time()
        dead = st.new_record(
            key="default:charge:dead", scope="default", tool="charge", fingerprint="f" * 64,
            args_json=json.dumps({"order": "o-dead", "amount": 1}), state=State.PENDING, owner="worker-dead",
            now=now - 120, lease_seconds=60,
        )  # fmt: skip
        assert ledger.store.insert(dead)
    with running(sqlite_url, env={"ONCEONLY_DASHBOARD_TOKEN": TOKEN}) as dashboard:
        page, problems = _open(browser, dashboard.url)
        try:
            page.click("#view-all")
            page.fill("#f-arg", "o-2")
            page.press("#f-arg", "Enter")
            expect(page.locator("#records tr[data-key]")).to_have_count(2)
            assert set(_rows(page)) == {made.confirmed[1], made.review[1]}
            page.fill("#f-arg", "order=o-dead")
            page.press("#f-arg", "Enter")
            expect(page.locator("#records tr[data-key]")).to_have_count(1)
            assert _rows(page) == [dead.key] and page.inner_text("#records tr td .state") == "pending"

            page.click("#f-clear")
            page.click("#view-unsettled")  # the oldest unsettled first: the dead holder's charge, then the others
            expect(page.locator("#records tr[data-key]")).to_have_count(4)
            assert _rows(page) == [dead.key, *made.review, made.unknown], page.inner_text("#records")
            page.fill("#who", "carol")
            page.click("#reconcile")
            expect(page.locator("#reconcile-report")).to_contain_text("1 failed")
            expect(page.locator("#records tr[data-key]")).to_have_count(3)  # settled: no longer unsettled
            expect(page.locator('[data-count="pending"] b')).to_have_text("0")
            expect(page.locator('[data-count="failed"] b')).to_have_text("2")
            with Ledger.open(sqlite_url) as ledger:
                rec = ledger.get(dead.key)
            assert rec is not None and rec.state is State.FAILED
            assert rec.history[-1]["by"] == "reconcile@dashboard:carol"

            page.click("#f-clear")
            page.click("#view-conflicts")
            expect(page.locator("#records tr[data-key]")).to_have_count(1)
            assert _rows(page) == [twice.key] and "2 CONFLICT(S)" in page.inner_text("#records")

            page.click("#view-attention")
            expect(page.locator("#records tr[data-key]")).to_have_count(3)
            assert page.locator("#records input.pick").count() == 2  # only records in review are picked
            page.check("#check-all")
            expect(page.locator("#bulk-count")).to_have_text("2 selected")
            page.fill("#bulk-why", "the bank shows no refund")
            page.click("#bulk-resolve")
            expect(page.locator("#bulk-question")).to_have_text("Resolve 2 record(s) as failed? ")
            with Ledger.open(sqlite_url) as ledger:  # nothing is written before the second click
                assert {ledger.get(k).state for k in made.review} == {State.NEEDS_REVIEW}  # type: ignore[union-attr]
            page.screenshot(path=str(tmp_path / "dashboard-bulk.png"), full_page=True)
            page.click("#bulk-yes")
            expect(page.locator("#bulk-note")).to_contain_text("Resolved 2, refused 0")
            expect(page.locator('[data-count="needs_review"] b')).to_have_text("0")
            expect(page.locator("#records tr[data-key]")).to_have_count(1)
            assert _rows(page) == [made.unknown]
            with Ledger.open(sqlite_url) as ledger:
                for key in made.review:
                    rec = ledger.get(key)
                    assert rec is not None and rec.state is State.FAILED and rec.via == "resolve"
                    assert rec.history[-1]["reason"] == "resolved by carol: the bank shows no refund"
            assert not problems, problems
        finally:
            page.close()


def test_a_person_pauses_and_resumes_calls_from_the_page(browser: Any, sqlite_url: str, tmp_path: Path) -> None:
    """ "Pause calls…" with a tool, a reason and a name pauses that tool for every process (a call in
    another process's ledger is refused and records nothing); a pause set elsewhere appears in the banner
    without a reload; "Resume" on the tool's pause lifts it alone, and the call then runs once."""
    from playwright.sync_api import expect

    seed(sqlite_url, orders=1, reviews=0, spread_hours=1)
    effects: list[str] = []
    with running(sqlite_url, env={"ONCEONLY_DASHBOARD_TOKEN": TOKEN}) as dashboard, Ledger.open(sqlite_url) as app:

        @app.tool(name="charge")
        def charge(order: str, amount: int) -> str:
            effects.append(order)
            return order

        page, problems = _open(browser, dashboard.url)
        try:
            expect(page.locator("#pauses")).to_be_hidden()
            page.fill("#who", "dana")
            page.click("#pause-open")
            page.fill("#pause-tool", "charge")
            page.click("#pause-submit")  # no reason yet: refused on the page, nothing written
            expect(page.locator("#pause-note")).to_contain_text("Give the reason")
            assert app.pauses() == []
            page.fill("#pause-reason", "card provider incident")
            page.click("#pause-submit")
            expect(page.locator("#pauses")).to_contain_text("Paused: tool 'charge' in every scope")
            expect(page.locator("#pauses")).to_contain_text("by dana: card provider incident")
            (set_here,) = app.pauses()
            assert (set_here.tool, set_here.scope, set_here.by) == ("charge", None, "dana")
            with pytest.raises(onceonly.Paused):
                charge("o-paused", 3)
            assert effects == [] and app.get(charge.key_for("o-paused", 3)) is None

            app.pause(scope="tenant-b", reason="tenant b is moving", by="erin")  # elsewhere: shown by the next read
            expect(page.locator("#pauses .pause")).to_have_count(2, timeout=15_000)
            page.screenshot(path=str(tmp_path / "dashboard-paused.png"), full_page=True)
            page.click('#pauses .pause[data-tool="charge"] button.resume')
            expect(page.locator("#pauses .pause")).to_have_count(1)
            expect(page.locator("#pauses")).to_contain_text("Paused: every tool in scope 'tenant-b'")
            assert [(p.tool, p.scope) for p in app.pauses()] == [(None, "tenant-b")]
            assert charge("o-paused", 3) == "o-paused"
            assert effects == ["o-paused"] and app.get(charge.key_for("o-paused", 3)).attempts == 1  # type: ignore[union-attr]
            assert not problems, problems
        finally:
            page.close()


def test_stale_data_is_marked_while_the_store_is_down(browser: Any, tmp_path: Path) -> None:
    """A private Redis under the dashboard is stopped: the page keeps what it showed, under a banner
    that says it is not up to date and since when, with the tiles, rows and charts marked stale; once
    the server is back (its data kept) the marks go and the page reads the store again. A read that
    fails on its own (the counts unchanged) is marked the same way, until a read succeeds again."""
    from playwright.sync_api import expect

    server = PrivateRedis(tmp_path, "--appendonly", "yes", "--appendfsync", "always").start()
    try:
        made = seed(server.url, orders=2, reviews=2, spread_hours=2)
        with running(server.url, "--poll", "0.2", env={"ONCEONLY_DASHBOARD_TOKEN": TOKEN}) as dashboard:
            page, problems = _open(browser, dashboard.url)
            try:
                expect(page.locator("#records tr[data-key]")).to_have_count(3)
                page.wait_for_selector("#charts .chart[data-tool='charge'] svg")
                assert page.is_hidden("#stale")
                server.stop()
                expect(page.locator("#stale")).to_be_visible()
                assert "Not up to date: the store does not answer" in page.inner_text("#stale")
                assert " UTC; they update when the store answers again." in page.inner_text("#stale")
                for marked in ("#counts", "#records", "#charts"):
                    expect(page.locator(marked)).to_have_class(re.compile(r"\bstale\b"))
                assert _rows(page) == [*made.review, made.unknown]  # kept, marked
                tile = '[data-count="needs_review"] b'
                assert page.inner_text(tile) == "2"
                marker = f"getComputedStyle(document.querySelector('{tile}'), '::after').content"
                assert page.evaluate(marker) == '" stale"'

                page.screenshot(path=str(tmp_path / "dashboard-stale.png"), full_page=True)

                server.start()
                expect(page.locator("#stale")).to_be_hidden(timeout=20_000)
                for marked in ("#counts", "#records", "#charts"):
                    expect(page.locator(marked)).not_to_have_class(re.compile(r"\bstale\b"))
                assert page.evaluate(marker) == "none"
                # A read that fails while the event stream's counts stay as they were: marked too, and
                # cleared by the next read that succeeds, tried again without a change to wait for.
                records = "**/api/records?*"
                down = json.dumps({"error": "the store timed out"})
                page.route(records, lambda route: route.fulfill(status=503, content_type="application/json", body=down))
                with Ledger.open(server.url) as ledger:

                    @ledger.tool(name="refund", on_unknown="review")
                    def refund(order: str) -> None:
                        raise TimeoutError("read timed out")

                    with pytest.raises(Exception, match="unknown"):
                        refund("o-after")
                expect(page.locator("#stale")).to_contain_text("the store timed out")
                expect(page.locator("#records")).to_have_class(re.compile(r"\bstale\b"))
                assert _rows(page) == [*made.review, made.unknown]
                page.unroute(records)
                expect(page.locator("#stale")).to_be_hidden()
                expect(page.locator("#records tr[data-key]")).to_have_count(4)  # live again
                # A failed fetch while the store was down is the browser's own log line; nothing else.
                assert all("503" in p for p in problems), problems
            finally:
                page.close()
    finally:
        server.stop()


def test_a_person_approves_an_operation_through_the_page(browser: Any, sqlite_url: str, tmp_path: Path) -> None:
    """A call of an approve= tool waits in the needs-a-person view; the page approves it with a reason
    and a name (the store's history has them), and the next call runs it once. The approve and deny
    endpoints take the same token and same-origin rules as resolve."""
    from playwright.sync_api import expect

    effects: list[str] = []
    with Ledger.open(sqlite_url) as ledger:

        @ledger.tool(name="pay", approve=True)
        def pay(to: str, amount: int) -> str:
            effects.append(to)
            return f"paid {to}"

        for to in ("ana", "bo"):
            with pytest.raises(onceonly.ApprovalPending):
                pay(to, 50)
        key, other = pay.key_for("ana", 50), pay.key_for("bo", 50)
        with running(sqlite_url, env={"ONCEONLY_DASHBOARD_TOKEN": TOKEN}) as dashboard:
            api = f"{dashboard.url}/api"
            body = {"key": other, "by": "mallory"}
            assert httpx.post(f"{api}/deny", json=body, timeout=30).status_code == 401
            foreign = {"Authorization": f"Bearer {TOKEN}", "Origin": "https://evil.example"}
            assert httpx.post(f"{api}/deny", json=body, headers=foreign, timeout=30).status_code == 403
            page, problems = _open(browser, dashboard.url)
            try:
                expect(page.locator('[data-count="awaiting_approval"] b')).to_have_text("2")
                expect(page.locator("#records tr[data-key]")).to_have_count(2)
                assert set(_rows(page)) == {key, other}
                page.click(f'#records tr[data-key="{key}"] td.age')
                page.wait_for_selector("#approval")
                page.fill("#approve-reason", "known customer")
                page.fill("#approve-by", "maria")
                page.click("#approve-yes")
                page.wait_for_selector("#detail-body [data-state='pending'].state")
                expect(page.locator('[data-count="awaiting_approval"] b')).to_have_text("1")
                assert not problems, problems
            finally:
                page.close()
            ok = {"Authorization": f"Bearer {TOKEN}"}
            again = httpx.post(f"{api}/approve", json={"key": key, "by": "maria"}, headers=ok, timeout=30)
            assert again.status_code == 409 and "not awaiting_approval" in again.json()["error"]
        rec = ledger.get(key)
        assert rec is not None and rec.state is State.PENDING
        assert (rec.history[-1][st.APPROVED_BY], rec.history[-1]["reason"]) == ("maria", "known customer")
        assert pay("ana", 50) == "paid ana" and pay("ana", 50) == "paid ana"
        assert effects == ["ana"]


def test_the_page_shows_each_budgets_use(browser: Any, sqlite_url: str) -> None:
    """A budgeted tool's window is shown with what it holds of its limit, and follows a new call live."""
    from playwright.sync_api import expect

    from onceonly import Budget

    def spend(order: str) -> None:
        with Ledger.open(sqlite_url) as ledger:

            @ledger.tool(name="pay", budget=Budget(amount="cents", limit=500, per="1d", by="tool"))
            def pay(order: str, cents: int) -> str:
                return order

            pay(order, 120)

    spend("o-1")
    with running(sqlite_url, "--poll", "0.2", env={"ONCEONLY_DASHBOARD_TOKEN": TOKEN}) as dashboard:
        page, problems = _open(browser, dashboard.url)
        try:
            row = page.locator("#budget-rows tr[data-budget='tool:pay']")
            expect(page.locator("#budgets")).to_be_visible()
            expect(row.locator("td.used")).to_have_text("120")
            assert "500" in row.inner_text()
            spend("o-2")
            expect(row.locator("td.used")).to_have_text("240")
            assert row.locator("progress").get_attribute("value") == "48"
            assert problems == []
        finally:
            page.close()
