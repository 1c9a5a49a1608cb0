"""Prefill/decode disaggregation in the simulator: arrivals reach prefill instances only, every
request with more than one token is handed to a decode instance after its first, its KV priced
on the link (pipelined or blocking), nothing leaks, and a decode pool without room makes the
prefill instance decode the request itself rather than lose it."""
from __future__ import annotations

import random

import pytest

from sloserve.cluster.controller import FleetController
from sloserve.cluster.migration import MoveCosts
from sloserve.cluster.routers import make_router
from sloserve.core.config import SchedulerConfig
from sloserve.sim.catalog import get_model
from sloserve.sim.cost import RooflineCostModel
from sloserve.sim.hardware import get_hardware
from sloserve.sim.instance import SimInstance
from sloserve.sim.simulator import Simulator
from sloserve.cluster.spec import FleetSpec
from sloserve.simulation import FleetConfig, build_fleet, sim_requests, simulate
from sloserve.core.types import Request, SamplingParams
from sloserve.workload.types import WorkloadRequest

MODEL = get_model("llama-2-7b")
KV_PER_TOKEN = MODEL.kv_bytes_per_token(2)


def requests(n: int = 60, seed: int = 1) -> list[Request]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(3.0)
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(20, 900))]
        params = SamplingParams(max_tokens=rng.choice([1, 8, 60, 200]), ignore_eos=True, temperature=0)
        out.append(Request(f"r{i}", prompt, params, arrival_time=t))
    return out


def pd_fleet(roles: list[str], num_blocks: int = 2000, bandwidth: float = 50e9, transfer: str = "pipelined",
             decode_blocks: int | None = None, max_num_seqs: int = 64) -> Simulator:
    cost = RooflineCostModel(get_hardware("a10-24g"), MODEL)
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=max_num_seqs)
    instances = [SimInstance(i, cost, decode_blocks if (decode_blocks and role == "decode") else num_blocks, 4096,
                             cfg) for i, role in enumerate(roles)]
    controller = FleetController(make_router("round-robin"), decode_router=make_router("least-kv"))
    return Simulator(instances, controller, MoveCosts.uniform(KV_PER_TOKEN, bandwidth), roles=roles,
                     pd_transfer=transfer, num_layers=MODEL.num_layers)


def run(sim: Simulator, reqs: list[Request]):
    result = sim.run(reqs)
    for instance in sim.instances:
        kv = instance.kv
        assert kv.num_free_blocks == kv.num_blocks and kv.num_pinned_blocks == 0
        assert not instance.scheduler.has_unfinished()
    return result


def test_every_request_is_prefilled_on_a_prefill_instance_and_decoded_on_a_decode_instance():
    reqs = requests()
    sim = pd_fleet(["prefill", "decode", "decode"])
    result = run(sim, reqs)
    assert result.num_finished == len(reqs) and not result.rejected
    where = {f.request.request_id: f.instance_id for f in result.finished}
    multi = [r for r in reqs if r.sampling_params.max_tokens > 1]
    for r in reqs:
        assert r.num_output_tokens == r.sampling_params.max_tokens
        assert where[r.request_id] == (0 if r.sampling_params.max_tokens == 1 else where[r.request_id])
    assert all(where[r.request_id] in (1, 2) for r in multi)  # finished on a decode instance
    assert {where[r.request_id] for r in multi} == {1, 2}  # both decode instances got work
    h = result.handoffs
    assert h["completed"] == len(multi) and h["aborted"] == 0 and h["started"] == len(multi)
    assert h["bytes"] == sum(KV_PER_TOKEN * r.num_prompt_tokens for r in multi)  # the prompt's KV: the first token is not computed yet
    assert result.migration == {}  # hand-offs are not counted as migrations
    # The decode instances never ran a prefill chunk: their busy time is decode work only,
    # and the prefill instance never decoded (each request left it right after its first token).
    assert sim.instances[0].scheduler.stats.num_migrated_out == len(multi)
    assert sum(i.scheduler.stats.num_migrated_in for i in sim.instances[1:]) == len(multi)


def test_pipelined_transfer_waits_less_than_blocking_on_a_slow_link():
    waits = {}
    for transfer in ("pipelined", "blocking"):
        reqs = requests(30, seed=4)
        result = run(pd_fleet(["prefill", "decode"], bandwidth=2e9, transfer=transfer), reqs)
        waits[transfer] = result.handoffs["downtime_s"] / result.handoffs["completed"]
    assert waits["pipelined"] < 0.7 * waits["blocking"], waits


