"""A clean stop flushes the write-back tiers to disk (issue 42, item 2).

With a host-memory tier over a disk tier, the disk only gets what host memory evicts: at a stop,
the blocks that only host memory (and the device pool) hold would be lost. The stop writes them to
the disk, best first (kv/tiers.py plan_flush: most prefix hits first, or most recently used first),
within a time budget (what the drain leaves of the grace period), and logs one line of what it
wrote and what it dropped and why.

Here: the ranking and the disk bound without a model; the engine's flush with a budget of zero
(nothing written, everything reported dropped, nothing leaked), in full, on a full disk and on a
failing disk; and a real `sloserve serve` with host + disk tiers stopped by SIGTERM and restarted
on the disk tier alone, whose replayed first turns come from the cache."""
from __future__ import annotations

import errno
import re
import signal

import pytest

from engine_helpers import EXACT
from server_helpers import ServerProcess
from sloserve.core.config import CacheConfig, EngineConfig, SchedulerConfig
from sloserve.kv.manager import KVCacheManager
from sloserve.kv.tiers import DISK, KVTiers, TierOp
from sloserve.core.types import Request, SamplingParams

BS = 4


# ---- the ranking and the bound (kv/, no model) ----------------------------------------------
def serve(kv: KVCacheManager, rid: str, tokens: list[int]) -> int:
    """One request through the KV manager: prefix hits, allocation, its blocks cached, freed.
    Returns the prompt tokens found cached."""
    req = Request(rid, list(tokens))
    hits, cached = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, len(tokens) - cached, hits) is not None
    req.num_computed_tokens = len(tokens)
    kv.cache_blocks(req)
    kv.free(req)
    return cached


def keys(plan) -> list[int]:
    return [op.key for op in plan.ops]


def test_newest_first_takes_host_memory_after_the_device_and_skips_what_the_disk_has():
    tiers = KVTiers(host_blocks=4, disk_blocks=10)
    tiers.demote(0, 100)
    tiers.demote(1, 101)
    tiers.demote(2, 102)
    tiers.take_ops()
    slots = {k: tiers.host.slot_of(k) for k in (100, 101, 102)}
    tiers.flushed([TierOp(DISK, 100, -1, slots[100])], set())  # already on disk
    # the device caches 200 and 201 (least recently freed first) and a copy of host memory's 102
    plan = tiers.plan_flush([(5, 200), (6, 102), (7, 201)], "newest")
    assert [(op.key, op.block, op.slot) for op in plan.ops] == [
        (201, 7, -1), (102, 6, -1), (200, 5, -1), (101, -1, slots[101])]
    assert plan.disk_full == 0 and plan.off == 0
    off = tiers.plan_flush([(5, 200), (6, 102), (7, 201)], "off")
    assert off.ops == [] and off.off == 4
    with pytest.raises(ValueError, match="flush order"):
        tiers.plan_flush([], "oldest")


def test_most_reused_first_ranks_by_prefix_hits_newest_first_among_equals():
    tiers = KVTiers(host_blocks=4, disk_blocks=10)
    for block, key in enumerate((100, 101, 102)):
        tiers.demote(block, key)
    tiers.reused([101, 101, 200])
    tiers.reused([100, 201])
    plan = tiers.plan_flush([(5, 200), (6, 201), (7, 202)], "most-reused")
    assert keys(plan) == [101, 201, 200, 100, 202, 102]
    assert keys(tiers.plan_flush([(5, 200), (6, 201), (7, 202)], "newest")) == [202, 201, 200, 102, 101, 100]


def test_reuse_counts_follow_a_block_into_host_memory_and_leave_with_it():
    tiers = KVTiers(host_blocks=2, disk_blocks=10)
    tiers.reused([100, 100, 101])
    tiers.demote(0, 100)  # the device copy goes to host memory: its hits with it
    assert tiers.uses(100) == 2
    tiers.demote(1, 101)
    tiers.demote(2, 102)  # host memory is full: 100 goes on to the disk, its count is dropped
    tiers.take_ops()
    assert 100 in tiers.disk and tiers.uses(100) == 0 and tiers.uses(101) == 1
    tiers.lost(101)
    assert tiers.uses(101) == 0
    # Without a disk tier nothing is counted (nothing is flushed).
    plain = KVTiers(host_blocks=2)
    plain.reused([1, 1])
    assert plain.uses(1) == 0


