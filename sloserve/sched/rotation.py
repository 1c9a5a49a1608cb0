"""Which running request gives its KV back under memory pressure: by rank, or by SLO slack.

`rank` (vLLM's rule) preempts the lowest-ranked running request: the newest
under FCFS, the least urgent under the deadline policies. `slack` (the default) preempts the request that
can best afford the pause (SuperInfer's rotary scheduling, by "virtual lag time"): a decoding
request that is ahead of its TPOT pace has banked time (its next token is not due until
first token + k x TBT target, k tokens in), a request still before its first token has its
TTFT deadline's distance; the one with the most time in hand (net of what restoring it costs) goes, swapped or recomputed as
the preemption mode decides, and comes back through the waiting queue in policy order, so
the most urgent of the swapped-out returns first. A request with no target has infinite slack
(it is the first to yield), and so has one already behind its SLO (pausing it loses no
attainment it still has); ties go to the lowest rank.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from sloserve.sched.deadlines import ttft_deadline
from sloserve.core.types import Request


def slo_slack(request: Request, now: float) -> float:
    """Seconds the request can be paused from `now` before it falls behind its SLO."""
    if request.first_token_time is None:
        return ttft_deadline(request) - now
    target = request.qos.tbt_target_s
    if math.isinf(target):
        return math.inf
    return request.first_token_time + request.num_output_tokens * target - now


def pick_victim(running: Sequence[Request], how: str, now: float,
                restore_s: Callable[[Request], float] = lambda r: 0.0) -> Request:
    """The running request to preempt (`running` is in policy order, most urgent first).
    `restore_s`: what bringing a request back would cost (its swap round trip, or the recompute
    of its context): slack net of it is what the pause really leaves."""
    if how == "rank" or len(running) == 1:
        return running[-1]
    best, best_key = running[-1], None
    for rank, request in enumerate(running):
        slack = slo_slack(request, now)
        # Already behind its SLO: pausing it costs no attainment it still has, so it goes first.
        key = (math.inf if slack < 0 else slack - restore_s(request), rank)
        if best_key is None or key > best_key:
            best, best_key = request, key
    return best
