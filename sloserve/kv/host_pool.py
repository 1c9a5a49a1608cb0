"""The host-memory tier: a fixed pool of KV blocks a preempted request's KV is swapped to.

Pure bookkeeping, like the device BlockPool: the executor owns the bytes and copies them
when the StepPlan says so. Host blocks are never shared or cached (a swapped request owns
its copy), so a free list is all it needs.
"""
from __future__ import annotations

from collections import deque


class HostBlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} host blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    def free_ids(self) -> set[int]:
        return set(self._free)
