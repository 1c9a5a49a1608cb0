"""The instance scheduler: iteration-level continuous batching with chunked prefill.

Each step has a token budget. Running decodes are planned first (one token each), then
running prefills continue, then waiting requests are admitted in policy order, their
prompts cut into chunks that fit what is left of the budget. A long prompt therefore never
stalls the decodes (Sarathi-style stall-free batching). When the KV pool runs dry, the
lowest-ranked running request is preempted by recompute: its blocks are freed and it
goes back to the waiting queue to recompute prompt + output so far.

Pure Python; time comes in as `now` arguments, never from the wall clock.
"""
from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass
from typing import Optional

from sloserve.config import SchedulerConfig
from sloserve.kv.manager import CopyOp, KVCacheManager
from sloserve.sched.plan import ScheduledRequest, StepPlan, StepResult
from sloserve.sched.policies import SchedulingPolicy, make_policy
from sloserve.sched.state import InstanceState
from sloserve.types import FinishReason, Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    max_batch_size: int = 0
    total_scheduled_seqs: int = 0

    @property
    def mean_batch_size(self) -> float:
        return self.total_scheduled_seqs / self.num_steps if self.num_steps else 0.0


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        policy: Optional[SchedulingPolicy] = None,
    ) -> None:
        config.validate()
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.policy = policy or make_policy(config.policy)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # in policy order
        self.running: list[Request] = []  # in policy order
        self._seq: dict[str, int] = {}
        self._next_seq = 0
        self._step_id = 0
        self.stats = SchedulerStats()

    # ---- request lifecycle -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if not request.prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the context window is {self.max_model_len}"
            )
        room = self.max_model_len - request.num_prompt_tokens
        request.max_output_tokens = room if request.max_output_tokens is None else min(request.max_output_tokens, room)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._seq[request.request_id] = self._next_seq
        self._next_seq += 1
        self._enqueue_waiting(request, now=request.arrival_time)

    def abort_request(self, request_id: str, now: float = 0.0) -> bool:
        """Stop a request wherever it is and free its blocks. False if unknown or done."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, FinishReason.ABORT, now)
        return True

    def finish_request(self, request_id: str, reason: FinishReason, now: float) -> None:
        """End a request for a reason found outside the scheduler (a stop string)."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, reason, now)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- planning -----------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        planned: dict[str, ScheduledRequest] = {}
        copies: dict[str, list[CopyOp]] = {}
        preempted: list[str] = []
        if not self.policy.static:
            self._resort(now)

        # 1) running requests: decodes first (one token each), then unfinished prefills.
        order = [r for r in self.running if self._pending(r) == 1] + [r for r in self.running if self._pending(r) > 1]
        for request in order:
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(self._pending(request), budget, self._chunk_cap())
            while True:
                ops = self.kv.allocate_slots(request, n)
                if ops is not None:
                    break
                victim = self._pick_victim()
                budget += self._preempt(victim, planned, copies, now)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                continue
            planned[request.request_id] = self._scheduled(request, n)
            copies[request.request_id] = ops
            budget -= n

        # 2) waiting requests in policy order, while budget, seats and blocks last.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            request = self.waiting[0]
            computed_blocks, num_cached = self.kv.get_computed_blocks(request)
            remaining = request.num_tokens - num_cached
            n = min(remaining, budget, self._chunk_cap())
            if not self.config.enable_chunked_prefill and n < remaining:
                break
            ops = self.kv.allocate_slots(request, n, computed_blocks, use_watermark=bool(self.running))
            if ops is None:
                break  # head-of-line: later requests wait behind it rather than overtake
            self.waiting.pop(0)
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
                self.kv.record_prefix_lookup(request.num_prompt_tokens, num_cached)
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            self._insert_sorted(self.running, request, now)
            planned[request.request_id] = self._scheduled(request, n)
            copies[request.request_id] = ops
            budget -= n

        scheduled = [planned[r.request_id] for r in self.running if r.request_id in planned]
        self._step_id += 1
        if scheduled:
            self.stats.num_steps += 1
            self.stats.total_scheduled_seqs += len(scheduled)
            self.stats.max_batch_size = max(self.stats.max_batch_size, len(scheduled))
        return StepPlan(
            step_id=self._step_id,
            now=now,
            scheduled=scheduled,
            copies=[op for s in scheduled for op in copies[s.request_id]],
            preempted=preempted,
        )

    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[Request]:
        """Apply a finished step: advance KV, append sampled tokens, finish what is done.

        Returns the requests that produced a token in this step (finished ones included).
        """
        produced: list[Request] = []
        for item in plan.scheduled:
            request = item.request
            if request.is_finished or self.requests.get(request.request_id) is not request:
                continue  # aborted while the step ran
            request.num_computed_tokens = item.start + item.num_new_tokens
            self.kv.cache_blocks(request)
            if not item.samples:
                continue
            token = result.sampled_token_ids[request.request_id]
            request.output_token_ids.append(token)
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            produced.append(request)
            reason = self._stop_reason(request, token)
            if reason is not None:
                self._finish(request, reason, now)
        return produced

    # ---- steady-state decode runs (simulation) ----------------------------------------
    def decode_run_length(self, max_steps: int) -> int:
        """How many upcoming steps are certain to be the same pure-decode step of the same
        running set: nothing can be admitted, nobody finishes before the last of them, and
        the free blocks cover every block the run will need. 0 when the next step needs the
        full scheduler.

        Valid only when sampled tokens cannot stop a request early (no EOS or stop token
        ids), which holds in simulation, where requests end at their recorded lengths.
        """
        running = self.running
        if not running or max_steps < 1 or self.eos_token_ids:
            return 0
        if len(running) > self.config.max_num_batched_tokens:
            return 0
        if self.waiting and len(running) < self.config.max_num_seqs:
            return 0  # a waiting request might be admitted at any step
        k = max_steps
        for r in running:
            if r.num_tokens - r.num_computed_tokens != 1 or r.sampling_params.stop_token_ids:
                return 0
            k = min(k, r.max_output_tokens - r.num_output_tokens)
        if k < 1:
            return 0
        bs, free = self.kv.block_size, self.kv.num_free_blocks
        tables = [(r.num_computed_tokens, self.kv.num_blocks_of(r.request_id)) for r in running]

        def blocks_needed(steps: int) -> int:
            return sum(max(0, -(-(c + steps) // bs) - have) for c, have in tables)

        if blocks_needed(k) > free:
            lo, hi = 0, k  # largest run whose blocks fit
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if blocks_needed(mid) <= free else (lo, mid - 1)
            k = lo
        return k

    def advance_decodes(self, num_steps: int, end_time: float, token: int) -> list[Request]:
        """Apply `num_steps` pure-decode steps at once (after decode_run_length said they are
        certain); every request gets `token` per step. Returns the requests that finished."""
        if num_steps <= 0:
            return []
        finished = []
        for request in list(self.running):
            if self.kv.allocate_slots(request, num_steps) is None:
                raise RuntimeError("decode run outgrew the KV pool; decode_run_length was not respected")
            request.num_computed_tokens += num_steps
            request.output_token_ids.extend([token] * num_steps)
            self.kv.cache_blocks(request)
            request.last_token_time = end_time
            if request.num_output_tokens >= request.max_output_tokens:
                self._finish(request, FinishReason.LENGTH, end_time)
                finished.append(request)
        n = len(self.running) + len(finished)
        self._step_id += num_steps
        self.stats.num_steps += num_steps
        self.stats.total_scheduled_seqs += n * num_steps
        self.stats.max_batch_size = max(self.stats.max_batch_size, n)
        return finished

    def reserve_decode_step(self) -> None:
        """Allocate what the next decode step will (as schedule() would at its start), so a
        snapshot taken while that step runs counts the same blocks either way."""
        for request in self.running:
            self.kv.allocate_slots(request, 1)

    # ---- snapshot for the cluster layer ------------------------------------------------
    def snapshot(self, now: float) -> InstanceState:
        queued_prefill = sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in self.running)
        queued_prefill += sum(r.num_tokens for r in self.waiting)
        remaining_decode = 0
        for r in self.running + self.waiting:
            expected = r.predicted_output_len if r.predicted_output_len is not None else r.max_output_tokens
            remaining_decode += max(0, (expected or 0) - r.num_output_tokens)
        slack = min((r.ttft_deadline - now for r in self.waiting if r.first_token_time is None), default=math.inf)
        return InstanceState(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            queued_prefill_tokens=queued_prefill,
            kv_blocks_used=self.kv.pool.num_used,
            kv_blocks_free=self.kv.num_free_blocks,
            kv_blocks_total=self.kv.num_blocks,
            predicted_remaining_decode_tokens=remaining_decode,
            prefix_cache_hit_rate=self.kv.stats.hit_rate,
            min_ttft_slack_s=slack,
        )

    # ---- internals ----------------------------------------------------------------
    @staticmethod
    def _pending(request: Request) -> int:
        return request.num_tokens - request.num_computed_tokens

    def _chunk_cap(self) -> int:
        cap = self.config.long_prefill_token_threshold
        return cap if cap > 0 else self.config.max_num_batched_tokens

    def _scheduled(self, request: Request, n: int) -> ScheduledRequest:
        return ScheduledRequest(
            request=request,
            start=request.num_computed_tokens,
            num_new_tokens=n,
            block_table=self.kv.block_table(request.request_id),
            samples=request.num_computed_tokens + n == request.num_tokens,
        )

    def _pick_victim(self) -> Request:
        return self.running[-1]  # the lowest-ranked running request

    def _preempt(
        self, victim: Request, planned: dict[str, ScheduledRequest], copies: dict[str, list[CopyOp]], now: float
    ) -> int:
        """Preempt by recompute; returns the budget the victim had taken in this plan."""
        self.running.remove(victim)
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.PREEMPTED
        self.stats.num_preemptions += 1
        logger.debug("preempted %s (%d tokens to recompute)", victim.request_id, victim.num_tokens)
        self._enqueue_waiting(victim, now)
        copies.pop(victim.request_id, None)
        item = planned.pop(victim.request_id, None)
        return item.num_new_tokens if item else 0

    def _stop_reason(self, request: Request, token: int) -> Optional[FinishReason]:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                return FinishReason.STOP
            if not params.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
        if request.max_output_tokens is not None and request.num_output_tokens >= request.max_output_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason, now: float) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.finish_reason = reason
        request.finished_time = now
        request.status = RequestStatus.ABORTED if reason is FinishReason.ABORT else RequestStatus.FINISHED
        if reason is FinishReason.ABORT:
            self.stats.num_aborted += 1
        else:
            self.stats.num_finished += 1
        del self.requests[request.request_id]
        del self._seq[request.request_id]

    def _enqueue_waiting(self, request: Request, now: float) -> None:
        self._insert_sorted(self.waiting, request, now)

    def _insert_sorted(self, queue: list[Request], request: Request, now: float) -> None:
        bisect.insort(queue, request, key=lambda r: self.policy.key(r, self._seq[r.request_id], now))

    def _resort(self, now: float) -> None:
        for queue in (self.waiting, self.running):
            queue.sort(key=lambda r: self.policy.key(r, self._seq[r.request_id], now))
