"""A cheap snapshot of one instance for the cluster layer (routing, autoscaling).

Everything here is pure Python: the router reads these snapshots on every arrival, in the
simulator a million times per run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Optional, Protocol, Sequence, runtime_checkable


@runtime_checkable
class PrefixIndex(Protocol):
    """What an instance can say about its prefix cache: how many leading blocks of a prompt,
    given as chained block keys (`sloserve.kv.hashing`), it holds.

    Block keys chain over their parents, so a hit on key k means the instance holds that
    whole k-block prefix; the router asks only as deep as it needs (see `match`)."""

    def match(self, keys: Sequence[int]) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class KeySetIndex:
    """A prefix index over any container of block keys.

    In one process (the simulator, or a worker answering for itself) it wraps the KV pool's
    live `cached` dict: no copy, O(1) per key. Across processes a worker ships a frozenset
    of its cached keys (or a subset: the first blocks of each prefix) and the front wraps
    that. Counting stops at the first miss, so the cost is the matched depth plus one."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Container[int]):
        self._keys = keys

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def match(self, keys: Sequence[int]) -> int:
        n = 0
        for key in keys:
            if key not in self._keys:
                break
            n += 1
        return n


class _LoadMeasures:
    """What routers derive from a state's fields; shared by the frozen and the live form."""

    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_waiting: int
    num_running: int
    num_waiting: int
    prefix_index: Optional[PrefixIndex]

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def kv_demand(self) -> float:
        """Share of the pool taken now plus what the waiting queue will take (may exceed 1)."""
        if not self.kv_blocks_total:
            return 0.0
        return (self.kv_blocks_used + self.kv_blocks_waiting) / self.kv_blocks_total

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting

    def prefix_match_blocks(self, keys: Sequence[int]) -> int:
        """Leading blocks of `keys` this instance holds (0 without a published index)."""
        return self.prefix_index.match(keys) if self.prefix_index is not None else 0


@dataclass(frozen=True)
class InstanceState(_LoadMeasures):
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int  # prompt tokens not yet computed, running and waiting
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    predicted_remaining_decode_tokens: int
    prefix_cache_hit_rate: float
    min_ttft_slack_s: float  # smallest (deadline - now) among waiting requests; inf when none
    block_size: int = 16  # tokens per KV block, to turn token counts into blocks
    # Blocks that waiting requests will need once admitted (their prompts, minus nothing: a
    # prefix hit is only known at admission). Lets KV-aware routers see demand queued behind
    # a step in flight, not only blocks already taken.
    kv_blocks_waiting: int = 0
    # The prefix cache as the router may query it; None when prefix caching is off or the
    # instance does not publish it. In-process it is a live view, valid at routing time.
    prefix_index: Optional[PrefixIndex] = None
    # LoRA adapters held in the device's form: a request naming one runs without loading it (a
    # real worker publishes them; the simulator's requests name none).
    adapters: frozenset[str] = frozenset()
