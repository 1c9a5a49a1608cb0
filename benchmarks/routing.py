"""Routing policies on a simulated fleet: 16 x Llama-3.1-8B on H100, three production traces.

For each trace (Azure 2023 conversation, Azure 2023 code, Mooncake FAST'25 conversation):

1. Take a fixed window of the trace: its first N requests, their own lengths, prefix ids and
   arrival pattern.
2. Measure the fleet's capacity: the highest mean rate (the trace's arrival pattern rescaled
   to that rate) at which least-requests routing still meets the SLO for >= 90% of requests,
   found by bisection on the rate (bracketed from the fleet's saturation throughput). Each rate
   is tried with at least `--sustain` seconds of the trace's arrivals (default 60: more of the
   trace past the window, up to `--max-requests`; planning.sustained), and a rate the trace
   cannot hold that long is not credited (planning.search_rate): the capacity is then a lower
   bound, warned and marked >=. A window squeezed to a high rate is a burst the fleet absorbs
   within a loose TTFT, not a rate it sustains (2,000 Azure requests at 700 req/s last 3 s).
3. Replay the same requests at 50% ... 110% of that capacity under every policy and record
   SLO attainment, P50/P99 TTFT, P99 TPOT, preemptions and the prefix-cache hit rate.

Every policy runs with the packaged output-length predictor (length-only: the traces carry
no text; online adaptation on), so no policy sees the recorded output lengths. Writes JSON,
a markdown table and a PNG to benchmarks/results/, and prints the ratios at >= 80% load.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import dataclass, fields, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from sloserve.bench.metrics import SLO, jsonable, percentile
from sloserve.cluster.spec import FleetSpec
from sloserve.core.config import SchedulerConfig
from sloserve.planning import SUSTAIN_S, Goodput, Sustained, at_rate, search_rate, sustained
from sloserve.simulation import FleetConfig, build_fleet, make_predictions, sim_requests, simulate
from sloserve.workload.build import WorkloadSpec, build_stream
from sloserve.workload.types import WorkloadRequest

logger = logging.getLogger("routing")
RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("round-robin", "least-requests", "least-kv", "power-of-two", "prefix-affinity", "predicted-load")
LOADS = (0.5, 0.8, 0.9, 1.0, 1.1)
CAPACITY_ROUTER = "least-requests"
CAPACITY_ATTAINMENT = 0.9
SPEC_FIELDS = {f.name for f in fields(FleetSpec)}  # run's options that go to the fleet's spec


@dataclass(frozen=True)
class Trace:
    name: str  # workload name
    label: str
    num_requests: int
    slo: SLO
    start_s: float = 0.0
    replay: bool = True  # False: a trace without times (ShareGPT), Poisson arrivals at 1 req/s


TRACES = (
    Trace("azure-conv", "Azure conv", 2000, SLO(ttft_s=1.0, tpot_s=0.1)),
    Trace("azure-code", "Azure code", 2000, SLO(ttft_s=1.0, tpot_s=0.1)),
    Trace("mooncake-conv", "Mooncake conv", 400, SLO(ttft_s=3.0, tpot_s=0.1)),
)


def window(trace: Trace) -> list[WorkloadRequest]:
    """The trace's first N requests (after start_s), arrival times relative to the first."""
    reqs = build_stream(WorkloadSpec(trace.name, replay=trace.replay, rate=None if trace.replay else 1.0,
                                     start_s=trace.start_s, num_requests=trace.num_requests))
    t0 = reqs[0].arrival_s
    return [replace(r, arrival_s=r.arrival_s - t0) for r in reqs]


def run(reqs: list[WorkloadRequest], policy: str, slo: SLO, instances: int, seed: int = 0, **fleet_options) -> dict:
    """One simulated run; `fleet_options` override FleetSpec fields (migration, pd, ...; a `pd` fleet has P + D
    instances) and FleetConfig ones (hardware, model, link, ...)."""
    options = {"hardware": "h100-80g", "model": "llama-3.1-8b", **fleet_options}
    spec_options = {name: options.pop(name) for name in SPEC_FIELDS & set(options)}
    spec = FleetSpec(instances, router=policy, predictor="default", router_seed=seed)
    fleet = FleetConfig(spec.with_pd(spec_options.pop("pd", None), **spec_options),
                        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256), **options)
    predictions = make_predictions(fleet)
    sim = build_fleet(fleet, predictions)
    t0 = time.perf_counter()
    records, result = simulate(sim, sim_requests(reqs, predictions=predictions), predictions=predictions)
    wall = time.perf_counter() - t0
    ok = [r for r in records if r.success]
    ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    tpot = sorted(t for t in (r.tpot_s for r in ok) if t is not None)
    hits = sum(i.kv.stats.hits for i in sim.instances)
    queries = sum(i.kv.stats.queries for i in sim.instances)
    return {
        "policy": policy, "requests": len(reqs), "completed": result.num_finished,
        "slo_attainment": sum(slo.met(r) for r in records) / max(1, len(reqs)),
        "p50_ttft_s": percentile(ttft, 50), "p99_ttft_s": percentile(ttft, 99), "p99_tpot_s": percentile(tpot, 99),
        "preemptions": sum(i.scheduler.stats.num_preemptions for i in sim.instances),
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "sim_s": result.end_time, "wall_s": wall,
    }


