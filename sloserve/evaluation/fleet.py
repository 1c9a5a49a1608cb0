"""From a cell's settings and a policy to a simulated fleet, and one run of it.

Every run of the suite goes through `simulate_policy`: the packaged output-length predictor
(length-only, learning online from completed requests) annotates every request for every policy,
so no policy sees the recorded output lengths (as benchmarks/routing.py and sim_migration.py).
"""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields, replace
from functools import lru_cache
from typing import Any, Mapping, Optional, Sequence

from sloserve.bench.metrics import SLO
from sloserve.cluster.spec import FleetSpec
from sloserve.cluster.migration import MIGRATION_POLICIES, CombinedPolicy, parse_migration
from sloserve.core.config import SchedulerConfig
from sloserve.evaluation.workloads import Fit, slo_for
from sloserve.core.records import RequestRecord
from sloserve.sim.simulator import SimResult
from sloserve.core.types import QoSClass
from sloserve.simulation import (FleetConfig, build_cost_model, build_fleet, fleet_gpus, make_predictions,
                                 sim_requests, simulate)
from sloserve.workload.types import WorkloadRequest

PREDICTOR = "default"
# The suite's fleets plan migrations every 0.1 s of simulated time and a P/D fleet picks a
# hand-off's decode instance by KV demand: fixed here, apart from FleetSpec's defaults, so a cell
# measures the same fleet whatever those defaults become.
MIGRATION_INTERVAL_S = 0.1
DECODE_ROUTER = "least-kv"


def scheduler() -> SchedulerConfig:
    """Every instance's step budget and batch bound (as the routing and migration studies)."""
    return SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256)


# A two-class cell's batch class: targets this many times the interactive class's (the cell's SLO).
BATCH_TTFT_X = 10.0
BATCH_TPOT_X = 4.0


@dataclass(frozen=True)
class Setting:
    """A cell's settings, typed: what the simulator is asked to build. `slo` is a multiplier on the
    trace's base TTFT and TPOT targets (workloads.TRACES). No defaults for the fleet: a grid gives
    every one of those settings, in its axes or its `defaults:` (one place says what a cell that
    does not name a setting ran). `interactive` alone has one, for grids with one class of requests:
    the share of requests in the interactive class (the cell's SLO); below 1 the rest are a batch
    class with targets BATCH_TTFT_X and BATCH_TPOT_X times looser, served after it by priority."""

    trace: str
    hardware: str
    model: str
    tp: int
    instances: int
    slo: float
    link: str
    interactive: float = 1.0

    @classmethod
    def of(cls, params: Mapping[str, Any]) -> "Setting":
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise ValueError(f"unknown setting(s) {', '.join(unknown)}; the simulator's are {', '.join(known)}")
        missing = [f.name for f in fields(cls) if f.name not in params and f.default is MISSING]
        if missing:
            raise ValueError(f"a cell needs the setting(s) {', '.join(missing)} (in the grid's axes: or defaults:)")
        setting = cls(str(params["trace"]), str(params["hardware"]), str(params["model"]), int(params["tp"]),
                      int(params["instances"]), float(params["slo"]), str(params["link"]),
                      float(params.get("interactive", 1.0)))
        if not 0 < setting.interactive <= 1:
            raise ValueError(f"interactive is a share of the requests in (0, 1], got {setting.interactive:g}")
        return setting

    @property
    def slo_targets(self) -> SLO:
        """The interactive class's targets (every request's, in a one-class cell)."""
        return slo_for(self.trace, self.slo)

    @property
    def classes(self) -> Optional[dict[str, QoSClass]]:
        """The QoS classes of a two-class cell by name (None: one class, the cell's SLO for all)."""
        if self.interactive >= 1:
            return None
        slo = self.slo_targets
        return {"interactive": QoSClass("interactive", slo.ttft_s, slo.tpot_s, priority=0),  # type: ignore[arg-type]
                "batch": QoSClass("batch", slo.ttft_s * BATCH_TTFT_X, slo.tpot_s * BATCH_TPOT_X,  # type: ignore[operator]
                                  priority=1)}


@dataclass(frozen=True)
class Policy:
    """What the cluster scheduler runs in a cell: a router, a migration spec ("none": routing only),
    and the fleet's layout: colocated (`pd` None) or a prefill:decode split of its instances."""

    router: str
    migration: str = "none"
    pd: Optional[str] = None
    scheduler: str = "fcfs"  # each instance's scheduling policy (sched/policies)
    tiers: str = "device"  # where the prefix cache lives: a name of TIERS
    clock: Optional[str] = None  # the SM clock policy (sched/clocks); None: top clock, no energy books

    @property
    def name(self) -> str:
        name = self.router if self.migration == "none" else f"{self.router} + {self.migration}"
        if self.clock is not None:
            name = f"{self.clock} clocks ({name})"
        if self.scheduler != "fcfs":
            name = f"{self.scheduler} scheduling ({name})"
        if self.tiers != "device":
            name = f"KV {self.tiers} ({name})"
        return name if self.pd is None else f"P:D {self.pd} ({name})"


