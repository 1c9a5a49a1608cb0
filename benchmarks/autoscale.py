#!/usr/bin/env python3
"""Autoscaling on a simulated fleet: GPU-hours against SLO attainment, per policy and cold start.

Demand: the shape of ServeGen's m-large total request rate (10-minute windows) over `--hours`
of day `--day`, rescaled so that its peak needs `--peak` instances at the capacity model's rate;
arrivals are Poisson within each window. Request lengths are drawn from a trace (`--lengths`,
Azure conversation by default). The days before `--day`, rescaled the same way, are the
forecaster's history (predictive, hybrid). Policies: static at the peak's size, static at the
mean's size, reactive, predictive, hybrid; each at every `--cold-starts` time. Per run: GPU-hours
(instance-hours x TP), SLO attainment, cold starts, peak instances; the instance count over time
is drawn for the first cold start.

    python benchmarks/autoscale.py --quick                      # ~3 hours of demand, small fleet
    python benchmarks/autoscale.py --hours 24 --peak 32 --cold-starts 30,120,300
    python benchmarks/autoscale.py --hours 24 --start-hour 0 --peak 64 --fidelity fluid --forecaster gbm \
        --utilizations 0.6,0.7,0.8,0.9 --seeds 5            # a day at flow level: seconds per policy
    python benchmarks/autoscale.py --hours 3 --peak 4 --fidelity both   # each run discrete and fluid, side by side
Writes benchmarks/results/autoscale-STAMP.json and benchmarks/figures/autoscale.png.
"""
from __future__ import annotations

import argparse
import json
import math
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

from sloserve.bench.metrics import SLO  # noqa: E402
from sloserve.cluster.spec import FleetSpec  # noqa: E402
from sloserve.core.config import SchedulerConfig  # noqa: E402
from sloserve.evaluation.decisions.autoscaling import poisson_requests  # noqa: E402
from sloserve.planning import (CURVE_DURATION_S, CURVE_INSTANCES, CURVE_LOADS, instance_capacity,  # noqa: E402
                               pool_capacity, response_curve)
from sloserve.sim.catalog import get_model  # noqa: E402
from sloserve.simulation import FleetConfig, build_fleet, build_fluid, sim_requests, simulate  # noqa: E402
from sloserve.workload.series import Series, servegen_series  # noqa: E402
from sloserve.workload.traces import load_file, shared_path  # noqa: E402
from sloserve.workload.types import WorkloadRequest  # noqa: E402

POLICIES = ("static-peak", "static-mean", "reactive", "predictive", "hybrid")
DAY = 86400.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--day", type=int, default=12, help="which ServeGen day (0-13) to replay; the ones before train")
    p.add_argument("--start-hour", type=float, default=5.0, help="where in that day the run starts")
    p.add_argument("--hours", type=float, default=6.0)
    p.add_argument("--peak", type=int, default=16, help="instances the run's peak demand needs")
    p.add_argument("--cold-starts", default="30,120,300", help="seconds, comma-separated")
    p.add_argument("--lengths", default="azure-conv", help="trace whose prompt/output lengths the requests take")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--hardware", default="h100-80g")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--slo", default="ttft=1000,tpot=100")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--forecaster", default="seasonal-naive")
    p.add_argument("--forecast-level", type=float, default=0.9, help="predictive/hybrid: the band planned for")
    p.add_argument("--quick", action="store_true", help="3 hours, peak 8, cold starts 30,120")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=int, default=2048, help="tokens per step (chunked prefill's budget)")
    p.add_argument("--demand-capacity", type=float, metavar="RPS",
                   help="size the demand with this per-instance rate instead of the measured one (the peak needs "
                        "--peak instances of it): the same requests for runs whose fleets differ")
    p.add_argument("--pd", action="store_true",
                   help="also run each policy on a prefill/decode-disaggregated fleet whose pools scale apart")
    p.add_argument("--no-figure", action="store_true", help="leave benchmarks/figures/ alone (results JSON only)")
    p.add_argument("--utilizations", default="0.8",
                   help="target utilisations (comma-separated) of the reactive, predictive and hybrid policies: "
                        "each a run, so that policies compare along their GPU-hours / attainment trade-off")
    p.add_argument("--seeds", type=int, default=1,
                   help="fluid runs: this many demand-noise seeds per run (the median run is reported, with the range)")
    p.add_argument("--fidelity", choices=("discrete", "fluid", "both"), default="discrete",
                   help="discrete: every request through the simulated schedulers; fluid: demand as a flow priced by "
                        "a response curve the discrete simulator measures first (sim/fluid.py; days on tens of "
                        "instances); both: each run both ways, side by side (colocated only)")
    return p.parse_args()


