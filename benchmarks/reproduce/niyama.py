#!/usr/bin/env python3
"""Niyama: co-scheduling QoS classes on shared instances (dynamic chunking, hybrid priority,
relegation) serves 32% more load than siloed deployments (one pool per class) within the QoS targets.

Ours: two simulated H100s serving Llama-3.1-8B, ShareGPT, half `interactive` (TTFT 1 s, TPOT 50 ms,
priority 0) and half `batch` (TTFT 10 s, TPOT 200 ms, priority 1). Siloed: one instance per class
(fcfs). Shared: both instances take both classes (least-requests routing, the `slo` scheduling
policy: deadline-aware order, dynamic chunking, relegation). Capacity: the highest total rate at
which >= 90% of each class meets its own targets (planning.max_rate), each rate tried with
`--duration` seconds of Poisson arrivals: a fixed sample squeezed to a high rate arrives as one burst
that a 10 s TTFT target absorbs, which measures a transient, not a capacity.

    python benchmarks/reproduce/niyama.py [--duration 120]
"""
from __future__ import annotations

import argparse

from common import Claim, report

from sloserve.cluster.spec import FleetSpec
from sloserve.core.config import SchedulerConfig
from sloserve.planning import max_rate
from sloserve.simulation import FleetConfig, build_fleet, sim_requests, simulate
from sloserve.core.types import QoSClass
from sloserve.workload.build import WorkloadSpec, build_stream
from sloserve.workload.mix import ClassSpec, Mix, assign_mix

MIX = Mix((ClassSpec(QoSClass("interactive", 1.0, 0.05, priority=0), share=0.5),
           ClassSpec(QoSClass("batch", 10.0, 0.2, priority=1), share=0.5)), default_class="interactive")
CLASSES = {c.name: c.qos for c in MIX.classes}
TARGET = 0.9


def met(record) -> bool:
    q = CLASSES[record.qos_class]
    if record.ttft_s is None or record.ttft_s > q.ttft_target_s:
        return False
    return record.output_tokens <= 1 or (record.e2e_s - record.ttft_s) / (record.output_tokens - 1) <= q.tbt_target_s


def attained(records) -> bool:
    for name in CLASSES:
        mine = [r for r in records if r.qos_class == name]
        if mine and sum(met(r) for r in mine) / len(mine) < TARGET:
            return False
    return True


def siloed(reqs) -> bool:
    records = []
    for name in CLASSES:
        mine = [r for r in reqs if r.qos_class == name]
        cfg = FleetConfig(scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256))
        records += simulate(build_fleet(cfg), sim_requests(mine, CLASSES))[0]
    return attained(records)


def shared(reqs) -> bool:
    cfg = FleetConfig(FleetSpec(2, router="least-requests"),
                      scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256, policy="slo"))
    return attained(simulate(build_fleet(cfg), sim_requests(reqs, CLASSES))[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per rate tried")
    args = ap.parse_args()

    def stream(rate: float):
        return list(assign_mix(build_stream(WorkloadSpec(name="sharegpt", rate=rate, duration_s=args.duration)), MIX))

    silo = max_rate(lambda rate: siloed(stream(rate)), 10.0, 5)
    pool = max_rate(lambda rate: shared(stream(rate)), 10.0, 5)
    report("niyama", Claim(
        "Niyama", "32% more serving capacity than siloed deployments", "capacity: shared / siloed", 1.32,
        pool / silo if silo else float("inf"),
        f"2 x H100, Llama-3.1-8B (simulated), ShareGPT half interactive / half batch: {pool:.2f} vs {silo:.2f} req/s",
        "two classes (Niyama evaluates more), 2 instances; our `slo` policy is Niyama-like (deadlines, dynamic "
        "chunks, relegation), not Niyama's code; capacity at 90% per class"),
        {"shared_rps": pool, "siloed_rps": silo, "duration_s": args.duration})


if __name__ == "__main__":
    main()
