"""What the scheduler may ask about time: how long a step would take, how long a swap would.

The scheduler never measures time itself. SLO-aware decisions (chunk size from TBT slack,
relegation, swap vs recompute) need *estimates*, so an executor-side object is injected:
the simulator passes its cost model, the engine a profiled model or an estimator fitted
online to the step durations it measures. Pure Python: no torch, no wall clock.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

from sloserve.kv.tiers import DISK, HOST, STORE
from sloserve.sched.plan import StepPlan


@dataclass(frozen=True)
class StepLoad:
    """The few numbers that decide a step's cost: what the scheduler's estimators price, what
    the simulator's cost models price, what the engine's step trace records."""

    num_tokens: int = 0  # new tokens computed (prefill chunks + decodes)
    num_sampled: int = 0  # rows that go through the LM head
    num_decodes: int = 0
    decode_context: int = 0  # sum over decodes of the tokens each attends to
    prefill_attention: float = 0.0  # sum over chunks of n * (start + (n + 1) / 2): attended (query, key) pairs
    prefill_context: int = 0  # sum over chunks of start + n: KV the chunks read
    swap_blocks: int = 0  # KV blocks copied between device and host before the step (either way; swap and host tier)
    disk_blocks: int = 0  # KV blocks loaded from the local-disk tier (on the step's critical path)
    store_blocks: int = 0  # KV blocks loaded from the shared store
    # Blocks saved to the (host, disk, store) tiers: written behind the step's compute (a copy
    # stream, background writers), so they cost time only when they outlast it.
    saves: tuple[int, int, int] = (0, 0, 0)

    @staticmethod
    def prefill(num_tokens: int, start: int = 0, samples: bool = True) -> "StepLoad":
        """One prefill chunk of `num_tokens` after `start` cached tokens."""
        if num_tokens <= 0:
            return StepLoad()
        return StepLoad(num_tokens, int(samples), 0, 0, num_tokens * (start + (num_tokens + 1) / 2),
                        start + num_tokens)

    @staticmethod
    def decodes(num_decodes: int, decode_context: int) -> "StepLoad":
        """A pure-decode step of `num_decodes` requests attending to `decode_context` tokens in all."""
        return StepLoad(num_decodes, num_decodes, num_decodes, decode_context, 0.0, 0)

    def __add__(self, other: "StepLoad") -> "StepLoad":
        return StepLoad(self.num_tokens + other.num_tokens, self.num_sampled + other.num_sampled,
                        self.num_decodes + other.num_decodes, self.decode_context + other.decode_context,
                        self.prefill_attention + other.prefill_attention,
                        self.prefill_context + other.prefill_context, self.swap_blocks + other.swap_blocks,
                        self.disk_blocks + other.disk_blocks, self.store_blocks + other.store_blocks,
                        tuple(a + b for a, b in zip(self.saves, other.saves)))  # type: ignore[arg-type]

    @staticmethod
    def of_plan(plan: StepPlan) -> "StepLoad":
        tokens = sampled = decodes = dctx = pctx = 0
        pattn = 0.0
        for s in plan.scheduled:
            n = s.num_new_tokens
            tokens += n
            sampled += s.num_sampled
            if n == 1:
                decodes += 1
                dctx += s.start + 1
            elif s.draft_token_ids:
                decodes += n
                dctx += n * s.start + n * (n + 1) // 2
            else:
                pattn += n * (s.start + (n + 1) / 2)
                pctx += s.start + n
        tier = plan.tier_ops
        if not tier:
            return StepLoad(tokens, sampled, decodes, dctx, pattn, pctx, len(plan.swap_out) + len(plan.swap_in))
        loads = {HOST: 0, DISK: 0, STORE: 0}
        saves = {HOST: 0, DISK: 0, STORE: 0}
        for op in tier.loads:
            loads[op.tier] += 1
        for op in tier.saves:
            saves[op.tier] += 1
        for op in tier.promotes:  # behind the step too, bound by the source tier's link
            saves[op.tier] += 1
        saves[DISK] += len(tier.spills)  # host evictions written back to the disk, behind the step
        return StepLoad(tokens, sampled, decodes, dctx, pattn, pctx, len(plan.swap_out) + len(plan.swap_in) + loads[HOST],
                        loads[DISK], loads[STORE], (saves[HOST], saves[DISK], saves[STORE]))


@runtime_checkable
class StepCostEstimator(Protocol):
    """Seconds a step of this load would take on the executor under the scheduler."""

    def estimate(self, load: StepLoad) -> float: ...


@runtime_checkable
class SwapCostEstimator(Protocol):
    """Seconds to copy `num_blocks` KV blocks one way between device and host memory."""

    def swap_time(self, num_blocks: int) -> float: ...


@runtime_checkable
class TierCostEstimator(Protocol):
    """Seconds to move `num_blocks` KV blocks one way between the device and a lower tier."""

    def tier_time(self, tier: str, num_blocks: int) -> float: ...


@dataclass
class LinkSwapCost:
    """Swap time from a link bandwidth (measured by the engine, or modelled) and the block size
    in bytes; `bandwidth` may be updated while serving as copies are measured."""

    bytes_per_block: float
    bandwidth: float  # bytes per second, one direction
    latency_s: float = 0.0  # fixed cost per transfer (launch, synchronisation)

    def swap_time(self, num_blocks: int) -> float:
        if num_blocks <= 0:
            return 0.0
        return self.latency_s + num_blocks * self.bytes_per_block / self.bandwidth

    def observe(self, num_blocks: int, seconds: float, smoothing: float = 0.3) -> None:
        """Fold a measured copy into the bandwidth (exponential moving average)."""
        if num_blocks > 0 and seconds > 0:
            measured = num_blocks * self.bytes_per_block / seconds
            self.bandwidth = (1 - smoothing) * self.bandwidth + smoothing * measured


@dataclass
class TierLinkCosts:
    """A `TierCostEstimator` from one link per tier (host: the swap link; disk: the file system;
    store: the network to the store), each measured by the engine or modelled by the simulator."""

    links: dict[str, LinkSwapCost]

    def tier_time(self, tier: str, num_blocks: int) -> float:
        link = self.links.get(tier)
        return float("inf") if link is None else link.swap_time(num_blocks)

    def observe(self, tier: str, num_blocks: int, seconds: float) -> None:
        link = self.links.get(tier)
        if link is not None:
            link.observe(num_blocks, seconds)


class OnlineStepEstimator:
    """A linear step-time model fitted online (recursive least squares with forgetting) to the
    durations an executor reports: t = c0 + c1 * new tokens + c2 * attended (query, key) pairs.

    Why online: a real engine's speed depends on the machine, threads and model; a few dozen
    steps are enough to price chunk sizes, and forgetting lets it follow a changing machine.
    Until it has seen `warmup` steps it answers from the prior coefficients. After that, a
    coefficient the measurements do not determine (its fitted value within two standard errors
    of zero) is answered from the prior as well: steps that barely vary a feature (a server that
    has seen only short prefills beside one-token decodes) leave its coefficient to the noise,
    and on a shared CPU one stalled step then fits prefill tokens as free, which prices every
    load-or-recompute and chunking decision wrong. Estimates use the coefficients clamped at
    zero, so a longer step is never estimated cheaper (the chunk-size search relies on that).
    """

    _SCALE = (1.0, 1e-3, 1e-6)  # feature scaling keeps the RLS well conditioned

    def __init__(self, prior: tuple[float, float, float] = (5e-3, 2e-4, 1e-8),
                 forgetting: float = 0.995, warmup: int = 8) -> None:
        self.prior = tuple(prior)
        self.forgetting = forgetting
        self.warmup = warmup
        self.num_observed = 0
        self._w = [c / s for c, s in zip(prior, self._SCALE)]  # coefficients in scaled units
        n = len(self._w)
        # A large initial covariance: the prior is weak, measurements dominate quickly.
        self._p = [[(1e4 if i == j else 0.0) for j in range(n)] for i in range(n)]
        # The residuals, weighted as the RLS weighs the steps: their sum of squares (from the a
        # priori and a posteriori errors, the standard RLS identity) and their count.
        self._sse = 0.0
        self._count = 0.0
        self._coefficients = self.prior  # what `estimate` uses: refitted once per observed step

    @property
    def coefficients(self) -> tuple[float, ...]:
        return self._coefficients

    def _determined(self) -> tuple[float, ...]:
        """The fitted coefficients, each replaced by its prior where the fit does not determine it."""
        variance = self._sse / max(1.0, self._count - len(self._w))  # of one step's residual
        return tuple(w * s if w > 2.0 * math.sqrt(max(0.0, self._p[i][i] * variance)) else max(0.0, prior)
                     for i, (w, s, prior) in enumerate(zip(self._w, self._SCALE, self.prior)))

    @staticmethod
    def _features(load: StepLoad) -> tuple[float, float, float]:
        return (1.0, float(load.num_tokens), load.decode_context + load.prefill_attention)

    def estimate(self, load: StepLoad) -> float:
        if load.num_tokens <= 0:
            return 0.0
        return sum(c * f for c, f in zip(self.coefficients, self._features(load)))

    def observe(self, load: StepLoad, seconds: float) -> None:
        """Fold in one measured step."""
        if load.num_tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return
        x = [f * s for f, s in zip(self._features(load), self._SCALE)]
        n, p, lam = len(x), self._p, self.forgetting
        px = [sum(p[i][j] * x[j] for j in range(n)) for i in range(n)]
        denom = lam + sum(x[i] * px[i] for i in range(n))
        gain = [v / denom for v in px]
        err = seconds - sum(w * xi for w, xi in zip(self._w, x))
        self._w = [w + g * err for w, g in zip(self._w, gain)]
        self._p = [[(p[i][j] - gain[i] * px[j]) / lam for j in range(n)] for i in range(n)]
        after = seconds - sum(w * xi for w, xi in zip(self._w, x))
        self._sse = lam * self._sse + err * after
        self._count = lam * self._count + 1.0
        self.num_observed += 1
        if self.num_observed >= self.warmup:
            self._coefficients = self._determined()


class DecodeRowCosts:
    """Measured durations of pure-decode steps by their number of rows (a moving average per row
    count), interpolated between the counts seen. At a few rows a step's cost is not linear in
    its rows (a packed kernel's crossover, the LM head per row), and a linear model fitted over
    prefill steps prices a row at a prefill token's cost; speculation decides between exactly
    such steps (n rows or n + drafts), so it asks this first."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self._seconds: dict[int, float] = {}

    def observe(self, load: StepLoad, seconds: float) -> None:
        rows = load.num_tokens
        if rows <= 0 or rows != load.num_decodes or not seconds > 0 or not math.isfinite(seconds):
            return  # a step with prefill chunks says nothing about decode rows
        old = self._seconds.get(rows)
        self._seconds[rows] = seconds if old is None else (1 - self.smoothing) * old + self.smoothing * seconds

    def estimate(self, rows: int) -> Optional[float]:
        """Seconds for a pure-decode step of `rows` rows; None outside the counts measured."""
        known = self._seconds
        if rows in known:
            return known[rows]
        below = max((r for r in known if r < rows), default=None)
        above = min((r for r in known if r > rows), default=None)
        if below is None or above is None:
            return None
        w = (rows - below) / (above - below)
        return (1 - w) * known[below] + w * known[above]


def prefill_time(estimator: Optional[StepCostEstimator], start: int, num_tokens: int, chunk: int) -> float:
    """The least time the prefill of `num_tokens` tokens after `start` can take: alone on the
    instance, in chunks of the full step budget. 0 without an estimator (a lower bound still)."""
    if estimator is None or num_tokens <= 0:
        return 0.0
    chunk = max(1, chunk)
    total, pos, left = 0.0, start, num_tokens
    while left > 0:
        n = min(chunk, left)
        total += estimator.estimate(StepLoad.prefill(n, pos, samples=(n == left)))
        pos += n
        left -= n
    return total
