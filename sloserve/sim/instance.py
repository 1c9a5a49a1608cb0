"""A simulated instance: the real Scheduler and KVCacheManager, with a cost model as executor.

Nothing here knows about tokens: the simulated "model" emits a placeholder token and each
request ends at its recorded output length (max_tokens with ignore_eos), which is exactly
what the trace says happened.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from sloserve.config import CacheConfig, ModelConfig, SchedulerConfig
from sloserve.kv.manager import KVCacheManager
from sloserve.sched.plan import StepPlan, StepResult
from sloserve.sched.scheduler import Scheduler
from sloserve.sched.state import InstanceState
from sloserve.sim.cost import CostModel
from sloserve.types import Request

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


class SimInstance:
    def __init__(self, instance_id: int, cost_model: CostModel, num_blocks: int, max_model_len: int,
                 scheduler_config: SchedulerConfig, cache_config: Optional[CacheConfig] = None,
                 trace: bool = False):
        cache = cache_config or CacheConfig()
        self.instance_id = instance_id
        self.cost_model = cost_model
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, cache.watermark)
        # No EOS: a simulated request ends at its recorded length, never on a placeholder token.
        self.scheduler = Scheduler(scheduler_config, self.kv, max_model_len, eos_token_ids=())
        self.current: Optional[StepPlan] = None
        self.busy_until: Optional[float] = None
        self.busy_time = 0.0
        self.traces: Optional[list[StepTrace]] = [] if trace else None

    @property
    def is_busy(self) -> bool:
        return self.current is not None

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def start_step(self, now: float) -> Optional[float]:
        """Plan the next step; returns when it ends, or None when there is nothing to run."""
        if self.current is not None:
            raise RuntimeError("a step is already running")
        if not self.scheduler.has_unfinished():
            return None
        plan = self.scheduler.schedule(now)
        if plan.is_empty:
            return None
        duration = self.cost_model.plan_time(plan)
        self.current = plan
        self.busy_until = now + duration
        self.busy_time += duration
        if self.traces is not None:
            self.traces.append(StepTrace(now, now + duration, plan.composition))
        return self.busy_until

    def finish_step(self, now: float) -> list[Request]:
        """Apply the running step's result; returns the requests that finished."""
        plan, self.current, self.busy_until = self.current, None, None
        if plan is None:
            return []
        tokens = {s.request_id: PLACEHOLDER_TOKEN for s in plan.scheduled if s.samples}
        produced = self.scheduler.update(plan, StepResult(tokens), now)
        return [r for r in produced if r.is_finished]

    def snapshot(self, now: float) -> InstanceState:
        return self.scheduler.snapshot(now)
