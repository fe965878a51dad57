"""Redis: the guard's per-call cost next to two raw round trips, and next to Powertools' idempotency.

    python benchmarks/bench.py --stores redis                 # the table (bench())
    python benchmarks/bench_redis.py --throughput 8           # 8 processes: guarded vs raw calls/s
    python benchmarks/bench_redis.py --preload 1000000        # per-call cost with 1M records stored
    python benchmarks/bench_redis.py --decompose              # where a first call's time goes, one run
    python benchmarks/bench_redis.py --replicas               # what replicas=1 (WAIT) costs a call, one run

Every contender uses the same redis-py client settings as the store (retries off, 5 s timeouts), the
same server ($ONCEONLY_BENCH_REDIS_URL, default redis://127.0.0.1:6379/0) and does the same work:

- floor: what any Redis ledger pays: a ``SET NX`` of a record-shaped value (the claim) and a ``SET``
  of the settled value (the settle): two round trips, no script, no index.
- the same two ``SET`` sent straight to the connection, as the store sends its scripts (below
  redis-py's ``execute_command``): how much lower the floor is on the store's own path.
- guarded first call / replay: ``@ledger.tool`` on a RedisStore: the claim script (one round trip,
  indexes and counters updated inside), the tool, the settle script.
- Powertools: ``@idempotent_function`` with ``RedisCachePersistenceLayer`` on a client made the same
  way, first call and replay.

Each run uses a prefix of its own (``$ONCEONLY_BENCH_PREFIX_BASE-<random>``, default base
``onceonly-bench``) and deletes what it wrote at the end, also when it fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from _harness import (
    Contender,
    bench_records,
    floor_histories,
    guarded_pair,
    interleave,
    report,
    spawn_rate,
    store_main,
    throughput,
    tool_body,
)

import onceonly
import onceonly.stores.redis as redis_store
from onceonly.stores.redis import RedisStore

URL = os.environ.get("ONCEONLY_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
# Every key a run writes starts with its prefix; the test suite points the base into its own namespace.
PREFIX_BASE = os.environ.get("ONCEONLY_BENCH_PREFIX_BASE", "onceonly-bench")


def _url(prefix: str) -> str:
    sep = "&" if "?" in URL else "?"
    return f"{URL}{sep}prefix={prefix}&warn_persistence=false"


def _claimed(t: float, history: str) -> list[Any]:
    """The fields of a claimed record (as the store's ``d``), for the floors' own writes."""
    return ["default", "bench.tool", "f" * 64, "in_flight", 1, 1, 1, "h:1:1", t + 30, None, None, t, t, None, None,
            history, None, 0]  # fmt: skip


def _settled(i: int, t: float, history: str) -> list[Any]:
    """The fields of the same record settled with call ``i``'s result."""
    return ["default", "bench.tool", "f" * 64, "confirmed", 1, 1, 2, None, None, None, t + 86400, t, t,
            f'{{"ok":true,"i":{i}}}', None, history, "run", 0]  # fmt: skip


def floor(store: RedisStore, prefix: str, *, direct: bool = False) -> Callable[[int], None]:
    """Two raw round trips per call on the store's own client: claim (SET NX), settle (SET).

    ``direct=True`` sends the same two ``SET`` on the path the store's primitives take: straight to
    the connection (``RedisStore._command``), below the Python that ``Redis.execute_command`` wraps
    around every command. The table's ratios are to the redis-py floor (what a user's own Redis code
    would pay); this second floor shows how much of the store's lead is that path, so they read fairly.
    """
    client = store._thread()  # the single-connection client the store's primitives use
    history_1, history_2 = floor_histories()

    def run(i: int) -> None:
        key = f"{prefix}:floor:default:bench.tool:{i:032d}"
        t = time.time()
        args = f'{{"i":{i}}}'
        claim = json.dumps([*_claimed(t, history_1), args])
        if direct:
            store._command("SET", key, claim, "NX")
        else:
            client.set(key, claim, nx=True)
        settled = json.dumps([*_settled(i, t, history_2), args])
        if direct:
            store._command("SET", key, settled)
        else:
            client.set(key, settled)

    return run


def powertools(prefix: str) -> tuple[Callable[[int], object], Callable[[int], object]]:
    """Powertools' idempotent function on Redis: (first call, replay)."""
    import warnings

    import redis
    from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
    from aws_lambda_powertools.utilities.idempotency.persistence.redis import RedisCachePersistenceLayer

    client = redis.Redis.from_url(
        URL, retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0), socket_timeout=5, single_connection_client=True
    )
    layer = RedisCachePersistenceLayer(client=client)  # type: ignore[arg-type]  # its protocol is narrower than redis-py's stubs
    config = IdempotencyConfig(expires_after_seconds=86400)
    # Outside Lambda it warns on every call that it cannot tell the remaining time; not our concern.
    warnings.filterwarnings("ignore", message="Couldn't determine the remaining time left")

    @idempotent_function(data_keyword_argument="order", persistence_store=layer, config=config, key_prefix=prefix)  # type: ignore[untyped-decorator]
    def tool(order: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "i": order["i"]}

    done: list[int] = []

    def first(i: int) -> object:
        out = tool(order={"i": i, "run": prefix})
        done.append(i)
        return out

    def replay(i: int) -> object:
        return tool(order={"i": done[i % len(done)], "run": prefix})

    first(0)
    return first, replay


