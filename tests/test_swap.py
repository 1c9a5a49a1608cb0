"""Preemption by swap to the host tier, without a model: the KV manager's host pool, the
scheduler's swap plans checked against a shadow device and host that really move "KV", the
cost-based choice between swap and recompute, and the simulator's pricing of swaps."""
from __future__ import annotations

import random

import pytest

from kv_helpers import assert_cached_blocks_unchanged, assert_tables_read_back
from sched_helpers import VOCAB, make_request, run_to_completion
from sloserve.core.config import CacheConfig, SchedulerConfig
from sloserve.kv.manager import KVCacheManager
from sloserve.sched.costs import LinkSwapCost, StepLoad
from sloserve.sched.plan import StepPlan, StepResult
from sloserve.sched.preemption import choose_preemption
from sloserve.sched.scheduler import Scheduler
from sloserve.sim.catalog import get_model
from sloserve.sim.cost import RooflineCostModel
from sloserve.sim.hardware import get_hardware
from sloserve.core.types import Request, RequestStatus, SamplingParams

BS = 16


class ShadowKVExecutor:
    """Keeps a token id in every device and host slot, moved exactly as a real executor moves
    K/V: swap-outs, then swap-ins, then copy-on-write copies, then the step's writes. Before
    sampling it reads each request's whole context back through its block table and checks it
    is the request's tokens, and the sampled token depends on what it read: a wrong swap
    shows up as an assertion or as different output."""

    def __init__(self, num_blocks: int, num_host_blocks: int):
        self.device = [[None] * BS for _ in range(num_blocks)]
        self.host = [[None] * BS for _ in range(num_host_blocks)]
        self.swapped_blocks = 0

    def execute(self, plan: StepPlan) -> StepResult:
        for dev, host in plan.swap_out:
            self.host[host] = list(self.device[dev])
        for host, dev in plan.swap_in:
            self.device[dev] = list(self.host[host])
        self.swapped_blocks += len(plan.swap_out) + len(plan.swap_in)
        for op in plan.copies:
            self.device[op.dst] = list(self.device[op.src])
        out = {}
        for s in plan.scheduled:
            req = s.request
            for pos in range(s.start, s.context_len):
                self.device[s.block_table[pos // BS]][pos % BS] = req.token_slice(pos, pos + 1)[0]
            if s.samples:
                seen = [self.device[s.block_table[p // BS]][p % BS] for p in range(s.context_len)]
                assert seen == req.token_slice(0, s.context_len), f"{req.request_id}: KV does not hold its tokens"
                out[req.request_id] = hash(tuple(seen)) % (VOCAB - 1)
        return StepResult(out, duration_s=0.01)


def swap_scheduler(num_blocks: int, num_host_blocks: int, mode: str = "swap", policy: str = "fcfs",
                   estimator=None, swap_cost=None, budget: int = 64, caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching, watermark=0.0, num_host_blocks=num_host_blocks)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16, policy=policy, preemption_mode=mode)
    return Scheduler(cfg, kv, num_blocks * BS, eos_token_ids=(), estimator=estimator, swap_cost=swap_cost)


class LinearCost:
    def __init__(self, const: float, per_token: float):
        self.const, self.per_token = const, per_token

    def estimate(self, load: StepLoad) -> float:
        return 0.0 if load.num_tokens <= 0 else self.const + self.per_token * load.num_tokens


# ---- the KV manager's host tier ------------------------------------------------------------
def computed(kv: KVCacheManager, rid: str, n: int) -> Request:
    r = Request(rid, list(range(1000, 1000 + n)), SamplingParams(max_tokens=10))
    assert kv.allocate_slots(r, n) == []
    r.num_computed_tokens = n
    kv.cache_blocks(r)
    return r


def test_kv_swap_out_and_in_moves_blocks_between_tiers():
    kv = KVCacheManager(10, BS, watermark=0.0, num_host_blocks=4)
    r = computed(kv, "r", 40)  # 3 blocks
    device_ids = list(kv.block_table("r"))
    pairs = kv.swap_out(r)
    assert [d for d, _ in pairs] == device_ids and len({h for _, h in pairs}) == 3
    assert kv.num_free_blocks == 10 and kv.num_free_host_blocks == 1
    assert kv.is_swapped("r") and kv.num_blocks_of("r") == 0
    kv.check_invariants()
    assert kv.swap_out(computed(kv, "big", 64)) is None  # 4 blocks, 1 host block free: no room, nothing changes
    assert kv.num_blocks_of("big") == 4
    kv.free(Request("big", [0], SamplingParams()))
    back = kv.swap_in(r, 1)
    assert [h for h, _ in back] == [h for _, h in pairs] and len(kv.block_table("r")) == 3
    # The host blocks stay taken until the next step is planned: the step that reads them has not run.
    assert kv.num_free_host_blocks == 1
    kv.check_invariants()
    kv.release_host_blocks()
    assert kv.num_free_host_blocks == 4
    kv.free(r)
    kv.check_invariants()
    assert kv.num_free_blocks == 10


def test_kv_swap_in_fails_cleanly_without_device_room_and_abort_frees_host_blocks():
    kv = KVCacheManager(4, BS, watermark=0.0, num_host_blocks=4)
    r = computed(kv, "r", 48)
    kv.swap_out(r)
    hog = computed(kv, "hog", 40)  # 3 of 4 device blocks
    assert kv.swap_in(r, 1) is None and kv.is_swapped("r") and kv.num_blocks_of("r") == 0
    kv.free(hog)
    kv.free(r)  # an abort while swapped out
    assert kv.num_free_host_blocks == 4
    kv.check_invariants()


# ---- the scheduler, with real block movement ------------------------------------------------
def workload(seed: int, n: int = 10) -> list[tuple[str, int, int, float]]:
    rng = random.Random(seed)
    return [(f"r{i}", rng.randint(20, 120), rng.randint(10, 40), i * 0.01) for i in range(n)]


@pytest.mark.parametrize("policy", ["fcfs", "slo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_swap_round_trip_gives_identical_outputs(policy, seed):
    def build(num_blocks: int, num_host: int, mode: str) -> Scheduler:
        s = swap_scheduler(num_blocks, num_host, mode, policy, estimator=LinearCost(0.005, 1e-4))
        for rid, n, m, t in workload(seed):
            s.add_request(make_request(rid, n, max_tokens=m, arrival=t))
        return s

    big = build(200, 0, "recompute")
    expected = run_to_completion(big, ShadowKVExecutor(200, 0))
    assert big.stats.num_preemptions == 0
    small = build(14, 200, "swap")
    executor = ShadowKVExecutor(14, 200)
    assert run_to_completion(small, executor) == expected
    assert small.stats.num_swaps_out > 0 and small.stats.num_swaps_in == small.stats.num_swaps_out
    assert small.stats.num_recomputes == 0 and executor.swapped_blocks == small.stats.num_blocks_swapped > 0
    assert small.kv.num_free_blocks == 14
    small.kv.release_host_blocks()
    assert small.kv.num_free_host_blocks == 200
    small.kv.check_invariants()


def test_full_host_tier_falls_back_to_recompute_and_still_matches():
    def build(num_blocks: int, num_host: int) -> Scheduler:
        s = swap_scheduler(num_blocks, num_host, "swap")
        for rid, n, m, t in workload(5, 12):
            s.add_request(make_request(rid, n, max_tokens=m, arrival=t))
        return s

    expected = run_to_completion(build(200, 0), ShadowKVExecutor(200, 0))
    small = build(14, 3)  # room for the smallest victims only
    assert run_to_completion(small, ShadowKVExecutor(14, 3)) == expected
    assert small.stats.num_swaps_out > 0 and small.stats.num_recomputes > 0


def test_swapped_request_resumes_where_it_stopped():
    # 8 blocks: two 60-token prompts take 4 each; when the first needs a fifth block the
    # second (last in FCFS order) is swapped out, and later continues from its own KV.
    sched = swap_scheduler(8, 16, "swap", budget=128)
    a, b = make_request("a", 60, max_tokens=50), make_request("b", 60, max_tokens=50, arrival=0.5)
    sched.add_request(a)
    sched.add_request(b)
    executor, now, kept, resumed_at = ShadowKVExecutor(8, 16), 0.0, None, None
    while sched.has_unfinished():
        plan = sched.schedule(now)
        if "b" in plan.preempted:
            assert b.status is RequestStatus.SWAPPED and kept is None
            kept = b.num_computed_tokens
        for s in plan.scheduled:
            if s.request_id == "b" and kept is not None and resumed_at is None:
                resumed_at = s.start
        sched.update(plan, executor.execute(plan), now)
        now += 1
    assert kept == 64 and resumed_at == kept  # no recompute: it went on from its 64 computed tokens
    assert sched.stats.num_swaps_out == sched.stats.num_swaps_in == 1 and a.num_output_tokens == 50


# ---- swap or recompute: the cost-based choice ----------------------------------------------
def test_cost_based_choice_on_constructed_costs():
    est = LinearCost(0.01, 1e-3)  # recomputing 1,000 tokens in 256-token chunks: 4 steps, 1.04 s
    fast_link = LinkSwapCost(bytes_per_block=1e6, bandwidth=1e9)  # 63 blocks: 63 ms each way
    slow_link = LinkSwapCost(bytes_per_block=1e6, bandwidth=1e7)  # 6.3 s each way
    auto = choose_preemption("auto", 1000, 63, 100, est, fast_link, 256)
    assert auto.how == "swap" and auto.swap_s == pytest.approx(0.126) and auto.recompute_s == pytest.approx(1.04)
    assert choose_preemption("auto", 1000, 63, 100, est, slow_link, 256).how == "recompute"
    # A short context is cheap to recompute even over a fast link.
    short = choose_preemption("auto", 10, 1, 100, est, LinkSwapCost(1e6, 5e7), 256)
    assert short.how == "recompute" and short.swap_s == pytest.approx(0.04) and short.recompute_s == pytest.approx(0.02)
    # Without room in the host tier, or nothing computed, there is nothing to swap.
    assert choose_preemption("auto", 1000, 63, 62, est, fast_link, 256).how == "recompute"
    assert choose_preemption("swap", 0, 0, 100, est, fast_link, 256).how == "recompute"
    # The fixed modes ignore the costs; auto without an estimate recomputes (the safe default).
    assert choose_preemption("swap", 1000, 63, 100, est, slow_link, 256).how == "swap"
    assert choose_preemption("recompute", 1000, 63, 100, est, fast_link, 256).how == "recompute"
    assert choose_preemption("auto", 1000, 63, 100, None, fast_link, 256).how == "recompute"
    assert choose_preemption("auto", 1000, 63, 100, est, None, 256).how == "recompute"
    with pytest.raises(ValueError):
        choose_preemption("drop", 1000, 63, 100, est, fast_link, 256)


@pytest.mark.parametrize("bandwidth, want", [(1e12, "swap"), (1e3, "recompute")])
def test_scheduler_in_auto_mode_picks_by_cost(bandwidth, want):
    sched = swap_scheduler(12, 64, "auto", estimator=LinearCost(0.01, 1e-3),
                           swap_cost=LinkSwapCost(bytes_per_block=1e5, bandwidth=bandwidth))
    for rid, n, m, t in workload(3, 8):
        sched.add_request(make_request(rid, n, max_tokens=m, arrival=t))
    run_to_completion(sched, ShadowKVExecutor(12, 64))
    assert sched.stats.num_preemptions > 0
    if want == "swap":
        assert sched.stats.num_swaps_out == sched.stats.num_preemptions
    else:
        assert sched.stats.num_recomputes == sched.stats.num_preemptions and sched.stats.num_swaps_out == 0
    assert sched.last_preemption.how == want


def test_link_swap_cost_learns_measured_bandwidth():
    cost = LinkSwapCost(bytes_per_block=1e6, bandwidth=1e9)
    assert cost.swap_time(10) == pytest.approx(0.01)
    for _ in range(30):
        cost.observe(10, 0.1)  # measured: 1e8 B/s
    assert cost.bandwidth == pytest.approx(1e8, rel=1e-3)


# ---- the simulator prices swaps over the host link -------------------------------------------
def test_roofline_prices_swaps_from_host_link_bandwidth():
    hw, model = get_hardware("h100-80g"), get_model("llama-3.1-8b")
    cost = RooflineCostModel(hw, model, block_size=16)
    block_bytes = 16 * model.kv_bytes_per_token(2)  # 2 MiB per 16-token block of Llama-3.1-8B
    assert cost.swap_time(100) == pytest.approx(100 * block_bytes / (hw.host_link_bandwidth * 0.8))
    base = StepLoad(64, 64, 64, 64 * 1000, 0.0, 0)
    with_swap = StepLoad(64, 64, 64, 64 * 1000, 0.0, 0, swap_blocks=100)
    assert cost.step_time(with_swap) == pytest.approx(cost.step_time(base) + cost.swap_time(100))
    assert RooflineCostModel(hw, model, tp=2).swap_time(100) == pytest.approx(cost.swap_time(100) / 2)
    # The cost model is also the scheduler's estimator.
    assert cost.estimate(StepLoad.prefill(512)) == pytest.approx(cost.step_time(StepLoad(512, 1, 0, 0, 512 * 256.5, 512)))


def test_simulated_instance_swaps_and_counts_it():
    from sloserve.cluster.routers import make_router
    from sloserve.sim.instance import SimInstance
    from sloserve.sim.simulator import Simulator

    cost = RooflineCostModel(get_hardware("a100-80g"), get_model("llama-3.1-8b"))
    cfg = SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=32, preemption_mode="swap")
    inst = SimInstance(0, cost, 60, 960, cfg, CacheConfig(block_size=16), num_host_blocks=5000)
    rng = random.Random(0)
    reqs = [Request(f"r{i}", [rng.randrange(100, 30000) for _ in range(rng.randint(50, 400))],
                    SamplingParams(max_tokens=rng.randint(20, 200), ignore_eos=True, temperature=0),
                    arrival_time=i * 0.01) for i in range(40)]
    result = Simulator([inst], make_router("round-robin")).run(reqs)
    assert len(result.finished) == 40
    assert inst.scheduler.stats.num_swaps_out > 0 and inst.scheduler.stats.num_recomputes == 0
    inst.kv.release_host_blocks()
    assert inst.kv.num_free_host_blocks == 5000 and inst.kv.num_free_blocks == 60


# ---- property: any interleaving of allocations, swaps and frees keeps every table readable ----
from hypothesis import settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

PBS = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 50, 51, 52, 53], [7] * 12]


class SwapMachine(RuleBasedStateMachine):
    """A shadow device and host tier written exactly as an executor would: swap-outs, then
    swap-ins, then copy-on-write copies, then new tokens. A resident request's blocks must read
    back as its tokens; a swapped one's host blocks must, once it is back; cached device blocks
    never change content."""

    @initialize(num_blocks=st.integers(4, 30), num_host=st.integers(0, 30), caching=st.booleans())
    def setup(self, num_blocks: int, num_host: int, caching: bool) -> None:
        self.kv = KVCacheManager(num_blocks, PBS, enable_prefix_caching=caching, watermark=0.0,
                                 num_host_blocks=num_host)
        self.device = {b: [None] * PBS for b in range(num_blocks)}
        self.host = {b: [None] * PBS for b in range(num_host)}
        self.hashed: dict[int, tuple] = {}
        self.resident: dict[str, Request] = {}
        self.swapped: dict[str, Request] = {}
        self.n = 0

    def _write(self, req: Request, n: int, copies) -> None:
        for op in copies:
            self.device[op.dst] = list(self.device[op.src])
        table = self.kv.block_table(req.request_id)
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            self.device[table[pos // PBS]][pos % PBS] = req.all_token_ids[pos]
        req.num_computed_tokens += n
        self.kv.cache_blocks(req)
        for block in self.kv.pool.blocks:
            if block.block_hash is not None:
                self.hashed.setdefault(block.block_hash, tuple(self.device[block.block_id]))

    @rule(prefix=st.sampled_from(PREFIXES), extra=st.lists(st.integers(100, 110), max_size=9))
    def new_request(self, prefix, extra):
        self.kv.release_host_blocks()  # a new step
        req = Request(f"r{self.n}", list(prefix) + list(extra), SamplingParams(max_tokens=100))
        self.n += 1
        hits, cached = self.kv.get_computed_blocks(req)
        copies = self.kv.allocate_slots(req, req.num_tokens - cached, hits)
        if copies is None:
            self.kv.free(req)
            return
        req.num_computed_tokens = cached
        self._write(req, req.num_tokens - cached, copies)
        self.resident[req.request_id] = req

    @rule(data=st.data(), tokens=st.lists(st.integers(100, 110), min_size=1, max_size=5))
    def append(self, data, tokens):
        if not self.resident:
            return
        req = self.resident[data.draw(st.sampled_from(sorted(self.resident)))]
        req.output_token_ids.extend(tokens)
        copies = self.kv.allocate_slots(req, len(tokens))
        if copies is None:
            del req.output_token_ids[-len(tokens):]
            return
        self._write(req, len(tokens), copies)

    @rule(data=st.data())
    def swap_out(self, data):
        if not self.resident:
            return
        rid = data.draw(st.sampled_from(sorted(self.resident)))
        req = self.resident[rid]
        pairs = self.kv.swap_out(req)
        if pairs is None:
            return
        for dev, host in pairs:
            self.host[host] = list(self.device[dev])
        self.swapped[rid] = self.resident.pop(rid)

    @rule(data=st.data())
    def swap_in(self, data):
        if not self.swapped:
            return
        rid = data.draw(st.sampled_from(sorted(self.swapped)))
        req = self.swapped[rid]
        pairs = self.kv.swap_in(req, 0)
        if pairs is None:
            return
        for host, dev in pairs:
            self.device[dev] = list(self.host[host])
        self.resident[rid] = self.swapped.pop(rid)

    @rule(data=st.data())
    def free(self, data):
        pool = {**self.resident, **self.swapped}
        if not pool:
            return
        rid = data.draw(st.sampled_from(sorted(pool)))
        self.kv.free(pool[rid])
        self.resident.pop(rid, None)
        self.swapped.pop(rid, None)

    @invariant()
    def consistent(self):
        if hasattr(self, "kv"):
            self.kv.check_invariants()

    @invariant()
    def resident_tables_read_back_tokens(self):
        if hasattr(self, "kv"):
            assert_tables_read_back(self.kv, self.resident.values(), self.device, PBS)

    @invariant()
    def cached_blocks_never_change(self):
        if hasattr(self, "kv"):
            assert_cached_blocks_unchanged(self.kv, self.device, self.hashed)


TestSwapMachine = SwapMachine.TestCase
TestSwapMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
