"""The fleet's shared KV store in simulation: one LRU set of block keys every simulated instance
reads and writes (Mooncake Store's role), with a capacity in blocks. It answers the KV manager
as the real store's client does (kv/tiers.py SharedIndex); its link's speed prices the copies
(CostModel.tier_s_per_block)."""
from __future__ import annotations

from typing import Iterable, Sequence

from sloserve.kv.hashing import BlockHash
from sloserve.kv.tiers import STORE, LocalTier


class SimKVStore:
    def __init__(self, capacity_blocks: int) -> None:
        self.keys = LocalTier(STORE, capacity_blocks)

    def leading(self, keys: Sequence[BlockHash]) -> int:
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            self.keys.touch(key)
            n += 1
        return n

    def saved(self, keys: Iterable[BlockHash]) -> None:
        for key in keys:
            self.keys.admit(key, set())

    def forget(self, keys: Iterable[BlockHash]) -> None:
        for key in keys:
            self.keys.discard(key)

    def __len__(self) -> int:
        return len(self.keys)
