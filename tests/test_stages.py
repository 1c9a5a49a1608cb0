"""Pipeline-parallel instances and their stage partitions (sloserve/stage_layout.py,
cluster/stages, sim/pipeline.py): the best split against brute force, what a step costs through
the stages, the dynamic policy moving layers only when it pays, and whole simulated runs."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fleet_helpers import sim_config
from sloserve.cluster.stages import STAGE_POLICIES, make_stage_policy
from sloserve.sched.costs import StepLoad
from sloserve.sim.catalog import get_model
from sloserve.sim.hardware import get_hardware, get_link
from sloserve.sim.pipeline import PipelineCostModel
from sloserve.simulation import FleetConfig, build_cost_model, build_fleet, fleet_gpus, sim_requests, simulate
from sloserve.stage_layout import StageLoad, best_partition, even_partition, layers_moved
from sloserve.workload.build import WorkloadSpec, build_stream


def compositions(layers: int, stages: int):
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(2, 12), stages=st.integers(1, 5), layer=st.floats(0.1, 5.0),
       head=st.floats(0.0, 20.0), send=st.floats(0.0, 1.0))
def test_the_best_partition_is_the_brute_force_optimum(layers, stages, layer, head, send):
    stages = min(stages, layers)
    load = StageLoad(layer, head, send)
    best = best_partition(layers, stages, load)
    assert sum(best) == layers and len(best) == stages and min(best) >= 1
    assert load.bottleneck(best) == pytest.approx(min(load.bottleneck(p) for p in compositions(layers, stages)))


def test_partitions_and_moves():
    assert even_partition(32, 4) == (8, 8, 8, 8) and even_partition(10, 4) == (3, 3, 2, 2)
    # 8B's LM head reads ~2.4 layers' worth of weights: in decode the last stage gives up layers
    assert best_partition(32, 4, StageLoad(1.0, 2.4, 0.01)) == (9, 9, 8, 6)
    assert best_partition(32, 4, StageLoad(1.0, 0.05, 0.01)) == (8, 8, 8, 8)  # prefill: the head is nothing
    assert layers_moved((8, 8, 8, 8), (9, 9, 8, 6)) == [1, 2, 2]
    with pytest.raises(ValueError, match="stages"):
        even_partition(3, 4)
    with pytest.raises(ValueError, match="unknown stage policy"):
        make_stage_policy("nope")
    assert set(STAGE_POLICIES) == {"even", "profiled", "dynamic"}


def cost_model(policy: str = "even", pp: int = 4, link: str = "pcie-gen4", **kw) -> PipelineCostModel:
    return PipelineCostModel(get_hardware("l40s"), get_model("llama-3.1-8b"), 1, pp,
                             make_stage_policy(policy, **kw), get_link(link))


def test_a_step_runs_the_slowest_stage_once_per_micro_batch():
    even = cost_model("even")
    batch = StepLoad.decodes(64, 64 * 1024)
    load, m = even.micro_load(batch)
    times = load.stage_times((8, 8, 8, 8))
    assert m == 4 and times[-1] == max(times)  # the LM head makes the last stage the slowest
    assert even.step_time(batch) == pytest.approx(4 * times[-1] + even.eff.step_overhead_s)
    alone = StepLoad.decodes(1, 1024)  # one sequence: one micro-batch crosses the stages in turn
    load1, m1 = even.micro_load(alone)
    assert m1 == 1 and even.step_time(alone) == pytest.approx(sum(load1.stage_times((8, 8, 8, 8)))
                                                               + even.eff.step_overhead_s)
    profiled = cost_model("profiled")
    assert profiled.partition == (9, 9, 8, 6)
    assert profiled.step_time(batch) < 0.9 * even.step_time(batch)
    # each GPU holds a quarter of the weights, so an instance of four stages has room for much more KV
    _, _, one = build_cost_model(FleetConfig(hardware="l40s"))
    _, _, four = build_cost_model(FleetConfig(hardware="l40s", pp=4))
    assert four > 4 * one and fleet_gpus(sim_config(hardware="l40s", pp=4, tp=2, instances=3)) == 24


def run_windows(model: PipelineCostModel, loads: list[StepLoad], start: float, window: float) -> float:
    """Run one step per load, spread evenly over [start, start + window)."""
    t = start
    for load in loads:
        model.advance(t)
        model.observe(load)
        t += window / len(loads)
    return t


def test_the_dynamic_policy_moves_layers_when_imbalance_persists_and_pays_for_the_move():
    model = cost_model("dynamic", window_s=10.0, threshold=0.05, persist=2)
    assert model.partition == (8, 8, 8, 8)
    decode = [StepLoad.decodes(64, 64 * 1024)] * 50
    t = run_windows(model, decode, 0.0, 10.0)
    model.advance(t + 1e-9)
    assert model.partition == (8, 8, 8, 8) and model.books.moves == 0  # one window is not a trend
    t = run_windows(model, decode, 10.0, 10.0)
    model.advance(t + 1e-9)
    assert model.partition == (9, 9, 8, 6) and model.books.moves == 1 and model.books.layers_moved == 5
    per_layer = model.layer_weight_bytes / get_link("pcie-gen4")
    assert model.books.stall_s == pytest.approx(2 * per_layer)  # two layers cross the busiest boundary
    assert model._pending_stall == pytest.approx(model.books.stall_s)  # the next step waits for the weights
    # Long prompts for two windows: the layers dominate, the head is nothing, the even split returns.
    prefill = [StepLoad.prefill(2048, 0)] * 50
    t = run_windows(model, prefill, 20.0, 10.0)
    t = run_windows(model, prefill, 30.0, 10.0)
    model.advance(t + 1e-9)
    assert model.partition == (8, 8, 8, 8) and model.books.moves == 2
    imbalance = [x for _, x in model.books.windows]
    assert imbalance[0] > 1.1 and len(imbalance) == 4
    # Over a link so slow that moving a layer costs more than a window's gain, nothing moves.
    slow = cost_model("dynamic", link="ethernet-25g", window_s=0.5, threshold=0.05, persist=1)
    t = run_windows(slow, decode[:3], 0.0, 0.5)
    slow.advance(t + 1e-9)
    assert slow.move_time((9, 9, 8, 6)) > 0.01 and slow.books.moves == 0


def azure(rate: float, duration: float) -> list:
    return build_stream(WorkloadSpec("azure-conv", rate=rate, duration_s=duration, arrival_process="poisson"))


def test_a_pipeline_parallel_fleet_serves_everything_and_the_balanced_split_is_faster():
    reqs = azure(5.0, 120.0)
    out = {}
    for policy in ("even", "profiled", "dynamic"):
        cfg = sim_config(instances=1, hardware="l40s", pp=4, stages=policy, stage_link="pcie-gen4",
                          stage_window_s=20.0)
        records, result = simulate(build_fleet(cfg), sim_requests(reqs))
        assert len(records) == len(reqs) and all(r.success for r in records)
        out[policy] = (np.mean([r.e2e_s for r in records]), result.stages[0])
    assert out["profiled"][0] < 0.95 * out["even"][0]
    assert out["dynamic"][0] < 0.95 * out["even"][0] and out["dynamic"][1]["moves"] >= 1
    assert out["even"][1]["moves"] == 0 and out["even"][1]["mean_imbalance"] > 1.1


def test_simulate_command_reports_the_stages_and_refuses_bad_settings(tmp_path, capsys):
    from sloserve.cli import main

    out = tmp_path / "pp"
    assert main(["simulate", "--workload", "azure-conv", "--rate", "4", "--duration", "60", "--hardware", "l40s",
                 "--pp", "4", "--stages", "dynamic", "--stage-window", "15", "--stage-link", "pcie-gen4",
                 "--out", str(out), "--no-progress"]) == 0
    assert "pipeline (4 stages, dynamic)" in capsys.readouterr().out
    doc = json.loads((out / "results.json").read_text())
    books = doc["runs"][0]["outcome"]["stage_books"] if "runs" in doc else doc["config"]["stage_books"]
    assert books and books[0]["partitions"][0][1] == [8, 8, 8, 8]
    for bad, message in ((["--pp", "0"], "--pp must be >= 1"), (["--pp", "4", "--stages", "nope"], "unknown stage"),
                         (["--pp", "40"], "between 1 and"), (["--pp", "2", "--stage-link", "carrier-pigeon"],
                                                             "unknown link"),
                         (["--pp", "2", "--experts", "static", "--model", "mixtral-8x7b"], "drop --pd")):
        assert main(["simulate", "--workload", "azure-conv", "--rate", "1", "--duration", "5", "--no-progress",
                     *bad]) == 2, bad
        assert message in capsys.readouterr().err, bad
