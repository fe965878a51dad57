"""What every MCP integration shares, free of any MCP library: keys, policies, and the guarded call.

A ``tools/call`` is guarded as one ledger operation whose arguments are the call's JSON arguments,
coerced by the tool's own ``inputSchema`` (``onceonly.schema``: ``500``, ``"500"`` and ``500.0`` for an
integer are one operation). The framework adapters (``onceonly.mcp.middleware``, ``onceonly.mcp.sdk``)
turn their request into a ``Request`` and their results into wire dicts (``{"content": [...],
"structuredContent": ..., "isError": ..., "_meta": {...}}``), and this module decides, through the edge
contract (``onceonly.edge``):

- who is calling (``caller``): the access token's principal, else the ``Authorization`` header (both as
  a keyed hash), else the one client of a stdio or in-memory transport, else the handshake-era protocol
  session, else a loopback client; a network caller with none of these shares nothing. A server guarded
  for one tenant on purpose (``single_tenant=True``) shares its records across callers;
- the key: ``_meta[meta_key]`` from the client, else ``_meta["dev.onceonly/scope"]`` (a conversation) +
  tool + canonical arguments, else tool + canonical arguments: each within its caller's scope, so that
  what a client chooses never reaches another caller's records;
- the policy: a read-only tool (by its annotations, when they are trusted) passes through, an
  idempotent one settles an unknown by running again, everything else by review, unless the tool's
  ``ToolPolicy`` says otherwise (a probe may be another tool of the same server);
- what a result means: an ``isError`` result of a tool that is not read-only says it ran and failed,
  maybe after its side effect: an unknown outcome, settled by its policy (``ToolPolicy.on_error``
  overrides it); a protocol error before the tool ran is a failure;
- what the client reads: a fresh result as it came, without any ``dev.onceonly/*`` mark of the
  upstream's; a replay as the same content blocks preceded by one text block of ``tell_model`` and marked
  ``_meta["dev.onceonly/replayed"] = true``; an unknown or any other refusal of the ledger as an error
  result with ``tell_model``'s text.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, get_args

from onceonly import edge
from onceonly.callers import CallerHasher, check_secret, stored_secret
from onceonly.errors import InvalidKey, OnceOnlyError, OutcomeUnknown
from onceonly.keys import MAX_KEY_LENGTH, canonical_json, compose_key, fingerprint, safe_name, select, validate_name
from onceonly.mcp.front import is_loopback
from onceonly.plan import NOT_FOUND, Outcome
from onceonly.policy import (
    DEFAULT_TTL,
    Classification,
    OnConflict,
    OnUnknown,
    Policy,
    Retry,
    Verdict,
    check_seconds,
    classify,
)
from onceonly.schema import SchemaError, coerce
from onceonly.tools import ToolSpec

if TYPE_CHECKING:
    from onceonly.ledger import Ledger

__all__ = [
    "KEY_META",
    "META_KEY",
    "REPLAYED_META",
    "SCOPE_META_KEY",
    "BadRequest",
    "Guard",
    "ProbeTool",
    "Request",
    "ToolPolicy",
    "Transport",
    "meta",
]

_log = logging.getLogger("onceonly")

#: The request ``_meta`` key a client puts its own idempotency key under.
META_KEY = "dev.onceonly/idempotencyKey"
#: The request ``_meta`` key of a conversation id: keys are then scoped by it.
SCOPE_META_KEY = "dev.onceonly/scope"
#: The result ``_meta`` key that marks a replay (``true``).
REPLAYED_META = "dev.onceonly/replayed"
#: The result ``_meta`` key that holds the ledger key of a replay or an unknown (for ``onceonly show``).
KEY_META = "dev.onceonly/key"

# Scopes and tool names longer than these are hashed, so that scope:tool:digest fits the key limit.
_MAX_SCOPE = 96
_MAX_TOOL = 96
# What precedes a replayed result's own content blocks.
_FOLLOWS = "see the content that follows"


def meta(key: str | None = None, *, scope: str | None = None) -> dict[str, str]:
    """The ``_meta`` of a ``tools/call`` that carries the client's own key, or its conversation scope.

    ``client.call_tool("create_ticket", args, meta=onceonly.mcp.meta("order-42"))``: the same key is one
    execution, whichever connection or session sends it. ``meta(scope=thread_id)``: calls with the same
    tool and arguments in one conversation are one execution.

    .. versionadded:: 0.1
    """
    out: dict[str, str] = {}
    if key is not None:
        out[META_KEY] = validate_name(key, f"_meta {META_KEY!r}")
    if scope is not None:
        out[SCOPE_META_KEY] = validate_name(scope, f"_meta {SCOPE_META_KEY!r}")
    if not out:
        raise ValueError("meta() needs key= or scope=")
    return out


class BadRequest(ValueError):
    """A ``tools/call`` the guard refuses before anything is recorded; adapters answer it as an
    ``invalid params`` MCP error."""


@dataclass(frozen=True, slots=True)
class ProbeTool:
    """A probe that is another tool of the same server: ``ProbeTool("find_ticket", {"session_id":
    "$session_id", "title": "$title"})``. A string ``"$name"`` is the guarded call's argument ``name``
    (``"$$x"`` is the literal ``"$x"``); anything else is passed as written.

    The probe's answer is "not found" when its result is empty: no content, or only text that is empty,
    ``null``, ``[]`` or ``{}``, or a ``structuredContent`` (or its ``result``) that is null or empty. Any
    other answer is taken as the operation's result. An error result is no answer: the outcome stays
    unknown.

    .. versionadded:: 0.1
    """

    tool: str
    arguments: Mapping[str, Any] = field(default_factory=dict)

    def map(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The probe's arguments for a guarded call with ``arguments``."""
        return {k: _substitute(v, arguments) for k, v in self.arguments.items()}


