"""The dashboard's ASGI app: one page (``static/index.html``) and the JSON API under ``/api/`` it reads.

It reads the ledger as ``onceonly ls``, ``show`` and ``stats`` do (``onceonly.ops``, the same JSON), and
writes only through ``POST /api/resolve`` and ``/api/resolve-many`` (``Ledger.resolve`` with a reason
and a name), ``POST /api/approve`` and ``/api/deny`` (``Ledger.approve`` / ``deny``, a person's
decision on a record awaiting approval), ``POST /api/reconcile`` (one reconciler run, ``onceonly
reconcile --once``) and ``POST /api/pause`` / ``/api/resume`` (the kill switch, ``dashboard/pauses.py``).

Who may call it:

- Bound to an address other machines reach, it needs a token (``check_binding``), and then every
  request carries it: ``Authorization: Bearer T``, or ``?token=T`` on a GET (the page's address and its
  event stream, which cannot send a header). Tokens are compared in constant time and never logged.
- Without a token (loopback only) the ``Host`` header must name a loopback host: a web page whose
  DNS name is made to point at 127.0.0.1 (DNS rebinding) is refused.
- Every ``POST`` takes only ``Content-Type: application/json``, the token only in the header,
  and an ``Origin`` (when the browser sends one) equal to the dashboard's own: a form or script on
  another site can do none of these without a CORS preflight, which this app never grants.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import json
import math
import re
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from importlib.resources import files
from typing import Any
from urllib.parse import urlsplit

from onceonly._install import install_hint

try:
    import click
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.datastructures import MutableHeaders, QueryParams
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
    from starlette.types import ASGIApp, Message, Receive, Scope, Send
except ImportError as exc:  # pragma: no cover - the dashboard extra is not installed
    raise ImportError(
        f"the onceonly dashboard needs the dashboard extra: {install_hint('dashboard')} ({exc})", name=exc.name
    ) from exc

from onceonly import ops
from onceonly._cli import Since
from onceonly.dashboard.pauses import pause_json, pauses_json, resume_json
from onceonly.errors import InProgress, InvalidKey, NotSerializable, OnceOnlyError, StoreError
from onceonly.ledger import Ledger
from onceonly.settle import reconcile
from onceonly.states import State

__all__ = ["MIN_TOKEN_LENGTH", "check_binding", "create_app", "is_loopback"]

#: The shortest token accepted: a guessable one protects nothing.
MIN_TOKEN_LENGTH = 16
#: Records per page at most (``/api/records?limit=``), and per bulk resolve.
MAX_LIMIT = 500
#: How far into a sorted list a page may start (``/api/records?offset=``).
MAX_OFFSET = 100_000
#: Seconds between two "has anything changed" reads of the event stream (one ``count_by_state``).
POLL_SECONDS = 1.0
#: Seconds of silence after which the event stream sends a comment, so proxies keep it open.
KEEPALIVE_SECONDS = 15.0

_SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "Referrer-Policy": "no-referrer",  # the page's address may carry ?token=
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",  # no other page frames the resolve button
}
_INLINE = re.compile(r"<(script|style)>(.*?)</\1>", re.DOTALL)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name, ``[::1]`` allowed) is reachable only from this machine."""
    name = host.strip().strip("[]").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False  # any other name may resolve to an address others reach


def check_binding(host: str, token: str | None) -> None:
    """Refuse to serve on ``host`` without a token unless it is a loopback address, and refuse a
    token too short to protect anything.

    Raises:
        ValueError: what is wrong and what to give instead.

    .. versionadded:: 0.1
    """
    if token is not None and len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(
            f"the token has {len(token)} characters; give at least {MIN_TOKEN_LENGTH}, e.g. "
            "python -c 'import secrets; print(secrets.token_urlsafe())'"
        )
    if token is None and not is_loopback(host):
        raise ValueError(
            f"--host {host} is reachable from other machines: give a token (--token or "
            "$ONCEONLY_DASHBOARD_TOKEN) that every request must carry, or serve on 127.0.0.1"
        )


def _host_name(header: str) -> str:
    """The host of a ``Host`` header, without its port (``[::1]:8765`` gives ``::1``)."""
    if header.startswith("["):
        return header[1 : header.find("]")]
    return header.rpartition(":")[0] if ":" in header else header


