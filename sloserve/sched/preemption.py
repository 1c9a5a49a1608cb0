"""Recompute or swap: how a preempted request gives back its device blocks.

Recompute frees the blocks and later re-runs the prefill of everything computed so far;
swap copies the KV to host memory and later back. Which is cheaper depends on the request
(a long context costs a long prefill but also many bytes) and on the machine (a fast host
link favours swap; a fast GPU with slow PCIe favours recompute), so in `auto` mode it is
priced per victim: 2 x the one-way copy time against the least recompute time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sloserve.sched.costs import StepCostEstimator, SwapCostEstimator, prefill_time

MODES = ("recompute", "swap", "auto")
RECOMPUTE, SWAP = "recompute", "swap"


@dataclass(frozen=True)
class PreemptionChoice:
    how: str  # "recompute" or "swap"
    swap_s: Optional[float] = None  # copy out + copy back (None: not priced)
    recompute_s: Optional[float] = None  # least time to recompute the computed tokens


def choose_preemption(mode: str, num_computed_tokens: int, num_blocks: int, host_free_blocks: int,
                      estimator: Optional[StepCostEstimator], swap_cost: Optional[SwapCostEstimator],
                      chunk: int) -> PreemptionChoice:
    """How to preempt a victim holding `num_blocks` blocks of `num_computed_tokens` computed tokens.

    Swap is possible only with room in the host tier and something computed to keep. `swap`
    mode swaps whenever possible; `auto` swaps only when copying out and back is priced cheaper
    than recomputing, and recomputes when either side cannot be priced.
    """
    if mode not in MODES:
        raise ValueError(f"preemption mode must be one of {MODES}, got {mode!r}")
    if mode == RECOMPUTE or num_computed_tokens <= 0 or num_blocks <= 0 or num_blocks > host_free_blocks:
        return PreemptionChoice(RECOMPUTE)
    if mode == SWAP:
        return PreemptionChoice(SWAP)
    if swap_cost is None or estimator is None:
        return PreemptionChoice(RECOMPUTE)
    swap_s = 2.0 * swap_cost.swap_time(num_blocks)
    recompute_s = prefill_time(estimator, 0, num_computed_tokens, chunk)
    return PreemptionChoice(SWAP if swap_s < recompute_s else RECOMPUTE, swap_s, recompute_s)
