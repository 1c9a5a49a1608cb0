"""Live migration between two real engines in one process (the embedded model): the request
keeps decoding while its full blocks are copied (pre-copy), is suspended for the last
blocks, and the target adopts it. Its tokens and text must be exactly those it produces
without moving, at any point of its decode, twice in a row, greedy or seeded; the blocks the
target already caches are not copied; a refused or failed move leaves both pools as they
were; a failover (no KV) resumes identically by recomputing."""
from __future__ import annotations

import pytest

from engine_helpers import EXACT
from sloserve.core.config import EngineConfig
from sloserve.engine.llm_engine import LLMEngine
from sloserve.engine.migration import ResumeState, read_blocks, write_blocks
from sloserve.engine.outputs import CompletedOutput, OutputAccumulator
from sloserve.core.types import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=48, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module")
def engines() -> tuple[LLMEngine, LLMEngine]:
    """Two engines at the default precision (what users run)."""
    return LLMEngine(EngineConfig()), LLMEngine(EngineConfig())


@pytest.fixture(scope="module")
def exact_engines() -> tuple[LLMEngine, LLMEngine]:
    """Two float32 engines, for the paths that recompute or reuse cached blocks: a prefill's numbers
    do not depend on how many rows it computes (at the default precision a prompt's tail computed
    after a prefix-cache hit may round differently from the whole prompt computed at once,
    migration or not)."""
    return LLMEngine(EngineConfig(**EXACT)), LLMEngine(EngineConfig(**EXACT))


def _step(engine: LLMEngine, fold: OutputAccumulator) -> None:
    for out in engine.step():
        fold.add(out)


def _run(engine: LLMEngine, fold: OutputAccumulator) -> CompletedOutput:
    while engine.has_unfinished_requests():
        _step(engine, fold)
    return fold.completed()


def alone(engine: LLMEngine, params: SamplingParams) -> CompletedOutput:
    engine.add_request(PROMPT, params)
    return _run(engine, OutputAccumulator())


def move(source: LLMEngine, target: LLMEngine, rid: str, params: SamplingParams, fold: OutputAccumulator,
         prompt: str = PROMPT) -> int:
    """Migrate `rid` as the worker does: pre-copy full blocks while it decodes (one step, its
    output into `fold`), then suspend and copy the rest. Returns the blocks sent (the target's
    cached prefix is not)."""
    ids, hashes = source.pin_full_blocks(rid, 0)
    request = source.scheduler.requests[rid]
    have, held = target.reserve_for_migration(hashes, request.num_tokens)
    have = min(have, len(ids))
    write_blocks(target.kv_cache, held[have:len(ids)], read_blocks(source.kv_cache, ids[have:]))
    source.kv.unpin(ids)
    sent = len(ids)
    _step(source, fold)  # it keeps decoding during the copy
    state, pinned = source.suspend(rid)
    if len(held) < len(pinned):
        held += target.kv.reserve(len(pinned) - len(held))
    write_blocks(target.kv_cache, held[sent:len(pinned)], read_blocks(source.kv_cache, pinned[sent:]))
    state.block_ids = held
    target.add(target.make_request(prompt, params, request_id=rid), state)
    assert source.drop_migrated(rid, pinned)
    return len(pinned) - have


def assert_free(*engines: LLMEngine) -> None:
    for e in engines:
        e.kv.check_invariants()
        assert e.kv.pool.num_used == 0 and e.kv.num_pinned_blocks == 0
        assert not e.scheduler.requests and not e.scheduler.suspended


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_migrated_request_continues_exactly(engines, params):
    a, b = engines
    expected = alone(a, params)
    for at in (1, 17, 40):  # right after the prompt, mid-block, near the end
        fold = OutputAccumulator()
        a.add_request(PROMPT, params, request_id="m")
        for _ in range(at):
            _step(a, fold)
        move(a, b, "m", params, fold)
        got = _run(b, fold)
        assert got.token_ids == expected.token_ids, at
        assert got.text == expected.text, at
        assert_free(a, b)


