"""Where a mixture-of-experts model's experts live inside one expert-parallel instance: per layer,
each expert's copies on the group's GPUs, or none (offloaded to host memory, fetched when a token
needs it). Plain data shared by the placement policies (cluster/experts) and the simulator's MoE
cost model (sim/experts.py), so neither imports the other.

A token routed to an expert with several copies uses one of them, chosen evenly (each copy takes
1/r of the expert's tokens), so replication spreads a hot expert's load over GPUs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

HOST = ()  # the copies of an offloaded expert: none on any GPU


@dataclass(frozen=True)
class ExpertPlacement:
    gpus: int
    layers: tuple[tuple[tuple[int, ...], ...], ...]  # layers[l][e]: GPUs holding a copy of expert e

    def __post_init__(self) -> None:
        for layer in self.layers:
            for copies in layer:
                if len(set(copies)) != len(copies) or any(not 0 <= g < self.gpus for g in copies):
                    raise ValueError(f"an expert's copies must be on distinct GPUs in 0..{self.gpus - 1}: {copies}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_experts(self) -> int:
        return len(self.layers[0]) if self.layers else 0

    def gpu_shares(self, layer: int, popularity: Sequence[float]) -> list[float]:
        """Share of the layer's routed tokens each GPU computes (an offloaded expert's tokens on
        its home GPU, `home`, once its weights have arrived there)."""
        shares = [0.0] * self.gpus
        for e, (p, copies) in enumerate(zip(popularity, self.layers[layer])):
            if not copies:
                shares[self.home(e)] += p
                continue
            part = p / len(copies)
            for g in copies:
                shares[g] += part
        return shares

    def home(self, expert: int) -> int:
        """The GPU that fetches an offloaded expert over its host link and computes it."""
        return expert % self.gpus

    def experts_per_gpu(self, layer: int) -> list[int]:
        counts = [0] * self.gpus
        for copies in self.layers[layer]:
            for g in copies:
                counts[g] += 1
        return counts

    def offloaded(self, layer: int) -> list[int]:
        return [e for e, copies in enumerate(self.layers[layer]) if not copies]

    def slots_per_gpu(self) -> int:
        """Expert copies the fullest GPU holds in its fullest layer: what sizes its memory."""
        return max((max(self.experts_per_gpu(layer)) for layer in range(self.num_layers)), default=0)

    def copies_total(self) -> int:
        return sum(len(copies) for layer in self.layers for copies in layer)

    def moved_copies(self, other: "ExpertPlacement") -> list[int]:
        """Per GPU, the expert copies it must receive to go from this placement to `other`."""
        received = [0] * self.gpus
        for old, new in zip(self.layers, other.layers):
            for old_copies, new_copies in zip(old, new):
                for g in set(new_copies) - set(old_copies):
                    received[g] += 1
        return received

    def straggler(self, popularity: Sequence[Sequence[float]]) -> float:
        """Mean over layers of the busiest GPU's share against an even share (1.0: balanced)."""
        if not self.layers:
            return 1.0
        total = 0.0
        for layer, pop in enumerate(popularity):
            total += max(self.gpu_shares(layer, pop)) * self.gpus
        return total / self.num_layers
