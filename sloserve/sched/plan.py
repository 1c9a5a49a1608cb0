"""What crosses between the instance scheduler and an executor, once per step.

The scheduler emits a StepPlan; the executor (the real model runner or a cost model)
returns a StepResult. Nothing else passes between them, which is what lets the simulator
run the very scheduler the engine runs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from sloserve.kv.manager import CopyOp
from sloserve.kv.tiers import TierOps
from sloserve.core.types import Request


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    start: int  # tokens already in the KV cache: this step computes [start, start + num_new_tokens)
    num_new_tokens: int
    block_table: list[int]
    samples: bool  # the step ends this request's pending tokens, so it produces a new token
    # Speculative decoding: guessed tokens after the pending one, verified in this step. They
    # count in num_new_tokens (1 + len(draft_token_ids)) but are not the request's tokens yet.
    draft_token_ids: tuple[int, ...] = ()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_prefill(self) -> bool:
        return self.start < self.request.num_prompt_tokens or self.num_new_tokens - len(self.draft_token_ids) > 1

    @property
    def num_sampled(self) -> int:
        """Rows this entry sends through the LM head: one per verified position when it speculates."""
        return 1 + len(self.draft_token_ids) if self.samples else 0

    @property
    def context_len(self) -> int:
        """Tokens attended to after this step (cached + new)."""
        return self.start + self.num_new_tokens


@dataclass
class StepPlan:
    step_id: int
    now: float
    scheduled: list[ScheduledRequest]
    copies: list[CopyOp] = field(default_factory=list)  # run before the forward
    preempted: list[str] = field(default_factory=list)  # ids preempted while planning this step
    # Swap to/from the host tier, run before the copies and the forward, in this order:
    # swap_out (device block, host block) first, since a swapped-out device block may be
    # handed to another request in this very step; then swap_in (host block, device block).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # Prefix-cache tier moves (kv/tiers.py). Drops and saves run first of all (they read the
    # device blocks this step reuses), then the swaps, then the loads (they write device blocks
    # a swap-out of this step may have read), then the copies.
    tier_ops: TierOps = field(default_factory=TierOps)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def has_kv_ops(self) -> bool:
        """KV moves the executor must run even when no request computes (a swap-out)."""
        return bool(self.swap_out or self.swap_in or self.copies or self.tier_ops)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.is_prefill)

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if not s.is_prefill)

    @property
    def composition(self) -> tuple[tuple[str, int, int], ...]:
        """(request id, start, new tokens) per entry: comparable across executors."""
        return tuple((s.request_id, s.start, s.num_new_tokens) for s in self.scheduled)


@dataclass(frozen=True)
class DecodeRunPlan:
    """A run of identical pure-decode steps the scheduler can vouch for (see
    Scheduler.plan_decode_run): its length and what prices it."""

    steps: int
    num_decodes: int
    context: int  # computed tokens of the running requests, summed, before the first step
    masked: int = 0  # of the decodes, those under a structured output's token mask


@dataclass
class StepResult:
    # One new token per scheduled request whose `samples` is true.
    sampled_token_ids: dict[str, int]
    duration_s: float = 0.0
    # Executor-specific per-request extras the scheduler ignores (e.g. logprobs).
    extras: dict[str, Any] = field(default_factory=dict)
    # Requests that verified drafts: the tokens after the sampled one, in order (one per
    # accepted draft: the model's token after it). An executor that cannot verify leaves it
    # empty, which accepts no draft.
    more_token_ids: dict[str, list[int]] = field(default_factory=dict)


class Executor(Protocol):
    """Runs a StepPlan: the real model runner, or a cost model in the simulator."""

    def execute(self, plan: StepPlan) -> StepResult: ...
