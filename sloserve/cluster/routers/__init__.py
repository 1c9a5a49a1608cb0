"""Routing policies, selected by name. A new policy is one file plus one line here."""
from __future__ import annotations

from sloserve.cluster.routers.base import Router
from sloserve.cluster.routers.least_requests import LeastRequestsRouter
from sloserve.cluster.routers.round_robin import RoundRobinRouter

ROUTERS: dict[str, type[Router]] = {r.name: r for r in (RoundRobinRouter, LeastRequestsRouter)}


def make_router(name: str) -> Router:
    try:
        return ROUTERS[name]()
    except KeyError:
        raise ValueError(f"unknown router {name!r}; choose from {sorted(ROUTERS)}") from None


__all__ = ["Router", "ROUTERS", "make_router", "RoundRobinRouter", "LeastRequestsRouter"]
