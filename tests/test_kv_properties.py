"""Property-based tests of the KV cache manager under random request lifecycles.

A shadow "device" records which token each slot of each block holds, written exactly as
an executor would (copy-on-write copies first, then the new tokens). Reading a request's
block table back must always give its tokens; a cached block's content must never change.
"""
from __future__ import annotations

import itertools

from hypothesis import given, settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from kv_helpers import assert_cached_blocks_unchanged, assert_tables_read_back
from sloserve.kv.hashing import hash_block, hash_full_blocks
from sloserve.kv.manager import KVCacheManager
from sloserve.core.types import Request, SamplingParams

BS = 4
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 50, 51, 52, 53], [7] * 12]


class KVMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    @initialize(num_blocks=st.integers(4, 40), caching=st.booleans())
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching, watermark=0.0)
        self.content: dict[int, list] = {b: [None] * BS for b in range(num_blocks)}
        self.hashed_content: dict[int, tuple] = {}  # block_hash -> content when first cached
        self.live: dict[str, Request] = {}
        self.ids = itertools.count()

    # -- an executor's view: apply copies, then write the new tokens --------------------
    def _compute(self, req: Request, n: int, copies) -> None:
        for op in copies:
            self.content[op.dst] = list(self.content[op.src])
        table = self.kv.block_table(req.request_id)
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            self.content[table[pos // BS]][pos % BS] = req.all_token_ids[pos]
        req.num_computed_tokens += n
        self.kv.cache_blocks(req)
        for block in self.kv.pool.blocks:
            if block.block_hash is not None:
                self.hashed_content.setdefault(block.block_hash, tuple(self.content[block.block_id]))

    @rule(target=requests, prefix=st.sampled_from(PREFIXES), extra=st.lists(st.integers(100, 110), max_size=9))
    def new_request(self, prefix, extra):
        req = Request(f"r{next(self.ids)}", list(prefix) + list(extra), SamplingParams(max_tokens=100))
        hits, num_cached = self.kv.get_computed_blocks(req)
        assert num_cached < req.num_tokens
        copies = self.kv.allocate_slots(req, req.num_tokens - num_cached, hits)
        if copies is None:
            assert self.kv.num_blocks_of(req.request_id) == 0  # a failed allocation changes nothing
            self.kv.free(req)
            return None
        req.num_computed_tokens = num_cached
        self._compute(req, req.num_tokens - num_cached, copies)
        self.live[req.request_id] = req
        return req.request_id

    @rule(rid=requests, tokens=st.lists(st.integers(100, 110), min_size=1, max_size=6))
    def append(self, rid, tokens):
        req = self.live.get(rid) if rid else None
        if req is None:
            return
        req.output_token_ids.extend(tokens)
        copies = self.kv.allocate_slots(req, len(tokens))
        if copies is None:
            req.output_token_ids[-len(tokens):] = []
            return
        self._compute(req, len(tokens), copies)

    @rule(target=requests, rid=requests)
    def fork(self, rid):
        parent = self.live.get(rid) if rid else None
        if parent is None:
            return None
        child = Request(f"r{next(self.ids)}", list(parent.prompt_token_ids), SamplingParams(max_tokens=100))
        child.output_token_ids = list(parent.output_token_ids)
        self.kv.fork(parent, child)
        self.live[child.request_id] = child
        return child.request_id

    @rule(rid=consumes(requests))
    def free(self, rid):
        req = self.live.pop(rid, None) if rid else None
        if req is not None:
            self.kv.free(req)

    @rule(n=st.integers(1, 8))
    def evict(self, n):
        free_before = self.kv.num_free_blocks
        self.kv.pool.evict_cached(n)
        assert self.kv.num_free_blocks == free_before  # eviction forgets content, frees nothing

    @rule()
    def free_everything(self):
        for req in self.live.values():
            self.kv.free(req)
        self.live.clear()
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert all(b.ref_count == 0 for b in self.kv.pool.blocks)

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def pool_consistent(self):
        if hasattr(self, "kv"):
            self.kv.check_invariants()  # ref counts >= 0, free <=> unreferenced, tables match refs

    @invariant()
    def tables_read_back_tokens(self):
        if hasattr(self, "kv"):
            assert_tables_read_back(self.kv, self.live.values(), self.content, BS)

    @invariant()
    def cached_blocks_never_change(self):
        if hasattr(self, "kv"):
            assert_cached_blocks_unchanged(self.kv, self.content, self.hashed_content)


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(tokens=st.lists(st.integers(0, (1 << 62) - 1), max_size=40), block_size=st.integers(1, 8),
       salt=st.sampled_from(["", "tenant-a"]), split=st.integers(0, 5))
def test_bulk_block_keys_equal_chained_keys(tokens: list[int], block_size: int, salt: str, split: int) -> None:
    """hash_full_blocks packs the tokens once; its keys must be exactly hash_block's chain, also
    when resumed from a parent (the KV manager hashes a request's new blocks as they fill)."""
    chained, parent = [], None
    for b in range(len(tokens) // block_size):
        parent = hash_block(parent, tokens[b * block_size:(b + 1) * block_size], salt)
        chained.append(parent)
    assert hash_full_blocks(tokens, block_size, salt) == chained
    head = hash_full_blocks(tokens[:split * block_size], block_size, salt)
    rest = hash_full_blocks(tokens[split * block_size:], block_size, salt, head[-1] if head else None)
    assert head + rest == chained
    assert len(set(chained)) == len(chained)  # chaining makes every prefix's key distinct
