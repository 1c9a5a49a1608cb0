"""Preemption as the scheduler plans a step: which running request gives way (`_pick_victim`,
rotation.py's SLO slack) and how (recompute or swap, preemption.py's pricing). A mixin of
`Scheduler`."""
from __future__ import annotations

import logging
import math

from sloserve.sched.costs import prefill_time
from sloserve.sched.preemption import SWAP, choose_preemption
from sloserve.sched.rotation import pick_victim, slo_slack
from sloserve.sched.step_build import StepBuild
from sloserve.core.types import Request, RequestStatus

logger = logging.getLogger(__name__)


class Preempting:
    def _pick_victim(self, now: float) -> Request:
        return pick_victim(self.running, self.config.preemption_victim, now, self._restore_s)

    def _restore_s(self, request: Request) -> float:
        """Least time to bring a preempted request back: its KV swapped out and in, or recomputed."""
        if self.config.preemption_mode != "recompute" and self.swap_cost is not None:
            return 2.0 * self.swap_cost.swap_time(self.kv.blocks_to_swap(request))
        return prefill_time(self.estimator, 0, request.num_computed_tokens, self._chunk_cap())

    def _preempt(self, victim: Request, step: StepBuild) -> None:
        """Take a running request off the device: swap its KV to the host tier or drop it for
        recompute, as the preemption mode and the costs decide. Gives back the budget it had
        taken in this step."""
        rid = victim.request_id
        self._loading.pop(rid, None)
        rotating = self.config.preemption_victim == "slack"
        slack = slo_slack(victim, step.now) - self._restore_s(victim) if rotating else 0.0
        self.running.remove(victim)
        choice = choose_preemption(
            self.config.preemption_mode, victim.num_computed_tokens, self.kv.blocks_to_swap(victim),
            self.kv.num_free_host_blocks, self.estimator, self.swap_cost, self._chunk_cap())
        pairs = None
        if choice.how == SWAP and not step.copies.get(rid):  # a pending copy-on-write: its block is not written yet
            pairs = self.kv.swap_out(victim)
        if pairs is not None:
            step.swap_out.extend(pairs)
            victim.status = RequestStatus.SWAPPED
            self.stats.num_swaps_out += 1
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED
            self.stats.num_recomputes += 1
        self.last_preemption = choice
        if rotating:  # it yields until half its slack is spent
            victim.resume_after = step.now + slack / 2 if 0 < slack < math.inf else step.now
        victim.num_preemptions += 1
        self.stats.num_preemptions += 1
        logger.debug("preempted %s by %s (%d tokens computed)", rid, "swap" if pairs else "recompute",
                     victim.num_tokens)
        self._enqueue_waiting(victim, step.now)
        step.preempted.append(rid)
        step.give_back(rid)
