"""The host-memory KV tier of the real engine: where swapped-out requests' KV blocks live.

The KV manager (kv/) decides which device block goes to which host block; this module owns
the host tensor and moves the bytes. The host tensor has the device cache's layout per
block, so a swap is one gather and one scatter of whole blocks per direction across all
layers. On CUDA the pool is pinned, so copies run at PCIe speed.
"""
from __future__ import annotations

import logging
import time

import torch

from sloserve.engine.model import KVCache

logger = logging.getLogger(__name__)


class HostKVPool:
    def __init__(self, kv_cache: KVCache, num_blocks: int):
        L, two, _, heads, dim = kv_cache.data.shape
        self.block_size = kv_cache.block_size
        self.num_blocks = num_blocks
        pin = kv_cache.data.device.type == "cuda"
        # empty, not zeros: pages are committed only as blocks are written (pinned memory is
        # committed at once, as vLLM's swap space is).
        self.data = torch.empty((L, two, num_blocks, self.block_size, heads, dim), dtype=kv_cache.data.dtype,
                                device="cpu", pin_memory=pin)

    @property
    def bytes_per_block(self) -> int:
        return self.data[:, :, 0].numel() * self.data.element_size()

    @staticmethod
    def _blocks(kv_cache: KVCache) -> torch.Tensor:
        L, two, _, heads, dim = kv_cache.data.shape
        return kv_cache.data.view(L, two, kv_cache.num_blocks, kv_cache.block_size, heads, dim)

    def swap_out(self, kv_cache: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: (device block, host block) pairs."""
        if not pairs:
            return
        dev = torch.tensor([d for d, _ in pairs], dtype=torch.long, device=kv_cache.data.device)
        host = torch.tensor([h for _, h in pairs], dtype=torch.long)
        self.data[:, :, host] = self._blocks(kv_cache).index_select(2, dev).to("cpu")

    def swap_in(self, kv_cache: KVCache, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: (host block, device block) pairs."""
        if not pairs:
            return
        host = torch.tensor([h for h, _ in pairs], dtype=torch.long)
        dev = torch.tensor([d for _, d in pairs], dtype=torch.long, device=kv_cache.data.device)
        src = self.data.index_select(2, host)
        if kv_cache.data.device.type == "cuda":
            src = src.pin_memory()
        self._blocks(kv_cache)[:, :, dev] = src.to(kv_cache.data.device, non_blocking=True)


def measure_link_bandwidth(device: torch.device, nbytes: int = 32 * 2**20, repeats: int = 3) -> float:
    """Bytes per second of a device -> host copy of `nbytes` (the best of a few tries): the
    first guess of the swap cost, refined from real swaps while serving."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=device.type == "cuda")
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    bandwidth = nbytes / max(best, 1e-9)
    logger.debug("device -> host copy: %.1f GB/s", bandwidth / 1e9)
    return bandwidth
