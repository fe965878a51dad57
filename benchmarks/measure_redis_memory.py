"""Redis: the server memory one settled record takes (the record's hash and its index entries).

    python benchmarks/measure_redis_memory.py                     # 10,000 records
    python benchmarks/measure_redis_memory.py --records 100000 --args-chars 500

Starts a redis-server of its own on a free port (nothing else writes to it, so ``used_memory`` moves
only with the ledger), reads ``INFO memory`` after opening the ledger, makes ``--records`` confirmed
records through a guarded tool (its key: the scope, the tool and a sha256; arguments of about ``--args-chars``
characters, a small JSON result, the default 24 h ttl), reads it again, and prints the difference
per record; ``MEMORY USAGE`` of one record's hash beside it (the rest is the shard's index entries
and allocator overhead). The server is stopped and its directory removed.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time

import redis

import onceonly


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--args-chars", type=int, default=100, help="about how long each call's arguments' JSON is")
    args = parser.parse_args()
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("redis-server is not installed")
    workdir = tempfile.mkdtemp(prefix="onceonly-redis-memory-")
    port = _free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(port=port)
        for _ in range(200):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        version = client.info("server")["redis_version"]
        url = f"redis://127.0.0.1:{port}/0?prefix=mem&warn_persistence=false"
        ledger = onceonly.Ledger.open(url)
        pad = "x" * max(0, args.args_chars - 60)

        @ledger.tool(name="create_ticket", key=("session_id", "title"))
        def create_ticket(session_id: str, title: str, body: str) -> dict[str, object]:
            return {"id": title, "status": "open"}

        create_ticket("warm-up", "t", pad)  # the ledger's metadata, scripts and counters exist before "before"
        client.memory_purge()
        before = client.info("memory")["used_memory"]
        for n in range(args.records):
            create_ticket(f"session-{n % 100:03d}", f"Printer on fire, ticket {n:07d}", pad)
        client.memory_purge()
        after = client.info("memory")["used_memory"]
        sample = next(k for k in client.scan_iter(match="mem:*:r:*", count=1000))
        usage = client.memory_usage(sample, samples=0)
        args_json = client.hget(sample, "a") or b""
        ledger.close()
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)
    per = (after - before) / args.records
    print(f"redis {version}: {args.records} confirmed records, arguments' JSON {len(args_json)} bytes each")
    print(f"used_memory before {before}, after {after}: {per:.0f} bytes per record")
    print(f"MEMORY USAGE of one record's hash ({len(sample)}-byte key): {usage} bytes; the rest is its index entries")


if __name__ == "__main__":
    main()
