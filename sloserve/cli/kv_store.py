"""`sloserve kv-store`: run the fleet's shared KV tier (a Valkey or Redis server) in the foreground.

The server is started the way the shared tier needs it: bound to one address, its memory
bounded with LRU eviction over every key (a cache, not a database), no snapshots or append-only
file. Instances reach it with `sloserve serve --kv-store redis://HOST:PORT/0`.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Optional

SERVERS = ("valkey-server", "redis-server")


def server_command(binary: str, host: str, port: int, max_memory_gib: float) -> list[str]:
    return [binary, "--bind", host, "--port", str(port), "--maxmemory", f"{int(max_memory_gib * 2**30)}",
            "--maxmemory-policy", "allkeys-lru", "--save", "", "--appendonly", "no", "--daemonize", "no"]


def find_server(explicit: str | None = None) -> str:
    for name in ([explicit] if explicit else SERVERS):
        path = shutil.which(name)
        if path:
            return path
    raise ValueError("no valkey-server or redis-server on PATH: `make install` installs redis-server "
                     "(or apt-get install redis-server)")


def cmd_kv_store(args: argparse.Namespace) -> int:
    if not args.max_memory_gib > 0:
        raise ValueError(f"--max-memory-gib must be > 0, got {args.max_memory_gib}")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    cmd = server_command(find_server(args.server), args.host, args.port, args.max_memory_gib)
    print(f"shared KV store on redis://{args.host}:{args.port}/0 ({args.max_memory_gib:g} GiB, LRU)", flush=True)
    os.execv(cmd[0], cmd)
    return 0  # not reached


def add_kv_store_parser(sub) -> None:
    p = sub.add_parser("kv-store", help="run the fleet's shared KV tier (Valkey/Redis) in the foreground")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=6379)
    p.add_argument("--max-memory-gib", type=float, default=4.0, help="memory bound; least recently used blocks go first")
    p.add_argument("--server", default=None, help="server binary (default: valkey-server, else redis-server)")
    p.set_defaults(func=cmd_kv_store)


@dataclass
class RunningKVStore:
    """A `sloserve kv-store` started in the background (tests, benchmarks)."""

    proc: subprocess.Popen
    url: str

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def start_kv_store(max_memory_gib: float = 0.25, port: Optional[int] = None, timeout_s: float = 10.0) -> RunningKVStore:
    """Run `sloserve kv-store` on loopback (a free port unless given) and wait until it answers."""
    import redis

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "sloserve.cli", "kv-store", "--port", str(port),
                             "--max-memory-gib", str(max_memory_gib)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            client.ping()
            return RunningKVStore(proc, url)
        except redis.exceptions.ConnectionError:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"sloserve kv-store did not start: {proc.communicate()[1].decode(errors='replace')[-500:]}")
