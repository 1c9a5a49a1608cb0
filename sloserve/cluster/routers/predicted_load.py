from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from sloserve.cluster.lengths import LengthPrediction, prediction_for
from sloserve.cluster.routers.base import Router, RouterOptions
from sloserve.cluster.routers.prefix import DEFAULT_MAX_BLOCKS, prefix_matches
from sloserve.sched.state import InstanceState
from sloserve.types import Request


@dataclass(frozen=True)
class LoadScore:
    """Why an instance scored what it did (tests and debugging read the parts)."""

    prefill: float  # prompt tokens queued ahead plus this prompt's uncached part
    decode: float  # weighted predicted decode tokens still to come
    overflow_risk: float  # P(the instance's KV outgrows its pool while this request runs)
    overflow_cost: float  # tokens a preemption would cost there
    total: float


class PredictedLoadRouter(Router):
    """The instance with the least predicted work, in prefill-token equivalents:

        queued prefill tokens + this prompt's uncached tokens there
        + decode_weight * predicted remaining decode tokens
        + P(KV overflow) * cost of the preemption it would cause

    Requests differ by orders of magnitude in cost, so counting them (least-requests) or
    taking turns (round-robin) misplaces the big ones. Prefill queued ahead is what delays
    a new request's first token and what stretches the steps its decodes share (chunks
    ride in the same steps), so it counts fully; remaining decode tokens mostly widen the
    batch, so they count at `decode_weight`.

    The overflow term uses the request's predicted length *distribution*, not a point: the
    instance's KV will hold its blocks in use, its waiting queue's prompts and its running
    requests' predicted growth; what is left is the room this request may grow into, and
    P(length > room) comes from the quantiles. A request likely to run long is kept off an
    instance whose pool would have to preempt someone for it, even when the median fits.
    The cost of an overflow is the recompute of a typical victim (the mean context held per
    running request) plus this request's own prompt.

    The prefix term makes it cache-aware without hot-spotting: a cached prefix only saves
    its own prefill, so an instance whose queue has grown beyond that saving loses.
    """

    name = "predicted-load"

    def __init__(self, predictions: Optional[Callable[[Request], Optional[LengthPrediction]]] = None,
                 decode_weight: float = 0.25, use_prefix: bool = True,
                 max_probe_blocks: int = DEFAULT_MAX_BLOCKS):
        self.predictions = predictions
        self.decode_weight = decode_weight
        self.use_prefix = use_prefix
        self.max_probe_blocks = max_probe_blocks

    @classmethod
    def from_options(cls, options: RouterOptions) -> "PredictedLoadRouter":
        return cls(predictions=options.predictions)  # type: ignore[arg-type]

    def scores(self, request: Request, states: Sequence[InstanceState]) -> list[LoadScore]:
        n = len(states)
        prediction = prediction_for(request, self.predictions)
        prompt = request.num_prompt_tokens
        matches = prefix_matches(request, states, self.max_probe_blocks) if self.use_prefix else [0] * n
        out = []
        for i in range(n):
            s = states[i]
            bs = s.block_size
            uncached = max(1, prompt - matches[i] * bs)
            prefill = s.queued_prefill_tokens + uncached
            decode = self.decode_weight * s.predicted_remaining_decode_tokens
            risk, cost = self._overflow(s, prediction, prompt, matches[i] * bs)
            out.append(LoadScore(prefill, decode, risk, cost, prefill + decode + risk * cost))
        return out

    @staticmethod
    def _overflow(s: InstanceState, prediction: LengthPrediction, prompt: int, cached: int) -> tuple[float, float]:
        if not s.kv_blocks_total:
            return 0.0, 0.0
        bs = s.block_size
        growth = -(-s.predicted_remaining_decode_tokens // bs)
        committed = s.kv_blocks_used + s.kv_blocks_waiting + growth
        # room for this request's output once its uncached prompt has its blocks
        room = (s.kv_blocks_total - committed) * bs - (prompt - cached)
        risk = 1.0 if room <= 0 else prediction.survival(room)
        victim = s.kv_blocks_used * bs / s.num_running if s.num_running else 0.0
        return risk, victim + prompt

    def route(self, request: Request, states: Sequence[InstanceState]) -> int:
        scores = self.scores(request, states)
        return min(range(len(scores)), key=lambda i: (scores[i].total, i))
