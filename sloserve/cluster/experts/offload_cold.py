from __future__ import annotations

import math
from typing import Sequence

from sloserve.cluster.experts.base import ExpertPlacer, pack
from sloserve.expert_layout import ExpertPlacement


class OffloadColdPlacer(ExpertPlacer):
    """The coldest `offload_share` of each layer's experts live in host memory (fetched over the
    host link when a step routes a token to them, prefetched while the layer before computes), the
    rest packed evenly on the GPUs, one copy each: device memory freed for KV (MoE-Infinity,
    Fiddler-style offloading), paid in PCIe transfers when a cold expert is hit."""

    name = "offload-cold"

    def place(self, popularity: Sequence[Sequence[float]], gpus: int) -> ExpertPlacement:
        layers = []
        for pop in popularity:
            cold = math.floor(self.offload_share * len(pop))
            order = sorted(range(len(pop)), key=lambda e: pop[e])
            counts = [1] * len(pop)
            for e in order[:cold]:
                counts[e] = 0
            layers.append(pack(pop, counts, gpus))
        return ExpertPlacement(gpus, tuple(layers))
