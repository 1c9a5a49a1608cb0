"""Routing policies on constructed instance states: each picks what it should, prefix
affinity respects its load bound, and every policy routes a simulated fleet by name."""
from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest

from fleet_helpers import sim_config
from sloserve.cluster.lengths import LengthPrediction
from sloserve.cluster.routers import ROUTERS, RouterOptions, make_router
from sloserve.cluster.routers.predicted_load import PredictedLoadRouter
from sloserve.cluster.routers.prefix import prefix_matches
from sloserve.cluster.routers.prefix_affinity import PrefixAffinityRouter
from sloserve.kv.hashing import hash_full_blocks
from sloserve.sched.state import InstanceState, KeySetIndex
from sloserve.core.types import Request, SamplingParams

BS = 16


def st(running=0, waiting=0, prefill=0, used=0, total=1000, decode=0, waiting_blocks=0, index=None) -> InstanceState:
    return InstanceState(num_running=running, num_waiting=waiting, queued_prefill_tokens=prefill, kv_blocks_used=used,
                         kv_blocks_free=total - used, kv_blocks_total=total, predicted_remaining_decode_tokens=decode,
                         prefix_cache_hit_rate=0.0, min_ttft_slack_s=math.inf, block_size=BS,
                         kv_blocks_waiting=waiting_blocks, prefix_index=index)


def req(prompt_len=100, rid="r", tenant="", prompt=None, predicted=None) -> Request:
    prompt = prompt if prompt is not None else list(range(1, prompt_len + 1))
    return Request(rid, prompt, SamplingParams(max_tokens=50, temperature=0), tenant=tenant,
                   predicted_output_len=predicted)


def cached(prompt, blocks=None, tenant="") -> KeySetIndex:
    """An index holding the first `blocks` full blocks of `prompt` (all by default)."""
    keys = hash_full_blocks(prompt, BS, tenant)
    return KeySetIndex(set(keys[:blocks] if blocks is not None else keys))


# ---- the simple ones ---------------------------------------------------------------------

def test_registry_has_every_policy_by_name():
    assert set(ROUTERS) == {"round-robin", "least-requests", "least-kv", "power-of-two", "prefix-affinity",
                            "predicted-load"}
    for name in ROUTERS:
        assert make_router(name).name == name
    with pytest.raises(ValueError, match="unknown router"):
        make_router("random-walk")


def test_round_robin_and_least_requests():
    states = [st(running=3), st(running=1, waiting=1), st(running=5)]
    rr = make_router("round-robin")
    assert [rr.route(req(), states) for _ in range(4)] == [0, 1, 2, 0]
    assert make_router("least-requests").route(req(), states) == 1


def test_least_kv_counts_blocks_in_use_and_the_waiting_queue():
    states = [st(used=500), st(used=100, waiting=1, waiting_blocks=300), st(used=300)]
    assert make_router("least-kv").route(req(), states) == 2  # 30% beats 40% (10% in use + 30% queued)
    # equal demand: fewer requests wins, then the lowest index
    assert make_router("least-kv").route(req(), [st(used=200, running=4), st(used=200, running=2)]) == 1
    assert make_router("least-kv").route(req(), [st(used=200), st(used=200)]) == 0


def test_power_of_two_takes_the_less_loaded_of_two_seeded_draws():
    states = [st(running=0), st(running=5), st(running=10)]
    router = make_router("power-of-two", RouterOptions(seed=7))
    picks = [router.route(req(), states) for _ in range(300)]
    assert 2 not in picks  # the most loaded loses every draw it is in
    assert set(picks) == {0, 1}
    assert Counter(picks)[0] > Counter(picks)[1]  # 0 wins whenever drawn: 2 of 3 pairs
    again = make_router("power-of-two", RouterOptions(seed=7))
    assert [again.route(req(), states) for _ in range(300)] == picks  # reproducible from the seed
    injected = make_router("power-of-two", RouterOptions(rng=random.Random(7)))
    assert [injected.route(req(), states) for _ in range(300)] == picks
    assert make_router("power-of-two").route(req(), [st()]) == 0


# ---- prefix affinity with bounded load --------------------------------------------------

def test_prefix_matches_counts_leading_cached_blocks_per_instance():
    prompt = list(range(1000, 1000 + 10 * BS + 3))
    states = [st(), st(index=cached(prompt, 3)), st(index=cached(prompt)), st(index=cached(prompt[:5 * BS]))]
    assert prefix_matches(req(prompt=prompt), states) == [0, 3, 10, 5]
    assert prefix_matches(req(prompt=prompt), states, max_blocks=4) == [0, 3, 4, 4]
    # a block-aligned prompt: its last block is never counted (the step computing it samples)
    aligned = prompt[:4 * BS]
    assert prefix_matches(req(prompt=aligned), [st(index=cached(aligned))]) == [3]


