"""Live migration on a simulated fleet of 16 instances: a memory-tight setting like Llumnix's
(Llama-2-7B on A10 24 GB: ~15k tokens of KV per instance) and an H100 one (Llama-3.1-8B on H100).

The workload and the load levels are the routing study's (benchmarks/routing.py): a fixed window
of the Azure LLM 2023 conversation trace (its own lengths and arrival pattern), the fleet's
capacity measured as the highest rate at which least-requests routing meets the SLO for >= 90%
of requests, and the same requests replayed at 80% ... 110% of that capacity. At each load:

- round-robin;
- predicted-load routing;
- predicted-load routing + migration (balance,defrag),

recording P99 TTFT, P99 TPOT, preemptions, SLO attainment and the migrations (started, completed,
aborted, bytes, downtime). Every run uses the packaged length predictor (online), so neither the
router nor the migration policy sees the recorded output lengths.

Then a two-class workload at 100% and 110% load: every fifth request is `interactive` (priority 0,
the setting's SLO as its targets), the rest `batch` (priority 1, 10x looser), the instance
scheduler serves by priority, and predicted-load routing runs without migration, with `priority`
migration alone, with balance,defrag, and with balance,defrag,priority: the interactive class's
P99 TTFT and P99 E2E.

The trace window is 6000 requests by default (the routing study uses 2000; a P99 over 2000 rests on
20 requests and moved by up to 1.5x between windows): about 4 minutes on 2 CPU cores.

Writes benchmarks/results/sim_migration-<time>.json and benchmarks/figures/sim_migration.png,
prints the tables and the ratios the issue asks about.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing import TRACES, at_rate, measure_capacity, window  # noqa: E402  (the routing study's workload)

from sloserve.bench.metrics import SLO, jsonable, percentile  # noqa: E402
from sloserve.cluster.spec import FleetSpec  # noqa: E402
from sloserve.core.config import SchedulerConfig  # noqa: E402
from sloserve.simulation import FleetConfig, build_fleet, make_predictions, sim_requests, simulate  # noqa: E402
from sloserve.core.types import QoSClass  # noqa: E402
from sloserve.workload.types import WorkloadRequest  # noqa: E402

logger = logging.getLogger("sim_migration")
HERE = Path(__file__).resolve().parent
RESULTS, FIGURES = HERE / "results", HERE / "figures"
LOADS = (0.8, 0.9, 1.0, 1.1)
MIGRATION = "balance,defrag"


@dataclass(frozen=True)
class Setting:
    name: str
    label: str
    hardware: str
    model: str
    link: str
    slo: SLO


SETTINGS = (
    # A10 servers are PCIe machines on Ethernet; 100 Gb/s RoCE between instances (Llumnix's own cluster
    # differs in detail: this is a setting *like* theirs, not their testbed).
    Setting("a10", "16 x Llama-2-7B on A10 24 GB (memory-tight)", "a10-24g", "llama-2-7b", "roce-100g",
            SLO(ttft_s=2.0, tpot_s=0.2)),
    Setting("h100", "16 x Llama-3.1-8B on H100 80 GB", "h100-80g", "llama-3.1-8b", "infiniband-ndr",
            SLO(ttft_s=1.0, tpot_s=0.1)),
)
CONFIGS = (("round-robin", "none"), ("predicted-load", "none"), ("predicted-load", MIGRATION))
TWO_CLASS_MIGRATIONS = ("none", "priority", MIGRATION, MIGRATION + ",priority")


def label(router: str, migration: str) -> str:
    return router if migration == "none" else f"{router} + {migration}"


def run(reqs: list[WorkloadRequest], setting: Setting, router: str, migration: str, instances: int,
        classes: Optional[dict[str, QoSClass]] = None, policy: str = "fcfs") -> dict:
    spec = FleetSpec(instances, router=router, predictor="default", migration=migration, migration_interval_s=0.1)
    fleet = FleetConfig(spec, hardware=setting.hardware, model=setting.model,
                        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, policy=policy),
                        link=setting.link)
    predictions = make_predictions(fleet)
    sim = build_fleet(fleet, predictions)
    t0 = time.perf_counter()
    records, result = simulate(sim, sim_requests(reqs, classes, predictions), predictions=predictions)
    wall = time.perf_counter() - t0
    ok = [r for r in records if r.success]

    def p99(values) -> float:
        return percentile(sorted(v for v in values if v is not None), 99)

    out = {
        "router": router, "migration": migration, "config": label(router, migration), "requests": len(reqs),
        "completed": result.num_finished,
        "slo_attainment": sum(setting.slo.met(r) for r in records) / max(1, len(reqs)),
        "p50_ttft_s": percentile(sorted(r.ttft_s for r in ok), 50), "p99_ttft_s": p99(r.ttft_s for r in ok),
        "p99_tpot_s": p99(r.tpot_s for r in ok), "p99_e2e_s": p99(r.e2e_s for r in ok),
        "preemptions": sum(i.scheduler.stats.num_preemptions for i in sim.instances),
        "migrations": result.migration, "migrations_by_policy": dict(sim.controller.completed_by_reason),
        "sim_s": result.end_time, "wall_s": wall,
    }
    if classes:
        out["classes"] = {name: {"requests": sum(1 for r in ok if r.qos_class == name),
                                 "p99_ttft_s": p99(r.ttft_s for r in ok if r.qos_class == name),
                                 "p99_e2e_s": p99(r.e2e_s for r in ok if r.qos_class == name),
                                 "p99_tpot_s": p99(r.tpot_s for r in ok if r.qos_class == name)}
                          for name in classes}
    return out


def two_classes(reqs: list[WorkloadRequest], slo: SLO) -> tuple[list[WorkloadRequest], dict[str, QoSClass]]:
    classes = {"interactive": QoSClass("interactive", slo.ttft_s, slo.tpot_s, priority=0),
               "batch": QoSClass("batch", 10 * slo.ttft_s, 10 * slo.tpot_s, priority=1)}
    tagged = [replace(r, qos_class="interactive" if i % 5 == 0 else "batch") for i, r in enumerate(reqs)]
    return tagged, classes


def ratio(a: Optional[float], b: Optional[float]) -> float:
    """a / b; NaN when either is missing or the baseline `a` is 0 (nothing to improve on)."""
    if a is None or b is None or a <= 0 or b <= 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


def ratios(entry: dict) -> list[dict]:
    """Baseline / migration, per load: P99 TTFT and preemptions (>1: migration is better)."""
    mig = label("predicted-load", MIGRATION)
    out = []
    for load in entry["loads"]:
        by = {r["config"]: r for r in entry["runs"] if r["load"] == load}
        rr, pl, me = by["round-robin"], by["predicted-load"], by[mig]
        out.append({"load": load, "ttft_vs_rr": ratio(rr["p99_ttft_s"], me["p99_ttft_s"]),
                    "ttft_vs_pl": ratio(pl["p99_ttft_s"], me["p99_ttft_s"]),
                    # (none left with migration counts as one, so the ratio stays finite)
                    "preempt_vs_rr": ratio(rr["preemptions"], max(1, me["preemptions"])),
                    "preempt_vs_pl": ratio(pl["preemptions"], max(1, me["preemptions"])),
                    "attain_vs_pl": me["slo_attainment"] - pl["slo_attainment"]})
    return out


def ms(s: Optional[float]) -> str:
    return "—" if s is None or math.isnan(s) else f"{1e3 * s:,.0f}"


def times(x: float) -> str:
    return "—" if math.isnan(x) else f"{x:.2f}x"


def print_tables(results: dict, console: Console) -> None:
    for entry in results["settings"]:
        t = Table(title=f"{entry['label']} — capacity {entry['capacity_rps']:.1f} req/s, link {entry['link']}, "
                        f"SLO TTFT ≤ {ms(entry['slo']['ttft_s'])} ms, TPOT ≤ {ms(entry['slo']['tpot_s'])} ms")
        for col in ("load", "config", "attain", "P99 TTFT ms", "P99 TPOT ms", "preempt", "migrated", "aborted",
                    "GB moved", "downtime ms"):
            t.add_column(col, justify="left" if col == "config" else "right")
        for r in entry["runs"]:
            m = r["migrations"] or {}
            t.add_row(f"{100 * r['load']:.0f}%", r["config"], f"{100 * r['slo_attainment']:.1f}%", ms(r["p99_ttft_s"]),
                      ms(r["p99_tpot_s"]), str(r["preemptions"]), str(m.get("completed", "—")),
                      str(m.get("aborted", "—")), f"{m['bytes'] / 1e9:.1f}" if m else "—",
                      ms(m["downtime_s"]) if m else "—")
        console.print(t)
        rt = Table(title="ratios: baseline ÷ predicted-load + migration (P99 TTFT, preemptions)")
        for col in ("load", "TTFT vs RR", "TTFT vs PL", "preempt vs RR", "preempt vs PL", "attainment vs PL"):
            rt.add_column(col, justify="right")
        for x in entry["ratios"]:
            rt.add_row(f"{100 * x['load']:.0f}%", times(x["ttft_vs_rr"]), times(x["ttft_vs_pl"]),
                       times(x["preempt_vs_rr"]), times(x["preempt_vs_pl"]), f"{100 * x['attain_vs_pl']:+.1f} pt")
        console.print(rt)
        if entry.get("two_class"):
            ct = Table(title="two classes (1 in 5 interactive; priority scheduler; predicted-load routing)")
            for col in ("load", "migration", "interactive P99 TTFT ms", "interactive P99 E2E ms",
                        "batch P99 TTFT ms", "attain", "moves by policy"):
                ct.add_column(col, justify="left" if col in ("migration", "moves by policy") else "right")
            for r in entry["two_class"]:
                c = r["classes"]
                moves = ", ".join(f"{k} {v}" for k, v in sorted(r["migrations_by_policy"].items())) or "—"
                ct.add_row(f"{100 * r['load']:.0f}%", r["migration"], ms(c["interactive"]["p99_ttft_s"]),
                           ms(c["interactive"]["p99_e2e_s"]), ms(c["batch"]["p99_ttft_s"]),
                           f"{100 * r['slo_attainment']:.1f}%", moves)
            console.print(ct)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = results["settings"]
    fig, axes = plt.subplots(3, len(settings), figsize=(5.5 * len(settings), 10), squeeze=False)
    for col, entry in enumerate(settings):
        for cfg in dict.fromkeys(r["config"] for r in entry["runs"]):
            rows = [r for r in entry["runs"] if r["config"] == cfg]
            x = [100 * r["load"] for r in rows]
            axes[0][col].plot(x, [1e3 * r["p99_ttft_s"] for r in rows], marker="o", label=cfg)
            axes[1][col].plot(x, [r["preemptions"] for r in rows], marker="o", label=cfg)
        axes[0][col].set_title(entry["label"], fontsize=10)
        axes[0][col].set_ylabel("P99 TTFT ms")
        axes[0][col].set_yscale("log")
        axes[1][col].set_ylabel("preemptions")
        axes[1][col].set_xlabel("load, % of measured capacity")
        two = entry.get("two_class")
        ax = axes[2][col]
        if two:
            loads = sorted({r["load"] for r in two})
            migrations = list(dict.fromkeys(r["migration"] for r in two))
            width = 0.8 / len(migrations)
            for k, migration in enumerate(migrations):
                rows = {r["load"]: r for r in two if r["migration"] == migration}
                ax.bar([i + (k - (len(migrations) - 1) / 2) * width for i in range(len(loads))],
                       [1e3 * rows[x]["classes"]["interactive"]["p99_ttft_s"] for x in loads], width=width,
                       label=migration)
            ax.set_xticks(range(len(loads)), [f"{100 * x:.0f}% load" for x in loads])
            ax.set_ylabel("interactive P99 TTFT ms")
            ax.set_title("two classes: the interactive class, by migration policy", fontsize=9)
            ax.legend(fontsize=7)
        for a in axes[:, col]:
            a.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Live migration on a simulated fleet (predicted-load routing + balance,defrag)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--settings", default=",".join(s.name for s in SETTINGS))
    p.add_argument("--loads", default=",".join(f"{x:g}" for x in LOADS), help="fractions of measured capacity")
    p.add_argument("--instances", type=int, default=16)
    p.add_argument("--requests", type=int, default=6000, help="requests of the trace window")
    p.add_argument("--capacity-iters", type=int, default=3)
    p.add_argument("--capacity", help="skip the search: setting=req/s,... (e.g. from an earlier run)")
    p.add_argument("--two-class-loads", default="1.0,1.1", help="fractions of capacity for the two-class runs")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--figure", type=Path, default=FIGURES / "sim_migration.png")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    loads = [float(x) for x in args.loads.split(",")]
    chosen = [s for s in SETTINGS if s.name in args.settings.split(",")]
    given = dict(kv.split("=") for kv in args.capacity.split(",")) if args.capacity else {}
    trace = replace(TRACES[0], num_requests=args.requests)  # Azure 2023 conversation
    reqs = window(trace)
    console = Console(width=max(140, Console().width))
    results = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "trace": trace.name,
               "requests": len(reqs), "instances": args.instances, "loads": loads, "migration": MIGRATION,
               "predictor": "default (length-only, online)", "settings": []}
    two_loads = [float(x) for x in args.two_class_loads.split(",") if x]
    n_runs = len(chosen) * (len(loads) * len(CONFIGS) + len(two_loads) * len(TWO_CLASS_MIGRATIONS))
    t_start = time.perf_counter()
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console)
    with progress:
        task = progress.add_task("runs", total=n_runs)
        for setting in chosen:
            fleet = {"hardware": setting.hardware, "model": setting.model}
            if setting.name in given:
                capacity, probes = float(given[setting.name]), []
            else:
                progress.update(task, description=f"{setting.name}: capacity")
                # The window's own capacity, squeezed (min_duration_s=0: a burst, said so in a warning),
                # as the load sweep below replays that same window: these runs compare policies on
                # one window, not sustained rates (routing.py --sustain holds rates).
                capacity, probes = measure_capacity(reqs, setting.slo, args.instances, args.capacity_iters,
                                                    min_duration_s=0, **fleet)
            entry = {"name": setting.name, "label": setting.label, "hardware": setting.hardware,
                     "model": setting.model, "link": setting.link, "capacity_rps": capacity, "loads": loads,
                     "slo": {"ttft_s": setting.slo.ttft_s, "tpot_s": setting.slo.tpot_s},
                     "capacity_probes": probes, "runs": []}
            for load in loads:
                batch = at_rate(reqs, load * capacity)
                for router, migration in CONFIGS:
                    progress.update(task, description=f"{setting.name} {100 * load:.0f}% {label(router, migration)}")
                    res = run(batch, setting, router, migration, args.instances)
                    entry["runs"].append({"load": load, "rate": load * capacity, **res})
                    progress.advance(task)
            entry["ratios"] = ratios(entry)
            entry["two_class"] = []
            for load in two_loads:
                tagged, classes = two_classes(at_rate(reqs, load * capacity), setting.slo)
                for migration in TWO_CLASS_MIGRATIONS:
                    progress.update(task, description=f"{setting.name} two classes {100 * load:.0f}% {migration}")
                    res = run(tagged, setting, "predicted-load", migration, args.instances, classes, policy="priority")
                    entry["two_class"].append({"load": load, **res})
                    progress.advance(task)
            results["settings"].append(entry)
    results["wall_s"] = time.perf_counter() - t_start
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = args.out / f"sim_migration-{stamp}.json"
    path.write_text(json.dumps(jsonable(results), indent=1))
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    plot(results, args.figure)
    print_tables(results, console)
    console.print(f"total {results['wall_s']:.0f} s; wrote {path} and {args.figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
