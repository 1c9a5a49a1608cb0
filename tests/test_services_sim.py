"""Several services on one simulated fleet at flow level (sim/services.py): each its own pool,
scaled on its own, or together under a GPU budget that the services share by marginal value."""
from __future__ import annotations

import pytest

from fleet_helpers import sim_config
from sloserve.sim.fluid import ResponseCurve
from sloserve.sim.services import ServiceFleets
from sloserve.simulation import build_fluid

CURVE = ResponseCurve((0.5, 1.0, 1.5), (1.0, 0.9, 0.4), saturation_rps=12.0, capacity_rps=10.0)
STEP_S = 10.0


def pool(**kw):
    base = dict(instances=8, model="llama-3.1-8b", hardware="a10-24g", router="least-requests", autoscale="reactive",
                min_instances=1, initial_instances=1, capacity_rps=10.0, scaling_interval_s=30, cold_start_s=60,
                demand_step_s=10, scale_down_delay_s=120)
    return build_fluid(sim_config(**{**base, **kw}), CURVE, ttft_s=1.0)


def held(result, name: str) -> dict[float, int]:
    """Instances a service held (ready, starting, draining) at each decision time."""
    return {t: r + s + d for t, r, s, d, *_ in result.services[name].scaling["timeline"]}


def test_services_with_peaks_at_different_times_share_a_budget_smaller_than_their_peaks_together():
    # chat peaks in the first half hour, code in the second; each peak wants ~7 instances
    chat = [50.0] * 180 + [5.0] * 180
    code = [5.0] * 180 + [50.0] * 180
    alone = ServiceFleets({"chat": pool(), "code": pool()}).run({"chat": chat, "code": code}, STEP_S)
    budget = 9
    shared = ServiceFleets({"chat": pool(), "code": pool()}, budget=budget).run({"chat": chat, "code": code}, STEP_S)
    peaks = [max(held(alone, n).values()) for n in ("chat", "code")]
    assert sum(peaks) > budget  # unshared, the two pools would not fit it at their peaks
    for t in held(shared, "chat"):
        assert held(shared, "chat")[t] + held(shared, "code")[t] <= budget, t
    # the shrinking pool gives its instances up at once; the growing one waits one round for their drain
    assert shared.services["code"].attainment > alone.services["code"].attainment - 0.03
    assert shared.attainment == pytest.approx(alone.attainment, abs=0.03)
    assert shared.instance_hours <= alone.instance_hours * 1.02
    books = shared.as_dict()
    assert set(books["services"]) == {"chat", "code"} and books["budget"] == budget
    assert books["instance_hours"] == pytest.approx(sum(s["instance_hours"] for s in books["services"].values()))


def test_when_both_peak_at_once_the_budget_goes_where_it_keeps_more_requests_within_the_slo():
    big, small = [50.0] * 240, [12.0] * 240  # both busy the whole hour: they want 7 and 2 instances
    result = ServiceFleets({"big": pool(), "small": pool()}, budget=6).run({"big": big, "small": small}, STEP_S)
    late = max(set(held(result, "big")) & set(held(result, "small")))
    # small's second instance would keep 3.4 req/s more within the SLO; each of big's up to its fifth, 8.4
    # or more: small is the one left short
    assert (held(result, "big")[late], held(result, "small")[late]) == (5, 1)
    assert result.services["big"].attainment > result.services["small"].attainment


def test_a_budget_below_the_services_minimums_is_refused():
    with pytest.raises(ValueError, match="below the services' minimums"):
        ServiceFleets({"a": pool(min_instances=2), "b": pool(min_instances=2)}, budget=3)
    with pytest.raises(ValueError, match="no demand for service"):
        ServiceFleets({"a": pool()}).run({}, STEP_S)


def test_simulate_runs_several_services_at_flow_level_from_the_command_line(tmp_path, monkeypatch, capsys):
    import json

    from sloserve.cli import main

    monkeypatch.setenv("SLOSERVE_CACHE_DIR", str(tmp_path / "cache"))
    args = ["simulate", "--fidelity", "fluid", "--demand", "mid=servegen:m-mid", "--demand", "small=servegen:m-small",
            "--start", str(12 * 86400), "--duration", str(3 * 3600), "--rate", "4", "--workload", "azure-conv",
            "--model", "llama-2-7b", "--hardware", "a10-24g", "--instances", "1:8", "--capacity", "1.0",
            "--slo", "ttft=2000,tpot=200", "--cold-start", "120", "--autoscale", "reactive", "--no-progress"]
    assert main(args + ["--out", str(tmp_path / "free")]) == 0
    assert main(args + ["--budget", "5", "--out", str(tmp_path / "budget")]) == 0
    free = json.loads((tmp_path / "free" / "services.json").read_text())
    capped = json.loads((tmp_path / "budget" / "services.json").read_text())
    assert set(free["services"]) == {"mid", "small"} and free["demand"]["mid"] == "servegen:m-mid"
    requests = sum(s["requests"] for s in free["services"].values())
    assert requests == pytest.approx(4.0 * 3 * 3600, rel=0.01)  # --rate is the services' mean together
    assert capped["budget"] == 5 and capped["instance_hours"] <= 5 * 3 + 1e-6  # never more than 5 at once
    for t in {row[0] for row in capped["timelines"]["mid"]} & {row[0] for row in capped["timelines"]["small"]}:
        held = sum(r + s + d for name in ("mid", "small") for (tt, r, s, d, *_) in capped["timelines"][name]
                   if tt == t)
        assert held <= 5, t
    assert "services.json" in "".join(capsys.readouterr().err.split())  # however the console wraps it
    assert main(args[:4] + ["servegen:m-mid"] + args[5:] + ["--out", str(tmp_path / "bad")]) == 2
    assert "NAME=SERIES" in capsys.readouterr().err
