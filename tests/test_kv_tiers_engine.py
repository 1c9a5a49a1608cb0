"""The prefix cache's lower tiers on the real engine (embedded model): a conversation's second
turn, after other traffic pushed its history out of a small device pool, is served from host
memory or disk with the very greedy tokens a recompute gives; a restarted engine on the same
disk directory serves a prefix the first one stored; a vanished file costs a recompute only."""
from __future__ import annotations

import pytest

from engine_helpers import EXACT
from sloserve import LLM
from sloserve.core.config import CacheConfig, EngineConfig, SchedulerConfig
from sloserve.kv.tiers import DISK, HOST, STORE
from sloserve.core.types import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SYSTEM = ("You are a careful assistant for a small bakery. Answer in one short sentence, mention the "
          "opening hours (7 to 15, closed on Mondays) when asked about visits, and never invent prices. ")
FIRST = SYSTEM + "User: Do you sell rye bread? Assistant: Yes, every day but Monday. "
SECOND = FIRST + "User: Can I come on Tuesday at eight? Assistant:"
OTHERS = [f"Write a list of {n} fruits that grow in cold climates and say why each one does well there."
          for n in range(3, 9)]


def config(num_blocks: int, max_seqs: int = 64, **cache) -> EngineConfig:
    return EngineConfig(**EXACT, num_threads=1, cache=CacheConfig(num_blocks=num_blocks, **cache),
                        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_seqs))


def chat(llm: LLM) -> list[int]:
    """Turn one, other traffic that evicts it from the device, then turn two."""
    llm.generate([FIRST], GREEDY)
    for other in OTHERS:
        llm.generate([other], GREEDY)
    return llm.generate([SECOND], GREEDY)[0].token_ids


@pytest.fixture(scope="module")
def recomputed():
    plain = LLM(config=config(12))  # the same small pool, no tiers: turn two recomputes its history
    out = chat(plain)
    assert plain.engine.scheduler.stats.num_tier_loads == 0
    return out


def test_second_turn_from_the_host_tier_equals_recompute(recomputed):
    llm = LLM(config=config(12, host_tier_gib=0.05))
    assert chat(llm) == recomputed
    stats = llm.engine.kv.tiers.stats()
    assert stats[HOST].saved > 0 and stats[HOST].loaded >= 3
    assert llm.engine.scheduler.stats.num_tier_loads == stats[HOST].loaded
    llm.engine.kv.check_invariants()


def test_disk_tier_survives_a_restart_and_a_lost_file_is_recomputed(recomputed, tmp_path):
    first = LLM(config=config(12, disk_tier_dir=str(tmp_path), disk_tier_gib=0.05))
    assert chat(first) == recomputed
    first.engine.close()  # writes what the device still caches
    files = list(tmp_path.rglob("*.kv"))
    assert files and not list(tmp_path.rglob("*.tmp"))

    again = LLM(config=config(12, disk_tier_dir=str(tmp_path), disk_tier_gib=0.05))
    assert len(again.engine.kv.tiers.disk) == len(files)
    out = again.generate([SECOND], GREEDY)[0]
    assert out.token_ids == recomputed
    assert again.engine.kv.tiers.stats()[DISK].loaded >= 3

    # With a host tier too, a request waiting behind another has its prefix prefetched from disk
    # into host memory (on a background thread) and is admitted with host loads.
    waiting = LLM(config=config(12, disk_tier_dir=str(tmp_path), disk_tier_gib=0.05, host_tier_gib=0.05,
                                max_seqs=1))
    outs = waiting.generate([OTHERS[0], SECOND], GREEDY)
    assert outs[1].token_ids == recomputed
    assert waiting.engine.scheduler.stats.num_tier_prefetches >= 3
    assert waiting.engine.kv.tiers.stats()[HOST].loaded >= 3

    # Delete every stored block behind the tier's back: the load fails, the request recomputes.
    third = LLM(config=config(12, disk_tier_dir=str(tmp_path), disk_tier_gib=0.05))
    for f in tmp_path.rglob("*.kv"):
        f.unlink()
    assert third.generate([SECOND], GREEDY)[0].token_ids == recomputed
    assert third.engine.scheduler.stats.num_recomputes >= 1
    third.engine.kv.check_invariants()
    assert third.engine.kv.pool.num_used == 0


def test_write_back_spills_what_host_memory_evicts_to_disk_and_reads_it_back(recomputed, tmp_path):
    # A host tier of 2 blocks (fp32 SmolLM2: ~0.74 MB a block) over a disk: turn one's 3 blocks
    # reach the disk only when the other traffic pushes them out of host memory.
    llm = LLM(config=config(12, host_tier_gib=0.0014, disk_tier_dir=str(tmp_path), disk_tier_gib=0.05))
    assert chat(llm) == recomputed
    stats = llm.engine.kv.tiers.stats()
    assert stats[HOST].saved > stats[DISK].saved > 0 and stats[HOST].dropped >= stats[DISK].saved
    assert stats[DISK].loaded >= 1  # a spilled block came back from its file, bytes intact (same output)
    llm.engine.kv.check_invariants()


@pytest.fixture(scope="module")
def kv_store():
    """`sloserve kv-store` on a free loopback port, as a user starts it."""
    import redis

    from sloserve.cli.kv_store import start_kv_store

    store = start_kv_store(max_memory_gib=0.25)
    assert redis.Redis.from_url(store.url).config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
    yield store.url
    store.stop()


def test_a_second_engine_serves_a_prefix_the_first_put_in_the_shared_store(recomputed, kv_store):
    first = LLM(config=config(12, kv_store_url=kv_store))
    assert chat(first) == recomputed  # its evictions publish turn one's blocks
    assert first.engine.kv.tiers.stats()[STORE].saved > 0
    second = LLM(config=config(12, kv_store_url=kv_store))
    assert second.generate([SECOND], GREEDY)[0].token_ids == recomputed
    assert second.engine.kv.tiers.stats()[STORE].loaded >= 3
    second.engine.kv.check_invariants()


def test_an_unreachable_store_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot reach the KV store"):
        LLM(config=config(12, kv_store_url="redis://127.0.0.1:1/0"))