def _substitute(value: Any, arguments: Mapping[str, Any]) -> Any:
    if isinstance(value, str) and value.startswith("$"):
        if value.startswith("$$"):
            return value[1:]
        name = value[1:]
        if name not in arguments:
            raise KeyError(f"the probe maps {value!r}, and the call has no argument {name!r}")
        return arguments[name]
    if isinstance(value, Mapping):
        return {k: _substitute(v, arguments) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, arguments) for v in value]
    return value


ProbeFn = Callable[[dict[str, Any]], Any]
OnError = Literal["unknown", "failed"]


@dataclass(frozen=True)
class ToolPolicy:
    """How one MCP tool is guarded; every field left ``None`` comes from the tool's annotations.

    Args:
        guard: ``False`` passes the tool through (no ledger); ``True`` guards it even when it says it
            is read-only; ``None`` (default): a read-only tool passes, the rest is guarded.
        on_unknown: ``"review"``, ``"probe"``, ``"retry"`` or ``"resend"``; default ``"probe"`` with a
            probe, ``"retry"`` for a tool that says it is idempotent, else ``"review"``.
        probe: a ``ProbeTool`` (another tool of the server), or a function of the call's arguments
            (sync or async) that returns the result, or ``onceonly.NOT_FOUND``.
        attempts: attempts of one operation (``isError`` results and retried unknowns count).
        timeout: seconds per attempt; past it the outcome is unknown and a late answer still counts.
        wait: seconds a second caller waits for an attempt in progress.
        ttl: seconds a result is kept and replayed (``None``: forever).
        key: the argument names that identify the operation (default: all arguments).
        on_conflict: an explicit key sent again with other arguments: ``"raise"`` or ``"replay"``.
        on_error: what the tool's own error result (``isError: true``) means: ``"unknown"`` (default for a
            tool that is not read-only: it ran, maybe after its side effect, so it is settled by
            ``on_unknown`` and never re-run blindly), ``"failed"`` (it did nothing: the error is answered
            as it came and a later call runs again), or a function of the result's wire dict that
            returns one of the two.

    .. versionadded:: 0.1
    """

    guard: bool | None = None
    on_unknown: OnUnknown | None = None
    probe: ProbeTool | ProbeFn | None = None
    attempts: int | None = None
    timeout: float | None = None
    wait: float = 10.0
    ttl: float | None = DEFAULT_TTL
    key: tuple[str, ...] | None = None
    on_conflict: OnConflict = "raise"
    on_error: OnError | Callable[[dict[str, Any]], OnError] | None = None

    def __post_init__(self) -> None:
        if self.on_error is not None and not callable(self.on_error) and self.on_error not in get_args(OnError):
            raise ValueError(
                f"on_error={self.on_error!r}: use 'unknown', 'failed', or a function of the error result "
                "that returns one of them"
            )
        if self.on_unknown is not None and self.on_unknown not in get_args(OnUnknown):
            raise ValueError(f"on_unknown={self.on_unknown!r}: use one of {', '.join(get_args(OnUnknown))}")
        if self.on_conflict not in get_args(OnConflict):
            raise ValueError(f"on_conflict={self.on_conflict!r}: use one of {', '.join(get_args(OnConflict))}")
        if self.on_unknown == "probe" and self.probe is None:
            raise ValueError("on_unknown='probe' needs a probe: a ProbeTool or a function of the arguments")
        if self.probe is not None and not isinstance(self.probe, ProbeTool) and not callable(self.probe):
            raise TypeError(f"probe={self.probe!r}: give a ProbeTool(tool, arguments) or a function")
        if self.attempts is not None:
            Retry(attempts=self.attempts)  # its own checks and messages
        if self.timeout is not None:
            check_seconds(self.timeout, f"timeout={self.timeout!r}", above_zero=True, none="no time limit")
        check_seconds(self.wait, f"wait={self.wait!r}")
        if self.ttl is not None:
            check_seconds(self.ttl, f"ttl={self.ttl!r}", above_zero=True, none="keep results forever")
        if self.key is not None:
            if isinstance(self.key, str) or not all(isinstance(k, str) for k in self.key):
                raise TypeError(f"key={self.key!r}: give a tuple of argument names, as key=('session_id',)")
            object.__setattr__(self, "key", tuple(self.key))


