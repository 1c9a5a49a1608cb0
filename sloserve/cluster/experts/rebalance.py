from __future__ import annotations

from typing import Optional

from sloserve.cluster.experts.replicate_hot import ReplicateHotPlacer


class RebalancePlacer(ReplicateHotPlacer):
    """replicate-hot, placed again every `interval_s` (default 10 minutes, as DeepSeek-V3 adjusts its
    redundant experts) from the popularity observed over the last interval; the caller pays for
    the copies that move."""

    name = "rebalance"
    interval_s: Optional[float] = 600.0