def test_prefix_affinity_follows_the_cache_within_the_bound():
    prompt = list(range(5000, 5000 + 8 * BS))
    states = [st(running=2), st(running=3, index=cached(prompt)), st(running=2)]
    # holder has 3 requests; bound = ceil(1.25 * (7 + 1) / 3) = 4, so 3 + 1 fits
    router = PrefixAffinityRouter(epsilon=0.25)
    assert router.load_bound(states) == 4
    assert router.route(req(prompt=prompt), states) == 1
    # the longest match wins among instances under the bound
    states = [st(running=1, index=cached(prompt, 2)), st(running=2, index=cached(prompt, 6)), st(running=1)]
    assert router.route(req(prompt=prompt), states) == 1


def test_prefix_affinity_leaves_an_overloaded_holder():
    prompt = list(range(5000, 5000 + 8 * BS))
    states = [st(running=1), st(running=6, index=cached(prompt)), st(running=0)]
    # bound = ceil(1.25 * 8 / 3) = 4 < 6 + 1: the holder is over it, the least-loaded takes it
    assert PrefixAffinityRouter(epsilon=0.25).route(req(prompt=prompt), states) == 2
    # a looser bound keeps the affinity
    assert PrefixAffinityRouter(epsilon=2.0).route(req(prompt=prompt), states) == 1


def test_prefix_affinity_without_a_match_goes_to_the_least_loaded():
    prompt = list(range(7000, 7000 + 4 * BS))
    other = list(range(9000, 9000 + 4 * BS))
    states = [st(running=3, index=cached(other)), st(running=1, index=cached(other)), st(running=2)]
    assert PrefixAffinityRouter().route(req(prompt=prompt), states) == 1
    # another tenant's cached copy of the same tokens does not count (keys are salted)
    states = [st(running=3, index=cached(prompt, tenant="acme")), st(running=1)]
    assert PrefixAffinityRouter().route(req(prompt=prompt, tenant="globex"), states) == 1
    assert PrefixAffinityRouter().route(req(prompt=prompt, tenant="acme"), states) == 0


def test_prefix_affinity_does_not_hot_spot_a_popular_prefix():
    """200 requests sharing one prefix, cached on instance 0 (and, once they land there, on
    every instance that took one): no instance ever exceeds the bound."""
    prompt = list(range(100, 100 + 8 * BS))
    n, eps = 4, 0.25
    router = PrefixAffinityRouter(epsilon=eps)
    loads = [0] * n
    holders = {0}
    for k in range(200):
        states = [st(running=loads[i], index=cached(prompt) if i in holders else None) for i in range(n)]
        bound = router.load_bound(states)
        i = router.route(req(prompt=prompt, rid=f"r{k}"), states)
        loads[i] += 1
        holders.add(i)
        assert loads[i] <= bound
    assert max(loads) <= math.ceil((1 + eps) * sum(loads) / n)
    assert min(loads) > 0  # the overflow really went elsewhere


# ---- predicted load ------------------------------------------------------------------------

def test_predicted_load_weighs_queued_prefill_not_request_counts():
    # instance 0: two requests, one 8k-token prompt queued; instance 1: five short ones
    states = [st(running=1, waiting=1, prefill=8000), st(running=4, waiting=1, prefill=300)]
    assert make_router("least-requests").route(req(), states) == 0
    assert make_router("predicted-load").route(req(), states) == 1


def test_predicted_load_counts_predicted_decode_work():
    states = [st(running=4, prefill=100, decode=8000), st(running=4, prefill=100, decode=1000)]
    assert make_router("predicted-load").route(req(), states) == 1


def test_predicted_load_uses_the_length_distribution_for_kv_overflow_risk():
    """Two instances: 0 has slightly less work queued but little KV room left, 1 has room.
    A request predicted at ~200 tokens with no spread fits both; the same median with a long
    tail overflows 0 with real probability, so it goes to 1."""
    states = [st(running=8, prefill=0, used=960, total=1000), st(running=8, prefill=200, used=500, total=1000)]
    tight = LengthPrediction((0.1, 0.5, 0.9), (200.0, 200.0, 200.0))
    wide = LengthPrediction((0.1, 0.5, 0.9), (50.0, 200.0, 2000.0))
    r = req(prompt_len=100)

    def router_for(pred):
        return PredictedLoadRouter(predictions=lambda request: pred)

    # room on 0: (1000 - 960) blocks * 16 - 100 prompt tokens = 540 tokens
    s_tight = router_for(tight).scores(r, states)
    assert s_tight[0].overflow_risk == 0.0 and router_for(tight).route(r, states) == 0
    s_wide = router_for(wide).scores(r, states)
    assert 0.1 < s_wide[0].overflow_risk < 0.5 and s_wide[1].overflow_risk < s_wide[0].overflow_risk
    assert router_for(wide).route(r, states) == 1


