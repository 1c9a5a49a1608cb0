#!/usr/bin/env python3
"""Energy per request when SLO slack is spent on lower SM clocks (BEAM-style), against every step
at the top clock, in the simulator.

One instance of each setting (Llama-3.1-8B on one H100; Llama-3.1-70B on four, TP4), each workload
(ShareGPT, Azure conversation, Azure code), each SLO (tight: TTFT 0.5 s / TPOT 50 ms; loose: 5 s /
150 ms; every request carries it as its QoS class, which is what the clock policy reads) and each
load (shares of the instance's saturation throughput at the top clock: requests / makespan with
all of them at once, planning.burst_rate), with the clock policies `max` (the baseline), `slo-slack` and
`energy-min` (lowest-energy clock, deadlines ignored). Energy counts every GPU of the instance,
idle time included. Anchor: BEAM reports up to 51% less energy than vLLM within SLOs.

    python benchmarks/sim_energy.py [--requests 800] [--loads 0.3,0.6,0.9]
Writes benchmarks/results/sim_energy-STAMP.json and .png.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from sloserve.bench.metrics import SLO
from sloserve.planning import at_rate, burst_rate
from sloserve.simulation import FleetConfig, build_fleet, sim_requests, simulate
from sloserve.core.types import QoSClass
from sloserve.workload.build import WorkloadSpec, build_stream

RESULTS = Path(__file__).resolve().parent / "results"
SETTINGS = {"8B x1": dict(model="llama-3.1-8b", tp=1), "70B TP4": dict(model="llama-3.1-70b", tp=4)}
SLOS = {"tight": "ttft=500,tpot=50", "loose": "ttft=5000,tpot=150"}
WORKLOADS = ("sharegpt", "azure-conv", "azure-code")
POLICIES = ("max", "slo-slack", "energy-min")


def one_run(reqs, cfg: FleetConfig, slo: SLO) -> dict:
    sim = build_fleet(cfg)
    qos = QoSClass("default", slo.ttft_s or math.inf, slo.tpot_s or math.inf)
    records, result = simulate(sim, sim_requests(reqs, {"default": qos}))
    e = result.energy
    done = [r for r in records if r.error is None]
    tokens = sum(r.output_tokens or 0 for r in done)
    ttft = sorted(r.ttft_s for r in done)
    tpot = sorted(r.tpot_s for r in done if r.tpot_s is not None)
    return {"attainment": sum(slo.met(r) for r in records) / max(1, len(records)),
            "j_per_request": e["total_j"] / max(1, len(done)), "j_per_token": e["total_j"] / max(1, tokens),
            "idle_share": e["idle_j"] / e["total_j"], "prefill_clock": e["prefill_mean_clock"],
            "decode_clock": e["decode_mean_clock"], "ttft_p99": ttft[int(0.99 * (len(ttft) - 1))],
            "tpot_p99": tpot[int(0.99 * (len(tpot) - 1))] if tpot else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=800)
    ap.add_argument("--loads", default="0.3,0.6,0.9", help="shares of the instance's saturation throughput")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"of {list(SETTINGS)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    settings = args.settings.split(",")
    workloads = args.workloads.split(",")
    cells = list(itertools.product(settings, workloads, SLOS))
    rows = []
    console = Console()
    with Progress(console=console) as progress:
        task = progress.add_task("simulating", total=len(cells) * len(loads) * len(POLICIES))
        for setting, workload, slo_name in cells:
            reqs = list(build_stream(WorkloadSpec(name=workload, rate=1.0, num_requests=args.requests)))
            slo = SLO.parse(SLOS[slo_name])
            base = FleetConfig(hardware="h100-80g", **SETTINGS[setting])
            capacity = burst_rate(reqs, base, slo)
            for load in loads:
                rate = load * capacity
                at = at_rate(reqs, rate)
                row = {"setting": setting, "workload": workload, "slo": slo_name, "load": load,
                       "capacity_rps": capacity, "rate": rate}
                for policy in POLICIES:
                    row[policy] = one_run(at, replace(base, clock_policy=policy), slo)
                    progress.advance(task)
                rows.append(row)
    table = Table(title=f"Energy per request by clock policy ({args.requests} requests per run, H100, simulated)")
    for col in ("setting", "workload", "SLO", "load", "J/req max", "slo-slack", "energy-min",
                "att max", "att slack", "att e-min", "clock p/d slack"):
        table.add_column(col, justify="right")
    for r in rows:
        m, s, lo = r["max"], r["slo-slack"], r["energy-min"]
        pc, dc = s["prefill_clock"], s["decode_clock"]
        table.add_row(r["setting"], r["workload"], r["slo"], f"{r['load']:.0%}", f"{m['j_per_request']:.0f}",
                      f"{s['j_per_request'] / m['j_per_request']:.2f}x",
                      f"{lo['j_per_request'] / m['j_per_request']:.2f}x",
                      f"{100 * m['attainment']:.1f}%", f"{100 * s['attainment']:.1f}%", f"{100 * lo['attainment']:.1f}%",
                      f"{'-' if pc is None else f'{pc:.2f}'}/{'-' if dc is None else f'{dc:.2f}'}")
    console.print(table)
    kept = [r for r in rows if r["slo-slack"]["attainment"] >= r["max"]["attainment"] - 0.01]
    if kept:
        best = min(kept, key=lambda r: r["slo-slack"]["j_per_request"] / r["max"]["j_per_request"])
        saving = 1 - best["slo-slack"]["j_per_request"] / best["max"]["j_per_request"]
        console.print(f"slo-slack within 1 point of the top clock's attainment in {len(kept)}/{len(rows)} cells; "
                      f"largest saving there {saving:.0%} ({best['setting']}, {best['workload']}, {best['slo']}, "
                      f"{best['load']:.0%} load); BEAM's anchor: up to 51%")
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"sim_energy-{stamp}.json"
    path.write_text(json.dumps({"date": stamp, "requests": args.requests, "rows": rows}, indent=1))
    plot(rows, path.with_suffix(".png"))
    console.print(f"wrote {path}")
    return 0


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    markers = {"sharegpt": "o", "azure-conv": "s", "azure-code": "^"}
    colors = {"slo-slack": "tab:green", "energy-min": "tab:red"}
    for ax, slo_name in zip(axes, SLOS):
        for r in (r for r in rows if r["slo"] == slo_name):
            m = r["max"]
            for policy in ("slo-slack", "energy-min"):
                p = r[policy]
                ax.scatter(p["j_per_request"] / m["j_per_request"], 100 * (p["attainment"] - m["attainment"]),
                           marker=markers.get(r["workload"], "o"), color=colors[policy],
                           s=20 + 40 * r["load"], alpha=0.75,
                           edgecolors="black" if r["setting"].startswith("70B") else "none")
        ax.axhline(0, color="gray", lw=0.8)
        ax.axvline(1, color="gray", lw=0.8)
        ax.set_title(f"{slo_name} SLO ({SLOS[slo_name]})")
        ax.set_xlabel("energy per request / top clock's")
        ax.set_ylabel("SLO attainment - top clock's (points)")
    handles = [plt.Line2D([], [], marker="o", ls="", color=c, label=p) for p, c in colors.items()]
    handles += [plt.Line2D([], [], marker=mk, ls="", color="gray", label=w) for w, mk in markers.items()]
    handles += [plt.Line2D([], [], marker="o", ls="", color="white", markeredgecolor="black", label="70B TP4")]
    axes[1].legend(handles=handles, fontsize=7, loc="lower left")
    fig.suptitle("Spending SLO slack on SM clocks (simulated H100; marker size = load)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
