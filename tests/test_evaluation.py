"""The held-out evaluation suite (sloserve/evaluation, `sloserve evaluate`): the dev/test split is a
fixed function of each cell's description, the grids load as declared, verdicts follow the noise
rule, the tuner never sees a test cell, and the quick grid runs end to end with real numbers."""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import re
import struct
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from sloserve.cli import main
from sloserve.cluster.migration import MIGRATION_POLICIES
from sloserve.cluster.autoscale import ScalingOptions, make_autoscaler
from sloserve.evaluation.decisions import DECISIONS, GoodputDecision, make_decision, measure_of
from sloserve.evaluation.decisions.autoscaling import (ORACLE, REACTIVE, STATIC, ScalingMetrics, ScalingSetting,
                                                       judge_pair, policy_names)
from sloserve.evaluation.fleet import Setting
from sloserve.evaluation.metrics import CellMetrics, LoadPoint
from sloserve.evaluation.decisions.disaggregation import CHOICE, planner_choice
from sloserve.evaluation.decisions.forecasting import BASELINE, ForecastSetting
from sloserve.evaluation.report import write_report
from sloserve.evaluation.runner import Evaluation, git_state, run_evaluation, write_results
from sloserve.evaluation.suite import Cell, Measure, cells, load_grid, split_of
from sloserve.evaluation.tune import tune
from sloserve.evaluation.verdict import NOISE_FLOOR, judge, seed_ratios
from sloserve.fleet_view import ScalingSignals
from sloserve.planning import Goodput

GRID = """
defaults:
  instances: 4
  slo: 1.0
axes:
  trace: [azure-conv, azure-code, sharegpt]
  hardware: [h100-80g, a10-24g]
  slo: [1.0, 0.5]
exclude:
  - {hardware: a10-24g, slo: 0.5}
measure: {sustain_s: 30}
quick:
  trace: [azure-conv]
  measure: {sustain_s: 5}
"""


def write_grid(folder: Path, text: str, name: str = "toy") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(text)
    return folder


# ---- the split --------------------------------------------------------------------------------

def test_the_split_is_the_hash_of_the_canonical_description():
    cell = Cell.make("routing", {"trace": "azure-conv", "slo": 0.5, "hardware": "a10-24g"})
    text = '{"decision":"routing","settings":{"hardware":"a10-24g","slo":0.5,"trace":"azure-conv"}}'
    assert cell.description == text  # sorted keys, no spaces, whatever order the settings came in
    expected = "test" if int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % 100 < 40 else "dev"
    assert split_of(cell) == cell.split == expected
    assert Cell.make("routing", {"hardware": "a10-24g", "trace": "azure-conv", "slo": 0.5}) == cell


@pytest.mark.parametrize("decision, settings, split", [
    ("routing", {"trace": "azure-conv"}, "test"),
    ("routing", {"instances": 12, "trace": "mooncake-conv"}, "dev"),
    ("routing", {"hardware": "a10-24g", "model": "llama-2-7b", "slo": 2.0, "trace": "sharegpt"}, "dev"),
    ("routing", {"hardware": "a10-24g", "model": "llama-2-7b", "slo": 2.0, "trace": "azure-code"}, "test"),
    ("routing", {"hardware": "a10-24g", "instances": 2, "model": "llama-2-7b", "trace": "azure-conv"}, "dev"),
    ("migration", {"link": "roce-100g", "trace": "mooncake-conv"}, "dev"),
    ("migration", {"hardware": "a10-24g", "model": "llama-2-7b", "trace": "azure-conv"}, "test"),
    ("migration", {"slo": 0.5, "trace": "synthetic"}, "dev"),
])
def test_named_cells_keep_their_split(decision, settings, split):
    """Pinned: a change to the description or the hash that moved these would reshuffle every claim."""
    assert split_of(Cell.make(decision, settings)) == split
    grid = load_grid(decision)
    shipped = Cell.make(decision, {**grid.defaults, **settings}, grid.defaults)
    assert shipped.description == Cell.make(decision, settings).description  # defaults are not described
    if settings.get("instances") != 2:  # (the quick grid's cells are not in the full grid)
        assert shipped in grid.cells


