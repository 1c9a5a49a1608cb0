"""`sloserve place`: choose which queries a small model answers and where both models run on
several GPU types, jointly (multi-objective Bayesian optimisation over simulations) and one after
the other, and compare the two Pareto fronts of cost against P95 latency (sloserve/hetero.py)."""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)


def add_place_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("place", help="route queries between a small and a large model and deploy both on GPU types: "
                                     "joint vs sequential search (BOute), on the simulator")
    p.add_argument("--workload", default="azure-conv", help="trace whose lengths the queries take (default %(default)s)")
    p.add_argument("--rate", type=float, default=20.0, help="queries/s, Poisson (default %(default)s)")
    p.add_argument("--duration", type=float, default=120.0, metavar="S", help="seconds of arrivals (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="workload and difficulty scores")
    p.add_argument("--small", default="llama-3.1-8b")
    p.add_argument("--large", default="llama-3.1-70b")
    p.add_argument("--gpus", default="h100-80g=8,a100-80g=8,a10-24g=16",
                   help="GPU types and how many of each there are (default %(default)s)")
    p.add_argument("--prices", default="", help="dollars per GPU-hour over the defaults, e.g. l40s=0.9")
    p.add_argument("--quality", type=float, default=0.95,
                   help="quality to keep, relative to sending everything to the large model (default %(default)s)")
    p.add_argument("--quality-gap", type=float, default=None,
                   help="how much worse the small model answers the hardest query (default: calibrated, see docs)")
    p.add_argument("--wide-tp", action="store_true",
                   help="also offer each model twice its smallest fitting tensor-parallel degree per GPU type")
    p.add_argument("--strategies", default="joint,sequential")
    p.add_argument("--trials", type=int, default=60, help="simulations per search (default %(default)s)")
    p.add_argument("--sampler", default="gp", help="gp (Gaussian-process MOBO), tpe, nsga2 or random")
    p.add_argument("--search-seeds", default="0", help="comma-separated seeds; each strategy runs once per seed")
    p.add_argument("--out", type=Path, help="write place.json and front.png here")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_place)


def parse_gpus(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"--gpus takes GPU=COUNT pairs with COUNT >= 1, got {part!r}")
        out[name.strip()] = int(value)
    if not out:
        raise ValueError("--gpus names no GPU type")
    return out


def build_problem(args: argparse.Namespace):
    from sloserve import hetero
    from sloserve.sim.catalog import get_model
    from sloserve.sim.hardware import get_hardware
    from sloserve.sim.prices import parse_prices
    from sloserve.workload.build import WorkloadSpec, build_stream

    if not args.rate > 0 or not args.duration > 0:
        raise ValueError("--rate and --duration must be > 0")
    available = parse_gpus(args.gpus)
    for hw in available:
        get_hardware(hw)
    get_model(args.small), get_model(args.large)
    reqs = build_stream(WorkloadSpec(args.workload, seed=args.seed, rate=args.rate, duration_s=args.duration,
                                     arrival_process="poisson"))
    if not reqs:
        raise ValueError("the workload has no requests at that rate and duration")
    quality = hetero.QualityModel() if args.quality_gap is None else hetero.QualityModel(args.quality_gap)
    return hetero.Problem(args.small, args.large, available, reqs, hetero.difficulty_scores(len(reqs), args.seed),
                          quality_target=args.quality, quality=quality, prices=parse_prices(args.prices),
                          wide_tp=args.wide_tp)


