"""Real crashes: the ticket service runs in a subprocess (``python -m onceonly.tickets``) that a fault
kills with ``os._exit`` between the ticket's write and the response; it is restarted on the same
database and the client retries with the same key."""

from __future__ import annotations

import re
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from onceonly.tickets.faults import CRASH_EXIT_CODE

from .conftest import new_ticket

pytestmark = pytest.mark.slow

KEY = {"Idempotency-Key": "crash-1"}


class Service:
    """One run of ``python -m onceonly.tickets`` on a free port."""

    def __init__(self, db: Path, log: Path, *args: str) -> None:
        self.log = log.open("a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "onceonly.tickets", "--port", "0", "--db", str(db), "--log-level", "warning", *args],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        line = self.proc.stdout.readline() if ready else ""
        found = re.search(r"serving on (\S+)", line)
        if found is None:
            self.stop()
            raise AssertionError(f"the ticket service did not start: {line!r}; see {log}")
        self.url = found.group(1)

    def post(self) -> httpx.Response:
        return httpx.post(f"{self.url}/tickets", json=new_ticket(), headers=KEY, timeout=10)

    def count(self) -> int:
        with httpx.Client(base_url=self.url, timeout=10) as c:
            return len(c.get("/tickets", params={"session_id": "s-1"}).json()["tickets"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()


@pytest.fixture(name="services")
def fixture_services(tmp_path: Path) -> Iterator[list[Service]]:
    """Started services, each stopped at the end (a crashed one is already gone)."""
    started: list[Service] = []
    yield started
    for service in started:
        service.stop()


def _crash(services: list[Service], db: Path, log: Path, *args: str) -> None:
    """Start the service with a crash fault, POST once: the process dies and the client gets nothing."""
    service = Service(db, log, *args)
    services.append(service)
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        service.post()
    assert service.proc.wait(10) == CRASH_EXIT_CODE


def test_crash_before_commit_then_retry_makes_one_ticket(services: list[Service], tmp_path: Path) -> None:
    """Transactional mode: a crash after the INSERT and before the commit leaves neither the ticket
    nor the key; after a restart the retry creates the ticket, once."""
    db, log = tmp_path / "tickets.db", tmp_path / "service.log"
    _crash(services, db, log, "--fault", "crash=1")
    service = Service(db, log)
    services.append(service)
    assert service.count() == 0
    retried = service.post()
    assert retried.status_code == 201 and "idempotent-replayed" not in retried.headers
    assert service.post().headers["idempotent-replayed"] == "true"
    assert service.count() == 1


def test_crash_after_commit_then_retry_replays(services: list[Service], tmp_path: Path) -> None:
    """Transactional mode: a crash after the commit, before the response: the ticket and its stored
    response are both there; after a restart the retry replays it."""
    db, log = tmp_path / "tickets.db", tmp_path / "service.log"
    _crash(services, db, log, "--fault", "crash-after-commit=1")
    service = Service(db, log)
    services.append(service)
    assert service.count() == 1
    retried = service.post()
    assert retried.status_code == 201 and retried.headers["idempotent-replayed"] == "true"
    assert service.count() == 1


def test_store_mode_crash_holds_the_key_until_its_lease_ends(services: list[Service], tmp_path: Path) -> None:
    """Store mode: the dead server's claim is still held after the restart, so the retry is told 409
    (not run again) until the claim's lease ends (--processing-timeout); docs/server.md says what
    happens after that and why the transactional mode exists."""
    db, log = tmp_path / "tickets.db", tmp_path / "service.log"
    store = ["--idempotency-store", f"sqlite:///{tmp_path / 'keys.db'}", "--processing-timeout", "60"]
    _crash(services, db, log, *store, "--fault", "crash-after-commit=1")
    service = Service(db, log, *store)
    services.append(service)
    retried = service.post()
    assert retried.status_code == 409 and retried.headers["retry-after"] == "1"
    assert service.count() == 1


def test_cli_is_registered_and_checks_its_options() -> None:
    """``onceonly tickets`` is a command of the main CLI; a bad --fault is a usage error."""
    from onceonly.cli import cli

    runner = CliRunner()
    shown = runner.invoke(cli, ["tickets", "--help"])
    assert shown.exit_code == 0 and "--no-idempotency" in shown.output and "--fault KIND=P" in shown.output
    bad = runner.invoke(cli, ["tickets", "--fault", "lost=2", "--port", "0"])
    assert bad.exit_code == 2 and "between 0 and 1" in bad.output
    both = runner.invoke(cli, ["tickets", "--no-idempotency", "--idempotency-store", "sqlite:///x.db"])
    assert both.exit_code == 2
