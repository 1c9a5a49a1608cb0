"""KV memory tiers: does keeping evicted prefix blocks in host memory, on local disk and in a shared
store serve more requests within the SLO than the device's cache alone?

Candidates: the same fleet with `+host` (200 GiB of host DRAM per GPU), `+disk` (and a 2 TiB NVMe
per instance) and `+store` (and an 8 TiB store every instance reaches over the cell's link):
evaluation/fleet.TIERS. Baseline: the device's cache alone. Every policy routes by prefix affinity
(it matches a prompt against each instance's device cache and its local tiers), so only where the
blocks live differs. Traces without shared prefixes are in the grid on purpose: tiers must not cost
anything there."""
from __future__ import annotations

from sloserve.evaluation.decisions.base import GoodputDecision, Lineup
from sloserve.evaluation.fleet import TIERS, Policy
from sloserve.evaluation.suite import Cell

ROUTER = "prefix-affinity"


class TiersDecision(GoodputDecision):
    name = "tiers"

    def policies(self, cell: Cell) -> Lineup:
        return Lineup(tuple(Policy(ROUTER, tiers=t) for t in TIERS if t != "device"), (Policy(ROUTER),))