def cmd_place(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from sloserve import hetero

    strategies = [s for s in args.strategies.split(",") if s]
    if not strategies or any(s not in ("joint", "sequential") for s in strategies):
        raise ValueError("--strategies takes joint and/or sequential")
    if args.sampler not in hetero.SAMPLERS:
        raise ValueError(f"--sampler must be one of {list(hetero.SAMPLERS)}")
    if args.trials < 1:
        raise ValueError("--trials must be >= 1")
    seeds = [int(s) for s in args.search_seeds.split(",") if s.strip()]
    if not seeds:
        raise ValueError("--search-seeds names no seed")
    problem = build_problem(args)
    if not problem.options():
        raise ValueError("neither model fits on any GPU given")
    console = Console()
    top = problem.max_share()
    console.print(f"{len(problem.requests)} queries; options: {', '.join(o.key for o in problem.options())}; the "
                  f"quality target lets at most {100 * min(1.0, top):.0f}% go to {problem.small_model}")
    results: dict[str, list] = {s: [] for s in strategies}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=args.no_progress) as progress:
        for strategy in strategies:
            for seed in seeds:
                task = progress.add_task(f"{strategy} (seed {seed})", total=args.trials)
                found = hetero.search(problem, strategy, args.trials, args.sampler, seed,
                                      on_trial=lambda _o, t=task: progress.advance(t))
                results[strategy].append(found)
    fronts = {s: hetero.pareto_front([o for r in runs for o in r.outcomes if o.feasible])
              for s, runs in results.items()}
    for strategy, front in fronts.items():
        table = Table(title=f"{strategy}: Pareto front (cost vs P95 end-to-end latency), {len(seeds)} search(es) "
                            f"of {args.trials} trials")
        for col in ("$/h", "P95 s", "P95 TTFT s", "to small", "quality", "deployment"):
            table.add_column(col, justify="right")
        for o in front:
            table.add_row(f"{o.cost_per_hour:.2f}", f"{o.p95_s:.2f}", f"{o.p95_ttft_s:.2f}",
                          f"{100 * o.small_share:.0f}%", f"{o.quality:.3f}", o.deployment.label)
        console.print(table)
    summary = compare(fronts) if {"joint", "sequential"} <= set(fronts) else None
    if summary:
        console.print(f"joint vs sequential: at equal cost, P95 better by up to {summary['p95_gain_max_pct']:.0f}% "
                      f"(median {summary['p95_gain_median_pct']:.0f}% over {summary['budgets']} budgets); at equal "
                      f"P95, cost lower by {summary['cost_saving_min_pct']:.0f}% to {summary['cost_saving_max_pct']:.0f}% "
                      f"(median {summary['cost_saving_median_pct']:.0f}% over {summary['targets']} targets; "
                      "negative: joint paid more)")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        doc = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"},
               "queries": len(problem.requests), "max_small_share": min(1.0, top),
               "options": [o.key for o in problem.options()], "comparison": summary,
               "searches": {s: [[o.as_dict() for o in r.outcomes] for r in runs] for s, runs in results.items()},
               "fronts": {s: [o.as_dict() for o in f] for s, f in fronts.items()}}
        (args.out / "place.json").write_text(json.dumps(doc, indent=1))
        plot(results, fronts, args.out / "front.png")
        console.print(f"wrote {args.out / 'place.json'} and {args.out / 'front.png'}")
    return 0


def compare(fronts: dict) -> Optional[dict]:
    """Joint against sequential on their fronts: at each budget either front reaches (both having a
    point within it), how much lower joint's P95 is; at each P95 either reaches (both reaching it),
    how much less joint pays."""
    from sloserve.hetero import best_within, cheapest_meeting

    joint, seq = fronts["joint"], fronts["sequential"]
    if not joint or not seq:
        return None
    gains, savings = [], []
    for budget in sorted({o.cost_per_hour for o in joint + seq}):
        a, b = best_within(joint, budget), best_within(seq, budget)
        if a is not None and b is not None:
            gains.append(b.p95_s / a.p95_s - 1)
    for target in sorted({o.p95_s for o in joint + seq}):
        a, b = cheapest_meeting(joint, target), cheapest_meeting(seq, target)
        if a is not None and b is not None:
            savings.append(1 - a.cost_per_hour / b.cost_per_hour)
    if not gains or not savings:
        return None
    return {"budgets": len(gains), "p95_gain_max_pct": 100 * max(gains),
            "p95_gain_median_pct": 100 * sorted(gains)[len(gains) // 2],
            "targets": len(savings), "cost_saving_min_pct": 100 * min(savings),
            "cost_saving_max_pct": 100 * max(savings),
            "cost_saving_median_pct": 100 * sorted(savings)[len(savings) // 2]}


def plot(results: dict, fronts: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"joint": "tab:blue", "sequential": "tab:orange"}
    fig, ax = plt.subplots(figsize=(8, 5), layout="constrained")
    drawn = 0
    for strategy, runs in results.items():
        pts = [o for r in runs for o in r.outcomes if o.feasible and o.p95_s < 1e3]
        drawn += len(pts)
        if not pts:
            continue
        ax.scatter([o.cost_per_hour for o in pts], [o.p95_s for o in pts], s=10, alpha=0.3,
                   color=colors.get(strategy), label=f"{strategy}: feasible trials")
        front = [o for o in fronts[strategy] if o.p95_s < 1e3]
        if front:
            xs = [o.cost_per_hour for o in front]
            ys = [o.p95_s for o in front]
            ax.step(xs + [xs[-1] * 1.05], ys + [ys[-1]], where="post", color=colors.get(strategy), linewidth=2,
                    label=f"{strategy}: Pareto front")
    if drawn:
        ax.set_yscale("log")
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no feasible trial", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("deployment cost ($ per hour)")
    ax.set_ylabel("P95 end-to-end latency (s)")
    ax.set_title("routing split and deployment: joint vs one after the other")
    ax.grid(alpha=0.3, which="both")
    fig.savefig(path, dpi=110)
    plt.close(fig)
