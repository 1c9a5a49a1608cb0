"""Heterogeneous models and GPUs (sloserve/hetero.py, `sloserve place`): the quality model's
calibration, deployments' cost and constraints, mixed-hardware fleets, and the joint search
finding a constructed problem's known optimum that the sequential baseline cannot reach."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fleet_helpers import sim_config
from sloserve import hetero
from sloserve.simulation import build_mixed_fleet, sim_requests, simulate
from sloserve.workload.build import WorkloadSpec, build_stream
from sloserve.workload.types import WorkloadRequest

pytest.importorskip("optuna")  # in the dev extra: a missing one is an install failure, not a skip in CI


def azure(rate: float, duration: float, seed: int = 1) -> list[WorkloadRequest]:
    return build_stream(WorkloadSpec("azure-conv", rate=rate, duration_s=duration, arrival_process="poisson",
                                     seed=seed))


def small_problem(**kw) -> hetero.Problem:
    reqs = azure(4.0, 60.0)
    settings = dict(available={"a10-24g": 1, "h100-80g": 4}, requests=reqs,
                    scores=hetero.difficulty_scores(len(reqs), 1))
    return hetero.Problem("llama-3.1-8b", "llama-3.1-70b", **{**settings, **kw})


def test_the_quality_model_is_calibrated_to_three_quarters_on_the_small_model_at_95_percent():
    scores = hetero.difficulty_scores(100_000, 0)
    q = hetero.QualityModel()
    assert q.quality(scores, hetero.easiest(scores, 0.75)) == pytest.approx(0.95, abs=0.002)
    assert q.quality(scores, hetero.easiest(scores, 0.0)) == 1.0
    assert q.max_share(scores, 0.95, 0.05) == pytest.approx(0.75)
    assert q.max_share(scores, 0.99, 0.05) == pytest.approx(0.30)  # 1 - gap x 0.3^2 / 2 = 0.992; 0.35: 0.989
    mask = hetero.easiest(np.array([0.9, 0.1, 0.5, 0.3]), 0.5)
    assert mask.tolist() == [False, True, False, True]  # the easiest half


def test_options_pick_the_smallest_tensor_parallel_degree_that_holds_the_model():
    prob = small_problem(available={"h100-80g": 8, "a10-24g": 16, "a100-80g": 8})
    keys = {o.key for o in prob.options()}
    # 70B's 141 GB of weights need four 80 GB GPUs (two leave no room for KV) and eight A10s; 8B fits on one
    assert keys == {"small:h100-80g:tp1", "small:a10-24g:tp1", "small:a100-80g:tp1",
                    "large:h100-80g:tp4", "large:a10-24g:tp8", "large:a100-80g:tp4"}
    wide = {o.key for o in small_problem(available={"h100-80g": 8}, wide_tp=True).options()}
    assert wide == {"small:h100-80g:tp1", "small:h100-80g:tp2", "large:h100-80g:tp4", "large:h100-80g:tp8"}


def test_a_deployment_costs_its_gpus_and_breaks_constraints_without_being_run():
    prob = small_problem()
    opts = {o.key: o for o in prob.options()}
    large, small_a10, small_h100 = opts["large:h100-80g:tp4"], opts["small:a10-24g:tp1"], opts["small:h100-80g:tp1"]
    dep = hetero.Deployment.of({large: 1, small_a10: 1, small_h100: 0})
    assert dep.gpus() == {"h100-80g": 4, "a10-24g": 1} and dep.cost_per_hour(prob.prices) == pytest.approx(12.71)
    ok = hetero.evaluate(prob, 0.5, dep)
    assert ok.feasible and 1 < ok.p95_s < 100 and ok.small_share == pytest.approx(0.5, abs=0.01)
    too_many = hetero.evaluate(prob, 0.5, hetero.Deployment.of({large: 1, small_h100: 1}))  # 5 of 4 H100s
    assert not too_many.feasible and dict(too_many.violations)["gpus:h100-80g"] == 1
    assert too_many.p95_s == hetero.UNSERVED_P95_S
    nobody = hetero.evaluate(prob, 0.5, hetero.Deployment.of({large: 1}))  # half the queries have no model
    assert not nobody.feasible and dict(nobody.violations)["instances:small"] == 1
    worse = hetero.evaluate(prob, 0.9, dep)  # past what quality allows: run, but infeasible
    assert not worse.feasible and dict(worse.violations)["quality"] > 0 and worse.p95_s < hetero.UNSERVED_P95_S
    unused = hetero.evaluate(prob, 0.0, dep)  # no query for the small model: its A10 still costs
    assert unused.feasible and unused.cost_per_hour == pytest.approx(12.71)


def test_a_mixed_fleet_sends_more_work_to_its_faster_instances():
    reqs = azure(6.0, 60.0)
    h100 = sim_config(instances=1, model="llama-3.1-8b", hardware="h100-80g")
    a10 = sim_config(instances=1, model="llama-3.1-8b", hardware="a10-24g")
    groups = [h100, a10, sim_config(instances=0, model="llama-3.1-8b", hardware="a100-80g")]
    records, _ = simulate(build_mixed_fleet(groups), sim_requests(reqs))
    assert len(records) == len(reqs) and all(r.success for r in records)
    finished = build_mixed_fleet(groups).run(list(sim_requests(reqs))).finished
    per_instance = [sum(f.instance_id == i for f in finished) for i in (0, 1)]
    assert per_instance[0] > 1.2 * per_instance[1]  # least-requests: the H100 empties its queue faster
    slow, _ = simulate(build_mixed_fleet([sim_config(instances=2, model="llama-3.1-8b", hardware="a10-24g")]),
                       sim_requests(reqs))
    assert np.percentile([r.e2e_s for r in records], 95) < np.percentile([r.e2e_s for r in slow], 95)
    with pytest.raises(ValueError, match="one model"):
        build_mixed_fleet([h100, sim_config(instances=1, model="llama-2-7b", hardware="a10-24g")])
    with pytest.raises(ValueError, match="at least one instance"):
        build_mixed_fleet([sim_config(instances=0)])


@pytest.mark.parametrize("sampler, trials", [("gp", 40), ("tpe", 50)])
@pytest.mark.slow
def test_the_joint_search_finds_the_known_optimum_the_sequential_one_cannot(sampler, trials):
    """One A10 and four H100s: 70B needs all four H100s, so the small model can only run on the
    A10, where 8B decodes slower (27 ms a token) than 70B on four H100s (~11 ms). Enumerating the
    space: the front is the single point of no small model (all queries on the large one, $11.96
    an hour, the lowest P95 of any split). Routing first sends 75% to the small model (the most
    quality allows), which needs the A10 and queues there: a dearer, slower deployment. The budget
    is the search's: half of its opening trials sit at routing-first's split, useless here."""
    prob = small_problem()
    assert prob.max_share() == pytest.approx(0.75)
    opts = {o.key: o for o in prob.options()}
    best = hetero.evaluate(prob, 0.0, hetero.Deployment.of({opts["large:h100-80g:tp4"]: 1}))
    grid = [hetero.evaluate(prob, s, hetero.Deployment.of({opts["large:h100-80g:tp4"]: 1,
                                                           opts["small:a10-24g:tp1"]: 1})) for s in (0.25, 0.5, 0.75)]
    assert all(g.p95_s > best.p95_s for g in grid)
    joint = hetero.search(prob, "joint", trials=trials, sampler=sampler, seed=0).front()
    sequential = hetero.search(prob, "sequential", trials=trials, sampler=sampler, seed=0).front()
    assert [(o.cost_per_hour, o.p95_s, o.share) for o in joint] == [(best.cost_per_hour, best.p95_s, 0.0)]
    assert len(sequential) == 1 and sequential[0].share == pytest.approx(0.75)
    assert sequential[0].cost_per_hour == pytest.approx(12.71) and sequential[0].p95_s > 3 * best.p95_s
    assert hetero.hypervolume(joint, 20.0, 100.0) > hetero.hypervolume(sequential, 20.0, 100.0)


def test_pareto_front_and_comparisons():
    dep = hetero.Deployment(())

    def o(cost, p95):
        return hetero.Outcome(0.0, dep, cost, p95, p95, 1.0, 0.0, True)

    pts = [o(10, 20), o(12, 10), o(12, 15), o(15, 10), o(20, 5), o(9, 50)]
    front = hetero.pareto_front(pts)
    assert [(p.cost_per_hour, p.p95_s) for p in front] == [(9, 50), (10, 20), (12, 10), (20, 5)]
    assert hetero.best_within(front, 14).p95_s == 10 and hetero.best_within(front, 8) is None
    assert hetero.cheapest_meeting(front, 12).cost_per_hour == 12
    # hypervolume in (cost, log10 p95) below (30, 100): strips from each point to the next
    expected = (10 - 9) * (2 - np.log10(50)) + (12 - 10) * (2 - np.log10(20)) + (20 - 12) * (2 - 1) \
        + (30 - 20) * (2 - np.log10(5))
    assert hetero.hypervolume(pts, 30, 100) == pytest.approx(expected)


def test_place_command_writes_fronts_and_refuses_bad_input(tmp_path, capsys):
    from sloserve.cli import main

    out = tmp_path / "place"
    assert main(["place", "--rate", "2", "--duration", "20", "--trials", "6", "--sampler", "tpe",
                 "--gpus", "h100-80g=4,a10-24g=2", "--out", str(out), "--no-progress"]) == 0
    doc = json.loads((out / "place.json").read_text())
    assert set(doc["fronts"]) == {"joint", "sequential"} and doc["max_small_share"] == pytest.approx(0.75, abs=0.1)
    assert all(len(run) == 6 for s in doc["searches"].values() for run in s)
    assert all(p["share"] == doc["max_small_share"] for run in doc["searches"]["sequential"] for p in run)
    assert (out / "front.png").stat().st_size > 10_000
    capsys.readouterr()
    for bad, message in ((["--gpus", "h100-80g=0"], "COUNT >= 1"), (["--gpus", "tpu=4"], "unknown hardware"),
                         (["--sampler", "nope"], "--sampler"), (["--prices", "h100-80g=free"], "--prices"),
                         (["--gpus", "a10-24g=2", "--large", "llama-3.1-70b"], "llama-3.1-70b fits on none"),
                         (["--strategies", "both"], "--strategies"), (["--rate", "0"], "--rate")):
        assert main(["place", "--trials", "2", "--duration", "5", *bad]) == 2, bad
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (bad, err)
