#!/usr/bin/env python3
"""MoE expert placement as expert popularity drifts, in the simulator: one expert-parallel instance
of 8 H100s (attention data-parallel, experts spread by the placement) serving Mixtral-8x7B
(8 experts, top-2) or Qwen3-30B-A3B (128 experts, top-8: the fine-grained DeepSeek-MoE design).

For each model and popularity skew, each placement (`static`, `replicate-hot`, `offload-cold`,
`rebalance`) serves the same run: ShareGPT requests at a steady Poisson rate (half of what the
static placement sustains in a burst at time 0, times STEADY_SHARE = 0.3) for `--duration` seconds while popularity drifts
(time constant `--drift`), then a burst of `--burst` requests at once. Reported: TTFT and TPOT p99
of the steady part, output tokens/s of the closing burst (saturation, where the straggler GPU
matters), weights per GPU and KV blocks, the straggler factor over time, re-placements and the
GB they moved.

    python benchmarks/sim_experts.py [--duration 1800] [--drift 900] [--skews 0.4,0.8]
Writes benchmarks/results/sim_experts-STAMP.json and .png.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from sloserve.core.config import SchedulerConfig
from sloserve.simulation import FleetConfig, build_fleet, sim_requests, simulate
from sloserve.workload.build import WorkloadSpec, build_stream

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("mixtral-8x7b", "qwen3-30b-a3b")
STEADY_SHARE = 0.3  # the steady load, as a share of the static placement's burst throughput at time 0
PLACEMENTS = ("static", "replicate-hot", "offload-cold", "rebalance")


def steady_then_burst(shapes, rate: float, duration: float, burst: int, seed: int = 0):
    """Poisson arrivals at `rate` for `duration` s with ShareGPT's lengths (cycled), then `burst` at once."""
    rng = random.Random(seed)
    out, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        out.append(replace(shapes[i % len(shapes)], arrival_s=t, request_id=f"s{i}"))
        i += 1
    for j in range(burst):
        out.append(replace(shapes[(i + j) % len(shapes)], arrival_s=duration, request_id=f"b{j}"))
    return out


def p99(values):
    values = sorted(v for v in values if v is not None)
    return values[int(0.99 * (len(values) - 1))] if values else None


def run(cfg: FleetConfig, reqs, duration: float) -> dict:
    sim = build_fleet(cfg)
    records, result = simulate(sim, sim_requests(reqs))
    steady = [r for r in records if r.request_id.startswith("s")]
    burst = [r for r in records if r.request_id.startswith("b")]
    burst_end = max((r.scheduled_s + r.e2e_s for r in burst if r.e2e_s is not None), default=duration)
    books = result.experts[0]
    cost = sim.instances[0].cost_model
    return {"ttft_p99": p99(r.ttft_s for r in steady), "tpot_p99": p99(r.tpot_s for r in steady),
            "burst_tok_s": sum(r.output_tokens or 0 for r in burst) / max(1e-9, burst_end - duration),
            "weights_gb_per_gpu": cost.weight_bytes() / 1e9, "kv_blocks": sim.instances[0].kv.pool.num_blocks,
            "mean_straggler": books["mean_straggler"], "replacements": books["replacements"],
            "moved_gb": books["moved_bytes"] / 1e9, "stall_s": books["stall_s"],
            "fetched_gb": books["fetched_bytes"] / 1e9, "timeline": books["timeline"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of steady load")
    ap.add_argument("--drift", type=float, default=900.0, help="time constant of the popularity's drift (s)")
    ap.add_argument("--skews", default="0.4,0.8")
    ap.add_argument("--interval", type=float, default=600.0, help="rebalance's re-placement interval (s)")
    ap.add_argument("--burst", type=int, default=1000)
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    skews = [float(s) for s in args.skews.split(",")]
    shapes = list(build_stream(WorkloadSpec(name="sharegpt", rate=1.0, num_requests=20000)))
    rows = []
    console = Console()
    cells = list(itertools.product(args.models.split(","), skews))
    with Progress(console=console) as progress:
        task = progress.add_task("simulating", total=len(cells) * (len(PLACEMENTS) + 1))
        for model, skew in cells:
            # Attention is data-parallel over the 8 GPUs: each rank batches as one vLLM instance would
            # (256 sequences, 2,048 tokens), so the group's step is 8 times that.
            base = FleetConfig(model=model, tp=8, experts="static", expert_skew=skew, expert_drift_s=args.drift,
                               expert_interval_s=args.interval,
                               scheduler=SchedulerConfig(max_num_batched_tokens=8 * 2048, max_num_seqs=8 * 256))
            fresh = run(base, steady_then_burst(shapes, 1e-9, 1.0, args.burst), 1.0)  # a burst at time ~0
            progress.advance(task)
            mean_out = sum(s.output_len for s in shapes[:args.burst]) / args.burst
            rate = STEADY_SHARE * fresh["burst_tok_s"] / mean_out
            reqs = steady_then_burst(shapes, rate, args.duration, args.burst)
            row = {"model": model, "skew": skew, "rate": rate, "static_fresh_burst_tok_s": fresh["burst_tok_s"]}
            for placement in PLACEMENTS:
                row[placement] = run(replace(base, experts=placement), reqs, args.duration)
                progress.advance(task)
            rows.append(row)
    table = Table(title=f"Expert placement on 8 x H100 under drifting popularity (drift {args.drift:g} s, "
                        f"{args.duration:g} s steady at 0.3x the static burst rate, then a {args.burst}-request burst)")
    for col in ("model", "skew", "placement", "burst tok/s", "vs static", "TTFT p99 ms", "TPOT p99 ms",
                "weights GB/GPU", "KV blocks", "straggler", "re-placed", "moved GB"):
        table.add_column(col, justify="right")
    for r in rows:
        s = r["static"]
        for placement in PLACEMENTS:
            p = r[placement]
            table.add_row(r["model"], f"{r['skew']:g}", placement, f"{p['burst_tok_s']:.0f}",
                          f"{p['burst_tok_s'] / s['burst_tok_s']:.2f}x", f"{1e3 * p['ttft_p99']:.0f}",
                          f"{1e3 * p['tpot_p99']:.1f}", f"{p['weights_gb_per_gpu']:.1f}", str(p["kv_blocks"]),
                          f"{p['mean_straggler']:.2f}", str(p["replacements"]), f"{p['moved_gb']:.1f}")
    console.print(table)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"sim_experts-{stamp}.json"
    path.write_text(json.dumps({"date": stamp, "args": vars(args), "rows": rows}, indent=1))
    plot(rows, path.with_suffix(".png"))
    console.print(f"wrote {path}")
    return 0


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(rows), figsize=(3.6 * len(rows), 6.4), squeeze=False)
    for col, r in enumerate(rows):
        ax = axes[0][col]
        for placement in PLACEMENTS:
            t = r[placement]["timeline"]
            ax.step([x / 60 for x, _ in t], [s for _, s in t], where="post", label=placement)
        ax.set_title(f"{r['model']}, skew {r['skew']:g}", fontsize=9)
        ax.set_xlabel("minutes")
        ax.set_ylabel("straggler (busiest GPU / even share)")
        ax = axes[1][col]
        xs = range(len(PLACEMENTS))
        ax.bar(xs, [r[p]["burst_tok_s"] / r["static"]["burst_tok_s"] for p in PLACEMENTS])
        ax.set_xticks(list(xs), PLACEMENTS, rotation=30, fontsize=7)
        ax.set_ylabel("burst tokens/s vs static")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
