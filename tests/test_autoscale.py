"""Autoscaling: the policies on constructed demand (a spike, a lull, a daily ramp the forecast
sees coming), the planner's safety rules, and a simulated fleet that adds instances for a burst
(none serves before its cold start ends), drains them by migration afterwards, and loses no
request; scale to zero holds arrivals until the first instance is up."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fleet_helpers import sim_config
from sloserve.cluster.autoscale import ScalingOptions, make_autoscaler
from sloserve.cluster.autoscale.planner import ScalePlanner
from sloserve.cluster.spec import FleetSpec
from sloserve.core.config import SchedulerConfig
from sloserve.fleet_view import DRAINING, READY, STARTING, STOPPED, InstanceSlot, ScalingSignals
from sloserve.sched.state import InstanceState
from sloserve.simulation import FleetConfig, build_fleet, sim_requests, simulate
from sloserve.workload.types import WorkloadRequest

STEP = 60.0


def state(waiting: int = 0) -> InstanceState:
    return InstanceState(0, waiting, 0, 0, 100, 100, 0, 0.0, float("inf"), 16)


def signals(demand, now: float = 0.0, ready: int = 1, starting: int = 0, capacity: float = 10.0,
            cold_start: float = 120.0, waiting: int = 0, step: float = STEP) -> ScalingSignals:
    return ScalingSignals(now, ready, starting, 0, [state(waiting)] * ready, tuple(demand), step, capacity,
                          cold_start)


def test_reactive_follows_the_stable_window_and_panics_on_a_spike():
    reactive = make_autoscaler("reactive", ScalingOptions(target_utilization=1.0))
    assert reactive.decide(signals([20.0] * 5, ready=1)).target == 2  # 20 req/s over 60 s at 10 per instance
    assert reactive.decide(signals([5.0] * 5, now=60, ready=4)).target == 1  # a lull: fewer
    spiky = make_autoscaler("reactive", ScalingOptions(target_utilization=1.0,
                                                       extra={"panic_window_s": 1.0, "stable_window_s": 10.0}))
    burst = spiky.decide(signals([1.0] * 9 + [80.0], ready=2, step=1.0))
    assert burst.target == 8 and burst.reason.startswith("panic")
    calm = spiky.decide(signals([1.0] * 20, now=5.0, ready=8, step=1.0))
    assert calm.target == 8  # no scale-down while the panic lasts
    assert spiky.decide(signals([1.0] * 20, now=30.0, ready=8, step=1.0)).target == 1
    queued = reactive.decide(signals([0.0] * 5, ready=1, waiting=1200))  # 1200 queued: 20 req/s to clear
    assert queued.target == 2


def daily(days: int, step: float = 600.0) -> np.ndarray:
    t = np.arange(int(days * 86400 / step))
    return 50 + 40 * np.sin(2 * np.pi * (t * step / 86400 - 0.25))  # trough at midnight, peak at noon


def test_predictive_scales_before_the_morning_ramp_reactive_does_not():
    history = daily(4)
    step = 600.0
    # 06:00 on day 5: demand is still near the trough's level but rising steeply for hours
    today = daily(1)[:36]
    opts = dict(target_utilization=1.0, history=history, history_step_s=step, extra={"interval_s": 600.0})
    sig = signals(today, now=36 * step, ready=5, capacity=10.0, cold_start=1800.0, step=step)
    reactive = make_autoscaler("reactive", ScalingOptions(**opts)).decide(sig)
    for name in ("predictive", "hybrid"):
        ahead = make_autoscaler(name, ScalingOptions(forecaster="seasonal-naive", **opts)).decide(sig)
        assert ahead.target > reactive.target, (name, ahead, reactive)
        expected = daily(5)[4 * 144 + 36 + 3]  # a cold start (30 min) ahead, what the fleet must carry
        assert ahead.target >= int(expected // 10)
    with pytest.raises(ValueError, match="needs demand history"):
        make_autoscaler("predictive").decide(sig)


def test_planner_clamps_waits_before_scaling_down_and_takes_back_drains_first():
    class Fixed:
        def __init__(self, n):
            self.n = n

        def decide(self, signals):
            from sloserve.fleet_view import ScalingDecision
            return ScalingDecision(self.n, "fixed")

    policy = Fixed(10)
    planner = ScalePlanner(policy, min_instances=1, max_instances=4, scale_down_delay_s=300)  # type: ignore[arg-type]
    slots = [InstanceSlot(0, READY, 50), InstanceSlot(1, DRAINING, 5), InstanceSlot(2, STOPPED), InstanceSlot(3, STOPPED)]
    up = planner.plan(signals([0.0]), slots)
    assert up.target == 4 and up.undrain == (1,) and up.start == 2  # a draining one back before any cold start
    policy.n = 1
    slots = [InstanceSlot(0, READY, 50), InstanceSlot(1, READY, 5), InstanceSlot(2, STARTING), InstanceSlot(3, READY, 9)]
    assert not planner.plan(signals([0.0], now=0), slots).changes  # lower, but not for long yet
    assert not planner.plan(signals([0.0], now=200), slots).changes
    down = planner.plan(signals([0.0], now=300), slots)
    assert down.cancel == (2,) and down.drain == (1, 3)  # the starting one first, then the least work
    policy.n = 0
    assert planner.plan(signals([0.0], now=1000), slots).target == 1  # min holds
    with pytest.raises(ValueError):
        ScalePlanner(policy, min_instances=3, max_instances=2)  # type: ignore[arg-type]


def burst_workload(phases=((2.0, 300.0), (16.0, 600.0), (1.0, 1500.0)), seed: int = 1,
                   max_prompt: int = 2000, max_output: int = 400) -> list[WorkloadRequest]:
    """Poisson arrivals at each phase's rate until its end time: by default 2 req/s for 5 minutes,
    16 req/s for 5 minutes, then 1 req/s for 15 minutes."""
    rng = np.random.default_rng(seed)
    out, t = [], 0.0
    for rate, until in phases:
        while True:
            t += rng.exponential(1 / rate)
            if t >= until:
                t = until
                break
            out.append(WorkloadRequest(t, prompt_len=int(rng.integers(200, max_prompt)),
                                       output_len=int(rng.integers(50, max_output))))
    return out


def fleet(**kw) -> FleetConfig:
    return sim_config(**{**dict(instances=6, model="llama-3.1-8b", hardware="a10-24g", router="least-requests",
                                autoscale="reactive", min_instances=1, capacity_rps=2.5, scaling_interval_s=30,
                                cold_start_s=60, demand_step_s=10, scale_down_delay_s=120), **kw})


@pytest.mark.slow
def test_the_demand_meter_reads_the_rate_of_each_ended_window_empty_ones_included():
    from sloserve.cluster.autoscale.demand import DemandMeter

    meter = DemandMeter(10.0)
    for t in (0.5, 3.0, 9.9, 25.0):
        meter.observe(t)
    meter.observe(31.0, count=5)
    assert meter.rates(9.0) == ()  # the first window has not ended
    assert meter.rates(40.0) == (0.3, 0.0, 0.1, 0.5)
    assert meter.rates(60.0) == (0.3, 0.0, 0.1, 0.5, 0.0, 0.0)  # nobody since: zero, not missing


def test_a_plan_is_carried_out_in_one_order_on_the_simulated_fleet():
    from sloserve.cluster.autoscale.base import ScalingDecision
    from sloserve.fleet_view import ScalingPlan
    from sloserve.sim.scaling import ScalingSpec, SimScaling

    scaling = SimScaling(ScalingSpec(capacity_rps=1.0, initial=3, cold_start_s=100.0, warm_start_s=5.0,
                                     keep_alive_s=60.0), ["mixed"] * 6)
    scaling.apply(ScalingPlan(ScalingDecision(1, "down"), 1, drain=(1, 2)), 0.0)
    scaling.stop_if_empty(2, 10.0, empty=True)  # slot 2 stopped at t=10: its weights stay warm until t=70
    started = scaling.apply(ScalingPlan(ScalingDecision(4, "up"), 4, start=2, undrain=(1,)), 20.0)
    assert scaling.status[:3] == [READY, READY, STARTING]  # taken back first, then the warmest slot started
    assert started == [(2, 25.0), (3, 120.0)]  # warm start (weights in host memory), then a cold one
    books = scaling.close(200.0)
    assert (books.warm_starts, books.cold_starts, books.drained) == (1, 1, 2)


def test_a_simulated_burst_adds_instances_that_serve_only_once_loaded_and_drains_them_after():
    cfg = fleet(migration="drain")
    reqs = burst_workload()
    sim = build_fleet(cfg)
    records, result = simulate(sim, sim_requests(reqs))
    assert len(records) == len(reqs) and all(r.success for r in records)  # nothing lost, drains included
    books = result.scaling
    peak = max(ready for _, ready, *_ in books["timeline"])
    assert peak >= 4 and books["cold_starts"] >= 3 and books["drained"] >= 2
    assert books["timeline"][-1][1] < peak  # scaled back down after the burst
    ready_at = {}
    for slot, asked, ready in books["starts"]:
        assert ready - asked == pytest.approx(60.0)
        ready_at.setdefault(slot, []).append(ready)
    for f in sim_run_instances(cfg, reqs):
        request, slot = f
        if slot in ready_at:  # started by the autoscaler: nothing ran there before it was loaded
            assert request.first_scheduled_time >= min(ready_at[slot]) - 1e-9
    assert 0 < books["instance_hours"] < 6 * result.end_time / 3600
    assert sim.controller.counters["completed"] >= 1  # running requests moved off drained instances


def sim_run_instances(cfg: FleetConfig, reqs):
    sim = build_fleet(cfg)
    result = sim.run(list(sim_requests(reqs)))
    return [(f.request, f.instance_id) for f in result.finished]


def test_scale_to_zero_holds_arrivals_until_an_instance_is_up():
    cfg = fleet(initial_instances=0, min_instances=0)
    reqs = [WorkloadRequest(5.0 + i, prompt_len=300, output_len=20) for i in range(5)]
    records, result = simulate(build_fleet(cfg), sim_requests(reqs))
    assert all(r.success for r in records) and result.scaling["cold_starts"] == 1
    first_start = result.scaling["starts"][0]
    assert min(r.ttft_s + r.scheduled_s for r in records) >= first_start[2]  # nothing before the first is loaded


def test_static_fleet_costs_its_size_for_the_whole_run():
    cfg = fleet(initial_instances=3, autoscale="static")
    records, result = simulate(build_fleet(cfg), sim_requests(burst_workload()[:200]))
    assert all(r.success for r in records)
    assert result.scaling["instance_seconds"] == pytest.approx(3 * result.end_time)
    assert result.scaling["cold_starts"] == 0


def test_simulate_command_autoscales_and_reports(tmp_path, capsys):
    import json

    from sloserve.cli import main

    out = tmp_path / "sim"
    assert main(["simulate", "--workload", "azure-code", "--replay", "--duration", "600", "--instances", "1:6",
                 "--autoscale", "reactive", "--capacity", "0.5", "--cold-start", "30", "--scaling-interval", "20",
                 "--out", str(out), "--no-progress"]) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["config"]["autoscale"] == "reactive" and run["outcome"]["scaling"]["cold_starts"] >= 1
    assert run["outcome"]["scaling"]["instance_hours"] > 0 and (out / "scaling.png").is_file()
    assert "instance-hours" in capsys.readouterr().out
    fixed = tmp_path / "fixed"
    assert main(["simulate", "--workload", "azure-code", "--replay", "--duration", "600", "--instances", "6",
                 "--out", str(fixed), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["bench", "compare", str(out / "results.json"), str(fixed / "results.json")]) == 0
    table = capsys.readouterr().out
    assert "instance-hours" in table and "cold starts" in table  # the fixed run shows – there
    assert main(["simulate", "--workload", "azure-code", "--replay", "--duration", "60", "--instances", "1:4"]) == 2
    assert "needs --autoscale" in capsys.readouterr().err
    assert main(["simulate", "--workload", "azure-code", "--replay", "--duration", "60", "--instances", "1:4",
                 "--autoscale", "predictive", "--capacity", "1"]) == 2
    assert "--scaling-history" in capsys.readouterr().err
    assert main(["simulate", "--workload", "azure-code", "--replay", "--duration", "60", "--instances", "1:4",
                 "--autoscale", "reactive"]) == 2
    assert "--capacity RPS, or --slo" in capsys.readouterr().err


def test_the_capacity_model_is_measured_once_and_read_back_from_disk(tmp_path, monkeypatch, caplog):
    from sloserve import planning
    from sloserve.bench.metrics import SLO
    from sloserve.user_cache import JsonCache

    reqs = [WorkloadRequest(i * 0.1, prompt_len=300, output_len=60) for i in range(40)]
    cfg = fleet()
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    path = tmp_path / "capacity.json"
    measured = planning.instance_capacity(reqs, cfg, slo, iters=2, cache=JsonCache(path))
    assert measured > 0 and len(json.loads(path.read_text())) == 1

    def no_search(*args, **kwargs):
        raise AssertionError("measured again instead of reading the cache")

    monkeypatch.setattr(planning, "search_goodput", no_search)
    # A new process (a new cache object on the same file) reads the measurement back ...
    assert planning.instance_capacity(reqs, cfg, slo, iters=2, cache=JsonCache(path)) == measured
    # ... but another SLO, another scheduler setting or another simulator is another question.
    for other_slo, other_cfg, code in ((SLO(ttft_s=0.5, tpot_s=0.1), cfg, None),
                                       (slo, fleet(scheduler=SchedulerConfig(max_num_seqs=8)), None),
                                       (slo, cfg, "changed simulator code")):
        if code is not None:
            monkeypatch.setattr(planning, "simulator_fingerprint", lambda: code)
        with pytest.raises(AssertionError, match="measured again"):
            planning.instance_capacity(reqs, other_cfg, other_slo, iters=2, cache=JsonCache(path))
    # An unreadable file costs the cache, not the run.
    path.write_text("{not json")
    monkeypatch.undo()
    with caplog.at_level("WARNING", logger="sloserve.user_cache"):
        assert planning.instance_capacity(reqs, cfg, slo, iters=2, cache=JsonCache(path)) == measured
    assert "unreadable cache" in caplog.text and len(json.loads(path.read_text())) == 1


@pytest.mark.slow
def test_the_capacity_model_holds_rates_long_enough_to_see_a_queue_grow(tmp_path):
    """An H100 serves short 8B requests at ~25 req/s; 400 of them at 40 req/s arrive in 10 s, and
    a 3 s TTFT forgives that burst. Squeezing the sample measured such a transient (~1.6x the
    sustained rate, at whose 0.8x a long run fails); holding each rate for 60 s of arrivals gives
    a rate whose 0.8x a five-minute run meets."""
    from sloserve import planning
    from sloserve.bench.metrics import SLO
    from sloserve.user_cache import JsonCache

    reqs = burst_workload(phases=((1.0, 12000.0),), seed=3)  # only the lengths and the order matter
    cfg = sim_config(instances=1, model="llama-3.1-8b", hardware="h100-80g", router="least-requests")
    slo = SLO(ttft_s=3.0, tpot_s=0.1)
    cache = JsonCache(tmp_path / "capacity.json")
    squeezed = planning.instance_capacity(reqs, cfg, slo, cache=cache, min_duration_s=0.0)
    held = planning.instance_capacity(reqs, cfg, slo, cache=cache)
    assert held < squeezed / 1.3 and len(json.loads((tmp_path / "capacity.json").read_text())) == 2

    def five_minutes_at(rate: float) -> float:
        return planning.attainment(planning.at_rate(reqs[:round(rate * 300)], rate), cfg, slo)[0]

    assert five_minutes_at(0.8 * held) >= 0.99
    assert five_minutes_at(0.8 * squeezed) < 0.5


def pd_fleet(**kw) -> FleetConfig:
    settings = dict(pd="4:4", pd_min="1:1", pd_capacity=(1.0, 8.0), model="llama-3.1-8b", hardware="a10-24g",
                    router="least-requests", autoscale="reactive", scaling_interval_s=30, cold_start_s=60,
                    demand_step_s=10, scale_down_delay_s=120, migration="drain")
    return sim_config(**{**settings, **kw})


def test_a_disaggregated_fleet_scales_its_pools_apart():
    """One prefill instance carries 1 req/s here and one decode instance 20: a 6 req/s burst needs
    more prefill instances (up to the pool's 4) and no second decode instance; the run pays for
    each pool's instances, loses nothing, and every request is decoded on the decode pool."""
    cfg = pd_fleet(pd_capacity=(1.0, 20.0))
    reqs = burst_workload(phases=((0.5, 120.0), (6.0, 420.0), (0.3, 900.0)), max_prompt=1500, max_output=120)
    sim = build_fleet(cfg)
    records, result = simulate(sim, sim_requests(reqs))
    assert len(records) == len(reqs) and all(r.success for r in records)
    books = result.scaling
    pools = {pool: [row for row in books["pool_timeline"] if row[1] == pool] for pool in ("prefill", "decode")}
    assert max(row[2] for row in pools["prefill"]) == 4 and pools["prefill"][-1][2] < 4  # grew, then drained
    assert max(row[2] for row in pools["decode"]) == 1
    roles = sim.roles
    assert books["starts"] and all(roles[slot] == "prefill" for slot, _, _ in books["starts"])
    assert all(reason.startswith(("prefill: ", "decode: ")) for _, _, reason in books["decisions"])
    hours = books["pool_instance_hours"]
    assert hours["prefill"] + hours["decode"] == pytest.approx(books["instance_hours"])
    assert hours["decode"] == pytest.approx(result.end_time / 3600)  # its one instance ran throughout
    assert result.handoffs["completed"] == len(reqs)
    decoded_on = {f.instance_id for f in build_fleet(cfg).run(list(sim_requests(reqs))).finished}
    assert {roles[i] for i in decoded_on} == {"decode"}


def test_a_disaggregated_fleet_waits_for_decode_instances_by_decoding_on_prefill():
    """The decode pool scales too: when it is the one short of capacity it grows, and the
    prefill pool stays at its minimum."""
    cfg = pd_fleet(pd_capacity=(20.0, 0.5))
    reqs = burst_workload(phases=((0.2, 120.0), (3.0, 360.0), (0.1, 900.0)), max_prompt=400, max_output=300)
    records, result = simulate(build_fleet(cfg), sim_requests(reqs))
    assert all(r.success for r in records)
    rows = result.scaling["pool_timeline"]
    assert max(r[2] for r in rows if r[1] == "decode") >= 3 and max(r[2] for r in rows if r[1] == "prefill") == 1


def test_pool_capacities_are_measured_per_role_and_cached(tmp_path, monkeypatch):
    from sloserve import planning
    from sloserve.bench.metrics import SLO
    from sloserve.user_cache import JsonCache

    long_out = [WorkloadRequest(i * 0.1, prompt_len=200, output_len=400) for i in range(40)]
    long_in = [WorkloadRequest(i * 0.1, prompt_len=3000, output_len=20) for i in range(40)]
    cfg = pd_fleet(pd_capacity=None)
    # An A10 reads 8B's weights in ~27 ms: with short contexts a TPOT of 35 ms only small batches
    # meet; a 3,000-token context alone takes a decode step to ~34 ms, so those get 100 ms.
    slo = SLO(ttft_s=1.0, tpot_s=0.035)
    cache = JsonCache(tmp_path / "capacity.json")
    # 40 requests hold 60 s of arrivals only below 0.67 req/s, and the search credits no rate past that (every
    # answer would be that lower bound); these evenly spaced, identical requests give the same answers squeezed
    # as held for 60 s (drawn past the 40, ~30 s of simulation), so they are squeezed here
    p_out, d_out = planning.pool_capacity(long_out, cfg, slo, iters=2, cache=cache, min_duration_s=0.0)
    p_in, d_in = planning.pool_capacity(long_in, cfg, SLO(ttft_s=1.0, tpot_s=0.1), iters=2, cache=cache,
                                        min_duration_s=0.0)
    assert all(c > 0 for c in (p_out, d_out, p_in, d_in))
    assert d_out < p_out  # long outputs: a decode instance carries fewer requests than a prefill one
    assert p_in < d_in  # long prompts: the other way round
    monkeypatch.setattr(planning, "search_goodput", lambda *a, **k: pytest.fail("measured again"))
    assert planning.pool_capacity(long_out, cfg, slo, iters=2, cache=JsonCache(tmp_path / "capacity.json"),
                                  min_duration_s=0.0) == (p_out, d_out)


def test_simulate_command_autoscales_each_pool(tmp_path, capsys):
    from sloserve.cli import main

    out = tmp_path / "pd"
    assert main(["simulate", "--workload", "azure-code", "--replay", "--duration", "600", "--pd", "3:3",
                 "--pd-min", "1:1", "--autoscale", "reactive", "--pd-capacity", "0.5:4", "--cold-start", "30",
                 "--scaling-interval", "20", "--out", str(out), "--no-progress"]) == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["config"]["pd_capacity"] == [0.5, 4.0] and run["config"]["pd_min"] == "1:1"
    assert set(run["outcome"]["scaling"]["pool_instance_hours"]) == {"prefill", "decode"}
    assert "prefill 1-3 at 0.50 req/s each" in capsys.readouterr().out.replace("\n", " ")
    assert main(["simulate", "--workload", "azure-code", "--replay", "--duration", "60", "--instances", "1:4",
                 "--autoscale", "reactive", "--capacity", "1", "--pd-min", "1:1"]) == 2
    assert "--pd-min needs --pd" in capsys.readouterr().err
    assert main(["simulate", "--workload", "azure-code", "--replay", "--duration", "60", "--pd", "2:2",
                 "--pd-min", "3:1", "--autoscale", "reactive", "--pd-capacity", "1:1"]) == 2
    assert "--pd-min 3:1 needs 1 <= min <= --pd 2:2" in capsys.readouterr().err


def test_the_forecast_band_planned_for_is_a_setting():
    """`forecast_level` (`--forecast-level`): a predictive policy plans for the top of a narrower
    band when asked, so for less demand."""
    from sloserve.workload.series import Series

    noisy = daily(4) * np.random.default_rng(3).uniform(0.8, 1.2, len(daily(4)))
    history = Series("history", noisy, 600.0)
    wide, narrow = (build_fleet(fleet(scaling_history=history, forecast_level=level, autoscale="predictive"))
                    for level in (0.9, 0.5))
    policies = [sim.controller.scalers["mixed"].autoscaler for sim in (wide, narrow)]
    assert [p.options.level for p in policies] == [0.9, 0.5]
    sig = signals(list(daily(1)[:36]), now=36 * 600.0, capacity=10.0, cold_start=1800.0, step=600.0)
    top_wide, top_narrow = (p.forecast_peak(sig)[0] for p in policies)
    assert top_narrow < top_wide
    # the real server's front builds its planners from the same setting (`sloserve serve --forecast-level`)
    from sloserve.cluster.assembly import scale_planners

    served = scale_planners(FleetSpec(instances=4, predictor="none", autoscale="predictive", forecast_level=0.5,
                                      capacity_rps=10.0), history)
    assert served["mixed"].autoscaler.options.level == 0.5


def test_serve_refuses_a_forecast_band_outside_0_1(capsys):
    from sloserve.cli import main

    assert main(["serve", "--instances", "1:2", "--autoscale", "reactive", "--capacity", "1", "--forecast-level", "1.5",
                 "--port", "9"]) == 2
    err = capsys.readouterr().err
    assert "--forecast-level must be in (0, 1), got 1.5" in err and err.count("\n") == 1


def test_a_shared_budget_leaves_short_the_service_whose_slo_loses_least():
    from sloserve.cluster.autoscale.budget import ServiceAsk, share_budget

    def served(demand: float, per_instance: float):
        return lambda n: min(demand, n * per_instance)  # requests/s within the SLO with n instances

    big = ServiceAsk("chat", fewest=1, wanted=6, value=served(50.0, 10.0))  # every instance serves 10 more
    small = ServiceAsk("code", fewest=1, wanted=4, value=served(12.0, 4.0))  # 4 more each, the 4th nothing
    assert share_budget([big, small], 20) == {"chat": 6, "code": 4}  # everything fits: every want granted
    assert share_budget([big, small], 8) == {"chat": 5, "code": 3}  # code's 4th instance gains nothing
    assert share_budget([big, small], 6) == {"chat": 5, "code": 1}  # chat's instances are worth more
    assert share_budget([ServiceAsk("a", 0, 3, served(9.0, 3.0)), ServiceAsk("b", 0, 3, served(9.0, 3.0))],
                        3) == {"a": 2, "b": 1}  # ties: the one granted fewer so far, then the first named
    with pytest.raises(ValueError, match="minimums"):
        share_budget([big, small], 1)
    # what a service holds it keeps, unless another gains clearly more (moving costs a start and a drain)
    holding = ServiceAsk("chat", 1, 5, served(50.0, 10.0), held=5)
    waiting = ServiceAsk("code", 1, 3, served(12.0, 4.0), held=1)
    assert share_budget([holding, waiting], 6) == {"chat": 5, "code": 1}  # code's +4 is not worth chat's -10
    idle = ServiceAsk("chat", 1, 5, served(20.0, 10.0), held=5)  # its demand fell: 3 of its 5 serve nothing
    assert share_budget([idle, waiting], 6) == {"chat": 3, "code": 3}


def test_a_planner_plans_to_a_target_it_is_granted():
    from sloserve.cluster.autoscale.static import StaticAutoscaler

    planner = ScalePlanner(StaticAutoscaler(ScalingOptions()), min_instances=1, max_instances=4)
    slots = [InstanceSlot(0, READY, 0.0)] + [InstanceSlot(i, STOPPED, 0.0) for i in (1, 2, 3)]
    signals = ScalingSignals(0.0, 1, 0, 0, [], (), 60.0, 1.0, 30.0)
    decision, wanted = planner.decide(signals)
    assert wanted == 1  # static: what runs
    plan = planner.plan_to(decision, 3, signals, slots)  # any target it is given, as a budget grants it
    assert (plan.target, plan.start) == (3, 2)
    assert not planner.plan_to(decision, 1, signals, slots).changes
