"""The secret that keys the hash of network callers (``onceonly.callers``) is a record in the store, and
no output shows it: not ``onceonly ls``/``show`` (text or JSON), not the dashboard's API, not the
metrics, the audit or a record's repr. With it, a caller's credentials could be guessed offline from
the hashes the store keeps. The stored secret itself is unchanged and still keys the hash."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest
from starlette.testclient import TestClient

from onceonly import Ledger, State, callers, ops
from onceonly.cli import cli
from onceonly.dashboard.app import create_app
from onceonly.metrics import LedgerCollector
from onceonly.server import IdempotencyMiddleware
from tests.server.conftest import asgi_call

#: Where the middleware keeps its secret (``KEY_PREFIX:meta:client-secret``) and where the MCP doors do.
MIDDLEWARE_KEY = "http:meta:client-secret"
MCP_KEY = "onceonly-mcp:meta:client-secret"
#: What an output shows in place of a kept secret (``onceonly.states.REDACTED_SECRET``).
REDACTED_SECRET = "<secret: redacted>"


def _forms(secret_hex: str) -> list[str]:
    """Every spelling of the secret an output might use: its hex (either case) and the base64 of its bytes."""
    raw = bytes.fromhex(secret_hex)
    return [
        secret_hex,
        secret_hex.upper(),
        base64.b64encode(raw).decode(),
        base64.urlsafe_b64encode(raw).decode().rstrip("="),
        base64.b64encode(secret_hex.encode()).decode(),
    ]


@pytest.fixture(name="secrets_made")
def fixture_secrets_made(store_url: str) -> dict[str, str]:
    """A ledger on each store whose middleware and MCP doors made their client secrets through their own
    code, and one ordinary confirmed record; key → the secret's hex as stored."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 201})
        await send({"type": "http.response.body", "body": b"made"})

    middleware = IdempotencyMiddleware(app, store=store_url)
    auth = ((b"authorization", b"Basic dXNlcjpwYXNzd29yZA=="), (b"idempotency-key", b"k-1"))

    async def call() -> int:
        try:
            return (await asgi_call(middleware, "POST", "/o", auth))[0]
        finally:
            await middleware.aclose()

    assert asyncio.run(call()) == 201
    with Ledger.open(store_url) as ledger:
        made = callers.stored_secret(ledger.store, key=MCP_KEY, scope="onceonly-mcp:meta", tool="mcp", now=1e9)

        @ledger.tool(name="charge")
        def charge(order: int) -> dict[str, int]:
            return {"order": order}

        charge(7)
        stored = {}
        for key in (MIDDLEWARE_KEY, MCP_KEY):
            rec = ledger.get(key)
            assert rec is not None and rec.state is State.CONFIRMED
            stored[key] = json.loads(rec.result_json or "")["client_secret"]
        assert bytes.fromhex(stored[MCP_KEY]) == made
    return stored


def _shows_no_secret(text: str, secrets: dict[str, str], where: str) -> None:
    for secret in secrets.values():
        for form in _forms(secret):
            assert form not in text, f"{where} shows the client secret ({form[:8]}…)"


def test_the_cli_never_shows_the_client_secret(store_url: str, secrets_made: dict[str, str]) -> None:
    """``onceonly ls`` and ``show``, as text and as JSON, of the secrets' records and of all records:
    the secret is shown as redacted, the other record's result as it is."""
    runner = CliRunner()
    outputs = {}
    commands = [["ls"], ["ls", "--json"], ["stats"], ["stats", "--json"]]
    for key in secrets_made:
        commands += [["show", key], ["show", key, "--json"], ["show", key.split(":")[0] + ":meta:"]]
    for args in commands:
        result = runner.invoke(cli, [*args, "--url", store_url])
        assert result.exit_code == 0, (args, result.output, result.exception)
        outputs[" ".join(args)] = result.output
        _shows_no_secret(result.output, secrets_made, "onceonly " + " ".join(args))
    for key in secrets_made:
        assert json.loads(outputs[f"show {key} --json"])["result"] == REDACTED_SECRET
        assert REDACTED_SECRET in outputs[f"show {key}"]
    listed = {r["key"]: r for r in json.loads(outputs["ls --json"])["records"]}
    assert {listed[k]["result"] for k in secrets_made} == {REDACTED_SECRET}
    assert {"order": 7} in [r["result"] for r in listed.values()]


def test_the_dashboard_never_shows_the_client_secret(store_url: str, secrets_made: dict[str, str]) -> None:
    """Every read of the dashboard's API (the list, one record with its timeline, the stats, the counts)."""
    with Ledger.open(store_url) as ledger, TestClient(create_app(ledger), base_url="http://127.0.0.1") as client:
        paths = ["/", "/api/counts", "/api/records", "/api/records?limit=500", "/api/stats"]
        paths += [f"/api/record?key={key}" for key in secrets_made]
        for path in paths:
            answer = client.get(path)
            assert answer.status_code == 200, (path, answer.text)
            _shows_no_secret(answer.text, secrets_made, path)
        for key in secrets_made:
            assert client.get("/api/record", params={"key": key}).json()["result"] == REDACTED_SECRET


def test_metrics_audit_and_repr_never_show_the_client_secret(store_url: str, secrets_made: dict[str, str]) -> None:
    """The Prometheus gauges, the audit's report, and a record's repr (what reaches logs and messages)."""
    with Ledger.open(store_url) as ledger:
        registry = CollectorRegistry()
        registry.register(LedgerCollector(ledger))
        _shows_no_secret(generate_latest(registry).decode(), secrets_made, "the metrics")
        _shows_no_secret(json.dumps(ops.audit(ledger, {}).to_dict()), secrets_made, "the audit")
        for key in secrets_made:
            rec = ledger.get(key)
            assert rec is not None
            _shows_no_secret(repr(rec) + str(rec), secrets_made, "a record's repr")
            _shows_no_secret(json.dumps(rec.to_dict()), secrets_made, "Record.to_dict")


def test_the_stored_secret_is_unchanged_and_still_keys_the_hash(store_url: str, secrets_made: dict[str, str]) -> None:
    """Redaction is in what is shown only: the store keeps the secret, and the doors read it back."""
    with Ledger.open(store_url) as ledger:
        again = callers.stored_secret(ledger.store, key=MCP_KEY, scope="onceonly-mcp:meta", tool="mcp", now=2e9)
    assert again == bytes.fromhex(secrets_made[MCP_KEY])