@dataclass(frozen=True, slots=True)
class Hints:
    """A tool's annotations, as far as they matter here (``None``: not said)."""

    read_only: bool | None = None
    idempotent: bool | None = None


@dataclass(frozen=True, slots=True)
class Transport:
    """What the transport says about who sent a request, as an adapter reads it.

    Attributes:
        network: the request came over HTTP (streamable HTTP, SSE); ``False``: stdio or in memory, a
            transport with exactly one client.
        principal: the access token's ``(client_id, issuer, subject)`` when the server has auth.
        authorization: the ``Authorization`` header as sent (hashed before anything keeps it).
        peer: the client's address.
        session: the protocol session of a handshake-era connection (``None`` on the stateless protocol).
    """

    network: bool = False
    principal: tuple[str | None, ...] | None = None
    authorization: str | None = None
    peer: str | None = None
    session: str | None = None


@dataclass(slots=True)
class Request:
    """One ``tools/call``, as an adapter sees it.

    ``call`` runs the rest of the server's chain with the given arguments (coerced by the tool's schema)
    and returns the framework's result object; ``to_wire`` turns such an object into a wire dict;
    ``probe_call`` calls another tool of the server (for a ``ProbeTool``) and returns its wire dict.
    """

    name: str
    arguments: dict[str, Any]
    meta: Mapping[str, Any]
    transport: Transport
    hints: Hints
    call: Callable[[dict[str, Any]], Awaitable[Any]]
    to_wire: Callable[[Any], dict[str, Any]]
    probe_call: Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]] | None = None
    schema: Mapping[str, Any] | None = None


