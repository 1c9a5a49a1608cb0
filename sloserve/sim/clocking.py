"""A simulated instance's SM clock: each step priced at every lockable clock (seconds from the
roofline, joules from the power model), one chosen by the instance's clock policy, and the
books of what the steps spent."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from sloserve.sched.clocks import ClockOption, ClockPolicy, decode_run_end_by, step_end_by
from sloserve.sched.costs import StepLoad
from sloserve.sched.plan import StepPlan
from sloserve.sim.cost import CostModel, RooflineCostModel
from sloserve.sim.power import GpuPower
from sloserve.core.types import Request


@dataclass
class EnergyBooks:
    """Joules of one instance's steps (all its GPUs), and the busy seconds at each clock."""

    step_joules: float = 0.0
    prefill_steps: int = 0  # steps that compute a prompt chunk
    decode_steps: int = 0
    prefill_clock_s: float = 0.0  # sum of clock x seconds over prefill steps (a time-weighted mean)
    prefill_s: float = 0.0
    decode_clock_s: float = 0.0
    decode_s: float = 0.0
    seconds_at: dict = field(default_factory=dict)  # MHz -> busy seconds

    def add(self, option: ClockOption, mhz: float, prefill: bool, steps: int = 1) -> None:
        self.step_joules += option.joules
        self.seconds_at[mhz] = self.seconds_at.get(mhz, 0.0) + option.seconds
        if prefill:
            self.prefill_steps += steps
            self.prefill_clock_s += option.clock * option.seconds
            self.prefill_s += option.seconds
        else:
            self.decode_steps += steps
            self.decode_clock_s += option.clock * option.seconds
            self.decode_s += option.seconds


class ClockControl:
    def __init__(self, policy: ClockPolicy, power: GpuPower, cost: CostModel, gpus: int = 1):
        if not isinstance(cost, RooflineCostModel):
            raise ValueError("clock policies need the roofline cost model (a profile does not split compute "
                             "from memory time)")
        self.policy, self.power, self.cost, self.gpus = policy, power, cost, gpus
        self.clocks = power.clocks()
        self.books = EnergyBooks()

    def _options(self, shape: StepLoad) -> list[ClockOption]:
        work = self.cost.work(shape)
        out = []
        for clock in self.clocks:
            seconds = self.cost.step_time_at(shape, clock, work)
            out.append(ClockOption(clock, seconds, self.gpus * self.power.step_energy(work, clock, seconds)))
        return out

    def step(self, plan: StepPlan, waiting: Sequence[Request], occupancy: float = 0.0) -> float:
        """The step's duration at the clock the policy picks (its joules booked); `occupancy`: the
        larger of the instance's KV and batch-slot shares in use (sched/clocks/base.occupancy_end_by)."""
        options = self._options(StepLoad.of_plan(plan))
        end_by = step_end_by(plan.now, plan.scheduled, waiting, options[0].seconds, self.policy.ttft_share,
                             occupancy, self.policy.occupancy_target) if self.policy.reads_deadlines else math.inf
        choice = self.policy.choose(plan.now, end_by, options)
        self.books.add(choice, self.power.mhz(choice.clock), any(s.is_prefill for s in plan.scheduled))
        return choice.seconds

    def decode_run(self, now: float, num_decodes: int, context: int, steps: int, running: Sequence[Request],
                   waiting: Sequence[Request], occupancy: float = 0.0) -> tuple[list[float], list[float], float]:
        """Durations and joules of a run of pure-decode steps, all at one clock (returned too):
        the one the policy picks for the run's longest (last) step."""
        last = StepLoad.decodes(num_decodes, context + steps * num_decodes)
        options = self._options(last)
        end_by = decode_run_end_by(now, running, waiting, options[0].seconds, self.policy.ttft_share,
                                   occupancy, self.policy.occupancy_target) if self.policy.reads_deadlines else math.inf
        choice = self.policy.choose(now, end_by, options)
        durations = self.cost.decode_run_at(num_decodes, context, steps, choice.clock)  # type: ignore[attr-defined]
        joules = [self.gpus * self.power.step_energy(self.cost.work(StepLoad.decodes(num_decodes,
                                                                                   context + i * num_decodes)),
                                                     choice.clock, d)
                  for i, d in enumerate(durations, start=1)]
        self.books.add(ClockOption(choice.clock, sum(durations), sum(joules)), self.power.mhz(choice.clock),
                       False, steps)
        return durations, joules, choice.clock

    def refund(self, clock: float, durations: Sequence[float], joules: Sequence[float]) -> None:
        """Steps of a run that were cut before they ran."""
        if durations:
            self.books.add(ClockOption(clock, -sum(durations), -sum(joules)), self.power.mhz(clock), False,
                           -len(durations))


def energy_summary(controls: Sequence[ClockControl], roles: Sequence[str], end_time: float,
                   pool_seconds: dict | None = None) -> dict:
    """The fleet's energy over a run: the steps' joules, plus idle power while an instance was up
    and not stepping (a fixed fleet is up from 0 to `end_time`; an autoscaled one while each pool's
    instances were paid for, `pool_seconds`). {} when no instance has a clock policy."""
    if not controls or any(c is None for c in controls):
        return {}
    step_j = sum(c.books.step_joules for c in controls)
    busy_idle_j = sum(c.power.idle_w * c.gpus * (c.books.prefill_s + c.books.decode_s) for c in controls)
    if pool_seconds is None:
        up_idle_j = sum(c.power.idle_w * c.gpus * end_time for c in controls)
    else:
        per_pool = {role: c.power.idle_w * c.gpus for c, role in zip(controls, roles)}
        up_idle_j = sum(per_pool[pool] * seconds for pool, seconds in pool_seconds.items() if pool in per_pool)
    idle_j = max(0.0, up_idle_j - busy_idle_j)
    books = [c.books for c in controls]
    prefill_s, decode_s = sum(b.prefill_s for b in books), sum(b.decode_s for b in books)
    seconds_at: dict = {}
    for b in books:
        for mhz, s in b.seconds_at.items():
            seconds_at[mhz] = seconds_at.get(mhz, 0.0) + s
    return {"total_j": step_j + idle_j, "step_j": step_j, "idle_j": idle_j,
            "prefill_steps": sum(b.prefill_steps for b in books), "decode_steps": sum(b.decode_steps for b in books),
            "prefill_mean_clock": sum(b.prefill_clock_s for b in books) / prefill_s if prefill_s > 0 else None,
            "decode_mean_clock": sum(b.decode_clock_s for b in books) / decode_s if decode_s > 0 else None,
            "busy_seconds_at_mhz": {f"{mhz:.0f}": s for mhz, s in sorted(seconds_at.items(), reverse=True) if s > 1e-12}}
