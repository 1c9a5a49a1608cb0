#!/usr/bin/env python3
"""Prefill/decode disaggregation in the simulator: when does it win?

For each workload, SLO and link, the goodput per GPU of a colocated fleet (chunked prefill,
`--instances` mixed instances) against every prefill:decode split of the same GPU count. Goodput is
the highest request rate at which >= 90% of requests meet both TTFT and TPOT targets, found by
bisection over the rate of the same requests (the routing study's `measure_capacity`: bracket
from the burst throughput, then geometric bisection); divided by the GPUs it is goodput per GPU.
Disaggregated fleets hand each request's KV to a decode instance after its first token
(`--pd-transfer`, pipelined by default), priced on the link.

Workloads are the routing study's trace windows (Azure code: long prompts, short outputs;
Azure conversation: decode-heavier), each at a tight and a loose SLO. Llama-3.1-8B on H100.
Per cell the table says which layout wins and by how much; a one-line rule is checked against
every cell (see `rule`).

    python benchmarks/sim_pd.py --instances 4 --requests 0.5
Writes benchmarks/results/sim_pd-STAMP.json and .png.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from routing import TRACES, measure_capacity, window  # noqa: E402  (the routing study's workloads and search)

from sloserve.bench.metrics import SLO, jsonable  # noqa: E402

logger = logging.getLogger("sim_pd")
RESULTS = Path(__file__).resolve().parent / "results"
LINKS = ("nvlink-h100", "infiniband-ndr", "ethernet-25g")


@dataclass(frozen=True)
class Cell:
    trace: str
    slo_name: str
    slo: SLO
    link: str


def slos_for(base: SLO) -> dict[str, SLO]:
    """The trace's own SLO as `loose`, and a `tight` one: TPOT 4x and TTFT 2x stricter."""
    return {"tight": SLO(ttft_s=base.ttft_s / 2, tpot_s=base.tpot_s / 4), "loose": base}


def splits(n: int) -> list[str]:
    return [f"{p}:{n - p}" for p in range(1, n)]


def rule(prefill_share: float, slo_name: str, link: str) -> str:
    """The prediction checked against every cell: disaggregation wins when decode latency is what
    the SLO squeezes (tight TPOT), the prompts are a big share of the work (prefills would stall
    colocated decodes) and the link is fast enough that a hand-off costs less than a TPOT."""
    slow_link = link.startswith("ethernet")
    return "pd" if slo_name == "tight" and prefill_share >= 0.5 and not slow_link else "colocated"


