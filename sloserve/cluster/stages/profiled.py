from __future__ import annotations

from sloserve.cluster.stages.base import StagePolicy
from sloserve.stage_layout import Partition, StageLoad, best_partition


class ProfiledStages(StagePolicy):
    """Balanced once, for a typical decode step profiled before serving, and never moved: the
    static answer to the last stage's head, right for decode-heavy load and wrong for prefill."""

    name = "profiled"

    def initial(self, layers: int, stages: int, reference: StageLoad) -> Partition:
        return best_partition(layers, stages, reference)
