"""Swap on the real engine (embedded model): a KV pool too small for the batch swaps real KV
blocks to the host pool and back, and greedy outputs stay identical to a roomy pool's."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import EXACT
from sloserve import LLM
from sloserve.core.config import CacheConfig, EngineConfig, SchedulerConfig
from sloserve.engine.model import KVCache
from sloserve.engine.swap import HostKVPool

pytestmark = pytest.mark.slow

from test_engine import GREEDY, PROMPTS  # noqa: E402  (the same prompts the engine tests check)


def engine_config(num_blocks: int, mode: str = "recompute", num_host_blocks: int = 0, policy: str = "fcfs"):
    return EngineConfig(**EXACT, num_threads=1, cache=CacheConfig(num_blocks=num_blocks, num_host_blocks=num_host_blocks),
                        scheduler=SchedulerConfig(max_num_batched_tokens=64, preemption_mode=mode, policy=policy))


@pytest.fixture(scope="module")
def reference():
    roomy = LLM(config=engine_config(400))
    outs = roomy.generate(PROMPTS, GREEDY)
    assert roomy.engine.scheduler.stats.num_preemptions == 0
    return [o.token_ids for o in outs]


def test_host_pool_round_trip_restores_blocks_bit_for_bit():
    from sloserve.core.config import ModelConfig

    cfg = ModelConfig("llama", 10, 8, 16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4)
    cache = KVCache(cfg, num_blocks=6, block_size=4, dtype=torch.float32, device=torch.device("cpu"))
    cache.data.normal_()
    before = cache.data.clone()
    host = HostKVPool(cache, num_blocks=5)
    assert host.bytes_per_block == 2 * 2 * 4 * 1 * 4 * 4
    host.swap_out(cache, [(1, 3), (4, 0)])
    cache.data.zero_()
    host.swap_in(cache, [(0, 2), (3, 5)])  # back into different device blocks
    view = cache.data.view(2, 2, 6, 4, 1, 4)
    old = before.view(2, 2, 6, 4, 1, 4)
    assert torch.equal(view[:, :, 5], old[:, :, 1]) and torch.equal(view[:, :, 2], old[:, :, 4])
    assert not view[:, :, [0, 1, 3, 4]].any()


@pytest.mark.parametrize("policy", ["fcfs", "slo"])
def test_swap_preemption_keeps_greedy_outputs(reference, policy):
    # 14 blocks x 16 = 224 tokens: the longest request fits alone, not beside the others.
    small = LLM(config=engine_config(14, "swap", num_host_blocks=64, policy=policy))
    outs = small.generate(PROMPTS, GREEDY)
    stats = small.engine.scheduler.stats
    assert [o.token_ids for o in outs] == reference
    assert stats.num_swaps_out > 0 and stats.num_swaps_in == stats.num_swaps_out and stats.num_recomputes == 0
    kv = small.engine.kv
    kv.release_host_blocks()
    assert kv.pool.num_used == 0 and kv.num_free_host_blocks == 64
    kv.check_invariants()
    # The engine measured its swaps and keeps a bandwidth estimate for the cost-based choice.
    assert small.engine.swap_cost is not None and small.engine.swap_cost.bandwidth > 0
    assert small.engine.step_estimator.num_observed > 0


def test_auto_preemption_on_the_engine_keeps_greedy_outputs(reference):
    small = LLM(config=engine_config(14, "auto", num_host_blocks=64))
    outs = small.generate(PROMPTS, GREEDY)
    stats = small.engine.scheduler.stats
    assert [o.token_ids for o in outs] == reference
    assert stats.num_preemptions > 0 and stats.num_swaps_out + stats.num_recomputes == stats.num_preemptions
