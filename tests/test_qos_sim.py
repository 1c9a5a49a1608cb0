"""The SLO-aware policies in the simulator: fast-forwarded decode runs still change no decision
(dynamic keys, class preemption and swaps included), and on an overloaded mix the deadline-aware
policies serve the interactive class better than FCFS."""
from __future__ import annotations

import random

import pytest

from sloserve.cluster.routers import make_router
from sloserve.core.config import CacheConfig, SchedulerConfig
from sloserve.sim.catalog import get_model
from sloserve.sim.cost import RooflineCostModel
from sloserve.sim.hardware import get_hardware
from sloserve.sim.instance import SimInstance
from sloserve.sim.simulator import Simulator
from sloserve.core.types import QoSClass, Request, SamplingParams

INTERACTIVE = QoSClass("interactive", ttft_target_s=0.5, tbt_target_s=0.05, priority=0)
BATCH = QoSClass("batch", ttft_target_s=10.0, tbt_target_s=0.5, priority=1)


def mixed_workload(n: int, rate: float, seed: int = 0) -> list[Request]:
    """Short interactive chats and long batch prompts, Poisson arrivals."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        interactive = rng.random() < 0.5
        prompt_len = rng.randint(50, 600) if interactive else rng.randint(1000, 3000)
        output = rng.randint(20, 300) if interactive else rng.randint(5, 60)
        prompt = [rng.randrange(100, 30000) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=output, ignore_eos=True, temperature=0)
        out.append(Request(f"r{i}", prompt, params, arrival_time=t, qos=INTERACTIVE if interactive else BATCH,
                           predicted_output_len=output if i % 2 else None))
    return out


def run(policy: str, fast_forward: bool, num_blocks: int, mode: str = "recompute", n: int = 200,
        rate: float = 12.0, budget: int = 1024):
    cost = RooflineCostModel(get_hardware("a100-80g"), get_model("llama-3.1-8b"))
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=24, policy=policy, preemption_mode=mode)
    instances = [SimInstance(i, cost, num_blocks, 4096, cfg, CacheConfig(block_size=16), fast_forward=fast_forward,
                             num_host_blocks=2000 if mode != "recompute" else 0) for i in range(2)]
    result = Simulator(instances, make_router("round-robin")).run(mixed_workload(n, rate))
    timings = sorted((f.request.request_id, f.instance_id, f.request.first_token_time, f.request.finished_time,
                      f.request.num_preemptions) for f in result.finished)
    stats = [(i.scheduler.stats.num_steps, i.scheduler.stats.num_preemptions, i.scheduler.stats.num_swaps_out)
             for i in instances]
    return timings, stats, result


@pytest.mark.parametrize("policy, num_blocks, mode", [
    ("edf", 5000, "recompute"), ("slo", 5000, "recompute"), ("slo", 400, "auto"), ("edf", 400, "swap"),
])
def test_fast_forward_changes_no_decision_with_slo_policies(policy, num_blocks, mode):
    slow, slow_stats, _ = run(policy, False, num_blocks, mode)
    fast, fast_stats, fast_res = run(policy, True, num_blocks, mode)
    assert len(slow) == 200 and slow == fast
    assert slow_stats == fast_stats
    if num_blocks == 400:
        assert sum(s[1] for s in slow_stats) > 0
    if mode == "swap":
        assert sum(s[2] for s in slow_stats) > 0


def interactive_attainment(policy: str) -> float:
    timings_ok = 0
    _, _, result = run(policy, True, 5000, n=300, rate=20.0, budget=2048)
    inter = [f.request for f in result.finished if f.request.qos is INTERACTIVE]
    for r in inter:
        ttft = r.first_token_time - r.arrival_time
        tpot = (r.finished_time - r.first_token_time) / max(1, r.num_output_tokens - 1)
        timings_ok += ttft <= INTERACTIVE.ttft_target_s and tpot <= INTERACTIVE.tbt_target_s
    return timings_ok / len(inter)


def test_deadline_aware_policies_protect_the_interactive_class_under_load():
    fcfs = interactive_attainment("fcfs")
    edf = interactive_attainment("edf")
    slo = interactive_attainment("slo")
    # Two A100s at 20 req/s: FCFS queues the short interactive prompts behind long batch ones.
    assert fcfs < 0.5 and edf > 0.9 and slo > 0.9, (fcfs, edf, slo)