def test_adding_a_setting_or_an_axis_value_moves_no_other_cell(tmp_path):
    before = load_grid("toy", root=write_grid(tmp_path / "a", GRID)).cells
    grown = GRID.replace("trace: [azure-conv, azure-code, sharegpt]",  # one more value, one more axis
                         "trace: [azure-conv, azure-code, sharegpt, mooncake-conv]\n"
                         "  link: [infiniband-ndr, roce-100g]")
    grown = grown.replace("defaults:\n", "defaults:\n  link: infiniband-ndr\n")
    after = load_grid("toy", root=write_grid(tmp_path / "b", grown)).cells
    old = {c.description: c.split for c in before}
    new = {c.description: c.split for c in after}
    assert len(after) == len(before) * 2 + 6  # each old cell again on roce-100g, and mooncake-conv on both links
    assert all(new[d] == s for d, s in old.items())  # every old cell: same description, same split
    assert all(dict(c.defaults)["link"] == "infiniband-ndr" for c in after if c.description in old)
    added = [c for c in after if c.description not in old]
    assert {c.split for c in added} == {"dev", "test"}


def test_about_forty_percent_of_a_large_grid_is_test(tmp_path):
    text = "axes:\n  a: [" + ", ".join(map(str, range(40))) + "]\n  b: [" + \
        ", ".join(f"b{i}" for i in range(25)) + "]\n  c: [0.5, 1.0, 2.0, 4.0]\n"
    grid = load_grid("big", root=write_grid(tmp_path, text, "big"))
    share = sum(c.split == "test" for c in grid.cells) / len(grid.cells)
    assert len(grid.cells) == 4000
    assert 0.37 < share < 0.43


def test_grids_load_with_their_exclusions_and_quick_overrides(tmp_path):
    root = write_grid(tmp_path, GRID)
    grid = load_grid("toy", root=root)
    assert len(grid.cells) == 3 * 2 * 2 - 3 and grid.measure_as(Measure).sustain_s == 30
    assert not any(c.params["hardware"] == "a10-24g" and c.params["slo"] == 0.5 for c in grid.cells)
    quick = load_grid("toy", quick=True, root=root)
    assert {c.params["trace"] for c in quick.cells} == {"azure-conv"} and quick.measure_as(Measure).sustain_s == 5
    both = cells("toy", "both", root=root)
    assert sorted(c.description for c in cells("toy", "dev", root=root) + cells("toy", "test", root=root)) == \
        sorted(c.description for c in both)
    for bad, message in [("axes: {trace: azure-conv}", "list of values"), (GRID + "bogus: 1\n", "unknown key"),
                         (GRID.replace("hardware: a10-24g, slo", "gpu: a10-24g, slo"), "exclude names unknown"),
                         (GRID.replace("sustain_s: 30", "sustain_s: 0"), "sustain_s must be > 0")]:
        with pytest.raises(ValueError, match=message):
            load_grid("toy", root=write_grid(tmp_path / "bad", bad)).measure_as(Measure)


def test_a_quick_grid_withholds_the_full_grids_test_cells(tmp_path):
    full = load_grid("toy", root=write_grid(tmp_path, GRID))
    held_out = next(c for c in full.cells if c.split == "test")
    kept = next(c for c in full.cells if c.split == "dev")
    picks = {k: sorted({held_out.params[k], kept.params[k]}, key=str) for k in full.axes}
    leaking = GRID.split("quick:")[0] + "quick:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in picks.items())
    quick = load_grid("toy", quick=True, root=write_grid(tmp_path / "leaking", leaking))
    assert held_out.description not in {c.description for c in quick.cells}  # withheld
    assert kept.description in {c.description for c in quick.cells}  # a dev cell of the full grid may be run


def test_shipped_grids_are_moderate_and_their_quick_grids_hold_both_splits():
    goodput = [d for d, cls in DECISIONS.items() if issubclass(cls, GoodputDecision)]
    assert {"routing", "migration"} <= set(goodput) and "autoscaling" in DECISIONS
    for decision in DECISIONS:
        full, quick = load_grid(decision), load_grid(decision, quick=True)
        assert measure_of(decision) != measure_of(decision, quick=True)  # both read by the decision's own type
        assert 20 <= len(full.cells) <= 120
        assert 2 <= len(quick.cells) <= 4 and {c.split for c in quick.cells} == {"dev", "test"}
        held_out = {c.description for c in full.cells if c.split == "test"}
        assert not held_out & {c.description for c in quick.cells}  # smoke runs never measure a claim's cell
        for cell in full.cells + quick.cells:  # every cell names every setting its runs need
            if decision in goodput:
                Setting.of(cell.params)
                assert make_decision(decision).policies(cell).candidates
            else:
                {"autoscaling": ScalingSetting, "forecasting": ForecastSetting}[decision].of(cell.params)
        if decision in goodput:
            assert not any(c.params["model"] == "llama-2-7b" and c.params["trace"].startswith("mooncake")
                           for c in full.cells)  # 4k context: excluded
    traces = {c.params["trace"] for d in goodput for c in load_grid(d).cells}
    assert {"azure-conv", "azure-code", "mooncake-conv", "mooncake-synthetic", "sharegpt", "servegen",
            "synthetic"} <= traces


