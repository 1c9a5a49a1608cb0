"""The stage policy interface (partitions and their pricing: sloserve/stage_layout.py)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Optional

from sloserve.stage_layout import Partition, StageLoad


class StagePolicy(ABC):
    """Decides the partition: once at the start, then at each window's end from what the window
    cost under the partition in force (`decide` returns a new partition, or None to keep it)."""

    name: str = ""

    def __init__(self, window_s: float = 30.0, threshold: float = 0.05, persist: int = 2):
        if not window_s > 0 or threshold < 0 or persist < 1:
            raise ValueError("stage policy: window > 0, threshold >= 0, persist >= 1")
        self.window_s, self.threshold, self.persist = window_s, threshold, persist

    @abstractmethod
    def initial(self, layers: int, stages: int, reference: StageLoad) -> Partition:
        """The partition at start; `reference` is a typical decode step's load (what a profile
        taken before serving would show)."""

    def decide(self, partition: Partition, load: StageLoad, move_s: Callable[[Partition], float]) -> Optional[Partition]:
        return None