def test_a_chain_is_ranked_head_first_through_the_manager():
    """Two three-turn chats and a one-turn request through the KV manager (a device pool that
    evicts into host memory): most-reused puts each chat's first turn before its later turns,
    as a replay of the first turns needs."""
    tiers = KVTiers(host_blocks=64, disk_blocks=64)
    kv = KVCacheManager(18, BS, tiers=tiers, watermark=0.0)
    chats = {c: [1000 * c + i for i in range(4 * BS)] for c in (1, 2)}
    first_turn = {c: [] for c in chats}
    for turn in range(3):
        for c in chats:
            if turn == 0:
                first_turn[c] = list(chats[c])
            else:
                chats[c] += [1000 * c + 100 * turn + i for i in range(2 * BS)]
            serve(kv, f"c{c}t{turn}", chats[c])
            tiers.take_ops()
    serve(kv, "other", [7000 + i for i in range(6 * BS)])  # pushes the chats out to host memory
    tiers.take_ops()
    assert len(tiers.host) > 0
    kv.check_invariants()
    plan = kv.plan_flush("most-reused")
    ranked = keys(plan)
    heads = set()
    for c, prompt in first_turn.items():
        hashes = kv.request_hashes(Request(f"h{c}", prompt))
        heads.update(hashes)
        assert all(tiers.uses(h) == 2 for h in hashes)  # read again by turns two and three
    assert set(ranked[:len(heads)]) == heads
    assert len(ranked) == len(set(ranked)) == 2 * (4 + 2 + 2) + 6  # every full block once
    # Newest first writes the last chat's whole history (and the other request) first.
    assert set(keys(kv.plan_flush("newest"))[:len(heads)]) != heads


def test_the_flush_fits_the_disk_evicting_older_blocks_never_its_own():
    tiers = KVTiers(host_blocks=8, disk_blocks=3)
    tiers.flushed([TierOp(DISK, 50, -1)], set())  # on disk from before
    for block, key in enumerate((100, 101, 102, 103)):
        tiers.demote(block, key)
    tiers.take_ops()
    plan = tiers.plan_flush([], "newest")
    assert keys(plan) == [103, 102, 101] and plan.disk_full == 1
    keep = set(keys(plan))
    assert tiers.flushed(plan.ops[:2], keep) == []
    assert tiers.flushed(plan.ops[2:], keep) == [50]  # the older block makes room, never a flushed one
    assert set(tiers.disk.keys()) == keep
    tiers.unflushed([101])
    assert set(tiers.disk.keys()) == {103, 102}
    tiers.check_invariants()


# ---- the engine's flush (embedded model) -----------------------------------------------------
SYSTEM = ("You answer questions about a small public library. Opening hours are nine to five, "
          "closed on Sundays; members borrow up to six books for three weeks. ")
PROMPTS = [SYSTEM + f"Question {i}: can I renew a book for the {n} time, and how?" for i, n in
           enumerate(["first", "second", "third", "fourth", "fifth", "sixth"])]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def tiered_engine(tmp_path, disk_gib: float = 0.05, order: str = "most-reused"):
    from sloserve import LLM

    cache = CacheConfig(num_blocks=12, host_tier_gib=0.02, disk_tier_dir=str(tmp_path), disk_tier_gib=disk_gib,
                        tier_flush_order=order)
    llm = LLM(config=EngineConfig(**EXACT, num_threads=1, cache=cache,
                                  scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4)))
    llm.generate(PROMPTS, GREEDY)
    return llm.engine


def files(tmp_path) -> int:
    return len(list(tmp_path.rglob("*.kv")))


