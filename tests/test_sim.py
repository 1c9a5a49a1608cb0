"""The simulator runs the real scheduler and KV manager: fast-forwarded decode runs must not
change a single decision, and a simulated instance must plan the same steps as the engine."""
from __future__ import annotations

import random
from array import array
from typing import Optional

import pytest
from hypothesis import given, settings, strategies as st

from sloserve.cluster.controller import FleetController
from sloserve.cluster.migration import (BalancePolicy, CombinedPolicy, DefragPolicy, MigrationPolicy, MoveCosts,
                                       PriorityPolicy)
from sloserve.cluster.routers import make_router
from sloserve.core.config import SchedulerConfig
from sloserve.sim.catalog import get_model
from sloserve.sched.costs import StepLoad
from sloserve.sim.cost import Profile, ProfiledCostModel, RooflineCostModel, choose_knots, features, fit_nonnegative
from sloserve.sim.hardware import get_hardware, get_link
from sloserve.sim.instance import SimInstance, kv_blocks_for
from sloserve.kv.hashing import hash_full_blocks
from sloserve.kv.manager import KVCacheManager
from sloserve.sim.prompts import SyntheticPrompt
from sloserve.sim.simulator import Simulator
from sloserve.core.types import DEFAULT_QOS, QoSClass, Request, SamplingParams


INTERACTIVE = QoSClass("interactive", ttft_target_s=0.3, tbt_target_s=0.03, priority=0)
BATCH = QoSClass("batch", priority=1)


def workload(n: int, rate: float, seed: int = 0, shared_prefix: int = 64, two_classes: bool = False) -> list[Request]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 2000) for _ in range(shared_prefix)]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        body = [rng.randrange(2000, 30000) for _ in range(rng.randint(5, 400))]
        prompt = (prefix if rng.random() < 0.5 else []) + body
        params = SamplingParams(max_tokens=rng.randint(1, 300), ignore_eos=True, temperature=0)
        qos = (INTERACTIVE if i % 4 == 0 else BATCH) if two_classes else DEFAULT_QOS
        out.append(Request(f"r{i}", prompt, params, arrival_time=t, qos=qos))
    return out


def simulate(fast_forward: bool, router: str, num_blocks: int, n: int = 400,
             migration: Optional[MigrationPolicy] = None, policy: str = "fcfs", token_gaps: bool = False):
    model = get_model("llama-3.1-8b")
    cost = RooflineCostModel(get_hardware("a100-80g"), model)
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32, policy=policy)
    instances = [SimInstance(i, cost, num_blocks, 4096, cfg, fast_forward=fast_forward) for i in range(3)]
    controller = FleetController(make_router(router), migration, min_interval_s=0.5)
    costs = MoveCosts.uniform(model.kv_bytes_per_token(2), get_link("infiniband-ndr"))
    requests = workload(n, rate=30.0, two_classes=migration is not None)
    for r in requests:
        r.token_gaps = [] if token_gaps else None
    result = Simulator(instances, controller, costs).run(requests)
    timings = sorted((f.request.request_id, f.instance_id, f.request.first_token_time, f.request.finished_time,
                      f.request.num_preemptions, f.request.num_cached_tokens) for f in result.finished)
    stats = [(i.scheduler.stats.num_steps, i.scheduler.stats.num_preemptions, i.kv.stats.hits,
              i.scheduler.stats.num_migrated_in, i.scheduler.stats.num_migrated_out) for i in instances]
    return timings, stats, result


# least-kv and predicted-load read fields a decode run changes (blocks, remaining tokens) at every
# arrival: the run must be caught up to each routing moment, and nothing kept from an earlier one.
@pytest.mark.parametrize("router, num_blocks", [("round-robin", 5000), ("least-requests", 120), ("least-kv", 120),
                                                ("predicted-load", 120)])
def test_fast_forward_changes_no_decision(router, num_blocks):
    slow, slow_stats, slow_res = simulate(False, router, num_blocks)
    fast, fast_stats, fast_res = simulate(True, router, num_blocks)
    assert len(slow) == 400 and slow == fast
    assert slow_stats == fast_stats
    if num_blocks == 120:
        assert sum(s[1] for s in slow_stats) > 0  # the small pool really preempted
    else:  # with room to spare, steady decoding dominates and fast-forward saves most events
        assert fast_res.num_events < slow_res.num_events / 2
    assert sum(s[2] for s in slow_stats) > 0  # and shared prefixes really hit the cache


