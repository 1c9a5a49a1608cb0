"""What an autoscaler sees and what it answers.

Every decision interval the fleet (simulated or real) shows the controller `ScalingSignals`
(fleet_view.py, with the rest of the vocabulary the fleets and the controller share): how
many instances are ready, starting and draining, the ready ones' state snapshots, the demand
observed so far (requests/s per step), what one instance sustains within the SLOs (the capacity
model), and how long a new instance takes to serve (the cold start). The policy answers with the
number of instances it wants ready and why; the controller (controller.py) turns that into
instances to start and to drain, within min/max, and keeps scale-down from flapping.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from sloserve.fleet_view import ScalingDecision, ScalingSignals


@dataclass
class ScalingOptions:
    target_utilization: float = 0.8  # plan for this share of an instance's capacity
    forecaster: str = "seasonal-naive"  # predictive / hybrid
    level: float = 0.9  # the forecast band whose top capacity is planned for
    history: Optional[np.ndarray] = None  # demand before the run (requests/s per step): trains the forecaster
    history_step_s: Optional[float] = None  # its step (default: the fleet's demand step); a multiple of it
    history_start_s: float = 0.0  # when the history's first step began, in seconds after a midnight
    future: Optional[np.ndarray] = None  # the run's own demand from its start (requests/s per step): the oracle's
    future_step_s: Optional[float] = None
    extra: dict = field(default_factory=dict)


class Autoscaler(ABC):
    name: str = ""

    def __init__(self, options: ScalingOptions) -> None:
        if not 0 < options.target_utilization <= 1:
            raise ValueError(f"target utilization must be in (0, 1], got {options.target_utilization}")
        self.options = options

    @abstractmethod
    def decide(self, signals: ScalingSignals) -> ScalingDecision: ...

    def instances_for(self, rate: float, signals: ScalingSignals) -> int:
        """Instances that carry `rate` requests/s at the target utilization."""
        per = signals.capacity_rps * self.options.target_utilization
        return math.ceil(rate / per - 1e-9) if rate > 0 else 0


__all__ = ["Autoscaler", "ScalingDecision", "ScalingOptions", "ScalingSignals"]
