"""``onceonly mcp-proxy`` as a real process: its front door over streamable HTTP (Host, Origin, token), the
environment its stdio upstream gets, and arguments coerced by the upstream's schema before the key."""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastmcp import Client
from fastmcp.client.transports import StreamableHttpTransport
from mcp import Client as SDKClient
from mcp import StdioServerParameters

from onceonly.mcp import REPLAYED_META

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mcp_proxy"
CHARGE_SERVER = ROOT / "tests" / "_mcp_charge_server.py"
PROXY = [sys.executable, "-c", "from onceonly.cli import main; main()", "mcp-proxy"]
TOKEN = "a-token-long-enough-to-count"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _started(args: list[str], port: int, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60  # a readiness bound for a loaded machine, not a measurement
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"nothing listens on {port}: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _tickets(db: Path) -> int:
    with sqlite3.connect(db) as conn:
        try:
            return int(conn.execute("SELECT COUNT(*) FROM tickets").fetchone()[0])
        except sqlite3.OperationalError:
            return 0


def test_the_front_door_refuses_before_the_upstream(tmp_path: Path) -> None:
    """A request shaped like a DNS-rebound page (a foreign Host, or a foreign Origin) and one without the
    token are refused by the proxy and never reach the upstream; the token on a loopback Host gets through."""
    db = tmp_path / "tickets.db"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TICKETS_DB": str(db)}
    up_port, port = _free_port(), _free_port()
    log = tmp_path / "processes.log"
    upstream = _started(
        [sys.executable, str(EXAMPLE / "ticket_server.py"), "--http", f"127.0.0.1:{up_port}"], up_port, env, log
    )
    args = [
        *PROXY, "--url", f"sqlite:///{tmp_path / 'ledger.db'}", "--upstream", f"http://127.0.0.1:{up_port}/mcp",
        "--listen", f"127.0.0.1:{port}", "--token", TOKEN,
    ]  # fmt: skip
    proxy = _started(args, port, env, log)
    url = f"http://127.0.0.1:{port}/mcp"
    ticket = {"session_id": "s", "title": "rebound", "body": "b"}

    async def call(headers: dict[str, str]) -> Any:
        async with Client(StreamableHttpTransport(url, headers=headers)) as client:
            return await client.call_tool("create_ticket", ticket)

    try:
        for headers in (
            {"Host": "attacker.example", "Authorization": f"Bearer {TOKEN}"},
            {"Origin": "http://attacker.example", "Authorization": f"Bearer {TOKEN}"},
            {},
            {"Authorization": "Bearer not-the-token"},
        ):
            with pytest.raises(Exception):
                asyncio.run(call(headers))
        raw = httpx.post(url, json={}, headers={"Host": "attacker.example"})
        assert raw.status_code == 403 and raw.headers["content-type"] == "application/problem+json"
        assert httpx.post(url, json={}).status_code == 401
        assert _tickets(db) == 0
        answer = asyncio.run(call({"Authorization": f"Bearer {TOKEN}"}))
        assert not answer.is_error and _tickets(db) == 1
    finally:
        _stop(proxy)
        _stop(upstream)


def test_listening_beyond_loopback_needs_a_token(tmp_path: Path) -> None:
    """--listen 0.0.0.0 without a token is refused at start, saying what to give; a short token too."""
    base = [*PROXY, "--url", f"sqlite:///{tmp_path / 'ledger.db'}", "--upstream", "http://127.0.0.1:9/mcp"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("ONCEONLY_PROXY_TOKEN", None)
    out = subprocess.run(
        [*base, "--listen", "0.0.0.0:8800"], check=False, capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 2 and "give a token" in out.stderr
    out = subprocess.run(
        [*base, "--listen", "0.0.0.0:8800", "--token", "short"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 2 and "at least 16" in out.stderr


def test_the_upstream_gets_a_safe_environment_and_coerced_arguments(tmp_path: Path) -> None:
    """The stdio upstream prints its own environment: the SDK's safe list and the variables the config
    names, never the proxy's secrets. 500, "500" and 500.0 for the upstream's integer are one charge."""
    charges = tmp_path / "charges.db"
    config = tmp_path / "proxy.toml"
    config.write_text('[proxy]\nenv = ["CHARGES_REGION"]\n', encoding="utf-8")
    secret_env = {
        "ONCEONLY_URL": "postgresql://app:hunter2@db.internal/ledger",
        "ONCEONLY_HASH_SECRET": "0" * 64,
        "ONCEONLY_DASHBOARD_TOKEN": "dashboard-token-value",
        "CHARGES_REGION": "eu",
    }
    env = {**os.environ, **secret_env, "PYTHONPATH": str(ROOT / "src")}
    args = [
        *PROXY[1:], "--url", f"sqlite:///{tmp_path / 'ledger.db'}", "--config", str(config), "--",
        sys.executable, str(CHARGE_SERVER), str(charges),
    ]  # fmt: skip
    params = StdioServerParameters(command=sys.executable, args=args, env=env, cwd=str(tmp_path))

    async def main() -> tuple[Any, list[Any]]:
        async with SDKClient(params) as client:
            names = await client.call_tool("environment", {})
            answers = [
                await client.call_tool("charge", {"customer": "c", "cents": cents}) for cents in (500, "500", 500.0)
            ]
            return names, answers

    names, answers = asyncio.run(main())
    seen = set(names.structured_content["result"])
    assert "PATH" in seen and "CHARGES_REGION" in seen
    assert not seen & {"ONCEONLY_URL", "ONCEONLY_HASH_SECRET", "ONCEONLY_DASHBOARD_TOKEN"}
    with sqlite3.connect(charges) as conn:
        assert conn.execute("SELECT cents FROM charges").fetchall() == [(500,)]
    assert [bool((a.meta or {}).get(REPLAYED_META)) for a in answers] == [False, True, True]