def test_a_full_decode_pool_makes_the_prefill_instance_decode_instead():
    reqs = requests(40, seed=2)
    sim = pd_fleet(["prefill", "decode"], decode_blocks=80)  # room for about two requests at a time
    result = run(sim, reqs)
    assert result.num_finished == len(reqs)
    where = {f.request.request_id: f.instance_id for f in result.finished}
    multi = [r for r in reqs if r.sampling_params.max_tokens > 1]
    assert 0 < result.handoffs["completed"] < len(multi)
    assert any(where[r.request_id] == 0 for r in multi)  # decoded where it was prefilled


def test_a_decode_instance_never_runs_more_requests_than_its_batch_seats():
    # KV room for every request, four seats: hand-offs past the fourth wait (decoding where they were prefilled)
    # instead of growing the decode batch past max_num_seqs (they did before 2026-12-04: 1,514 at 256 seats)
    reqs = [r for r in requests(60, seed=3) if r.sampling_params.max_tokens > 1]
    for r in reqs:
        r.arrival_time = 0.0  # all at once: far more decodes than seats
    sim = pd_fleet(["prefill", "decode"], max_num_seqs=4)
    result = run(sim, reqs)
    assert result.num_finished == len(reqs)
    decode = sim.instances[1].scheduler.stats
    assert decode.max_batch_size <= 4 and decode.num_migrated_in >= 4
    where = {f.request.request_id: f.instance_id for f in result.finished}
    assert any(i == 0 for i in where.values())  # some finished where they were prefilled, waiting for a seat


def test_roles_are_validated():
    cost = RooflineCostModel(get_hardware("a10-24g"), MODEL)
    one = [SimInstance(0, cost, 100, 4096, SchedulerConfig())]
    two = one + [SimInstance(1, cost, 100, 4096, SchedulerConfig())]
    costs = MoveCosts.uniform(KV_PER_TOKEN, 1e9)
    with pytest.raises(ValueError, match="decode instance to hand off"):
        Simulator(one, make_router("round-robin"), costs, roles=["prefill"])
    with pytest.raises(ValueError, match="nowhere to prefill"):
        Simulator(two, make_router("round-robin"), costs, roles=["decode", "decode"])
    with pytest.raises(ValueError, match="roles must name"):
        Simulator(two, make_router("round-robin"), costs, roles=["prefill", "gpu"])
    with pytest.raises(ValueError, match="P:D"):
        FleetSpec(pd="3")
    with pytest.raises(ValueError, match="at least one"):
        FleetSpec(pd="0:2")


def test_fleet_config_builds_a_disaggregated_fleet():
    cfg = FleetConfig(FleetSpec(pd="1:2"), hardware="h100-80g", model="llama-3.1-8b", link="infiniband-ndr")
    sim = build_fleet(cfg)
    assert cfg.fleet.instances == 3 and sim.roles == ["prefill", "decode", "decode"]
    stream = [WorkloadRequest(arrival_s=0.1 * i, prompt_len=300 + 50 * i, output_len=20) for i in range(12)]
    records, result = simulate(sim, sim_requests(stream))
    assert len(records) == 12 and all(r.error is None for r in records)
    assert result.handoffs["completed"] == 12


def test_pools_take_their_own_settings():
    from sloserve.simulation import PoolSettings, fleet_gpus

    cfg = FleetConfig(FleetSpec(pd="1:2", prefill_pool=PoolSettings.parse("tp=2,budget=8192,seqs=16,chunk=4096"),
                                decode_pool=PoolSettings.parse("seqs=512")), hardware="h100-80g", model="llama-3.1-8b")
    sim = build_fleet(cfg)
    prefill, decode = sim.instances[0], sim.instances[1]
    assert prefill.scheduler.config.max_num_batched_tokens == 8192 and prefill.scheduler.config.max_num_seqs == 16
    assert prefill.scheduler.config.long_prefill_token_threshold == 4096
    assert decode.scheduler.config.max_num_seqs == 512 and decode.scheduler.config.max_num_batched_tokens == 2048
    assert prefill.cost_model.tp == 2 and decode.cost_model.tp == 1
    assert fleet_gpus(cfg) == 4 and fleet_gpus(FleetConfig(FleetSpec(instances=3))) == 3
    stream = [WorkloadRequest(arrival_s=0.05 * i, prompt_len=2000, output_len=30) for i in range(10)]
    records, result = simulate(sim, sim_requests(stream))
    assert all(r.error is None for r in records) and result.handoffs["completed"] == 10


@pytest.mark.parametrize("bad", ["tp=0", "gpus=2", "budget=lots", "tp"])
def test_bad_pool_settings_are_refused(bad):
    from sloserve.simulation import PoolSettings

    with pytest.raises(ValueError, match="pool setting"):
        PoolSettings.parse(bad)
