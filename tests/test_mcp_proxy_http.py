"""``onceonly mcp-proxy --upstream URL --listen HOST:PORT``: the proxy and the upstream as real processes
over streamable HTTP on 127.0.0.1, a real client."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mcp import Client

from onceonly import Ledger
from onceonly.mcp import REPLAYED_META, meta
from tests._mcp_tickets import Tickets

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "mcp_proxy"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60  # a readiness bound for a loaded machine, not a measurement
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on {port}: {log.read_text()[-2000:]}")


@contextmanager
def _process(args: list[str], port: int, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        _wait_listening(port, proc, log)
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_proxy_over_streamable_http(tmp_path: Path) -> None:
    """Without onceonly a retry makes two tickets. Through the proxy: read-only runs every time, one
    ticket per key with the replay visible, an isError retried; the upstream killed after the commit
    leaves the outcome unknown (the client is told so, as an error result); once the upstream is back,
    the same call is settled by the probe and replayed: one ticket."""
    tickets = Tickets(tmp_path / "tickets.db")
    tickets.fault("error_once", "flaky")
    tickets.fault("hang", "hang")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TICKETS_DB": str(tickets.path)}
    up_port, proxy_port = _free_port(), _free_port()
    upstream_url = f"http://127.0.0.1:{up_port}/mcp"
    ledger_url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upstream_args = [sys.executable, str(EXAMPLE / "ticket_server.py"), "--http", f"127.0.0.1:{up_port}"]
    proxy_args = [
        sys.executable, "-c", "from onceonly.cli import main; main()", "mcp-proxy", "--url", ledger_url,
        "--config", str(EXAMPLE / "proxy.toml"), "--upstream", upstream_url, "--listen", f"127.0.0.1:{proxy_port}",
    ]  # fmt: skip
    args = {"session_id": "s", "title": "a", "body": "b"}
    hang = {"session_id": "s", "title": "hang", "body": "b"}

    async def direct() -> None:
        async with Client(upstream_url) as client:
            for _ in range(2):
                await client.call_tool("create_ticket", {**args, "session_id": "d", "title": "direct"})

    async def through_proxy() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with Client(f"http://127.0.0.1:{proxy_port}/mcp") as client:
            before = await client.call_tool("count_tickets", {"session_id": "s"})
            out["first"] = await client.call_tool("create_ticket", args, meta=meta("order-1"))
            out["again"] = await client.call_tool("create_ticket", args, meta=meta("order-1"))
            after = await client.call_tool("count_tickets", {"session_id": "s"})
            out["counts"] = (before.structured_content, after.structured_content)
            flaky = {**args, "title": "flaky"}
            out["flaky_error"] = await client.call_tool("create_ticket", flaky)
            out["flaky_ok"] = await client.call_tool("create_ticket", flaky)
            out["killed"] = await asyncio.gather(client.call_tool("create_ticket", hang), kill_after_commit())
        return out

    async def kill_after_commit() -> None:
        while tickets.count("hang") == 0:
            await asyncio.sleep(0.02)
        os.kill(upstream.pid, signal.SIGKILL)
        upstream.wait()

    async def retry_hang() -> Any:
        async with Client(f"http://127.0.0.1:{proxy_port}/mcp") as client:
            return await client.call_tool("create_ticket", hang)

    log = tmp_path / "processes.log"
    with _process(upstream_args, up_port, env, log) as upstream, _process(proxy_args, proxy_port, env, log):
        asyncio.run(direct())
        assert tickets.count("direct") == 2
        out = asyncio.run(through_proxy())
        with _process(upstream_args, up_port, env, log):
            settled = asyncio.run(retry_hang())

    assert out["counts"] == ({"result": 0}, {"result": 1})
    assert not (out["first"].meta or {}).get(REPLAYED_META) and out["again"].meta[REPLAYED_META] is True
    assert tickets.count("a") == 1
    # An isError answer may come after the side effect: the probe settles it (not found) and it runs again.
    assert not out["flaky_error"].is_error and not out["flaky_ok"].is_error
    assert out["flaky_ok"].meta[REPLAYED_META] is True
    assert tickets.count("flaky") == 1

    unknown = out["killed"][0]
    assert (
        unknown.is_error and "unknown" in unknown.content[0].text and "Do not issue it again" in unknown.content[0].text
    )
    assert "onceonly resolve" not in unknown.content[0].text
    assert settled.meta[REPLAYED_META] is True and not settled.is_error
    assert tickets.count("hang") == 1
    with Ledger.open(ledger_url) as ledger:
        (rec,) = [r for r in ledger.list(tool="create_ticket") if r.args["arguments"]["title"] == "hang"]
    assert rec.via == "probe"
