"""The routing interface, shared by the real multi-instance server and the simulator."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Sequence

from sloserve.sched.state import InstanceState
from sloserve.types import Request


class Router(ABC):
    name: ClassVar[str]

    @abstractmethod
    def route(self, request: Request, states: Sequence[InstanceState]) -> int:
        """Index of the instance (into `states`) that should serve `request`."""
