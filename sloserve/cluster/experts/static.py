from __future__ import annotations

import math
from typing import Sequence

from sloserve.cluster.experts.base import ExpertPlacer
from sloserve.expert_layout import ExpertPlacement


class StaticPlacer(ExpertPlacer):
    """The training layout: experts in id order, a contiguous block per GPU, one copy each,
    whatever their popularity. The baseline every other policy is measured against."""

    name = "static"

    def place(self, popularity: Sequence[Sequence[float]], gpus: int) -> ExpertPlacement:
        per = math.ceil(len(popularity[0]) / gpus)
        return ExpertPlacement(gpus, tuple(tuple((e // per,) for e in range(len(pop))) for pop in popularity))
