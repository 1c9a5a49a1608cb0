"""Stream transforms: time windows, time scaling, new arrivals, length clipping, spreading ties.

Each transform takes and returns an iterable of `WorkloadRequest` and never mutates its input
(`dataclasses.replace`), so the same loaded trace can feed several rates of a sweep. They are
lazy where the operation allows, so infinite generators (synthetic, ServeGen) flow through.
"""
from __future__ import annotations

import math
import random
from dataclasses import replace
from typing import Iterable, Iterator, Optional, Sequence, Union

from sloserve.workload.arrivals import ArrivalProcess
from sloserve.workload.types import WorkloadRequest


def time_window(requests: Iterable[WorkloadRequest], start_s: float = 0.0,
                duration_s: Optional[float] = None) -> Iterator[WorkloadRequest]:
    """Requests arriving in [start_s, start_s + duration_s), re-based so the window starts at 0."""
    end = math.inf if duration_s is None else start_s + duration_s
    for r in requests:
        if r.arrival_s < start_s:
            continue
        if r.arrival_s >= end:
            return  # streams are sorted by arrival
        yield replace(r, arrival_s=r.arrival_s - start_s)


def time_scale(requests: Iterable[WorkloadRequest], factor: float) -> Iterator[WorkloadRequest]:
    """Play `factor` times faster (2 = twice the rate, same burst shape)."""
    if not factor > 0 or math.isinf(factor):
        raise ValueError(f"time scale must be a positive finite number, got {factor!r}")
    for r in requests:
        yield replace(r, arrival_s=r.arrival_s / factor)


def observed_rate(requests: Sequence[WorkloadRequest]) -> float:
    """Mean arrival rate of a finite stream: (n - 1) gaps over its span."""
    if len(requests) < 2:
        raise ValueError("need at least two requests to measure a rate")
    span = requests[-1].arrival_s - requests[0].arrival_s
    if span <= 0:
        raise ValueError("all requests arrive at the same time; the trace has no rate to scale")
    return (len(requests) - 1) / span


def scale_to_rate(requests: Sequence[WorkloadRequest], rate: float) -> list[WorkloadRequest]:
    """The trace's own arrival pattern (bursts and all), sped up or slowed down to `rate` req/s."""
    if math.isinf(rate):
        return [replace(r, arrival_s=0.0) for r in requests]
    start = requests[0].arrival_s if requests else 0.0
    factor = rate / observed_rate(requests)
    return [replace(r, arrival_s=(r.arrival_s - start) / factor) for r in requests]


def with_arrivals(requests: Iterable[WorkloadRequest], process: ArrivalProcess,
                  seed: Union[int, str, random.Random] = 0) -> Iterator[WorkloadRequest]:
    """Keep each request's lengths and prompt, replace its arrival time with the process's.

    The first request arrives at 0 (a run starts with traffic, not with a random wait) and each
    later one a drawn gap after its predecessor.
    """
    times = process.arrival_times(seed)
    t = 0.0
    for i, r in enumerate(requests):
        if i > 0:
            t = next(times)
        else:
            next(times)
        yield replace(r, arrival_s=t)


def spread_ties(requests: Sequence[WorkloadRequest]) -> list[WorkloadRequest]:
    """Spread requests that share a quantized timestamp evenly up to the next distinct one.

    The Mooncake conversation trace is quantized to about 3 s; played raw, it arrives in bursts
    the real service never saw. The last group is spread over the median step of the trace.
    """
    out: list[WorkloadRequest] = []
    distinct = sorted({r.arrival_s for r in requests})
    steps = sorted(b - a for a, b in zip(distinct, distinct[1:]))
    last_step = steps[len(steps) // 2] if steps else 0.0
    i = 0
    while i < len(requests):
        j = i
        while j < len(requests) and requests[j].arrival_s == requests[i].arrival_s:
            j += 1
        t = requests[i].arrival_s
        nxt = requests[j].arrival_s if j < len(requests) else t + last_step
        n = j - i
        for k in range(n):
            out.append(replace(requests[i + k], arrival_s=t + (nxt - t) * k / n))
        i = j
    return out


def with_structured_share(requests: Iterable[WorkloadRequest], share: float,
                          seed: int = 0) -> Iterator[WorkloadRequest]:
    """Mark `share` of the requests, drawn reproducibly from `seed` by position, as under a
    structured output's token mask (every rate of a sweep marks the same requests)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"structured share must be in [0, 1], got {share}")
    rng = random.Random(f"{seed}:structured")
    for r in requests:
        yield replace(r, structured=True) if rng.random() < share else r


def clip_lengths(requests: Iterable[WorkloadRequest], max_prompt_len: Optional[int] = None,
                 max_output_len: Optional[int] = None, min_output_len: int = 1) -> Iterator[WorkloadRequest]:
    """Clip lengths to what a server can take (e.g. a small model's context window).

    Clipping, rather than dropping, keeps the arrival pattern intact. Prefix-block hashes beyond
    the clipped prompt are dropped with it; an already synthesized prompt is truncated (token
    ids) or marked for re-synthesis (text, whose token count is not known here).
    """
    for r in requests:
        changes: dict = {}
        if max_prompt_len is not None and r.prompt_len > max_prompt_len:
            changes["prompt_len"] = max_prompt_len
            if r.hash_ids is not None and r.hash_block_size:
                changes["hash_ids"] = r.hash_ids[:math.ceil(max_prompt_len / r.hash_block_size)]
            if r.prompt_token_ids is not None:
                changes["prompt_token_ids"] = r.prompt_token_ids[:max_prompt_len]
        out_len = r.output_len
        if max_output_len is not None:
            out_len = min(out_len, max_output_len)
        out_len = max(out_len, min_output_len)
        if out_len != r.output_len:
            changes["output_len"] = out_len
        yield replace(r, **changes) if changes else r


def cut(requests: Iterable[WorkloadRequest], num_requests: Optional[int] = None,
        duration_s: Optional[float] = None, max_requests: int = 10_000_000) -> list[WorkloadRequest]:
    """Materialize the first `num_requests`, or those arriving before `duration_s`, or both.

    One of the two bounds must be given for an endless stream; `max_requests` stops a
    mistaken unbounded cut (e.g. rate=inf with only a duration) instead of exhausting memory.
    """
    out: list[WorkloadRequest] = []
    for r in requests:
        if num_requests is not None and len(out) >= num_requests:
            break
        if duration_s is not None and r.arrival_s >= duration_s:
            break
        if len(out) >= max_requests:
            raise ValueError(f"more than {max_requests} requests; bound the run with a request count")
        out.append(r)
    return out
