"""The instance scheduler: iteration-level continuous batching with chunked prefill.

Each step has a token budget. Running decodes are planned first (one token each), then
running prefills continue, then waiting requests are admitted in policy order, their
prompts cut into chunks that fit what is left of the budget. A long prompt therefore never
stalls the decodes (Sarathi-style stall-free batching). When the KV pool runs dry, the
lowest-ranked running request is preempted: by recompute (its blocks are freed and it goes
back to the waiting queue to recompute prompt + output so far), or by swap (its KV is
copied to the host tier and back later), as the preemption mode and the costs decide.

SLO-aware policies switch on more (see SchedulingPolicy): running prefills and waiting
requests share the prefill budget in policy order, higher classes may preempt lower ones
for blocks or seats, and the step's prefill size follows the TBT slack of the decodes.

Pure Python; time comes in as `now` arguments, never from the wall clock. Durations the
SLO-aware decisions need come from an injected estimator (sched/costs.py).
"""
from __future__ import annotations

import bisect
import heapq
import logging
from dataclasses import dataclass
from typing import Optional

from sloserve.core.config import SchedulerConfig
from sloserve.kv.manager import CopyOp, KVCacheManager
from sloserve.kv.tiers import TIERS, TierHit
from sloserve.sched.chunking import prefill_token_cap, tbt_slack
from sloserve.sched.costs import StepCostEstimator, StepLoad, SwapCostEstimator, TierCostEstimator
from sloserve.sched.drafts import make_proposer
from sloserve.sched.live_state import LiveInstanceState, Moment
from sloserve.sched.decode_runs import DecodeRuns
from sloserve.sched.handover import Handover
from sloserve.sched.plan import ScheduledRequest, StepPlan, StepResult
from sloserve.sched.policies import SchedulingPolicy, make_policy
from sloserve.sched.preemption import PreemptionChoice
from sloserve.sched.preempting import Preempting
from sloserve.sched.tier_loads import choose_tier_prefix, load_seconds
from sloserve.sched.speculation import Speculator
from sloserve.sched.state import InstanceState
from sloserve.sched.step_build import StepBuild
from sloserve.sched.tier_loading import TierLoading
from sloserve.core.types import FinishReason, Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    max_batch_size: int = 0
    total_scheduled_seqs: int = 0
    num_recomputes: int = 0  # preemptions that dropped the KV
    num_swaps_out: int = 0  # preemptions that moved the KV to the host tier
    num_swaps_in: int = 0
    num_blocks_swapped: int = 0  # blocks copied either way
    num_migrated_out: int = 0  # requests handed to another instance with their KV
    num_migrated_in: int = 0
    num_tier_loads: int = 0  # prefix blocks copied back from a lower KV tier instead of recomputed
    num_tier_prefetches: int = 0  # of those, blocks staged from disk or the store into host memory while waiting
    num_output_tokens: int = 0  # tokens sampled and kept (the fleet timeline's tokens/s)

    @property
    def mean_batch_size(self) -> float:
        return self.total_scheduled_seqs / self.num_steps if self.num_steps else 0.0


