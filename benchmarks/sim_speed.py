"""How fast does the simulator run? Two fleets, wall seconds and simulated time / wall time.

1. The whole Azure 2023 conversation trace (replayed at its own times) on 16 simulated H100s
   serving Llama-3.1-8B. Target: <= 20 s of wall time (>= 180x real time).
2. 1,000,000 synthetic requests (Poisson, 512 prompt / 128 output tokens) on 64 instances.
   Target: <= 10 minutes.
3. The first case again, recording the fleet timeline (`sloserve simulate` always does, for
   report.html: a frame of every instance each `--timeline-interval`, here 6 s = 600 frames
   over the hour): what recording costs, as a ratio to case 1 in the same process.

Both run the real scheduler and KV manager per instance; fast-forwarded decode runs are on
(tests/test_sim.py shows they change no decision). Prints a table and writes JSON + a PNG.
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from sloserve.cluster.spec import FleetSpec
from sloserve.core.config import SchedulerConfig
from sloserve.simulation import FleetConfig, build_fleet, sim_requests, simulate
from sloserve.timeline import FleetTimeline
from sloserve.workload.build import WorkloadSpec, build_stream

RESULTS = Path(__file__).resolve().parent / "results"


def run_case(name: str, spec: WorkloadSpec, fleet: FleetConfig, progress: Progress,
             timeline_interval_s: float = 0.0) -> dict:
    t0 = time.perf_counter()
    stream = build_stream(spec)
    build_s = time.perf_counter() - t0
    gc.freeze()  # as `sloserve simulate` does: the workload is only read from here on
    task = progress.add_task(name, total=len(stream), sim_time=0.0)
    sim = build_fleet(fleet)
    timeline = FleetTimeline(timeline_interval_s, "simulated", max_frames=1_000_000) if timeline_interval_s else None
    t1 = time.perf_counter()
    records, result = simulate(sim, sim_requests(stream), timeline=timeline,
                               on_progress=lambda t, n: progress.update(task, completed=n, sim_time=t))
    wall = time.perf_counter() - t1
    ttfts = sorted(r.ttft_s for r in records if r.ttft_s is not None)
    return {
        "case": name, "requests": len(stream), "completed": result.num_finished, "instances": fleet.fleet.instances,
        "router": fleet.fleet.router, "sim_time_s": result.end_time, "wall_s": wall, "workload_build_s": build_s,
        "speedup": result.end_time / wall, "events": result.num_events,
        "p50_ttft_ms": 1e3 * ttfts[len(ttfts) // 2] if ttfts else None,
        "p99_ttft_ms": 1e3 * ttfts[int(len(ttfts) * 0.99)] if ttfts else None,
        "timeline_frames": len(timeline.frames) if timeline is not None else 0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--million", type=int, default=1_000_000, help="requests in the synthetic case")
    p.add_argument("--million-rate", type=float, default=1500.0, help="req/s of the synthetic case")
    p.add_argument("--router", default="least-requests")
    p.add_argument("--skip-million", action="store_true")
    args = p.parse_args()
    sched = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256)
    azure = ("azure-conv full trace, 16 x H100", WorkloadSpec("azure-conv", replay=True, duration_s=1e9),
             FleetConfig(FleetSpec(16, router=args.router, predictor="none"), "h100-80g", "llama-3.1-8b",
                         scheduler=sched))
    cases = [(*azure, 0.0)]
    if not args.skip_million:
        cases.append((f"{args.million:,} synthetic, 64 x H100",
                      WorkloadSpec("synthetic", rate=args.million_rate, num_requests=args.million, input_len=512,
                                   output_len=128),
                      FleetConfig(FleetSpec(64, router=args.router, predictor="none"), "h100-80g", "llama-3.1-8b",
                                  scheduler=sched), 0.0))
    cases.append((azure[0] + ", timeline every 6 s", azure[1], azure[2], 6.0))
    console = Console()
    rows = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("sim {task.fields[sim_time]:.0f} s"), TimeElapsedColumn(), console=console) as progress:
        for name, spec, fleet, interval in cases:
            rows.append(run_case(name, spec, fleet, progress, interval))
    table = Table(title="simulator speed")
    for col in ("case", "requests", "completed", "sim time s", "wall s", "x real time", "events", "p99 TTFT ms"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["case"], f"{r['requests']:,}", f"{r['completed']:,}", f"{r['sim_time_s']:.0f}",
                      f"{r['wall_s']:.1f}", f"{r['speedup']:.0f}", f"{r['events']:,}", f"{r['p99_ttft_ms']:.0f}")
    console.print(table)
    plain, recorded = rows[0], rows[-1]
    console.print(f"recording the timeline ({recorded['timeline_frames']} frames): wall x"
                  f"{recorded['wall_s'] / plain['wall_s']:.3f} of the same run without it; p99 TTFT "
                  f"{'unchanged' if recorded['p99_ttft_ms'] == plain['p99_ttft_ms'] else 'CHANGED'}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"sim_speed-{stamp}.json"
    out.write_text(json.dumps({"when": stamp, "cases": rows}, indent=1))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        ax.barh([r["case"] for r in rows], [r["speedup"] for r in rows])
        ax.set_xlabel("simulated time / wall time")
        ax.set_xscale("log")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=120)
    except ImportError:
        pass
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
