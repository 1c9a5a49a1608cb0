"""Deadlines of a request, derived from its arrival, its QoS class and its last token.

One definition shared by the deadline-aware policies and the chunk-size choice, so they
agree on what "late" means. An infinite target gives an infinite deadline.
"""
from __future__ import annotations

import math

from sloserve.types import Request


def ttft_deadline(request: Request) -> float:
    """When the first token is due: arrival + the class's TTFT target."""
    return request.arrival_time + request.qos.ttft_target_s


def tbt_deadline(request: Request) -> float:
    """When the next token is due once tokens flow: the last token + the class's TBT target."""
    target = request.qos.tbt_target_s
    if request.last_token_time is None or math.isinf(target):
        return math.inf
    return request.last_token_time + target


def next_deadline(request: Request) -> float:
    """The deadline of the next token this request produces (TTFT until the first, then TBT)."""
    return ttft_deadline(request) if request.first_token_time is None else tbt_deadline(request)
