"""Serving a small and a large model on several GPU types (BOute's problem, MLSys '26): which
queries go to the small model, and how many instances of each model run on which GPU type at
which tensor-parallel degree, chosen together by multi-objective Bayesian optimisation (optuna;
each trial a simulation of the whole deployment on the workload), or one after the other (the
sequential baseline: routing first, for cost at the quality target; then the deployment).

Routing: each query carries a difficulty score in [0, 1] (a router's estimate); the easiest
`share` of queries (a multiple of `share_step`: 0 means no small model at all) go to the small
model. Quality (`QualityModel`): the small model's answer to a query of difficulty s is worth
(1 - gap x s) of the large model's, so sending the easiest share t of uniformly scored queries
keeps 1 - gap x t^2 / 2 of the large model's quality.
The default gap is calibrated to RouteLLM (Ong et al., 2024, arXiv 2406.18665): routers there keep
95% of the strong model's MT-Bench quality while sending about a quarter of the queries to it, so
75% to the small model keeps 95% here (gap = 0.1 / 0.75^2). A deployment's cost is its GPUs'
rental prices (sim/prices.py); its latency the P95 of end-to-end request latency over both fleets.

Objectives are (dollars per hour, log10 P95 latency): the Pareto front is the same under the log,
and the surrogate sees ratios rather than seconds. Constraints (optuna's, >= 0 violated): the
quality target, each GPU type's availability, and an instance for each model that gets queries.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from sloserve.simulation import FleetConfig, build_cost_model, build_mixed_fleet, sim_requests, simulate
from sloserve.sim.prices import PRICES_PER_GPU_HOUR, gpu_price
from sloserve.workload.types import WorkloadRequest

logger = logging.getLogger(__name__)

SMALL, LARGE = "small", "large"
ROLES = (SMALL, LARGE)
UNSERVED_P95_S = 1e4  # the latency a trial is charged when a model gets queries and has no instance
TP_DEGREES = (1, 2, 4, 8)
SAMPLERS = ("gp", "tpe", "nsga2", "random")


@dataclass(frozen=True)
class QualityModel:
    """Relative quality of a routing split (module docstring): 1 - gap x mean(s over the queries
    sent to the small model, counted over all queries)."""

    gap: float = 0.1 / 0.75 ** 2

    def quality(self, scores: np.ndarray, small: np.ndarray) -> float:
        """Quality kept when the queries in the `small` mask go to the small model."""
        return 1.0 - self.gap * float(np.sum(scores[small])) / max(1, len(scores))

    def max_share(self, scores: np.ndarray, target: float, step: float) -> float:
        """The largest share (a multiple of `step`) of the easiest queries the small model may
        answer with `target` quality kept: the routing step of the sequential baseline (the
        most queries on the cheaper model that quality allows)."""
        share = 0.0
        while share + step <= 1.0 + 1e-9 and self.quality(scores, easiest(scores, share + step)) >= target:
            share = round(share + step, 9)
        return share


def easiest(scores: np.ndarray, share: float) -> np.ndarray:
    """Mask of the `share` of queries with the lowest difficulty scores: what a router sending
    queries under a threshold does, the threshold set at that quantile of the scores it has seen."""
    mask = np.zeros(len(scores), dtype=bool)
    mask[np.argsort(scores, kind="stable")[:round(share * len(scores))]] = True
    return mask


@dataclass(frozen=True)
class Option:
    """One way to run one of the two models: an instance of `tp` GPUs of type `hardware`."""

    role: str
    model: str
    hardware: str
    tp: int

    @property
    def key(self) -> str:
        return f"{self.role}:{self.hardware}:tp{self.tp}"


@dataclass(frozen=True)
class Deployment:
    """Instances per option (options with none left out)."""

    counts: tuple[tuple[Option, int], ...]

    @classmethod
    def of(cls, counts: Mapping[Option, int]) -> "Deployment":
        return cls(tuple(sorted(((o, n) for o, n in counts.items() if n > 0), key=lambda x: x[0].key)))

    def instances(self, role: str) -> int:
        return sum(n for o, n in self.counts if o.role == role)

    def gpus(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for o, n in self.counts:
            out[o.hardware] = out.get(o.hardware, 0) + n * o.tp
        return out

    def cost_per_hour(self, prices: Mapping[str, float]) -> float:
        return sum(gpu_price(hw, prices) * n for hw, n in self.gpus().items())

    @property
    def label(self) -> str:
        return " + ".join(f"{n}x{o.role[0].upper()}@{o.hardware}" + (f"/tp{o.tp}" if o.tp > 1 else "")
                          for o, n in self.counts) or "nothing"


@dataclass(frozen=True)
class Problem:
    """What a search decides over: the two models, the GPU types with how many of each there are,
    their prices, the workload (with a difficulty score per query) and the quality target."""

    small_model: str
    large_model: str
    available: Mapping[str, int]  # GPUs of each type
    requests: Sequence[WorkloadRequest]
    scores: np.ndarray  # one difficulty score per request
    quality_target: float = 0.95
    quality: QualityModel = QualityModel()
    prices: Mapping[str, float] = field(default_factory=lambda: dict(PRICES_PER_GPU_HOUR))
    base: FleetConfig = field(default_factory=FleetConfig)  # scheduler and cache settings of every instance
    router: str = "least-requests"
    min_context: int = 8192  # an instance must hold at least this many tokens of KV
    wide_tp: bool = False  # also offer twice the smallest tensor-parallel degree that fits
    share_step: float = 0.05  # routing splits searched: multiples of this share

    def __post_init__(self) -> None:
        if len(self.scores) != len(self.requests):
            raise ValueError("one difficulty score per request")
        if not 0 < self.quality_target <= 1:
            raise ValueError(f"the quality target must lie in (0, 1], got {self.quality_target}")
        if not 0 < self.share_step <= 1:
            raise ValueError(f"the routing step must lie in (0, 1], got {self.share_step}")
        for hw in self.available:
            gpu_price(hw, self.prices)

    def max_share(self) -> float:
        return self.quality.max_share(self.scores, self.quality_target, self.share_step)

    def options(self) -> list[Option]:
        """Per model and GPU type: the smallest tensor-parallel degree that holds the weights and
        `min_context` tokens of KV (and, with `wide_tp`, twice it: fewer, faster instances)."""
        out = []
        for role, model in ((SMALL, self.small_model), (LARGE, self.large_model)):
            for hw, count in self.available.items():
                fitting = [tp for tp in TP_DEGREES if tp <= count and self._fits(model, hw, tp)]
                if fitting:
                    out.extend(Option(role, model, hw, tp) for tp in TP_DEGREES
                               if tp in fitting and tp <= (2 if self.wide_tp else 1) * fitting[0])
        return out

    def _fits(self, model: str, hardware: str, tp: int) -> bool:
        try:
            _, _, blocks = build_cost_model(self.fleet(Option(SMALL, model, hardware, tp), 1))
        except ValueError:
            return False
        return blocks * self.base.cache.block_size >= self.min_context

    def fleet(self, option: Option, count: int) -> FleetConfig:
        return replace(self.base.fixed(instances=count, pd=None, migration="none"), model=option.model,
                       hardware=option.hardware, tp=option.tp)


@dataclass(frozen=True)
class Outcome:
    share: float  # asked to go to the small model
    deployment: Deployment
    cost_per_hour: float
    p95_s: float
    p95_ttft_s: float
    quality: float
    small_share: float
    feasible: bool
    violations: tuple[tuple[str, float], ...] = ()  # (constraint, value): > 0 is violated

    def as_dict(self) -> dict:
        return {"share": self.share, "deployment": self.deployment.label,
                "counts": {o.key: n for o, n in self.deployment.counts}, "cost_per_hour": self.cost_per_hour,
                "p95_s": self.p95_s, "p95_ttft_s": self.p95_ttft_s, "quality": self.quality,
                "small_share": self.small_share, "feasible": self.feasible}


def evaluate(problem: Problem, share: float, deployment: Deployment) -> Outcome:
    """Simulate the deployment on the workload with the easiest `share` of queries on the small
    model: each model's fleet (its groups on their GPU types behind one router) serves the
    queries routed to it. A deployment that breaks a constraint other than quality is not run."""
    small = easiest(problem.scores, share)
    quality = problem.quality.quality(problem.scores, small)
    used = deployment.gpus()
    violations = {"quality": problem.quality_target - quality}
    for hw in sorted(set(used) | set(problem.available)):
        violations[f"gpus:{hw}"] = float(used.get(hw, 0) - problem.available.get(hw, 0))
    routed = {SMALL: [r for r, m in zip(problem.requests, small) if m],
              LARGE: [r for r, m in zip(problem.requests, small) if not m]}
    for role in ROLES:  # a model that gets queries needs an instance
        violations[f"instances:{role}"] = float(bool(routed[role]) - deployment.instances(role))
    latencies: list[float] = []
    ttfts: list[float] = []
    unserved = any(v > 0 for k, v in violations.items() if k != "quality")  # not run: it could not be deployed
    for role in ROLES:
        if unserved or not routed[role]:
            continue
        groups = [problem.fleet(o, n) for o, n in deployment.counts if o.role == role]
        records, _ = simulate(build_mixed_fleet(groups, problem.router), sim_requests(routed[role]))
        latencies += [r.e2e_s if r.success and r.e2e_s is not None else UNSERVED_P95_S for r in records]
        ttfts += [r.ttft_s if r.success and r.ttft_s is not None else UNSERVED_P95_S for r in records]
    p95 = UNSERVED_P95_S if unserved or not latencies else float(np.percentile(latencies, 95))
    p95_ttft = UNSERVED_P95_S if unserved or not ttfts else float(np.percentile(ttfts, 95))
    return Outcome(share, deployment, deployment.cost_per_hour(problem.prices), p95, p95_ttft, quality,
                   float(np.mean(small)) if len(small) else 0.0, all(v <= 0 for v in violations.values()),
                   tuple(sorted(violations.items())))


@dataclass
class SearchResult:
    strategy: str
    outcomes: list[Outcome]

    def front(self) -> list[Outcome]:
        return pareto_front([o for o in self.outcomes if o.feasible])


def pareto_front(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """The outcomes no other beats on both cost and P95 (ties: the first kept), cheapest first."""
    best: list[Outcome] = []
    for o in sorted(outcomes, key=lambda o: (o.cost_per_hour, o.p95_s)):
        if not best or o.p95_s < best[-1].p95_s:
            best.append(o)
    return best


def best_within(front: Sequence[Outcome], budget: float) -> Optional[Outcome]:
    """The lowest-latency outcome costing at most `budget` per hour."""
    within = [o for o in front if o.cost_per_hour <= budget + 1e-9]
    return min(within, key=lambda o: o.p95_s) if within else None


def cheapest_meeting(front: Sequence[Outcome], p95_s: float) -> Optional[Outcome]:
    within = [o for o in front if o.p95_s <= p95_s]
    return min(within, key=lambda o: o.cost_per_hour) if within else None


def hypervolume(outcomes: Sequence[Outcome], ref_cost: float, ref_p95_s: float) -> float:
    """Area the outcomes dominate in (dollars per hour, log10 P95 seconds) below the reference
    point: one number per search, larger is better."""
    area, top = 0.0, math.log10(ref_p95_s)
    front = [o for o in pareto_front(outcomes) if o.cost_per_hour < ref_cost and o.p95_s < ref_p95_s]
    for i, o in enumerate(front):
        right = front[i + 1].cost_per_hour if i + 1 < len(front) else ref_cost
        area += (right - o.cost_per_hour) * (top - math.log10(o.p95_s))
    return area


def make_sampler(name: str, seed: int, startup: int):
    import optuna

    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup)
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=True)
    if name == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=max(4, startup))
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"unknown sampler {name!r}; choose from {list(SAMPLERS)}")


def search(problem: Problem, strategy: str = "joint", trials: int = 60, sampler: str = "gp", seed: int = 0,
           startup: Optional[int] = None,
           on_trial: Optional[Callable[[Outcome], None]] = None) -> SearchResult:
    """`joint`: the routing share and the deployment in one multi-objective search. `sequential`:
    the share first (the largest the quality target allows: routing alone minimises cost by
    sending the most queries to the cheaper model), then the deployment for it, with the same
    number of trials."""
    try:
        import optuna
    except ImportError:
        raise ValueError("the search needs optuna: pip install 'sloserve[place]'") from None

    if strategy not in ("joint", "sequential"):
        raise ValueError(f"unknown strategy {strategy!r}; choose joint or sequential")
    if trials < 1:
        raise ValueError("trials must be >= 1")
    options = problem.options()
    top = problem.max_share()
    for role, model in ((SMALL, problem.small_model), (LARGE, problem.large_model)):
        if not any(o.role == role for o in options) and (top > 0 if role == SMALL else top < 1):
            raise ValueError(f"{model} fits on none of the GPUs given ({', '.join(problem.available)})")
    outcomes: list[Outcome] = []

    def objective(trial: "optuna.Trial") -> tuple[float, float]:
        share = top if strategy == "sequential" else \
            trial.suggest_float("share", 0.0, top, step=problem.share_step) if top > 0 else 0.0
        counts = {o: trial.suggest_int(o.key, 0, problem.available[o.hardware] // o.tp) for o in options}
        out = evaluate(problem, share, Deployment.of(counts))
        for name, value in out.violations:
            trial.set_constraint(name, value)
        outcomes.append(out)
        if on_trial is not None:
            on_trial(out)
        return out.cost_per_hour, math.log10(out.p95_s)

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    startup = startup or max(4, trials // 5)
    study = optuna.create_study(directions=["minimize", "minimize"], sampler=make_sampler(sampler, seed, startup))
    if strategy == "joint" and top > 0:
        # Half the opening trials at routing-first's split (their deployments drawn as usual): the joint
        # space holds the sequential one, and starting there keeps the larger space from costing the
        # slice the sequential search explores.
        for _ in range(startup // 2):
            study.enqueue_trial({"share": top})
    study.optimize(objective, n_trials=trials)
    return SearchResult(strategy, outcomes)


def difficulty_scores(n: int, seed: int = 0) -> np.ndarray:
    """Uniform scores, independent of the query's lengths: the router's estimate of how hard a
    query is, which the traces do not carry."""
    return np.random.default_rng(seed).uniform(0.0, 1.0, n)
