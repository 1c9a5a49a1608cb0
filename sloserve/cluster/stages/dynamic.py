from __future__ import annotations

from typing import Callable, Optional

from sloserve.cluster.stages.base import StagePolicy
from sloserve.stage_layout import Partition, StageLoad, best_partition, even_partition


class DynamicStages(StagePolicy):
    """DynaPipe's idea: watch the stages' times per window, and when the partition in force has
    been slower than the best one for this load by more than `threshold` for `persist` windows in
    a row, move layers to the best one, if the window's gain pays for the move (the instance
    stalls while the moved layers' weights cross the stage link)."""

    name = "dynamic"

    def __init__(self, window_s: float = 30.0, threshold: float = 0.05, persist: int = 2):
        super().__init__(window_s, threshold, persist)
        self._streak = 0

    def initial(self, layers: int, stages: int, reference: StageLoad) -> Partition:
        return even_partition(layers, stages)

    def decide(self, partition: Partition, load: StageLoad, move_s: Callable[[Partition], float]) -> Optional[Partition]:
        best = best_partition(sum(partition), len(partition), load)
        now, then = load.bottleneck(partition), load.bottleneck(best)
        if best == partition or now <= then * (1 + self.threshold):
            self._streak = 0
            return None
        self._streak += 1
        if self._streak < self.persist or now - then <= move_s(best):
            return None
        self._streak = 0
        return best
