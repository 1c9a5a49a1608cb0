"""The simulator prices structured outputs' token masks (sim/cost.MaskCost): per masked row and
step, the same whether decode runs are fast-forwarded or stepped; the workload's
`--structured-share` marks requests reproducibly; the bench client sends constraints only with them."""
from __future__ import annotations

import random

import pytest

from sloserve.cluster.controller import FleetController
from sloserve.cluster.migration import MoveCosts
from sloserve.cluster.routers import make_router
from sloserve.core.config import SchedulerConfig
from sloserve.sim.catalog import get_model
from sloserve.sim.cost import MaskCost, RooflineCostModel
from sloserve.sim.hardware import get_hardware, get_link
from sloserve.sim.instance import SimInstance
from sloserve.sim.simulator import Simulator
from sloserve.simulation import SIMULATED_MASK, sim_requests
from sloserve.core.types import Request, SamplingParams
from sloserve.workload.build import WorkloadSpec, build_stream
from sloserve.workload.types import WorkloadRequest


def test_mask_cost_is_serial_per_row_plus_what_the_fill_outlasts():
    cost = MaskCost(serial_s=40e-6, fill_s=10e-6, fill_threads=2)
    assert cost.extra(0, 0.01) == 0.0
    assert cost.extra(16, 0.01) == pytest.approx(16 * 40e-6)  # the fill (80 us) hides behind 10 ms
    assert cost.extra(16, 50e-6) == pytest.approx(16 * 40e-6 + 80e-6 - 50e-6)  # it outlasts a 50 us step
    with pytest.raises(ValueError):
        MaskCost(fill_threads=0)


def requests(n: int, share: float, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(20.0)
        structured = SIMULATED_MASK if rng.random() < share else None
        params = SamplingParams(max_tokens=rng.randint(20, 200), ignore_eos=structured is None, temperature=0,
                                structured=structured)
        out.append(Request(f"r{i}", [rng.randrange(2000, 30000) for _ in range(rng.randint(10, 300))], params,
                           arrival_time=t))
    return out


def run(share: float, fast_forward: bool, masks: MaskCost = MaskCost()):
    model = get_model("llama-3.1-8b")
    cost = RooflineCostModel(get_hardware("a100-80g"), model)
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32)
    instances = [SimInstance(i, cost, 3000, 4096, cfg, fast_forward=fast_forward, masks=masks) for i in range(2)]
    controller = FleetController(make_router("least-requests"), None)
    costs = MoveCosts.uniform(model.kv_bytes_per_token(2), get_link("infiniband-ndr"))
    result = Simulator(instances, controller, costs).run(requests(200, share))
    return {f.request.request_id: (f.request.first_token_time, f.request.finished_time) for f in result.finished}


def test_masks_cost_the_same_fast_forwarded_or_stepped():
    slow, fast = run(0.5, False), run(0.5, True)
    assert slow.keys() == fast.keys() and len(slow) == 200
    for rid, times in slow.items():
        assert times == pytest.approx(fast[rid])


def test_masked_requests_take_longer_by_the_mask_cost():
    free = run(0.0, True)
    assert run(0.0, True, MaskCost(serial_s=1e-3)) == free  # no masked row: no cost, whatever it would be
    cheap, dear = run(1.0, True, MaskCost(serial_s=0.0, fill_s=0.0)), run(1.0, True, MaskCost(serial_s=1e-3))
    assert all(cheap[rid] == pytest.approx(free[rid]) for rid in free)  # a free mask changes nothing
    tpot = {rid: (e - f) for rid, (f, e) in dear.items()}
    base = {rid: (e - f) for rid, (f, e) in free.items()}
    # Each decode step costs 1 ms per masked row in it: at least 1 ms a token more, for every request.
    assert all(tpot[rid] > base[rid] + 1e-3 * 19 for rid in base)


def test_structured_share_marks_the_same_requests_at_every_rate():
    a = build_stream(WorkloadSpec("synthetic", seed=3, rate=2.0, num_requests=400, structured_share=0.25))
    b = build_stream(WorkloadSpec("synthetic", seed=3, rate=9.0, num_requests=400, structured_share=0.25))
    marked = [r.structured for r in a]
    assert marked == [r.structured for r in b] and 60 < sum(marked) < 140
    assert not any(r.structured for r in build_stream(WorkloadSpec("synthetic", seed=3, rate=2.0, num_requests=50)))
    sim = list(sim_requests(a[:40]))
    assert [r.sampling_params.structured is not None for r in sim] == marked[:40]
    with pytest.raises(ValueError, match="structured share"):
        build_stream(WorkloadSpec("synthetic", rate=1.0, num_requests=5, structured_share=1.5))
    assert WorkloadRequest.from_dict(WorkloadRequest(0.0, 5, 5, structured=True).to_dict()).structured
    assert "structured" not in WorkloadRequest(0.0, 5, 5).to_dict()
