"""The fleet as its controller sees it, and what the controller decides: the vocabulary between
the cluster layer (`cluster/`: routers, migration policies, the fleet controller) and the
instances it drives, simulated (`sim/`) or real (the server's workers).

Instances show themselves as `InstanceView`s (a state snapshot and the requests that could
move); the controller answers with `Move`s, priced by `MoveCosts`; a backend carries them out
and reports back through the `FleetDecisions` calls. It sits below both sides, so neither
imports the other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from sloserve.sched.state import InstanceState
from sloserve.core.types import Request


@dataclass(frozen=True)
class MovableRequest:
    """A running request a policy may move (or, in `InstanceView.waiting`, one queued there)."""

    request_id: str
    num_tokens: int  # prompt + output so far (the KV that moves)
    num_output_tokens: int
    predicted_remaining: int  # predicted remaining decode tokens (0 if unknown)
    priority: int  # effective priority, lower = more important
    ttft_target_s: float = math.inf
    tbt_target_s: float = math.inf
    tbt_s: float = 0.0  # its recent time between tokens on its instance (0 unknown)


# What an instance does in a prefill/decode-disaggregated fleet: `prefill` instances take new
# requests and hand each to a `decode` instance after its first token; `mixed` ones do both.
ROLES = ("mixed", "prefill", "decode")
HANDOFF = "pd-handoff"  # the `Move.reason` of a prefill -> decode hand-off (not a policy's migration)


@dataclass(frozen=True)
class ScalingSignals:
    """What an autoscaler sees at a decision (cluster/autoscale/): how many instances are ready,
    starting and draining, the ready ones' snapshots, the demand observed so far (requests/s per
    `step_s` window; the last value is the latest complete window), what one instance sustains
    within the SLOs (the capacity model), and how long a new instance takes to serve."""

    now: float
    ready: int
    starting: int
    draining: int
    states: Sequence[InstanceState]  # the ready instances'
    demand: Sequence[float]
    step_s: float
    capacity_rps: float
    cold_start_s: float
    held: int = 0  # requests waiting for any instance to be ready (none is: scale from zero)
    pool: str = "mixed"  # whose instances these are: "mixed", or "prefill" / "decode" (scaled apart)

    @property
    def active(self) -> int:
        """Instances that serve now or soon (ready + starting)."""
        return self.ready + self.starting

    def recent_rate(self, window_s: float) -> float:
        """Mean observed demand over the last `window_s` (0 before anything was observed)."""
        if not len(self.demand):
            return 0.0
        n = max(1, min(len(self.demand), round(window_s / self.step_s)))
        return float(sum(self.demand[-n:])) / n

    @property
    def queued(self) -> int:
        return self.held + sum(s.num_waiting for s in self.states)


@dataclass(frozen=True)
class ScalingDecision:
    target: int  # instances wanted ready (starting ones count towards it)
    reason: str


# An instance slot's lifecycle under autoscaling: stopped -> starting (cold start: serves nothing)
# -> ready (routed to) -> draining (out of routing, emptied) -> stopped.
STOPPED, STARTING, READY, DRAINING = "stopped", "starting", "ready", "draining"


@dataclass(frozen=True)
class InstanceSlot:
    instance_id: int
    status: str  # STOPPED, STARTING, READY or DRAINING
    remaining_work: float = 0.0  # e.g. predicted remaining decode tokens (who drains first)


@dataclass(frozen=True)
class ScalingPlan:
    decision: ScalingDecision
    target: int  # after clamping to the fleet's min/max
    start: int = 0  # new instances to start
    undrain: tuple[int, ...] = ()  # draining instances taken back
    cancel: tuple[int, ...] = ()  # starting instances stopped before they serve
    drain: tuple[int, ...] = ()  # ready instances to empty and stop

    @property
    def changes(self) -> bool:
        return bool(self.start or self.undrain or self.cancel or self.drain)


@dataclass(frozen=True)
class InstanceView:
    instance_id: int
    state: InstanceState  # (or a LiveInstanceState in the simulator)
    running: Sequence[MovableRequest]  # requests that may move (decode phase, single choice)
    waiting: Sequence[MovableRequest] = ()  # queued, not admitted (defrag reads the head's need)
    accepting: bool = True  # may receive migrations (healthy, not draining)
    draining: bool = False  # must be emptied (the `drain` policy moves everything off it)


@dataclass(frozen=True)
class Move:
    request_id: str
    source: int  # instance_id
    target: int
    reason: str  # the policy that asked
    kv_bytes: int = 0
    est_copy_s: float = 0.0


@dataclass(frozen=True)
class MoveCosts:
    """What a move costs on this fleet: the KV bytes of a token and the link between two instances."""

    kv_bytes_per_token: float
    link_bandwidth: Callable[[int, int], float]  # bytes/s between two instance ids

    @classmethod
    def uniform(cls, kv_bytes_per_token: float, bandwidth: float) -> "MoveCosts":
        """Every pair of instances joined by the same link."""
        if bandwidth <= 0:
            raise ValueError(f"link bandwidth must be positive, got {bandwidth}")
        return cls(kv_bytes_per_token, lambda source, target: bandwidth)

    def kv_bytes(self, num_tokens: int) -> int:
        return int(num_tokens * self.kv_bytes_per_token)

    def copy_time(self, num_tokens: int, source: int, target: int) -> float:
        """Seconds to copy `num_tokens` tokens of KV from `source` to `target`."""
        return num_tokens * self.kv_bytes_per_token / self.link_bandwidth(source, target)

    def move(self, request: MovableRequest, source: int, target: int, reason: str) -> Move:
        """A move of `request`, priced (bytes and copy time of its whole KV as it is now)."""
        return Move(request.request_id, source, target, reason, self.kv_bytes(request.num_tokens),
                    self.copy_time(request.num_tokens, source, target))


class FleetDecisions(Protocol):
    """What a fleet backend asks of its controller (`cluster.controller.FleetController`)."""

    @property
    def migration_enabled(self) -> bool: ...

    @property
    def counters(self) -> dict[str, float]: ...

    def route(self, request: Request, states: Sequence[InstanceState]) -> int: ...

    def route_decode(self, request: Request, states: Sequence[InstanceState]) -> int: ...

    def plan_migrations(self, now: float, views: Sequence[InstanceView], costs: MoveCosts) -> list[Move]: ...

    def started(self, move: Move) -> None: ...

    def finished(self, move: Move, ok: bool, now: float, bytes_sent: int | None = None,
                 downtime_s: float = 0.0) -> None: ...

    def plan_scaling(self, signals: ScalingSignals, slots: Sequence[InstanceSlot]) -> ScalingPlan | None: ...