def _presented_token(request: Request) -> str | None:
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    # In the address only for GETs: a page, an API read, the event stream. A write takes the header,
    # which no other site can make a browser send.
    return request.query_params.get("token") if request.method in ("GET", "HEAD") else None


def _refusal(request: Request, token: str | None) -> tuple[int, str] | None:
    """Why ``request`` is refused (status, message), or ``None``: the rules of the module docstring."""
    if token is None:
        if not is_loopback(_host_name(request.headers.get("host", ""))):
            return 403, "this dashboard answers only to a loopback Host (127.0.0.1, localhost)"
    else:
        presented = _presented_token(request)
        if presented is None or not hmac.compare_digest(presented.encode(), token.encode()):
            where = "the Authorization: Bearer header" if request.method == "POST" else "the header or ?token="
            return 401, f"this dashboard needs its token, in {where}"
    if request.method == "POST":
        # The host only, not the scheme: behind a proxy that ends TLS the page is https, the app sees http.
        origin = request.headers.get("origin")
        if origin is not None and urlsplit(origin).netloc != request.headers.get("host", ""):
            return 403, "a write must come from the dashboard's own page (Origin differs)"
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            return 415, "send the body as JSON, with Content-Type: application/json"
    return None


class _Guard:
    """Pure ASGI: refuse what ``_refusal`` refuses, and add the security headers to every answer."""

    def __init__(self, app: ASGIApp, token: str | None, csp: str) -> None:
        self.app = app
        self.token = token
        self.csp = csp

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in _SECURITY_HEADERS.items():
                    headers.setdefault(name, value)
                headers.setdefault("Content-Security-Policy", self.csp)
            await send(message)

        refused = _refusal(Request(scope), self.token)
        if refused is not None:
            status, message = refused
            extra = {"WWW-Authenticate": "Bearer"} if status == 401 else None
            await JSONResponse({"error": message}, status, headers=extra)(scope, receive, send_secured)
            return
        await self.app(scope, receive, send_secured)


