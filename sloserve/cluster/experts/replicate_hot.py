from __future__ import annotations

from typing import Sequence

from sloserve.cluster.experts.base import ExpertPlacer, balanced
from sloserve.expert_layout import ExpertPlacement


class ReplicateHotPlacer(ExpertPlacer):
    """Placed once, from the popularity measured at deployment: the hottest experts of each layer
    get `redundant` extra copies per GPU, and copies are packed so GPUs carry even loads
    (DeepSeek-V3's redundant experts). Costs the replicas' memory; drifts out of balance as
    popularity moves."""

    name = "replicate-hot"

    def place(self, popularity: Sequence[Sequence[float]], gpus: int) -> ExpertPlacement:
        return balanced(popularity, gpus, self.redundant)