def _cleanup(prefix: str) -> None:
    """Delete what this run wrote (benchmark clean-up only; the store itself never scans).

    One pattern covers it all: the store's keys, the floors' and the stripped ledgers' start with the
    prefix, and Powertools' are ``key_prefix#hash`` (and ``…:lock``) with the prefix as ``key_prefix``.
    """
    import redis

    client = redis.Redis.from_url(URL)
    try:
        batch = list(client.scan_iter(match=f"{prefix}*", count=1000))
        for i in range(0, len(batch), 500):
            client.delete(*batch[i : i + 500])
    finally:
        client.close()


@contextmanager
def _run_prefix() -> Iterator[str]:
    """A fresh key prefix for one run; what was written under it is deleted at the end, also on failure.

    Open the run's ledgers inside it: opening one already writes (``P:meta``).
    """
    prefix = f"{PREFIX_BASE}-{uuid.uuid4().hex[:8]}"
    try:
        yield prefix
    except BaseException:
        try:
            _cleanup(prefix)
        except Exception as exc:  # the run's own error is the one to see; say what was left behind
            print(f"redis: the keys under {prefix}* were not deleted ({type(exc).__name__}: {exc})", file=sys.stderr)
        raise
    _cleanup(prefix)


def bench(rounds: int, batch: int, workdir: Path) -> list[dict[str, object]]:
    with _run_prefix() as prefix, onceonly.Ledger.open(_url(prefix)) as ledger:
        store = ledger.store
        assert isinstance(store, RedisStore)
        first, replay = guarded_pair(ledger.tool(name="bench.tool")(tool_body))
        contenders = [
            Contender("bare tool", tool_body),
            Contender("floor: 2 raw round trips", floor(store, prefix)),
            Contender("same 2 SET below redis-py's client", floor(store, f"{prefix}:direct", direct=True)),
            first,
            replay,
        ]
        pt_first: Contender | None = None
        try:
            pt_call, pt_replay = powertools(prefix)
            pt_first = Contender("powertools first call", pt_call)
            contenders += [pt_first, Contender("powertools replay", pt_replay)]
        except ImportError as exc:
            print(f"redis: Powertools not installed ({exc}): pip install 'aws-lambda-powertools[redis]'",
                  file=sys.stderr)  # fmt: skip
        interleave(contenders, rounds, batch)
    rows = report("redis", contenders)
    if pt_first is not None:
        # Like every ratio in the table: the median of the per-round ratios, not a ratio of medians.
        ratio = statistics.median(g / p for g, p in zip(first.per_call, pt_first.per_call, strict=True))
        print(f"redis: guarded first call / Powertools first call = {ratio:.2f}")
    return rows


# --- opt-in: throughput with 8 processes, and the cost with a million records stored ------------------


_PREFIX_ENV = "ONCEONLY_BENCH_PREFIX"


def _make_call(kind: str, worker: int) -> Callable[[int], object]:
    """In a worker process: a guarded first call, or the floor's two raw round trips, on this round's prefix
    (keys of this process's own: every call is a first call, also on a prefix that earlier rounds used)."""
    prefix = os.environ[_PREFIX_ENV]
    store = RedisStore(_url(prefix))
    own = uuid.uuid4().hex[:8]
    if kind == "guarded":
        guarded: Callable[[int], object] = onceonly.Ledger(store).tool(name=f"bench.tool.{own}")(tool_body)
        return guarded
    return floor(store, f"{prefix}:{worker}:{own}")


