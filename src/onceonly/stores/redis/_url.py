"""The Redis URL: onceonly's options split from redis-py's, Sentinel URLs, and the URL as messages show it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import SplitResult, parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from onceonly.stores._url import redact_url
from onceonly.stores.redis._layout import DEFAULT_PREFIX, DEFAULT_SHARDS, MAX_SHARDS

_OURS = (
    "prefix", "shards", "warn_persistence", "allow_eviction", "cluster", "replicas", "replicas_timeout",
    "sentinel_username", "sentinel_password", "sentinel_ssl",
)  # fmt: skip
#: URL schemes that open a Redis Cluster client, and the scheme redis-py is given instead.
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
#: URL schemes that find the master through Redis Sentinel, and the scheme of the master's URL.
_SENTINEL_SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}
_SENTINEL_PORT = 26379
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
#: Seconds a write waits for its replicas (``replicas=N``) unless ``replicas_timeout`` says otherwise.
DEFAULT_REPLICAS_TIMEOUT = 1.0


@dataclass(frozen=True)
class SentinelTarget:
    """Where a ``redis+sentinel://`` URL finds its master: the sentinels, the name they monitor it
    under, and the options of the connections to the sentinels themselves (``sentinel_password`` …).

    .. versionadded:: 0.1
    """

    sentinels: tuple[tuple[str, int], ...]
    service: str
    options: dict[str, Any] = field(default_factory=dict)


def _sentinel_hosts(netloc: str, shown: str) -> tuple[str, tuple[tuple[str, int], ...]]:
    """The user part and the ``host:port`` pairs of a sentinel URL's ``host1:26379,host2:26379``."""
    userinfo, at, hosts = netloc.rpartition("@")
    found: list[tuple[str, int]] = []
    for item in hosts.split(","):
        host, port = item.strip(), str(_SENTINEL_PORT)
        if host.startswith("["):  # [::1]:26379
            host, _, rest = host[1:].partition("]")
            if rest:
                port = rest.removeprefix(":")
        elif host.count(":") == 1:
            host, port = host.split(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"sentinel {item.strip()!r} in {shown!r}: give each sentinel as host:port, separated by commas "
                "(redis+sentinel://host1:26379,host2:26379,host3:26379/mymaster/0)"
            )
        found.append((host, int(port)))
    return (userinfo + at), tuple(found)


def _sentinel_url(
    parts: SplitResult, ours: dict[str, str], flags: dict[str, bool], shown: str
) -> tuple[SplitResult, SentinelTarget]:
    """A ``redis+sentinel://[user:password@]host1:26379,host2:26379/service[/db]`` URL: the master's
    URL for redis-py (its host left for the sentinels to say) and where to ask for it."""
    if flags["cluster"]:
        raise ValueError(f"{shown!r}: Sentinel watches one master and its replicas, not a Cluster: drop cluster=true")
    userinfo, sentinels = _sentinel_hosts(parts.netloc, shown)
    service, _, db = parts.path.strip("/").partition("/")
    if not service or "/" in db or (db and not db.isdigit()):
        raise ValueError(
            f"{shown!r}: a Sentinel URL names the master's service and, optionally, a database: "
            "redis+sentinel://host1:26379,host2:26379/mymaster/0"
        )
    options: dict[str, Any] = {}
    if ours.get("sentinel_username"):
        options["username"] = ours["sentinel_username"]
    if ours.get("sentinel_password"):
        options["password"] = ours["sentinel_password"]
    ssl = ours.get("sentinel_ssl", "true" if parts.scheme.lower() == "rediss+sentinel" else "false").lower()
    if ssl not in _TRUE + _FALSE:
        raise ValueError(f"sentinel_ssl={ssl!r} in {shown!r}: use true or false")
    if ssl in _TRUE:
        options["ssl"] = True
    master = parts._replace(
        scheme=_SENTINEL_SCHEMES[parts.scheme.lower()], netloc=f"{userinfo}sentinel-master", path=f"/{db or 0}"
    )
    return master, SentinelTarget(sentinels, unquote(service), options)


def _replicas(ours: dict[str, str], theirs: list[tuple[str, str]], shown: str) -> tuple[int, float]:
    """``replicas=N`` and ``replicas_timeout`` (seconds): how many replicas each write waits for, how long."""
    try:
        replicas = int(ours.get("replicas", "0"))
    except ValueError:
        raise ValueError(f"replicas={ours['replicas']!r} in {shown!r}: give a whole number such as 1") from None
    if not 0 <= replicas <= 100:
        raise ValueError(f"replicas={replicas} in {shown!r}: use 0 (do not wait) to 100")
    try:
        timeout = float(ours.get("replicas_timeout", DEFAULT_REPLICAS_TIMEOUT))
    except ValueError:
        shown_timeout = ours["replicas_timeout"]
        raise ValueError(f"replicas_timeout={shown_timeout!r} in {shown!r}: give seconds, such as 1") from None
    try:
        socket_timeout = float(dict(theirs)["socket_timeout"])
    except ValueError:  # "none" or the like: redis-py reads it, and the connection never times out
        socket_timeout = float("inf")
    if replicas and not 0.001 <= timeout < socket_timeout:
        raise ValueError(
            f"replicas_timeout={timeout:g} in {shown!r}: give 0.001 s or more, and less than socket_timeout "
            f"({socket_timeout:g} s), or the connection times out before the replicas answer"
        )
    return replicas, timeout


