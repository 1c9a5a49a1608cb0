#!/usr/bin/env python3
"""Does the prefix cache outlive a clean restart? Issue 42's scenario, through the real server.

`sloserve serve` with a host-memory tier over a local-disk tier serves a few multi-turn chats
(ShareGPT first turns, short follow-ups, the model's own greedy answers in the history; several
chats at once through the official `openai` client), gets SIGTERM, and a second `sloserve serve`
on the same disk directory with the disk tier only replays every chat's first turn. Reported per
variant: the share of the replayed prompt tokens served from the cache
(usage.prompt_tokens_details.cached_tokens), and the first server's flush line (how many blocks it
wrote at shutdown, how many it dropped and why). Variants, one after the other:

- disk only (no host tier: the disk takes the device's evictions directly), the reference;
- host + disk served by another checkout (`--before-root`, e.g. the commit before the flush:
  `git archive <commit> | tar -x -C DIR`), both servers;
- host + disk with each `--kv-flush-order` (`off` writes nothing at the stop);
- with a smaller disk (`--small-disk-gib`), each order again: the disk holds only part of what
  the stop owes it, so the order decides which prefixes survive.

The stopped server's device pool is small (`--kv-cache-gib`, 0.05 GiB: ~145 bf16 blocks of the
embedded model) so that the chats' history overflows into host memory, as on a busy server; the
restarted one has the default 1 GiB, so the replay measures what the stop left on disk (with a
small pool, a replay that misses demotes what it computes into a full disk, evicting what later
replays would have found).

    python benchmarks/kv_shutdown_flush.py --chats 12 --turns 3 --before-root /tmp/sloserve-before
Writes benchmarks/results/kv_shutdown_flush-STAMP.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from migration_downtime import cpu_model  # noqa: E402

from sloserve.workload.traces import load_sharegpt, shared_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
FOLLOW_UPS = ["Can you say that more briefly?", "Give me one concrete example.", "What is the main risk here?",
              "How would you explain it to a child?", "Summarise your answer in one line."]
FLUSH_LINE = re.compile(r"KV shutdown flush \(.*")
FOUND_LINE = re.compile(r"disk KV tier .*: (\d+) blocks found")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`sloserve serve` on a free loopback port, its log in a file."""

    def __init__(self, args: list[str], log: Path, threads: int, root: Path = ROOT) -> None:
        self.port = free_port()
        self.log_path = log
        self._log = open(log, "wb")
        cmd = [sys.executable, "-m", "sloserve.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--num-threads", str(threads), "--cache-salt-secret", "kv-shutdown-flush-bench", *args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
        env.pop("SLOSERVE_API_KEY", None)
        self.proc = subprocess.Popen(cmd, cwd=root, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited during start-up:\n{self.log()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError("server not healthy")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 120) -> int:
        """SIGTERM (a clean stop: drain, then the flush) and wait for the exit."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def client_of(port: int):
    """The official client, and the model the server serves."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600, max_retries=0)
    return client, client.models.list().data[0].id


def ask(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0.0)
    details = r.usage.prompt_tokens_details
    return {"text": r.choices[0].message.content, "prompt_tokens": r.usage.prompt_tokens,
            "cached_tokens": (details.cached_tokens if details is not None else 0) or 0}


def run_chats(port: int, firsts: list[str], turns: int, max_tokens: int, concurrency: int) -> list[list[dict]]:
    """Every chat, `turns` turns each, up to `concurrency` chats at once; returns the histories."""
    client, model = client_of(port)

    def chat(c: int) -> list[dict]:
        history: list[dict] = []
        for t in range(turns):
            user = firsts[c] if t == 0 else FOLLOW_UPS[(t + c) % len(FOLLOW_UPS)]
            messages = history + [{"role": "user", "content": user}]
            history = messages + [{"role": "assistant", "content": ask(client, model, messages, max_tokens)["text"]}]
        return history

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(chat, range(len(firsts))))


def replay_first_turns(port: int, firsts: list[str], max_tokens: int, block_size: int = 16) -> dict:
    client, model = client_of(port)
    results = [ask(client, model, [{"role": "user", "content": first}], max_tokens) for first in firsts]
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    # The most a cache can serve: every full block but the one holding the last prompt token.
    best = sum((r["prompt_tokens"] - 1) // block_size * block_size for r in results)
    return {"prompt_tokens": prompt, "cached_tokens": cached, "cached_share": cached / prompt,
            "cacheable_share": best / prompt}


def variant(name: str, first_args: list[str], disk_gib: float, firsts: list[str], args, work: Path,
            root: Path = ROOT) -> dict:
    disk = work / name / "kv"
    disk.mkdir(parents=True)
    common = ["--grace-period", str(args.grace_period)]
    t0 = time.perf_counter()
    first = Server([*common, "--kv-cache-gib", str(args.kv_cache_gib), "--kv-disk-dir", str(disk), "--kv-disk-gib", str(disk_gib), *first_args],
                   work / name / "first.log", args.threads, root)
    try:
        run_chats(first.port, firsts, args.turns, args.max_tokens, args.concurrency)
        stop_t0 = time.perf_counter()
    finally:
        rc = first.stop()
    stop_s = time.perf_counter() - stop_t0
    log = first.log_path.read_text(errors="replace")
    flush = FLUSH_LINE.search(log)
    files = len(list(disk.rglob("*.kv")))
    second = Server([*common, "--kv-cache-gib", str(args.restart_kv_cache_gib), "--kv-disk-dir", str(disk),
                     "--kv-disk-gib", str(disk_gib)],
                    work / name / "second.log", args.threads, root)
    try:
        replay = replay_first_turns(second.port, firsts, args.max_tokens)
    finally:
        second.stop()
    found = FOUND_LINE.search(second.log_path.read_text(errors="replace"))
    out = {"first_server_args": first_args, "server_root": str(root), "disk_gib": disk_gib, "exit_status": rc,
           "sigterm_to_exit_s": round(stop_s, 2), "flush_line": flush.group(0) if flush else None,
           "files_on_disk": files, "blocks_found_on_restart": int(found.group(1)) if found else None,
           **replay, "wall_s": round(time.perf_counter() - t0, 1)}
    print(f"{name:>28}: cached {100 * replay['cached_share']:5.1f}% of {replay['prompt_tokens']} prompt tokens "
          f"(at most {100 * replay['cacheable_share']:.1f}%); "
          f"{files} block files; {out['flush_line'] or 'no flush line'}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chats", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--first-turn-chars", type=int, default=1200, help="ShareGPT first turns cut to this length")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4, help="chats in flight at once")
    ap.add_argument("--kv-cache-gib", type=float, default=0.05, help="the device pool of the server stopped")
    ap.add_argument("--restart-kv-cache-gib", type=float, default=1.0,
                    help="the restarted server's device pool (the default: the replay evicts nothing from it, so "
                         "nothing it computes displaces what the stop left on disk)")
    ap.add_argument("--host-gib", type=float, default=0.25)
    ap.add_argument("--disk-gib", type=float, default=1.0)
    ap.add_argument("--small-disk-gib", type=float, default=0.05,
                    help="also run each order with a disk this small (0: not)")
    ap.add_argument("--before-root", type=Path, default=None,
                    help="a checkout to serve the `before` variant from (its own code, without --kv-flush-order)")
    ap.add_argument("--grace-period", type=float, default=30.0)
    ap.add_argument("--orders", default="off,newest,most-reused", help="the host+disk variants' --kv-flush-order")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    firsts = [r.prompt_text[:args.first_turn_chars] for r in load_sharegpt(shared_path("sharegpt"))
              if r.prompt_text and len(r.prompt_text) > args.first_turn_chars // 2][:args.chats]
    work = Path(tempfile.mkdtemp(prefix="sloserve-flush-bench-"))
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_model(),
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}, "variants": {}}
    host = ["--kv-host-gib", str(args.host_gib)]
    try:
        out["variants"]["disk only"] = variant("disk-only", [], args.disk_gib, firsts, args, work)
        if args.before_root is not None:
            out["variants"]["host+disk, before"] = variant("host-disk-before", host, args.disk_gib, firsts, args,
                                                           work, args.before_root.resolve())
        for order in args.orders.split(","):
            out["variants"][f"host+disk, {order}"] = variant(
                f"host-disk-{order}", [*host, "--kv-flush-order", order], args.disk_gib, firsts, args, work)
        if args.small_disk_gib > 0:
            for order in args.orders.split(","):
                if order == "off":
                    continue
                out["variants"][f"host+small disk, {order}"] = variant(
                    f"host-small-disk-{order}", [*host, "--kv-flush-order", order], args.small_disk_gib, firsts,
                    args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"kv_shutdown_flush-{stamp}.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
