"""Hand-off from mixed instances (Llumnix-style `--mixed-handoff`) on a simulated fleet: does
letting a colocated fleet move a request to another instance after its first token pay, and when?

Setting: 8 x Llama-3.1-8B on H100 80 GB, chunked prefill (2,048-token budget), KV over InfiniBand
NDR, pipelined transfer; arrivals routed by least-requests (load-aware) and by round-robin (blind to
load, so prefill backlogs build unevenly: where a hand-off has something to fix). Workloads: windows of the Azure LLM 2023 code
trace (prefill-heavy) and conversation trace, their own lengths and arrival pattern, replayed at
0.8x, 1.0x and 1.2x the fleet's measured capacity (least-requests, no hand-off, >= 90% of
requests within the SLO: benchmarks/routing.py's search), with a tight SLO (TTFT 1 s, TPOT
50 ms: where a decode step that carries a prefill chunk costs a token's budget). Policies:

- `never`: colocated serving (the baseline);
- `prefill-pressure` at 1,024 and 4,096 queued prompt tokens: move a request whose instance has
  that much prefill work queued to a decode-light instance without such a backlog;
- `always`: every request decodes away from its prefill instance (disaggregation by request).

Per run: SLO attainment, TTFT p50/p99, TPOT p50/p90/p99, hand-offs and KV moved. Writes
benchmarks/results/sim_mixed_handoff-<time>.json and benchmarks/figures/sim_mixed_handoff.png;
prints the table. About 6 minutes on 2 CPU cores.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing import TRACES, Trace, measure_capacity, window  # noqa: E402  (the routing study's workload)

from sloserve.bench.metrics import SLO, jsonable, percentile  # noqa: E402
from sloserve.cluster.spec import FleetSpec  # noqa: E402
from sloserve.core.config import SchedulerConfig  # noqa: E402
from sloserve.planning import at_rate  # noqa: E402
from sloserve.simulation import FleetConfig, build_fleet, sim_requests, simulate  # noqa: E402
from sloserve.workload.types import WorkloadRequest  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS, FIGURES = HERE / "results", HERE / "figures"
SLO_TIGHT = SLO(ttft_s=1.0, tpot_s=0.05)
LOADS = (0.8, 1.0, 1.2)
POLICIES = (("never", 0), ("prefill-pressure", 1024), ("prefill-pressure", 4096), ("always", 0))
FLEET = {"hardware": "h100-80g", "model": "llama-3.1-8b", "link": "infiniband-ndr", "decode_router": "least-kv"}
ROUTERS = ("least-requests", "round-robin")


def label(policy: str, tokens: int) -> str:
    return f"{policy} {tokens}" if policy == "prefill-pressure" else policy


def run(reqs: list[WorkloadRequest], router: str, policy: str, tokens: int, instances: int, slo: SLO) -> dict:
    spec = FleetSpec(instances, router=router, decode_router=FLEET["decode_router"], mixed_handoff=policy,
                     mixed_handoff_tokens=max(1, tokens))
    fleet = FleetConfig(spec, scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256),
                        **{k: v for k, v in FLEET.items() if k != "decode_router"})
    sim = build_fleet(fleet)
    t0 = time.perf_counter()
    records, result = simulate(sim, sim_requests(reqs))
    ok = [r for r in records if r.success]
    ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    tpot = sorted(t for t in (r.tpot_s for r in ok) if t is not None)
    h = result.handoffs or {}
    return {"router": router, "policy": label(policy, tokens), "requests": len(reqs), "completed": result.num_finished,
            "slo_attainment": sum(slo.met(r) for r in records) / max(1, len(reqs)),
            "p50_ttft_s": percentile(ttft, 50), "p99_ttft_s": percentile(ttft, 99),
            "p50_tpot_s": percentile(tpot, 50), "p90_tpot_s": percentile(tpot, 90), "p99_tpot_s": percentile(tpot, 99),
            "handoffs": int(h.get("completed", 0)), "handoff_gb": h.get("bytes", 0) / 1e9,
            "sim_s": result.end_time, "wall_s": time.perf_counter() - t0}


def print_table(results: dict, console: Console) -> None:
    for w in results["workloads"]:
        table = Table(title=f"{w['label']}: capacity {w['capacity_rps']:.1f} req/s with least-requests "
                            f"(8 x 8B on H100, TTFT <= 1 s, TPOT <= 50 ms)")
        for col in ("load", "router", "policy", "SLO met", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p90", "TPOT p99",
                    "hand-offs"):
            table.add_column(col, justify="right")
        for r in w["runs"]:
            table.add_row(f"{r['load']:.1f}x", r["router"], r["policy"], f"{100 * r['slo_attainment']:.1f}%",
                          *(f"{1e3 * r[k]:,.0f}" for k in ("p50_ttft_s", "p99_ttft_s")),
                          *(f"{1e3 * r[k]:.1f}" for k in ("p50_tpot_s", "p90_tpot_s", "p99_tpot_s")),
                          f"{r['handoffs']}/{r['requests']}")
        console.print(table)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = results["workloads"]
    fig, axes = plt.subplots(2, len(workloads), figsize=(5.5 * len(workloads), 7), squeeze=False)
    for col, w in enumerate(workloads):
        names = list(dict.fromkeys((r["router"], r["policy"]) for r in w["runs"]))
        for router, policy in names:
            runs = [r for r in w["runs"] if (r["router"], r["policy"]) == (router, policy)]
            name = f"{router}: {policy}"
            loads = [r["load"] for r in runs]
            style = "-" if router == ROUTERS[0] else "--"
            axes[0][col].plot(loads, [100 * r["slo_attainment"] for r in runs], marker="o", linestyle=style,
                              label=name)
            axes[1][col].plot(loads, [1e3 * r["p90_tpot_s"] for r in runs], marker="o", linestyle=style, label=name)
        axes[0][col].set_title(f"{w['label']} (capacity {w['capacity_rps']:.0f} req/s)")
        axes[0][col].set_ylabel("requests within SLO (%)")
        axes[1][col].set_ylabel("TPOT p90 (ms)")
        axes[1][col].set_xlabel("load (x capacity)")
        axes[1][col].axhline(1e3 * SLO_TIGHT.tpot_s, color="grey", linestyle=":", linewidth=1)
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=7)
    fig.suptitle("Hand-off from mixed instances (simulated, 8 x Llama-3.1-8B on H100)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="azure-code,azure-conv")
    p.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS), help="fractions of measured capacity")
    p.add_argument("--instances", type=int, default=8)
    p.add_argument("--requests", type=int, default=3000, help="requests of each trace window")
    p.add_argument("--capacity-iters", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--figure", type=Path, default=FIGURES / "sim_mixed_handoff.png")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    loads = [float(x) for x in args.loads.split(",")]
    traces: list[Trace] = [replace(t, num_requests=args.requests, slo=SLO_TIGHT) for t in TRACES
                           if t.name in args.workloads.split(",")]
    console = Console(width=max(140, Console().width))
    results = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "instances": args.instances,
               "fleet": FLEET, "routers": ROUTERS, "capacity_router": "least-requests", "slo": {"ttft_s": SLO_TIGHT.ttft_s,
                                                                    "tpot_s": SLO_TIGHT.tpot_s},
               "loads": loads, "workloads": []}
    t_start = time.perf_counter()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console)
    with progress:
        task = progress.add_task("runs", total=len(traces) * (1 + len(loads) * len(ROUTERS) * len(POLICIES)))
        for trace in traces:
            reqs = window(trace)
            progress.update(task, description=f"{trace.label}: capacity")
            # the window's own (squeezed) capacity, as the load sweep replays that window (a warning says so)
            capacity, _ = measure_capacity(reqs, trace.slo, args.instances, args.capacity_iters, min_duration_s=0,
                                           **FLEET)
            progress.advance(task)
            entry = {"name": trace.name, "label": trace.label, "requests": len(reqs), "capacity_rps": capacity,
                     "runs": []}
            for load in loads:
                batch = at_rate(reqs, load * capacity)
                for router in ROUTERS:
                    for policy, tokens in POLICIES:
                        progress.update(task, description=f"{trace.label} {load:.1f}x {router} {label(policy, tokens)}")
                        entry["runs"].append({"load": load, "rate": load * capacity,
                                              **run(batch, router, policy, tokens, args.instances, trace.slo)})
                        progress.advance(task)
            results["workloads"].append(entry)
    results["wall_s"] = time.perf_counter() - t_start
    print_table(results, console)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = args.out / f"sim_mixed_handoff-{stamp}.json"
    path.write_text(json.dumps(jsonable(results), indent=1))
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    plot(results, args.figure)
    console.print(f"wrote {path} and {args.figure} ({results['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
