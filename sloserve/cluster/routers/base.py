"""The routing interface, shared by the real multi-instance server and the simulator.

A router sees the request and one `InstanceState` per instance and returns an index. It never
reads the wall clock and draws randomness only from the RNG it was given, so a simulated run
is reproducible and the same object routes a live fleet.
"""
from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional, Sequence

from sloserve.sched.state import InstanceState
from sloserve.core.types import Request


@dataclass
class RouterOptions:
    """Knobs shared by the policies; each policy takes the ones it uses.

    `predictions` looks up the output-length distribution of a request (see
    `sloserve.cluster.predict`); routers that need one fall back to a prior without it.
    """

    seed: int = 0
    rng: Optional[random.Random] = None  # injected RNG; otherwise one seeded with `seed`
    epsilon: float = 0.25  # bounded-load slack: an instance may take up to (1 + epsilon) x the mean load
    predictions: Optional[Callable[[Request], object]] = None

    def make_rng(self) -> random.Random:
        return self.rng if self.rng is not None else random.Random(self.seed)


class Router(ABC):
    name: ClassVar[str]

    @classmethod
    def from_options(cls, options: RouterOptions) -> "Router":
        """Build the policy from shared options (policies without knobs ignore them)."""
        return cls()

    @abstractmethod
    def route(self, request: Request, states: Sequence[InstanceState]) -> int:
        """Index of the instance (into `states`) that should serve `request`."""


def argmin(n: int, key: Callable[[int], object]) -> int:
    """Index in range(n) with the smallest key; ties go to the lowest index (deterministic)."""
    best, best_key = 0, None
    for i in range(n):
        k = key(i)
        if best_key is None or k < best_key:  # type: ignore[operator]
            best, best_key = i, k
    return best
