"""Mixture-of-experts placement: the policies (cluster/experts) on constructed popularity with a known
best answer, the drifting popularity and the expert-parallel cost model (sim/experts.py), and whole
simulated runs that re-place, move and report."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from fleet_helpers import sim_config
from sloserve.cli import main
from sloserve.cluster.experts import make_expert_placer, pack, replicate
from sloserve.expert_layout import ExpertPlacement
from sloserve.sched.costs import StepLoad
from sloserve.sim.catalog import get_model
from sloserve.sim.experts import ExpertParallelCostModel, ExpertPopularity
from sloserve.sim.hardware import get_hardware
from sloserve.simulation import build_fleet, sim_requests, simulate
from sloserve.workload.build import WorkloadSpec, build_stream

# One layer of 8 experts: expert 0 takes half the tokens, the rest share the other half.
SKEWED = [[0.5] + [0.5 / 7] * 7]


def test_static_is_the_training_layout_and_pays_for_a_hot_expert():
    placement = make_expert_placer("static").place(SKEWED, 4)
    assert placement.layers[0] == ((0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,))
    # GPU 0 holds experts 0 and 1: 0.5 + 0.071 of the tokens against an even 0.25.
    assert placement.straggler(SKEWED) == pytest.approx((0.5 + 0.5 / 7) * 4)


def test_replicate_hot_spreads_the_hot_expert_until_the_loads_even_out():
    placement = make_expert_placer("replicate-hot", redundant=1).place(SKEWED, 4)
    copies = placement.layers[0]
    assert len(copies[0]) == 4  # 0.5 over 4 copies = 0.125, then the rest are as heavy as its copies
    assert placement.copies_total() == 12 and placement.slots_per_gpu() == 3
    assert placement.straggler(SKEWED) < 1.15
    assert placement.straggler(SKEWED) < make_expert_placer("static").place(SKEWED, 4).straggler(SKEWED)
    assert replicate([0.5, 0.5], 10, gpus=3) == [3, 3]  # never more copies than GPUs


def test_offload_cold_keeps_the_coldest_share_in_host_memory():
    pop = [[0.30, 0.01, 0.20, 0.02, 0.25, 0.03, 0.15, 0.04]]
    placement = make_expert_placer("offload-cold", offload_share=0.25).place(pop, 2)
    assert placement.offloaded(0) == [1, 3]
    assert placement.slots_per_gpu() == 3
    assert placement.home(1) == 1 and placement.home(3) == 1


def test_only_rebalance_re_places_and_bad_options_are_refused():
    assert make_expert_placer("rebalance").interval_s == 600.0
    assert make_expert_placer("rebalance", interval_s=60).interval_s == 60
    assert make_expert_placer("replicate-hot", interval_s=60).interval_s is None
    with pytest.raises(ValueError, match="unknown expert placement"):
        make_expert_placer("random")
    with pytest.raises(ValueError):
        make_expert_placer("offload-cold", offload_share=1.0)
    with pytest.raises(ValueError, match="distinct GPUs"):
        ExpertPlacement(2, (((0, 0),),))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.001, 1.0), min_size=2, max_size=24), st.integers(1, 6), st.integers(0, 3))
def test_packing_places_every_copy_once_per_gpu_and_evenly(weights, gpus, extra):
    total = sum(weights)
    pop = [w / total for w in weights]
    counts = replicate(pop, len(pop) + extra * gpus, gpus)
    where = pack(pop, counts, gpus)
    assert [len(w) for w in where] == counts
    assert all(len(set(w)) == len(w) for w in where)
    used = [sum(g in w for w in where) for g in range(gpus)]
    assert max(used) == math.ceil(sum(counts) / gpus)
    placement = ExpertPlacement(gpus, (where,))
    assert sum(placement.gpu_shares(0, pop)) == pytest.approx(1.0)


def test_popularity_is_skewed_as_asked_and_drifts_only_when_asked():
    fixed = ExpertPopularity(4, 16, skew=0.6, drift_s=0, seed=1)
    before = [list(layer) for layer in fixed.current]
    fixed.advance_to(30)
    assert fixed.current == before
    assert all(sum(layer) == pytest.approx(1.0) for layer in before)
    assert ExpertPopularity(1, 8, skew=0.0).current == [[1 / 8] * 8]
    moving = ExpertPopularity(4, 16, skew=0.6, drift_s=600, epoch_s=60, seed=1)
    assert moving.current == before  # same seed, same start
    moving.advance_to(30)  # 30 minutes at a 10-minute time constant: little of the start is left
    hot_then = [max(range(16), key=layer.__getitem__) for layer in before]
    hot_now = [max(range(16), key=layer.__getitem__) for layer in moving.current]
    assert hot_then != hot_now
    assert ExpertPopularity(4, 16, skew=0.6, drift_s=600, seed=1).current == before


def cost(placement: ExpertPlacement, pop: ExpertPopularity, model: str = "mixtral-8x7b") -> ExpertParallelCostModel:
    return ExpertParallelCostModel(get_hardware("h100-80g"), get_model(model), placement.gpus, placement, pop)


def test_the_straggler_sets_a_compute_bound_step_and_offloaded_experts_cost_host_transfers():
    model = get_model("mixtral-8x7b")
    pop = ExpertPopularity(model.num_layers, 8, skew=0.0)  # even popularity
    even = ExpertPlacement(8, tuple(tuple((e,) for e in range(8)) for _ in range(model.num_layers)))
    crowded = ExpertPlacement(8, tuple(((0,), (0,), (0,), (0,), (4,), (5,), (6,), (7,))
                                       for _ in range(model.num_layers)))
    prefill = StepLoad.prefill(4096)
    t_even, t_crowded = cost(even, pop).step_time(prefill), cost(crowded, pop).step_time(prefill)
    assert t_crowded > 1.5 * t_even  # GPU 0 computes half of the tokens
    one_gpu = ExpertPlacement(1, tuple(tuple((0,) for _ in range(8)) for _ in range(model.num_layers)))
    assert cost(one_gpu, pop).step_time(prefill) > t_even  # no all-to-all, but one GPU does it all
    offload = make_expert_placer("offload-cold", offload_share=0.25).place(pop.current, 8)
    decode = StepLoad.decodes(16, 16 * 512)
    off = cost(offload, pop)
    assert off.step_time(decode) > 2 * cost(even, pop).step_time(decode)  # two experts per layer over PCIe
    assert off._moe(16)[1] > 0
    assert off.weight_bytes() < cost(even, pop).weight_bytes()
    replicated = make_expert_placer("replicate-hot", redundant=1).place(pop.current, 8)
    assert cost(replicated, pop).weight_bytes() > cost(even, pop).weight_bytes()
    with pytest.raises(ValueError, match="no experts"):
        ExpertParallelCostModel(get_hardware("h100-80g"), get_model("llama-3.1-8b"), 8, even, pop)


def run(policy: str, drift_s: float, duration: float = 240.0, **kw):
    stream = list(build_stream(WorkloadSpec(name="sharegpt", rate=3.0, num_requests=int(3 * duration))))
    cfg = sim_config(instances=1, model="mixtral-8x7b", tp=8, experts=policy, expert_skew=0.8,
                      expert_drift_s=drift_s, expert_epoch_s=20.0, expert_interval_s=60.0, **kw)
    sim = build_fleet(cfg)
    records, result = simulate(sim, sim_requests(stream))
    return records, result.experts[0], sim


def test_under_drift_rebalancing_keeps_the_load_even_and_pays_for_its_moves():
    _, static, _ = run("static", 120.0)
    _, hot, _ = run("replicate-hot", 120.0)
    records, again, sim = run("rebalance", 120.0)
    assert static["replacements"] == hot["replacements"] == 0
    assert again["replacements"] >= 3 and again["moved_copies"] > 0 and again["stall_s"] > 0
    assert again["moved_bytes"] == again["moved_copies"] * 3 * 4096 * 14336 * 2
    assert again["mean_straggler"] < hot["mean_straggler"] < static["mean_straggler"]
    assert all(r.error is None for r in records)
    assert sim.instances[0].cost_model.placement.copies_total() == get_model("mixtral-8x7b").num_layers * 16
    # Fixed popularity: the placement found first stays right, so nothing moves.
    _, still, _ = run("rebalance", 0.0)
    assert still["replacements"] >= 3 and still["moved_copies"] == 0


def test_simulate_places_experts_and_refuses_what_it_cannot_price(tmp_path, capsys):
    base = ["simulate", "--workload", "sharegpt", "--rate", "3", "--num-requests", "90", "--no-progress",
            "--model", "mixtral-8x7b", "--tp", "8"]
    assert main(base + ["--experts", "rebalance", "--expert-interval", "10", "--out", str(tmp_path)]) == 0
    assert "experts (rebalance): mean straggler" in capsys.readouterr().out
    run = json.loads((tmp_path / "results.json").read_text())["runs"][0]
    assert run["config"]["experts"] == "rebalance" and run["outcome"]["expert_books"][0]["replacements"] >= 2
    assert run["outcome"]["expert_weights_gb"][0] > 0
    assert main(base[:-4] + ["--experts", "static"]) == 2
    assert "has none" in capsys.readouterr().err
    assert main(base + ["--experts", "static", "--clock-policy", "max"]) == 2
    assert "drop --profile and --clock-policy" in capsys.readouterr().err
