"""The proxy's TOML config: its own settings, and a ``ToolPolicy`` per upstream tool. No MCP library.

[proxy]
scope = "tickets"            # the scope of keys when the client sends none (default: the upstream's name)
annotations = true           # the upstream is trusted: its readOnlyHint / idempotentHint relax guarding (default false)
tell_model = true            # precede a replay with the text that tells the model
single_tenant = false        # true: every caller is one tenant, so records are shared across callers
env = ["TICKETS_API_KEY"]    # variables of the proxy's environment the upstream command also gets
allowed_hosts = []           # --listen: Host/Origin names accepted besides loopback ones

[tools.create_ticket]
on_unknown = "probe"
on_error = "unknown"         # an isError answer may follow the side effect ("failed": it did nothing)
probe = { tool = "find_ticket", arguments = { session_id = "$session_id", title = "$title" } }
attempts = 3
timeout = 30                 # seconds per attempt
wait = 10                    # seconds a second caller waits for an attempt in progress
ttl = 86400                  # seconds a result is replayed, or "forever"
key = ["session_id", "title"]

[tools.get_weather]
guard = false                # pass through
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from onceonly.mcp.core import META_KEY, ProbeTool, ToolPolicy

__all__ = ["ProxyConfig", "load_config", "parse_config"]

_PROXY_FIELDS = {"scope", "annotations", "tell_model", "meta_key", "single_tenant", "env", "allowed_hosts"}
_TOOL_FIELDS = {"guard", "on_unknown", "probe", "attempts", "timeout", "wait", "ttl", "key", "on_conflict", "on_error"}


@dataclass(frozen=True)
class ProxyConfig:
    """What ``onceonly mcp-proxy --config FILE`` reads.

    .. versionadded:: 0.1
    """

    scope: str | None = None
    annotations: bool = False  # an upstream's claims about its tools are trusted only when the config says so
    tell_model: bool = True
    meta_key: str = META_KEY
    tools: dict[str, ToolPolicy] = field(default_factory=dict)
    single_tenant: bool = False
    env: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()


def load_config(path: str | Path) -> ProxyConfig:
    """Read a proxy config file.

    Raises:
        ValueError: the file is not TOML, or a section or field is unknown or of the wrong type; the
            message names the file and the field.

    .. versionadded:: 0.1
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    return parse_config(data, str(path))


def _want(value: Any, kind: type | tuple[type, ...], where: str, what: str) -> Any:
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise ValueError(f"{where}: {what}, got {value!r}")
    if not isinstance(value, kind):
        raise ValueError(f"{where}: {what}, got {type(value).__name__} {value!r}")  # noqa: TRY004 - a wrong value in a file, one error type for all
    return value


def parse_config(data: dict[str, Any], source: str = "config") -> ProxyConfig:
    """A ``ProxyConfig`` from the parsed TOML tables (see ``load_config``).

    .. versionadded:: 0.1
    """
    unknown = set(data) - {"proxy", "tools"}
    if unknown:
        raise ValueError(f"{source}: unknown section(s) {sorted(unknown)}; the sections are [proxy] and [tools.NAME]")
    proxy = _want(data.get("proxy", {}), dict, f"{source} [proxy]", "a table")
    bad = set(proxy) - _PROXY_FIELDS
    if bad:
        raise ValueError(f"{source} [proxy]: unknown field(s) {sorted(bad)}; known: {sorted(_PROXY_FIELDS)}")
    where = f"{source} [proxy]"
    scope = proxy.get("scope")
    if scope is not None:
        _want(scope, str, f"{where} scope", "a string")
    tools_table = _want(data.get("tools", {}), dict, f"{source} [tools]", "a table of [tools.NAME] tables")
    tools: dict[str, ToolPolicy] = {}
    for name, table in tools_table.items():
        tools[name] = _tool(name, _want(table, dict, f"{source} [tools.{name}]", "a table"), f"{source} [tools.{name}]")
    return ProxyConfig(
        scope=scope,
        annotations=_want(proxy.get("annotations", False), bool, f"{where} annotations", "true or false"),
        tell_model=_want(proxy.get("tell_model", True), bool, f"{where} tell_model", "true or false"),
        meta_key=_want(proxy.get("meta_key", META_KEY), str, f"{where} meta_key", "a string"),
        tools=tools,
        single_tenant=_want(proxy.get("single_tenant", False), bool, f"{where} single_tenant", "true or false"),
        env=_names(proxy.get("env", []), f"{where} env", "names of environment variables"),
        allowed_hosts=_names(proxy.get("allowed_hosts", []), f"{where} allowed_hosts", "host names"),
    )


def _names(value: Any, where: str, what: str) -> tuple[str, ...]:
    items = _want(value, list, where, f"a list of {what}")
    return tuple(_want(v, str, where, f"{what} (strings)") for v in items)


def _tool(name: str, table: dict[str, Any], where: str) -> ToolPolicy:
    bad = set(table) - _TOOL_FIELDS
    if bad:
        raise ValueError(f"{where}: unknown field(s) {sorted(bad)}; known: {sorted(_TOOL_FIELDS)}")
    kw: dict[str, Any] = {}
    if "guard" in table:
        kw["guard"] = _want(table["guard"], bool, f"{where} guard", "true or false")
    for text in ("on_unknown", "on_conflict", "on_error"):
        if text in table:
            kw[text] = _want(table[text], str, f"{where} {text}", "a string")
    if "attempts" in table:
        kw["attempts"] = _want(table["attempts"], int, f"{where} attempts", "a whole number")
    for seconds in ("timeout", "wait"):
        if seconds in table:
            kw[seconds] = float(_want(table[seconds], (int, float), f"{where} {seconds}", "a number of seconds"))
    if "ttl" in table:
        ttl = table["ttl"]
        kw["ttl"] = (
            None if ttl == "forever" else float(_want(ttl, (int, float), f"{where} ttl", 'seconds or "forever"'))
        )
    if "key" in table:
        key = _want(table["key"], list, f"{where} key", "a list of argument names")
        kw["key"] = tuple(_want(k, str, f"{where} key", "argument names (strings)") for k in key)
    if "probe" in table:
        probe = _want(table["probe"], dict, f"{where} probe", '{ tool = "NAME", arguments = { ... } }')
        extra = set(probe) - {"tool", "arguments"}
        if extra or "tool" not in probe:
            raise ValueError(f'{where} probe: give {{ tool = "NAME", arguments = {{ ... }} }}, got {probe!r}')
        kw["probe"] = ProbeTool(
            _want(probe["tool"], str, f"{where} probe.tool", "a tool name"),
            _want(probe.get("arguments", {}), dict, f"{where} probe.arguments", "a table"),
        )
    try:
        return ToolPolicy(**kw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