# ---- verdicts ---------------------------------------------------------------------------------

def metrics(policy: str, *goodputs99: float) -> list[CellMetrics]:
    point = LoadPoint(1.0, 1.0, 10, 1.0, 0.1, 0.01, 0.001, 0, 0.0)
    return [CellMetrics(policy, seed, Goodput(g * 1.1, 100), Goodput(g, 100), 1.0, (point,), 1, 0.0)
            for seed, g in enumerate(goodputs99)]


def test_a_verdict_is_paired_by_seed_and_needs_more_than_the_ratios_noise():
    """Windows differ more than policies: a candidate 10% better in both a busy and a quiet window
    wins, though the baseline's own goodput spans 2x across them; ratios that disagree make a tie."""
    base = {"rr": metrics("rr", 5.0, 10.0), "lr": metrics("lr", 4.0, 9.0)}
    judged = {"cand": ("rr", "lr")}
    [v] = judge({**base, "cand": metrics("cand", 5.5, 11.0)}, judged)
    assert v.baseline == "rr" and v.ratio == pytest.approx(1.1) and v.noise == NOISE_FLOOR and v.outcome == "win"
    [v] = judge({**base, "cand": metrics("cand", 4.5, 9.0)}, judged)
    assert v.outcome == "loss" and v.ratio == pytest.approx(0.9)
    [v] = judge({**base, "cand": metrics("cand", 6.0, 9.0)}, judged)  # +20% in one window, -10% in the other
    assert v.outcome == "tie" and v.noise == pytest.approx(math.sqrt(1.2 / 0.9) - 1)
    steady = {"lr": metrics("lr", 10.0, 10.0)}  # the floor decides: one lattice step (2.2%) is no win
    assert judge({**steady, "c": metrics("c", 10.4, 10.4)}, {"c": ("lr",)})[0].outcome == "win"
    [v] = judge({**steady, "c": metrics("c", 10.22, 10.22)}, {"c": ("lr",)})
    assert v.outcome == "tie" and v.noise == NOISE_FLOOR
    none = {"lr": metrics("lr", 0.0, 0.0)}
    assert judge({**none, "c": metrics("c", 0.0, 0.0)}, {"c": ("lr",)})[0].outcome == "tie"
    assert judge({**none, "c": metrics("c", 1.0, 0.0)}, {"c": ("lr",)})[0].ratio == math.inf
    with pytest.raises(ValueError, match="two seeds"):
        judge({"lr": metrics("lr", 1.0), "c": metrics("c", 1.0)}, {"c": ("lr",)})


# ---- tuning -----------------------------------------------------------------------------------

def test_declared_thresholds_are_constructor_arguments_around_their_defaults():
    for cls in DECISIONS.values():
        for policy, args in cls.thresholds.items():
            params = inspect.signature(MIGRATION_POLICIES[policy].__init__).parameters
            for arg, t in args.items():
                assert arg in params, f"{policy} has no constructor argument {arg}"
                assert t.low <= params[arg].default <= t.high


