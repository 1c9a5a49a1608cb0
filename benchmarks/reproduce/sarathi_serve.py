#!/usr/bin/env python3
"""Sarathi-Serve (OSDI '24): chunked prefills with stall-free batching give Mistral-7B on one A100
up to 2.6x the serving capacity of vLLM (prefills whole, no chunking) under a P99 TBT SLO.

Ours: Llama-3.1-8B (Mistral-7B's shape but for the vocabulary: 4,096 hidden, 32 layers, 8 KV heads)
on one simulated A100-80GB, ShareGPT (requests that fit an 8,192-token step whole), Poisson arrivals,
each rate tried with at least 60 s of them. Capacity = the highest rate at which the P99 of every
gap between two tokens of a request (the simulator's --token-gaps) stays within the SLO and the
median TTFT within 2 s (Sarathi-Serve bounds the median scheduling delay). SLOs as Sarathi-Serve
sets them: strict = 5x and relaxed = 25x the time of a decode-only iteration (one sequence at 1,024
tokens of context here), with its token budgets: 512 (strict) and 2,048 (relaxed). vLLM-like: whole
prompts, an 8,192-token budget. The larger of the two capacity ratios is ours.

    python benchmarks/reproduce/sarathi_serve.py [--iters 4]
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import numpy as np
from common import Claim, report

from sloserve.config import SchedulerConfig
from sloserve.planning import at_rate, max_rate, sustained
from sloserve.sched.costs import StepLoad
from sloserve.sim.catalog import get_model
from sloserve.sim.cost import RooflineCostModel
from sloserve.sim.hardware import get_hardware
from sloserve.simulation import FleetConfig, build_fleet, sim_requests, simulate
from sloserve.workload.build import WorkloadSpec, build_stream

SUSTAIN_S = 60.0
MAX_TTFT_P50_S = 2.0


def fitting(n: int) -> list:
    """The first n ShareGPT requests that fit one 8,192-token step whole (both schedulers serve them)."""
    out = [r for r in build_stream(WorkloadSpec(name="sharegpt", rate=1.0, num_requests=2 * n + 200))
           if r.prompt_len + r.output_len <= 8192]
    return out[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=4, help="bisection steps of the capacity search")
    ap.add_argument("--max-requests", type=int, default=6000)
    args = ap.parse_args()
    pool = fitting(args.max_requests)
    requests_at = sustained(lambda n: pool[:n], 400, SUSTAIN_S, len(pool))
    base = FleetConfig(instances=1, hardware="a100-80g", model="llama-3.1-8b")
    decode_s = RooflineCostModel(get_hardware("a100-80g"), get_model("llama-3.1-8b")).step_time(
        StepLoad.decodes(1, 1024))
    whole = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256, enable_chunked_prefill=False)
    out = {"decode_iteration_s": decode_s}
    for name, factor, budget in (("strict", 5, 512), ("relaxed", 25, 2048)):
        tbt = factor * decode_s

        def meets(rate: float, scheduler: SchedulerConfig) -> bool:
            records, _ = simulate(build_fleet(replace(base, scheduler=scheduler)),
                                  sim_requests(requests_at(rate), token_gaps=True))
            if not all(r.success for r in records):
                return False
            gaps = [g for r in records for g in r.itl_s]
            return bool(np.percentile(gaps, 99) <= tbt and np.median([r.ttft_s for r in records]) <= MAX_TTFT_P50_S)

        start = len(pool[:400]) / max(pool[399].arrival_s, 1e-9)  # the trace's own rate: the search brackets from it
        chunked = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=256)
        out[name] = {"tbt_p99_s": tbt, "budget": budget,
                     "capacity_whole": max_rate(lambda r: meets(r, whole), start, args.iters),
                     "capacity_chunked": max_rate(lambda r: meets(r, chunked), start, args.iters)}
        out[name]["ratio"] = out[name]["capacity_chunked"] / max(out[name]["capacity_whole"], 1e-9)
    best = max(("strict", "relaxed"), key=lambda k: out[k]["ratio"])
    s, r = out["strict"], out["relaxed"]
    report("sarathi_serve", Claim(
        "Sarathi-Serve (OSDI '24)", "up to 2.6x the serving capacity of vLLM for Mistral-7B on one A100",
        "capacity with chunked prefill / without, P99 TBT SLO", 2.6, out[best]["ratio"],
        f"Llama-3.1-8B, 1 x A100-80GB (simulated), ShareGPT, P99 TBT <= {1e3 * s['tbt_p99_s']:.0f} ms (strict): "
        f"{s['capacity_chunked']:.2f} vs {s['capacity_whole']:.2f} req/s ({s['ratio']:.2f}x); <= "
        f"{1e3 * r['tbt_p99_s']:.0f} ms (relaxed): {r['capacity_chunked']:.2f} vs {r['capacity_whole']:.2f} req/s "
        f"({r['ratio']:.2f}x)",
        "Llama-3.1-8B for Mistral-7B; roofline step times, not measured; our chunked scheduler is not Sarathi's code; "
        "the decode-iteration time the SLOs scale is our model's"), out)


if __name__ == "__main__":
    main()
