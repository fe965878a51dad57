"""A local stand-in for the Anthropic Messages API, for running the real Claude Code CLI offline.

A real HTTP server on 127.0.0.1 (the standard library's, in a thread) that answers ``POST /v1/messages``
from a script, streamed as server-sent events when the request asks for it, and keeps every request body,
so that a test can read what the model was shown (the ``tool_result`` blocks the CLI sent back).

A script is a function of the request body that returns the assistant's content blocks
(``text(...)``, ``tool_use(...)``). Requests the CLI makes on its own (a title, a quota check: no
tools in them) get a short text answer and are kept apart (``side_requests``).
"""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = ["FakeMessagesApi", "Script", "claude_env", "text", "tool_results", "tool_use"]

Block = dict[str, Any]
Script = Callable[[dict[str, Any]], list[Block]]


def text(value: str) -> Block:
    return {"type": "text", "text": value}


def tool_use(name: str, arguments: dict[str, Any], call_id: str | None = None) -> Block:
    return {"type": "tool_use", "id": call_id or f"toolu_{uuid.uuid4().hex[:20]}", "name": name, "input": arguments}


def tool_results(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every ``tool_result`` block of a request's messages, oldest first, each with its text joined."""
    found = []
    for message in body.get("messages", []):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                inner = block.get("content")
                if isinstance(inner, list):
                    joined = "\n".join(str(b.get("text", "")) for b in inner if isinstance(b, dict))
                else:
                    joined = str(inner or "")
                found.append({"tool_use_id": block.get("tool_use_id"), "text": joined,
                              "is_error": bool(block.get("is_error"))})  # fmt: skip
    return found


def _main_loop(body: dict[str, Any]) -> bool:
    """A request of the agent loop (it offers the tools), not one the CLI makes on its own."""
    return any(str(t.get("name", "")).startswith("mcp__") for t in body.get("tools") or [])


class FakeMessagesApi:
    """The server: ``with FakeMessagesApi(script) as api: ... api.url``; ``api.requests`` are the agent
    loop's request bodies, in order."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[dict[str, Any]] = []
        self.side_requests: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self._lock = threading.Lock()
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return

            def _send(self, status: int, payload: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(payload)))
                self.send_header("request-id", f"req_{uuid.uuid4().hex[:12]}")
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self) -> None:
                with api._lock:
                    api.paths.append(f"GET {self.path}")
                self._send(200, b"{}", "application/json")

            def do_HEAD(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                path = self.path.split("?", 1)[0]
                with api._lock:
                    api.paths.append(f"POST {self.path}")
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {}
                if path.endswith("/count_tokens"):
                    self._send(200, b'{"input_tokens": 10}', "application/json")
                    return
                if not path.endswith("/v1/messages"):
                    self._send(404, b'{"type":"error","error":{"type":"not_found_error","message":"no"}}',
                               "application/json")  # fmt: skip
                    return
                if _main_loop(body):
                    with api._lock:
                        api.requests.append(body)
                    try:
                        blocks = api.script(body)
                    except Exception as exc:  # a broken script: the test reads it as the answer
                        blocks = [text(f"script error: {type(exc).__name__}: {exc}")]
                else:
                    with api._lock:
                        api.side_requests.append(body)
                    blocks = [text("ok")]
                message = _message(body, blocks)
                if body.get("stream"):
                    self._send(200, _events(message), "text/event-stream")
                else:
                    self._send(200, json.dumps(message).encode(), "application/json")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-messages-api", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeMessagesApi:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def results(self) -> list[dict[str, Any]]:
        """The tool results of the last agent-loop request (every result the model read, in order)."""
        with self._lock:
            last = self.requests[-1] if self.requests else {}
        return tool_results(last)


def _message(body: dict[str, Any], blocks: list[Block]) -> dict[str, Any]:
    stop = "tool_use" if any(b["type"] == "tool_use" for b in blocks) else "end_turn"
    return {
        "id": f"msg_{uuid.uuid4().hex[:20]}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model") or "claude-fake",
        "content": blocks,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 10},
    }


def _events(message: dict[str, Any]) -> bytes:
    def event(kind: str, data: dict[str, Any]) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

    start = {**message, "content": [], "stop_reason": None, "usage": {"input_tokens": 10, "output_tokens": 1}}
    out = [event("message_start", {"message": start})]
    for i, block in enumerate(message["content"]):
        if block["type"] == "tool_use":
            out.append(event("content_block_start", {"index": i, "content_block": {**block, "input": {}}}))
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        else:
            out.append(event("content_block_start", {"index": i, "content_block": {"type": "text", "text": ""}}))
            delta = {"type": "text_delta", "text": block["text"]}
        out.append(event("content_block_delta", {"index": i, "delta": delta}))
        out.append(event("content_block_stop", {"index": i}))
    out.append(event("message_delta", {"delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                                       "usage": {"output_tokens": 10}}))  # fmt: skip
    out.append(event("message_stop", {}))
    return "".join(out).encode()


def claude_env(api_url: str, home: Path) -> dict[str, str]:
    """The environment the bundled CLI runs in: this fake API, a home, config and temporary directory of its
    own, and none of the traffic (telemetry, updates, tool search) that would leave the machine."""
    config = home / ".claude"
    config.mkdir(parents=True, exist_ok=True)
    scratch = home / "tmp"  # the CLI's own temporary files (file-watch probes) stay in the test's folder
    scratch.mkdir(exist_ok=True)
    return {
        "TMPDIR": str(scratch),
        "ANTHROPIC_BASE_URL": api_url,
        "ANTHROPIC_API_KEY": "sk-ant-test-not-a-real-key",
        "HOME": str(home),
        "CLAUDE_CONFIG_DIR": str(config),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "ENABLE_TOOL_SEARCH": "false",
        "CLAUDE_CODE_ENABLE_TELEMETRY": "0",
        "MCP_TIMEOUT": "30000",
        "MCP_TOOL_TIMEOUT": "60000",
    }


@contextlib.contextmanager
def serving(script: Script) -> Iterator[FakeMessagesApi]:
    with FakeMessagesApi(script) as api:
        yield api
