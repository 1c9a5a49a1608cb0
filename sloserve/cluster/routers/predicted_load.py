from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from sloserve.cluster.lengths import LengthPrediction, prediction_for
from sloserve.cluster.routers.base import Router, RouterOptions
from sloserve.cluster.routers.prefix import DEFAULT_MAX_BLOCKS, prefix_matches
from sloserve.sched.state import InstanceState
from sloserve.core.types import Request


DEFAULT_DECODE_WEIGHT = 0.25
# What sending a request to an instance that does not hold its LoRA adapter in the device's form
# costs, in prefill-token equivalents: the adapter's load there, and one more adapter's products
# in every step its batch shares (engine/lora.py). A queue longer than this outweighs it.
ADAPTER_MISS_TOKENS = 256.0


@dataclass(frozen=True)
class InstanceLoad:
    """The work an instance already holds, in prefill-token equivalents: what the router adds a
    request's own cost to, and what migration balances (`cluster/migration/balance.py`)."""

    prefill: float  # prompt tokens queued (waiting prompts and unfinished chunks)
    decode: float  # decode_weight * predicted decode tokens still to come
    committed_blocks: int  # KV blocks in use + the waiting queue's + the running requests' predicted growth
    # blocks by which the committed KV, plus the chunks running prefills have yet to compute, exceeds
    # the pool (negative: room left)
    excess_blocks: float
    overflow: float  # tokens the preemptions that excess forces would recompute (0 without excess)

    @property
    def total(self) -> float:
        return self.prefill + self.decode + self.overflow


def victim_tokens(s: InstanceState) -> float:
    """Context of a typical running request: what one preemption by recompute costs there."""
    return s.kv_blocks_used * s.block_size / s.num_running if s.num_running else 0.0


def overflow_cost(s: InstanceState, excess_blocks: float) -> float:
    """Tokens recomputed when the pool falls `excess_blocks` short: whole preemptions of typical
    victims (one block short already costs a whole request)."""
    if excess_blocks <= 0:
        return 0.0
    victim = max(1.0, victim_tokens(s) / s.block_size)  # in blocks; an idle instance: block by block
    return math.ceil(excess_blocks / victim) * victim * s.block_size


def instance_load(s: InstanceState, decode_weight: float = DEFAULT_DECODE_WEIGHT,
                  kv_reserve: float = 0.0) -> InstanceLoad:
    """An instance's predicted load (see PredictedLoadRouter for why each term counts): queued
    prefill, weighted decode, and the preemptions its KV is heading for.

    `kv_reserve`: share of the pool counted as taken already when computing the excess: a
    margin for predictions that run short (a point prediction is a median, and half the
    requests outgrow it)."""
    bs = s.block_size
    growth = -(-s.predicted_remaining_decode_tokens // bs)
    committed = s.kv_blocks_used + s.kv_blocks_waiting + growth
    # queued prefill counts the waiting prompts and the unfinished chunks of running ones; only the
    # latter are not in `committed` yet
    chunks_left = max(0, -(-s.queued_prefill_tokens // bs) - s.kv_blocks_waiting)
    excess = committed + chunks_left - s.kv_blocks_total * (1.0 - kv_reserve) if s.kv_blocks_total else -math.inf
    return InstanceLoad(s.queued_prefill_tokens, decode_weight * s.predicted_remaining_decode_tokens, committed,
                        excess, overflow_cost(s, excess))


@dataclass(frozen=True)
class LoadScore:
    """Why an instance scored what it did (tests and debugging read the parts)."""

    prefill: float  # prompt tokens queued ahead plus this prompt's uncached part
    decode: float  # weighted predicted decode tokens still to come
    overflow_risk: float  # P(the instance's KV outgrows its pool while this request runs)
    overflow_cost: float  # tokens a preemption would cost there
    total: float
    adapter: float = 0.0  # ADAPTER_MISS_TOKENS where the instance does not hold the request's adapter


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
    its own prefill, so an instance whose queue has grown beyond that saving loses. The adapter
    term does the same for LoRA: a request naming an adapter prefers the instances that hold it
    in the device's form, by `adapter_miss_tokens`, unless their queues are longer than that.
    """

    name = "predicted-load"

    def __init__(self, predictions: Optional[Callable[[Request], Optional[LengthPrediction]]] = None,
                 decode_weight: float = DEFAULT_DECODE_WEIGHT, use_prefix: bool = True,
                 max_probe_blocks: int = DEFAULT_MAX_BLOCKS, adapter_miss_tokens: float = ADAPTER_MISS_TOKENS):
        self.predictions = predictions
        self.adapter_miss_tokens = adapter_miss_tokens
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
            load = instance_load(s, self.decode_weight)
            uncached = max(1, prompt - matches[i] * bs)
            prefill = load.prefill + uncached
            risk, cost = self._overflow(s, load, prediction, prompt, matches[i] * bs)
            miss = self.adapter_miss_tokens if request.lora is not None and request.lora not in s.adapters else 0.0
            out.append(LoadScore(prefill, load.decode, risk, cost, prefill + load.decode + risk * cost + miss, miss))
        return out

    @staticmethod
    def _overflow(s: InstanceState, load: InstanceLoad, prediction: LengthPrediction, prompt: int,
                  cached: int) -> tuple[float, float]:
        if not s.kv_blocks_total:
            return 0.0, 0.0
        bs = s.block_size
        # room for this request's output once its uncached prompt has its blocks
        room = (s.kv_blocks_total - load.committed_blocks) * bs - (prompt - cached)
        risk = 1.0 if room <= 0 else prediction.survival(room)
        return risk, victim_tokens(s) + prompt

    def route(self, request: Request, states: Sequence[InstanceState]) -> int:
        scores = self.scores(request, states)
        return min(range(len(scores)), key=lambda i: (scores[i].total, i))
