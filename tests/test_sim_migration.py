"""Live migration in the simulator: the real schedulers and KV managers on both ends of every
move, priced on the link. Every request still ends at its recorded length, no block leaks on
any instance whatever aborts, the counters add up, fast-forward changes no decision, and on an
imbalanced fleet `balance` shortens the queues that routing alone left behind."""
from __future__ import annotations

import json
import logging
import random
import subprocess
import sys
from collections import Counter

import pytest

from sloserve.cluster.controller import FleetController
from sloserve.cluster.migration import (BalancePolicy, CombinedPolicy, DefragPolicy, MigrationOptions, MoveCosts,
                                        make_migration_policy)
from sloserve.cluster.routers import make_router
from sloserve.core.config import SchedulerConfig
from sloserve.sim.catalog import get_model
from sloserve.sim.cost import RooflineCostModel
from sloserve.sim.hardware import get_hardware, get_link
from sloserve.sim.instance import SimInstance
from sloserve.sim.simulator import SimResult, Simulator
from sloserve.core.types import Request, SamplingParams

MODEL = get_model("llama-2-7b")
KV_PER_TOKEN = MODEL.kv_bytes_per_token(2)


def fleet(n: int, num_blocks: int, fast_forward: bool = True) -> list[SimInstance]:
    cost = RooflineCostModel(get_hardware("a10-24g"), MODEL)
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64)
    return [SimInstance(i, cost, num_blocks, 4096, cfg, fast_forward=fast_forward) for i in range(n)]


