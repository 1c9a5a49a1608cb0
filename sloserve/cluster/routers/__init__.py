"""Routing policies, selected by name. A new policy is one file plus one line here."""
from __future__ import annotations

from typing import Optional

from sloserve.cluster.routers.base import Router, RouterOptions
from sloserve.cluster.routers.least_kv import LeastKVRouter
from sloserve.cluster.routers.least_requests import LeastRequestsRouter
from sloserve.cluster.routers.power_of_two import PowerOfTwoRouter
from sloserve.cluster.routers.predicted_load import PredictedLoadRouter
from sloserve.cluster.routers.prefix_affinity import PrefixAffinityRouter
from sloserve.cluster.routers.round_robin import RoundRobinRouter

ROUTERS: dict[str, type[Router]] = {r.name: r for r in (
    RoundRobinRouter, LeastRequestsRouter, LeastKVRouter, PowerOfTwoRouter, PrefixAffinityRouter, PredictedLoadRouter)}


def make_router(name: str, options: Optional[RouterOptions] = None) -> Router:
    try:
        cls = ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r}; choose from {sorted(ROUTERS)}") from None
    return cls.from_options(options or RouterOptions())


__all__ = ["Router", "RouterOptions", "ROUTERS", "make_router", "RoundRobinRouter", "LeastRequestsRouter",
           "LeastKVRouter", "PowerOfTwoRouter", "PrefixAffinityRouter", "PredictedLoadRouter"]