@pytest.mark.slow
def test_engine_flush_with_no_budget_writes_nothing_and_reports_it_all_dropped(tmp_path, caplog):
    engine = tiered_engine(tmp_path)
    before = files(tmp_path)
    assert len(engine.kv.tiers.host) > 0  # a 12-block pool pushed blocks into host memory
    with caplog.at_level("INFO", logger="sloserve.engine.llm_engine"):
        report = engine.flush_tiers(0.0)
    assert report.written == 0 and report.budget_out > 0 and report.dropped == report.budget_out
    assert files(tmp_path) == before == len(engine.kv.tiers.disk)  # nothing written, nothing registered
    line = [r.getMessage() for r in caplog.records if "KV shutdown flush" in r.getMessage()]
    assert len(line) == 1 and "wrote 0 blocks" in line[0] and f"dropped {report.budget_out} " in line[0]
    # Nothing leaked: every device block is free again, the host rows are all accounted for.
    assert engine.kv.pool.num_used == 0 and engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.kv.check_invariants()

    # With time, the same engine writes every one of them; a restart on the disk alone finds them.
    report = engine.flush_tiers(60.0)
    assert report.written == report.from_host + report.from_device and report.dropped == 0
    assert report.from_host > 0 and report.from_device > 0
    assert files(tmp_path) == len(engine.kv.tiers.disk) == before + report.written
    assert engine.kv.pool.num_used == 0
    engine.kv.check_invariants()
    assert engine.flush_tiers(60.0).written == 0  # all on disk now

    from sloserve import LLM

    again = LLM(config=EngineConfig(**EXACT, num_threads=1, cache=CacheConfig(
        num_blocks=12, disk_tier_dir=str(tmp_path), disk_tier_gib=0.05)))
    out = again.generate([PROMPTS[0]], GREEDY)[0]
    assert out.num_cached_tokens == (len(out.prompt_token_ids) - 1) // 16 * 16


@pytest.mark.slow
def test_engine_flush_on_a_small_or_failing_disk_drops_for_a_full_disk(tmp_path):
    per_block = 30 * 2 * 16 * 3 * 64 * 4  # fp32 SmolLM2-135M: layers x K/V x tokens x KV heads x dim
    small = tmp_path / "small"
    engine = tiered_engine(small, disk_gib=4.5 * per_block / 2**30)  # a disk of 4 blocks
    report = engine.flush_tiers(60.0)
    assert report.disk_full > 0 and report.budget_out == 0
    assert files(small) == len(engine.kv.tiers.disk) == 4
    engine.kv.check_invariants()

    failing = tmp_path / "failing"
    engine = tiered_engine(failing)
    before = files(failing)

    def no_space(blocks, keys):
        raise OSError(errno.ENOSPC, "No space left on device")

    engine.tier_movers.disk.save = no_space
    report = engine.flush_tiers(60.0)
    assert report.written == 0 and report.disk_full > 0 and report.dropped == report.disk_full
    assert files(failing) == len(engine.kv.tiers.disk) == before
    assert engine.kv.pool.num_used == 0
    engine.kv.check_invariants()


# ---- the real server: SIGTERM, restart on the disk tier alone --------------------------------
CHAT_FIRSTS = [
    "I am planning a small vegetable garden on a sunny balcony of about four square metres. Which vegetables "
    "grow well in pots, how deep should the pots be, and how often should I water them in a hot summer?",
    "Explain how a bicycle's gears work to someone who has only ever ridden a single-speed bike. When should "
    "I shift to a lower gear, and what happens to the chain when I do it while pedalling hard uphill?",
    "My sourdough bread keeps coming out dense and flat even though the starter bubbles nicely. What are the "
    "most common reasons for this, and what should I change first in my recipe or in the proofing time?",
    "What is the difference between a comet and an asteroid? Please describe where each of them usually comes "
    "from in the solar system and why comets grow a tail when they get closer to the sun than asteroids do.",
]
FOLLOW_UPS = ["Can you say that more briefly?", "Give me one concrete example."]
FLUSH = re.compile(r"KV shutdown flush \((\S+)\): wrote (\d+) blocks .* \((\d+) from host memory, (\d+) from the "
                   r"device\), dropped (\d+) ")
FOUND = re.compile(r"disk KV tier .*: (\d+) blocks found")


