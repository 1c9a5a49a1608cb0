"""A simulated instance: the real Scheduler and KVCacheManager, with a cost model as executor.

Nothing here knows about tokens: the simulated "model" emits a placeholder token and each
request ends at its recorded output length (max_tokens with ignore_eos), which is exactly
what the trace says happened.
"""
from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Optional

from sloserve.core.config import CacheConfig, ModelConfig, SchedulerConfig
from sloserve.kv.manager import KVCacheManager
from sloserve.kv.tiers import KVTiers
from sloserve.sched.plan import DecodeRunPlan, StepPlan, StepResult
from sloserve.sched.live_state import LiveInstanceState, Moment
from sloserve.sched.scheduler import Scheduler
from sloserve.sched.state import InstanceState
from sloserve.sim.clocking import ClockControl
from sloserve.sim.cost import CostModel, MaskCost
from sloserve.core.types import Request

logger = logging.getLogger(__name__)

PLACEHOLDER_TOKEN = 0


def kv_blocks_for(memory_bytes: float, weight_bytes: float, model: ModelConfig, block_size: int, tp: int,
                  max_num_batched_tokens: int, max_num_seqs: int, dtype_bytes: int = 2,
                  memory_utilization: float = 0.9) -> int:
    """KV blocks that fit on one instance, the way vLLM sizes its pool: a share of device memory,
    minus the weights, minus peak activations of the largest step, divided by the block size."""
    activations = max_num_batched_tokens * (4 * model.hidden_size + 2 * model.intermediate_size) * dtype_bytes / tp
    activations += max_num_seqs * model.vocab_size * 4  # fp32 logits of the sampled rows
    free = memory_bytes * memory_utilization - weight_bytes - activations
    block_bytes = block_size * model.kv_bytes_per_token(dtype_bytes) / tp
    blocks = int(free // block_bytes)
    if blocks <= 0:
        raise ValueError(f"{model.name or 'model'} does not fit: weights {weight_bytes / 1e9:.1f} GB per device, "
                         f"{memory_bytes / 1e9:.0f} GB of memory; raise the tensor-parallel degree")
    return blocks


@dataclass
class StepTrace:
    """What one simulated step did (kept only when tracing is on: tests, fidelity checks)."""

    start: float
    end: float
    composition: tuple


@dataclass
class DecodeRun:
    """A stretch of identical pure-decode steps priced at once; applied lazily as time passes."""

    ends: list[float]  # end time of each step
    applied: int = 0  # steps already applied to the scheduler
    reserved: bool = False  # the blocks of the step in flight are allocated (done only for a reader)
    joules: Optional[list[float]] = None  # each step's energy, with a clock policy (at `clock`)
    clock: float = 1.0

    @property
    def end(self) -> float:
        return self.ends[-1]


class SimInstance:
    """One simulated engine. With `fast_forward`, a steady state of pure decodes is priced as
    one run of steps instead of one event per step; anything that could change the schedule
    (a request routed here) cuts the run at the step in flight, so decisions stay the same
    as stepping one at a time."""

    def __init__(self, instance_id: int, cost_model: CostModel, num_blocks: int, max_model_len: int,
                 scheduler_config: SchedulerConfig, cache_config: Optional[CacheConfig] = None,
                 trace: bool = False, fast_forward: bool = True, max_run_steps: int = 64,
                 num_host_blocks: int = 0, tiers: Optional[KVTiers] = None,
                 clock: Optional[ClockControl] = None, masks: MaskCost = MaskCost()):
        """`clock`: price each step at the SM clock a clock policy picks, and book its energy
        (None: every step at the top clock, no energy books); `masks`: what a structured
        output's token mask adds to each step its rows are in."""
        cache = cache_config or CacheConfig()
        self.instance_id = instance_id
        self.cost_model = cost_model
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, cache.watermark,
                                 num_host_blocks=num_host_blocks, tiers=tiers)
        # No EOS: a simulated request ends at its recorded length, never on a placeholder token.
        # The cost model doubles as the scheduler's step, swap and tier-load estimator.
        self.scheduler = Scheduler(scheduler_config, self.kv, max_model_len, eos_token_ids=(),
                                   estimator=cost_model, swap_cost=cost_model, tier_cost=cost_model)
        self.current: Optional[StepPlan] = None
        self.run: Optional[DecodeRun] = None
        self.fast_forward = fast_forward and not trace
        self.max_run_steps = max_run_steps
        self.busy_until: Optional[float] = None
        self.busy_time = 0.0
        self.clock = clock
        self.traces: Optional[list[StepTrace]] = [] if trace else None
        self.masks = masks
        self._masked_seen = False  # a structured request came here: steps count their masked rows

    @property
    def is_busy(self) -> bool:
        return self.current is not None or self.run is not None

    @property
    def occupancy(self) -> float:
        """The larger of the KV blocks' and the batch slots' shares in use."""
        return max(self.kv.usage, len(self.scheduler.running) / self.scheduler.config.max_num_seqs)

    def add_request(self, request: Request) -> None:
        self._note(request)
        self.scheduler.add_request(request)

    def adopt(self, request: Request, blocks: list[int], now: float) -> None:
        """A migrated request arrives with its KV (sim/migration.py)."""
        self._note(request)
        self.scheduler.adopt(request, blocks, now)

    def _note(self, request: Request) -> None:
        if request.sampling_params.structured is not None:
            self._masked_seen = True

    def start_step(self, now: float) -> Optional[float]:
        """Plan the next step; returns when it ends, or None when there is nothing to run."""
        if self.is_busy:
            raise RuntimeError("a step is already running")
        if not self.scheduler.has_unfinished():
            return None
        self.cost_model.advance(now)
        if self.fast_forward:
            run = self.scheduler.plan_decode_run(self.max_run_steps)
            if run is not None:
                return self._start_run(now, run)
        plan = self.scheduler.schedule(now)
        if plan.is_empty and not plan.has_kv_ops:  # a swap-out alone still takes its copy time
            return None
        duration = self.cost_model.plan_time(plan) if self.clock is None else \
            self.clock.step(plan, self.scheduler.waiting, self.occupancy)
        if self._masked_seen:
            masked = sum(s.num_sampled for s in plan.scheduled if s.request.sampling_params.structured is not None)
            duration += self.masks.extra(masked, duration)
        self.current = plan
        self.busy_until = now + duration
        self.busy_time += duration
        if self.traces is not None:
            self.traces.append(StepTrace(now, now + duration, plan.composition))
        return self.busy_until

    def _start_run(self, now: float, run: DecodeRunPlan) -> float:
        joules, clock = None, 1.0
        if self.clock is None:
            durations = self.cost_model.decode_run(run.num_decodes, run.context, run.steps)
        else:
            durations, joules, clock = self.clock.decode_run(now, run.num_decodes, run.context, run.steps,
                                                             self.scheduler.running, self.scheduler.waiting,
                                                             self.occupancy)
        if run.masked:
            durations = [d + self.masks.extra(run.masked, d) for d in durations]
        ends, t = [], now
        for duration in durations:
            t += duration
            ends.append(t)
        self.busy_time += t - now
        self.run = DecodeRun(ends, joules=joules, clock=clock)
        self.busy_until = t
        return t

    def sync(self, now: float) -> None:
        """Apply the run's steps that ended before `now`."""
        run = self.run
        if run is None:
            return
        done = bisect.bisect_left(run.ends, now, lo=run.applied)  # steps ending strictly before now
        if done > run.applied and done < len(run.ends):
            self.scheduler.advance_decodes(done - run.applied, run.ends[run.applied], run.ends[done - 1],
                                           PLACEHOLDER_TOKEN, run.ends, run.applied)
            run.applied = done
            run.reserved = False

    def catch_up(self, now: float) -> None:
        """Make the scheduler show what stepping one at a time would at `now`: completed steps
        applied, the blocks of the step in flight allocated (as schedule() does at its start).
        Only a reader of the state needs the allocation, so only a reader pays for it; it
        happens before any other allocation of this instance either way."""
        self.sync(now)
        run = self.run
        if run is not None and not run.reserved:
            self.scheduler.reserve_decode_step()
            run.reserved = True

    def interrupt(self, now: float) -> Optional[float]:
        """Something may change the schedule at `now`: end the run with the step in flight.
        Returns the new end time, or None when the run already ends with that step."""
        run = self.run
        if run is None:
            return None
        # The steps already done are applied when the run ends (or when a reader needs them).
        in_flight = bisect.bisect_left(run.ends, now, lo=run.applied)
        if in_flight >= len(run.ends) - 1:
            return None
        self.busy_time -= run.ends[-1] - run.ends[in_flight]
        if self.clock is not None and run.joules is not None:
            cut = [b - a for a, b in zip(run.ends[in_flight:], run.ends[in_flight + 1:])]
            self.clock.refund(run.clock, cut, run.joules[in_flight + 1:])
            del run.joules[in_flight + 1:]
        del run.ends[in_flight + 1:]
        self.busy_until = run.ends[-1]
        return self.busy_until

    def finish_step(self, now: float) -> list[Request]:
        """Apply the running step's (or run's) result; returns the requests that finished."""
        run = self.run
        if run is not None:
            self.run, self.busy_until = None, None
            return self.scheduler.advance_decodes(len(run.ends) - run.applied, run.ends[run.applied], run.ends[-1],
                                                  PLACEHOLDER_TOKEN, run.ends, run.applied)
        plan, self.current, self.busy_until = self.current, None, None
        if plan is None:
            return []
        tokens = {s.request.request_id: PLACEHOLDER_TOKEN for s in plan.scheduled if s.samples}
        produced = self.scheduler.update(plan, StepResult(tokens), now)
        return [r for r in produced if r.is_finished]

    def snapshot(self, now: float) -> InstanceState:
        return self.live_view(Moment(now)).freeze()

    def live_view(self, moment: Moment) -> LiveInstanceState:
        """What the router reads, computed as read at `moment`; the decode run in progress is
        synced to the moment only if a field that depends on it is read."""
        return LiveInstanceState(self.scheduler, moment, self.catch_up)
