"""Early shedding under overload: refuse a request whose TTFT target is already out of reach.

A count bound (Admission) alone lets a queue of admitted requests grow until every one of
them misses its target. Here each arrival with a TTFT target asks: given the work the engine
holds now (prefills queued ahead of it, running decodes holding batch slots) and what a step
of that shape costs (the engine's step estimator), when would its first token come? If after
its target, it gets 429 `slo_unattainable` at once, with a Retry-After of how far the queue
would have to drain; the requests admitted keep their SLO.

Where the load comes from, and why two sources:
- the scheduler's own lists (read from the event loop; the engine thread mutates them, so a
  read that trips over a change is retried, as worker.state_payload does) give each request's
  progress: prompt tokens left, outputs so far;
- a ledger kept on the event loop covers what the scheduler cannot see yet: requests admitted
  since the engine thread last picked up new work (it does so between steps, so a burst that
  arrives during one step would otherwise see none of its own members).

Pure Python, clock injected, no torch: `predict_ttft` is a small event simulation (each step
runs the running decodes plus a prefill chunk) that unit tests drive with constructed loads.

The model prices steps, not what happens between them (the event loop's share of the GIL, SSE
writes, tokenizing the next arrival), and it admits right up to the target, so the admitted
requests' first tokens cluster just below it: a bias of a few percent puts many over. So the
prediction is calibrated by feedback: each admitted request whose wait mattered (predicted at
least a fifth of its target) reports its first token, and predictions are scaled by the median
ratio of observed to predicted over the last 32 such requests, or over the last 8 when that is
higher: a machine that slows down (a neighbour on shared cores, a clock that drops) tightens
admission after a few late first tokens, while it relaxes only as the longer window agrees.
"""
from __future__ import annotations

import heapq
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from sloserve.sched.costs import StepCostEstimator, StepLoad
from sloserve.server.errors import APIError
from sloserve.core.types import QoSClass

logger = logging.getLogger(__name__)

SHED_CODE = "slo_unattainable"
CALIBRATION_WINDOW = 32  # admitted requests whose observed / predicted TTFT ratios are kept
RECENT_WINDOW = 8  # the newest ratios, whose median overrides the window's when higher (slowdowns)
CALIBRATE_ABOVE = 0.2  # learn only from predictions of at least this share of the target: where queueing is priced
CALIBRATION_BOUNDS = (0.5, 4.0)  # a correction outside these says the estimator is broken, not biased


@dataclass(frozen=True)
class Work:
    """What one request still costs the engine."""

    prefill_tokens: int  # tokens to compute before it samples again (prompt, or a recompute)
    decode_tokens: int  # output tokens still expected after that
    context_tokens: int = 0  # tokens its decode steps attend to now


@dataclass(frozen=True)
class EngineShape:
    max_num_seqs: int  # batch slots
    step_tokens: int  # per-step token budget (max_num_batched_tokens): decodes + prefill chunk


@dataclass(frozen=True)
class Load:
    """The engine as a new request finds it: requests holding batch slots, and the requests the
    scheduler will take before the new one, in that order."""

    running: tuple[Work, ...] = ()
    ahead: tuple[Work, ...] = ()