def longer_windows(trace: Trace) -> Callable[[int], list[WorkloadRequest]]:
    """The trace's first n requests, for any n (loaded once per size, rounded up to 1,000): what a
    sustained probe draws from past the window."""
    loaded: dict[int, list[WorkloadRequest]] = {}

    def first(n: int) -> list[WorkloadRequest]:
        size = -(-n // 1000) * 1000
        if size not in loaded:
            loaded[size] = window(replace(trace, num_requests=size))
        return loaded[size][:n]
    return first


def search_capacity(reqs: list[WorkloadRequest], slo: SLO, instances: int, iters: int,
                    requests_at: Optional[Callable[[float], list[WorkloadRequest]]] = None,
                    min_duration_s: float = SUSTAIN_S, **fleet_options) -> tuple[Goodput, list[dict]]:
    """Highest rate at which the capacity router keeps >= 90% attainment (bisection on rate), as
    planning.search_rate's answer (the rate, how long it was held, and whether the sample bounded it).

    Bracketing starts from the burst throughput (every request at once: requests / makespan).
    That is not an upper bound here (a burst's makespan is set by its longest outputs, not by
    the fleet's rate), so the bracket doubles up from it, or halves down, until one end meets
    the SLO and the other does not; then `iters` geometric bisection steps. `requests_at` gives the
    requests each rate is tried with (a planning.sustained probe: a rate it cannot hold for its
    minimum duration is not credited); by default `reqs` at that rate, held for `min_duration_s`
    (rates past len(reqs) / min_duration_s are not credited; 0: every rate is tried with `reqs`,
    however short they last at it)."""
    probes: list[dict] = []
    probe = requests_at if requests_at is not None else sustained(lambda n: reqs[:n], len(reqs), min_duration_s,
                                                                  len(reqs))

    def meets(tried: list[WorkloadRequest], rate: float) -> bool:
        res = run(tried, CAPACITY_ROUTER, slo, instances, **fleet_options)
        probes.append({"rate": rate, **res})
        logger.info("  capacity probe %.1f req/s (%d requests, %.0f s): attainment %.1f%%", rate, len(tried),
                    len(tried) / rate, 100 * res["slo_attainment"])
        return res["slo_attainment"] >= CAPACITY_ATTAINMENT

    burst = run([replace(r, arrival_s=0.0) for r in reqs], CAPACITY_ROUTER, slo, instances, **fleet_options)
    probes.append({"rate": None, "burst": True, **burst})
    start = len(reqs) / burst["sim_s"]
    found = search_rate(meets, probe, start, iters)
    if found.limited:  # the rate the search wanted but the sample could not hold: not run, not credited
        probes.append({"rate": found.refused_rps, "refused": True, "requests": found.refused_requests})
    logger.info("burst throughput %.1f req/s, capacity %s%.1f req/s (held %.0f s, %d requests)", start,
                ">=" if found.limited else "", found.rps, found.held_s, found.requests)
    return found, probes


def warn_if_limited(found: Goodput, min_duration_s: float, what: str) -> bool:
    """One warning line when the sample bounded the search (the capacity is a lower bound), or, for a search
    that held rates for no minimum duration (`min_duration_s` 0), when its answer lasted under SUSTAIN_S of
    arrivals (a burst the fleet absorbed, not a rate it sustains). Whether it warned."""
    if found.limited:
        logger.warning("capacity of %s: %.2f req/s is a lower bound: holding %g s of arrivals at %.2f req/s needs %d "
                       "requests, the sample gave %d (give the search more: --max-requests, a longer trace)", what,
                       found.rps, min_duration_s, found.refused_rps, math.ceil(found.refused_rps * min_duration_s),
                       found.refused_requests)
        return True
    if min_duration_s <= 0 and found.rps > 0 and found.held_s < SUSTAIN_S:
        logger.warning("capacity of %s: %.2f req/s held only %.1f s of arrivals (%d requests): a burst the fleet "
                       "absorbs, not a rate it sustains (hold rates for %g s: --sustain)", what, found.rps,
                       found.held_s, found.requests, SUSTAIN_S)
        return True
    return False


def measure_capacity(reqs: list[WorkloadRequest], slo: SLO, instances: int, iters: int,
                     requests_at: Optional[Callable[[float], list[WorkloadRequest]]] = None,
                     min_duration_s: float = SUSTAIN_S, **fleet_options) -> tuple[float, list[dict]]:
    """`search_capacity`'s rate, with its probes; a warning when it is a lower bound (the sample could not
    hold a rate the search wanted to try for the probe's minimum duration)."""
    found, probes = search_capacity(reqs, slo, instances, iters, requests_at, min_duration_s, **fleet_options)
    # seconds each rate was held for: the probe's; a probe that is not `sustained` held none
    need = requests_at.min_duration_s if isinstance(requests_at, Sustained) else \
        min_duration_s if requests_at is None else 0.0
    warn_if_limited(found, need, f"{instances} instances")
    return found.rps, probes


def bound(t: dict) -> str:
    """'>=' before a capacity the search could only bound from below."""
    return ">=" if t.get("capacity_limited") else ""


def held(t: dict) -> str:
    """How long the capacity was held, for a heading (nothing for a capacity given on the command line)."""
    return f"held {t['capacity_held_s']:.0f} s; " if t.get("capacity_held_s") is not None else ""


def fmt_ms(s: float) -> str:
    return "—" if s is None or (isinstance(s, float) and math.isnan(s)) else f"{1e3 * s:,.0f}"


def markdown(results: dict) -> str:
    lines = []
    for t in results["traces"]:
        lines += [f"#### {t['label']} — {t['requests']} requests, capacity {bound(t)}{t['capacity_rps']:.1f} "
                  f"req/s ({held(t)}SLO: TTFT ≤ {1e3 * t['slo']['ttft_s']:.0f} ms, "
                  f"TPOT ≤ {1e3 * t['slo']['tpot_s']:.0f} ms)", "",
                  "| load | policy | SLO attainment | P50 TTFT ms | P99 TTFT ms | P99 TPOT ms | preemptions | prefix hit |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|"]
        for row in t["runs"]:
            lines.append(f"| {100 * row['load']:.0f}% | {row['policy']} | {100 * row['slo_attainment']:.1f}% | "
                         f"{fmt_ms(row['p50_ttft_s'])} | {fmt_ms(row['p99_ttft_s'])} | {fmt_ms(row['p99_tpot_s'])} | "
                         f"{row['preemptions']} | {100 * row['prefix_hit_rate']:.1f}% |")
        lines.append("")
    lines += ["#### Ratios at ≥ 80% load (baseline ÷ policy for P99 TTFT; attainment in points)", "",
              "| trace | load | policy | P99 TTFT vs round-robin | vs least-requests | attainment vs RR | vs LR |",
              "|---|---:|---|---:|---:|---:|---:|"]
    for r in ratios(results):
        lines.append(f"| {r['trace']} | {100 * r['load']:.0f}% | {r['policy']} | {r['ttft_vs_rr']:.2f}× | "
                     f"{r['ttft_vs_lr']:.2f}× | {100 * r['att_vs_rr']:+.1f} | {100 * r['att_vs_lr']:+.1f} |")
    return "\n".join(lines) + "\n"


def ratios(results: dict, policies=("predicted-load", "prefix-affinity")) -> list[dict]:
    out = []
    for t in results["traces"]:
        by = {(r["load"], r["policy"]): r for r in t["runs"]}
        for load in sorted({r["load"] for r in t["runs"]}):
            if load < 0.8 - 1e-9:
                continue
            rr, lr = by.get((load, "round-robin")), by.get((load, "least-requests"))
            for p in policies:
                me = by.get((load, p))
                if not (me and rr and lr):
                    continue
                out.append({"trace": t["label"], "load": load, "policy": p,
                            "ttft_vs_rr": rr["p99_ttft_s"] / me["p99_ttft_s"],
                            "ttft_vs_lr": lr["p99_ttft_s"] / me["p99_ttft_s"],
                            "att_vs_rr": me["slo_attainment"] - rr["slo_attainment"],
                            "att_vs_lr": me["slo_attainment"] - lr["slo_attainment"]})
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = results["traces"]
    fig, axes = plt.subplots(2, len(traces), figsize=(5 * len(traces), 7), squeeze=False)
    for col, t in enumerate(traces):
        for policy in results["policies"]:
            rows = [r for r in t["runs"] if r["policy"] == policy]
            x = [100 * r["load"] for r in rows]
            axes[0][col].plot(x, [100 * r["slo_attainment"] for r in rows], marker="o", label=policy)
            axes[1][col].plot(x, [1e3 * r["p99_ttft_s"] for r in rows], marker="o", label=policy)
        axes[0][col].set_title(f"{t['label']} (capacity {bound(t)}{t['capacity_rps']:.0f} req/s)")
        axes[0][col].set_ylabel("SLO attainment %")
        axes[1][col].set_ylabel("P99 TTFT ms")
        axes[1][col].set_yscale("log")
        axes[1][col].set_xlabel("load, % of measured capacity")
        for ax in (axes[0][col], axes[1][col]):
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("16 x Llama-3.1-8B on H100 (simulated): routing policies")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", default=",".join(t.name for t in TRACES))
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS), help="fractions of measured capacity")
    p.add_argument("--instances", type=int, default=16)
    p.add_argument("--requests", type=float, default=1.0, help="scale every trace's request count")
    p.add_argument("--capacity-iters", type=int, default=3, help="bisection steps after bracketing")
    p.add_argument("--capacity", help="skip the search: trace=req/s,... (e.g. from an earlier run)")
    p.add_argument("--sustain", type=float, default=SUSTAIN_S, metavar="S",
                   help="try each rate of the capacity search with at least S seconds of the trace's arrivals (more "
                        "of the trace past the window, up to --max-requests; planning.sustained); a rate the trace "
                        "cannot hold that long is not credited (the capacity is then a lower bound, marked >=). "
                        "0: the window alone squeezed to each rate (a burst at high rates, as the runs before this "
                        "option)")
    p.add_argument("--max-requests", type=int, default=20000, help="with --sustain: at most this many per probe")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--figure", type=Path, help="also save the PNG here (BENCHMARKS.md shows benchmarks/figures/routing.png)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    policies = args.policies.split(",")
    loads = [float(x) for x in args.loads.split(",")]
    given = dict(kv.split("=") for kv in args.capacity.split(",")) if args.capacity else {}
    chosen = [t for t in TRACES if t.name in args.traces.split(",")]
    results = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "instances": args.instances,
               "hardware": "h100-80g", "model": "llama-3.1-8b", "policies": policies, "loads": loads,
               "predictor": "default (length-only, online)", "capacity_router": CAPACITY_ROUTER,
               "capacity_attainment": CAPACITY_ATTAINMENT, "sustain_s": args.sustain,
               "max_requests": args.max_requests, "traces": []}
    t_start = time.perf_counter()
    for trace in chosen:
        trace = replace(trace, num_requests=max(50, int(trace.num_requests * args.requests)))
        reqs = window(trace)
        found: Optional[Goodput] = None
        if trace.name in given:
            capacity, probes = float(given[trace.name]), []
        else:
            requests_at = sustained(longer_windows(trace), len(reqs), args.sustain, max(len(reqs), args.max_requests))
            found, probes = search_capacity(reqs, trace.slo, args.instances, args.capacity_iters, requests_at)
            warn_if_limited(found, args.sustain, f"{args.instances} instances on {trace.label}")
            capacity = found.rps
        entry = {"name": trace.name, "label": trace.label, "requests": len(reqs), "capacity_rps": capacity,
                 "capacity_held_s": found.held_s if found and found.rps > 0 else None,
                 "capacity_limited": found.limited if found else None,
                 "capacity_search": found.as_dict() if found else None,
                 "slo": {"ttft_s": trace.slo.ttft_s, "tpot_s": trace.slo.tpot_s}, "capacity_probes": probes,
                 "runs": []}
        for load in loads:
            batch = at_rate(reqs, load * capacity)
            for policy in policies:
                res = run(batch, policy, trace.slo, args.instances, args.seed)
                entry["runs"].append({"load": load, "rate": load * capacity, **res})
                logger.info("%s %3.0f%% %-15s attain %5.1f%%  p99 TTFT %7s ms  p99 TPOT %5s ms  preempt %4d  "
                            "hit %4.1f%%  (%.1f s)", trace.label, 100 * load, policy, 100 * res["slo_attainment"],
                            fmt_ms(res["p99_ttft_s"]), fmt_ms(res["p99_tpot_s"]), res["preemptions"],
                            100 * res["prefix_hit_rate"], res["wall_s"])
        results["traces"].append(entry)
    results["wall_s"] = time.perf_counter() - t_start
    results["ratios"] = ratios(results)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    base = args.out / f"routing-{stamp}"
    base.with_suffix(".json").write_text(json.dumps(jsonable(results), indent=1))
    md = markdown(results)
    base.with_suffix(".md").write_text(md)
    plot(results, base.with_suffix(".png"))
    if args.figure:
        args.figure.parent.mkdir(parents=True, exist_ok=True)
        plot(results, args.figure)
    print(md)
    logger.info("total %.0f s; wrote %s.{json,md,png}", results["wall_s"], base)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