@pytest.mark.parametrize("num_blocks, migration", [(120, None), (160, "eager")])
def test_token_gaps_are_the_same_fast_forwarded_and_step_by_step(num_blocks, migration):
    """Each request's gaps between tokens (the simulated ITL) add up to its time from first to
    last token, one per token after the first, and come out the same whether decode runs are
    fast-forwarded or stepped one event at a time, through preemptions and migrations."""
    policy = eager_migration() if migration else None
    runs = []
    for fast in (False, True):
        _, _, result = simulate(fast, "least-kv", num_blocks, n=200, migration=policy, token_gaps=True)
        runs.append({f.request.request_id: f.request for f in result.finished})
    slow, fast = runs
    assert slow.keys() == fast.keys() and len(slow) == 200
    for rid, r in slow.items():
        gaps = r.token_gaps
        assert len(gaps) == r.num_output_tokens - 1 and min(gaps, default=0.0) >= 0
        assert sum(gaps) == pytest.approx(r.finished_time - r.first_token_time)
        assert gaps == pytest.approx(fast[rid].token_gaps)
    if migration is None:
        assert any(r.num_preemptions for r in slow.values())  # a preempted request's stall is one long gap
        stalled = [max(r.token_gaps) for r in slow.values() if r.num_preemptions and r.token_gaps]
        typical = sorted(g for r in slow.values() for g in r.token_gaps)[len(slow)]
        assert stalled and max(stalled) > 5 * typical


# Migration cuts decode runs at step boundaries (suspend), takes blocks on targets mid-run
# (reserve) and frees them on sources (commit): every one of those must land on the same step
# with fast-forward on as with one event per step.
# Thresholds far below the defaults, so that a 400-request run migrates often.
def eager_migration() -> MigrationPolicy:
    return CombinedPolicy([BalancePolicy(min_gap=64, rel_gap=0.05, min_gain=0), DefragPolicy(),
                           PriorityPolicy(ttft_slack_fraction=1.0, tbt_fraction=1.0)])


@pytest.mark.parametrize("router, num_blocks, policy", [("round-robin", 120, "priority"), ("least-kv", 160, "fcfs"),
                                                        ("predicted-load", 5000, "priority")])
def test_fast_forward_changes_no_decision_with_migration(router, num_blocks, policy):
    slow, slow_stats, slow_res = simulate(False, router, num_blocks, migration=eager_migration(), policy=policy)
    fast, fast_stats, fast_res = simulate(True, router, num_blocks, migration=eager_migration(), policy=policy)
    assert len(slow) == 400 and slow == fast
    assert slow_stats == fast_stats
    assert slow_res.migration == fast_res.migration
    assert slow_res.migration["completed"] >= 10  # migrations really happened
    assert fast_res.num_events < slow_res.num_events  # and runs were still fast-forwarded


def test_kv_pool_is_sized_from_device_memory():
    model, hw = get_model("llama-3.1-8b"), get_hardware("h100-80g")
    cost = RooflineCostModel(hw, model)
    blocks = kv_blocks_for(hw.mem_bytes, cost.weight_bytes(), model, 16, 1, 2048, 256)
    tokens = blocks * 16
    # 80 GB * 0.9 - 16 GB of weights leaves ~55 GB; at 128 KiB per token that is ~420k tokens.
    assert 380_000 < tokens < 460_000
    with pytest.raises(ValueError, match="does not fit"):
        kv_blocks_for(hw.mem_bytes, RooflineCostModel(hw, get_model("llama-3.1-70b")).weight_bytes(),
                      get_model("llama-3.1-70b"), 16, 1, 2048, 256)


def test_roofline_is_memory_bound_at_decode_and_compute_bound_at_prefill():
    model, hw = get_model("llama-3.1-8b"), get_hardware("h100-80g")
    cost = RooflineCostModel(hw, model)
    one = cost.step_time(StepLoad.decodes(1, 512))
    many = cost.step_time(StepLoad.decodes(64, 64 * 512))
    assert many < 2.5 * one  # batching decodes is nearly free while weights dominate
    prefill = cost.step_time(StepLoad(4096, 1, 0, 0, 4096 * 2048.5, 4096))
    assert prefill > 8 * one
    tp2 = RooflineCostModel(hw, model, tp=2).step_time(StepLoad(4096, 1, 0, 0, 4096 * 2048.5, 4096))
    assert 0.5 * prefill < tp2 < prefill
    moe = get_model("mixtral-8x7b")
    assert moe.num_active_params < moe.num_params / 3