def chat_round_robin(server: ServerProcess, turns: int) -> None:
    """Every chat turn by turn, round robin (each turn's history has left the device by then)."""
    from openai import OpenAI

    client = OpenAI(base_url=server.v1, api_key="none", timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    histories: list[list[dict]] = [[] for _ in CHAT_FIRSTS]
    for turn in range(turns):
        for c, first in enumerate(CHAT_FIRSTS):
            messages = histories[c] + [{"role": "user", "content": first if turn == 0 else FOLLOW_UPS[turn - 1]}]
            r = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0.0)
            histories[c] = messages + [{"role": "assistant", "content": r.choices[0].message.content}]


@pytest.mark.slow
def test_sigterm_flushes_host_memory_so_a_disk_only_restart_serves_the_first_turns(tmp_path):
    disk = tmp_path / "kv"
    common = ["--cache-salt-secret", "flush-test", "--kv-disk-dir", str(disk), "--kv-disk-gib", "0.2",
              "--max-num-batched-tokens", "128"]
    # A 12-block device pool (192 tokens) and 43 blocks of host memory (fp32: 0.74 MB a block):
    # four three-turn chats (29 full blocks) leave most of their history in host memory, none on disk.
    first = ServerProcess([*common, "--num-blocks", "12", "--kv-host-gib", "0.03"], tmp_path / "first.log")
    try:
        chat_round_robin(first, turns=3)
        first.signal(signal.SIGTERM)
        assert first.wait(120) == 0
    finally:
        first.kill()
    log = first.log_path.read_text(errors="replace")
    (line,) = FLUSH.findall(log)
    order, written, from_host, _, dropped = line[0], *map(int, line[1:])
    assert order == "most-reused" and written > 0 and from_host > 0 and dropped == 0, log[-3000:]
    assert len(list(disk.rglob("*.kv"))) >= written

    second = ServerProcess([*common, "--num-blocks", "64"], tmp_path / "second.log")
    try:
        from openai import OpenAI

        client = OpenAI(base_url=second.v1, api_key="none", timeout=120, max_retries=0)
        model = client.models.list().data[0].id
        prompt = cached = best = 0
        for first_turn in CHAT_FIRSTS:  # (one at a time: each reads its own blocks from disk)
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": first_turn}],
                                               max_tokens=4, temperature=0.0)
            prompt += r.usage.prompt_tokens
            cached += r.usage.prompt_tokens_details.cached_tokens
            best += (r.usage.prompt_tokens - 1) // 16 * 16  # every full block but the one computed for logits
    finally:
        second.kill()
    assert int(FOUND.search(second.log_path.read_text(errors="replace")).group(1)) >= written
    # Every full block of every first turn was flushed (dropped 0), so the replay finds all of them:
    # the cache can serve no more than `best` (the last, partial block is always computed). Measured
    # on a 2-core EPYC: cached == best == 256 of 292 prompt tokens (87.7%), 29 blocks flushed (18
    # from host memory); with --kv-flush-order off, 48 (16.4%: the shared template block only).
    assert cached >= 0.95 * best and cached >= 0.8 * prompt, (cached, best, prompt)


def test_the_flush_gets_what_the_drain_left_of_the_grace_period_and_its_order_from_the_cli():
    from sloserve.cli import build_parser
    from sloserve.cli.engine_args import engine_config_from_args
    from sloserve.server.launcher import flush_budget

    assert flush_budget(30.0, 100.0, 112.0, forced=False) == 18.0
    assert flush_budget(30.0, 100.0, 140.0, forced=False) == 0.0  # the drain took it all
    assert flush_budget(30.0, None, 5.0, forced=False) == 30.0  # stopped with no drain
    assert flush_budget(30.0, 100.0, 101.0, forced=True) == 0.0  # a second signal: exit now
    for command in ("serve", "generate"):
        args = build_parser().parse_args([command, *(["x"] if command == "generate" else []),
                                          "--kv-flush-order", "newest"])
        assert engine_config_from_args(args).cache.tier_flush_order == "newest"
    assert engine_config_from_args(build_parser().parse_args(["serve"])).cache.tier_flush_order == "most-reused"
    with pytest.raises(ValueError, match="kv-flush-order"):
        CacheConfig(tier_flush_order="oldest").validate()
