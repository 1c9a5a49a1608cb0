from __future__ import annotations

from typing import Sequence

from sloserve.cluster.routers.base import Router
from sloserve.sched.state import InstanceState
from sloserve.core.types import Request


class RoundRobinRouter(Router):
    """Each instance in turn, blind to load: the baseline every other policy must beat."""

    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0

    def route(self, request: Request, states: Sequence[InstanceState]) -> int:
        choice = self._next % len(states)
        self._next = choice + 1
        return choice
