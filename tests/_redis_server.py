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


def free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too: a cluster node binds both and
    exits at once when it cannot (ephemeral ports above 55535 have no bus port at all)."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class PrivateRedisCluster:
    """A Redis Cluster of the test's own: ``masters`` nodes in cluster mode on free ports, the slots
    spread over them by ``redis-cli --cluster create``, ``replicas`` replicas of each, persisting nothing.

    ``start()`` returns once every node says ``cluster_state:ok`` (and every replica is in sync);
    ``stop()`` stops each node by its PID, ``kill(port)`` one node by SIGKILL (a failover's cause),
    ``rejoin(port)`` starts it again as its successor's replica.
    """

    def __init__(self, workdir: Path, masters: int = 3, replicas: int = 0) -> None:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            raise FileNotFoundError("redis-server and redis-cli are needed to start a Redis Cluster")
        self.server, self.cli = server, cli
        self.workdir = workdir
        self.replicas = replicas
        self.ports: list[int] = []
        while len(self.ports) < masters * (1 + replicas):
            port = free_cluster_port()
            if port not in self.ports:
                self.ports.append(port)
        self.procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """The URL of the first node with the cluster option: the client finds the others."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}/0"

    def _ask(self, port: int, *command: str) -> bytes:
        """One command on one node through redis-cli (no client library involved)."""
        out = subprocess.run(
            [self.cli, "-h", "127.0.0.1", "-p", str(port), *command], capture_output=True, timeout=10, check=False
        )
        return out.stdout

    def start(self) -> PrivateRedisCluster:
        try:
            for port in self.ports:
                self.procs.append(self._spawn(port))
            deadline = time.monotonic() + 10
            for port, proc in zip(self.ports, self.procs, strict=True):
                while not self._ask(port, "PING").startswith(b"PONG"):
                    assert proc.poll() is None, f"the cluster node on {port} exited with {proc.returncode}"
                    assert time.monotonic() < deadline, f"redis-server on {port} did not answer PING within 10 s"
                    time.sleep(0.02)
            created = subprocess.run(
                [self.cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                 "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                capture_output=True, timeout=30, check=False,
            )  # fmt: skip
            assert created.returncode == 0, f"redis-cli --cluster create failed: {created.stdout!r} {created.stderr!r}"
            deadline = time.monotonic() + 10
            for port in self.ports:
                while b"cluster_state:ok" not in self._ask(port, "CLUSTER", "INFO"):
                    assert time.monotonic() < deadline, f"the cluster node on {port} is not ok within 10 s"
                    time.sleep(0.05)
                while b"role:slave" in (info := self._ask(port, "INFO", "replication")) and (
                    b"master_link_status:up" not in info
                ):
                    assert time.monotonic() < deadline, f"the replica on {port} is not in sync within 10 s"
                    time.sleep(0.05)
            # A replica says its link is up once it loaded its first sync, but its master streams writes to
            # it only from its first acknowledgement on (within a second; later under load): a master killed
            # in between leaves a replica with none of its writes. So: every replica online on its master.
            expected = len(self.ports) // (1 + self.replicas) * self.replicas
            while (online := self._online()) < expected:
                assert time.monotonic() < deadline + 10, f"{online} of {expected} replicas online within 20 s"
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        command = [
            self.server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
            "--cluster-config-file", str(self.workdir / f"nodes-{port}.conf"), "--cluster-node-timeout",
            "2000", "--save", "", "--appendonly", "no", "--daemonize", "no", "--dir", str(self.workdir),
        ]  # fmt: skip
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def rejoin(self, port: int, timeout: float = 30.0) -> None:
        """Start the killed node on ``port`` again, empty (nothing persisted) but with its cluster config:
        it finds that its replica took over and follows it. Returns once it is a replica in sync that
        its new master streams to."""
        at = self.ports.index(port)
        assert self.procs[at].poll() is not None, f"the node on {port} is still running"
        self.procs[at] = self._spawn(port)
        deadline = time.monotonic() + timeout
        expected = len(self.ports) // (1 + self.replicas) * self.replicas
        while True:
            info = self._ask(port, "INFO", "replication")
            if b"role:slave" in info and b"master_link_status:up" in info and self._online() >= expected:
                return
            assert self.procs[at].poll() is None, f"the node on {port} exited with {self.procs[at].returncode}"
            assert time.monotonic() < deadline, f"the node on {port} did not rejoin as a replica within {timeout:g} s"
            time.sleep(0.1)

    def _online(self) -> int:
        """How many replicas their masters stream to (``slaveN:...,state=online,...`` on the master)."""
        return sum(self._ask(port, "INFO", "replication").count(b",state=online,") for port in self.ports)

    def kill(self, port: int) -> None:
        """SIGKILL the node on ``port``: no shutdown, no last write."""
        proc = self.procs[self.ports.index(port)]
        proc.kill()
        proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            proc.wait(10)
        self.procs = []


class PrivateSentinel:
    """A master, ``replicas`` replicas of it and ``sentinels`` Redis Sentinels watching it as ``service``,
    all of the test's own on free ports, persisting nothing; stopped by their PIDs.

    ``start()`` returns once every replica is online on the master and every sentinel knows the
    replicas and the other sentinels (so that ``failover()`` has somewhere to go). ``master_port()`` is
    where the sentinels say the master is now.
    """

    def __init__(self, workdir: Path, *, replicas: int = 1, sentinels: int = 3, service: str = "mymaster") -> None:
        server = shutil.which("redis-server")
        if server is None:
            pytest.skip("redis-server is not installed: cannot start a private Redis with Sentinel")
        self.server = server
        self.workdir = workdir
        self.service = service
        self.master = PrivateRedis(workdir / "master")
        self.replicas = [PrivateRedis(workdir / f"replica{i}") for i in range(replicas)]
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self.sentinel_procs: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        """``redis+sentinel://`` naming every sentinel and the service (no query)."""
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{self.service}/0"

    def ask(self, port: int, *command: str) -> str:
        """One command on one server or sentinel through redis-cli (no client library involved)."""
        out = subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *command], capture_output=True, timeout=10, check=False
        )
        return out.stdout.decode()

    def start(self) -> PrivateSentinel:
        try:
            for node in (self.master, *self.replicas):
                node.workdir.mkdir(parents=True, exist_ok=True)
            self.master.start()
            for replica in self.replicas:
                replica.args = ("--replicaof", "127.0.0.1", str(self.master.port))
                replica.start()
            for i, port in enumerate(self.sentinel_ports):
                conf = self.workdir / f"sentinel{i}.conf"
                conf.write_text(
                    f"port {port}\nbind 127.0.0.1\ndir {self.workdir}\n"
                    f"sentinel monitor {self.service} 127.0.0.1 {self.master.port} 2\n"
                    f"sentinel down-after-milliseconds {self.service} 1000\n"
                    f"sentinel failover-timeout {self.service} 3000\n"
                )
                self.sentinel_procs.append(
                    subprocess.Popen(
                        [self.server, str(conf), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                    )
                )
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, seconds: float = 20) -> None:
        """Every replica online on the current master, every sentinel agreeing on that master and
        knowing every replica and the other sentinels."""
        deadline = time.monotonic() + seconds
        while True:
            ready = self._ready()
            if ready is True:
                return
            assert time.monotonic() < deadline, f"Sentinel set not ready within {seconds:g} s: {ready}"
            time.sleep(0.1)

    def _ready(self) -> bool | str:
        port = self.master_port()
        if port is None:
            return "no master agreed"
        online = self.ask(port, "INFO", "replication").count(",state=online,")
        if online < len(self.replicas):
            return f"{online} of {len(self.replicas)} replicas online on {port}"
        for sentinel in self.sentinel_ports:
            info = self.ask(sentinel, "SENTINEL", "MASTER", self.service).split()
            fields = dict(zip(info[::2], info[1::2], strict=False))
            if fields.get("num-slaves") != str(len(self.replicas)):
                return f"sentinel {sentinel}: {fields.get('num-slaves')} replicas known"
            if fields.get("num-other-sentinels") != str(len(self.sentinel_ports) - 1):
                return f"sentinel {sentinel}: {fields.get('num-other-sentinels')} other sentinels known"
        return True

    def master_port(self) -> int | None:
        """The master's port as every sentinel gives it, or None while they disagree or do not answer."""
        ports = set()
        for sentinel in self.sentinel_ports:
            answer = self.ask(sentinel, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service).split()
            ports.add(int(answer[1]) if len(answer) == 2 and answer[1].isdigit() else None)
        return ports.pop() if len(ports) == 1 else None

    def majority_master_port(self) -> int | None:
        """The master's port as most sentinels give it (a quorum acts on it; the others learn it from
        their hello messages, seconds later on a busy machine), or None without a majority."""
        ports: list[int | None] = []
        for sentinel in self.sentinel_ports:
            answer = self.ask(sentinel, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service).split()
            ports.append(int(answer[1]) if len(answer) == 2 and answer[1].isdigit() else None)
        best = max(set(ports), key=ports.count)
        return best if ports.count(best) * 2 > len(ports) else None

    def failover(self) -> None:
        """``SENTINEL FAILOVER``: a replica is promoted, the master demoted, without the master's consent."""
        answer = self.ask(self.sentinel_ports[0], "SENTINEL", "FAILOVER", self.service)
        assert answer.strip() == "OK", f"SENTINEL FAILOVER answered {answer!r}"

    def stop(self) -> None:
        for proc in self.sentinel_procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.sentinel_procs:
            proc.wait(10)
        self.sentinel_procs = []
        for node in (*self.replicas, self.master):
            node.stop()
