#!/usr/bin/env python3
"""Live migration between two real workers: downtime and copy rate against context length.

`sloserve serve --instances 2` (embedded model, one thread per worker) on a free 127.0.0.1
port. For each context length, a streamed completion whose prompt is that many random token
ids (a fresh prompt every run, so no prefix cache shortens the copy) is moved to the other
worker after its 4th token, by the admin API, once with live pre-copy (the request keeps
decoding while its full blocks are copied; only the last blocks move while it is paused) and
once with stop-and-copy (paused for the whole copy: the baseline). Per run:

  downtime   the request was paused: the source's stop-and-copy until the target's first token
  copy       the whole copy, pre-copy rounds included
  bytes      KV bytes sent;  rate = bytes / copy
  gap        the largest gap between two tokens the client saw around the move (its view)

Every run must also give the client exactly the tokens of the same prompt unmoved (checked on
the greedy text). Output: a table, benchmarks/results/migration-downtime-STAMP.json and
benchmarks/figures/migration_downtime.png.

    python benchmarks/migration_downtime.py                 # 256 .. 8000 tokens, 2 runs each (~10 min)
    python benchmarks/migration_downtime.py --lengths 256 1024 --runs 1
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from figure import measured_ticks, save  # noqa: E402
from sloserve.bench.local_server import LocalServer  # noqa: E402

ADMIN = "bench-admin"
MODES = ("pre-copy", "stop-and-copy")
MAX_TOKENS = 40
MOVE_AT = 4


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def admin(method: str, url: str, **kw) -> httpx.Response:
    return httpx.request(method, url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=300, **kw)


def instances(base: str) -> list[dict]:
    return admin("GET", base + "/v1/instances").json()["data"]


def wait_healthy(server: LocalServer, n: int, timeout_s: float = 300) -> None:
    """Until the fleet's front answers and all `n` workers are healthy (SystemExit after `timeout_s`)."""
    server.wait_ready()
    deadline = time.monotonic() + timeout_s
    while [d["status"] for d in instances(server.base_url)] != ["healthy"] * n:
        if time.monotonic() > deadline:
            raise SystemExit("workers not healthy")
        time.sleep(0.5)