def throughput_table(processes: int, seconds: float, rounds: int) -> dict[str, float]:
    """Calls per second of ``processes`` processes on one ledger: guarded first calls vs the floor."""

    def rate(kind: str) -> float:
        with _run_prefix() as prefix:  # fresh keys every round
            os.environ[_PREFIX_ENV] = prefix
            return spawn_rate(_make_call, kind, processes, seconds)

    return throughput(rate, "redis", processes, seconds, rounds)


def fill(store: RedisStore, records: int, tool: str = "preload") -> None:
    """``records`` confirmed records, each written by the store's own claim script (its indexes and
    counters with it), pipelined 2000 at a time; keys spread in key order."""
    import dataclasses

    from onceonly.stores.redis import _claim_args

    template = bench_records('{"i":0}', '{"ok":true,"i":0}')[1]
    template = dataclasses.replace(template, tool=tool, scope="default")
    chunk = 2000
    for base in range(0, records, chunk):
        pipe = store._client.pipeline(transaction=False)
        for i in range(base, min(base + chunk, records)):
            digest = hashlib.sha256(str(i).encode()).hexdigest()
            rec = dataclasses.replace(template, key=f"default:{tool}:{digest[:32]}", fingerprint=digest,
                                      args_json=f'{{"i":{i}}}', result_json=f'{{"ok":true,"i":{i}}}')  # fmt: skip
            store._claim(store._keys(rec.key), _claim_args(rec), client=pipe)
        pipe.execute()


def preload(records: int, rounds: int, batch: int) -> list[dict[str, object]]:
    """Per-call cost with ``records`` confirmed records already stored (loaded by pipelined claims)."""
    with _run_prefix() as prefix, onceonly.Ledger.open(_url(prefix)) as ledger:
        store = ledger.store
        assert isinstance(store, RedisStore)
        started = time.monotonic()
        fill(store, records)
        print(f"redis: {records} records loaded in {time.monotonic() - started:.0f}s", file=sys.stderr)
        first, replay = guarded_pair(ledger.tool(name="bench.tool")(tool_body))
        first.name, replay.name = f"guarded first call, {records} stored", f"replay, {records} stored"
        contenders = [Contender("floor: 2 raw round trips", floor(store, prefix)), first, replay]
        interleave(contenders, rounds, batch)
    return report("redis", contenders)


# --- opt-in: where a first call's time goes -------------------------------------------------------

# The store's own scripts with parts taken out, to measure what each part costs. Not ledgers: without
# the all-keys index `ls` misses records, without the counters `stats` is wrong, without any index the
# reconciler and purge find nothing. They exist only for the rows of --decompose.
_ALL_KEYS = "redis.call('ZADD', KEYS[2], 0, key)"
_COUNTERS = ("if old then redis.call('HINCRBY', KEYS[6], old, -1) end", "redis.call('HINCRBY', KEYS[6], new, 1)")
_STRIPPED: dict[str, dict[str, tuple[str, ...]]] = {
    # The record's compare-and-set alone: the least a ledger with one script per transition does.
    "record only": {
        "claim": ("reindex(false, s, lease, expiry)", _ALL_KEYS),
        "swap": ("reindex(cur[2], s, lease, expiry)", "changed(v)\n"),
    },
    # What the reconciler and waiters need (unknown, held-by-lease and expiry indexes, change notification),
    # without the all-keys index behind `ls` and the per-state counters behind `stats`.
    "reconciler's indexes": {"claim": (_ALL_KEYS, *_COUNTERS), "swap": _COUNTERS},
}


def _stripped(script: str, variant: str, part: str) -> str:
    for line in _STRIPPED[variant][part]:
        assert line in script, f"the store's {part} script changed: update _STRIPPED ({line!r})"
        script = script.replace(line, "")
    return script


def _strip(ledger: onceonly.Ledger, variant: str) -> onceonly.Ledger:
    """``ledger`` with its claim and settle scripts stripped of ``variant``'s parts (measurement only).

    The server loads them on their first run (the store's NOSCRIPT path), in guarded_pair's warm-up.
    """
    store = ledger.store
    assert isinstance(store, RedisStore)
    store._claim = store._client.register_script(_stripped(redis_store._CLAIM, variant, "claim"))
    store._swap = store._client.register_script(_stripped(redis_store._SWAP, variant, "swap"))
    return ledger