def parse_redis_url(url: str) -> tuple[str, dict[str, Any]]:
    """Split ``url`` into the URL redis-py gets and onceonly's own options.

    Onceonly's options: ``prefix`` (key namespace, default ``onceonly``; no braces, no whitespace),
    ``shards`` (default 16), ``warn_persistence`` (default ``true``), ``allow_eviction`` (default
    ``false``: a server whose ``maxmemory-policy`` evicts keys is refused), ``cluster`` (default
    ``false``; ``true``, or the scheme ``redis+cluster://`` / ``rediss+cluster://``, opens a Redis
    Cluster client on the node of the URL, which finds the others), ``replicas`` (default 0: each
    write waits for that many replicas to acknowledge it, ``WAIT``, up to ``replicas_timeout``
    seconds, default 1). ``redis+sentinel://host1:26379,host2:26379/mymaster/0`` (``rediss+sentinel``
    for TLS) asks the sentinels for the master of ``mymaster``; ``sentinel_password``,
    ``sentinel_username`` and ``sentinel_ssl`` are for the sentinels, the URL's user part for the master
    (the returned options' ``sentinel`` then holds a ``SentinelTarget``, and the URL is the master's
    with a placeholder host). Every other query parameter is redis-py's (``socket_timeout``,
    ``socket_connect_timeout``, ``max_connections``, ``client_name``…); the two timeouts default to 5
    seconds here, so that a dead server is reported rather than waited on forever.

    .. versionadded:: 0.1
    """
    parts = urlsplit(url)
    shown = redact_url(url)
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "rediss", "unix", *_CLUSTER_SCHEMES, *_SENTINEL_SCHEMES):
        raise ValueError(
            f"not a Redis URL: {shown!r}: use redis://host:6379/0, rediss://…, unix:///path.sock, "
            "redis+cluster://host:7000 for a Redis Cluster, or redis+sentinel://host1:26379,host2:26379/mymaster "
            "for a master that Redis Sentinel watches"
        )
    ours: dict[str, str] = {}
    theirs: list[tuple[str, str]] = []
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name.lower() in _OURS:
            ours[name.lower()] = value
        else:
            theirs.append((name, value))
    names = {n for n, _ in theirs}
    for name in ("socket_timeout", "socket_connect_timeout"):
        if name not in names:
            theirs.append((name, "5"))
    prefix = ours.get("prefix", DEFAULT_PREFIX)
    if not prefix or any(c in prefix for c in "{}") or not prefix.isprintable() or any(c.isspace() for c in prefix):
        raise ValueError(
            f"prefix={prefix!r} in {shown!r}: a prefix is a non-empty name without braces or whitespace "
            "(braces would move the hash tag that keeps a record and its indexes in one Cluster slot)"
        )
    try:
        shards = int(ours.get("shards", DEFAULT_SHARDS))
    except ValueError:
        raise ValueError(f"shards={ours['shards']!r} in {shown!r}: give a whole number such as 16") from None
    if not 1 <= shards <= MAX_SHARDS:
        raise ValueError(f"shards={shards} in {shown!r}: use 1 to {MAX_SHARDS}")
    flags: dict[str, bool] = {}
    for name, default in (("warn_persistence", "true"), ("allow_eviction", "false"), ("cluster", "false")):
        flag = ours.get(name, default).lower()
        if flag not in _TRUE + _FALSE:
            raise ValueError(f"{name}={flag!r} in {shown!r}: use true or false")
        flags[name] = flag in _TRUE
    replicas, replicas_timeout = _replicas(ours, theirs, shown)
    sentinel: SentinelTarget | None = None
    if scheme in _SENTINEL_SCHEMES:
        parts, sentinel = _sentinel_url(parts, ours, flags, shown)
    elif any(name.startswith("sentinel_") for name in ours):
        raise ValueError(f"{shown!r}: sentinel_* options belong to a redis+sentinel:// URL")
    if scheme in _CLUSTER_SCHEMES:
        if "cluster" in ours and not flags["cluster"]:
            raise ValueError(f"{shown!r} says {scheme}:// and cluster=false: drop one of them")
        flags["cluster"] = True
        parts = parts._replace(scheme=_CLUSTER_SCHEMES[scheme])
    if flags["cluster"]:
        if scheme == "unix":
            raise ValueError(f"{shown!r}: a Redis Cluster is reached over TCP: use redis+cluster://host:port")
        if parts.path.strip("/") not in ("", "0"):
            raise ValueError(
                f"database {parts.path.strip('/')!r} in {shown!r}: a Redis Cluster has database 0 only; give "
                "another prefix= instead"
            )
        parts = parts._replace(path="")
    client_url = urlunsplit(parts._replace(query=urlencode(theirs)))
    return client_url, {
        "prefix": prefix,
        "shards": shards,
        **flags,
        "replicas": replicas,
        "replicas_timeout": replicas_timeout,
        "sentinel": sentinel,
    }


def where(url: str) -> str:
    """The URL without credentials, for messages."""
    parts = urlsplit(url)
    if parts.scheme.lower() in _SENTINEL_SCHEMES:
        hosts = parts.netloc.rpartition("@")[2]
        return f"{parts.scheme}://{hosts}/{parts.path.strip('/').partition('/')[0]}"
    host = parts.hostname or parts.path or "?"
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}"


def sentinel_kwargs(master: dict[str, Any], target: SentinelTarget) -> tuple[dict[str, Any], dict[str, Any]]:
    """redis-py's keywords for a Sentinel: the master's connections (``master``: the master URL's
    ``parse_url``, its placeholder host dropped) and the sentinels' own (their password, TLS, and the
    master's socket timeouts, so that a dead sentinel is reported as fast as a dead master)."""
    kwargs = {k: v for k, v in master.items() if k not in ("host", "port", "path")}
    if kwargs.pop("connection_class", None) is not None:  # rediss+sentinel: the master over TLS
        kwargs["ssl"] = True
    options = {k: v for k, v in kwargs.items() if k.startswith("socket_")} | target.options
    return kwargs, options