def test_the_tuner_refuses_test_cells(capsys):
    test_cells = cells("migration", "test", quick=True)
    assert test_cells
    with pytest.raises(ValueError, match="refusing to tune on 1 test cell"):
        tune("balance", test_cells, trials=1)
    with pytest.raises(ValueError, match="test cell"):  # one test cell among dev ones is enough
        tune("balance", cells("migration", "both", quick=True), trials=1)
    for split in ("test", "both"):
        assert main(["evaluate", "--tune", "balance", "--quick", "--split", split]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("sloserve: error: refusing to tune") and "\n" not in err
    assert main(["evaluate", "--tune", "predicted-load"]) == 2
    assert "predicted-load declares no thresholds" in capsys.readouterr().err


def test_bad_input_is_one_line(capsys):
    for argv, message in [(["--split", "train"], "--split must be dev, test or both"),
                          (["--decision", "placement"], "unknown decision 'placement'"),
                          (["--seeds", "1", "--quick"], "--seeds must be >= 2"),
                          (["--jobs", "0", "--quick"], "--jobs must be >= 1")]:
        assert main(["evaluate", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err


# ---- end to end -------------------------------------------------------------------------------

def test_quick_dev_run_end_to_end(tmp_path):
    assert main(["evaluate", "--quick", "--decision", "routing", "migration", "qos", "--split", "dev", "--jobs", "2",
                 "--no-progress", "--out", str(tmp_path)]) == 0
    [folder] = tmp_path.glob("evaluate-dev-*")
    data = json.loads((folder / "results.json").read_text())
    assert data["split"] == "dev" and data["quick"] and data["seeds"] == 2
    assert re.fullmatch(r"[0-9a-f]{40}", data["commit"]) and data["date"]
    assert {c["decision"] for c in data["cells"]} == {"routing", "migration", "qos"}
    assert all(c["split"] == "dev" for c in data["cells"])
    run = Evaluation.load(folder / "results.json")
    for result in run.cells:
        decision = make_decision(result.cell.decision)
        lineup = decision.policies(result.cell)
        assert set(result.metrics) == {p.name for p in lineup.every}
        baselines = [p.name for p in lineup.baselines]
        for seed in range(2):
            runs = {p: m[seed] for p, m in result.metrics.items()}
            capacity = max(runs[b].goodput90.rps for b in baselines)
            assert capacity > 0 and all(m.capacity_rps == capacity for m in runs.values())
            for m in runs.values():
                assert m.seed == seed and m.goodput90.rps >= m.goodput99.rps >= 0
                assert m.goodput90.held_s >= run.measures[result.cell.decision].sustain_s * 0.999  # sustained
                assert [p.load for p in m.loads] == [0.8, 1.0, 1.1]
                assert [p.rate_rps for p in m.loads] == pytest.approx([0.8 * capacity, capacity, 1.1 * capacity])
                assert all(p.p99_ttft_s > 0 and p.p99_tpot_s > 0 and p.gpu_hours > 0 for p in m.loads)
            # the load point at 100% replays the very run that set the capacity: it met the SLO for >= 90%
            best = max(baselines, key=lambda b: runs[b].goodput90.rps)
            assert runs[best].at(1.0).attainment >= 0.9
            assert runs[best].at(1.1).p99_ttft_s > runs[best].at(0.8).p99_ttft_s
        for name, per_seed in result.metrics.items():
            moved = sum(m.migrations for m in per_seed)
            assert (moved > 0 and sum(m.bytes_moved for m in per_seed) > 0) if "+" in name else moved == 0
        assert {v.candidate for v in result.verdicts} == {p.name for p in lineup.candidates}
        for v in result.verdicts:
            means = {b: sum(m.goodput99.rps for m in result.metrics[b]) / 2 for b in baselines}
            assert v.baseline_value == max(means.values()) and v.baseline == max(means, key=means.get)
            assert v.baseline_value > 0 and v.noise >= NOISE_FLOOR
            per_seed = seed_ratios(result.metrics[v.candidate], result.metrics[v.baseline])
            assert v.ratio == pytest.approx(math.exp(sum(map(math.log, per_seed)) / len(per_seed)))
            assert v.outcome == ("win" if v.ratio > 1 + v.noise else "loss" if v.ratio < 1 / (1 + v.noise) else "tie")
    md = (folder / "report.md").read_text()
    assert "| predicted-load |" in md and "not run" in md and "balance,defrag" in md
    page = (folder / "report.html").read_text()
    assert "data:image/png;base64," in page and "not run" in page and "trace=azure-conv" in page
    assert page.count("data:image/png;base64,") == 3  # a figure per decision
    for decision in ("routing", "migration", "qos"):
        png = (folder / f"summary-{decision}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
        assert struct.unpack(">II", png[16:24]) == (1200, 750)  # width, height: one screen, not a strip


def test_a_two_class_cell_judges_each_class_on_its_own_targets():
    from sloserve.evaluation.fleet import BATCH_TPOT_X, BATCH_TTFT_X, fleet_config, simulate_policy
    from sloserve.evaluation.fleet import Policy
    from sloserve.evaluation.metrics import attainment, classed
    from sloserve.core.records import RequestRecord
    from sloserve.workload.types import WorkloadRequest

    params = {"trace": "sharegpt", "hardware": "a10-24g", "model": "llama-2-7b", "tp": 1, "instances": 1,
              "slo": 1.0, "link": "infiniband-ndr"}
    assert Setting.of(params).classes is None  # a grid without the setting: one class, as before
    setting = Setting.of({**params, "interactive": 0.3})
    inter, batch = setting.classes["interactive"], setting.classes["batch"]
    assert (inter.ttft_target_s, inter.tbt_target_s) == (1.0, 0.1) and inter.priority < batch.priority
    assert (batch.ttft_target_s, batch.tbt_target_s) == (BATCH_TTFT_X * 1.0, pytest.approx(BATCH_TPOT_X * 0.1))
    with pytest.raises(ValueError, match="interactive is a share"):
        Setting.of({**params, "interactive": 0})

    draw = classed(lambda n: [WorkloadRequest(float(i), 100, 20) for i in range(n)], 0.3, seed=1)
    many, few = draw(1000), draw(50)
    assert [r.qos_class for r in few] == [r.qos_class for r in many[:50]]  # a request keeps its class
    assert sum(r.qos_class == "interactive" for r in many) == pytest.approx(300, abs=3)
    assert 12 <= sum(r.qos_class == "interactive" for r in few) <= 18  # the share holds in a prefix

    def rec(cls: str, ttft: float) -> RequestRecord:
        return RequestRecord(0, qos_class=cls, ttft_s=ttft, e2e_s=ttft + 1.0, output_tokens=11)
    # 2 s misses the interactive TTFT target (1 s) and meets the batch one (10 s)
    records = [rec("interactive", 0.5)] * 3 + [rec("interactive", 2.0)] + [rec("batch", 2.0)] * 4
    assert attainment(records, setting.slo_targets, setting.classes) == 0.75  # the worse class decides
    assert attainment(records, setting.slo_targets, None) == 3 / 8  # one class: the cell's SLO for all

    # simulated: the requests reach the scheduler with their class, and edf serves the interactive first
    reqs = draw(40)
    by_policy = {}
    for scheduler in ("fcfs", "edf"):
        cfg = fleet_config(setting, Policy("round-robin", scheduler=scheduler))
        assert cfg.scheduler.policy == scheduler
        records, _ = simulate_policy([replace(r, arrival_s=0.0) for r in reqs], cfg, classes=setting.classes)
        assert {r.qos_class for r in records} == {"interactive", "batch"}
        by_policy[scheduler] = sorted(r.ttft_s for r in records if r.qos_class == "interactive")
    assert sum(by_policy["edf"]) < sum(by_policy["fcfs"])


def test_tier_policies_size_the_lower_tiers_and_the_baseline_keeps_the_device_cache_alone():
    from sloserve.evaluation.fleet import Policy, fleet_config

    setting = Setting.of({"trace": "mooncake-conv", "hardware": "h100-80g", "model": "llama-3.1-70b", "tp": 4,
                          "instances": 4, "slo": 1.0, "link": "roce-100g"})
    store = fleet_config(setting, Policy("prefix-affinity", tiers="+store"))
    assert (store.cache.host_tier_gib, store.cache.disk_tier_gib, store.kv_store_gib) == (800.0, 2048.0, 8192.0)
    assert store.kv_store_link == "roce-100g"  # the store is reached over the cell's link
    device = fleet_config(setting, Policy("prefix-affinity"))
    assert (device.cache.host_tier_gib, device.cache.disk_tier_gib, device.kv_store_gib) == (0.0, 0.0, 0.0)
    lineup = make_decision("tiers").policies(load_grid("tiers").cells[0])
    assert [p.name for p in lineup.candidates] == ["KV +host (prefix-affinity)", "KV +disk (prefix-affinity)",
                                                   "KV +store (prefix-affinity)"]
    assert [p.name for p in lineup.baselines] == ["prefix-affinity"]
    with pytest.raises(ValueError, match="unknown tiers"):
        fleet_config(setting, Policy("prefix-affinity", tiers="+tape"))


def test_migration_targets_count_memory_tight_cells_and_the_worst_ratio():
    from sloserve.evaluation.result import CellResult
    from sloserve.evaluation.verdict import Verdict

    def result(hardware: str, ratios: dict[str, float]) -> CellResult:
        cell = Cell.make("migration", {"trace": "azure-conv", "hardware": hardware, "model": "llama-2-7b"})
        return CellResult(cell, {}, [Verdict(name, "predicted-load", r, 1.0, r, 0.03, "tie", False)
                                     for name, r in ratios.items()], 0.0)

    balance, defrag = "predicted-load + balance", "predicted-load + balance,defrag"
    lines = make_decision("migration").targets([result("a10-24g", {balance: 1.2, defrag: 1.0}),
                                                result("a10-24g", {balance: 1.16, defrag: 1.3}),
                                                result("h100-80g", {balance: 0.97, defrag: 1.5})])
    assert lines[0].startswith(f"{balance}: >= 1.15x") and "in 2 of 2 memory-tight cells (100%; target >= 60%: met)" \
        in lines[0] and "lowest ratio in any cell 0.970 (target >= 0.98: missed)" in lines[0]
    assert "in 1 of 2 memory-tight cells (50%; target >= 60%: missed)" in lines[1] and "1.000" in lines[1]


def test_quick_disaggregation_run_judges_every_split_and_the_planners_choice(tmp_path):
    """Each split against the best colocated fleet; the planner's choice is the measurement of the
    layout it picked on its own window, judged against every layout of the cell (never a win)."""
    kept = tmp_path / "jobs.jsonl"
    assert main(["evaluate", "--quick", "--decision", "disaggregation", "--split", "dev", "--no-progress",
                 "--out", str(tmp_path), "--checkpoint", str(kept)]) == 0
    [folder] = tmp_path.glob("evaluate-dev-*")
    [result] = Evaluation.load(folder / "results.json").cells
    decision = make_decision("disaggregation")
    lineup = decision.policies(result.cell)
    assert [p.pd for p in lineup.candidates] == ["1:1"] and all(p.pd is None for p in lineup.baselines)
    picked = planner_choice(Setting.of(result.cell.params))
    assert picked in lineup.every
    for seed, choice in enumerate(result.metrics[CHOICE]):
        assert choice.policy == f"{CHOICE}: {picked.name}"
        assert replace(choice, policy=picked.name) == result.metrics[picked.name][seed]
    verdicts = {v.candidate: v for v in result.verdicts}
    assert verdicts["P:D 1:1 (least-requests)"].baseline in {p.name for p in lineup.baselines}
    assert verdicts[CHOICE].outcome in ("tie", "loss") and verdicts[CHOICE].ratio <= 1.0
    md = (folder / "report.md").read_text()
    assert f"{CHOICE}: right in" in md and f"{CHOICE}: {picked.name}" in md
    # the checkpoint holds both seeds: a second run restores them and judges the same
    assert len(kept.read_text().splitlines()) == 2
    labels: list[str] = []
    again = run_evaluation(["disaggregation"], "dev", quick=True, on_done=labels.append, checkpoint=kept)
    assert len(labels) == 2 and all(label.endswith("(restored)") for label in labels)
    assert again.cells[0].metrics == result.metrics and again.cells[0].verdicts == result.verdicts
    # a torn last line and a job measured by other code are measured again
    lines = kept.read_text().splitlines()
    other = json.loads(lines[1]) | {"code": "older"}
    kept.write_text(lines[0] + "\n" + json.dumps(other) + "\n" + lines[1][:40] + "\n")
    labels.clear()
    third = run_evaluation(["disaggregation"], "dev", quick=True, on_done=labels.append, checkpoint=kept)
    assert sorted(label.endswith("(restored)") for label in labels) == [False, True]
    def timeless(metrics):  # a job measured again took its own wall time
        return {p: [replace(m, wall_s=0.0) for m in runs] for p, runs in metrics.items()}

    assert timeless(third.cells[0].metrics) == timeless(result.metrics)


# ---- autoscaling ------------------------------------------------------------------------------

def scaling(policy: str, *runs: tuple[float, float]) -> list[ScalingMetrics]:
    """One ScalingMetrics per seed from (GPU-hours, attainment)."""
    return [ScalingMetrics(policy, seed, gpu, att, 1000.0, 0.0, 1, 0, 4, 0.0) for seed, (gpu, att) in enumerate(runs)]


def test_an_autoscaling_verdict_weighs_gpu_hours_and_attainment_together():
    base = scaling("reactive", (100.0, 0.990), (80.0, 0.995))
    cases = [((90.0, 0.990), (72.0, 0.995), "win"),  # 10% cheaper, attainment held
             ((100.0, 0.995), (80.0, 0.998), "win"),  # as dear, attainment up beyond the seeds' noise
             ((90.0, 0.980), (72.0, 0.990), "trade"),  # cheaper, and fewer requests within the SLO
             ((110.0, 0.990), (88.0, 0.995), "loss"),
             ((100.5, 0.9905), (80.2, 0.9952), "tie")]  # within 1% and 0.1 point
    for first, second, outcome in cases:
        v = judge_pair("c", "reactive", {"reactive": base, "c": scaling("c", first, second)})
        assert v.outcome == outcome, (first, second, v)
        assert v.ratio == pytest.approx(math.sqrt(100 / first[0] * 80 / second[0]))
        assert v.candidate_value == pytest.approx((first[0] + second[0]) / 2) and v.baseline_value == 90.0


def test_the_oracle_plans_for_the_true_peak_one_cold_start_and_one_interval_ahead():
    future = [10.0] * 5 + [50.0] + [10.0] * 10  # req/s per 60 s step; a burst in [300, 360) s
    oracle = make_autoscaler("oracle", ScalingOptions(target_utilization=0.5, future=future, future_step_s=60.0,
                                                      extra={"interval_s": 60.0}))

    def target(now: float) -> int:
        return oracle.decide(ScalingSignals(now, 1, 0, 0, [], (), 60.0, 10.0, 120.0)).target

    assert target(0.0) == 2 and target(120.0) == 2  # 10 req/s / (10 x 0.5): the next decision is early enough
    assert target(180.0) == 10 and target(300.0) == 10  # the burst within a cold start and an interval
    assert target(360.0) == 2 and target(10_000.0) == 0  # past it, and past the run's end
    with pytest.raises(ValueError, match="needs the run's demand in advance"):
        make_autoscaler("oracle", ScalingOptions())


def test_quick_autoscaling_run_both_splits(tmp_path):
    """Every policy runs the quick cells' day at flow level; the oracle needs the fewest GPU-hours
    among the autoscaled policies at full attainment, and every verdict follows the rule."""
    run = run_evaluation(["autoscaling"], "both", quick=True, seeds=2)
    assert {c.split for c in run.cells} == {"dev", "test"}
    candidates, every = policy_names(run.measures["autoscaling"])
    for result in run.cells:
        assert list(result.metrics) == every
        for seed in range(2):
            got = {p: m[seed] for p, m in result.metrics.items()}
            assert all(m.requests > 1000 and 0.9 <= m.attainment <= 1.0 and m.gpu_hours > 0 for m in got.values())
            peak = ScalingSetting.of(result.cell.params).peak
            assert got[STATIC].gpu_hours == pytest.approx(peak * 3.0)  # its size, the whole 3 hours
            assert got[ORACLE].gpu_hours <= min(got[p].gpu_hours for p in (REACTIVE, *candidates)) * 1.001
            assert got[ORACLE].attainment >= 0.999
        assert [(v.candidate, v.baseline) for v in result.verdicts] == \
            [(c, REACTIVE) for c in candidates] + [(REACTIVE, STATIC)]
        for v in result.verdicts:
            assert v == judge_pair(v.candidate, v.baseline, result.metrics)
    folder = write_results(run, tmp_path)
    write_report(run, folder)
    md = (folder / "report.md").read_text()
    assert "#### autoscaling" in md and "| predictive[seasonal-naive] |" in md and "x oracle GPU-hours" in md
    assert Evaluation.load(folder / "results.json").cells[0].metrics[ORACLE] == run.cells[0].metrics[ORACLE]


# ---- forecasting ------------------------------------------------------------------------------

def test_quick_forecasting_run_both_splits(tmp_path):
    """Every forecaster forecasts every origin of the held-out day; verdicts are naive's MAPE over
    the candidate's, and the learned model's seed is what the seeds change."""
    run = run_evaluation(["forecasting"], "both", quick=True, seeds=2)
    assert {c.split for c in run.cells} == {"dev", "test"}
    measure = run.measures["forecasting"]
    for result in run.cells:
        assert list(result.metrics) == [BASELINE, *measure.forecasters]
        for name, per_seed in result.metrics.items():
            assert all(m.origins >= 140 and 0 < m.mape < m.max_ape and 0 <= m.coverage <= 1 for m in per_seed)
            if name != "gbm":  # deterministic: the seed changes nothing
                assert per_seed[0].mape == per_seed[1].mape
        for v in result.verdicts:
            naive, mine = result.metrics[BASELINE], result.metrics[v.candidate]
            assert v.baseline == BASELINE and v.baseline_value == pytest.approx(naive[0].mape)
            ratios = [b.mape / m.mape for m, b in zip(mine, naive)]
            assert v.ratio == pytest.approx(math.exp(sum(map(math.log, ratios)) / 2))
            assert v.outcome == ("win" if v.ratio > 1 + v.noise else "loss" if v.ratio < 1 / (1 + v.noise) else "tie")
    folder = write_results(run, tmp_path)
    write_report(run, folder)
    md = (folder / "report.md").read_text()
    assert "#### forecasting" in md and "| gbm | " in md and "naive ÷ candidate" in md


def test_the_checkpoints_code_digest_ignores_comments_and_docstrings_but_not_code(tmp_path):
    from sloserve.evaluation.checkpoint import code_digest

    src = tmp_path / "policy.py"

    def digest(text: str) -> str:
        src.write_text(text)
        return code_digest([src])

    base = digest('"""A policy."""\ndef f(x):\n    """Doubles."""\n    return 2 * x  # twice\n')
    assert digest('"""A policy, reworded."""\ndef f(x):\n    # a new comment\n    return 2 * x\n') == base
    assert digest('def f(x):\n    return 3 * x\n') != base
    assert digest('def f(x):\n    """Doubles."""\n    return 2 * x\nLIMIT = 4\n') != base


def test_clock_policies_book_energy_and_spend_slack_only_below_the_deadlines():
    """A clocks cell's runs carry the cell's SLO as every request's deadlines and book joules; at a
    light load slo-slack uses less energy per request than the top clock and keeps the SLO."""
    from sloserve.evaluation.decisions.clocks import joules_per_request
    from sloserve.evaluation.fleet import Policy, fleet_config
    from sloserve.evaluation.metrics import PolicyRuns, probe_for

    cell = load_grid("clocks", quick=True).cells[0]
    setting = Setting.of(cell.params)
    lineup = make_decision("clocks").policies(cell)
    assert [p.name for p in lineup.baselines] == ["max clocks (predicted-load)"]
    assert [p.name for p in lineup.candidates] == ["slo-slack clocks (predicted-load)"]
    assert fleet_config(setting, lineup.candidates[0]).clock_policy == "slo-slack"
    assert fleet_config(setting, Policy("predicted-load")).clock_policy is None
    probe = probe_for(setting, 0, measure_of("clocks", quick=True))
    points = {}
    for policy in (*lineup.baselines, *lineup.candidates):
        runs = PolicyRuns(setting, policy, probe)
        assert runs.classes["default"].ttft_target_s == setting.slo_targets.ttft_s
        points[policy.clock] = runs.at_load(0.3, 20.0)
    assert points["max"].requests == points["slo-slack"].requests > 0
    assert all(p.joules > 0 for p in points.values())
    assert points["slo-slack"].joules < 0.9 * points["max"].joules
    assert points["slo-slack"].attainment >= points["max"].attainment - 0.01
    m = CellMetrics("x", 0, Goodput(1.0, 1), Goodput(1.0, 1), 20.0, (points["max"],), 1, 0.0)
    assert joules_per_request(m) == pytest.approx(points["max"].joules / points["max"].requests)


def _clock_run(seed: int, joules: float, attainments: tuple[float, ...], g99: float) -> CellMetrics:
    loads = tuple(LoadPoint(x, x * 10, 100, a, 0.1, 0.01, 0.1, 0, 0.0, joules) for x, a in zip((0.3, 0.6, 0.9), attainments))
    return CellMetrics("p", seed, Goodput(g99 * 1.1, 10), Goodput(g99, 10), 10.0, loads, 1, 0.0)


def test_clock_verdicts_weigh_energy_against_the_slo():
    from sloserve.evaluation.decisions.clocks import judge_clock

    base = [_clock_run(s, 3000.0, (1.0, 1.0, 1.0), 9.0) for s in (0, 1)]

    def verdict(joules, attainments, g99):
        return judge_clock("c", "b", {"c": [_clock_run(s, joules[s], attainments, g99) for s in (0, 1)],
                                      "b": base}).outcome

    assert verdict((2000.0, 2100.0), (1.0, 1.0, 0.995), 9.0) == "win"  # 1.4-1.5x less energy, SLO kept
    assert verdict((2000.0, 2100.0), (1.0, 1.0, 0.95), 9.0) == "trade"  # 5 points lost at 0.9 load
    assert verdict((2000.0, 2100.0), (1.0, 1.0, 1.0), 8.0) == "trade"  # capacity lost beyond noise
    assert verdict((3000.0, 3010.0), (1.0, 1.0, 1.0), 9.0) == "tie"
    assert verdict((3000.0, 3010.0), (1.0, 0.9, 1.0), 9.0) == "loss"
    nan = [_clock_run(s, math.nan, (1.0,) * 3, 9.0) for s in (0, 1)]
    with pytest.raises(ValueError, match="energy books"):
        judge_clock("c", "b", {"c": nan, "b": base})


def test_the_cli_help_and_the_suite_readme_name_every_decision():
    from sloserve.cli import build_parser

    evaluate = next(a for a in build_parser()._subparsers._group_actions[0].choices["evaluate"]._actions
                    if a.dest == "decision")
    readme = (Path(__file__).resolve().parents[1] / "benchmarks" / "suite" / "README.md").read_text()
    for name in DECISIONS:
        assert name in evaluate.help
        assert f"`{name}.yaml`" in readme


def test_a_run_is_dirty_only_when_code_differs_from_its_commit(tmp_path):
    """Checkpoints and reports of runs in progress under benchmarks/suite/runs are the run's own
    outputs: they leave its commit clean; any other change marks the run as from uncommitted code."""
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q")
    (tmp_path / "policy.py").write_text("x = 1\n")
    git("add", "policy.py")
    git("commit", "-q", "-m", "one")
    runs = tmp_path / "benchmarks" / "suite" / "runs"
    runs.mkdir(parents=True)
    (runs / "qos-test.checkpoint.jsonl").write_text("{}\n")
    commit, dirty = git_state(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{40}", commit) and not dirty
    (tmp_path / "policy.py").write_text("x = 2\n")
    assert git_state(tmp_path) == (commit, True)