def rule2(prefill_share: float, slo_name: str, link: str, transfer: str) -> str:
    """The rule read off the first run's 12 cells (2026-12-01 04:42; `rule` got 9): prefill-dominated
    work at a tight TPOT, and the link matters only when the send is not pipelined. To be tested on
    cells that run did not have (other traces, blocking sends)."""
    if transfer == "blocking" and link.startswith("ethernet"):
        return "colocated"
    return "pd" if slo_name == "tight" and prefill_share >= 0.9 else "colocated"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", default="azure-code,azure-conv")
    p.add_argument("--instances", type=int, default=4, help="GPUs per fleet (colocated and every split)")
    p.add_argument("--links", default=",".join(LINKS))
    p.add_argument("--requests", type=float, default=0.5, help="scale every trace window's request count")
    p.add_argument("--capacity-iters", type=int, default=3)
    p.add_argument("--pd-transfer", default="pipelined", choices=["pipelined", "blocking"])
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    console = Console(width=200)
    links = args.links.split(",")
    chosen = [t for t in TRACES if t.name in args.traces.split(",")]
    cells: list[dict] = []
    jobs = []
    for trace in chosen:
        for slo_name, slo in slos_for(trace.slo).items():
            jobs.append((trace, slo_name, slo, None, None))  # colocated: the link does not matter
            for link in links:
                for split in splits(args.instances):
                    jobs.append((trace, slo_name, slo, link, split))
    t0 = time.perf_counter()
    capacities: dict[tuple, float] = {}
    shares: dict[str, float] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        task = progress.add_task("capacity searches", total=len(jobs))
        windows = {}
        for trace, slo_name, slo, link, split in jobs:
            if trace.name not in windows:
                windows[trace.name] = window(replace(trace, num_requests=max(50, int(trace.num_requests * args.requests))))
                reqs = windows[trace.name]
                shares[trace.name] = sum(r.prompt_len for r in reqs) / sum(r.prompt_len + r.output_len for r in reqs)
            reqs = windows[trace.name]
            options = {} if split is None else {"pd": split, "link": link, "pd_transfer": args.pd_transfer}
            capacity, _ = measure_capacity(reqs, slo, args.instances, args.capacity_iters, **options)
            capacities[(trace.name, slo_name, link, split)] = capacity
            progress.advance(task)
    for trace in chosen:
        for slo_name, slo in slos_for(trace.slo).items():
            colocated = capacities[(trace.name, slo_name, None, None)]
            for link in links:
                best_split = max(splits(args.instances), key=lambda s: capacities[(trace.name, slo_name, link, s)])
                best = capacities[(trace.name, slo_name, link, best_split)]
                winner = "pd" if best > colocated else "colocated"
                cells.append({"trace": trace.name, "slo": slo_name, "ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s,
                              "link": link, "prefill_share": shares[trace.name],
                              "colocated_goodput_per_gpu": colocated / args.instances,
                              "best_split": best_split, "pd_goodput_per_gpu": best / args.instances,
                              "splits": {s: capacities[(trace.name, slo_name, link, s)] / args.instances
                                         for s in splits(args.instances)},
                              "winner": winner, "pd_over_colocated": best / colocated if colocated else float("inf"),
                              "rule": rule(shares[trace.name], slo_name, link),
                              "rule2": rule2(shares[trace.name], slo_name, link, args.pd_transfer)})
    right = sum(c["rule"] == c["winner"] for c in cells)
    right2 = sum(c["rule2"] == c["winner"] for c in cells)
    table = Table(title=f"goodput per GPU (req/s at >= 90% SLO attainment), {args.instances} x H100, Llama-3.1-8B")
    for col in ("trace", "prompt share", "SLO (TTFT/TPOT)", "link", "colocated", "best P:D", "P:D", "P:D / coloc.",
                "winner", "rule", "rule2"):
        table.add_column(col, justify="right")
    for c in cells:
        table.add_row(c["trace"], f"{c['prefill_share']:.2f}", f"{c['slo']} ({c['ttft_s']:g}s/{1e3 * c['tpot_s']:g}ms)",
                      c["link"], f"{c['colocated_goodput_per_gpu']:.2f}", c["best_split"],
                      f"{c['pd_goodput_per_gpu']:.2f}", f"{c['pd_over_colocated']:.2f}x", c["winner"],
                      c["rule"] + (" ✓" if c["rule"] == c["winner"] else " ✗"),
                      c["rule2"] + (" ✓" if c["rule2"] == c["winner"] else " ✗"))
    console.print(table)
    console.print(f"the rule predicts {right}/{len(cells)} cells, rule2 {right2}/{len(cells)}; "
                  f"{time.perf_counter() - t0:.0f} s")
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = args.out / f"sim_pd-{stamp}.json"
    path.write_text(json.dumps(jsonable({"when": stamp, "instances": args.instances, "requests_scale": args.requests,
                                         "pd_transfer": args.pd_transfer, "hardware": "h100-80g",
                                         "model": "llama-3.1-8b", "cells": cells, "rule_right": right,
                                         "rule2_right": right2}), indent=1))
    plot(cells, path.with_suffix(".png"), args.instances)
    console.print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def plot(cells: list[dict], path: Path, n: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c['trace']}\n{c['slo']}\n{c['link']}" for c in cells]
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(cells)), 4.5))
    xs = range(len(cells))
    ax.bar([x - 0.2 for x in xs], [c["colocated_goodput_per_gpu"] for c in cells], 0.4, label="colocated")
    ax.bar([x + 0.2 for x in xs], [c["pd_goodput_per_gpu"] for c in cells], 0.4, label="best P:D")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("goodput per GPU (req/s)")
    ax.set_title(f"Prefill/decode disaggregation vs colocated, {n} GPUs (simulated)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
