"""Deadlines of a request, derived from its arrival, its QoS class and its last token.

One definition shared by the deadline-aware policies and the chunk-size choice, so they
agree on what "late" means. An infinite target gives an infinite deadline.
"""
from __future__ import annotations

import math

from sloserve.core.types import Request


def ttft_deadline(request: Request) -> float:
    """When the first token is due: arrival + the class's TTFT target."""
    return request.arrival_time + request.qos.ttft_target_s


# How many TBT targets of time a request that runs ahead of its pace may bank, i.e. the
# longest gap it accepts before one token when earlier tokens came early.
TBT_BANK = 4.0
# The pace runs this much faster than the target: a request paced exactly at its target ends
# with a TPOT at the target, and a step's worth of estimation error then misses it. The same
# holds for a request behind its pace, so its next token is due this share of a target after
# its last one (a full target let overloaded CPU runs settle at TPOT = target + error: 65%
# vs 93% interactive attainment on the engine at 8 req/s, benchmarks/qos.py).
TBT_PACE_HEADROOM = 0.9


def tbt_deadline(request: Request) -> float:
    """When the next token is due once tokens flow.

    The pace is the class's TBT target per token since the first (the k-th token after the
    first is due at first + k * target, with TBT_PACE_HEADROOM): the TPOT the request is judged by, and it
    lets a request that got its last tokens early absorb one longer step (a big prefill chunk)
    instead of forcing every step to stay short. Two bounds keep the stream smooth: the banked
    time is capped at TBT_BANK targets, and a request already behind its pace still gets
    TBT_PACE_HEADROOM of a target from its last token (never a deadline in the past)."""
    target = request.qos.tbt_target_s
    if request.last_token_time is None or request.first_token_time is None or math.isinf(target):
        return math.inf
    last = request.last_token_time
    headroom = target * TBT_PACE_HEADROOM
    paced = request.first_token_time + request.num_output_tokens * headroom
    return max(last + headroom, min(paced, last + TBT_BANK * target))


def next_deadline(request: Request) -> float:
    """The deadline of the next token this request produces (TTFT until the first, then TBT)."""
    return ttft_deadline(request) if request.first_token_time is None else tbt_deadline(request)
