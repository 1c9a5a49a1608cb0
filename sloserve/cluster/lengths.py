"""A predicted output-length distribution, as the router consumes it.

Pure Python (no numpy): routers import this, and they run on every arrival. The predictor
(`sloserve.cluster.predict`) produces these; a router that gets none falls back to a prior.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional, Sequence

#: quantile levels every prediction carries
LEVELS: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 0.9)

# Spread of the true length around a predicted median, as ratios at LEVELS: the held-out
# residuals of the length-only model on ShareGPT (see `sloserve train-predictor`'s report),
# rounded. Used when only a point prediction is known.
POINT_SPREAD: tuple[float, ...] = (0.15, 0.45, 1.0, 1.45, 2.2)


@dataclass(frozen=True)
class LengthPrediction:
    """Output-length quantiles: `values[i]` tokens at level `levels[i]` (non-decreasing).

    Between levels the CDF is linear; below the first level it falls linearly to 0 at
    length 0, above the last it reaches 1 at twice the last value (a short, bounded tail:
    the router wants an order of magnitude, not a density)."""

    levels: tuple[float, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.levels) != len(self.values) or not self.levels:
            raise ValueError("levels and values must be non-empty and of equal length")
        if any(b < a for a, b in zip(self.values, self.values[1:])):
            raise ValueError(f"quantile values must be non-decreasing, got {self.values}")

    @classmethod
    def from_point(cls, median: float, spread: Sequence[float] = POINT_SPREAD,
                   levels: Sequence[float] = LEVELS) -> "LengthPrediction":
        return cls(tuple(levels), tuple(max(1.0, median * s) for s in spread))

    @property
    def median(self) -> int:
        return max(1, round(self.quantile(0.5)))

    def quantile(self, q: float) -> float:
        lv, vs = self.levels, self.values
        if q <= lv[0]:
            return vs[0] * q / lv[0] if lv[0] > 0 else vs[0]
        if q >= lv[-1]:
            top = 2.0 * vs[-1]
            return vs[-1] + (top - vs[-1]) * (q - lv[-1]) / (1.0 - lv[-1]) if lv[-1] < 1 else vs[-1]
        i = bisect.bisect_right(lv, q)
        a, b = lv[i - 1], lv[i]
        return vs[i - 1] + (vs[i] - vs[i - 1]) * (q - a) / (b - a)

    def cdf(self, x: float) -> float:
        """P(length <= x)."""
        lv, vs = self.levels, self.values
        if x <= 0:
            return 0.0
        if x < vs[0]:
            return lv[0] * x / vs[0]
        top = 2.0 * vs[-1]
        if x >= top:
            return 1.0
        if x >= vs[-1]:
            return lv[-1] + (1.0 - lv[-1]) * (x - vs[-1]) / (top - vs[-1])
        i = bisect.bisect_right(vs, x)  # vs[i-1] <= x < vs[i]
        a, b = vs[i - 1], vs[i]
        if b == a:
            return lv[i]
        return lv[i - 1] + (lv[i] - lv[i - 1]) * (x - a) / (b - a)

    def survival(self, x: float) -> float:
        """P(length > x): e.g. the chance a request outgrows the KV room left for it."""
        return 1.0 - self.cdf(x)

    def scaled(self, factor: float) -> "LengthPrediction":
        return LengthPrediction(self.levels, tuple(v * factor for v in self.values))


# Output lengths of ShareGPT first turns (cl100k tokens; see shared/data/README.md), at LEVELS:
# the router's prior for a request nobody predicted.
SHAREGPT_PRIOR = LengthPrediction(LEVELS, (48.0, 140.0, 270.0, 413.0, 611.0))


def prediction_for(request, lookup=None) -> LengthPrediction:
    """The best distribution at hand for a request: the predictor's (via `lookup`), else a
    spread around `request.predicted_output_len`, else the ShareGPT prior. Never the
    request's max_tokens: in simulation that is the recorded length (an oracle)."""
    if lookup is not None:
        found: Optional[LengthPrediction] = lookup(request)
        if found is not None:
            return found
    point = getattr(request, "predicted_output_len", None)
    if point is not None:
        return LengthPrediction.from_point(point)
    return SHAREGPT_PRIOR
