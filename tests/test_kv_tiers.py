"""The prefix cache's lower tiers (host memory, disk, shared store), without a model.

A shadow executor keeps (salt, token) in every device slot and in every tier entry and moves them
exactly as the engine's movers move K/V (drops, spills, saves, then loads, before the step's writes).
Before sampling it reads each request's whole context back through its block table: a block
loaded from the wrong slot, saved after being overwritten, evicted while loaded, or served to
another tenant shows up as an assertion. Property tests drive it with random multi-turn traffic
on a device pool small enough to evict all the time."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sched_helpers import VOCAB
from fleet_helpers import sim_config
from sloserve.core.config import SchedulerConfig
from sloserve.kv.manager import KVCacheManager
from sloserve.kv.tiers import DISK, HOST, STORE, KVTiers, LocalTier, TierHit
from sloserve.sched.costs import LinkSwapCost, StepLoad, TierLinkCosts
from sloserve.sched.plan import StepPlan, StepResult
from sloserve.sched.scheduler import Scheduler
from sloserve.sched.tier_loads import choose_tier_prefix
from sloserve.core.types import Request, RequestStatus, SamplingParams

BS = 4


class DictStore:
    """A shared store as a dict (the fleet-wide component the simulator also uses this way)."""

    def __init__(self) -> None:
        self.keys: set[int] = set()

    def leading(self, keys) -> int:
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n

    def saved(self, keys) -> None:
        self.keys.update(keys)

    def forget(self, keys) -> None:
        self.keys.difference_update(keys)


class TieredShadow:
    """Device blocks, host slots, disk files and store entries holding (salt, token) per slot."""

    def __init__(self, num_blocks: int, store_data: dict):
        self.device = [[None] * BS for _ in range(num_blocks)]
        self.host: dict[int, list] = {}
        self.disk: dict[int, list] = {}
        self.store = store_data  # shared between instances
        self.loads = {HOST: 0, DISK: 0, STORE: 0}
        self.swap_space: dict[int, list] = {}  # the host swap pool, apart from the host tier

    def _tier(self, name: str):
        return {HOST: self.host, DISK: self.disk, STORE: self.store}[name]

    def execute(self, plan: StepPlan) -> StepResult:
        ops = plan.tier_ops
        for op in ops.drops:
            if op.tier == DISK:
                del self.disk[op.key]
            elif op.tier == HOST:
                self.host.pop(op.slot, None)
        for op in ops.spills:  # host rows to the disk, before the saves reuse the rows
            key, content = self.host[op.slot]
            assert key == op.key, f"spilling host slot {op.slot}: it holds another block"
            self.disk[op.key] = (key, list(content))
        for op in ops.saves:
            content = list(self.device[op.block])
            assert None not in content, f"saving a block that is not full: {content}"
            self._tier(op.tier)[op.slot if op.tier == HOST else op.key] = (op.key, content)
        for op in ops.promotes:  # (behind the step on the engine; before this step's loads either way)
            key, content = self._tier(op.tier)[op.key]
            self.host[op.slot] = (key, list(content))
        for dev, host in plan.swap_out:  # the runner's order: saves, swaps, loads, copies
            self.swap_space[host] = list(self.device[dev])
        for host, dev in plan.swap_in:
            self.device[dev] = list(self.swap_space[host])
        for op in ops.loads:
            key, content = self._tier(op.tier)[op.slot if op.tier == HOST else op.key]
            assert key == op.key, f"{op.tier} slot {op.slot} holds another block"
            self.device[op.block] = list(content)
            self.loads[op.tier] += 1
        for op in plan.copies:
            self.device[op.dst] = list(self.device[op.src])
        out = {}
        for s in plan.scheduled:
            req = s.request
            for pos in range(s.start, s.context_len):
                self.device[s.block_table[pos // BS]][pos % BS] = (req.cache_salt, req.token_slice(pos, pos + 1)[0])
            if s.samples:
                seen = [self.device[s.block_table[p // BS]][p % BS] for p in range(s.context_len)]
                want = [(req.cache_salt, t) for t in req.token_slice(0, s.context_len)]
                assert seen == want, f"{req.request_id}: KV does not hold its tokens"
                out[req.request_id] = hash(tuple(seen)) % (VOCAB - 1)
        return StepResult(out, duration_s=0.01)


def tiered_scheduler(num_blocks: int, tiers: KVTiers, tier_cost=None, estimator=None, mode: str = "recompute",
                     max_seqs: int = 4) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True, watermark=0.0, tiers=tiers,
                        num_host_blocks=0 if mode == "recompute" else 32)
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=max_seqs, policy="fcfs", preemption_mode=mode)
    return Scheduler(cfg, kv, num_blocks * BS, eos_token_ids=(), estimator=estimator, tier_cost=tier_cost)


def run(sched: Scheduler, shadow: TieredShadow, requests: list[Request], max_steps: int = 5000) -> dict[str, list[int]]:
    for r in requests:
        sched.add_request(r)
    done: dict[str, list[int]] = {}
    now = 0.0
    for _ in range(max_steps):
        if not sched.has_unfinished():
            break
        plan = sched.schedule(now)
        result = shadow.execute(plan)
        now += result.duration_s
        for r in sched.update(plan, result, now):
            if r.is_finished:
                done[r.request_id] = list(r.output_token_ids)
        sched.kv.check_invariants()
    assert not sched.has_unfinished(), "did not finish"
    return done


def conversation(rid: str, turns: int, system: list[int], salt: str, turn_len: int = 6, out: int = 3) -> list[Request]:
    """One request per turn; each prompt extends the previous one (its answer guessed as fixed tokens)."""
    reqs, history = [], list(system)
    for t in range(turns):
        history = history + [(hash((rid, t, i)) % (VOCAB - 1)) for i in range(turn_len)]
        reqs.append(Request(f"{rid}-{t}", list(history), SamplingParams(max_tokens=out, temperature=0.0),
                            tenant=salt))
        history = history + [7] * out
    return reqs


# ---- the tier bookkeeping ------------------------------------------------------------------------
def test_local_tier_is_lru_with_slots_and_skips_busy_keys():
    tier = LocalTier(HOST, 2, slotted=True)
    assert tier.admit(1, set())[1] is None
    slot2, dropped = tier.admit(2, set())
    assert dropped is None and {tier.slot_of(1), slot2} == {0, 1}
    tier.touch(1)  # 2 is now the least recently used
    slot3, dropped = tier.admit(3, set())
    assert dropped == 2 and slot3 == slot2
    assert tier.admit(4, busy={1, 3}) is None  # every resident key is being loaded
    tier.check_invariants()
    assert LocalTier(DISK, 0).admit(5, set()) is None


def test_seed_keeps_the_newest_within_capacity():
    tier = LocalTier(DISK, 2)
    assert tier.seed([10, 11, 12]) == [10]
    assert tier.keys() == [11, 12]


def test_demote_writes_through_every_lower_tier_once():
    store = DictStore()
    tiers = KVTiers(host_blocks=2, disk_blocks=4, store=store, write_back=False)
    tiers.demote(5, 100)
    tiers.demote(6, 100)  # the same key again: already everywhere
    ops = tiers.take_ops()
    assert sorted((op.tier, op.key, op.block) for op in ops.saves) == [(DISK, 100, 5), (HOST, 100, 5), (STORE, 100, 5)]
    assert tiers.find([100, 101]) == [TierHit(HOST, 100, tiers.host.slot_of(100))]
    store.saved([101])
    assert [h.tier for h in tiers.find([100, 101, 102])] == [HOST, STORE]


def test_write_back_sends_the_disk_only_what_the_host_tier_evicts():
    store = DictStore()
    tiers = KVTiers(host_blocks=2, disk_blocks=4, store=store)
    tiers.demote(5, 100)
    tiers.demote(6, 101)
    ops = tiers.take_ops()
    assert sorted((op.tier, op.key) for op in ops.saves) == [(HOST, 100), (HOST, 101), (STORE, 100), (STORE, 101)]
    assert not ops.spills and 100 not in tiers.disk
    slot_100 = tiers.host.slot_of(100)
    tiers.demote(7, 102)  # the host tier is full: its oldest block (100) goes on to the disk, from its row
    ops = tiers.take_ops()
    assert [(op.tier, op.key, op.slot) for op in ops.spills] == [(DISK, 100, slot_100)]
    assert (HOST, 102, 7, slot_100) in [(op.tier, op.key, op.block, op.slot) for op in ops.saves]
    assert 100 in tiers.disk and 100 not in tiers.host
    # Saved and evicted within one step: the host row never held it, so the disk takes the device block.
    tiers.demote(8, 103)  # evicts 101: spilled from its row
    tiers.demote(9, 104)  # evicts 102 (saved last step): spilled from its row
    tiers.demote(10, 105)  # evicts 103, whose host save is still pending: a direct disk save
    ops = tiers.take_ops()
    assert (DISK, 103, 8) in [(op.tier, op.key, op.block) for op in ops.saves]
    assert 103 not in [op.key for op in ops.spills] and {101, 102} <= {op.key for op in ops.spills}
    tiers.check_invariants()


def test_disk_and_store_writes_are_paced_to_their_links():
    store = DictStore()
    tiers = KVTiers(disk_blocks=100, store=store)
    tiers.write_rates = {DISK: 50.0, STORE: 20.0}  # blocks per second
    tiers.pace_writes(0.0)  # a first step: one burst's worth (0.1 s of each link)
    for k in range(10):
        tiers.demote(k, 1000 + k)
    ops = tiers.take_ops()
    assert sum(op.tier == DISK for op in ops.saves) == 5 and sum(op.tier == STORE for op in ops.saves) == 2
    assert tiers.disk.stats.skipped == 5 and tiers.store_stats.skipped == 8
    tiers.pace_writes(0.02)  # 20 ms later: one more disk block, no store block yet
    for k in range(10, 13):
        tiers.demote(k, 1000 + k)
    ops = tiers.take_ops()
    assert [op.key for op in ops.saves if op.tier == DISK] == [1010] and not [op for op in ops.saves if op.tier == STORE]
    tiers.pace_writes(100.0)  # idle for long: still only one burst
    for k in range(13, 40):
        tiers.demote(k, 1000 + k)
    assert sum(op.tier == DISK for op in tiers.take_ops().saves) == 5


def test_evicted_cached_blocks_are_demoted_and_a_miss_on_device_loads_them_back():
    shadow_store: dict = {}
    tiers = KVTiers(host_blocks=64)
    sched = tiered_scheduler(12, tiers)
    shadow = TieredShadow(12, shadow_store)
    first = conversation("a", 1, list(range(1, 17)), "t")
    run(sched, shadow, first)
    # Other traffic pushes the first prompt's blocks out of the 12-block device pool.
    run(sched, shadow, conversation("b", 1, list(range(100, 130)), "t"))
    assert tiers.host.stats.saved > 0
    again = Request("a-again", list(first[0].prompt_token_ids), SamplingParams(max_tokens=3, temperature=0.0),
                    tenant="t")
    out = run(sched, shadow, [again])
    # 22-token prompt: (22 - 1) // 4 = 5 blocks may be hits; what the device lost comes from the host tier.
    assert again.num_cached_tokens == 5 * BS
    assert shadow.loads[HOST] == 3 and sched.stats.num_tier_loads == 3
    assert out["a-again"] == run(tiered_scheduler(12, KVTiers()), TieredShadow(12, {}),
                                 [Request("x", list(first[0].prompt_token_ids), SamplingParams(max_tokens=3, temperature=0.0),
                                          tenant="t")])["x"]


def test_a_second_instance_loads_what_the_first_saved_in_the_shared_store():
    store, store_data = DictStore(), {}
    one, shadow_one = tiered_scheduler(12, KVTiers(store=store)), TieredShadow(12, store_data)
    run(one, shadow_one, conversation("a", 1, list(range(1, 17)), "t"))
    for other in "bc":  # evict (and so publish) all of a's blocks
        run(one, shadow_one, conversation(other, 1, list(range(100, 130)), other))
    two, shadow_two = tiered_scheduler(8, KVTiers(store=store)), TieredShadow(8, store_data)
    same = conversation("a", 1, list(range(1, 17)), "t")[0]
    run(two, shadow_two, [same])
    assert shadow_two.loads[STORE] == 5 and same.num_cached_tokens == 5 * BS
    other_tenant = conversation("a", 1, list(range(1, 17)), "u")[0]
    run(two, shadow_two, [other_tenant])
    assert shadow_two.loads[STORE] == 5 and other_tenant.num_cached_tokens == 0  # another salt: no hit


class FixedTierCost:
    """Per-block load times by tier (the engine measures them; here they are chosen)."""

    def __init__(self, per_block: dict[str, float]):
        self.per_block = per_block

    def tier_time(self, tier: str, num_blocks: int) -> float:
        return self.per_block.get(tier, float("inf")) * num_blocks  # a tier it has no link to: never worth it


class PerTokenCost:
    def estimate(self, load: StepLoad) -> float:
        return 0.0 if load.num_tokens <= 0 else 1e-3 + 1e-3 * load.num_tokens


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    convs=st.lists(st.tuples(st.integers(0, 2), st.sampled_from("tu"), st.integers(1, 3)), min_size=2, max_size=6),
    host=st.integers(0, 16), disk=st.integers(0, 16), use_store=st.booleans(), priced=st.booleans(),
    device=st.integers(12, 20), mode=st.sampled_from(["recompute", "swap"]), concurrent=st.booleans(),
)
def test_tiers_never_change_what_a_request_reads(convs, host, disk, use_store, priced, device, mode, concurrent):
    systems = [list(range(1, 9)), list(range(50, 62)), []]
    chats = [conversation(f"c{i}", turns, systems[system], tenant, turn_len=5, out=2)
             for i, (system, tenant, turns) in enumerate(convs)]
    # Round robin over the conversations: each turn finds its history pushed down the tiers.
    requests = [r for turn in itertools.zip_longest(*chats) for r in turn if r is not None]
    store = DictStore() if use_store else None
    cost = FixedTierCost({HOST: 1e-4, DISK: 3e-3, STORE: 2e-2}) if priced else None
    sched = tiered_scheduler(device, KVTiers(host, disk, store), tier_cost=cost,
                             estimator=PerTokenCost() if priced else None, mode=mode)
    shadow = TieredShadow(device, {})
    out: dict[str, list[int]] = {}
    if concurrent:  # every turn at once: preemptions (swap or recompute) interleave with the tier moves
        out.update(run(sched, shadow, requests))
    else:
        for r in requests:  # one turn after another, as a chat client sends them
            out.update(run(sched, shadow, [r]))
    plain = tiered_scheduler(device, KVTiers())
    plain_shadow = TieredShadow(device, {})
    expected: dict[str, list[int]] = {}
    for r in conversation_copies(requests):
        expected.update(run(plain, plain_shadow, [r]))
    assert out == expected
    for key, content in shadow.host.values():
        for other in (shadow.disk, shadow.store):
            if key in other:
                assert other[key] == (key, content)


def conversation_copies(requests: list[Request]) -> list[Request]:
    return [Request(r.request_id, list(r.prompt_token_ids), r.sampling_params, tenant=r.tenant) for r in requests]


def test_load_or_recompute_is_priced_per_tier():
    hits = [TierHit(HOST, 1), TierHit(HOST, 2), TierHit(DISK, 3), TierHit(DISK, 4)]
    est = PerTokenCost()  # 1 ms per token plus 1 ms per step
    cheap = FixedTierCost({HOST: 1e-4, DISK: 1e-4})
    assert choose_tier_prefix(hits, 0, 40, BS, est, cheap, 64) == 4
    slow_disk = FixedTierCost({HOST: 1e-4, DISK: 1.0})  # a disk block costs more than its 4 tokens
    assert choose_tier_prefix(hits, 0, 40, BS, est, slow_disk, 64) == 2
    assert choose_tier_prefix(hits, 0, 40, BS, est, FixedTierCost({HOST: 1.0, DISK: 1.0}), 64) == 0
    assert choose_tier_prefix(hits, 0, 40, BS, None, None, 64) == 4  # unpriced: load
    links = TierLinkCosts({HOST: LinkSwapCost(1000.0, 1e6)})
    assert links.tier_time(HOST, 2) == pytest.approx(2e-3) and links.tier_time(DISK, 1) == float("inf")


# ---- the simulator: the same tiers, priced on the hardware's links -------------------------------
def test_simulated_fleet_serves_mooncake_prefixes_from_the_shared_store():
    from sloserve.core.config import CacheConfig
    from sloserve.simulation import build_fleet, sim_requests, simulate
    from sloserve.workload.build import WorkloadSpec, build_stream

    stream = build_stream(WorkloadSpec(name="mooncake-conv", replay=True, duration_s=60.0))

    def run_fleet(**kw):
        cfg = sim_config(instances=2, router="round-robin", num_blocks=2000,
                          scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64), **kw)
        sim = build_fleet(cfg)
        records, _ = simulate(sim, sim_requests(stream))
        hits = sum(i.kv.stats.hits for i in sim.instances) / sum(i.kv.stats.queries for i in sim.instances)
        for i in sim.instances:
            i.kv.check_invariants()
        return records, hits, sim

    plain, plain_hits, _ = run_fleet()
    shared, shared_hits, sim = run_fleet(kv_store_gib=500.0, cache=CacheConfig(host_tier_gib=16.0))
    loads = sum(i.scheduler.stats.num_tier_loads for i in sim.instances)
    assert loads > 0 and shared_hits > plain_hits
    served = [r.request_id for r in shared if r.ttft_s is not None]
    assert served == [r.request_id for r in plain if r.ttft_s is not None] and len(served) > 100
    mean = lambda rs: sum(r.ttft_s for r in rs if r.ttft_s is not None) / len(served)  # noqa: E731
    assert mean(shared) < mean(plain)


# ---- rotation: which request yields its KV under pressure ----------------------------------------
def test_slack_victim_is_the_request_with_most_time_in_hand_and_late_ones_go_first():
    from sloserve.sched.rotation import pick_victim, slo_slack
    from sloserve.core.types import QoSClass

    qos = QoSClass("i", ttft_target_s=1.0, tbt_target_s=0.1)

    def req(rid, first=None, outputs=0, arrival=0.0):
        r = Request(rid, [1, 2, 3], SamplingParams(max_tokens=50), arrival_time=arrival, qos=qos)
        r.first_token_time = first
        r.output_token_ids = [5] * outputs
        return r

    waiting_first = req("a", arrival=9.5)  # TTFT due at 10.5: 0.5 s in hand at t=10
    ahead = req("b", first=5.0, outputs=60)  # 60 tokens since t=5: next due at 11.0, 1.0 s in hand
    behind = req("c", first=2.0, outputs=10)  # next was due at 3.0: already behind its pace
    assert slo_slack(waiting_first, 10.0) == pytest.approx(0.5) and slo_slack(ahead, 10.0) == pytest.approx(1.0)
    running = [waiting_first, ahead]  # policy order
    assert pick_victim(running, "rank", 10.0) is ahead
    assert pick_victim([ahead, waiting_first], "rank", 10.0) is waiting_first
    assert pick_victim([ahead, waiting_first], "slack", 10.0) is ahead
    assert pick_victim([ahead, waiting_first], "slack", 10.0, restore_s=lambda r: 0.8 if r is ahead else 0) \
        is waiting_first  # its restore eats most of its slack
    assert pick_victim([behind, ahead, waiting_first], "slack", 10.0) is behind


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_slack_rotation_keeps_every_request_correct_under_pressure(mode):
    from sched_helpers import make_request

    kv = KVCacheManager(10, BS, enable_prefix_caching=True, watermark=0.0, num_host_blocks=64)
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, preemption_mode=mode, preemption_victim="slack")
    sched = Scheduler(cfg, kv, 40, eos_token_ids=(), estimator=PerTokenCost(),
                      swap_cost=LinkSwapCost(1000.0, 1e9))
    from sloserve.core.types import QoSClass

    qos = QoSClass("i", ttft_target_s=0.5, tbt_target_s=0.05)
    requests = [make_request(f"r{i}", 6 + i % 5, max_tokens=8, qos=qos) for i in range(8)]
    out = run(sched, TieredShadow(10, {}), requests)
    assert len(out) == 8 and sched.stats.num_preemptions > 0


def test_prefix_affinity_routes_to_the_instance_whose_host_tier_holds_the_prefix():
    from sloserve.cluster.routers.prefix_affinity import PrefixAffinityRouter
    from sloserve.sched.state import InstanceState, KeySetIndex

    prompt = list(range(1, 23))
    instances = []
    for host in (0, 64):  # the same traffic on both; only the second keeps evicted blocks in host memory
        sched = tiered_scheduler(12, KVTiers(host_blocks=host))
        shadow = TieredShadow(12, {})
        run(sched, shadow, [Request("a", list(prompt), SamplingParams(max_tokens=3, temperature=0.0), tenant="t")])
        run(sched, shadow, conversation("b", 1, list(range(100, 130)), "t"))  # evicts a's prefix from the device
        instances.append(sched.kv)
    probe = Request("probe", list(prompt), SamplingParams(max_tokens=3), tenant="t")
    hashes = instances[1].request_hashes(probe)[:5]
    held = instances[1].held_keys()
    assert any(instances[1].pool.lookup(h) is None for h in hashes) and all(h in held for h in hashes)
    assert len(instances[1].newest_held_keys(1000)) > len(instances[0].newest_held_keys(1000))
    states = [InstanceState(0, 0, 0, 0, 12, 12, 0, 0.0, float("inf"), block_size=BS,
                            prefix_index=KeySetIndex(kv.held_keys())) for kv in instances]
    assert PrefixAffinityRouter().route(probe, states) == 1


def test_the_slo_policy_expects_a_tier_hit_and_prices_its_load():
    from sloserve.core.types import QoSClass

    kv = KVCacheManager(12, BS, enable_prefix_caching=True, watermark=0.0, tiers=KVTiers(host_blocks=64))
    cost = FixedTierCost({HOST: 0.0005})
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, policy="slo"), kv, 48,
                      eos_token_ids=(), estimator=PerTokenCost(), tier_cost=cost)
    shadow = TieredShadow(12, {})
    prompt = list(range(1, 23))
    run(sched, shadow, [Request("a", list(prompt), SamplingParams(max_tokens=3, temperature=0.0), tenant="t")])
    for other in "bc":
        run(sched, shadow, conversation(other, 1, list(range(100, 130)), "t"))
    qos = QoSClass("i", ttft_target_s=1.0, tbt_target_s=0.1)
    again = Request("a2", list(prompt), SamplingParams(max_tokens=3, temperature=0.0), tenant="t", qos=qos)
    fresh = Request("f", list(range(500, 522)), SamplingParams(max_tokens=3, temperature=0.0), tenant="t", qos=qos)
    sched.add_request(again)
    sched.add_request(fresh)
    assert again.expected_cached_tokens == 5 * BS and fresh.expected_cached_tokens == 0
    loaded = 5 - sum(kv.pool.lookup(h) is not None for h in kv.request_hashes(again)[:5])
    assert again.expected_load_s == pytest.approx(0.0005 * loaded)
    policy = sched.policy
    assert policy.min_prefill_time(again) < policy.min_prefill_time(fresh)


def test_a_rotated_out_request_sits_out_half_its_slack_while_others_run():
    from sched_helpers import make_request
    from sloserve.core.types import QoSClass

    kv = KVCacheManager(6, BS, enable_prefix_caching=False, watermark=0.0)
    cfg = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, preemption_victim="slack")
    sched = Scheduler(cfg, kv, 24, eos_token_ids=())
    relaxed = QoSClass("batch", ttft_target_s=100.0, tbt_target_s=10.0)
    urgent = QoSClass("interactive", ttft_target_s=0.5, tbt_target_s=0.05)
    slow = make_request("slow", 8, max_tokens=12, qos=relaxed)
    sched.add_request(slow)
    step = sched.schedule(0.0)
    sched.update(step, StepResult({"slow": 1}), 0.01)
    fast = make_request("fast", 8, max_tokens=12, arrival=0.01, qos=urgent)
    sched.add_request(fast)
    preempted_at = None
    now = 0.01
    for _ in range(40):  # 6 blocks of 4 tokens cannot hold both: the relaxed one yields
        plan = sched.schedule(now)
        if "slow" in plan.preempted:
            preempted_at = now
        now += 0.01
        sched.update(plan, StepResult({s.request_id: 1 for s in plan.scheduled if s.samples}), now)
        if preempted_at is not None and slow.status is not RequestStatus.RUNNING and sched.running:
            assert slow.resume_after > now  # sits out while the urgent one runs
        if not sched.has_unfinished():
            break
    assert preempted_at is not None and slow.resume_after > preempted_at
    assert fast.is_finished and slow.is_finished


def test_a_long_tier_load_is_paced_over_steps_beside_running_decodes():
    tiers = KVTiers(disk_blocks=64)
    cost = FixedTierCost({DISK: 0.0015})  # 1.5 ms a block; a decode step here costs 1 ms + 1 ms a token
    sched = tiered_scheduler(24, tiers, tier_cost=cost, estimator=PerTokenCost())
    shadow = TieredShadow(24, {})
    prompt = list(range(1, 42))  # 41 tokens: 10 blocks may be hits
    run(sched, shadow, [Request("a", list(prompt), SamplingParams(max_tokens=2, temperature=0.0), tenant="t")])
    for other in "bc":
        run(sched, shadow, conversation(other, 1, list(range(100, 160)), "t"))  # pushes a's blocks to disk
    long_decode = Request("d", list(range(300, 305)), SamplingParams(max_tokens=30, temperature=0.0), tenant="t")
    again = Request("a2", list(prompt), SamplingParams(max_tokens=2, temperature=0.0), tenant="t")
    sched.add_request(long_decode)
    loads_per_step, now = [], 0.0
    plan = sched.schedule(now)  # d prefills and starts decoding
    shadow.execute(plan)
    sched.update(plan, StepResult({s.request_id: 7 for s in plan.scheduled if s.samples}), now)
    sched.add_request(again)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        plan = sched.schedule(now)
        loads_per_step.append(sum(1 for op in plan.tier_ops.loads if op.tier == DISK))
        result = shadow.execute(plan)
        now += result.duration_s
        sched.update(plan, result, now)
        sched.kv.check_invariants()
    assert not sched.has_unfinished()
    steps_loading = [n for n in loads_per_step if n]
    assert len(steps_loading) >= 2 and max(steps_loading) < sum(steps_loading)  # spread over steps
    assert again.num_cached_tokens >= 8 * BS