def mispredicted(n: int = 80, seed: int = 5) -> list[Request]:
    """Requests whose predicted lengths are often wrong: balance moves some that then end while
    their KV is still on the wire."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(4.0)
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(50, 600))]
        params = SamplingParams(max_tokens=rng.choice([5, 30, 400, 900]), ignore_eos=True, temperature=0)
        out.append(Request(f"r{i}", prompt, params, arrival_time=t, predicted_output_len=rng.choice([20, 800])))
    return out


def churn(fast_forward: bool = True) -> tuple[list[SimInstance], list[Request], SimResult]:
    """Three small pools, a slow link (0.3 GB/s: a long request's copy takes seconds) and eager
    thresholds: moves complete, and others abort in every phase (no room on the target at the
    start, the request finished during pre-copy, the target full when the request stops to leave)."""
    instances = fleet(3, 200, fast_forward)
    policy = CombinedPolicy([BalancePolicy(min_gap=64, rel_gap=0.05, min_gain=0, options=MigrationOptions(max_copy_s=60.0,
                                                                                              headroom=0.0)),
                             DefragPolicy()])
    controller = FleetController(make_router("round-robin"), policy, min_interval_s=0.2)
    requests = mispredicted()
    result = Simulator(instances, controller, MoveCosts.uniform(KV_PER_TOKEN, 0.3e9)).run(requests)
    return instances, requests, result


def assert_clean(instances: list[SimInstance]) -> None:
    for instance in instances:
        instance.kv.check_invariants()
        assert instance.kv.num_pinned_blocks == 0  # no reservation left behind
        assert instance.kv.pool.num_used == 0  # every block free (cached ones count as free)
        assert not instance.scheduler.requests and not instance.scheduler.suspended


def test_every_request_finishes_and_no_block_leaks_through_completed_and_aborted_moves(caplog):
    caplog.set_level(logging.DEBUG, logger="sloserve.sim.migration")
    instances, requests, result = churn()
    assert result.num_finished == len(requests) == 80
    for r in requests:
        assert len(r.output_token_ids) == r.sampling_params.max_tokens, r.request_id
        assert r.first_token_time <= r.finished_time
    assert_clean(instances)
    m = result.migration
    assert m["started"] == m["completed"] + m["aborted"]
    assert m["completed"] >= 10 and m["aborted"] >= 3
    moved_in = sum(i.scheduler.stats.num_migrated_in for i in instances)
    moved_out = sum(i.scheduler.stats.num_migrated_out for i in instances)
    assert moved_in == moved_out == m["completed"]
    assert m["bytes"] >= m["completed"] * 50 * KV_PER_TOKEN  # every prompt had >= 50 tokens
    assert 0 < m["downtime_s"] < result.end_time
    aborts = Counter(rec.getMessage().rsplit("(", 1)[-1].rstrip(")") for rec in caplog.records
                     if "aborted" in rec.getMessage())
    assert {"precopy", "suspending"} <= set(aborts) and any("no room" in k for k in aborts)


def test_fast_forward_changes_no_decision_through_aborts():
    slow_instances, slow_requests, slow = churn(fast_forward=False)
    fast_instances, fast_requests, fast = churn(fast_forward=True)

    def timings(requests):
        return [(r.request_id, r.first_token_time, r.finished_time, r.num_preemptions) for r in requests]

    assert timings(slow_requests) == timings(fast_requests)
    assert slow.migration == fast.migration
    assert ([(i.scheduler.stats.num_steps, i.scheduler.stats.num_migrated_in) for i in slow_instances]
            == [(i.scheduler.stats.num_steps, i.scheduler.stats.num_migrated_in) for i in fast_instances])
    assert fast.num_events < slow.num_events


def alternating(n: int = 60, gap: float = 0.5) -> list[Request]:
    """Pairs arriving together: a long generation and a short one. Round-robin sends every long
    one to instance 0 and every short one to instance 1."""
    out = []
    for i in range(n):
        prompt = list(range(1000 + 7 * i, 1200 + 7 * i))
        params = SamplingParams(max_tokens=1500 if i % 2 == 0 else 20, ignore_eos=True, temperature=0)
        out.append(Request(f"r{i}", prompt, params, arrival_time=(i // 2) * gap))
    return out


def run_alternating(migration: str) -> tuple[list[Request], list[SimInstance], SimResult]:
    instances = fleet(2, 400)
    controller = FleetController(make_router("round-robin"), make_migration_policy(migration))
    requests = alternating()
    result = Simulator(instances, controller, MoveCosts.uniform(KV_PER_TOKEN, get_link("infiniband-ndr"))).run(requests)
    return requests, instances, result


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def test_balance_relieves_the_instance_routing_overloaded():
    still, still_instances, still_res = run_alternating("none")
    moved, moved_instances, moved_res = run_alternating("balance")
    assert still_res.migration == {} and moved_res.migration["completed"] >= 5
    ttft_still = p99([r.first_token_time - r.arrival_time for r in still])
    ttft_moved = p99([r.first_token_time - r.arrival_time for r in moved])
    assert ttft_moved < 0.6 * ttft_still
    preempted = [sum(i.scheduler.stats.num_preemptions for i in fleet_) for fleet_ in (still_instances,
                                                                                       moved_instances)]
    assert preempted[1] < preempted[0]
    assert moved_res.end_time < 0.8 * still_res.end_time  # the idle instance took its share of the long ones
    assert_clean(moved_instances)


def test_simulator_needs_move_costs_for_a_migration_policy():
    with pytest.raises(ValueError, match="MoveCosts"):
        Simulator(fleet(2, 100), FleetController(make_router("round-robin"), make_migration_policy("balance")))
    Simulator(fleet(2, 100), make_router("round-robin"))  # a bare router still works (routing only)


def test_simulate_cli_runs_and_reports_migration(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-m", "sloserve.cli", "simulate", "--workload", "azure-conv", "--replay", "--duration", "40",
         "--instances", "3", "--hardware", "a10-24g", "--model", "llama-2-7b", "--migration", "balance,defrag",
         "--router", "round-robin", "--migration-interval", "0.1",  # round-robin leaves imbalance to move
         "--link", "roce-100g", "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["config"]["migration"] == "balance,defrag" and run["config"]["link"] == "roce-100g"
    m = run["outcome"]["migrations"]
    assert m["started"] == m["completed"] + m["aborted"] and m["completed"] > 0
    assert "migration (balance,defrag over roce-100g)" in " ".join(res.stdout.split())
    bad = subprocess.run([sys.executable, "-m", "sloserve.cli", "simulate", "--link", "carrier-pigeon",
                          "--num-requests", "5", "--out", str(tmp_path / "bad")], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "unknown link" in bad.stderr


def test_a_drained_instance_takes_nothing_new_and_its_running_requests_move_off():
    instances = fleet(2, 400)
    controller = FleetController(make_router("round-robin"), make_migration_policy("drain"), min_interval_s=0.2)
    sim = Simulator(instances, controller, MoveCosts.uniform(KV_PER_TOKEN, get_link("infiniband-ndr")))
    rng = random.Random(3)
    requests = [Request(f"d{i}", [rng.randrange(100, 30000) for _ in range(200)],
                        SamplingParams(max_tokens=600, ignore_eos=True, temperature=0), arrival_time=0.05 * i)
                for i in range(20)]
    sim.drain_at(0.3, 0)
    result = sim.run(requests)
    assert result.num_finished == 20 and result.migration["completed"] >= 1
    where = {f.request.request_id: f.instance_id for f in result.finished}
    for r in requests:
        assert len(r.output_token_ids) == 600
        if r.arrival_time > 0.3:
            assert where[r.request_id] == 1, r.request_id  # routed around the drained instance
    # what ran on instance 0 at the drain moved off (600 tokens take far longer than their copy)
    assert sum(1 for i in where.values() if i == 0) < sum(1 for r in requests if r.arrival_time <= 0.3) / 2
    assert_clean(instances)
