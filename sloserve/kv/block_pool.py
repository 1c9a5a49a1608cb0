"""A fixed pool of KV blocks with reference counts and a content-addressed cache.

A block is in exactly one of two states:
- referenced (ref_count > 0): part of at least one running request's block table;
- free (ref_count == 0): in `free_queue`, oldest-freed first. A free block that still holds
  a full, hashed block stays findable in `cached` until it is reused (LRU eviction), so a
  prefix survives its request and serves the next one.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from sloserve.kv.hashing import BlockHash


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: Optional[BlockHash] = None  # set once the block is full and cached

    def __repr__(self) -> str:  # compact in test failure output
        return f"Block({self.block_id}, ref={self.ref_count}, hash={'-' if self.block_hash is None else hex(self.block_hash)[:8]})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Ordered by time of freeing: popping from the front evicts the least recently used.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.num_evictions = 0
        # Told of each cached block `allocate` is about to reuse, while its bytes are still
        # intact: the lower KV tiers demote it there.
        self.on_evict: Optional[Callable[[int, BlockHash], None]] = None

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def lookup(self, block_hash: BlockHash) -> Optional[Block]:
        block_id = self.cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def allocate(self, n: int, demote: bool = True) -> list[Block]:
        """Take n free blocks, evicting the least recently freed cached ones first. `demote=False`
        when the blocks are written before the next step runs (KV arriving by migration), so an
        evicted block's bytes could not be saved to a lower tier in time."""
        free_queue = self.free_queue
        if n > len(free_queue):
            raise MemoryError(f"asked for {n} KV blocks, {len(free_queue)} free")
        blocks, out = self.blocks, []
        on_evict = self.on_evict if demote else None
        for _ in range(n):
            block = blocks[free_queue.popitem(last=False)[0]]
            if block.block_hash is not None:
                if on_evict is not None:
                    on_evict(block.block_id, block.block_hash)
                self._uncache(block)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on blocks found in the cache (a prefix hit)."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each. Pass blocks tail-first: the tail of a prefix is the
        least likely to be shared, so it should be evicted before the head."""
        free_queue, caching = self.free_queue, self.enable_caching
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_count -= 1
            if block.ref_count == 0:
                if not caching:
                    self._uncache(block)
                free_queue[block.block_id] = None

    def cache(self, block: Block, block_hash: BlockHash) -> None:
        """Register a full block under its content key. If an equal block is already
        cached (two requests computed the same prefix at once), keep the first."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block.block_id

    def evict_cached(self, n: int) -> int:
        """Forget up to n free cached blocks (LRU first); they stay free. Returns how many."""
        dropped = 0
        for block_id in list(self.free_queue):
            if dropped >= n:
                break
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._uncache(block)
                dropped += 1
        return dropped

    def reset_cache(self) -> None:
        """Forget every free cached block (e.g. after weights change)."""
        self.evict_cached(self.num_blocks)

    def uncache(self, block: Block) -> None:
        """Stop finding `block` by its key (its bytes are wrong); any references stay."""
        self._uncache(block)

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool is inconsistent (used by tests)."""
        for block in self.blocks:
            assert block.ref_count >= 0, block
            in_free = block.block_id in self.free_queue
            assert in_free == (block.ref_count == 0), f"{block} free={in_free}"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) == block.block_id, block
        for block_hash, block_id in self.cached.items():
            assert self.blocks[block_id].block_hash == block_hash
