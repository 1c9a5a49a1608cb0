from __future__ import annotations

from typing import Optional, Sequence

from sloserve.cluster.experts.base import ExpertPlacer, balanced
from sloserve.expert_layout import ExpertPlacement


class RebalancePlacer(ExpertPlacer):
    """replicate-hot, placed again every `interval_s` (default 10 minutes, as DeepSeek-V3 adjusts its
    redundant experts) from the popularity observed over the last interval; the caller pays for
    the copies that move."""

    name = "rebalance"
    interval_s: Optional[float] = 600.0

    def place(self, popularity: Sequence[Sequence[float]], gpus: int) -> ExpertPlacement:
        return balanced(popularity, gpus, self.redundant)
