"""Scheduling policies, selected by name. A new policy is one file plus one line here."""
from __future__ import annotations

from sloserve.sched.policies.base import SchedulingPolicy
from sloserve.sched.policies.edf import EDFPolicy
from sloserve.sched.policies.fcfs import FCFSPolicy
from sloserve.sched.policies.priority import PriorityPolicy
from sloserve.sched.policies.slo import SLOPolicy
from sloserve.sched.policies.vtc import VTCPolicy

POLICIES: dict[str, type[SchedulingPolicy]] = {p.name: p for p in (FCFSPolicy, PriorityPolicy, EDFPolicy, SLOPolicy,
                                                                     VTCPolicy)}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose from {sorted(POLICIES)}") from None


__all__ = ["SchedulingPolicy", "EDFPolicy", "FCFSPolicy", "PriorityPolicy", "SLOPolicy", "VTCPolicy", "POLICIES",
           "make_policy"]