def _csp(page: str) -> str:
    """A Content-Security-Policy that runs only the page's own inline script and style (by hash)."""
    hashes: dict[str, list[str]] = {"script": [], "style": []}
    for tag, body in _INLINE.findall(page):
        digest = base64.b64encode(hashlib.sha256(body.encode("utf-8")).digest()).decode("ascii")
        hashes[tag].append(f"'sha256-{digest}'")
    return (
        f"default-src 'none'; script-src {' '.join(hashes['script'])}; style-src {' '.join(hashes['style'])}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


# --- reading the query ------------------------------------------------------------------------------


def _text(params: QueryParams, name: str) -> str | None:
    value = params.get(name, "").strip()
    return value or None


def _states(params: QueryParams) -> list[State] | None:
    names = [s for s in params.getlist("state") if s]
    try:
        return [State(s) for s in names] or None
    except ValueError:
        bad = next(s for s in names if s not in {x.value for x in State})
        raise ValueError(f"state={bad!r}: give one of {', '.join(s.value for s in State)}") from None


def _since(params: QueryParams) -> float | None:
    text = _text(params, "since")
    if text is None:
        return None
    try:
        return Since().convert(text, None, None)
    except click.BadParameter as exc:
        raise ValueError(f"since: {exc.message}") from None


def _number(params: QueryParams, name: str, default: float | None, low: float, high: float) -> float | None:
    text = _text(params, name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:
        raise ValueError(f"{name}={text!r}: give a number from {low:g} to {high:g}")
    return value


def _flag(params: QueryParams, name: str) -> bool:
    text = (_text(params, name) or "0").lower()
    if text not in ("0", "1", "true", "false"):
        raise ValueError(f"{name}={text!r}: give 1 or 0")
    return text in ("1", "true")


def _records_json(ledger: Ledger, params: QueryParams) -> dict[str, Any]:
    """``GET /api/records``: a page of records (``onceonly ls --json``) and each key's short form.

    ``arg=`` (repeatable) keeps the records whose arguments hold the value (``ops.args_match``),
    ``conflicts=1`` those with conflicts; ``sort=`` orders them (``ops.SORTS``): in key order the page
    after it is ``after=next_after``, in the others ``offset=next_offset``."""
    limit = int(_number(params, "limit", 50, 1, MAX_LIMIT) or 50)
    offset = int(_number(params, "offset", 0, 0, MAX_OFFSET) or 0)
    found = ops.search(
        ledger,
        states=_states(params),
        tool=_text(params, "tool"),
        scope=_text(params, "scope"),
        since=_since(params),
        prefix=_text(params, "prefix"),
        args=[a.strip() for a in params.getlist("arg") if a.strip()],
        conflicts=_flag(params, "conflicts"),
        sort=_text(params, "sort") or "key",
        after=_text(params, "after"),
        offset=offset,
        limit=limit,
    )
    out = found.to_dict()
    ordered = (_text(params, "sort") or "key") != "key"
    out["next_offset"] = offset + len(found.records) if ordered and found.more else None
    out["short"] = ops.short_keys(ledger, [r.key for r in found.records])
    return out


def _stats_json(shared: _SharedStats, counts: _SharedCounts, params: QueryParams) -> dict[str, Any]:
    """``GET /api/stats``: ``onceonly stats --json``, and each tool's latency by time (``ops.latency``).

    ``?seen=`` (the records per state of the page's last ``counts`` event, as JSON) lets every page that
    saw the same counts share one reading of the ledger (``_SharedStats``)."""
    seen = _text(params, "seen")
    try:
        wanted = None if seen is None else json.loads(seen)
    except (ValueError, RecursionError):
        raise ValueError("seen: give the records per state of the last counts event, as JSON") from None
    counted = None if wanted is None else counts.found_at(wanted)
    figures = shared.read((_text(params, "tool"), _text(params, "scope")), wanted, counted)
    out = figures.to_dict()
    bucket = _number(params, "bucket", None, 1, 366 * 86400)
    out["latency"] = ops.latency({t.tool: t.spans for t in figures.tools.values()}, bucket_seconds=bucket)
    return out


def _counts_json(ledger: Ledger) -> dict[str, Any]:
    """``GET /api/counts``: records per state (Redis: its counters; SQLite, PostgreSQL: a count of the table)."""
    states = ledger.stats()
    return {"states": states, "total": sum(states.values()), "url": ledger.url}


def _resolve_args(body: Any) -> tuple[str, dict[str, Any], int | None]:
    """The key, ``Ledger.resolve``'s keyword arguments and the version the page saw, from the body of
    ``POST /api/resolve``; ``ValueError`` says what is missing."""
    if not isinstance(body, dict):  # a client's body, answered 400: not a programming error
        raise ValueError(  # noqa: TRY004
            'send a JSON object: {"key": ..., "confirmed": RESULT or "failed": REASON, "by", "why"}'
        )
    key = body.get("key")
    if not isinstance(key, str) or not key:
        raise ValueError('"key": give the whole key of the record')
    if ("confirmed" in body) == ("failed" in body):
        raise ValueError('give exactly one of "confirmed": RESULT (it happened) or "failed": REASON (it did not)')
    kwargs: dict[str, Any] = {}
    for name in ("by", "why"):
        value = body.get(name)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f'"{name}": give who resolves it and why; both are kept in the record\'s history')
        kwargs[name] = value.strip()
    if "confirmed" in body:
        if body.get("reset"):
            raise ValueError('"reset" goes with "failed": a confirmed record never runs again')
        kwargs["confirmed"] = body["confirmed"]
    else:
        failed = body["failed"]
        if not isinstance(failed, str) or not failed.strip():
            raise ValueError('"failed": give the reason it did not happen, as text')
        kwargs["failed"] = failed.strip()
        kwargs["reset"] = body.get("reset") is True
    version = body.get("version")
    if version is not None and type(version) is not int:
        raise ValueError('"version": the record\'s version as the page read it, an integer')
    return key, kwargs, version


def _resolve_json(ledger: Ledger, body: Any) -> dict[str, Any]:
    """``POST /api/resolve``: settle a ``needs_review`` record by hand, as ``onceonly resolve`` does.

    Only a record still in review (and at the ``version`` the page read, when given) is resolved: a page
    left open must not settle a record the reconciler or a colleague settled meanwhile.
    """
    key, kwargs, version = _resolve_args(body)
    rec = ledger.get(key)
    if rec is None:
        raise KeyError(f"no record with key {key!r}")
    if rec.state is not State.NEEDS_REVIEW:
        raise _Conflict(f"{key!r} is {rec.state.value}, not needs_review: reload; `onceonly resolve` settles others")
    if version is not None and rec.version != version:
        raise _Conflict(f"{key!r} changed since the page read it (version {version}, now {rec.version}): reload")
    return ops.record_json(ledger.resolve(key, **kwargs, version=rec.version))


def _decide_json(ledger: Ledger, body: Any, what: str) -> dict[str, Any]:
    """``POST /api/approve`` and ``/api/deny``: a person's decision on a record awaiting approval, as
    ``onceonly approve`` / ``deny`` make it: only while it still awaits it, at the ``version`` the page
    read (when given), for the arguments it showed (``fingerprint``, when given)."""
    if not isinstance(body, dict):  # a client's body, answered 400: not a programming error
        raise ValueError('send a JSON object: {"key": ..., "by": WHO, "reason": WHY (optional), "version"}')  # noqa: TRY004
    key, by, reason = body.get("key"), body.get("by"), body.get("reason")
    if not isinstance(key, str) or not key:
        raise ValueError('"key": give the whole key of the record')
    if not isinstance(by, str) or not by.strip():
        raise ValueError(f'"by": give who decides to {what} it; it is kept in the record\'s history')
    if reason is not None and not isinstance(reason, str):
        raise ValueError('"reason": give it as text, or leave it out')
    version, fp = body.get("version"), body.get("fingerprint")
    if version is not None and type(version) is not int:
        raise ValueError('"version": the record\'s version as the page read it, an integer')
    if fp is not None and not isinstance(fp, str):
        raise ValueError('"fingerprint": the record\'s fingerprint as the page read it, as text')
    rec = ledger.get(key)
    if rec is None:
        raise KeyError(f"no record with key {key!r}")
    if rec.state is not State.AWAITING_APPROVAL:
        raise _Conflict(f"{key!r} is {rec.state.value}, not awaiting_approval: reload")
    if version is not None and rec.version != version:
        raise _Conflict(f"{key!r} changed since the page read it (version {version}, now {rec.version}): reload")
    decide = ledger.approve if what == "approve" else ledger.deny
    done = decide(key, by=by.strip(), reason=(reason or "").strip() or None, fingerprint=fp or rec.fingerprint)
    return ops.record_json(done)


def _resolve_many_json(ledger: Ledger, body: Any) -> dict[str, Any]:
    """``POST /api/resolve-many``: resolve each of ``"records"`` (``[{"key", "version"}]``) with the
    one outcome, reason and name the body gives, as ``/api/resolve`` resolves one. Each record is
    resolved or refused on its own (not in review, changed, unknown key); when the store fails, the
    records not yet tried are refused with it."""
    if not isinstance(body, dict) or not isinstance(body.get("records"), list) or not body["records"]:
        raise ValueError(
            '"records": give the records to resolve, [{"key": K, "version": V}, ...], with "failed" or '
            '"confirmed", "by" and "why" as for /api/resolve'
        )
    chosen = body["records"]
    if len(chosen) > MAX_LIMIT:
        raise ValueError(f'"records": {len(chosen)} given; resolve at most {MAX_LIMIT} at once')
    shared = {k: v for k, v in body.items() if k != "records"}
    asks = []
    for item in chosen:
        if not isinstance(item, dict):
            raise ValueError('"records": each item is {"key": K, "version": V}')  # noqa: TRY004
        asks.append({**shared, "key": item.get("key"), "version": item.get("version")})
    for ask in asks:
        _resolve_args(ask)  # a bad body is refused whole, before anything is written
    resolved: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    failed: StoreError | None = None
    for ask in asks:
        if failed is not None:
            refused.append({"key": ask["key"], "status": 503, "error": f"not tried: {failed}"})
            continue
        try:
            resolved.append(_resolve_json(ledger, ask))
        except Exception as exc:
            status = _status(exc)
            if status is None:
                raise
            if isinstance(exc, StoreError):
                failed = exc
            refused.append({"key": ask["key"], "status": status, "error": _message(exc)})
    return {"resolved": resolved, "refused": refused, "count": {"resolved": len(resolved), "refused": len(refused)}}


class _Reconciling:
    """``POST /api/reconcile``: one reconciler run over the ledger (``onceonly reconcile --once``),
    one at a time per dashboard."""

    def __init__(self, ledger: Ledger, tools: Mapping[str, Any] | None) -> None:
        self.ledger = ledger
        self.tools = tools
        self._lock = threading.Lock()

    def run(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ValueError('send a JSON object: {"by": WHO, "scope": SCOPE (optional)}')  # noqa: TRY004
        by = body.get("by")
        if not isinstance(by, str) or not by.strip():
            raise ValueError('"by": give who runs the reconciler; it is kept in the history of what it settles')
        scope = body.get("scope")
        if scope is not None and (not isinstance(scope, str) or not scope):
            raise ValueError('"scope": a scope\'s name, or leave it out for every record')
        if not self._lock.acquire(blocking=False):
            raise _Conflict("a reconcile started from this dashboard is still running: wait for its report")
        try:
            tools = self.ledger.tools if self.tools is None else self.tools
            report = reconcile(self.ledger, tools=tools, scope=scope, by=f"reconcile@dashboard:{by.strip()}")
        finally:
            self._lock.release()
        out = report.to_dict()
        out["tools"] = sorted(tools)
        if not tools:
            out["note"] = (
                "no tools registered: expired leases were settled, unknown records wait for their tools' "
                "probes (`onceonly reconcile --app module:ledger`)"
            )
        return out


class _Conflict(Exception):
    """The request is sound but the record is not in a state that allows it (HTTP 409)."""


def _status(exc: Exception) -> int | None:
    """The HTTP status of an error a read or a resolve raised, or ``None`` for a bug (500)."""
    if isinstance(exc, InvalidKey | NotSerializable | ValueError):
        return 400
    if isinstance(exc, ops.AmbiguousKey | _Conflict | InProgress):
        return 409
    if isinstance(exc, KeyError):
        return 404
    if isinstance(exc, StoreError):
        return 503
    if isinstance(exc, OnceOnlyError):
        return 409  # already confirmed, and the like: the message says which
    return None


async def _answer(work: Callable[[], Any]) -> Response:
    """Run ``work`` (it reads the store: blocking) in a worker thread, its errors as JSON answers."""
    try:
        return JSONResponse(await run_in_threadpool(work))
    except Exception as exc:
        status = _status(exc)
        if status is None:
            raise
        return JSONResponse({"error": _message(exc)}, status)


def _write(work: Callable[[Any], dict[str, Any]]) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint of a ``POST``: its JSON body handed to ``work``, which answers as ``_answer`` says."""

    async def endpoint(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return JSONResponse({"error": f"the body is not JSON: {exc}"}, 400)
        return await _answer(lambda: work(body))

    return endpoint


def _message(exc: Exception) -> str:
    # str() of a KeyError is the repr of its message, quoted: send the message itself.
    return str(exc.args[0] if isinstance(exc, LookupError) and exc.args else exc)


def create_app(
    ledger: Ledger,
    *,
    token: str | None = None,
    poll_seconds: float = POLL_SECONDS,
    tools: Mapping[str, Any] | None = None,
) -> ASGIApp:
    """The dashboard over ``ledger`` (which the caller opens and closes).

    Args:
        ledger: the ledger shown; read through ``onceonly.ops``, written only by ``/api/resolve``,
            ``/api/resolve-many``, ``/api/reconcile``, ``/api/approve`` and ``/api/deny``.
        token: when given, every request must carry it (``Authorization: Bearer``, or ``?token=`` on
            a GET). Serving beyond loopback without one is refused by ``check_binding``.
        poll_seconds: how often the event stream asks the store whether anything changed (one count of
            the records per state, shared by every page that listens).
        tools: the tools (name → tool) whose probes ``/api/reconcile`` settles unknown records with
            (default: ``ledger.tools``), e.g. an app's own ledger's.

    .. versionadded:: 0.1
    """
    if not (math.isfinite(poll_seconds) and poll_seconds > 0):
        raise ValueError(f"poll_seconds={poll_seconds!r}: give a positive number of seconds")
    page = files("onceonly.dashboard").joinpath("static", "index.html").read_text(encoding="utf-8")

    async def index(request: Request) -> Response:
        return HTMLResponse(page)

    shared = _SharedCounts(ledger, poll_seconds)
    shared_stats = _SharedStats(ledger, poll_seconds)

    async def counts(request: Request) -> Response:
        return await _answer(lambda: _counts_json(ledger))

    async def records(request: Request) -> Response:
        return await _answer(lambda: _records_json(ledger, request.query_params))

    async def record(request: Request) -> Response:
        key = request.query_params.get("key", "")

        def read() -> dict[str, Any]:
            found = ops.find(ledger, key)
            return {**ops.record_json(found), "short": ops.short_keys(ledger, [found.key])[found.key]}

        return await _answer(read)

    async def stats(request: Request) -> Response:
        return await _answer(lambda: _stats_json(shared_stats, shared, request.query_params))

    reconciling = _Reconciling(ledger, tools)
    resolve = _write(lambda body: _resolve_json(ledger, body))
    resolve_many = _write(lambda body: _resolve_many_json(ledger, body))
    reconcile_now = _write(reconciling.run)
    approve = _write(lambda body: _decide_json(ledger, body, "approve"))
    deny = _write(lambda body: _decide_json(ledger, body, "deny"))
    pause = _write(lambda body: pause_json(ledger, body))
    resume = _write(lambda body: resume_json(ledger, body))

    async def pauses(request: Request) -> Response:
        return await _answer(lambda: pauses_json(ledger))

    async def events(request: Request) -> Response:
        return StreamingResponse(_changes(shared), media_type="text/event-stream")

    routes = [
        Route("/", index, methods=["GET"]),
        Route("/api/counts", counts, methods=["GET"]),
        Route("/api/records", records, methods=["GET"]),
        Route("/api/record", record, methods=["GET"]),
        Route("/api/stats", stats, methods=["GET"]),
        Route("/api/events", events, methods=["GET"]),
        Route("/api/resolve", resolve, methods=["POST"]),
        Route("/api/resolve-many", resolve_many, methods=["POST"]),
        Route("/api/reconcile", reconcile_now, methods=["POST"]),
        Route("/api/approve", approve, methods=["POST"]),
        Route("/api/deny", deny, methods=["POST"]),
        Route("/api/pauses", pauses, methods=["GET"]),
        Route("/api/pause", pause, methods=["POST"]),
        Route("/api/resume", resume, methods=["POST"]),
    ]
    return _Guard(Starlette(routes=routes), token, _csp(page))


def _event(name: str, data: Mapping[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


#: A count is read again no sooner than this many times as long as the last one took: on a store that
#: counts by reading every record (SQLite: 0.5 s a million), a page left open costs a tenth of a core.
COUNT_SPACING = 10.0


class _SharedCounts:
    """The counts per state, read from the store at most once per ``every`` seconds however many
    pages listen, and no sooner than ``COUNT_SPACING`` times the last read's duration: each read
    counts the records (Redis: its counters; PostgreSQL and SQLite: a scan of the table)."""

    def __init__(self, ledger: Ledger, every: float) -> None:
        self.ledger = ledger
        self.every = every
        self._lock = threading.Lock()
        self._next_at = -math.inf
        self._value: dict[str, Any] = {}
        # The counts per state lately sent (as JSON) → when the count that first found them started.
        self._found_at: dict[str, float] = {}

    def read(self) -> dict[str, Any]:
        with self._lock:
            started = time.monotonic()
            if started >= self._next_at:
                try:
                    value = _counts_json(self.ledger)
                except StoreError as exc:
                    value = {"error": str(exc)}
                if "states" in value and value != self._value:
                    self._found_at[json.dumps(value["states"], sort_keys=True)] = started
                    while len(self._found_at) > _SharedStats.KEPT:
                        del self._found_at[next(iter(self._found_at))]
                self._value = value
                took = time.monotonic() - started
                # 0.9: a stream that polls every `every` seconds still gets a fresh read each time.
                self._next_at = started + max(0.9 * self.every, COUNT_SPACING * took)
            return self._value

    def found_at(self, states: Any) -> float | None:
        """When the count that found ``states`` (counts per state an event sent) started, if it was lately."""
        with self._lock:
            return self._found_at.get(json.dumps(states, sort_keys=True))


class _SharedStats:
    """The ledger's figures (``ops.stats``, which reads every record), computed once for all the pages
    that ask together: one reading at a time in the whole app, each started no sooner than
    ``COUNT_SPACING`` times as long as the last one took (nor within 0.9 ``every`` of it), and shared by
    every request it answers.

    A request is answered by a reading that started after it asked, or after the count that found the
    records per state the page last saw (``counted``: the page asks because its event stream showed those
    counts), or that found those same counts (``wanted``), or, without ``wanted``, one that started less
    than ``every`` before it asked. Pages that react to the
    same change thus share one reading, and each still gets one at least as new as the change it saw."""

    #: Readings kept, by (tool, scope): the page asks for one; a script may ask for others.
    KEPT = 16

    def __init__(self, ledger: Ledger, every: float) -> None:
        self.ledger = ledger
        self.every = every
        self._cond = threading.Condition()
        self._running = False
        self._next_at = -math.inf
        # (tool, scope) → (when the reading started, its figures or the error it raised)
        self._done: dict[tuple[str | None, str | None], tuple[float, ops.LedgerStats | Exception]] = {}

    def _answers(
        self, done: tuple[float, ops.LedgerStats | Exception], asked: float, wanted: Any, counted: float | None
    ) -> bool:
        started, value = done
        if started >= asked or (counted is not None and started >= counted):
            return True
        if isinstance(value, Exception):
            return False
        return value.states == wanted if wanted is not None else started >= asked - self.every

    def read(
        self, which: tuple[str | None, str | None], wanted: Any = None, counted: float | None = None
    ) -> ops.LedgerStats:
        """The figures of ``which`` (tool, scope); ``wanted``: the counts per state the page saw, and
        ``counted``: when the count that found them started (a reading started since is as new)."""
        asked = time.monotonic()
        with self._cond:
            while True:
                done = self._done.get(which)
                if done is not None and self._answers(done, asked, wanted, counted):
                    return _figures(done[1])
                wait = None if self._running else self._next_at - time.monotonic()
                if wait is not None and wait <= 0:
                    break
                self._cond.wait(wait)  # a reading running ends with notify_all; else the spacing ends
            self._running = True
        started = time.monotonic()
        value: ops.LedgerStats | Exception
        try:
            value = ops.stats(self.ledger, tool=which[0], scope=which[1])
        except Exception as exc:  # handed to every request it answers; raised by each
            value = exc
        took = time.monotonic() - started
        with self._cond:
            self._running = False
            self._done.pop(which, None)
            self._done[which] = (started, value)
            while len(self._done) > self.KEPT:
                del self._done[next(iter(self._done))]
            self._next_at = started + max(0.9 * self.every, COUNT_SPACING * took)
            self._cond.notify_all()
        return _figures(value)


def _figures(value: ops.LedgerStats | Exception) -> ops.LedgerStats:
    if isinstance(value, Exception):
        raise value
    return value


async def _changes(counts: _SharedCounts) -> AsyncIterator[str]:
    """The event stream: ``counts`` now and whenever the records per state change, ``unavailable``
    while the store cannot be read. The counts are the cheap check: a new record, and every move from
    one state to another, changes them. A change that leaves them all as they were (a conflict counted
    on a confirmed record, two records crossing) shows with the next one, or a reload."""
    yield "retry: 2000\n\n"  # the browser reconnects after 2 s when the stream drops
    last: dict[str, Any] | None = None
    quiet = 0.0
    while True:
        now = await run_in_threadpool(counts.read)
        if now != last:
            yield _event("unavailable" if "error" in now else "counts", now)
            last, quiet = now, 0.0
        elif quiet >= KEEPALIVE_SECONDS:
            yield ": still here\n\n"
            quiet = 0.0
        await asyncio.sleep(counts.every)
        quiet += counts.every
