"""``Ledger.open`` says where the ledger is: the default SQLite file is relative to the working
directory, so the ``onceonly`` logger names its absolute path (and where the URL came from) at INFO."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

import onceonly
from tests._urls import SECRET, with_password
from tests.conftest import RUN_ID, join_url


def _opened(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "onceonly" and "ledger at" in r.getMessage()]


def test_the_default_ledger_is_logged_with_its_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With no URL and no $ONCEONLY_URL, the log names the default file under the working directory."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ONCEONLY_URL", raising=False)
    with caplog.at_level(logging.INFO, logger="onceonly"):
        ledger = onceonly.Ledger.open()
    ledger.close()
    where = (tmp_path / ".onceonly" / "ledger.db").resolve()
    assert _opened(caplog) == [f"onceonly: ledger at {where} (the default URL; set $ONCEONLY_URL to choose)"]


def test_the_environment_url_is_logged_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """$ONCEONLY_URL is used when no URL is given, and the log says so."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ONCEONLY_URL", "sqlite:///from-env.db")
    with caplog.at_level(logging.INFO, logger="onceonly"):
        ledger = onceonly.Ledger.open()
    ledger.close()
    assert _opened(caplog) == [f"onceonly: ledger at {(tmp_path / 'from-env.db').resolve()} ($ONCEONLY_URL)"]


def test_a_server_url_is_logged_without_its_password(
    redis_base_url: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A Redis URL is logged as given, its password masked."""
    monkeypatch.delenv("ONCEONLY_URL", raising=False)
    with caplog.at_level(logging.INFO, logger="onceonly"):
        ledger = onceonly.Ledger.open(join_url(with_password(redis_base_url), prefix=f"onceonly-test-{RUN_ID}-open"))
    ledger.close()
    said = _opened(caplog)
    assert len(said) == 1 and said[0].endswith("(the url given)")
    assert SECRET not in caplog.text
