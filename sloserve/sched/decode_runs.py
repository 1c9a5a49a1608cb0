"""Steady-state decode runs (the simulator's fast-forward): when a step holds only decodes and
nothing arrives, the next N steps are alike, so the simulator plans them at once
(`plan_decode_run`) and applies them in one go (`advance_decodes`) with exactly the tokens, block
growth and finishes N single steps would give. A mixin of `Scheduler`."""
from __future__ import annotations

from typing import Optional, Sequence

from sloserve.sched.plan import DecodeRunPlan
from sloserve.core.types import FinishReason, Request


class DecodeRuns:
    def plan_decode_run(self, max_steps: int) -> Optional[DecodeRunPlan]:
        """Up to `max_steps` upcoming steps that are certain to be the same pure-decode step of
        the same running set: nothing can be admitted, nobody finishes before the last of them,
        and the free blocks cover every block the run will need. None when the next step
        needs the full scheduler (or a run would be a single step).

        Valid only when sampled tokens cannot stop a request early (no EOS or stop token
        ids), which holds in simulation, where requests end at their recorded lengths.
        """
        running = self.running
        if not running or max_steps < 2 or self.eos_token_ids or self.speculator is not None:
            return None
        if len(running) > self.config.max_num_batched_tokens:
            return None
        if self.waiting and len(running) < self.config.max_num_seqs:
            return None  # a waiting request might be admitted at any step
        if self.waiting and self.policy.preempts_for_admission:
            lowest = max(r.effective_priority for r in running)
            if any(w.effective_priority < lowest for w in self.waiting):
                return None  # a higher class waiting might take a lower one's seat at any step
        k = max_steps
        context = masked = 0
        for r in running:
            num_output = len(r.output_token_ids)
            computed = r.num_computed_tokens
            if r.num_prompt_tokens + num_output - computed != 1 or r.sampling_params.stop_token_ids:
                return None
            k = min(k, r.max_output_tokens - num_output)
            context += computed
            masked += r.sampling_params.structured is not None
        if k < 2:
            return None
        # A request holds the blocks of its computed tokens, so k more tokens need at most
        # ceil(k / bs) new blocks each; count exactly only when the pool might fall short.
        bs, free = self.kv.block_size, self.kv.num_free_blocks
        if len(running) * -(-k // bs) > free:
            num_blocks_of = self.kv.num_blocks_of
            tables = [(r.num_computed_tokens, num_blocks_of(r.request_id)) for r in running]

            def blocks_needed(steps: int) -> int:
                return sum(max(0, -(-(c + steps) // bs) - have) for c, have in tables)

            if blocks_needed(k) > free:
                lo, hi = 0, k  # largest run whose blocks fit
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if blocks_needed(mid) <= free else (lo, mid - 1)
                k = lo
        return DecodeRunPlan(k, len(running), context, masked) if k >= 2 else None

    def advance_decodes(self, num_steps: int, first_end: float, end_time: float, token: int,
                        ends: Optional[Sequence[float]] = None, first: int = 0) -> list[Request]:
        """Apply `num_steps` pure-decode steps at once (after plan_decode_run said they are
        certain); every request gets `token` per step. `first_end` is when the first of them ended:
        a request whose last prompt token was still pending gets its first token there. `ends`
        (from index `first`): when each step ended, for requests that keep their token gaps.
        Returns the requests that finished."""
        if num_steps <= 0:
            return []
        finished = []
        kv, bs = self.kv, self.kv.block_size
        allocate_slots = kv.allocate_slots
        tokens = [token] * num_steps
        if self._tracker is not None:
            for request in self.running:  # (before any of them finishes and departs)
                # A request whose last prompt token was pending computes it in the run's first step.
                self._tracker.on_service(request, int(request.num_computed_tokens < request.num_prompt_tokens),
                                         num_steps)
        for request in list(self.running):
            before = request.num_computed_tokens
            if allocate_slots(request, num_steps) is None:
                raise RuntimeError("decode run outgrew the KV pool; plan_decode_run was not respected")
            request.num_computed_tokens = after = before + num_steps
            request.output_token_ids.extend(tokens)
            if after // bs > before // bs:  # a block filled up: register it
                kv.cache_blocks(request)
            gaps = request.token_gaps
            if gaps is not None:
                self._run_gaps(gaps, request.last_token_time, num_steps, first_end, end_time, ends, first)
            if request.first_token_time is None:
                request.first_token_time = first_end
            request.last_token_time = end_time
            if len(request.output_token_ids) >= request.max_output_tokens:
                self._finish(request, FinishReason.LENGTH, end_time)
                finished.append(request)
        n = len(self.running) + len(finished)
        self._step_id += num_steps
        self.stats.num_steps += num_steps
        self.stats.total_scheduled_seqs += n * num_steps
        self.stats.num_output_tokens += n * num_steps
        self.stats.max_batch_size = max(self.stats.max_batch_size, n)
        return finished

    def reserve_decode_step(self) -> None:
        """Allocate what the next decode step will (as schedule() would at its start), so a
        snapshot taken while that step runs counts the same blocks either way."""
        for request in self.running:
            self.kv.allocate_slots(request, 1)

    @staticmethod
    def _run_gaps(gaps: list[float], last: Optional[float], num_steps: int, first_end: float, end_time: float,
                  ends: Optional[Sequence[float]], first: int) -> None:
        """The token gaps a decode run gives one request: from its last token to the run's first
        step's end, then one per step (the steps' own durations, or their mean without `ends`)."""
        if last is not None:
            gaps.append(first_end - last)
        if num_steps > 1:
            if ends is not None:
                gaps.extend(ends[k] - ends[k - 1] for k in range(first + 1, first + num_steps))
            else:
                gaps.extend([(end_time - first_end) / (num_steps - 1)] * (num_steps - 1))
