"""What the suite measures of one policy in one cell and seed (`CellMetrics`), and how.

- goodput at >= 90% and at >= 99% of requests within the cell's SLO (in a two-class cell, of
  each class's requests within its own targets, the lowest share over the classes): `planning.search_rate`
  over `planning.sustained` probes, so every rate tried is held for `Measure.sustain_s` seconds of
  the window's arrivals and a rate the window cannot hold is never credited (`Goodput.limited`
  then says the answer is a lower bound). Every policy of a cell and seed starts its searches
  from the same rate (the burst throughput of the cell's first baseline), so all of them probe
  the same lattice of rates and two policies that hold the same rate tie exactly; the searches
  of one policy share their runs (a rate is simulated once, whichever target asks);
- the cell's capacity in that seed: the best baseline's goodput at 90%;
- at each of `Measure.loads` x that capacity: SLO attainment, P99 TTFT, P99 TPOT, GPU-hours of the
  run, the migrations completed and bytes they moved (0 without migration), and with a clock
  policy the fleet's joules.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence

from sloserve.bench.metrics import SLO, summarize
from sloserve.evaluation.fleet import Policy, Setting, fit_of, fleet_config, gpu_hours, simulate_policy
from sloserve.evaluation.suite import Measure
from sloserve.evaluation.workloads import available, source
from sloserve.planning import Goodput, Sustained, burst_rate, search_rate, sustained
from sloserve.core.records import RequestRecord
from sloserve.core.types import DEFAULT_QOS, QoSClass
from sloserve.workload.types import WorkloadRequest

TARGETS = (0.9, 0.99)  # attainment of the two goodputs; capacity is the first one's


@dataclass(frozen=True)
class LoadPoint:
    """One run of a policy at `load` x the cell's capacity."""

    load: float
    rate_rps: float
    requests: int
    attainment: float
    p99_ttft_s: float
    p99_tpot_s: float
    gpu_hours: float
    migrations: int
    bytes_moved: float
    joules: float = math.nan  # the fleet's energy over the run, idle time included (clock policies only)

    def as_dict(self) -> dict:
        return dict(vars(self))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LoadPoint":
        return cls(**{k: (math.nan if v is None else v) for k, v in d.items()})


@dataclass(frozen=True)
class CellMetrics:
    """One policy in one cell and seed."""

    policy: str
    seed: int
    goodput90: Goodput
    goodput99: Goodput
    capacity_rps: float  # the cell's capacity in this seed: the best baseline's goodput at 90%
    loads: tuple[LoadPoint, ...]
    runs: int  # simulations this policy took (searches and load points)
    wall_s: float

    @property
    def migrations(self) -> int:
        return sum(p.migrations for p in self.loads)

    @property
    def bytes_moved(self) -> float:
        return sum(p.bytes_moved for p in self.loads)

    @property
    def gpu_hours(self) -> float:
        return sum(p.gpu_hours for p in self.loads)

    def at(self, load: float) -> Optional[LoadPoint]:
        return next((p for p in self.loads if abs(p.load - load) < 1e-9), None)

    def as_dict(self) -> dict:
        return {"policy": self.policy, "seed": self.seed, "goodput90": self.goodput90.as_dict(),
                "goodput99": self.goodput99.as_dict(), "capacity_rps": self.capacity_rps,
                "loads": [p.as_dict() for p in self.loads], "runs": self.runs, "wall_s": self.wall_s,
                "gpu_hours": self.gpu_hours, "migrations": self.migrations, "bytes_moved": self.bytes_moved}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CellMetrics":
        return cls(d["policy"], int(d["seed"]), Goodput.from_dict(d["goodput90"]), Goodput.from_dict(d["goodput99"]),
                   float(d["capacity_rps"]), tuple(LoadPoint.from_dict(p) for p in d["loads"]), int(d["runs"]),
                   float(d["wall_s"]))


def probe_for(setting: Setting, seed: int, measure: Measure) -> Sustained:
    """The requests each rate is tried with: `sustain_s` seconds of the seed's window at that rate
    (at least `sustain_ttfts` TTFT targets; of the requests the cell can serve at all: fleet.fit_of)."""
    fit = fit_of(setting)
    most = available(setting.trace, seed, measure.max_requests, fit)
    if most < 10:
        raise ValueError(f"{setting.trace} seed {seed}: its window has {most} requests the cell can serve, too few")
    sustain = measure.sustain_for(setting.slo_targets.ttft_s)
    draw = source(setting.trace, seed, fit)
    if setting.classes is not None:
        draw = classed(draw, setting.interactive, seed)
    return sustained(draw, min(measure.sample, most), sustain, most)