@dataclass(slots=True)
class Forwarded:
    """Answer with the framework's own result object (a fresh result, an error result, an input request)."""

    original: Any


@dataclass(slots=True)
class Made:
    """Answer with this wire dict (a replay, or the model's text for an unknown or another refusal)."""

    wire: dict[str, Any]


Answer = Forwarded | Made


class _ToolFailed(Exception):
    """The tool answered with ``isError`` and its policy says it did nothing: a definite failed attempt,
    re-raised to be answered as it came."""

    onceonly_verdict = Verdict.FAILED

    def __init__(self, original: Any, wire: dict[str, Any]) -> None:
        super().__init__(_text_of(wire) or "the tool answered with an error result")
        self.original = original


class _ToolErrorAfterRun(Exception):
    """The tool answered with ``isError`` after it may have acted (an upstream's own timeout, a failure
    half-way): the outcome is unknown, settled by the tool's policy."""

    onceonly_verdict = Verdict.UNKNOWN

    def __init__(self, wire: dict[str, Any]) -> None:
        super().__init__(
            f"the tool answered with an error result after it may have acted: {_text_of(wire)[:300]}".rstrip(": ")
        )


class _InputRequired(Exception):
    """The tool asked the client for input (a multi-round-trip ``input_required``): not final. The claim is
    given back, uncounted, and the next round of the same call runs it again."""

    def __init__(self, original: Any) -> None:
        super().__init__("input_required")
        self.original = original


class _Forward:
    """The guarded function's one argument that is not part of the operation: how to run it this time."""

    __slots__ = ("arguments", "error", "forged", "on_error", "original", "request")

    def __init__(self, request: Request, arguments: dict[str, Any], on_error: Callable[[dict[str, Any]], str]) -> None:
        self.request = request
        self.arguments = arguments
        self.on_error = on_error
        self.original: Any = None
        self.forged = False
        #: The tool's own error result, when it answered with one that is taken as an unknown outcome.
        self.error: dict[str, Any] | None = None

    async def __call__(self) -> dict[str, Any]:
        req = self.request
        got = await req.call(self.arguments)
        wire = req.to_wire(got)
        if wire.get("resultType") == "input_required":
            raise _InputRequired(got)
        if wire.get("isError"):
            if self.on_error(wire) == "failed":
                raise _ToolFailed(got, wire)
            self.error = wire
            raise _ToolErrorAfterRun(wire)
        self.original = got
        self.forged = has_own_meta(wire)
        return stored(wire)


async def _mcp_tool(arguments: dict[str, Any], forward: _Forward) -> Any:
    return await forward()


# What the current request can reach, for a ProbeTool (the probe runs inside the request's own task).
_PROBE_CALL: contextvars.ContextVar[Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]] | None] = (
    contextvars.ContextVar("onceonly_mcp_probe_call", default=None)
)