@dataclass(frozen=True)
class Tiers:
    """The prefix cache's lower tiers (kv/tiers.py) a policy runs with, sized as a DGX-class host:
    host DRAM per GPU, a local NVMe per instance, a store the whole fleet reaches."""

    host_gib_per_gpu: float = 0.0
    disk_gib: float = 0.0
    store_gib: float = 0.0


TIERS = {"device": Tiers(), "+host": Tiers(200.0), "+disk": Tiers(200.0, 2048.0),
         "+store": Tiers(200.0, 2048.0, 8192.0)}


def fleet_config(setting: Setting, policy: Policy) -> FleetConfig:
    spec = FleetSpec(instances=setting.instances, router=policy.router, migration=policy.migration,
                     predictor=PREDICTOR, migration_interval_s=MIGRATION_INTERVAL_S)
    if policy.pd is not None:
        spec = spec.with_pd(policy.pd, decode_router=DECODE_ROUTER)
    cfg = FleetConfig(spec, hardware=setting.hardware, model=setting.model, tp=setting.tp, link=setting.link,
                      scheduler=replace(scheduler(), policy=policy.scheduler), clock_policy=policy.clock)
    if policy.tiers != "device":
        try:
            tiers = TIERS[policy.tiers]
        except KeyError:
            raise ValueError(f"unknown tiers {policy.tiers!r}; choose from {sorted(TIERS)}") from None
        cfg = replace(cfg, cache=replace(cfg.cache, host_tier_gib=tiers.host_gib_per_gpu * setting.tp,
                                         disk_tier_gib=tiers.disk_gib),
                      kv_store_gib=tiers.store_gib, kv_store_link=setting.link)
    cfg.validate()
    return cfg


def migration_policy(spec: str, thresholds: Mapping[str, Mapping[str, Any]]):
    """The migration policy of `spec` with some policies' constructor arguments set (`thresholds`:
    policy name -> {argument: value}); the others as `make_migration_policy` builds them."""
    names = parse_migration(spec)
    stray = sorted(set(thresholds) - set(names))
    if stray:
        raise ValueError(f"thresholds for {', '.join(stray)}, which {spec!r} does not run")
    policies = [MIGRATION_POLICIES[n](**dict(thresholds.get(n, {}))) for n in names]
    return policies[0] if len(policies) == 1 else CombinedPolicy(policies)


def simulate_policy(reqs: Sequence[WorkloadRequest], cfg: FleetConfig,
                    thresholds: Optional[Mapping[str, Mapping[str, Any]]] = None,
                    classes: Optional[Mapping[str, QoSClass]] = None) -> tuple[list[RequestRecord], SimResult]:
    """One run of `reqs` on the fleet `cfg`, every request annotated by the run's own predictor;
    `thresholds`: migration policies' constructor arguments (see `migration_policy`); `classes`:
    the QoS classes the requests name (Setting.classes)."""
    predictions = make_predictions(cfg)
    sim = build_fleet(cfg, predictions)
    if thresholds:
        sim.controller.migration = migration_policy(cfg.fleet.migration, thresholds)  # type: ignore[attr-defined]
    return simulate(sim, sim_requests(reqs, dict(classes) if classes else None, predictions=predictions),
                    predictions=predictions)


def fit_of(setting: Setting) -> Fit:
    """The requests a cell can serve at all (workloads.Fit): within the context of one instance
    (the model's, or its KV pool if smaller), and prompts one idle instance prefills within the
    TTFT target."""
    cfg = fleet_config(setting, Policy("round-robin"))
    _, model, blocks = build_cost_model(cfg)
    context = min(model.max_position_embeddings, blocks * cfg.cache.block_size)
    return Fit(_longest_prompt(cfg.hardware, cfg.model, cfg.tp, context, setting.slo_targets.ttft_s), context)


@lru_cache(maxsize=64)
def _longest_prompt(hardware: str, model: str, tp: int, context: int, ttft_s: Optional[float]) -> int:
    """The longest prompt (to 64 tokens) a lone request gets its first token within `ttft_s` on an
    idle instance; `context` - 1 when every prompt that fits does."""
    if ttft_s is None:
        return context - 1
    cfg = FleetConfig(hardware=hardware, model=model, tp=tp, scheduler=scheduler())

    def alone(tokens: int) -> float:
        records, _ = simulate(build_fleet(cfg), sim_requests([WorkloadRequest(0.0, tokens, 2)]))
        return records[0].ttft_s if records[0].ttft_s is not None else math.inf

    lo, hi = 1, context - 1
    if alone(hi) <= ttft_s:
        return hi
    while hi - lo > 64:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if alone(mid) <= ttft_s else (lo, mid)
    return lo


def gpu_hours(cfg: FleetConfig, seconds: float) -> float:
    """Device-hours of the fleet over `seconds` of simulated time (every instance runs throughout)."""
    return fleet_gpus(cfg) * seconds / 3600.0