class Scheduler(DecodeRuns, Handover, TierLoading, Preempting):
    """The batching core is here (admission, the step's plan, updates, finishes); what a step does
    around it lives in one mixin per concern: decode runs (decode_runs.py), hand-over between
    instances (handover.py), lower-tier KV loads (tier_loading.py), preemption (preempting.py)."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        eos_token_ids: tuple[int, ...] = (),
        policy: Optional[SchedulingPolicy] = None,
        estimator: Optional[StepCostEstimator] = None,
        swap_cost: Optional[SwapCostEstimator] = None,
        tier_cost: Optional[TierCostEstimator] = None,
    ) -> None:
        """`estimator` prices steps (dynamic chunking, relegation, recompute cost); `swap_cost`
        prices copies to the host swap tier, `tier_cost` loads from the prefix-cache tiers. All
        are optional: without them the SLO-aware parts fall back to what needs no estimate
        (static chunks, relegation only past a deadline, recompute in `auto` mode, always load
        a prefix found in a lower tier)."""
        config.validate()
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.policy = policy or make_policy(config.policy)
        self.estimator = estimator
        self.swap_cost = swap_cost
        self.tier_cost = tier_cost
        tiers = kv.tiers
        if tier_cost is not None and tiers.enabled:
            tiers.prefer({t: tier_cost.tier_time(t, 1) for t in TIERS})
        self._prefetch = tiers.host is not None and (tiers.disk is not None or tiers.store is not None)
        self._prefetched: set[str] = set()  # waiting requests whose prefix was staged already
        # Requests whose lower-tier prefix is being loaded over several steps: request id ->
        # (table index of the next block to load, the hits still to load).
        self._loading: dict[str, tuple[int, list[TierHit]]] = {}
        self.policy.bind(estimator, self._chunk_cap())
        # The policy, when it wants service reports (fair sharing); None keeps every hot loop free of them.
        self._tracker: Optional[SchedulingPolicy] = self.policy if self.policy.tracks_service else None
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # in policy order (preempted and swapped-out ones too)
        self.running: list[Request] = []  # in policy order
        # Requests stopped for a migration's last copy: they keep their blocks, are not scheduled,
        # and either go on here (`unsuspend`) or leave with their KV (`drop_suspended`).
        self.suspended: dict[str, Request] = {}
        self._seq: dict[str, int] = {}
        self._next_seq = 0
        self._step_id = 0
        self.last_preemption: Optional[PreemptionChoice] = None
        self.stats = SchedulerStats()
        self.speculator: Optional[Speculator] = None
        if config.speculative != "off":
            self.speculator = Speculator(make_proposer(config.speculative), config.num_speculative_tokens,
                                         config.speculative_max_batch, estimator)

    @property
    def dynamic_chunking(self) -> bool:
        wanted = self.config.dynamic_chunking
        if wanted is None:
            wanted = self.policy.dynamic_chunking
        return wanted and self.estimator is not None

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
        request.max_output_tokens = self._output_room(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._seq[request.request_id] = self._next_seq
        self._next_seq += 1
        if self._tracker is not None:
            self._tracker.on_arrival(request)
        if self.policy.prices_prefills and self.kv.enable_prefix_caching:
            self._expect_prefix(request)
        self._enqueue_waiting(request, now=request.arrival_time)

    def _output_room(self, request: Request) -> int:
        """The most tokens the request may generate here: what it asked for, within the context
        window. Without chunked prefill a step holds a whole prefill, so a request whose prompt (or
        its recompute after a preemption, prompt + outputs) no step can hold is refused: it would
        wait at the head of the queue forever."""
        room = self.max_model_len - request.num_prompt_tokens
        longest = room if request.max_output_tokens is None else min(request.max_output_tokens, room)
        budget = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and request.num_prompt_tokens + longest > budget:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens and may generate {longest}; without chunked "
                f"prefill a step computes at most {budget} (max_num_batched_tokens): raise it or enable chunking")
        return longest

    def _cached_prefix(self, request: Request) -> tuple[list, int, list[TierHit]]:
        """What the request's prompt hits now: its device blocks, their tokens, and the lower-tier
        blocks after them that are worth loading (`choose_tier_prefix`)."""
        blocks, cached = self.kv.get_computed_blocks(request)
        hits = self.kv.find_in_tiers(request, len(blocks))
        if hits:
            hits = hits[:choose_tier_prefix(hits, cached, request.num_tokens, self.kv.block_size,
                                            self.estimator, self.tier_cost, self._chunk_cap())]
        return blocks, cached, hits

    def _expect_prefix(self, request: Request) -> None:
        """The prefix the request would hit now and the time to load its lower-tier part, for
        the policy's TTFT estimates."""
        _, cached, hits = self._cached_prefix(request)
        request.expected_cached_tokens = cached + len(hits) * self.kv.block_size
        request.expected_load_s = load_seconds(hits, self.tier_cost)

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

    def requeue_for_recompute(self, requests: list[Request], now: float) -> None:
        """Send running requests back to the queue without their KV (the step they were planned
        in could not give them the prefix it loaded): preemption by recompute, between steps."""
        for request in requests:
            if request.status is not RequestStatus.RUNNING:
                continue
            self.running.remove(request)
            self._loading.pop(request.request_id, None)
            self.kv.free(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.PREEMPTED
            request.num_preemptions += 1
            self.stats.num_preemptions += 1
            self.stats.num_recomputes += 1
            self._enqueue_waiting(request, now)

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
        self.kv.release_host_blocks()  # the previous step has run: its swap-ins were read
        if self.tier_cost is not None and self.kv.tiers.enabled:
            self._pace_tier_writes(now)
        step = StepBuild(now, self.config.max_num_batched_tokens)
        if not self.policy.static:
            self._resort(now)

        # 1) running decodes first (one token each), then what is left goes to prefills.
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:  # (num_tokens spelled out: this runs for every request every step)
            (decodes if r.num_prompt_tokens + len(r.output_token_ids) - r.num_computed_tokens == 1
             else prefills).append(r)
        for request in decodes:
            if step.budget <= 0:
                break
            if request.status is RequestStatus.RUNNING:  # not preempted earlier in this loop
                self._plan_running(request, step)
        if self.dynamic_chunking and step.budget > 0:
            step.prefill_left = self._prefill_cap(step, prefills)
        if self.tier_cost is not None and step.planned and self.kv.tiers.enabled:
            step.load_left = self._load_budget(step)

        if self.policy.interleave_prefills:
            # 2') running prefills and waiting requests share the budget in policy order.
            self._plan_prefills_interleaved(prefills, step)
        else:
            # 2) unfinished prefills, then 3) waiting requests in policy order.
            for request in prefills:
                if step.budget <= 0 or step.prefill_left <= 0:
                    break
                if request.status is RequestStatus.RUNNING:
                    self._plan_running(request, step)
            while step.budget > 0 and not step.preempted:
                head = self._next_waiting(step.now)
                if head is None or not self._admit(head, step):
                    break  # head-of-line: later requests wait behind it rather than overtake
        if self.speculator is not None and step.budget > 0:
            self._plan_drafts(decodes, step)
        if self._prefetch:
            self._prefetch_waiting()

        scheduled = [step.planned[r.request_id] for r in self.running if r.request_id in step.planned]
        self._step_id += 1
        if scheduled:
            self.stats.num_steps += 1
            self.stats.total_scheduled_seqs += len(scheduled)
            self.stats.max_batch_size = max(self.stats.max_batch_size, len(scheduled))
        self.stats.num_blocks_swapped += len(step.swap_out) + len(step.swap_in)
        return StepPlan(
            step_id=self._step_id,
            now=now,
            scheduled=scheduled,
            copies=[op for s in scheduled for op in step.copies.get(s.request_id, ())] if step.copies else [],
            preempted=step.preempted,
            swap_out=step.swap_out,
            swap_in=step.swap_in,
            tier_ops=self.kv.take_tier_ops(),
        )

    def _plan_prefills_interleaved(self, prefills: list[Request], step: StepBuild) -> None:
        seqs, now = self._seq, step.now

        def key(r: Request):
            return self.policy.key(r, seqs[r.request_id], now)

        admitting = not step.preempted  # memory ran short for running requests: admit nobody
        # Head-of-line per class: once a waiting request cannot be admitted, nobody of its class
        # or a lower one overtakes it, but a higher class still may (it can preempt lower ones).
        blocked: Optional[int] = None
        for request in heapq.merge(prefills, list(self.waiting), key=key):
            if step.budget <= 0 or step.prefill_left <= 0:
                break
            if request.status is RequestStatus.RUNNING:
                if request.request_id not in step.planned:
                    self._plan_running(request, step)
            elif admitting and request.request_id not in step.preempted and not request.is_finished:
                if blocked is not None and request.effective_priority >= blocked:
                    continue
                if self._deferred(request, now):
                    continue
                if not self._admit(request, step):
                    blocked = request.effective_priority

    def _deferred(self, request: Request, now: float) -> bool:
        """A request rotated out for its slack sits out until half of it is spent (while others
        run: with nothing running it may come back at once, so the instance never idles)."""
        return request.resume_after > now and bool(self.running)

    def _next_waiting(self, now: float) -> Optional[Request]:
        for request in self.waiting:
            if not self._deferred(request, now):
                return request
        return None

    def _plan_drafts(self, decodes: list[Request], step: StepBuild) -> None:
        """Speculation: give the decodes of a pure-decode step draft tokens from the budget it
        has left, when the speculator says they pay (sched/speculation.py). Drafts never
        preempt: a request whose extra slots do not fit decodes plainly."""
        planned = step.planned
        rows = [r for r in decodes if (item := planned.get(r.request_id)) is not None
                and item.samples and item.num_new_tokens == 1]
        if not rows or len(rows) != len(planned):
            return  # only pure-decode steps carry drafts: one with a prefill chunk is compute-bound
        room = {r.request_id: min(r.max_output_tokens - len(r.output_token_ids), self.max_model_len - r.num_tokens) - 1
                for r in rows}
        drafts = self.speculator.plan(rows, step.budget, tbt_slack(rows, step.now), room)  # type: ignore[union-attr]
        verified = False
        for rid, guess in drafts.items():
            item = planned[rid]
            ops = self.kv.allocate_slots(item.request, 1 + len(guess), use_watermark=True)
            if ops is None:
                continue
            if ops:
                step.copies.setdefault(rid, []).extend(ops)
            item.num_new_tokens = 1 + len(guess)
            item.draft_token_ids = tuple(guess)
            item.block_table = self.kv.block_table(rid)
            step.budget -= len(guess)
            verified = True
        if verified:
            self.speculator.stats.num_verify_steps += 1  # type: ignore[union-attr]

    def _plan_running(self, request: Request, step: StepBuild) -> None:
        """Plan the next chunk (or decode token) of a running request, preempting the
        lowest-ranked running requests while its blocks do not fit."""
        pending = request.num_tokens - request.num_computed_tokens
        if pending == 1:  # a decode: the common case, planned for every running request every step
            n = 1 if step.budget > 0 else 0
        elif request.request_id in self._loading:  # (its prefix still loading: never a decode)
            self._continue_loading(request, step)
            return
        else:
            n = int(min(pending, step.budget, self._chunk_cap(), step.prefill_left))
        if n <= 0:
            return
        while True:
            ops = self.kv.allocate_slots(request, n)
            if ops is not None:
                break
            victim = self._pick_victim(step.now)
            self._preempt(victim, step)
            if victim is request:
                return
        step.take(self._scheduled(request, n, samples=n == pending), ops, is_prefill=pending > 1)

    def _admit(self, request: Request, step: StepBuild) -> bool:
        """Admit a waiting (or swapped-out) request with its first chunk. When it finds no seat
        or no blocks, a policy that allows it preempts lower-ranked running requests for it.
        False when it cannot run in this step."""
        while True:
            if len(self.running) < self.config.max_num_seqs:
                admitted = self._try_admit(request, step)
                if admitted is not None:
                    return admitted
            if not (self.policy.preempts_for_admission and self.running):
                return False
            victim = self.running[-1]
            if not self.policy.may_preempt(request, victim, step.now):
                return False
            self._preempt(victim, step)

    def _try_admit(self, request: Request, step: StepBuild) -> Optional[bool]:
        """True if admitted; False if it cannot run this step whatever is preempted (budget,
        no chunking); None if only blocks are missing."""
        swapped = request.status is RequestStatus.SWAPPED
        hits: list[TierHit] = []
        if swapped:
            computed_blocks, num_cached = [], request.num_computed_tokens
        else:
            computed_blocks, num_cached, hits = self._cached_prefix(request)
            num_cached += len(hits) * self.kv.block_size
        remaining = request.num_tokens - num_cached
        n = min(remaining, step.budget, self._chunk_cap())
        if remaining > 1:
            n = int(min(n, step.prefill_left))
        if n <= 0 or (not self.config.enable_chunked_prefill and n < remaining):
            return False
        use_watermark = bool(self.running)
        if swapped:
            pairs = self.kv.swap_in(request, n, use_watermark)
            if pairs is None:
                return None
            step.swap_in.extend(pairs)
            ops: list[CopyOp] = []
            self.stats.num_swaps_in += 1
        else:
            bs = self.kv.block_size
            now_hits = self._affordable(hits, step) if hits else 0
            paced = now_hits < len(hits)  # the rest is loaded over the next steps, computing nothing meanwhile
            maybe_ops = self.kv.allocate_slots(request, len(hits) * bs + (0 if paced else n), computed_blocks,
                                               use_watermark=use_watermark)
            if maybe_ops is None:
                return None
            ops = maybe_ops
            if request.first_scheduled_time is None:  # its first admission (not a preempted or resumed one)
                request.num_cached_tokens = num_cached
                self.kv.record_prefix_lookup(request.num_prompt_tokens, num_cached)
            request.num_computed_tokens = num_cached - (len(hits) - now_hits) * bs
            if hits:
                self._load(request, len(computed_blocks), hits[:now_hits], step)
            if paced:
                self._loading[request.request_id] = (len(computed_blocks) + now_hits, hits[now_hits:])
        self._remove_waiting(request)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = step.now
        self._insert_sorted(self.running, request, step.now)
        if request.request_id not in self._loading:  # a paced load computes nothing this step
            step.take(self._scheduled(request, n, samples=num_cached + n == request.num_tokens), ops,
                      is_prefill=remaining > 1)
        return True

    def _prefill_cap(self, step: StepBuild, prefills: list[Request]) -> int:
        """Prefill tokens this step may carry so the decodes planned so far keep their TBT."""
        head = prefills[0] if prefills else (self.waiting[0] if self.waiting else None)
        if head is None:
            return step.budget  # nothing to prefill: no need to price anything
        planned = list(step.planned.values())
        n = len(planned)
        load = StepLoad(n, n, n, sum(s.context_len for s in planned))
        decodes = [s.request for s in planned]
        start = head.num_computed_tokens
        return prefill_token_cap(load, tbt_slack(decodes, step.now), self.estimator, step.budget,
                                 self.config.min_prefill_chunk, start)

    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[Request]:
        """Apply a finished step: advance KV, append sampled tokens, finish what is done.

        Returns the requests that produced a token in this step (finished ones included).
        """
        if self._tracker is not None:
            self._report_service(plan, result)
        if self.speculator is not None and result.duration_s > 0:
            self.speculator.observe_step(StepLoad.of_plan(plan), result.duration_s)
        produced: list[Request] = []
        bs = self.kv.block_size
        requests = self.requests
        for item in plan.scheduled:
            request = item.request
            if requests.get(request.request_id) is not request or request.status is RequestStatus.MIGRATING:
                continue  # aborted, ended by a stop string, or suspended for a migration while the step ran
            tokens = [result.sampled_token_ids[request.request_id]] if item.samples else []
            end = item.start + item.num_new_tokens
            if item.draft_token_ids:  # the pending token and the accepted drafts are computed now
                more = result.more_token_ids.get(request.request_id, ())
                self.speculator.observe(request.request_id, len(item.draft_token_ids), len(more))  # type: ignore[union-attr]
                tokens.extend(more)
                end = item.start + 1 + len(more)
            reason = None
            for token in tokens:  # one by one, so a stop ends the request exactly where plain decoding would
                request.output_token_ids.append(token)
                self.stats.num_output_tokens += 1
                reason = self._stop_reason(request, token)
                if reason is not None:
                    break
            if tokens:
                end = min(end, request.num_tokens - 1)  # (tokens past a stop were dropped)
            request.num_computed_tokens = end
            if end // bs > item.start // bs:  # a block filled up: register it
                self.kv.cache_blocks(request)
            if not tokens:
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            elif request.token_gaps is not None:
                request.token_gaps.append(now - request.last_token_time)  # type: ignore[operator]
            request.last_token_time = now
            produced.append(request)
            if reason is not None:
                self._finish(request, reason, now)
        return produced

    def _report_service(self, plan: StepPlan, result: StepResult) -> None:
        """Tell the policy what each request of a finished step received, before the step is
        applied (so before any of them departs). Requests gone while it ran are skipped."""
        on_service, requests = self._tracker.on_service, self.requests  # type: ignore[union-attr]
        for item in plan.scheduled:
            request = item.request
            if requests.get(request.request_id) is request:
                prompt = min(item.start + item.num_new_tokens, request.num_prompt_tokens) - item.start
                outputs = 1 + len(result.more_token_ids.get(request.request_id, ())) if item.samples else 0
                on_service(request, max(0, prompt), outputs)

    # ---- snapshot for the cluster layer ------------------------------------------------
    def snapshot(self, now: float) -> InstanceState:
        """Every field, computed now (a worker ships this to its router; in one process the
        simulator's routers read a `LiveInstanceState` instead, field by field)."""
        return LiveInstanceState(self, Moment(now)).freeze()

    # ---- internals ----------------------------------------------------------------
    def _chunk_cap(self) -> int:
        cap = self.config.long_prefill_token_threshold
        return cap if cap > 0 else self.config.max_num_batched_tokens

    def _scheduled(self, request: Request, n: int, samples: bool) -> ScheduledRequest:
        """`samples`: the step computes the request's last pending token, so it samples one."""
        return ScheduledRequest(request, request.num_computed_tokens, n, self.kv.block_table(request.request_id),
                                samples)

    def _stop_reason(self, request: Request, token: int) -> Optional[FinishReason]:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if token in params.stop_token_ids:
                return FinishReason.STOP
            if not params.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
        if request.max_output_tokens is not None and num_output >= request.max_output_tokens:
            return FinishReason.LENGTH
        if request.num_prompt_tokens + num_output >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, request: Request, reason: FinishReason, now: float) -> None:
        self._prefetched.discard(request.request_id)
        self._loading.pop(request.request_id, None)
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.MIGRATING:
            self.suspended.pop(request.request_id, None)
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
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        if self._tracker is not None:
            self._tracker.on_departure(request)

    def _remove_waiting(self, request: Request) -> None:
        """By identity (usually the head): Request's dataclass equality compares every field."""
        for i, r in enumerate(self.waiting):
            if r is request:
                del self.waiting[i]
                return
        raise ValueError(f"{request.request_id} is not waiting")

    def _enqueue_waiting(self, request: Request, now: float) -> None:
        self._insert_sorted(self.waiting, request, now)

    def _insert_sorted(self, queue: list[Request], request: Request, now: float) -> None:
        bisect.insort(queue, request, key=lambda r: self.policy.key(r, self._seq[r.request_id], now))

    def _resort(self, now: float) -> None:
        for queue in (self.waiting, self.running):
            queue.sort(key=lambda r: self.policy.key(r, self._seq[r.request_id], now))
