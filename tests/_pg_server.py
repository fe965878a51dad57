"""A private PostgreSQL for tests that must crash and restart a server: ``initdb`` in a temporary
directory, ``postgres`` on a free port, stopped by its PID, the directory removed; never the shared one.

Run as root, the server runs as the ``postgres`` OS user (``initdb`` refuses root); otherwise as the
current user. The binaries come from ``/usr/lib/postgresql/<version>/bin`` (Debian, Ubuntu), else PATH.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from tests._redis_server import free_port

__all__ = ["PrivatePostgres", "postgres_bin"]


def postgres_bin() -> Path | None:
    """The directory of the newest installed ``initdb`` and ``postgres``, or None."""
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(Path(d).parent.name.split(".")[0]))
    for d in reversed(dirs):
        if (Path(d) / "initdb").exists() and (Path(d) / "postgres").exists():
            return Path(d)
    found = shutil.which("initdb")
    return Path(found).parent if found and (Path(found).parent / "postgres").exists() else None


class PrivatePostgres:
    """One PostgreSQL server of the caller's own, with trust authentication for user ``postgres``;
    ``settings`` are server settings (``"fsync=off"``).

    ``crash()`` is an immediate-mode stop (SIGQUIT to the postmaster: no checkpoint, every session cut,
    what ``pg_ctl stop -m immediate`` does); ``start()`` after it replays the WAL, as after a crash.
    ``stop()`` ends the server and removes its directory.
    """

    def __init__(self, *settings: str) -> None:
        bindir = postgres_bin()
        if bindir is None:
            raise FileNotFoundError("initdb and postgres are needed to start a private PostgreSQL")
        self.bindir = bindir
        self.user = "postgres" if os.geteuid() == 0 else None
        self.workdir = Path(tempfile.mkdtemp(prefix="onceonly-pg-"))
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.workdir, entry.pw_uid, entry.pw_gid)
        self.data = self.workdir / "data"
        self.port = free_port()
        self.options = [arg for setting in settings for arg in ("-c", setting)]  # e.g. "fsync=off"
        self.proc: subprocess.Popen[bytes] | None = None
        self._initialised = False

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *command: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(command, user=self.user, capture_output=True, timeout=60, check=False)

    def start(self) -> PrivatePostgres:
        if not self._initialised:
            # --no-sync: a test's cluster needs no fsync at creation; the server itself fsyncs as usual.
            made = self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", "postgres", "-A", "trust",
                             "--no-sync")  # fmt: skip
            if made.returncode != 0:
                raise RuntimeError(f"initdb failed: {made.stderr.decode(errors='replace')[-500:]}")
            self._initialised = True
        log = open(self.workdir / "server.log", "ab")  # noqa: SIM115 - the server writes it until it stops
        try:
            self.proc = subprocess.Popen(
                [str(self.bindir / "postgres"), "-D", str(self.data), "-p", str(self.port), "-k", str(self.workdir),
                 "-c", "listen_addresses=127.0.0.1", *self.options],
                user=self.user, stdout=log, stderr=log,
            )  # fmt: skip
        finally:
            log.close()
        deadline = time.monotonic() + 30
        while self._run(str(self.bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-q").returncode:
            if self.proc.poll() is not None:
                tail = (self.workdir / "server.log").read_text(errors="replace")[-500:]
                raise RuntimeError(f"postgres exited with {self.proc.returncode}: {tail}")
            if time.monotonic() > deadline:
                raise RuntimeError("postgres did not accept connections within 30 s")
            time.sleep(0.05)
        return self

    def _end(self, sig: signal.Signals) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(sig)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
            self.proc = None

    def crash(self) -> None:
        """An immediate-mode stop: the postmaster quits its backends at once, no shutdown checkpoint."""
        self._end(signal.SIGQUIT)

    def stop(self) -> None:
        """A fast shutdown (SIGINT), then the directory goes."""
        self._end(signal.SIGINT)
        shutil.rmtree(self.workdir, ignore_errors=True)
