"""Pipeline-stage partition policies (sim/pipeline.py prices them), selected by name; a new one is
one file plus one line here."""
from __future__ import annotations

from sloserve.cluster.stages.base import StagePolicy
from sloserve.stage_layout import Partition, StageLoad, best_partition, even_partition, layers_moved
from sloserve.cluster.stages.dynamic import DynamicStages
from sloserve.cluster.stages.even import EvenStages
from sloserve.cluster.stages.profiled import ProfiledStages

STAGE_POLICIES: dict[str, type[StagePolicy]] = {p.name: p for p in (EvenStages, ProfiledStages, DynamicStages)}


def make_stage_policy(name: str, **options) -> StagePolicy:
    try:
        cls = STAGE_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown stage policy {name!r}; choose from {sorted(STAGE_POLICIES)}") from None
    return cls(**options)


__all__ = ["STAGE_POLICIES", "Partition", "StageLoad", "StagePolicy", "best_partition", "even_partition",
           "layers_moved", "make_stage_policy"]
