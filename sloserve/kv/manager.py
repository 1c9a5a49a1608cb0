"""The KV cache manager: block tables, prefix sharing, copy-on-write, swap to host memory.

It owns which blocks each request holds; it never touches tensors. The executor receives
block ids and copy operations through the StepPlan and moves the actual bytes.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Container, Optional, Sequence

from sloserve.kv.block_pool import Block, BlockPool
from sloserve.kv.hashing import BlockHash, hash_packed_blocks, pack_tokens
from sloserve.kv.host_pool import HostBlockPool
from sloserve.kv.tiers import FlushPlan, KVTiers, TierHit, TierOps
from sloserve.core.types import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CopyOp:
    """Copy one block's KV to another before the step (copy-on-write of a shared tail)."""

    src: int
    dst: int


class AnyOf:
    """A container holding what any of `parts` holds (no copy: each part stays live)."""

    __slots__ = ("parts",)

    def __init__(self, parts: Sequence[Container]) -> None:
        self.parts = parts

    def __contains__(self, key: object) -> bool:
        return any(key in part for part in self.parts)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        num_host_blocks: int = 0,
        tiers: Optional[KVTiers] = None,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self._tables: dict[str, list[Block]] = {}
        self._ids: dict[str, list[int]] = {}  # block ids of each table, kept in step with _tables
        self._hashes: dict[str, list[BlockHash]] = {}  # keys of the request's full blocks so far
        self._num_cached: dict[str, int] = {}  # leading blocks of each table already offered to the cache
        self.stats = PrefixCacheStats()
        # Host tier (swap): blocks each swapped-out request holds there, in table order.
        self.host = HostBlockPool(num_host_blocks)
        self._swapped: dict[str, list[int]] = {}
        # Host blocks read by a swap-in of the step being planned: freed only when the next
        # step is planned, so a swap-out in the same step cannot overwrite them before the read.
        self._host_to_release: list[int] = []
        # Blocks referenced by no request but held for a migration: reserved on a target for KV
        # in transit, or pinned on a source while its bytes are read. block id -> references held.
        self._pinned: dict[int, int] = {}
        # Lower tiers of the prefix cache (host memory, disk, shared store): evicted full
        # blocks are demoted there, and prefixes found there can be loaded back.
        self.tiers = tiers if tiers is not None else KVTiers()
        if self.tiers.enabled and enable_prefix_caching:
            self.pool.on_evict = self.tiers.demote

    # ---- queries -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """Share of blocks referenced by requests (cached-but-free blocks count as free)."""
        return self.pool.num_used / self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids. The list is live (no copy per step): it is valid until the
        next allocation or free for this request, i.e. for the step it was planned for."""
        return self._ids.get(request_id, [])

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._tables.get(request_id, ()))

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def request_hashes(self, request: Request) -> list[BlockHash]:
        """Keys of every full block of the request's tokens, computed incrementally."""
        hashes = self._hashes.setdefault(request.request_id, [])
        n_full = request.num_tokens // self.block_size
        done = len(hashes)
        if done < n_full:
            start, end, p = done * self.block_size, n_full * self.block_size, request.num_prompt_tokens
            packed = pack_tokens(request.prompt_token_ids, start, min(end, p)) if start < p else b""
            if end > p:
                packed += pack_tokens(request.output_token_ids, max(0, start - p), end - p)
            hashes.extend(hash_packed_blocks(packed, self.block_size, request.cache_salt, hashes[-1] if hashes else None))
        return hashes

    # ---- allocation ----------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest cached prefix of a request that holds no blocks yet.

        At least one token is always left to compute: the step that computes it also
        produces the logits to sample from.
        """
        if not self.enable_prefix_caching or request.request_id in self._tables:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for block_hash in self.request_hashes(request)[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def find_in_tiers(self, request: Request, num_device_blocks: int) -> list[TierHit]:
        """The blocks of the request's prefix after its `num_device_blocks` device hits that a
        lower tier holds (leading run; one token is always left to compute)."""
        if not (self.tiers.enabled and self.enable_prefix_caching) or request.request_id in self._tables:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        if num_device_blocks >= max_blocks:
            return []
        return self.tiers.find(self.request_hashes(request)[num_device_blocks:max_blocks])

    def load_from_tiers(self, request: Request, first_block: int, hits: Sequence[TierHit]) -> None:
        """Plan the copy of `hits` into the request's blocks from `first_block` on (just
        allocated for them), and cache them as if computed (`num_computed_tokens` counts them)."""
        ids = self._ids[request.request_id][first_block:first_block + len(hits)]
        self.tiers.load(hits, ids)
        self.cache_blocks(request)

    def forget_blocks(self, block_ids) -> None:
        """The bytes of these device blocks are not what their keys say (a tier load failed):
        stop serving them as cached prefixes, here and from the tier they came from."""
        for block_id in block_ids:
            block = self.pool.blocks[block_id]
            if block.block_hash is not None:
                self.tiers.lost(block.block_hash)
                self.pool.uncache(block)

    def plan_flush(self, order: str) -> FlushPlan:
        """A clean stop: what the disk tier lacks of the device's cached blocks and host memory's,
        ranked by `order` (tiers.FLUSH_ORDERS), for the engine to write within its time budget
        (the prefix cache outlives the process)."""
        pool = self.pool
        free = [pool.blocks[i] for i in pool.free_queue]  # least recently freed first
        held = [b for b in pool.blocks if b.ref_count > 0]  # in use: the newest
        return self.tiers.plan_flush(((b.block_id, b.block_hash) for b in free + held if b.block_hash is not None),
                                     order)

    def held_keys(self) -> Container[BlockHash]:
        """Every block key this instance serves without recomputing: the device's cached blocks
        and its local tiers' (what prefix-aware routers match a prompt against)."""
        local = self.tiers.local()
        return AnyOf((self.pool.cached, *local)) if local else self.pool.cached

    def newest_held_keys(self, max_keys: int) -> list[BlockHash]:
        """Up to `max_keys` held keys, the device's newest first, then each lower tier's."""
        if not self.enable_prefix_caching or max_keys <= 0:
            return []
        keys = list(self.pool.cached)[-max_keys:]
        for tier in self.tiers.local():
            if len(keys) >= max_keys:
                break
            keys.extend(tier.keys()[-(max_keys - len(keys)):])
        return keys

    def prefetch_from_tiers(self, request: Request) -> int:
        """Stage a waiting request's prefix blocks that sit on disk or in the store into the host
        tier ahead of its admission (HiCache's prefetch). Returns the blocks planned."""
        if self.tiers.host is None or not (self.tiers.disk is not None or self.tiers.store is not None):
            return 0
        device_blocks, _ = self.get_computed_blocks(request)
        return self.tiers.prefetch(self.find_in_tiers(request, len(device_blocks)))

    def take_tier_ops(self) -> TierOps:
        """Tier moves planned since the last step: the executor runs them before this one."""
        return self.tiers.take_ops()

    def record_prefix_lookup(self, num_queried: int, num_hit: int) -> None:
        self.stats.queries += num_queried
        self.stats.hits += num_hit

    def can_allocate(self, num_new_blocks: int, use_watermark: bool) -> bool:
        reserve = self.watermark_blocks if use_watermark else 0
        return self.pool.num_free - num_new_blocks >= reserve

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[Block] = (),
        use_watermark: bool = False,
    ) -> Optional[list[CopyOp]]:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        Returns the copy-on-write operations to run first, or None (changing nothing)
        when the pool cannot supply the blocks.
        """
        table = self._tables.get(request.request_id)
        if table is None:
            table = []
        elif not computed_blocks and num_new_tokens > 0:
            # Fast path of every decode step: the new tokens fit in blocks it already owns,
            # and the block written first is not a shared, partly filled one.
            start, bs = request.num_computed_tokens, self.block_size
            if start + num_new_tokens <= len(table) * bs and (
                    start % bs == 0 or start // bs != len(table) - 1 or table[-1].ref_count <= 1):
                return []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed_total = self.blocks_needed(num_computed + num_new_tokens)
        have = len(table) + len(computed_blocks)
        # Cached hits that sit free in the pool stop being free once referenced.
        free_hits = sum(1 for b in computed_blocks if b.ref_count == 0)
        cow = self._needs_copy_on_write(table, num_computed, num_new_tokens)
        num_new_blocks = max(0, needed_total - have) + (1 if cow else 0)
        if not self.can_allocate(num_new_blocks + free_hits, use_watermark):
            return None

        ids = self._ids.setdefault(request.request_id, [])
        if computed_blocks and self.tiers.disk is not None:
            self.tiers.reused(b.block_hash for b in computed_blocks)  # (ranks the shutdown flush)
        self.pool.touch(computed_blocks)
        table.extend(computed_blocks)
        ids.extend(b.block_id for b in computed_blocks)
        self._tables[request.request_id] = table
        ops: list[CopyOp] = []
        if cow:
            old = table[-1]
            (new,) = self.pool.allocate(1)
            ops.append(CopyOp(old.block_id, new.block_id))
            self.pool.free([old])
            table[-1], ids[-1] = new, new.block_id
            num_new_blocks -= 1
        new_blocks = self.pool.allocate(num_new_blocks)
        table.extend(new_blocks)
        ids.extend(b.block_id for b in new_blocks)
        return ops

    def _needs_copy_on_write(self, table: list[Block], num_computed: int, num_new_tokens: int) -> bool:
        """A shared, partly filled last block must be copied before this request writes into it."""
        if not table or num_new_tokens <= 0 or num_computed % self.block_size == 0:
            return False
        last_index = num_computed // self.block_size
        return last_index == len(table) - 1 and table[-1].ref_count > 1

    def cache_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        if not table:
            return
        n_full = min(request.num_computed_tokens // self.block_size, len(table))
        done = self._num_cached.get(request.request_id, 0)
        if n_full <= done:
            return
        hashes = self.request_hashes(request)
        for i in range(done, n_full):
            if table[i].block_hash is None:
                self.pool.cache(table[i], hashes[i])
        self._num_cached[request.request_id] = n_full

    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share all of `parent`'s blocks (parallel sampling of one prompt)."""
        table = self._tables.get(parent.request_id, [])
        self.pool.touch(table)
        self._tables[child.request_id] = list(table)
        self._ids[child.request_id] = [b.block_id for b in table]
        self._num_cached[child.request_id] = self._num_cached.get(parent.request_id, 0)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, request: Request) -> None:
        """Release every block the request holds; full ones stay cached for reuse."""
        table = self._tables.pop(request.request_id, None)
        self._ids.pop(request.request_id, None)
        self._hashes.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        if table:
            self.pool.free(reversed(table))
        host_ids = self._swapped.pop(request.request_id, None)
        if host_ids:
            self.host.free(host_ids)

    # ---- migration: blocks held outside any request ------------------------------------
    @property
    def num_pinned_blocks(self) -> int:
        return sum(self._pinned.values())

    def reserve(self, n: int, use_watermark: bool = True) -> Optional[list[int]]:
        """Take `n` free blocks for KV arriving from another instance; None (changing nothing)
        when they do not fit. They stay held until `adopt` gives them to a request or `unpin`."""
        if n < 0 or not self.can_allocate(n, use_watermark):
            return None
        blocks = self.pool.allocate(n, demote=False)  # written by the transfer, before any step
        for b in blocks:
            self._pinned[b.block_id] = self._pinned.get(b.block_id, 0) + 1
        return [b.block_id for b in blocks]

    def pin_cached(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Hold the cached blocks of the leading `hashes` this instance has (a migration's
        target already holds that prefix: those blocks need not be sent). Returns their ids."""
        found: list[Block] = []
        if self.enable_prefix_caching:
            for h in hashes:
                block = self.pool.lookup(h)
                if block is None:
                    break
                found.append(block)
        return self._pin(found)

    def pin_request(self, request_id: str, end: int, start: int = 0) -> list[int]:
        """Hold blocks [start, end) of a request while their bytes are read elsewhere, so
        they survive the request finishing meanwhile. Returns their ids."""
        return self._pin(self._tables.get(request_id, [])[start:end])

    def _pin(self, blocks: Sequence[Block]) -> list[int]:
        self.pool.touch(blocks)
        for b in blocks:
            self._pinned[b.block_id] = self._pinned.get(b.block_id, 0) + 1
        return [b.block_id for b in blocks]

    def unpin(self, block_ids: Sequence[int]) -> None:
        """Drop holds taken by reserve/pin_cached/pin_request (tail-first, like `free`)."""
        for block_id in reversed(block_ids):
            held = self._pinned.get(block_id, 0)
            if held <= 0:
                raise RuntimeError(f"block {block_id} is not pinned")
            if held == 1:
                del self._pinned[block_id]
            else:
                self._pinned[block_id] = held - 1
            self.pool.free([self.pool.blocks[block_id]])

    def adopt(self, request: Request, block_ids: Sequence[int]) -> None:
        """Give held blocks (in table order) to a request that holds none: its KV arrived in
        them. The holds become the request's references; its full computed blocks enter the
        prefix cache as if computed here (`request.num_computed_tokens` must be set)."""
        rid = request.request_id
        if rid in self._tables or rid in self._swapped:
            raise ValueError(f"{rid} already holds blocks")
        if len(block_ids) < self.blocks_needed(request.num_computed_tokens):
            raise ValueError(f"{len(block_ids)} blocks cannot hold {request.num_computed_tokens} tokens")
        for block_id in block_ids:
            held = self._pinned.get(block_id, 0)
            if held <= 0:
                raise ValueError(f"block {block_id} was not reserved or pinned")
            if held == 1:
                del self._pinned[block_id]
            else:
                self._pinned[block_id] = held - 1
        table = [self.pool.blocks[i] for i in block_ids]
        self._tables[rid] = table
        self._ids[rid] = list(block_ids)
        self._num_cached[rid] = 0
        self.cache_blocks(request)

    # ---- swap to the host tier --------------------------------------------------------
    @property
    def num_free_host_blocks(self) -> int:
        return self.host.num_free

    def num_swapped_blocks(self, request_id: str) -> int:
        return len(self._swapped.get(request_id, ()))

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    def blocks_to_swap(self, request: Request) -> int:
        """Blocks holding the request's computed KV: what a swap-out copies."""
        return min(self.blocks_needed(request.num_computed_tokens), self.num_blocks_of(request.request_id))

    def swap_out(self, request: Request) -> Optional[list[tuple[int, int]]]:
        """Move the request's computed KV to host blocks and free its device blocks.

        Returns (device block, host block) pairs to copy before the next step writes anything,
        or None (changing nothing) when the host tier has no room. Freed full blocks stay in
        the device prefix cache like any freed block.
        """
        rid = request.request_id
        n = self.blocks_to_swap(request)
        if n == 0 or n > self.host.num_free or rid in self._swapped:
            return None
        device_ids = self._ids[rid][:n]
        host_ids = self.host.allocate(n)
        self.free(request)
        self._swapped[rid] = host_ids
        return list(zip(device_ids, host_ids))

    def swap_in(self, request: Request, num_new_tokens: int,
                use_watermark: bool = False) -> Optional[list[tuple[int, int]]]:
        """Give a swapped-out request fresh device blocks for its KV plus room for
        `num_new_tokens` more. Returns (host block, device block) pairs to copy before the step,
        or None (changing nothing) when the device pool cannot supply the blocks."""
        rid = request.request_id
        host_ids = self._swapped[rid]
        total = self.blocks_needed(request.num_computed_tokens + num_new_tokens)
        if not self.can_allocate(total, use_watermark):
            return None
        blocks = self.pool.allocate(len(host_ids))
        self._tables[rid] = blocks
        self._ids[rid] = [b.block_id for b in blocks]
        ops = self.allocate_slots(request, num_new_tokens)
        assert ops == [], "fresh blocks need no copy-on-write"
        del self._swapped[rid]
        self._host_to_release.extend(host_ids)
        return list(zip(host_ids, self._ids[rid]))

    def release_host_blocks(self) -> None:
        """The step that read the last swap-ins has run: their host blocks are free again."""
        if self._host_to_release:
            self.host.free(self._host_to_release)
            self._host_to_release = []

    def reset_prefix_cache(self) -> None:
        """Forget cached prefixes in every local tier (the weights changed). The shared store
        is keyed by model, so it needs no reset."""
        self.pool.reset_cache()
        self.tiers.clear()

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        self.tiers.check_invariants()
        refs = [0] * self.pool.num_blocks
        for rid, table in self._tables.items():
            assert self._ids[rid] == [b.block_id for b in table], rid
            for block in table:
                refs[block.block_id] += 1
        for block_id, held in self._pinned.items():
            assert held > 0, block_id
            refs[block_id] += held
        for block in self.pool.blocks:
            assert block.ref_count == refs[block.block_id], f"{block} held by {refs[block.block_id]} tables"
        held = [b for ids in self._swapped.values() for b in ids] + self._host_to_release
        assert len(held) == len(set(held)), "a host block is held twice"
        assert not set(held) & self.host.free_ids(), "a held host block is also free"
        assert len(held) + self.host.num_free == self.host.num_blocks, "host blocks leaked"
        assert not set(self._swapped) & set(self._tables), "a swapped request holds device blocks"