def scripts_floor(store: RedisStore, prefix: str) -> Callable[[int], None]:
    """Two minimal Lua scripts per call, sent the store's way: read-check-write of one record, no index.

    The claim reads the record and writes it if absent; the settle checks the version and writes it:
    the floor's two writes, each made atomic by a script, which is what one script per transition costs
    before anything is indexed.
    """
    claim = (
        "local c = redis.call('HMGET', KEYS[1], 'd', 'a') if c[1] then return c end "
        "redis.call('HSET', KEYS[1], 'v', '1', 's', 'in_flight', 'd', ARGV[1], 'a', ARGV[2]) return 1"
    )
    swap = (
        "if redis.call('HGET', KEYS[1], 'v') ~= ARGV[2] then return 0 end "
        "redis.call('HSET', KEYS[1], 'v', '2', 's', 'confirmed', 'd', ARGV[1]) return 1"
    )
    claim_sha, swap_sha = (store._command("SCRIPT", "LOAD", text).decode() for text in (claim, swap))
    history_1, history_2 = floor_histories()

    def run(i: int) -> None:
        key = f"{prefix}:{{t}}:r:default:bench.tool:{i:032d}"
        t = time.time()
        store._command("EVALSHA", claim_sha, 1, key, json.dumps(_claimed(t, history_1)), f'{{"i":{i}}}')
        store._command("EVALSHA", swap_sha, 1, key, json.dumps(_settled(i, t, history_2)), "1")

    return run


def store_scripts(store: RedisStore, prefix: str) -> Callable[[int], None]:
    """The store's own claim and settle scripts, all indexes kept, with no guard around them: the
    arguments of one claimed and one settled record are built once (the stored value holds no key, so
    it fits every key), and each call sends only the two ``EVALSHA``. What the scripts cost on the
    wire and in the server, before any of the guard's or the store's Python."""
    claimed, settled = bench_records('{"i":0}', '{"ok":true,"i":0}')
    claim_args = redis_store._claim_args(claimed)
    swap_args = redis_store._swap_args(settled, claimed)
    claim, swap = store._claim, store._swap

    def run(i: int) -> None:
        keys = store._keys(f"default:bench.tool:{i:032d}")
        store._script(claim, keys, claim_args)
        store._script(swap, keys, swap_args)

    return run


def guard_on_floor(store: RedisStore, prefix: str, ledgers: ExitStack) -> Callable[[int], object]:
    """The guard's own Python on the floor's path: ``@ledger.tool`` on bench_guard's in-memory dict,
    whose claim and settle each also send the floor's ``SET`` below redis-py. What the guard's Python
    costs in place, between blocking round trips, where it runs several times slower than in
    bench_guard's tight loop (caches gone cold while the process waited)."""
    from bench_guard import DictStore

    history_1, history_2 = floor_histories()

    class OnFloor(DictStore):
        def claim(self, record: onceonly.Record) -> onceonly.Record | None:
            t = time.time()
            store._command("SET", f"{prefix}:g:{record.key}", json.dumps([*_claimed(t, history_1), "{}"]), "NX")
            return super().claim(record)

        def swap(self, record: onceonly.Record, expected: onceonly.Record) -> bool:
            t = time.time()
            store._command("SET", f"{prefix}:g:{record.key}", json.dumps([*_settled(0, t, history_2), "{}"]))
            return super().swap(record, expected)

    ledger = ledgers.enter_context(onceonly.Ledger(OnFloor()))
    return guarded_pair(ledger.tool(name="bench.tool")(tool_body))[0].run