def demand(args: argparse.Namespace) -> tuple[Series, Series]:
    """(history before the run, the run's windows), both in the series' own units (req/s)."""
    series = servegen_series("m-large")
    per_day = series.steps_per_day
    first = args.day * per_day + round(args.start_hour * 3600 / series.step_s)
    n = math.ceil(args.hours * 3600 / series.step_s)
    values = np.nan_to_num(series.values, nan=float(np.nanmedian(series.values)))
    return (Series("history", values[:first], series.step_s, series.start_s),
            Series("run", values[first:first + n], series.step_s, series.start_s + first * series.step_s))


def requests(run: Series, scale: float, lengths: list[WorkloadRequest], seed: int) -> list[WorkloadRequest]:
    """Poisson arrivals at `scale` x the run's rate in each window, lengths drawn from a trace."""
    return poisson_requests(run.values * scale, run.step_s, lengths, seed)

DECODE_ROUTER = "least-kv"  # a P/D fleet's pick of a hand-off's decode instance


def main() -> int:
    args = parse_args()
    if args.quick:
        args.hours, args.peak, args.cold_starts = 3.0, 8, "30,120"
    console = Console()
    slo = SLO.parse(args.slo)
    base = FleetConfig(FleetSpec(args.peak, router="least-requests", migration="drain", migration_interval_s=0.1),
                       hardware=args.hardware, model=args.model, tp=args.tp,
                       scheduler=SchedulerConfig(max_num_batched_tokens=args.budget, max_num_seqs=256))
    lengths = load_file(shared_path(args.lengths), source=args.lengths)
    context = get_model(args.model).max_position_embeddings
    fits = [r for r in lengths if r.prompt_len + r.output_len <= context]
    console.print(f"{len(lengths) - len(fits)} of {len(lengths)} {args.lengths} requests exceed {args.model}'s "
                  f"{context}-token context and are not drawn (a server would refuse them, whatever the policy)")
    lengths = fits
    console.print(f"capacity model: one {args.model} instance on {args.hardware} at SLO {args.slo} ...")
    # measured on requests shaped like the run's (Poisson arrivals, the same length draw), not the trace's own
    # bursty pattern, which would understate what an instance sustains here
    probe = requests(Series("probe", np.ones(60), 60.0), 1.0, lengths, args.seed + 1)
    capacity = instance_capacity(probe, base, slo, sample=len(probe))
    history, run = demand(args)
    sizing = args.demand_capacity or capacity
    scale = args.peak * sizing * 0.8 / float(run.values.max())  # the peak needs `peak` instances at 80%
    discrete = args.fidelity in ("discrete", "both")
    reqs = requests(run, scale, lengths, args.seed) if discrete else []
    curve = None
    if args.fidelity != "discrete":
        need = math.ceil(max(CURVE_LOADS) * capacity * CURVE_INSTANCES * CURVE_DURATION_S * 1.05)
        curve_probe = requests(Series("curve", np.ones(math.ceil(need / 60)), 60.0), 1.0, lengths, args.seed + 2)
        console.print(f"response curve: {CURVE_INSTANCES} instances at {len(CURVE_LOADS)} loads, "
                      f"{CURVE_DURATION_S:g} s each ({len(curve_probe)} requests) ...")
        curve = response_curve(curve_probe, base.with_fleet(router="least-requests"), slo, capacity)
        console.print("attainment by load: " + ", ".join(f"{x:g}: {100 * a:.1f}%" for x, a in
                                                         zip(curve.loads, curve.attainment))
                      + f"; saturation {curve.saturation_rps:.2f} req/s per instance")
    hist = Series("history", history.values * scale, history.step_s, history.start_s)
    mean_need = math.ceil(float(run.values.mean()) * scale / (capacity * 0.8))
    peak_need = math.ceil(float(run.values.max()) * scale / (capacity * 0.8))  # = --peak unless --demand-capacity
    base = base.with_fleet(instances=max(args.peak, peak_need))
    expected = float(run.values.sum() * run.step_s * scale)
    console.print(f"capacity {capacity:.2f} req/s per instance; {len(reqs) or expected:.0f} requests over {args.hours:g} h; demand "
                  f"{run.values.min() * scale:.1f}-{run.values.max() * scale:.1f} req/s (mean needs {mean_need}, "
                  f"peak {peak_need} instances)")
    pools = None
    if args.pd:
        pools = pool_capacity(probe, base.with_fleet(pd=(1, 1), decode_router=DECODE_ROUTER), slo, sample=len(probe))
        console.print(f"P/D pools: one prefill instance carries {pools[0]:.2f} req/s, one decode instance "
                      f"{pools[1]:.2f} req/s")
    cold_starts = [float(x) for x in args.cold_starts.split(",")]
    policies = [p for p in args.policies.split(",") if p]
    fidelities = {"discrete": ("discrete",), "fluid": ("fluid",), "both": ("discrete", "fluid")}[args.fidelity]
    utilizations = [float(x) for x in args.utilizations.split(",")]
    jobs = [(c, p, pd, f, u) for c in cold_starts for p in policies for pd in ((False, True) if pools else (False,))
            for f in fidelities if not (pd and f == "fluid")
            for u in ((0.8,) if p.startswith("static") else utilizations)]
    rows = []
    t0 = time.perf_counter()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("runs", total=len(jobs))
        for cold, policy, pd, fidelity, utilization in jobs:
            if pd:  # each pool sized by its own capacity; autoscaled pools may grow to twice the peak's need
                rate = float(run.values.max() if policy == "static-peak" else run.values.mean()) * scale
                need = [max(1, math.ceil(rate / (c * 0.8))) for c in pools]  # type: ignore[union-attr]
                if policy.startswith("static"):
                    sizes = (need[0], need[1])
                    cfg = replace(base.with_fleet(pd=sizes, decode_router=DECODE_ROUTER, pd_min=sizes,
                                                  autoscale="static"), pd_initial=sizes)
                else:
                    most = [max(args.peak, 2 * math.ceil(float(run.values.max()) * scale / (c * 0.8)))
                            for c in pools]  # type: ignore[union-attr]
                    cfg = replace(base.with_fleet(pd=(most[0], most[1]), decode_router=DECODE_ROUTER, pd_min=(1, 1),
                                                  autoscale=policy), pd_initial=(need[0], need[1]))
                cfg = cfg.with_fleet(pd_capacity=pools)
            elif policy.startswith("static"):
                n = peak_need if policy == "static-peak" else mean_need
                cfg = replace(base.with_fleet(instances=n, autoscale="static", min_instances=n), initial_instances=n)
            else:
                cfg = replace(base.with_fleet(autoscale=policy, min_instances=1), initial_instances=mean_need)
            cfg = replace(cfg.with_fleet(capacity_rps=capacity, scaling_interval_s=60.0, scale_down_delay_s=300.0,
                                         forecaster=args.forecaster, forecast_level=args.forecast_level,
                                         target_utilization=utilization),
                          cold_start_s=cold, demand_step_s=60.0, scaling_history=hist)
            t_run = time.perf_counter()
            spread = None
            if fidelity == "fluid":
                runs = sorted((build_fluid(cfg, curve, slo.ttft_s, seed=args.seed + k).run(run.values * scale, run.step_s)
                               for k in range(args.seeds)), key=lambda f: f.attainment)
                fluid = runs[len(runs) // 2]
                spread = [runs[0].attainment, runs[-1].attainment]
                sc, met, failed, n_reqs = fluid.scaling, fluid.attainment, fluid.unserved, fluid.requests
            else:
                records, result = simulate(build_fleet(cfg), sim_requests(reqs))
                sc = result.scaling
                met = sum(slo.met(r) for r in records) / max(1, len(records))
                failed = len(reqs) - len(records) + sum(not r.success for r in records)
                n_reqs = len(reqs)
            rows.append({"policy": policy + (" (P/D)" if pd else ""), "cold_start_s": cold, "fidelity": fidelity,
                         "utilization": utilization, "attainment_range": spread,
                         "pool_gpu_hours": {k: v * args.tp for k, v in sc.get("pool_instance_hours", {}).items()},
                         "gpu_hours": sc["instance_hours"] * args.tp,
                         "attainment": met, "cold_starts": sc["cold_starts"],
                         "peak_ready": max((r[1] for r in sc["timeline"]), default=0),
                         "timeline": [(r[0], r[1], r[2]) for r in sc["timeline"]], "failed": failed,
                         "requests": n_reqs, "wall_s": time.perf_counter() - t_run})
            progress.advance(task)
    table = Table(title=f"{args.hours:g} h of ServeGen m-large (day {args.day}, from {args.start_hour:g} h), "
                        f"peak {args.peak} x {args.model} on {args.hardware}, SLO {args.slo}")
    for col in ("cold start", "policy", "util.", "fidelity", "GPU-hours", "vs static-peak", "SLO attainment",
                "cold starts", "peak ready", "requests", "wall s"):
        table.add_column(col, justify="right")
    for r in rows:
        ref = next((x for x in rows if x["policy"] == "static-peak" and x["cold_start_s"] == r["cold_start_s"]
                    and x["fidelity"] == r["fidelity"]), None)
        r["vs_static_peak"] = r["gpu_hours"] / ref["gpu_hours"] if ref else None
        spread = r["attainment_range"]
        table.add_row(f"{r['cold_start_s']:g} s", r["policy"], f"{r['utilization']:g}", r["fidelity"],
                      f"{r['gpu_hours']:.1f}", f"{r['vs_static_peak']:.3f}x" if ref else "-",
                      f"{100 * r['attainment']:.2f}%" + (f" ({100 * spread[0]:.2f}-{100 * spread[1]:.2f})"
                                                         if spread and len(set(spread)) > 1 else ""),
                      str(r["cold_starts"]), str(r["peak_ready"]), f"{r['requests']:.0f}", f"{r['wall_s']:.1f}")
    console.print(table)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = REPO / "benchmarks" / "results" / f"autoscale-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"when": stamp, "args": vars(args), "capacity_rps": capacity, "pd_capacity": pools,
                               "requests": len(reqs) or expected,
                               "response_curve": curve.as_dict() if curve else None,
                               "machine": platform.processor() or platform.machine(),
                               "wall_s": time.perf_counter() - t0, "rows": rows}, indent=1))
    name = "autoscale" + ("" if args.forecaster == "seasonal-naive" else f"-{args.forecaster}") + ("-pd" if pools else "") \
        + ("" if args.forecast_level == 0.9 else f"-band{args.forecast_level:g}") \
        + ("" if args.fidelity == "discrete" else f"-{args.fidelity}-{args.hours:g}h-peak{args.peak}")
    figure = REPO / "benchmarks" / "figures" / f"{name}.png"
    if args.no_figure:
        console.print(f"wrote {out} ({time.perf_counter() - t0:.0f} s)")
        return 0
    plot(rows, run, scale, capacity, figure, cold_starts[0])
    if len(utilizations) > 1:
        tradeoff = figure.with_name(figure.stem + "-tradeoff.png")
        plot_tradeoff(rows, tradeoff, f"{args.hours:g} h of ServeGen m-large, peak {args.peak} x {args.model} on "
                                      f"{args.hardware} ({args.fidelity}), a point per target utilisation")
        figure = tradeoff
    console.print(f"wrote {out} and {figure.relative_to(REPO)} ({time.perf_counter() - t0:.0f} s)")
    return 0