def stored(wire: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a result that is kept: its content blocks, structured content, and the ``_meta``
    keys that are the tool's own (not the protocol's ``io.modelcontextprotocol/*``, nor onceonly's
    ``dev.onceonly/*``, which only onceonly sets)."""
    out: dict[str, Any] = {"content": list(wire.get("content") or [])}
    if wire.get("structuredContent") is not None:
        out["structuredContent"] = wire["structuredContent"]
    own = {
        k: v
        for k, v in edge.strip_own_meta(wire.get("_meta")).items()
        if not str(k).startswith("io.modelcontextprotocol/")
    }
    if own:
        out["_meta"] = own
    return out


def has_own_meta(wire: Mapping[str, Any]) -> bool:
    """Whether a result carries one of onceonly's own ``_meta`` marks (from an upstream: forged)."""
    meta = wire.get("_meta")
    return bool(meta) and len(edge.strip_own_meta(meta)) != len(meta)  # type: ignore[arg-type]


def cleaned(wire: Mapping[str, Any]) -> dict[str, Any]:
    """``wire`` without onceonly's own ``_meta`` marks, everything else as it came."""
    out = dict(wire)
    meta = edge.strip_own_meta(wire.get("_meta"))
    if meta:
        out["_meta"] = meta
    else:
        out.pop("_meta", None)
    return out


def _text_of(wire: Mapping[str, Any]) -> str:
    return "\n".join(
        str(b.get("text", "")) for b in wire.get("content") or [] if isinstance(b, dict) and b.get("type") == "text"
    )


_EMPTY_TEXT = frozenset({"", "null", "[]", "{}", '""'})


def is_empty(wire: Mapping[str, Any]) -> bool:
    """Whether a probe's answer says "not found" (see ``ProbeTool``)."""
    structured = wire.get("structuredContent")
    if structured is not None:
        if isinstance(structured, dict) and set(structured) == {"result"}:
            structured = structured["result"]
        return structured is None or structured in ([], {}, "")
    blocks = wire.get("content") or []
    return all(
        isinstance(b, dict) and b.get("type") == "text" and str(b.get("text", "")).strip() in _EMPTY_TEXT
        for b in blocks
    )


def _safe_name(value: str, limit: int, prefix: str) -> str:
    """``value`` when it is a valid name of at most ``limit`` characters, else a hash of it."""
    return safe_name(value, limit=limit, prefix=prefix)


def _classify_mcp(exc: BaseException) -> Classification | None:
    """Verdicts the core does not know: an MCP connection that closed or a request that timed out may
    have been served (unknown); a FastMCP ``ToolError`` is as unsafe as its cause; httpx2 (the HTTP
    client of mcp 2.x) is classified as httpx is."""
    mcp_error = _mcp_error_codes(exc)
    if mcp_error is not None:
        return mcp_error
    if type(exc).__name__ == "ToolError" and exc.__cause__ is not None:
        return classify(exc.__cause__, _classify_mcp)
    mod = type(exc).__module__.partition(".")[0]
    if mod == "httpx2":
        name = type(exc).__name__
        if name in ("ConnectError", "ConnectTimeout", "PoolTimeout", "UnsupportedProtocol", "InvalidURL"):
            return Classification(Verdict.NOT_SENT, None, name)
        return Classification(Verdict.UNKNOWN, None, name)
    return None


def _mcp_error_codes(exc: BaseException) -> Classification | None:
    code = getattr(getattr(exc, "error", None), "code", None)
    if type(exc).__name__ != "MCPError" or not isinstance(code, int):
        return None
    from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

    if code in (CONNECTION_CLOSED, REQUEST_TIMEOUT):
        return Classification(Verdict.UNKNOWN, None, f"MCPError {code}: {getattr(exc.error, 'message', '')}")  # type: ignore[attr-defined]
    return Classification(Verdict.FAILED, None, f"MCPError {code}")


Mode = Literal["pass", "guard"]

#: Where a guard keeps the secret of its callers' hash, in the ledger's store.
SECRET_KEY = "onceonly-mcp:meta:client-secret"


class Guard:
    """The MCP guard of one server (or proxy): its ledger, its key sources, its tools' policies.

    Args:
        ledger: the ledger.
        meta_key: the request ``_meta`` key of the client's own key.
        scope: the server's part of every key's scope (default: the server's name, as the adapter knows
            it), so that two servers on one ledger stay apart; each caller's scope is under it.
        tools: a ``ToolPolicy`` (or a dict of its fields) per tool name.
        annotations: trust the tools' annotations to relax guarding (``readOnlyHint``, ``idempotentHint``).
        tell_model: precede a replay's content with the text that tells the model it was not repeated.
        single_tenant: every caller is the same tenant on purpose: records (and the keys and scopes clients
            choose) are shared across callers. Off by default: a record is never shared between callers
            that could be different people.
        client_secret: the key of the callers' hash (16 bytes or more, the same in every process); default:
            one made on first use and kept in the ledger's store.
    """

    def __init__(
        self,
        ledger: Ledger,
        *,
        meta_key: str = META_KEY,
        scope: str | None = None,
        tools: Mapping[str, ToolPolicy | Mapping[str, Any]] | None = None,
        annotations: bool = True,
        tell_model: bool = True,
        single_tenant: bool = False,
        client_secret: bytes | str | None = None,
    ) -> None:
        self.ledger = ledger
        self.meta_key = validate_name(meta_key, "meta_key")
        self.scope = None if scope is None else validate_name(scope, "scope")
        self.tools = {name: p if isinstance(p, ToolPolicy) else ToolPolicy(**p) for name, p in (tools or {}).items()}
        self.annotations = annotations
        self.tell_model = tell_model
        self.single_tenant = bool(single_tenant)
        self._hasher = None if client_secret is None else CallerHasher(check_secret(client_secret))
        self._hasher_lock = asyncio.Lock()
        self._warned_anonymous = False
        self._specs: dict[tuple[str, str], ToolSpec] = {}

    # --- the decisions --------------------------------------------------------------------------

    def mode(self, name: str, hints: Hints) -> Mode:
        p = self.tools.get(name)
        if p is not None and p.guard is not None:
            return "guard" if p.guard else "pass"
        return "pass" if self.annotations and hints.read_only is True else "guard"

    def on_unknown(self, name: str, hints: Hints) -> OnUnknown:
        p = self.tools.get(name)
        if p is not None and p.on_unknown is not None:
            return p.on_unknown
        if p is not None and p.probe is not None:
            return "probe"
        if self.annotations and hints.idempotent is True:
            return "retry"
        return "review"

    def on_error(self, name: str, hints: Hints) -> Callable[[dict[str, Any]], str]:
        """What an ``isError`` result of this tool means: ``"unknown"`` unless it is read-only (its
        annotations trusted) or its policy says otherwise."""
        p = self.tools.get(name)
        rule = p.on_error if p is not None else None
        if callable(rule):
            fn = rule

            def ask(wire: dict[str, Any]) -> str:
                verdict = fn(wire)
                if verdict not in ("unknown", "failed"):
                    raise TypeError(
                        f"the on_error function of tool {name!r} returned {verdict!r}: return 'unknown' or 'failed'"
                    )
                return verdict

            return ask
        if rule is None:
            read_only = self.annotations and hints.read_only is True
            rule = "failed" if edge.error_result_verdict(read_only=read_only) is Verdict.FAILED else "unknown"
        fixed = rule
        return lambda _wire: fixed

    def base(self, base: str) -> str:
        return _safe_name(self.scope or base, _MAX_SCOPE, "h-")

    async def hasher(self) -> CallerHasher:
        if self._hasher is None:
            async with self._hasher_lock:
                if self._hasher is None:
                    secret = await asyncio.to_thread(
                        stored_secret, self.ledger.store, key=SECRET_KEY, scope="onceonly-mcp:meta", tool="mcp",
                        now=self.ledger.clock(),
                    )  # fmt: skip
                    self._hasher = CallerHasher(secret)
        return self._hasher

    async def caller(self, req: Request, base: str) -> str:
        """The scope of the caller of ``req``, under the server's ``base`` (see the module's docstring)."""
        root = self.base(base)
        if self.single_tenant:
            return root
        t = req.transport
        if t.principal is not None:
            return edge.caller_scope("p", (await self.hasher())("token", list(t.principal)), base=root)
        if t.authorization:
            return edge.caller_scope("p", (await self.hasher())("authorization", [t.authorization]), base=root)
        if not t.network:
            return edge.caller_scope("local", base=root)
        if t.session is not None:
            return edge.caller_scope("s", t.session, base=root)
        if t.peer and is_loopback(t.peer):
            return edge.caller_scope("local", base=root)
        if not self._warned_anonymous:
            self._warned_anonymous = True
            _log.warning(
                "onceonly mcp: a call over the network came with no credentials and no session, so its caller "
                "cannot be told from others: it runs guarded on its own and nothing replays for it. Give the "
                "server auth (or clients an Authorization header), or, if every caller is one tenant on "
                "purpose, pass single_tenant=True"
            )
        return edge.caller_scope("r", uuid.uuid4().hex, base=root)

    async def scope_and_key(self, req: Request, base: str) -> tuple[str, str | None]:
        """The key's scope and the client's own key (``None``: the key is tool + canonical arguments).

        Raises:
            BadRequest: a ``_meta`` key or scope that is not a usable name.
        """
        caller = await self.caller(req, base)
        raw = req.meta.get(self.meta_key)
        tool = self.tool_name(req.name)
        if raw is not None:
            room = MAX_KEY_LENGTH - len(compose_key(caller, tool, ""))  # as stored: ':' and '%' encoded
            try:
                key = validate_name(raw, f"_meta {self.meta_key!r}")
            except InvalidKey as exc:
                raise BadRequest(str(exc)) from None
            if len(key) > room:
                raise BadRequest(
                    f"the _meta {self.meta_key!r} is {len(key)} characters; with this server's scope and the "
                    f"tool name the limit is {room}: send a shorter key, or a hash of it"
                )
            return caller, key
        conv = req.meta.get(SCOPE_META_KEY)
        if conv is not None:
            if not isinstance(conv, str) or not conv:
                raise BadRequest(
                    f"the _meta {SCOPE_META_KEY!r} must be a non-empty string (a conversation id), "
                    f"got {type(conv).__name__}: {conv!r}"[:300]
                )
            return edge.client_scope(caller, conv), None
        return caller, None

    def tool_name(self, name: str) -> str:
        return _safe_name(name, _MAX_TOOL, "tool-")

    def spec(self, name: str, on_unknown: OnUnknown) -> ToolSpec:
        """The ledger's view of one tool under one policy (one per tool and settling rule, kept)."""
        cached = self._specs.get((name, on_unknown))
        if cached is not None:
            return cached
        p = self.tools.get(name) or ToolPolicy()
        key_fn = None
        if p.key is not None:
            fields = p.key

            def key_fn(bound: dict[str, Any]) -> str:
                return fingerprint(canonical_json(select(bound["arguments"], fields), path="key"))[:32]

        probe = _probe_for(p.probe) if p.probe is not None else None
        policy = Policy(
            retry=Retry(attempts=p.attempts) if p.attempts is not None else Retry(),
            on_unknown=on_unknown,
            on_conflict=p.on_conflict,
            has_probe=probe is not None,
            ttl=p.ttl,
            wait=p.wait,
            classify=_classify_mcp,
        )
        made = ToolSpec(
            self.ledger, _mcp_tool, name=self.tool_name(name), key=key_fn, ignore=("forward",), normalize=None,
            policy=policy, probe=probe, timeout=p.timeout, readonly=False, decode=None,
            passthrough=(_InputRequired,),
        )  # fmt: skip
        self._specs[(name, on_unknown)] = made
        return made

    # --- one call -------------------------------------------------------------------------------

    async def run(self, req: Request, base_scope: str) -> Answer:
        """Run (or replay) one ``tools/call``.

        Raises:
            BadRequest: the request is refused before anything is recorded.
            Exception: whatever the rest of the chain raised (the framework answers it).
        """
        if self.mode(req.name, req.hints) == "pass":
            return self.passed(req, await req.call(req.arguments))
        if not isinstance(req.arguments, dict):
            raise BadRequest(
                f"tools/call {req.name!r}: the arguments must be a JSON object, got {type(req.arguments).__name__}"
            )
        arguments = self.coerced(req)
        scope, key = await self.scope_and_key(req, base_scope)
        spec = self.spec(req.name, self.on_unknown(req.name, req.hints))
        forward = _Forward(req, arguments, self.on_error(req.name, req.hints))
        token = _PROBE_CALL.set(req.probe_call)
        try:
            with self.ledger.task(scope):
                out = await spec.arun((arguments, forward), {}, key, 1)
        except _ToolFailed as exc:
            return self.passed(req, exc.original)
        except _InputRequired as exc:
            return Forwarded(exc.original)
        except OnceOnlyError as exc:
            _log.warning("onceonly mcp %s: %s", req.name, exc)
            return Made(self.refusal(exc, forward.error if isinstance(exc, OutcomeUnknown) else None))
        finally:
            _PROBE_CALL.reset(token)
        if not out.replayed and forward.original is not None:
            if forward.forged:
                return Made(cleaned(req.to_wire(forward.original)))
            return Forwarded(forward.original)
        return Made(self.replay(out))

    @staticmethod
    def passed(req: Request, got: Any) -> Answer:
        """A result the guard passes on: as it came, less any ``dev.onceonly/*`` mark (only onceonly sets those)."""
        wire = req.to_wire(got)
        return Made(cleaned(wire)) if has_own_meta(wire) else Forwarded(got)

    @staticmethod
    def coerced(req: Request) -> dict[str, Any]:
        """The call's arguments as the tool will see them, by its ``inputSchema``.

        Raises:
            BadRequest: the schema refuses them; nothing is recorded.
        """
        try:
            made = coerce(req.schema, req.arguments)
        except SchemaError as exc:
            raise BadRequest(f"tools/call {req.name!r}: invalid arguments: {exc}") from None
        return made if isinstance(made, dict) else req.arguments

    def replay(self, out: Outcome) -> dict[str, Any]:
        """A recorded result, as the client reads it again."""
        result = out.result if isinstance(out.result, dict) else {"content": [], "structuredContent": None}
        content = list(result.get("content") or [])
        if not content and result.get("structuredContent") is None:
            # A result from `onceonly resolve --confirmed`: not a stored tool result. Show it as text.
            content = [{"type": "text", "text": canonical_json(out.result, path="result")}]
        if self.tell_model:
            text = edge.envelope(replace(out, result=_FOLLOWS)).text
            content = [{"type": "text", "text": text}, *content]
        wire: dict[str, Any] = {"content": content, "isError": False}
        if result.get("structuredContent") is not None:
            wire["structuredContent"] = result["structuredContent"]
        wire["_meta"] = {**(result.get("_meta") or {}), REPLAYED_META: True, KEY_META: out.key}
        return wire

    @staticmethod
    def refusal(exc: OnceOnlyError, error: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """An unknown outcome (or any refusal of the ledger) as the client reads it: an error result; after
        the text, the tool's own error content when it answered with one (it is the tool's, not an
        operator's)."""
        content: list[Any] = [{"type": "text", "text": edge.envelope(exc).text}]
        if error is not None:
            content += [b for b in error.get("content") or [] if isinstance(b, dict)]
        wire: dict[str, Any] = {"content": content, "isError": True}
        key = getattr(exc, "key", None)
        if isinstance(key, str):
            wire["_meta"] = {KEY_META: key}
        return wire


def _probe_for(p: ProbeTool | ProbeFn) -> Callable[[dict[str, Any], str], Awaitable[Any]]:
    async def probe(args: dict[str, Any], key: str) -> Any:
        arguments = args.get("arguments") or {}
        if isinstance(p, ProbeTool):
            call = _PROBE_CALL.get()
            if call is None:
                raise OnceOnlyError(f"the probe {p.tool!r} is a tool of the server, and no server is at hand here")
            wire = await call(p.tool, p.map(arguments))
            if wire.get("isError"):
                raise OnceOnlyError(f"the probe {p.tool!r} answered with an error: {_text_of(wire)[:500]}")
            return NOT_FOUND if is_empty(wire) else stored(wire)
        value = p(arguments)
        if inspect.isawaitable(value):
            value = await value
        return value

    return probe
