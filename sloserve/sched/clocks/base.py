"""SM clock policies: how fast to run a step.

A GPU's SM clock can be locked per step (nvidia-smi / NVML application clocks). A lower clock
stretches the compute-bound part of a step and saves power on all of it (sim/power.py), so an
instance whose requests have SLO slack can spend that slack on energy (BEAM, GreenLLM,
DynamoLLM). The policy sees the step's candidate clocks already priced, each with its seconds
and joules, and the time by which the step must end for no request to miss its next deadline
(`step_end_by`); it picks one. Pure Python, time passed in: the simulator prices the options
with its cost and power models, and a real engine could with a profile and a power meter.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from sloserve.sched.deadlines import TBT_PACE_HEADROOM, next_deadline, tbt_deadline, ttft_deadline
from sloserve.sched.plan import ScheduledRequest
from sloserve.core.types import Request


@dataclass(frozen=True)
class ClockOption:
    clock: float  # fraction of the maximum SM clock
    seconds: float  # the step's duration at that clock
    joules: float  # what the instance's GPUs spend on it


class ClockPolicy(ABC):
    name: str = ""
    ttft_share: float = 0.5  # what step_end_by may give of a TTFT slack (see TTFT_SHARE)
    occupancy_target: float = 0.5  # the occupancy a stretch may fill up to (see OCCUPANCY_TARGET)
    reads_deadlines: bool = False  # whether `choose` looks at `end_by` (else the caller passes inf, unpriced)

    @abstractmethod
    def choose(self, now: float, end_by: float, options: Sequence[ClockOption]) -> ClockOption:
        """One of `options` (highest clock first) for a step starting at `now` that should end
        by `end_by` (inf: no request has a deadline)."""


# Requests before their first token are served one after another (chunks in queue order), so a
# slower clock stretches each one's wait by the work ahead of it, not only its own prefill. Their
# first tokens are projected with all of that work at this step's pace (seconds per token at the
# top clock, times the clock's stretch) and must land within this share of the time to their
# TTFT deadline: the rest is kept for requests that arrive while the work runs (they queue behind it).
# 0.5: on 6,000-token prompts at a 350 ms TTFT target, 0.3 / 0.5 / 0.7 kept 98.5 / 97.0 / 93.0% of
# the top clock's 98.5% attainment for 20 / 32 / 36% less energy (tests/test_energy.py's case).
TTFT_SHARE = 0.5


# A slower clock keeps every request resident longer by the step's stretch, so at the same arrival
# rate the KV blocks and batch slots the instance holds grow by that factor (Little's law): a step
# may stretch only as far as OCCUPANCY_TARGET / occupancy, so that spare room is spent on energy
# without turning into a queue. Near capacity (occupancy at the target) every step runs at the top clock.
# 0.5 from the clocks suite's dev cells: at 0.8 an A100 ShareGPT cell at its capacity kept 77% of requests
# within the SLO against the top clock's 92% (0.5: 88%), and dev verdicts went from 7 to 10 wins of 21.
OCCUPANCY_TARGET = 0.5


def occupancy_end_by(now: float, full_clock_s: float, occupancy: float, target: float = OCCUPANCY_TARGET) -> float:
    """When a step that takes `full_clock_s` at the top clock must end so that the instance's
    occupancy (the larger of its KV and batch-slot shares in use, 0-1) stretched by the step's
    slowdown stays within `target`."""
    if occupancy <= 0:
        return math.inf
    return now + full_clock_s * max(1.0, target / occupancy)


def step_end_by(now: float, scheduled: Sequence[ScheduledRequest], waiting: Sequence[Request],
                full_clock_s: float, ttft_share: float = TTFT_SHARE, occupancy: float = 0.0,
                occupancy_target: float = OCCUPANCY_TARGET) -> float:
    """When a step that takes `full_clock_s` at the top clock must end: before the paced TBT
    deadline of every decode it samples, and early enough that every request before its first
    token in this step still gets it in time if all the prefill work up to its own ran at this
    step's stretch (`ttft_share` of the time to its deadline); no later than the instance's
    `occupancy` allows (occupancy_end_by). While a request with a deadline waits to be admitted,
    the step ends as at the top clock: a queue means the instance is short of throughput, and a
    slower step lengthens that queue's wait and that of every request behind it (the clocks
    suite's dev cells at 90% load lost up to half their attainment to slack spent then)."""
    if any(next_deadline(request) < math.inf for request in waiting):
        return now + full_clock_s
    end_by = occupancy_end_by(now, full_clock_s, occupancy, occupancy_target)
    tokens = sum(s.num_new_tokens for s in scheduled if s.request.first_token_time is None)
    per_token = full_clock_s / tokens if tokens else 0.0
    ahead = 0
    for s in scheduled:
        request = s.request
        if request.first_token_time is not None:
            if s.samples:
                end_by = min(end_by, tbt_deadline(request))
            continue
        ahead += max(0, request.num_tokens - s.start)
        due = ttft_deadline(request)
        if due < math.inf:
            end_by = min(end_by, now + full_clock_s * ttft_share * (due - now) / (per_token * ahead))
    return end_by


def decode_run_end_by(now: float, running: Sequence[Request], waiting: Sequence[Request],
                      full_clock_s: float, ttft_share: float = TTFT_SHARE, occupancy: float = 0.0,
                      occupancy_target: float = OCCUPANCY_TARGET) -> float:
    """When each step of a run of pure-decode steps of all `running` requests must end, as the
    run's first step: its next deadlines, what `occupancy` allows, and no step longer than the
    tightest paced TBT (the run's later steps have no banked time to draw on)."""
    end_by = step_end_by(now, (), waiting, full_clock_s, ttft_share, occupancy, occupancy_target)
    for request in running:
        end_by = min(end_by, next_deadline(request), now + request.qos.tbt_target_s * TBT_PACE_HEADROOM)
    return end_by