def predict_ttft(load: Load, prompt_tokens: int, shape: EngineShape, estimator: StepCostEstimator,
                 count: int = 1) -> float:
    """Seconds until the last of `count` new requests of `prompt_tokens` each (queued behind
    `load.ahead`) gets its first token.

    Model: continuous batching with chunked prefill, as the scheduler runs it. A step carries one
    decode token per running decoder plus prefill tokens up to the budget; queued requests take
    free batch slots in order and are prefilled together; a request whose prefill completes
    becomes a decoder until its expected output is done and frees its slot. Events (a prefill
    batch completes, a decoder finishes) are jumped between, so the cost is O(n log n) in the
    requests, not in steps. KV-memory preemption is not modelled.
    """
    slots = max(1, shape.max_num_seqs)
    decoders: list[tuple[int, int, int]] = []  # heap of (finish step, start step, context at start)
    ctx_sum = 0
    queue: deque[tuple[Work, bool]] = deque()  # (work, already holds a slot)
    for w in load.running:
        if w.prefill_tokens > 0:
            queue.append((w, True))
        elif w.decode_tokens > 0:
            heapq.heappush(decoders, (w.decode_tokens, 0, w.context_tokens))
            ctx_sum += w.context_tokens
    used = len(queue) + len(decoders)
    for w in load.ahead:
        queue.append((w, False))
    mine = Work(max(1, prompt_tokens), 0, 0)
    for _ in range(max(1, count)):
        queue.append((mine, False))
    remaining_mine = max(1, count)

    t, step = 0.0, 0

    def finish_until(upto: int) -> None:
        nonlocal ctx_sum, used
        while decoders and decoders[0][0] <= upto:
            end, start, ctx0 = heapq.heappop(decoders)
            ctx_sum -= ctx0 + (end - start)
            used -= 1

    while True:
        batch_tokens, batch_mine, batch = 0, 0, []
        while queue and (queue[0][1] or used < slots):
            w, slotted = queue.popleft()
            if not slotted:
                used += 1
            batch.append(w)
            batch_tokens += w.prefill_tokens
            batch_mine += w is mine
        if batch:
            b = len(decoders)
            per_step = max(1, shape.step_tokens - b)
            steps = max(1, math.ceil(batch_tokens / per_step))
            chunk = min(batch_tokens, per_step)
            t += steps * estimator.estimate(StepLoad.prefill(chunk) + StepLoad.decodes(b, ctx_sum))
            ctx_sum += b * steps
            step += steps
            remaining_mine -= batch_mine
            if remaining_mine <= 0:
                return t
            finish_until(step)
            for w in batch:
                if w.decode_tokens > 0:
                    heapq.heappush(decoders, (step + w.decode_tokens, step, w.prefill_tokens + w.context_tokens))
                    ctx_sum += w.prefill_tokens + w.context_tokens
                else:
                    used -= 1
            continue
        if not decoders:  # slots held by nothing we can see: nothing to wait for
            used = 0
            continue
        b = len(decoders)
        end = decoders[0][0]
        t += (end - step) * estimator.estimate(StepLoad.decodes(b, ctx_sum))
        ctx_sum += b * (end - step)
        step = end
        finish_until(step)


# ---------------------------------------------------------------------- live load


@dataclass(frozen=True)
class _Pending:
    work: Work
    rank: tuple[float, ...]


def _expected_outputs(r: Any, max_model_len: int) -> int:
    """Output tokens a request is expected to produce: its predicted length when one was made,
    else max_tokens (the context window when unset); as the scheduler's snapshot counts them."""
    expected = r.predicted_output_len if r.predicted_output_len is not None else r.max_output_tokens
    if expected is None:
        expected = max_model_len - r.num_prompt_tokens
    return max(0, int(expected))


def work_of(r: Any, max_model_len: int) -> Work:
    """A scheduler Request's remaining work."""
    left = r.num_tokens - r.num_computed_tokens
    outputs = r.num_output_tokens
    decode_left = max(0, _expected_outputs(r, max_model_len) - outputs)
    if left <= 1 and outputs > 0:  # decoding: one token per step
        return Work(0, decode_left, r.num_tokens)
    return Work(max(1, left), max(0, decode_left - 1), r.num_computed_tokens)