def classed(draw: Callable[[int], list[WorkloadRequest]], interactive: float,
            seed: int) -> Callable[[int], list[WorkloadRequest]]:
    """`draw` with each request in the interactive or the batch class: request i is interactive
    when (i * golden ratio + seed / 8) mod 1 < `interactive`, so the shares hold in every prefix
    of the stream and a request keeps its class whatever the rate (Setting.classes)."""
    def first(n: int) -> list[WorkloadRequest]:
        return [replace(r, qos_class="interactive" if (i * _GOLDEN + seed / 8) % 1.0 < interactive else "batch")
                for i, r in enumerate(draw(n))]
    return first


_GOLDEN = 0.6180339887498949


def attainment(records: Sequence[RequestRecord], slo: SLO, classes: Optional[Mapping[str, QoSClass]]) -> float:
    """The share of requests within the SLO; with classes, the lowest share over the classes, each
    request judged on its own class's targets (every class must keep it)."""
    if not records:
        return 0.0
    if not classes:
        return sum(slo.met(r) for r in records) / len(records)
    shares = []
    for name, qos in classes.items():
        mine = [r for r in records if r.qos_class == name]
        if mine:
            shares.append(sum(qos.slo.met(r) for r in mine) / len(mine))
    return min(shares)


class PolicyRuns:
    """Runs of one policy in one cell and seed: attainment per rate, simulated once per rate."""

    def __init__(self, setting: Setting, policy: Policy, probe: Sustained,
                 thresholds: Optional[Mapping[str, Mapping[str, Any]]] = None):
        self.setting, self.policy, self.probe = setting, policy, probe
        self.slo: SLO = setting.slo_targets
        self.classes = setting.classes
        if self.classes is None and policy.clock is not None:  # a clock policy spends the slack to the deadlines
            self.classes = {DEFAULT_QOS.name: replace(DEFAULT_QOS, ttft_target_s=self.slo.ttft_s or math.inf,
                                                      tbt_target_s=self.slo.tpot_s or math.inf)}
        self.cfg = fleet_config(setting, policy)
        self.thresholds = thresholds
        self.runs = 0
        self._attained: dict[float, float] = {}

    def attainment(self, tried: Sequence[WorkloadRequest], rate: float) -> float:
        if rate not in self._attained:
            records, _ = simulate_policy(tried, self.cfg, self.thresholds, self.classes)
            self.runs += 1
            self._attained[rate] = sum(self.slo.met(r) for r in records) / max(1, len(tried)) \
                if self.classes is None else attainment(records, self.slo, self.classes)
        return self._attained[rate]

    def goodput(self, target: float, start: float, iters: int) -> Goodput:
        """The highest rate held with >= `target` of requests within the SLO (planning.search_rate)."""
        return search_rate(lambda tried, rate: self.attainment(tried, rate) >= target, self.probe, start, iters)

    def at_load(self, load: float, capacity: float) -> LoadPoint:
        rate = load * capacity
        tried = self.probe(rate)
        records, result = simulate_policy(tried, self.cfg, self.thresholds, self.classes)
        self.runs += 1
        overall = summarize(records, slo=self.slo).overall
        attained = overall.slo_attainment if self.classes is None else attainment(records, self.slo, self.classes)
        return LoadPoint(load, rate, len(tried), float(attained or 0.0),
                         overall.latency["ttft"].p(99), overall.latency["tpot"].p(99),
                         gpu_hours(self.cfg, result.end_time), int(result.migration.get("completed", 0)),
                         float(result.migration.get("bytes", 0.0)), float(result.energy.get("total_j", math.nan)))


def start_rate(setting: Setting, first_baseline: Policy, probe: Sustained) -> float:
    """Where every search of a cell and seed starts: the first baseline's burst throughput."""
    return burst_rate(probe.source(probe.base), fleet_config(setting, first_baseline), setting.slo_targets)


def measure_cell(setting: Setting, candidates: Sequence[Policy], baselines: Sequence[Policy], seed: int,
                 measure: Measure) -> dict[str, CellMetrics]:
    """Every policy of a cell in one seed: baselines first (their goodput at 90% is the capacity the
    load points are fractions of), then the candidates."""
    probe = probe_for(setting, seed, measure)
    start = start_rate(setting, baselines[0], probe)
    searched: dict[str, tuple[PolicyRuns, Goodput, Goodput, float]] = {}
    for policy in (*baselines, *candidates):
        t0 = time.perf_counter()
        runs = PolicyRuns(setting, policy, probe)
        g90, g99 = (runs.goodput(t, start, measure.iters) for t in TARGETS)
        searched[policy.name] = (runs, g90, g99, time.perf_counter() - t0)
    capacity = max(searched[b.name][1].rps for b in baselines)
    out = {}
    for name, (runs, g90, g99, wall) in searched.items():
        t0 = time.perf_counter()
        loads = tuple(runs.at_load(x, capacity) for x in measure.loads) if capacity > 0 else ()
        out[name] = CellMetrics(name, seed, g90, g99, capacity, loads, runs.runs, wall + time.perf_counter() - t0)
    return out