def decompose(rounds: int, batch: int) -> list[dict[str, object]]:
    """One run, eight contenders: the floor, the floor below redis-py, two minimal scripts; the guard's
    Python alone on the floor's path and the store's scripts alone (each one half of a guarded call);
    then the guarded call on scripts that keep no index, on scripts that keep only the indexes the
    reconciler needs, and the guarded call."""
    with _run_prefix() as prefix, ExitStack() as ledgers:  # the ledgers close before the keys go
        ledger = ledgers.enter_context(onceonly.Ledger.open(_url(prefix)))
        stripped = [
            (_strip(ledgers.enter_context(onceonly.Ledger.open(_url(f"{prefix}-bare"))), "record only"),
             "guarded first call, scripts without indexes"),
            (_strip(ledgers.enter_context(onceonly.Ledger.open(_url(f"{prefix}-reconciler"))), "reconciler's indexes"),
             "guarded, no all-keys index, no counters"),
        ]  # fmt: skip
        store = ledger.store
        assert isinstance(store, RedisStore)
        contenders = [
            Contender("floor: 2 raw round trips", floor(store, prefix)),
            Contender("same 2 SET below redis-py's client", floor(store, f"{prefix}:direct", direct=True)),
            Contender("2 minimal scripts (record only)", scripts_floor(store, prefix)),
            Contender("the guard's Python on a dict + the same 2 SET", guard_on_floor(store, prefix, ledgers)),
            Contender("the store's 2 scripts, no guard", store_scripts(store, prefix)),
        ]
        for other, name in stripped:
            first, _ = guarded_pair(other.tool(name="bench.tool")(tool_body))
            first.name = name
            contenders.append(first)
        contenders.append(guarded_pair(ledger.tool(name="bench.tool")(tool_body))[0])
        interleave(contenders, rounds, batch)
    return report("redis", contenders)


@contextmanager
def _master_and_replica(workdir: Path) -> Iterator[str]:
    """A private master and one replica of it (``redis-server`` on free ports, persisting nothing), stopped
    by PID: the URL of the master. The shared server is left alone (it may have no replica)."""
    import socket
    import subprocess

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        return port

    def ask(port: int, *command: str) -> str:
        out = subprocess.run(["redis-cli", "-p", str(port), *command], capture_output=True, timeout=10, check=False)
        return out.stdout.decode()

    master, replica = free_port(), free_port()
    procs = []
    try:
        for port, extra in ((master, ()), (replica, ("--replicaof", "127.0.0.1", str(master)))):
            procs.append(
                subprocess.Popen(
                    [
                        "redis-server",
                        "--port",
                        str(port),
                        "--bind",
                        "127.0.0.1",
                        "--save",
                        "",
                        "--appendonly",
                        "no",
                        "--dir",
                        str(workdir),
                        "--dbfilename",
                        f"{port}.rdb",
                        *extra,
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = time.monotonic() + 20
        while "state=online" not in ask(master, "INFO", "replication"):
            if time.monotonic() > deadline:
                raise SystemExit("the private replica did not come online within 20 s")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{master}/0"
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def replicas_cost(rounds: int, batch: int) -> list[dict[str, object]]:
    """One run on a private master with one replica: a guarded first call and a replay on a plain URL and
    on ``replicas=1`` (each write followed by a barrier write and ``WAIT 1``, in the same packet)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="onceonly-bench-") as tmp, _master_and_replica(Path(tmp)) as url:
        plain = onceonly.Ledger.open(f"{url}?prefix=plain&warn_persistence=false")
        waited = onceonly.Ledger.open(f"{url}?prefix=waited&warn_persistence=false&replicas=1")
        store = plain.store
        assert isinstance(store, RedisStore)
        first, replay = guarded_pair(plain.tool(name="bench.tool")(tool_body))
        w_first, w_replay = guarded_pair(waited.tool(name="bench.tool")(tool_body))
        w_first.name, w_replay.name = "guarded first call, replicas=1", "replay, replicas=1"
        contenders = [Contender("floor: 2 raw round trips", floor(store, "floor")), first, w_first, replay, w_replay]
        interleave(contenders, rounds, batch)
        plain.close()
        waited.close()
    rows = report("redis", contenders)
    for name, base, other in (("first call", first, w_first), ("replay", replay, w_replay)):
        ratio = statistics.median(w / p for w, p in zip(other.per_call, base.per_call, strict=True))
        print(f"redis: {name} with replicas=1 / without = {ratio:.2f}")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if "--replicas" in args:
        import argparse

        parser = argparse.ArgumentParser(description="what replicas=1 costs a guarded call")
        parser.add_argument("--replicas", action="store_true")
        parser.add_argument("--rounds", type=int, default=30)
        parser.add_argument("--batch", type=int, default=200)
        parsed = parser.parse_args(args)
        replicas_cost(parsed.rounds, parsed.batch)
        return 0
    return store_main(argv, __doc__, bench, throughput_table, preload, decompose)


if __name__ == "__main__":
    sys.exit(main())
