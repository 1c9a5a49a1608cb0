#!/usr/bin/env python3
"""/health and /metrics latency, and the workers' /internal/state as their front polls it, while
hostile clients send huge bodies, at the single server and at the multi-instance front, for this
checkout and (optionally) an earlier revision, in interleaved rounds on the same cores.

Each round starts the server (`sloserve serve`, one torch thread; `--instances 2` for the
front), polls GET /health then GET /metrics every 20 ms (and, behind a front, each worker's GET
/internal/state every 20 ms, as the front's own poll does, with the fleet's secret read from the
worker's environment), and after half a second lets `--clients` clients each POST one body of
about `--prompt-bytes` bytes, in each shape of `--shapes`: `text`, a completion whose prompt is
that much text (three 3.8 MB prompts, ~1.5M tokens each, far past the context window), and
`conversation`, a chat call of ~90,000 short turns (what costs a server the most Python per
byte: every turn validated, then rendered). Reported per target, shape and source: the
clients' wall time and statuses, and the probe latencies (p50, p99, max). Nothing else should
run meanwhile (two cores).

    .venv/bin/python benchmarks/front_health.py --baseline 8184ec4 --rounds 2   # ~10 minutes on 2 cores

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

from sloserve.workers.contract import FLEET_SECRET_ENV, FLEET_SECRET_HEADER  # noqa: E402


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


def hostile_call(shape: str, nbytes: int) -> tuple[str, bytes]:
    """(path, JSON body) of one hostile client's call, about `nbytes` long."""
    if shape == "text":
        prompt = ("lorem ipsum dolor sit amet " * (nbytes // 27 + 1))[:nbytes]
        return "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    if shape == "conversation":
        turn = {"role": "user", "content": "hi there "}
        turns = nbytes // len(json.dumps(turn))
        return "/v1/chat/completions", json.dumps({"messages": [turn] * turns, "max_tokens": 1}).encode()
    raise SystemExit(f"unknown shape {shape!r}: text or conversation")


def fleet_secret(pid: int) -> str:
    """The fleet's secret, from a worker's environment as its front started it (Linux)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    prefix = FLEET_SECRET_ENV.encode() + b"="
    return next(v[len(prefix):].decode() for v in environ if v.startswith(prefix))


async def probe(base: str, clients: int, call: tuple[str, bytes]) -> dict:
    health: list[float] = []
    metrics: list[float] = []
    state: list[float] = []
    done = asyncio.Event()
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        workers = []
        listed = await client.get("/v1/instances")
        if listed.status_code == 200:  # a front: poll its workers' state as it does
            workers = [(w["url"], fleet_secret(w["pid"])) for w in listed.json()["data"]]

        async def poll_state(url: str, secret: str) -> None:
            async with httpx.AsyncClient(timeout=600, headers={FLEET_SECRET_HEADER: secret}) as worker:
                while not done.is_set():
                    t = time.perf_counter()
                    r = await worker.get(url + "/internal/state")
                    state.append(time.perf_counter() - t)
                    assert r.status_code == 200, r.text
                    await asyncio.sleep(0.02)

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
            path, body = call
            r = await client.post(path, content=body, headers={"Content-Type": "application/json"})
            return r.status_code

        pollers = [asyncio.create_task(poll())] + [asyncio.create_task(poll_state(*w)) for w in workers]
        await asyncio.sleep(0.5)
        t0 = time.perf_counter()
        statuses = await asyncio.gather(*(hostile() for _ in range(clients)))
        wall = time.perf_counter() - t0
        await asyncio.sleep(0.3)
        done.set()
        await asyncio.gather(*pollers)

    def q(xs: list[float], p: float) -> float:
        return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] * 1e3

    return {"statuses": statuses, "clients_wall_s": wall, "polls": len(health),
            "health_ms": {"p50": statistics.median(health) * 1e3, "p99": q(health, 0.99), "max": max(health) * 1e3},
            "metrics_ms": {"p50": statistics.median(metrics) * 1e3, "p99": q(metrics, 0.99),
                           "max": max(metrics) * 1e3},
            "state_ms": None if not state else {"p50": statistics.median(state) * 1e3, "p99": q(state, 0.99),
                                                "max": max(state) * 1e3}}


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
    ap.add_argument("--shapes", default="text,conversation", help="hostile bodies: text, conversation")
    args = ap.parse_args()
    sources = {"this checkout": REPO}
    if args.baseline:
        sources[f"baseline {args.baseline}"] = worktree(args.baseline)
    targets = {"single": 1, "front": 2}
    chosen = [t for t in args.targets.split(",") if t]
    shapes = [x for x in args.shapes.split(",") if x]
    calls = {shape: hostile_call(shape, args.prompt_bytes) for shape in shapes}
    out_dir = REPO / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    runs: list[dict] = []
    console = Console()
    with Progress(console=console) as progress:
        task = progress.add_task("rounds", total=args.rounds * len(sources) * len(chosen) * len(shapes))
        for r in range(args.rounds):
            order = list(sources.items())
            if r % 2:
                order.reverse()  # alternate which source goes first
            for target in chosen:
                for shape in shapes:
                    for name, source in order:
                        proc, base = start(source, targets[target], out_dir / f"front_health-{stamp}-server.log")
                        try:
                            result = asyncio.run(probe(base, args.clients, calls[shape]))
                        finally:
                            stop(proc)
                        runs.append({"round": r, "target": target, "shape": shape, "source": name, **result})
                        progress.advance(task)

    table = Table(title=f"/health, /metrics and the workers' /internal/state with {args.clients} hostile bodies of "
                        f"~{args.prompt_bytes:,} bytes in flight (median of {args.rounds} rounds; max = largest of "
                        "any)")
    for col in ("target", "shape", "source", "statuses", "clients s", "health p99 ms", "health max ms",
                "metrics max ms", "state p99 ms", "state max ms"):
        table.add_column(col)
    summary = []
    for target in chosen:
        for shape in shapes:
            for name in sources:
                mine = [x for x in runs if x["target"] == target and x["shape"] == shape and x["source"] == name]
                states = [x["state_ms"] for x in mine if x["state_ms"]]
                row = {"target": target, "shape": shape, "source": name,
                       "statuses": sorted({s for x in mine for s in x["statuses"]}),
                       "clients_wall_s": statistics.median(x["clients_wall_s"] for x in mine),
                       "health_p50_ms": statistics.median(x["health_ms"]["p50"] for x in mine),
                       "health_p99_ms": statistics.median(x["health_ms"]["p99"] for x in mine),
                       "health_max_ms": max(x["health_ms"]["max"] for x in mine),
                       "metrics_p99_ms": statistics.median(x["metrics_ms"]["p99"] for x in mine),
                       "metrics_max_ms": max(x["metrics_ms"]["max"] for x in mine),
                       "state_p99_ms": statistics.median(x["p99"] for x in states) if states else None,
                       "state_max_ms": max(x["max"] for x in states) if states else None}
                summary.append(row)
                table.add_row(target, shape, name, str(row["statuses"]), f"{row['clients_wall_s']:.1f}",
                              f"{row['health_p99_ms']:.1f}", f"{row['health_max_ms']:.0f}",
                              f"{row['metrics_max_ms']:.0f}",
                              "-" if not states else f"{row['state_p99_ms']:.1f}",
                              "-" if not states else f"{row['state_max_ms']:.0f}")
    console.print(table)
    info = machine_info()
    path = out_dir / f"front_health-{stamp}.json"
    path.write_text(json.dumps({"args": vars(args), "machine": info, "summary": summary, "runs": runs}, indent=1))
    console.print(f"wrote {path}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, (key, what) in zip(axes, (("health_max_ms", "/health (the server or front)"),
                                      ("state_max_ms", "a worker's /internal/state (behind a front)"))):
        rows = [row for row in summary if row[key] is not None]
        labels = [f"{row['target']} {row['shape']}\n{row['source']}" for row in rows]
        ax.bar(range(len(rows)), [row[key] for row in rows], color=["C0" if "checkout" in row["source"] else "C1"
                                                                    for row in rows])
        ax.set_xticks(range(len(rows)), labels, fontsize=8, rotation=30, ha="right")
        ax.set_title(f"slowest {what}", fontsize=10)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("ms (max over rounds)")
    save(fig, REPO / "benchmarks" / "figures" / "front_health.png",
         f"while {args.clients} clients send ~{args.prompt_bytes / 1e6:.1f} MB bodies ({info['cpu']})")

if __name__ == "__main__":
    main()
