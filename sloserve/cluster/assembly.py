"""One assembly of the fleet controller from a FleetSpec, for every fleet that runs one: the real
fleet (front/multi.py), the simulated one (simulation.build_fleet, build_fluid) and the
evaluation suite (through build_fleet).

What differs between fleets is passed in, never re-derived from flat copies of the spec:
`predictions` (the run's PredictionBook: predicted-load routing reads it), the demand a
forecaster trains on (`history`) or the oracle reads (`future`, simulated runs only), and
`operator_drain`: the real fleet honours an operator's drain request whatever `migration` says,
so it runs the `drain` policy first; a simulated fleet has no operator."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from sloserve.cluster.controller import FleetController
from sloserve.cluster.migration import make_migration_policy
from sloserve.cluster.mixed_handoff import make_mixed_handoff
from sloserve.cluster.routers import RouterOptions, make_router
from sloserve.cluster.spec import FleetSpec

if TYPE_CHECKING:
    from sloserve.cluster.autoscale.base import ScalingOptions
    from sloserve.cluster.autoscale.planner import ScalePlanner
    from sloserve.cluster.predict import PredictionBook


def build_controller(spec: FleetSpec, *, predictions: Optional["PredictionBook"] = None, history: Any = None,
                     future: Any = None, operator_drain: bool = False) -> FleetController:
    """The controller `spec` describes: its router (reading `predictions` where one is given), a
    decode router of its own wherever requests hand off (P/D, or mixed hand-off), its migration
    policies, its mixed hand-off policy and a scale planner per pool when it autoscales."""
    options = RouterOptions(seed=spec.router_seed, epsilon=spec.router_epsilon,
                            predictions=predictions.lookup if predictions is not None else None)
    handoff = make_mixed_handoff(spec.mixed_handoff, spec.handoff_tokens)
    decode_router = make_router(spec.decode_router or spec.router, options) \
        if spec.pd is not None or handoff.hands_off_anything else None
    return FleetController(make_router(spec.router, options), make_migration_policy(migration_names(spec, operator_drain)),
                           decode_router=decode_router, scalers=scale_planners(spec, history, future),
                           mixed_handoff=handoff)


def migration_names(spec: FleetSpec, operator_drain: bool = False) -> str:
    """The migration policies the controller runs: `spec.migration`, after `drain` where an
    operator may ask for one."""
    names = [n.strip() for n in spec.migration.split(",") if n.strip() and n.strip() != "none"]
    if operator_drain:
        names = list(dict.fromkeys(["drain", *names]))
    return ",".join(names) or "none"


def scale_planners(spec: FleetSpec, history: Any = None, future: Any = None) -> dict[str, "ScalePlanner"]:
    """A scale planner per pool (spec.pool_bounds), each with its own autoscaler (policies keep
    state: panic windows, a trained forecaster); none for a fixed fleet."""
    if spec.autoscale is None:
        return {}
    from sloserve.cluster.autoscale.planner import pool_planners

    return pool_planners(spec.autoscale, scaling_options(spec, history, future), spec.pool_bounds,
                         spec.scale_down_delay_s)


def scaling_options(spec: FleetSpec, history: Any = None, future: Any = None) -> "ScalingOptions":
    """The autoscalers' options: the spec's, the demand history (a workload.series.Series) that
    trains a forecaster and, simulated only, the run's own future demand (the oracle)."""
    from sloserve.cluster.autoscale.base import ScalingOptions

    return ScalingOptions(target_utilization=spec.target_utilization, forecaster=spec.forecaster,
                          level=spec.forecast_level, history=None if history is None else history.values,
                          history_step_s=None if history is None else history.step_s,
                          history_start_s=0.0 if history is None else history.start_s,
                          future=None if future is None else future.values,
                          future_step_s=None if future is None else future.step_s, extra=spec.scaling_extra)
