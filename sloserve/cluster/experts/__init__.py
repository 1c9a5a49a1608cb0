"""Expert placement policies, selected by name; a new one is one file plus one line here."""
from __future__ import annotations

from sloserve.cluster.experts.base import ExpertPlacer, balanced, pack, replicate
from sloserve.cluster.experts.offload_cold import OffloadColdPlacer
from sloserve.cluster.experts.rebalance import RebalancePlacer
from sloserve.cluster.experts.replicate_hot import ReplicateHotPlacer
from sloserve.cluster.experts.static import StaticPlacer

EXPERT_PLACERS: dict[str, type[ExpertPlacer]] = {p.name: p for p in (
    StaticPlacer, ReplicateHotPlacer, OffloadColdPlacer, RebalancePlacer)}


def make_expert_placer(name: str, **options) -> ExpertPlacer:
    try:
        cls = EXPERT_PLACERS[name]
    except KeyError:
        raise ValueError(f"unknown expert placement {name!r}; choose from {sorted(EXPERT_PLACERS)}") from None
    return cls(**options)


__all__ = ["EXPERT_PLACERS", "ExpertPlacer", "balanced", "make_expert_placer", "pack", "replicate"]
