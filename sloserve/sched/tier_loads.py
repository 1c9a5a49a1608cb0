"""Load or recompute: how much of a prefix found in a lower KV tier to copy back.

A prefix the device pool lost may still sit in host memory, on disk or in the shared store.
Copying it back costs its bytes over that tier's link; recomputing costs prefill time, which
grows faster than linearly with the context. Which is cheaper depends on the tier (host memory
nearly always wins; a slow disk or a far store may not for short prefixes) and on where the
prefix starts, so it is priced per request: the scheduler loads the leading run of hits (cut at
a tier boundary) that saves the most time, or nothing when no cut saves any.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

from sloserve.kv.tiers import TierHit
from sloserve.sched.costs import StepCostEstimator, TierCostEstimator, prefill_time

# A load is charged this many times its copy time. It runs before its step's compute and holds
# every request in the step back for as long, and its blocks are allocated at once, while the
# recompute it replaces is chunked and shares each step's weight reads with the other requests
# (its estimate, alone on the instance, overstates what it adds). A near-tie therefore goes to
# recompute: in the simulator a local disk about as fast as recompute (Llama-3.1-70B, TP 4)
# lost goodput when ties went to loading (BENCHMARKS.md, KV tiers).
LOAD_STALL_FACTOR = 2.0


def load_seconds(hits: Sequence[TierHit], tier_cost: Optional[TierCostEstimator]) -> float:
    """Copy time of `hits` from their tiers (0 unpriced): one transfer per tier."""
    if tier_cost is None or not hits:
        return 0.0
    return sum(tier_cost.tier_time(tier, n) for tier, n in Counter(h.tier for h in hits).items())


def choose_tier_prefix(hits: Sequence[TierHit], start: int, num_tokens: int, block_size: int,
                       estimator: Optional[StepCostEstimator], tier_cost: Optional[TierCostEstimator],
                       chunk: int) -> int:
    """How many leading `hits` to load for a request with `num_tokens` tokens of which `start`
    are already on the device. Unpriced (no estimator or no tier costs), loading is taken to win."""
    if not hits:
        return 0
    if estimator is None or tier_cost is None:
        return len(hits)
    full = prefill_time(estimator, start, num_tokens - start, chunk)
    best_k, best_gain = 0, 0.0
    for i, hit in enumerate(hits):
        if i + 1 < len(hits) and hits[i + 1].tier == hit.tier:
            continue  # price only where the tier changes, and at the end
        k = i + 1
        skipped = start + k * block_size
        load_s = LOAD_STALL_FACTOR * load_seconds(hits[:k], tier_cost)
        gain = full - prefill_time(estimator, skipped, num_tokens - skipped, chunk) - load_s
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k