def test_profile_fit_recovers_a_known_piecewise_linear_cost(tmp_path):
    # Linear layers cost 60 ms at 1 token, 150 ms at 8, 200 ms at 64, 600 ms at 512 (GEMMs at
    # small batch run below peak), plus per-row LM-head and attention terms.
    knots_truth = {1: 0.060, 8: 0.150, 64: 0.200, 512: 0.600}
    per_unit = [1e-3, 8e-6, 1e-6]
    rng = random.Random(0)
    shapes = []
    for tokens in knots_truth:
        for _ in range(6):
            d = rng.randint(0, tokens)
            shapes.append(StepLoad(tokens, max(1, d), d, d * rng.randint(10, 900), rng.uniform(0, 1e5), 0))
    knots = choose_knots([s.num_tokens for s in shapes])
    assert knots == [1, 8, 64, 512]
    truth = list(knots_truth.values()) + per_unit
    times = [sum(c * f for c, f in zip(truth, features(s, knots))) for s in shapes]
    coef = fit_nonnegative([features(s, knots) for s in shapes], times)
    Profile("m", "here", "float32", 2, coef, [], knots).save(tmp_path / "p.json")
    model = ProfiledCostModel(Profile.load(tmp_path / "p.json"))
    for s, t in zip(shapes, times):
        assert model.step_time(s) == pytest.approx(t, rel=0.02)
    between = StepLoad(36, 1, 0, 0, 0.0, 0)  # halfway between the 8- and 64-token knots
    assert model.step_time(between) == pytest.approx(0.175 + 1e-3, rel=0.02)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError):
        Profile.load(tmp_path / "bad.json")


def test_simulate_cli_writes_the_bench_report(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-m", "sloserve.cli", "simulate", "--workload", "mooncake-conv", "--replay", "--duration", "60",
         "--instances", "2", "--router", "least-requests", "--slo", "ttft=2000,tpot=100", "--out", str(out),
         "--no-progress"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    data = json.loads((out / "results.json").read_text())
    run = data["runs"][0]
    assert run["config"]["simulated"] and run["outcome"]["completed"] == len(run["records"]) > 10
    assert all(r["ttft_s"] <= r["e2e_s"] for r in run["records"] if r["http_status"] == 200)
    assert (out / "latency_cdf.png").stat().st_size > 1000 and "TTFT" in (out / "report.md").read_text()
    bad = subprocess.run([sys.executable, "-m", "sloserve.cli", "simulate", "--hardware", "tpu-v9", "--num-requests",
                          "5", "--out", str(tmp_path / "bad")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown hardware" in bad.stderr


@settings(max_examples=200, deadline=None)
@given(length=st.integers(1, 300), uid=st.integers(0, 10**6),
       hash_ids=st.lists(st.integers(0, 10**9), max_size=4), hash_block=st.sampled_from([16, 48, 512]),
       a=st.integers(0, 320), b=st.integers(0, 320))
def test_synthetic_prompt_packs_and_slices_like_its_ids(length, uid, hash_ids, hash_block, a, b):
    """The lazy prompt's fast paths (ranges, packed int64) agree with reading it id by id."""
    prompt = SyntheticPrompt(length, uid, tuple(hash_ids), hash_block)
    ids = [prompt[i] for i in range(length)]
    start, stop = min(a, b), max(a, b)
    assert prompt[start:stop] == ids[start:stop]
    assert prompt.packed(start, stop) == array("q", ids[start:stop]).tobytes()


@settings(max_examples=50, deadline=None)
@given(length=st.integers(1, 200), hash_ids=st.lists(st.integers(0, 50), max_size=3),
       outputs=st.lists(st.integers(0, 40), min_size=1, max_size=3), tenant=st.sampled_from(["", "t1"]))
def test_block_keys_of_a_synthetic_prompt_match_its_ids(length, hash_ids, outputs, tenant):
    """The KV manager hashes a synthetic prompt from its packed bytes, and prompt + output in
    increments: the keys must be those of the plain token list."""
    kv = KVCacheManager(64, block_size=16)
    prompt = SyntheticPrompt(length, 7, tuple(hash_ids), 32)
    request = Request("r", prompt, SamplingParams(max_tokens=200), tenant=tenant)
    for n in outputs:  # the keys grow as tokens are appended
        kv.request_hashes(request)
        request.output_token_ids.extend([5] * n)
    tokens = [prompt[i] for i in range(length)] + request.output_token_ids
    assert kv.request_hashes(request) == hash_full_blocks(tokens, 16, tenant)
