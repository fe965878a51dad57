"""The dashboard in a real browser: Debian's Chromium, headless, driven by Playwright, against
``onceonly dashboard`` in a process of its own over a SQLite ledger.

Chromium is the system's (``/usr/bin/chromium``): Playwright never downloads a browser here. Under
``CI=true`` a missing Chromium is installed with apt-get when running as root, and anything still
missing fails the test; elsewhere it is skipped with the reason.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onceonly import Ledger, State
from tests._dashboard import running, seed
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


def test_the_page_shows_filters_opens_resolves_and_updates_live(browser: Any, sqlite_url: str, tmp_path: Path) -> None:
    """The page loads with the counts; a state filter lists the records in review; a row opens its
    timeline; resolving it with a reason and a name changes the store; a record made after the page
    loaded appears without a reload; the page breaks none of its own security policy. A screenshot is
    kept under the test's folder."""
    from playwright.sync_api import expect

    made = seed(sqlite_url, orders=3, reviews=2, spread_hours=6)
    key = made.review[0]
    with running(sqlite_url, env={"ONCEONLY_DASHBOARD_TOKEN": TOKEN}) as dashboard:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        problems: list[str] = []
        page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: problems.append(str(e)))
        try:
            page.goto(f"{dashboard.url}/?token={TOKEN}")
            assert TOKEN not in page.url  # taken out of the address bar, kept for the tab
            page.wait_for_selector("#live.on")
            assert page.inner_text('[data-count="needs_review"] b') == "2"
            assert page.inner_text('[data-count="total"] b') == "25"
            page.wait_for_selector("#charts .chart[data-tool='charge'] svg polyline")
            page.evaluate("window.notReloaded = true")

            page.select_option("#f-state", "needs_review")
            page.click("#filters button[type=submit]")
            expect(page.locator("#records tr[data-key]")).to_have_count(2)
            shown = page.eval_on_selector_all("#records tr[data-key]", "rows => rows.map(r => r.dataset.key)")
            assert shown == sorted(made.review)

            page.click(f'#records tr[data-key="{key}"]')
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
            expect(page.locator('[data-count="total"] b')).to_have_text("26")
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
            page.wait_for_selector(f'#records tr[data-key="{late}"]')
            assert page.evaluate("window.notReloaded") is True
            shot = tmp_path / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"screenshot: {shot}")
            assert not problems, problems
        finally:
            page.close()
