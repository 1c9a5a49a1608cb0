"""Prefill/decode roles in the real fleet's bookkeeping (no workers started): arrivals go to
prefill instances, hand-offs to decode instances, a fleet with no prefill instance left still
serves (a decode instance takes the whole request), and the CLI refuses splits that cannot be."""
from __future__ import annotations

import pytest

from fleet_helpers import StandInHandle, front_config
from sloserve.cli import main
from sloserve.cluster.spec import FleetSpec
from sloserve.core.config import PoolSettings, SchedulerConfig
from sloserve.front.handoff import HandoffLatency
from sloserve.front.multi import build_worker_fleet
from sloserve.core.types import Request, SamplingParams
from sloserve.workers.fleet import HEALTHY


def _fleet(pd, router: str = "round-robin", decode_router=None, instances: int = 1):
    cfg = front_config(instances=instances, router=router, pd=pd, decode_router=decode_router)
    fleet = build_worker_fleet(lambda slot: StandInHandle(), cfg)
    for inst in fleet.instances:
        inst.status = HEALTHY
    return fleet


def _request(i: int) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8))


def test_arrivals_go_to_prefill_and_handoffs_to_decode_instances():
    fleet = _fleet((1, 2))
    assert fleet.disaggregated and [i.role for i in fleet.instances] == ["prefill", "decode", "decode"]
    assert {fleet.pick(_request(i), set()).slot for i in range(6)} == {0}
    targets = [fleet.pick_decode(_request(i), set()).slot for i in range(6)]
    assert set(targets) == {1, 2}  # round-robin over the decode pool only
    assert fleet.pick_decode(_request(9), {(1, 0), (2, 0)}) is None  # both tried: none left
    assert fleet.counters["pd_fallback"] == 0


def test_a_fleet_without_its_prefill_instance_still_serves():
    fleet = _fleet((1, 1))
    fleet.instances[0].status = "dead"
    assert fleet.pick(_request(0), set()).slot == 1
    assert fleet.counters["pd_fallback"] == 1
    fleet.instances[0].status = HEALTHY
    assert fleet.pick(_request(1), set()).slot == 0


def test_mixed_fleets_are_unchanged_and_roles_come_from_the_spec():
    fleet = _fleet(None, instances=2)
    assert not fleet.disaggregated
    assert {fleet.pick(_request(i), set()).slot for i in range(4)} == {0, 1}
    assert fleet.pick_decode(_request(5), set()) is None  # no decode pool: nothing is handed off
    assert FleetSpec(pd=(2, 1)).roles == ("prefill", "prefill", "decode")
    assert FleetSpec(instances=2).roles == ("mixed", "mixed")


def test_decode_router_is_its_own_policy():
    fleet = _fleet((1, 2), router="least-requests", decode_router="round-robin")
    assert type(fleet.controller.decode_router).__name__ != type(fleet.controller.router).__name__


def test_pool_settings_change_only_what_they_name():
    base = SchedulerConfig()
    changed = PoolSettings.parse("budget=2048,seqs=4").apply(base)
    assert (changed.max_num_batched_tokens, changed.max_num_seqs) == (2048, 4)
    assert changed.long_prefill_token_threshold == base.long_prefill_token_threshold
    assert PoolSettings().apply(base) is base


def test_handoff_latency_histogram_is_cumulative():
    h = HandoffLatency((0.01, 0.1))
    for s in (0.005, 0.05, 0.05, 3.0):
        h.observe(s)
    assert h.cumulative() == [("0.01", 1), ("0.1", 3), ("+Inf", 4)]
    assert h.count == 4 and h.sum == pytest.approx(3.105)


@pytest.mark.parametrize("args, message", [
    (["--pd", "2"], "P:D"),
    (["--pd", "1:2", "--instances", "2"], "makes 3 instances"),
    (["--decode-router", "round-robin"], "needs --pd P:D or --mixed-handoff"),
    (["--pd-decode", "seqs=4"], "need --pd"),
    (["--pd", "1:1", "--mixed-handoff", "always"], "a --pd fleet has none"),
    (["--instances", "2", "--mixed-handoff", "prefill-pressure", "--mixed-handoff-tokens", "0"], "must be >= 1"),
    (["--pd", "1:1", "--pd-decode", "tp=2"], "tp is for `sloserve simulate`"),
    (["--pd", "1:1", "--decode-router", "nope"], "unknown router"),
    (["--pd", "2:2", "--autoscale", "reactive"], "needs --pd-capacity P_RPS:D_RPS"),
    (["--pd", "2:2", "--autoscale", "reactive", "--pd-capacity", "1:1", "--pd-min", "3:1"],
     "needs 1 <= min <= --pd 2:2"),
    (["--pd", "2:2", "--pd-min", "1:1"], "need --pd and --autoscale"),
    (["--pd", "2:2", "--autoscale", "reactive", "--pd-capacity", "fast"], "P_RPS:D_RPS (two numbers)"),
])
def test_cli_refuses_bad_splits_before_starting_anything(args, message, capsys):
    assert main(["serve", *args, "--port", "9"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_an_autoscaled_pd_fleet_scales_each_pool_on_its_own_capacity():
    """`serve --pd 2:2 --pd-min 1:1 --autoscale reactive --pd-capacity 1:100`: one worker of each
    pool starts; 5 req/s needs a second prefill worker (1 req/s each) but not a second decode one."""
    from sloserve.front.autoscale import AutoscaleDriver
    from sloserve.workers.fleet import STARTING, STOPPED

    now = [0.0]
    cfg = front_config(router="round-robin", pd=(2, 2), autoscale="reactive", pd_min=(1, 1),
                       pd_capacity=(1.0, 100.0), stable_window_s=10.0, scale_down_delay_s=0.0)
    fleet = build_worker_fleet(lambda slot: StandInHandle(), cfg, clock=lambda: now[0])
    assert [i.status != STOPPED for i in fleet.instances] == [True, False, True, False]
    for inst in fleet.instances:
        if inst.status != STOPPED:
            inst.status = HEALTHY
    fleet.start_times.append(5.0)  # as the first health poll records (autoscaling waits for one)
    driver = AutoscaleDriver(fleet, {"prefill": 1.0, "decode": 100.0}, interval_s=10.0, demand_step_s=10.0,
                             clock=lambda: now[0])
    for _ in range(50):  # 5 req/s over one 10 s window
        driver.observe_arrival()
    now[0] = 10.0
    driver.tick()
    assert [i.status for i in fleet.instances] == [HEALTHY, STARTING, HEALTHY, STOPPED]
    info = driver.describe()
    assert info["pools"]["prefill"]["target"] == 2 and info["pools"]["decode"]["target"] == 1
    assert (info["pools"]["decode"]["min"], info["pools"]["decode"]["max"]) == (1, 2)
    assert info["target"] == 3 and [d["pool"] for d in info["decisions"]] == ["prefill"]
    signals = driver.signals("decode")
    assert signals.pool == "decode" and signals.ready == 1 and signals.capacity_rps == 100.0