def test_twice_in_a_row_and_the_cached_prefix_is_not_sent(exact_engines):
    a, b = exact_engines
    expected = alone(a, GREEDY)  # also leaves the prompt's blocks in a's prefix cache
    fold = OutputAccumulator()
    a.add_request(PROMPT, GREEDY, request_id="twice")
    for _ in range(10):
        _step(a, fold)
    move(a, b, "twice", GREEDY, fold)
    for _ in range(12):
        _step(b, fold)
    total = b.kv.blocks_needed(b.scheduler.requests["twice"].num_computed_tokens)
    sent = move(b, a, "twice", GREEDY, fold)  # back to a, which still caches the prompt's blocks
    assert sent < total
    assert _run(a, fold).token_ids == expected.token_ids
    assert_free(a, b)


def test_a_refused_or_aborted_move_changes_nothing(engines):
    a, b = engines
    expected = alone(a, GREEDY)
    fold = OutputAccumulator()
    a.add_request(PROMPT, GREEDY, request_id="stay")
    for _ in range(20):
        _step(a, fold)
    ids, hashes = a.pin_full_blocks("stay", 0)
    free = b.kv.num_free_blocks
    assert b.reserve_for_migration(hashes, b.kv.num_blocks * b.kv.block_size * 2) is None  # no room: refused
    assert b.kv.num_free_blocks == free and b.kv.num_pinned_blocks == 0
    seats = b.scheduler.config.max_num_seqs  # blocks to spare, but every seat promised to a migration in flight
    assert b.reserve_for_migration(hashes, 16, incoming=seats) is None
    assert b.kv.num_free_blocks == free and b.kv.num_pinned_blocks == 0
    a.kv.unpin(ids)
    state, pinned = a.suspend("stay")  # the stop-and-copy began, then the target failed
    assert a.suspend("stay") is None
    a.unsuspend("stay", pinned)
    assert _run(a, fold).token_ids == expected.token_ids
    assert_free(a, b)


def test_a_failover_recomputes_and_continues_exactly(exact_engines):
    a, b = exact_engines
    expected = alone(a, SEEDED)
    fold = OutputAccumulator()
    a.add_request(PROMPT, SEEDED, request_id="fo")
    for _ in range(25):
        _step(a, fold)
    sent = fold.completed()
    a.abort_request("fo")  # the instance "dies": nothing but what the client received survives
    state = ResumeState(list(sent.token_ids), len(sent.text), age_s=1.0, first_token_age_s=0.5)
    b.add(b.make_request(PROMPT, SEEDED, request_id="fo"), state)
    rest = _run(b, OutputAccumulator())
    assert sent.token_ids + rest.token_ids == expected.token_ids
    assert sent.text + rest.text == expected.text
    assert_free(a, b)


def test_a_refused_move_says_why_the_request_cannot_move(engines):
    """What a worker's 409 names (worker_migration: the error's code): a request still prefilling
    or queued is `not_running`, one that finished or moved away is told apart from one never
    here, so a hand-off that comes too late is not mistaken for a bug."""
    a, b = engines
    assert a.why_not_movable("never-here")[0] == "unknown_request"
    fold = OutputAccumulator()
    a.add_request(PROMPT, GREEDY, request_id="soon")
    assert a.why_not_movable("soon") == ("not_running", "is waiting here")
    _run(a, fold)
    assert a.pin_full_blocks("soon", 0) is None and a.suspend("soon") is None
    assert a.why_not_movable("soon") == ("finished", "finished here before it could move")
    a.add_request(PROMPT, GREEDY, request_id="leaves")
    for _ in range(10):
        _step(a, fold)
    move(a, b, "leaves", GREEDY, fold)
    assert a.why_not_movable("leaves") == ("not_running", "has moved away from here")
    _run(b, fold)
    assert_free(a, b)
