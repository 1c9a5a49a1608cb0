#!/usr/bin/env python3
"""Sarathi-Serve (OSDI '24): chunked prefills with stall-free batching give Mistral-7B on one A100
up to 2.6x the serving capacity of vLLM (prefills whole, no chunking) under a P99 TBT SLO.

Ours: Llama-3.1-8B (Mistral-7B's shape but for the vocabulary: 4,096 hidden, 32 layers, 8 KV heads)
on one simulated A100-80GB, ShareGPT (requests that fit an 8,192-token step whole), Poisson arrivals,
each rate tried with at least 60 s of them (SUSTAIN_S; planning.sustained): a rate the sample cannot hold
that long (`--max-requests` ShareGPT requests that fit) is not credited (planning.search_rate), and a
capacity the sample bounded is reported as a lower bound (a warning, `>=` in the setting, `limited` and
`held_s` in the JSON). Capacity = the highest rate at which the P99 of every gap between two tokens
of a request (the simulator's --token-gaps) stays within the SLO and the median TTFT within 2 s
(Sarathi-Serve bounds the median scheduling delay). SLOs as Sarathi-Serve sets them: strict = 5x
and relaxed = 25x the time of a decode-only iteration (one sequence at 1,024 tokens of context here),
with its token budgets: 512 (strict) and 2,048 (relaxed). vLLM-like: whole prompts, an 8,192-token
budget. The larger of the two capacity ratios is ours.

    python benchmarks/reproduce/sarathi_serve.py [--iters 4]
"""
from __future__ import annotations

import argparse
import math
from dataclasses import replace

import numpy as np
from common import Claim, report

from sloserve.core.config import SchedulerConfig
from sloserve.planning import Goodput, search_rate, sustained
from sloserve.sched.costs import StepLoad
from sloserve.sim.catalog import get_model
from sloserve.sim.cost import RooflineCostModel
from sloserve.sim.hardware import get_hardware
from sloserve.simulation import FleetConfig, build_fleet, sim_requests, simulate
from sloserve.workload.build import WorkloadSpec, build_stream

SUSTAIN_S = 60.0
MAX_TTFT_P50_S = 2.0


def warn_if_limited(found: Goodput, what: str) -> None:
    """One warning line when the sample bounded a capacity search (the capacity is then a lower bound)."""
    if found.limited:
        print(f"warning: capacity ({what}): {found.rps:.2f} req/s is a lower bound: {SUSTAIN_S:g} s of arrivals at "
              f"{found.refused_rps:.2f} req/s needs {math.ceil(found.refused_rps * SUSTAIN_S)} requests, the sample "
              f"gave {found.refused_requests} (raise --max-requests)")


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
    base = FleetConfig(hardware="a100-80g", model="llama-3.1-8b")
    decode_s = RooflineCostModel(get_hardware("a100-80g"), get_model("llama-3.1-8b")).step_time(
        StepLoad.decodes(1, 1024))
    whole = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256, enable_chunked_prefill=False)
    out = {"decode_iteration_s": decode_s}
    for name, factor, budget in (("strict", 5, 512), ("relaxed", 25, 2048)):
        tbt = factor * decode_s

        def meets(tried: list, scheduler: SchedulerConfig) -> bool:
            records, _ = simulate(build_fleet(replace(base, scheduler=scheduler)), sim_requests(tried, token_gaps=True))
            if not all(r.success for r in records):
                return False
            gaps = [g for r in records for g in r.itl_s]
            return bool(np.percentile(gaps, 99) <= tbt and np.median([r.ttft_s for r in records]) <= MAX_TTFT_P50_S)

        head = pool[:400]
        start = len(head) / max(head[-1].arrival_s, 1e-9)  # the trace's own rate: the search brackets from it
        chunked = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=256)
        found = {kind: search_rate(lambda tried, _rate, sched=sched: meets(tried, sched), requests_at, start,
                                   args.iters) for kind, sched in (("whole", whole), ("chunked", chunked))}
        for kind, g in found.items():
            warn_if_limited(g, f"{name} SLO, {kind} prefills")
        out[name] = {"tbt_p99_s": tbt, "budget": budget,
                     "capacity_whole": found["whole"].rps, "capacity_chunked": found["chunked"].rps,
                     **{f"search_{kind}": {**g.as_dict(), "limited": g.limited} for kind, g in found.items()}}
        out[name]["ratio"] = out[name]["capacity_chunked"] / max(out[name]["capacity_whole"], 1e-9)
        # a lower-bound chunked capacity makes the ratio a lower bound; a lower-bound whole one leaves it unbounded
        out[name]["ratio_is"] = ("unbounded" if found["whole"].limited else
                                 "a lower bound" if found["chunked"].limited else "measured")
    best = max(("strict", "relaxed"), key=lambda k: out[k]["ratio"])
    s, r = out["strict"], out["relaxed"]

    def ge(x: dict, kind: str) -> str:  # '>=' before a capacity the sample could only bound from below
        return ">=" if x[f"search_{kind}"]["limited"] else ""

    report("sarathi_serve", Claim(
        "Sarathi-Serve (OSDI '24)", "up to 2.6x the serving capacity of vLLM for Mistral-7B on one A100",
        "capacity with chunked prefill / without, P99 TBT SLO", 2.6, out[best]["ratio"],
        f"Llama-3.1-8B, 1 x A100-80GB (simulated), ShareGPT, P99 TBT <= {1e3 * s['tbt_p99_s']:.0f} ms (strict): "
        f"{ge(s, 'chunked')}{s['capacity_chunked']:.2f} vs {ge(s, 'whole')}{s['capacity_whole']:.2f} req/s "
        f"({s['ratio']:.2f}x); <= {1e3 * r['tbt_p99_s']:.0f} ms (relaxed): "
        f"{ge(r, 'chunked')}{r['capacity_chunked']:.2f} vs {ge(r, 'whole')}{r['capacity_whole']:.2f} req/s "
        f"({r['ratio']:.2f}x); rates held {SUSTAIN_S:g} s"
        + (" (>=: a lower bound, the sample could not hold a higher rate that long)"
           if any(x[f"search_{k}"]["limited"] for x in (s, r) for k in ("whole", "chunked")) else ""),
        "Llama-3.1-8B for Mistral-7B; roofline step times, not measured; our chunked scheduler is not Sarathi's code; "
        "the decode-iteration time the SLOs scale is our model's"), out)


if __name__ == "__main__":
    main()
