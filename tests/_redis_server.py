"""A private ``redis-server`` for tests that must restart, reconfigure or fill a server: started on a
free port, stopped by its PID, never touching the shared one."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

__all__ = ["PrivateRedis", "free_port"]


def free_port() -> int:
    """A TCP port nobody listens on right now (on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


class PrivateRedis:
    """One ``redis-server`` of the test's own, persisting nothing unless ``args`` say otherwise.

    ``restart()`` stops it and starts a fresh one on the same port: what a server without persistence
    looks like after a crash or a failover to an empty replica.
    """

    def __init__(self, workdir: Path, *args: str) -> None:
        server = shutil.which("redis-server")
        if server is None:
            pytest.skip("redis-server is not installed: cannot start a private Redis")
        self.server = server
        self.workdir = workdir
        self.args = args
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> PrivateRedis:
        self.proc = subprocess.Popen(
            [self.server, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            assert self.proc.poll() is None, f"redis-server {' '.join(self.args)} exited with {self.proc.returncode}"
            assert time.monotonic() < deadline, "redis-server did not answer PING within 10 s"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()