def plot(rows: list[dict], run: Series, scale: float, capacity: float, path: Path, cold: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5), layout="constrained")
    hours = [k * run.step_s / 3600 for k in range(len(run.values) + 1)]
    need = [v * scale / (capacity * 0.8) for v in run.values]
    ax.step(hours, need + need[-1:], where="post", color="black", linewidth=1.2, label="instances the demand needs")
    for r in rows:
        if r["cold_start_s"] != cold or r.get("utilization", 0.8) != 0.8:
            continue
        t = [x[0] / 3600 for x in r["timeline"]]
        fluid = r.get("fidelity") == "fluid"
        ax.step(t, [x[1] for x in r["timeline"]], where="post", linestyle="--" if fluid else "-",
                label=f"{r['policy']} ({'fluid, ' if fluid else ''}ready)")
    ax.set_xlabel("hours into the run")
    ax.set_ylabel("instances")
    ax.set_title(f"ready instances per policy, cold start {cold:g} s")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tradeoff(rows: list[dict], path: Path, title: str) -> None:
    """GPU-hours (of static-peak's) against SLO attainment, a panel per cold start, a line per policy
    through its target utilisations: a policy beats another where its line lies above and left."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colds = sorted({r["cold_start_s"] for r in rows})
    fig, axes = plt.subplots(1, len(colds), figsize=(5 * len(colds), 4.2), layout="constrained", sharey=True)
    for ax, cold in zip(np.atleast_1d(axes), colds):
        here = [r for r in rows if r["cold_start_s"] == cold and r.get("vs_static_peak")]
        for policy in dict.fromkeys(r["policy"] for r in here):
            pts = sorted((r["vs_static_peak"], 100 * r["attainment"], r["utilization"]) for r in here
                         if r["policy"] == policy)
            label = policy if len(pts) > 1 else f"{policy} ({pts[0][1]:.1f}%)"  # a static point may sit below the axis
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
            if len(pts) > 1:
                for x, y, u in pts:
                    ax.annotate(f"{u:g}", (x, y), fontsize=7, textcoords="offset points", xytext=(3, -9))
        scaled = [100 * r["attainment"] for r in here if not r["policy"].startswith("static")]
        ax.set_ylim(max(80.0, min(scaled, default=99.0) - 1), 100.3)
        ax.axhline(99, color="grey", linewidth=0.8, linestyle=":")
        ax.axvline(0.6, color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(f"cold start {cold:g} s")
        ax.set_xlabel("GPU-hours / static at peak")
        ax.grid(alpha=0.3)
    np.atleast_1d(axes)[0].set_ylabel("SLO attainment (%)")
    for ax in np.atleast_1d(axes):
        ax.legend(fontsize="x-small", loc="lower right")
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
