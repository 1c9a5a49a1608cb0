"""A cheap snapshot of one instance for the cluster layer (routing, autoscaling)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InstanceState:
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int  # prompt tokens not yet computed, running and waiting
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_total: int
    predicted_remaining_decode_tokens: int
    prefix_cache_hit_rate: float
    min_ttft_slack_s: float  # smallest (deadline - now) among waiting requests; inf when none

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