def _median(values: Sequence[float]) -> float:
    """The upper median: with an even count, the higher middle value (the cautious one)."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class Shedder:
    """Decides, per arrival with a TTFT target, whether that target is still reachable.

    `scheduler` is read, never changed (running, waiting, requests, config.policy); `core` is
    anything with `scheduler`, `step_estimator`, `max_model_len`, `config.scheduler` and
    `clock` (an LLMEngine). Runs on the event loop thread only.
    """

    def __init__(self, core: Any, retry_after_min_s: int = 1,
                 clock: Optional[Callable[[], float]] = None, headroom: float = 0.9) -> None:
        """`headroom`: admit only while the predicted TTFT is within this share of the target.
        The prediction is a mean; with none, admissions pile up right at the target and the
        model's error puts about half of them over it (the same 10% the TBT pacing keeps)."""
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom must be in (0, 1], got {headroom}")
        self.headroom = headroom
        self.core = core
        self.clock = clock or core.clock
        self.retry_after_min_s = retry_after_min_s
        cfg = core.config.scheduler
        self.shape = EngineShape(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.policy = cfg.policy
        self._ledger: dict[str, _Pending] = {}  # admitted, not yet seen in the scheduler
        self._reserved: Optional[tuple[Work, tuple[float, ...], int, float]] = None
        self.num_shed = 0
        self._awaiting: dict[str, tuple[float, float]] = {}  # admitted, first token not seen: (admitted at, raw s)
        self._ratios: deque[float] = deque(maxlen=CALIBRATION_WINDOW)
        self.calibration = 1.0  # observed / predicted TTFT, median of the window (1 until it has samples)

    # -- the ledger: fed by Admission
    def on_admit(self, request_ids: Sequence[str]) -> None:
        """Record the work of requests just admitted: what the last check_deadline passed."""
        reserved, self._reserved = self._reserved, None
        if reserved is None:
            return
        work, rank, count, raw = reserved
        if count != len(request_ids):  # not the same call: admit without a ledger entry
            return
        now = self.clock()
        for rid in request_ids:
            self._ledger[rid] = _Pending(work, rank)
            if raw > 0:
                self._awaiting[rid] = (now, raw)

    def on_release(self, request_id: str) -> None:
        self._ledger.pop(request_id, None)
        self._awaiting.pop(request_id, None)

    def on_first_token(self, request_id: str) -> None:
        """Feedback: an admitted request's first token is out; learn how far off its prediction was."""
        entry = self._awaiting.pop(request_id, None)
        if entry is None:
            return
        admitted_at, raw = entry
        self._ratios.append((self.clock() - admitted_at) / raw)
        ratio = max(_median(self._ratios), _median(list(self._ratios)[-RECENT_WINDOW:]))
        self.calibration = min(CALIBRATION_BOUNDS[1], max(CALIBRATION_BOUNDS[0], ratio))

    # -- the decision
    def _rank(self, qos: QoSClass, priority: Optional[int], now: float) -> tuple[float, ...]:
        """Order key under the scheduling policy; a queued request with a key <= ours goes first."""
        if self.policy == "priority":
            return (qos.priority if priority is None else priority,)
        if self.policy in ("edf", "slo"):
            return (now + qos.ttft_target_s,)
        return ()  # fcfs: everyone queued is ahead

    def _request_rank(self, r: Any) -> tuple[float, ...]:
        if self.policy == "priority":
            return (r.effective_priority,)
        if self.policy in ("edf", "slo"):
            return (r.ttft_deadline,)
        return ()

    def load(self, rank: tuple[float, ...]) -> Load:
        """Running requests and the requests ahead of a new one of this rank, right now."""
        sched, max_len = self.core.scheduler, self.core.max_model_len
        for attempt in range(5):
            try:
                running = list(sched.running)
                waiting = list(sched.waiting)
                known = sched.requests
                run = tuple(work_of(r, max_len) for r in running)
                ahead = [work_of(r, max_len) for r in waiting if self._request_rank(r) <= rank]
                seen = [rid for rid in self._ledger if rid in known]
                break
            except (RuntimeError, AttributeError, TypeError):  # changed under us by the engine thread
                if attempt == 4:
                    raise
        for rid in seen:  # the scheduler has it now: its own view is more exact from here on
            del self._ledger[rid]
        ahead += [p.work for p in self._ledger.values() if p.rank <= rank]
        return Load(run, tuple(ahead))

    def _raw_prediction(self, per_request: int, rank: tuple[float, ...], count: int) -> float:
        return predict_ttft(self.load(rank), per_request, self.shape, self.core.step_estimator, count)

    def predict(self, prompt_tokens: int, qos: QoSClass, priority: Optional[int] = None, count: int = 1) -> float:
        """The calibrated TTFT prediction the decision uses."""
        rank = self._rank(qos, priority, self.clock())
        per_request = max(1, prompt_tokens // max(1, count))
        return self.calibration * self._raw_prediction(per_request, rank, count)

    def check(self, prompt_tokens: int, qos: QoSClass, priority: Optional[int] = None, count: int = 1,
              max_tokens: Optional[int] = None) -> None:
        """APIError 429 `slo_unattainable` when the predicted TTFT is past `headroom` of the class's target.
        `prompt_tokens` counts all `count` engine requests together; `max_tokens` is each one's."""
        count = max(1, count)
        per_request = max(1, prompt_tokens // count)
        rank = self._rank(qos, priority, self.clock())
        learn_from = 0.0  # raw prediction to check against the first token; 0 when the wait hardly matters
        if math.isfinite(qos.ttft_target_s):
            raw = self._raw_prediction(per_request, rank, count)
            predicted = self.calibration * raw
            if raw >= CALIBRATE_ABOVE * qos.ttft_target_s:
                learn_from = raw
            if predicted > self.headroom * qos.ttft_target_s:
                self.num_shed += 1
                self._reserved = None
                retry = max(self.retry_after_min_s, math.ceil(predicted - qos.ttft_target_s))
                logger.debug("shed: predicted TTFT %.2fs > target %.2fs (class %s)", predicted, qos.ttft_target_s,
                             qos.name)
                raise APIError(
                    429,
                    f"server is overloaded: the predicted time to first token ({predicted:.1f}s) is past "
                    f"{self.headroom:.0%} of the {qos.name!r} class's target ({qos.ttft_target_s:g}s), the most this "
                    f"server admits; retry later",
                    code=SHED_CODE, headers={"Retry-After": str(retry)})
        decode = max_tokens if max_tokens is not None else self.core.max_model_len - per_request
        self._reserved = (Work(per_request, max(0, decode - 1), 0), rank, count, learn_from)

