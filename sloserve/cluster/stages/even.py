from __future__ import annotations

from sloserve.cluster.stages.base import StagePolicy
from sloserve.stage_layout import Partition, StageLoad, even_partition


class EvenStages(StagePolicy):
    """Layers split evenly and never moved: what a pipeline-parallel engine does by default."""

    name = "even"

    def initial(self, layers: int, stages: int, reference: StageLoad) -> Partition:
        return even_partition(layers, stages)
