#!/usr/bin/env python3
"""Pipeline stages (DynaPipe, issue 19 part 4): one pipeline-parallel instance whose layers are
split evenly (the engine default), balanced once for a profiled decode step, or re-split
dynamically when the stages stay unbalanced. End-to-end latency, TTFT and TPOT per policy on
workloads whose prefill/decode mix differs, and one whose mix shifts every few minutes.

    python benchmarks/sim_stages.py            # the study in BENCHMARKS.md (~2 min)
Writes benchmarks/results/sim_stages-STAMP.json and benchmarks/figures/sim_stages.png.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sloserve.simulation import FleetConfig, build_fleet, sim_requests, simulate  # noqa: E402
from sloserve.workload.build import WorkloadSpec, build_stream  # noqa: E402
from sloserve.workload.types import WorkloadRequest  # noqa: E402

POLICIES = ("even", "profiled", "dynamic")


def phases(parts: list[tuple[str, float]], phase_s: float, seed: int) -> list[WorkloadRequest]:
    """Poisson arrivals, one (trace, rate) per phase of `phase_s` seconds, back to back."""
    out: list[WorkloadRequest] = []
    for k, (trace, rate) in enumerate(parts):
        reqs = build_stream(WorkloadSpec(trace, rate=rate, duration_s=phase_s, arrival_process="poisson",
                                         seed=seed + k, max_prompt_len=32000))
        out += [replace(r, arrival_s=r.arrival_s + k * phase_s, request_id=f"p{k}-{i}") for i, r in enumerate(reqs)]
    return out


def cases(seed: int) -> list[dict]:
    """(name, model, GPUs, stages, requests): 8B over four PCIe L40S (no NVLink, so stages rather
    than tensor parallelism), 70B over eight."""
    conv8 = phases([("azure-conv", 5.0)] * 2, 600, seed)
    long8 = phases([("mooncake-conv", 1.5)] * 2, 600, seed)
    shift8 = phases([("mooncake-conv", 1.5), ("azure-conv", 6.0)] * 3, 300, seed)
    conv70 = phases([("azure-conv", 1.0)] * 2, 600, seed)
    return [
        {"name": "8B, Azure conversation (decode-heavy)", "short": "8B\nconversation",
         "model": "llama-3.1-8b", "pp": 4, "reqs": conv8},
        {"name": "8B, Mooncake conversation (long prompts)", "short": "8B\nlong prompts",
         "model": "llama-3.1-8b", "pp": 4, "reqs": long8},
        {"name": "8B, the two alternating every 5 min", "short": "8B\nalternating",
         "model": "llama-3.1-8b", "pp": 4, "reqs": shift8},
        {"name": "70B, Azure conversation", "short": "70B\nconversation",
         "model": "llama-3.1-70b", "pp": 8, "reqs": conv70},
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hardware", default="l40s")
    p.add_argument("--link", default="pcie-gen4", help="between stages")
    p.add_argument("--window", type=float, default=30.0)
    p.add_argument("--threshold", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    console = Console()
    work = cases(args.seed)
    rows = []
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("runs", total=len(work) * len(POLICIES))
        for case in work:
            for policy in POLICIES:
                cfg = FleetConfig(hardware=args.hardware, model=case["model"], pp=case["pp"], stages=policy,
                                  stage_link=args.link, stage_window_s=args.window, stage_threshold=args.threshold)
                records, result = simulate(build_fleet(cfg), sim_requests(case["reqs"]))
                ok = [r for r in records if r.success]
                e2e = np.array([r.e2e_s for r in ok])
                ttft = np.array([r.ttft_s for r in ok])
                tpot = np.array([r.tpot_s for r in ok if r.tpot_s is not None])
                books = result.stages[0]
                rows.append({"case": case["name"], "short": case["short"], "model": case["model"], "pp": case["pp"],
                             "policy": policy,
                             "requests": len(records), "failed": len(records) - len(ok),
                             "e2e_mean_s": float(e2e.mean()), "e2e_p95_s": float(np.percentile(e2e, 95)),
                             "ttft_p50_s": float(np.median(ttft)), "ttft_p99_s": float(np.percentile(ttft, 99)),
                             "tpot_p50_s": float(np.median(tpot)), "moves": books["moves"],
                             "layers_moved": books["layers_moved"], "stall_s": books["stall_s"],
                             "mean_imbalance": books["mean_imbalance"], "partitions": books["partitions"],
                             "windows": books["windows"]})
                progress.advance(task)
    table = Table(title=f"pipeline stages on {args.hardware} (stages linked by {args.link}), one instance")
    for col in ("case", "policy", "e2e mean s", "vs even", "e2e p95 s", "vs even", "TTFT p99 s", "TPOT p50 ms",
                "re-splits", "slowest / mean stage"):
        table.add_column(col, justify="right")
    for r in rows:
        even = next(x for x in rows if x["case"] == r["case"] and x["policy"] == "even")
        table.add_row(r["case"], r["policy"], f"{r['e2e_mean_s']:.2f}", f"{r['e2e_mean_s'] / even['e2e_mean_s']:.3f}",
                      f"{r['e2e_p95_s']:.2f}", f"{r['e2e_p95_s'] / even['e2e_p95_s']:.3f}", f"{r['ttft_p99_s']:.2f}",
                      f"{1e3 * r['tpot_p50_s']:.1f}", str(r["moves"]), f"{r['mean_imbalance']:.3f}")
    console.print(table)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = REPO / "benchmarks" / "results" / f"sim_stages-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"when": stamp, "args": vars(args), "machine": platform.processor() or platform.machine(),
                               "wall_s": time.perf_counter() - t0, "rows": rows}, indent=1))
    figure = REPO / "benchmarks" / "figures" / "sim_stages.png"
    plot(rows, figure)
    console.print(f"wrote {out} and {figure.relative_to(REPO)} ({time.perf_counter() - t0:.0f} s)")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["case"] for r in rows))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), layout="constrained")
    width = 0.8 / len(POLICIES)
    for k, policy in enumerate(POLICIES):
        vals = []
        for name in names:
            even = next(r for r in rows if r["case"] == name and r["policy"] == "even")
            mine = next(r for r in rows if r["case"] == name and r["policy"] == policy)
            vals.append(mine["e2e_mean_s"] / even["e2e_mean_s"])
        ax.bar([i + (k - 1) * width for i in range(len(names))], vals, width, label=policy)
    ax.axhline(1.0, color="black", linewidth=0.8)
    shorts = [next(r["short"] for r in rows if r["case"] == n) for n in names]
    ax.set_xticks(range(len(names)), shorts, fontsize="small")
    ax.set_ylabel("mean end-to-end latency / even split's")
    ax.set_ylim(0.8, 1.05)
    ax.legend()
    ax.set_title("latency per stage policy")
    shift = names[2]
    for policy in POLICIES:
        r = next(x for x in rows if x["case"] == shift and x["policy"] == policy)
        bx.plot([w[0] / 60 for w in r["windows"]], [w[1] for w in r["windows"]], label=policy, marker=".")
    for k in range(1, 6):
        bx.axvline(5 * k, color="grey", linewidth=0.5, linestyle=":")
    bx.set_xlabel("minutes (phases alternate every 5: long prompts, then conversation)")
    bx.set_ylabel("slowest stage / mean stage, per window")
    bx.set_title(shift)
    bx.legend()
    bx.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
