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
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests._redis_server import free_port

__all__ = ["PgBouncer", "PrivatePostgres", "pgbouncer_bin", "postgres_bin"]


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

    def standby(self) -> PrivatePostgres:
        """A streaming hot standby of this (running) server, on a port of its own, not yet started:
        ``pg_basebackup -R`` (which writes ``standby.signal`` and the primary's address)."""
        replica = PrivatePostgres(*[o for o in self.options if o != "-c"])
        made = self._run(str(self.bindir / "pg_basebackup"), "-D", str(replica.data), "-h", "127.0.0.1",
                         "-p", str(self.port), "-U", "postgres", "-R", "-X", "stream", "--no-sync")  # fmt: skip
        if made.returncode != 0:
            replica.stop()
            raise RuntimeError(f"pg_basebackup failed: {made.stderr.decode(errors='replace')[-500:]}")
        replica._initialised = True
        return replica

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


def pgbouncer_bin() -> str | None:
    """The ``pgbouncer`` binary (Debian's ``pgbouncer`` package), or None."""
    return shutil.which("pgbouncer") or next(iter(glob.glob("/usr/sbin/pgbouncer")), None)


class PgBouncer:
    """A PgBouncer of the caller's own on a free port, in front of ``host:port`` (every database),
    trust authentication for user ``postgres``; ``settings`` are lines of its ``[pgbouncer]`` section
    (``"server_lifetime = 1"``). Stopped by its PID, its directory removed."""

    def __init__(self, host: str, port: int, *settings: str, pool_mode: str = "transaction") -> None:
        binary = pgbouncer_bin()
        if binary is None:
            raise FileNotFoundError("pgbouncer is needed (apt-get install pgbouncer)")
        self.binary = binary
        self.user = "postgres" if os.geteuid() == 0 else None  # it refuses to run as root
        self.workdir = Path(tempfile.mkdtemp(prefix="onceonly-pgbouncer-"))
        self.port = free_port()
        (self.workdir / "users.txt").write_text('"postgres" ""\n')
        lines = [
            "[databases]",
            f"* = host={host} port={port}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {self.workdir / 'users.txt'}",
            "admin_users = postgres",
            f"pool_mode = {pool_mode}",
            "max_client_conn = 1000",
            f"logfile = {self.workdir / 'pgbouncer.log'}",
            *settings,
        ]
        (self.workdir / "pgbouncer.ini").write_text("\n".join(lines) + "\n")
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            for path in (self.workdir, *self.workdir.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> PgBouncer:
        self.proc = subprocess.Popen(
            [self.binary, str(self.workdir / "pgbouncer.ini")],
            user=self.user, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"pgbouncer exited with {self.proc.returncode}: {self.log()[-800:]}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError("pgbouncer did not listen within 30 s") from None
                time.sleep(0.05)

    def log(self) -> str:
        try:
            return (self.workdir / "pgbouncer.log").read_text(errors="replace")
        except OSError:
            return ""

    def admin(self, command: str) -> str:
        """A command on the admin console (``RECONNECT``, ``SHOW SERVERS``…), by psql: it takes simple queries only."""
        done = subprocess.run(
            ["psql", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-d", "pgbouncer", "-XAtc", command],
            capture_output=True, timeout=30, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"pgbouncer admin {command!r}: {done.stderr.decode(errors='replace')}")
        return done.stdout.decode()

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(10)
            self.proc = None
        shutil.rmtree(self.workdir, ignore_errors=True)
