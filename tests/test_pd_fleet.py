"""Prefill/decode roles in the real fleet's bookkeeping (no workers started): arrivals go to
prefill instances, hand-offs to decode instances, a fleet with no prefill instance left still
serves (a decode instance takes the whole request), and the CLI refuses splits that cannot be."""
from __future__ import annotations

import pytest

from sloserve.cli import main
from sloserve.config import PoolSettings, SchedulerConfig, pd_roles
from sloserve.server.front_handoff import HandoffLatency
from sloserve.server.multi import build_worker_fleet
from sloserve.types import Request, SamplingParams
from sloserve.workers.fleet import HEALTHY, FrontConfig


class _Handle:
    url = "http://127.0.0.1:9"

    def is_running(self) -> bool:
        return True

    def kill(self) -> None:
        pass

    def describe(self) -> dict:
        return {}


def _fleet(roles: tuple[str, ...], router: str = "round-robin", decode_router=None):
    cfg = FrontConfig(router=router, predictor=None, roles=roles, decode_router=decode_router)
    fleet = build_worker_fleet(lambda slot: _Handle(), len(roles), cfg)
    for inst in fleet.instances:
        inst.status = HEALTHY
    return fleet


def _request(i: int) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8))


def test_arrivals_go_to_prefill_and_handoffs_to_decode_instances():
    fleet = _fleet(("prefill", "decode", "decode"))
    assert fleet.disaggregated and [i.role for i in fleet.instances] == ["prefill", "decode", "decode"]
    assert {fleet.pick(_request(i), set()).slot for i in range(6)} == {0}
    targets = [fleet.pick_decode(_request(i), set()).slot for i in range(6)]
    assert set(targets) == {1, 2}  # round-robin over the decode pool only
    assert fleet.pick_decode(_request(9), {(1, 0), (2, 0)}) is None  # both tried: none left
    assert fleet.counters["pd_fallback"] == 0


def test_a_fleet_without_its_prefill_instance_still_serves():
    fleet = _fleet(("prefill", "decode"))
    fleet.instances[0].status = "dead"
    assert fleet.pick(_request(0), set()).slot == 1
    assert fleet.counters["pd_fallback"] == 1
    fleet.instances[0].status = HEALTHY
    assert fleet.pick(_request(1), set()).slot == 0


def test_mixed_fleets_are_unchanged_and_roles_must_fit():
    fleet = _fleet(("mixed", "mixed"))
    assert not fleet.disaggregated
    assert {fleet.pick(_request(i), set()).slot for i in range(4)} == {0, 1}
    assert fleet.pick_decode(_request(5), set()) is None  # no decode pool: nothing is handed off
    with pytest.raises(ValueError, match="roles"):
        _fleet(("prefill", "decode", "bogus"))
    assert pd_roles("2:1", 3) == ["prefill", "prefill", "decode"] and pd_roles(None, 2) == ["mixed", "mixed"]


def test_decode_router_is_its_own_policy():
    fleet = _fleet(("prefill", "decode", "decode"), router="least-requests", decode_router="round-robin")
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
    (["--decode-router", "round-robin"], "need --pd"),
    (["--pd", "1:1", "--pd-decode", "tp=2"], "tp is for `sloserve simulate`"),
    (["--pd", "1:1", "--decode-router", "nope"], "unknown router"),
])
def test_cli_refuses_bad_splits_before_starting_anything(args, message, capsys):
    assert main(["serve", *args, "--port", "9"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