def run_one(base: str, prompt: list[int], mode: str, rid: str) -> dict:
    """One streamed request moved after MOVE_AT tokens; what the client and the front saw."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    times: list[float] = []
    texts: list[str] = []
    result: dict = {}

    def move() -> None:
        for target in (0, 1):
            r = admin("POST", base + "/v1/migrations", json={"request_id": rid, "target": target, "mode": mode})
            if r.status_code == 200:
                result.update(r.json())
                return
        result["migrated"] = False

    mover = None
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600, headers={"X-Request-Id": rid}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                times.append(time.perf_counter())
                texts.append(event["choices"][0]["text"])
                if len(texts) == MOVE_AT:
                    mover = threading.Thread(target=move)
                    mover.start()
    if mover is not None:
        mover.join()
    gaps = [b - a for a, b in zip(times, times[1:])]
    result["max_gap_s"] = max(gaps[MOVE_AT - 1:], default=0.0)
    result["median_gap_s"] = statistics.median(gaps) if gaps else 0.0
    result["text"] = "".join(texts)
    result["tokens"] = len(texts)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8000])
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot-only", metavar="JSON", help="redraw the figure from a results file, run nothing")
    args = p.parse_args()
    if args.plot_only:
        saved = json.loads(Path(args.plot_only).read_text())
        plot(saved["summary"], REPO / "benchmarks" / "figures" / "migration_downtime.png", saved["cpu"])
        return 0
    console = Console(width=150)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results_dir = REPO / "benchmarks" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    log = results_dir / f"migration-downtime-{stamp}.log"
    longest = max(args.lengths) + MAX_TOKENS + 16
    gib = max(0.2, 2 * longest * 46080 / 2**30)  # the embedded model's fp32 KV: 46,080 bytes a token
    server = LocalServer(["--instances", "2", "--router", "round-robin", "--admin-key", ADMIN, "--num-threads", "2",
                          "--kv-cache-gib", f"{gib:.2f}", "--max-num-seqs", "4", "--no-shed-unattainable"], log)
    rng = random.Random(args.seed)
    rows: list[dict] = []
    try:
        wait_healthy(server, 2)
        total = len(args.lengths) * args.runs * len(MODES)
        with Progress(console=console) as progress:
            task = progress.add_task("migrations", total=total)
            for length in args.lengths:
                for run in range(args.runs):
                    for mode in MODES:
                        prompt = [rng.randrange(100, 40000) for _ in range(length)]
                        rid = f"mig-{length}-{run}-{mode}"
                        moved = run_one(server.base_url, prompt, mode, rid)
                        plain = httpx.post(server.base_url + "/v1/completions", timeout=600, json={
                            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}).json()
                        same = moved.pop("text") == plain["choices"][0]["text"]
                        rows.append({"context": length, "mode": mode, "run": run, "identical": same, **moved})
                        progress.advance(task)
    finally:
        server.stop()

    table = Table(title=f"live migration between two workers ({cpu_model()})")
    for col in ("context", "mode", "downtime ms", "copy ms", "MB", "MB/s", "rounds", "max gap ms",
                "median gap ms", "identical"):
        table.add_column(col, justify="right")
    summary: dict = {}
    for length in args.lengths:
        for mode in MODES:
            runs = [r for r in rows if r["context"] == length and r["mode"] == mode and r.get("migrated")]
            if not runs:
                continue
            med = {k: statistics.median(r[k] for r in runs) for k in ("downtime_s", "copy_s", "kv_bytes",
                                                                       "max_gap_s", "median_gap_s", "rounds")}
            rate = med["kv_bytes"] / med["copy_s"] / 1e6 if med["copy_s"] else 0.0
            summary.setdefault(str(length), {})[mode] = {**med, "mb_per_s": rate, "runs": len(runs),
                                                         "all_identical": all(r["identical"] for r in runs)}
            table.add_row(str(length), mode, f"{med['downtime_s'] * 1e3:.1f}", f"{med['copy_s'] * 1e3:.1f}",
                          f"{med['kv_bytes'] / 1e6:.1f}", f"{rate:.0f}", f"{med['rounds']:.0f}",
                          f"{med['max_gap_s'] * 1e3:.0f}", f"{med['median_gap_s'] * 1e3:.0f}",
                          str(all(r["identical"] for r in runs)))
    console.print(table)
    failed = [r for r in rows if not r.get("migrated") or not r["identical"]]
    out = results_dir / f"migration-downtime-{stamp}.json"
    out.write_text(json.dumps({"cpu": cpu_model(), "date": stamp, "max_tokens": MAX_TOKENS, "move_at": MOVE_AT,
                               "summary": summary, "runs": rows}, indent=1))
    console.print(f"results: {out}")
    plot(summary, REPO / "benchmarks" / "figures" / "migration_downtime.png", cpu_model())
    if failed:
        console.print(f"[red]{len(failed)} runs did not migrate or changed the output[/red]")
        return 1
    return 0


def plot(summary: dict, path: Path, cpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(int(k) for k in summary)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, style in zip(MODES, ("o-", "s--")):
        xs = [n for n in lengths if mode in summary[str(n)]]
        ax1.plot(xs, [summary[str(n)][mode]["downtime_s"] * 1e3 for n in xs], style, label=mode)
        ax2.plot(xs, [summary[str(n)][mode]["mb_per_s"] for n in xs], style, label=mode)
    ax1.set(xscale="log", xlabel="context (tokens)", ylabel="downtime (ms, median)",
            title="request paused during a migration")
    ax2.set(xscale="log", xlabel="context (tokens)", ylabel="KV copy rate (MB/s)", title="copy rate over loopback HTTP")
    for ax in (ax1, ax2):
        measured_ticks(ax, lengths)
    save(fig, path, f"sloserve live migration, 2 workers of SmolLM2-135M fp32 on {cpu}")


if __name__ == "__main__":
    raise SystemExit(main())
