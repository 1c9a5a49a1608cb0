#!/usr/bin/env python3
"""/health and /metrics latency while hostile clients send huge prompts, at the single server and
at the multi-instance front, for this checkout and (optionally) an earlier revision, in
interleaved rounds on the same cores.

Each round starts the server (`sloserve serve`, one torch thread; `--instances 2` for the
front), polls GET /health then GET /metrics every 20 ms, and after half a second lets
`--clients` clients each POST one completion whose prompt is `--prompt-bytes` of text (the
issue's case: three 3.8 MB prompts, ~1.5M tokens each, far past the context window). Reported
per target and source: the clients' wall time and statuses, and the probe latencies (p50, p99,
max). Nothing else should run meanwhile (two cores).

    .venv/bin/python benchmarks/front_health.py --baseline d81e02c --rounds 3   # ~10 minutes on 2 cores

Output: a table, benchmarks/results/front_health-STAMP.json and benchmarks/figures/front_health.png.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

from figure import save  # noqa: E402
from offline_throughput import machine_info  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(source: Path, instances: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sloserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--num-threads", "1", "--log-level", "warning"]
    if instances > 1:
        cmd += ["--instances", str(instances)]
    env = {**os.environ, "PYTHONPATH": str(source), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=source, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited during start-up: {log.read_text()[-2000:]}")
        try:
            health = httpx.get(base + "/health", timeout=2).json()
            if health.get("status") == "ok" and health.get("healthy_instances", instances) == instances:
                return proc, base
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.3)
    proc.kill()
    raise TimeoutError("server not ready in 300 s")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


async def probe(base: str, clients: int, prompt: str) -> dict:
    health: list[float] = []
    metrics: list[float] = []
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        async def poll() -> None:
            while not done.is_set():
                t = time.perf_counter()
                r = await client.get("/health")
                health.append(time.perf_counter() - t)
                assert r.status_code == 200, r.text
                t = time.perf_counter()
                r = await client.get("/metrics")
                metrics.append(time.perf_counter() - t)
                await asyncio.sleep(0.02)

        async def hostile() -> int:
            r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            return r.status_code

        poller = asyncio.create_task(poll())
        await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        statuses = await asyncio.gather(*(hostile() for _ in range(clients)))
        wall = time.perf_counter() - t0
        await asyncio.sleep(0.3)
        done.set()
        await poller

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1e3

    return {"statuses": statuses, "clients_wall_s": wall, "polls": len(health),
            "health_ms": {"p50": statistics.median(health) * 1e3, "p99": q(health, 0.99), "max": max(health) * 1e3},
            "metrics_ms": {"p50": statistics.median(metrics) * 1e3, "p99": q(metrics, 0.99),
                           "max": max(metrics) * 1e3}}


def worktree(rev: str) -> Path:
    path = Path("/tmp") / f"sloserve-{rev}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=REPO, check=True,
                       capture_output=True)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", help="a git revision to measure beside this checkout (a worktree under /tmp)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--prompt-bytes", type=int, default=3_800_000)
    ap.add_argument("--targets", default="single,front")
    args = ap.parse_args()
    sources = {"this checkout": REPO}
    if args.baseline:
        sources[f"baseline {args.baseline}"] = worktree(args.baseline)
    targets = {"single": 1, "front": 2}
    chosen = [t for t in args.targets.split(",") if t]
    prompt = ("lorem ipsum dolor sit amet " * (args.prompt_bytes // 27 + 1))[:args.prompt_bytes]
    out_dir = REPO / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    runs: list[dict] = []
    console = Console()
    with Progress(console=console) as progress:
        task = progress.add_task("rounds", total=args.rounds * len(sources) * len(chosen))
        for r in range(args.rounds):
            order = list(sources.items())
            if r % 2:
                order.reverse()  # alternate which source goes first
            for target in chosen:
                for name, source in order:
                    proc, base = start(source, targets[target], out_dir / f"front_health-{stamp}-server.log")
                    try:
                        result = asyncio.run(probe(base, args.clients, prompt))
                    finally:
                        stop(proc)
                    runs.append({"round": r, "target": target, "source": name, **result})
                    progress.advance(task)

    table = Table(title=f"/health and /metrics with {args.clients} x {args.prompt_bytes:,}-byte prompts in flight "
                        f"(median of {args.rounds} rounds; max = largest of any round)")
    for col in ("target", "source", "statuses", "clients s", "health p50 ms", "health p99 ms", "health max ms",
                "metrics p99 ms", "metrics max ms"):
        table.add_column(col)
    summary = []
    for target in chosen:
        for name in sources:
            mine = [x for x in runs if x["target"] == target and x["source"] == name]
            row = {"target": target, "source": name, "statuses": sorted({s for x in mine for s in x["statuses"]}),
                   "clients_wall_s": statistics.median(x["clients_wall_s"] for x in mine),
                   "health_p50_ms": statistics.median(x["health_ms"]["p50"] for x in mine),
                   "health_p99_ms": statistics.median(x["health_ms"]["p99"] for x in mine),
                   "health_max_ms": max(x["health_ms"]["max"] for x in mine),
                   "metrics_p99_ms": statistics.median(x["metrics_ms"]["p99"] for x in mine),
                   "metrics_max_ms": max(x["metrics_ms"]["max"] for x in mine)}
            summary.append(row)
            table.add_row(target, name, str(row["statuses"]), f"{row['clients_wall_s']:.1f}",
                          f"{row['health_p50_ms']:.1f}", f"{row['health_p99_ms']:.1f}", f"{row['health_max_ms']:.0f}",
                          f"{row['metrics_p99_ms']:.1f}", f"{row['metrics_max_ms']:.0f}")
    console.print(table)
    info = machine_info()
    path = out_dir / f"front_health-{stamp}.json"
    path.write_text(json.dumps({"args": vars(args), "machine": info, "summary": summary, "runs": runs}, indent=1))
    console.print(f"wrote {path}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{row['target']}\n{row['source']}" for row in summary]
    xs = range(len(summary))
    ax.bar([x - 0.2 for x in xs], [row["health_p99_ms"] for row in summary], 0.4, label="/health p99 (median of rounds)")
    ax.bar([x + 0.2 for x in xs], [row["health_max_ms"] for row in summary], 0.4, label="/health max (any round)")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    save(fig, REPO / "benchmarks" / "figures" / "front_health.png",
         f"/health while {args.clients} clients send {args.prompt_bytes / 1e6:.1f} MB prompts ({info['cpu']})")


if __name__ == "__main__":
    main()