def test_predicted_load_prefers_a_cached_prefix_until_the_queue_outweighs_it():
    prompt = list(range(300, 300 + 200 * BS))  # 3200 tokens, all cacheable but the last block
    holder = cached(prompt)
    router = make_router("predicted-load")
    assert router.route(req(prompt=prompt), [st(prefill=500), st(prefill=1500, index=holder)]) == 1
    assert router.route(req(prompt=prompt), [st(prefill=500), st(prefill=6000, index=holder)]) == 0


def test_predicted_load_prefers_an_instance_holding_the_adapter_until_its_queue_outweighs_it():
    from dataclasses import replace

    from sloserve.cluster.routers.predicted_load import ADAPTER_MISS_TOKENS

    router = make_router("predicted-load")
    tuned = replace(req(), lora="support-bot")
    holder = replace(st(prefill=200), adapters=frozenset({"support-bot"}))
    assert router.route(tuned, [st(prefill=100), holder]) == 1  # 100 tokens more queue < loading it elsewhere
    assert router.route(req(), [st(prefill=100), holder]) == 0  # the base model: no preference
    busy = replace(st(prefill=100 + ADAPTER_MISS_TOKENS + 50), adapters=frozenset({"support-bot"}))
    assert router.route(tuned, [st(prefill=100), busy]) == 0  # the queue outweighs the adapter's load
    assert [s.adapter for s in router.scores(tuned, [st(), holder])] == [ADAPTER_MISS_TOKENS, 0.0]


def test_predicted_load_without_predictions_falls_back_to_the_point_or_a_prior():
    router = PredictedLoadRouter()
    states = [st(used=900, total=1000, running=4), st(used=100, total=1000, running=4, prefill=50)]
    long_point = req(prompt_len=100, predicted=5000)
    assert router.scores(long_point, states)[0].overflow_risk > 0.5
    assert router.route(long_point, states) == 1
    assert router.route(req(prompt_len=100), states) in (0, 1)  # the prior: just a valid answer


# ---- every policy routes `sloserve simulate` -------------------------------------------

@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_every_router_runs_in_sloserve_simulate(name, tmp_path):
    from sloserve.cli import main

    out = tmp_path / "out"
    rc = main(["simulate", "--router", name, "--instances", "3", "--workload", "synthetic", "--rate", "40",
               "--num-requests", "60", "--input-len", "300", "--output-len", "40", "--out", str(out),
               "--no-progress", "--slo", "ttft=2000"])
    assert rc == 0
    run = json.loads((out / "results.json").read_text())["runs"][0]
    assert run["config"]["router"] == name and run["outcome"]["completed"] == 60
    assert run["config"]["predictor"] == ("default" if name == "predicted-load" else None)


def test_prefix_affinity_raises_the_hit_rate_in_a_simulated_fleet():
    """Conversations of several turns, each turn's prompt extending the last: following the
    cache saves prefill that round-robin recomputes."""
    from sloserve.simulation import build_fleet, sim_requests, simulate
    from sloserve.workload.types import WorkloadRequest

    rng = random.Random(0)
    stream, t = [], 0.0
    for turn in range(1, 5):  # every conversation's turn k, then every turn k + 1: ~2 s between turns
        for conv in range(41):  # (41, not 40: round-robin over 4 must not keep conversations together by chance)
            t += rng.expovariate(20.0)
            ids = tuple(conv * 100 + j for j in range(turn * 2))  # 2 more 512-token blocks per turn
            stream.append(WorkloadRequest(t, len(ids) * 512 + 50, 30, hash_ids=ids, hash_block_size=512,
                                          request_id=f"c{conv}-t{turn}"))
    hit = {}
    for name in ("round-robin", "prefix-affinity", "predicted-load"):
        sim = build_fleet(sim_config(instances=4, router=name, num_blocks=20000))
        records, result = simulate(sim, sim_requests(stream))
        assert result.num_finished == len(stream)
        hits = sum(i.kv.stats.hits for i in sim.instances)
        queries = sum(i.kv.stats.queries for i in sim.instances)
        hit[name] = hits / queries
    assert hit["prefix-affinity"] > hit["round-robin"] + 0.1
    assert hit["predicted-load"] > hit["round-robin"] + 0.1
