"""The request streams of the evaluation's traces, one window per seed, and each trace's base SLO.

Every trace in the shared data folder that the workload builder reads is a trace here, plus
one synthetic shape. A seed picks a different sample of the same trace, so the spread of a
policy's goodput across seeds is what a different hour of the same service would change:
- traces with their own arrival times (Azure, Mooncake): the window starting `seed` eighths of
  the way into the trace (arrival times from its first request); its pattern is what the
  rate searches stretch;
- ShareGPT prompts: Poisson arrivals, the prompts in the seed's shuffled order;
- ServeGen: the seed's draw of the per-client arrival processes (with ShareGPT prompts);
- synthetic: fixed 1,024-token prompts and 256-token outputs, bursty (gamma, CV 2) arrivals.
Requests no policy can serve within the cell's SLO are left out of its windows (`Fit`): those the
model cannot hold (prompt + output over its context), and prompts too long to prefill within the
TTFT target even alone on an idle instance. Every policy would miss them alike; kept, they would
only make 99% of requests within the SLO unreachable for all.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable, Optional, Sequence

from sloserve.bench.metrics import SLO
from sloserve.workload.build import WorkloadSpec, build_stream
from sloserve.workload.types import WorkloadRequest

WINDOWS = 8  # a timed trace's seeds start at these fractions of it (seed 8 is seed 0 again)
WHOLE_TRACE = 10**6  # "every request" for a count-bound build of a timed trace


@dataclass(frozen=True)
class Trace:
    """A trace of the suite: the workload name, whether its requests share prefixes (a prefix-aware
    router has something to find), and the SLO a cell's `slo` multiplier scales."""

    name: str
    timed: bool  # its own arrival times (else a rate-1 arrival process, rescaled by the searches)
    prefixes: bool
    base_slo: SLO


TRACES: dict[str, Trace] = {t.name: t for t in (
    Trace("azure-conv", True, False, SLO(ttft_s=1.0, tpot_s=0.1)),
    Trace("azure-code", True, False, SLO(ttft_s=1.0, tpot_s=0.1)),
        # 7k-token median prompts, 85k at the 99th percentile (8B on an H100 prefills 85k tokens in ~6 s alone):
    # a 10 s base TTFT leaves their 99% within reach at the base SLO
    Trace("mooncake-conv", True, True, SLO(ttft_s=10.0, tpot_s=0.1)),
    Trace("mooncake-synthetic", True, True, SLO(ttft_s=10.0, tpot_s=0.1)),
    Trace("sharegpt", False, False, SLO(ttft_s=1.0, tpot_s=0.1)),
    Trace("servegen", False, False, SLO(ttft_s=1.0, tpot_s=0.1)),
    Trace("synthetic", False, False, SLO(ttft_s=1.0, tpot_s=0.1)),
)}


def get_trace(name: str) -> Trace:
    try:
        return TRACES[name]
    except KeyError:
        raise ValueError(f"unknown trace {name!r} in the suite; choose from {sorted(TRACES)}") from None


def slo_for(trace: str, tightness: float) -> SLO:
    """The trace's base SLO times `tightness` (0.5: twice as tight)."""
    if not tightness > 0:
        raise ValueError(f"slo multiplier must be > 0, got {tightness}")
    base = get_trace(trace).base_slo
    return SLO(ttft_s=base.ttft_s * tightness, tpot_s=base.tpot_s * tightness)  # type: ignore[operator]


def spec_for(trace: str, seed: int) -> WorkloadSpec:
    """The workload spec of a trace's stream for `seed` (a timed trace: the whole trace, cut later)."""
    t = get_trace(trace)
    if t.timed:
        return WorkloadSpec(trace, replay=True, num_requests=WHOLE_TRACE)
    if trace == "synthetic":
        return WorkloadSpec(trace, seed=seed, rate=1.0, arrival_process="gamma", cv=2.0, input_len=1024,
                            output_len=256, num_requests=1)
    return WorkloadSpec(trace, seed=seed, rate=1.0, num_requests=1)


@dataclass(frozen=True)
class Fit:
    """Which requests a cell can serve at all: prompts of at most `max_prompt` tokens, prompt and
    output together at most `max_total` (the context)."""

    max_prompt: int
    max_total: int

    def __call__(self, r: WorkloadRequest) -> bool:
        return r.prompt_len <= self.max_prompt and r.prompt_len + r.output_len <= self.max_total


@lru_cache(maxsize=8)
def _whole(trace: str, fit: Optional[Fit]) -> tuple[WorkloadRequest, ...]:
    return tuple(_fitting(build_stream(spec_for(trace, 0)), fit))


@lru_cache(maxsize=16)
def _first(trace: str, seed: int, n: int, fit: Optional[Fit]) -> tuple[WorkloadRequest, ...]:
    size = n
    while True:  # draw more until n fit (a ShareGPT prompt may not)
        drawn = _fitting(build_stream(replace(spec_for(trace, seed), num_requests=size)), fit)
        if len(drawn) >= n or size >= 4 * n:
            return tuple(drawn[:n])
        size *= 2


def _fitting(reqs: Sequence[WorkloadRequest], fit: Optional[Fit]) -> list[WorkloadRequest]:
    return list(reqs) if fit is None else [r for r in reqs if fit(r)]


def available(trace: str, seed: int, most: int, fit: Optional[Fit] = None) -> int:
    """How many requests the seed's window of `trace` has (at most `most`)."""
    if not get_trace(trace).timed:
        return most
    whole = _whole(trace, fit)
    return min(most, len(whole) - _offset(len(whole), seed))


def source(trace: str, seed: int, fit: Optional[Fit] = None) -> Callable[[int], list[WorkloadRequest]]:
    """The first n requests of the seed's window of `trace` (as `planning.sustained` draws them),
    arrival times from the window's first request; with `fit`, only the requests it admits."""
    if get_trace(trace).timed:
        whole = _whole(trace, fit)
        start = _offset(len(whole), seed)

        def first(n: int) -> list[WorkloadRequest]:
            window = whole[start:start + n]
            t0 = window[0].arrival_s if window else 0.0
            return [replace(r, arrival_s=r.arrival_s - t0) for r in window]
        return first

    def drawn(n: int) -> list[WorkloadRequest]:
        size = -(-n // 1000) * 1000  # built once per thousand, cut to n
        return list(_first(trace, seed, size, fit)[:n])
    return drawn


def _offset(length: int, seed: int) -> int:
    return (seed % WINDOWS) * (length // WINDOWS)
