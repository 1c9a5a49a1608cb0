"""The instance-scheduling policy interface: one ordering decides admission and preemption."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from sloserve.types import Request


class SchedulingPolicy(ABC):
    """Orders requests: a smaller key is served first and preempted last.

    `static` policies give each request a key that never changes, so the waiting queue
    stays sorted on insertion; dynamic ones (deadline slack) are re-sorted every step.
    """

    name: ClassVar[str]
    static: ClassVar[bool] = True

    @abstractmethod
    def key(self, request: Request, seq: int, now: float) -> Any:
        """`seq` is the request's arrival order at this instance (a stable tie-breaker)."""
