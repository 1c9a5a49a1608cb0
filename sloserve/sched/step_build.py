"""What one `Scheduler.schedule()` call has decided so far: the requests planned with their
token counts and copy-on-write ops, the budgets left, and the KV moves (preemptions, swaps)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from sloserve.kv.manager import CopyOp
from sloserve.sched.plan import ScheduledRequest


@dataclass
class StepBuild:
    """What one schedule() call has decided so far."""

    now: float
    budget: int
    prefill_left: float = math.inf  # dynamic chunking: prefill tokens this step may still take
    load_left: float = math.inf  # seconds of lower-tier KV loads this step may still carry
    prefill_ids: set[str] = field(default_factory=set)  # planned requests counted against prefill_left
    planned: dict[str, ScheduledRequest] = field(default_factory=dict)
    copies: dict[str, list[CopyOp]] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)

    def take(self, item: ScheduledRequest, ops: list[CopyOp], is_prefill: bool) -> None:
        """Plan `item` with its copy-on-write ops, charging the budget (and the prefill cap)."""
        rid = item.request.request_id
        self.planned[rid] = item
        if ops:  # rare (copy-on-write of a shared tail): only requests with copies have an entry
            self.copies[rid] = ops
        self.budget -= item.num_new_tokens
        if is_prefill:
            self.prefill_left -= item.num_new_tokens
            self.prefill_ids.add(rid)

    def give_back(self, request_id: str) -> None:
        """Undo `take` for a request preempted later in the same step."""
        self.copies.pop(request_id, None)
        item = self.planned.pop(request_id, None)
        if item is not None:
            self.budget += item.num_new_tokens
            if request_id in self.prefill_ids:
                self.prefill_left += item.num_new_tokens
