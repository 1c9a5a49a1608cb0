"""FleetSpec: what the fleet controller runs, described once for the real fleet (`sloserve serve
--instances`) and the simulated one (`sloserve simulate`, `plan`, the evaluation suite).

One set of defaults: a policy tuned in the simulator is the policy the real fleet runs unless a
flag says otherwise. The spec holds only the controller's side (routing, migration, P/D roles and
hand-off, autoscaling); what each backend adds (hardware and links for the simulator, worker
processes and the HTTP edge for the real fleet) stays in that backend's config, which holds a
spec (`simulation.FleetConfig.fleet`, `workers.fleet.FrontConfig.fleet`); both fleets and the
evaluation assemble their controller from it with `cluster.assembly.build_controller`.

"P:D" pairs (`pd`, `pd_min`) are parsed here and nowhere else: the spec holds them as (P, D).

A spec comes from one set of CLI flags (`cli/fleet_args.py`, shared by both commands) or a YAML
file with the same names (`--fleet fleet.yaml`; the flags given on the command line win)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Mapping, Optional

from sloserve.core.config import PoolSettings, parse_instance_range

Pair = tuple[int, int]  # (prefill instances, decode instances)

PD_TRANSFERS = ("blocking", "live", "pipelined")
# CLI flag (dashes as underscores) -> FleetSpec field, where the two names differ; a fleet file
# takes either name.
FLAG_FIELDS = {
    "migration_interval": "migration_interval_s", "capacity": "capacity_rps", "scaling_interval": "scaling_interval_s",
    "scale_down_delay": "scale_down_delay_s", "stable_window": "stable_window_s", "pd_prefill": "prefill_pool",
    "pd_decode": "decode_pool",
}
PREDICTOR_AUTO = "auto"  # the packaged predictor where a policy reads predictions, none elsewhere
PREDICTED_ROUTERS = ("predicted-load",)  # routers that read the output-length predictor


@dataclass(frozen=True)
class FleetSpec:
    # instances: the most that run (with `autoscale`, `min_instances` is the fewest)
    instances: int = 1
    min_instances: Optional[int] = None  # None: `instances` (fixed), or 1 with `autoscale`
    router: str = "least-requests"
    decode_router: Optional[str] = None  # picks a hand-off's decode instance; None: `router`
    router_seed: int = 0  # seeds the randomized routers (power-of-two)
    router_epsilon: float = 0.25  # prefix-affinity's load bound: an instance takes up to (1 + e) x the mean
    predictor: str = PREDICTOR_AUTO  # auto | default | none | a `sloserve train-predictor` file
    migration: str = "none"  # comma-separated policies (cluster/migration)
    migration_interval_s: float = 0.5  # how often the controller plans moves
    # Prefill/decode disaggregation: (P, D) instance counts (then `instances` is P + D; a spec
    # given only `pd` gets P + D instances; "P:D" text is parsed on construction); the copy of a
    # hand-off (pipelined: the decode instance is picked at arrival and gets each KV block as the
    # prefill computes it; blocking: all of it after the first token; live: pre-copy rounds while
    # the prefill instance keeps decoding, real fleet only); per-pool scheduler overrides.
    pd: Optional[Pair] = None
    pd_transfer: str = "pipelined"
    prefill_pool: PoolSettings = field(default_factory=PoolSettings)
    decode_pool: PoolSettings = field(default_factory=PoolSettings)
    mixed_handoff: str = "never"  # cluster/mixed_handoff: a mixed instance hands a stream it prefilled on
    mixed_handoff_tokens: Optional[int] = None  # prefill-pressure's queued prompt tokens (None: its default)
    # Autoscaling (cluster/autoscale): a policy, or None for a fixed fleet. `capacity_rps`: what one
    # instance sustains within the SLOs; a P/D fleet scales each pool between `pd_min` and `pd`,
    # with `pd_capacity` (prefill, decode) req/s per instance.
    autoscale: Optional[str] = None
    capacity_rps: Optional[float] = None
    pd_min: Optional[Pair] = None
    pd_capacity: Optional[tuple[float, float]] = None
    scaling_interval_s: float = 10.0
    scale_down_delay_s: float = 300.0  # a lower target holds this long before an instance drains
    target_utilization: float = 0.8
    stable_window_s: float = 60.0  # reactive/hybrid: demand averaged over this window
    forecaster: str = "seasonal-naive"
    forecast_level: float = 0.9  # predictive/hybrid plan for the top of this band of the forecast

    def __post_init__(self) -> None:
        for name in ("pd", "pd_min"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, parse_pd(value, "--pd-min" if name == "pd_min" else "--pd"))
        if isinstance(self.pd_capacity, str):
            object.__setattr__(self, "pd_capacity", parse_pd_capacity(self.pd_capacity))
        elif self.pd_capacity is not None:
            object.__setattr__(self, "pd_capacity", tuple(float(c) for c in self.pd_capacity))
        if self.pd is not None and self.instances == 1:  # `pd` alone: P + D instances
            object.__setattr__(self, "instances", sum(self.pd))

    def with_pd(self, pd: "Optional[Pair | str]", **changes: Any) -> "FleetSpec":
        """This spec as a fleet of `pd` (None: colocated, keeping its instance count), with `changes`."""
        if pd is None:
            return replace(self, pd=None, **changes)
        pair = parse_pd(pd)
        return replace(self, pd=pair, **{"instances": sum(pair), **changes})

    # ---- derived ---------------------------------------------------------------------
    @property
    def roles(self) -> tuple[str, ...]:
        """Each instance's role: P prefill then D decode, or all `mixed`."""
        if self.pd is None:
            return ("mixed",) * self.instances
        p, d = self.pd
        return ("prefill",) * p + ("decode",) * d

    @property
    def pd_text(self) -> Optional[str]:
        """`pd` as the flag writes it ("P:D"), None for a colocated fleet."""
        return None if self.pd is None else pair_text(self.pd)

    @property
    def pool_bounds(self) -> dict[str, tuple[int, int]]:
        """(fewest, most) instances of each pool the autoscaler plans: "mixed", or "prefill" and
        "decode" (a P/D fleet scales each between `pd_min`, default 1:1, and `pd`)."""
        if self.pd is None:
            return {"mixed": (self.fewest, self.instances)}
        low = self.pd_min or (1, 1)
        return {"prefill": (low[0], self.pd[0]), "decode": (low[1], self.pd[1])}

    @property
    def fewest(self) -> int:
        """The fewest instances that run (the most without autoscaling)."""
        if self.min_instances is not None:
            return self.min_instances
        return 1 if self.autoscale else self.instances

    @property
    def handoff_tokens(self) -> int:
        from sloserve.cluster.mixed_handoff import DEFAULT_QUEUED_TOKENS

        return DEFAULT_QUEUED_TOKENS if self.mixed_handoff_tokens is None else self.mixed_handoff_tokens

    @property
    def resolved_predictor(self) -> Optional[str]:
        """The predictor the fleet loads: None (off), "default" (packaged) or a file."""
        if self.predictor == PREDICTOR_AUTO:
            reads = self.router in PREDICTED_ROUTERS or self.decode_router in PREDICTED_ROUTERS
            return "default" if reads else None
        return None if self.predictor == "none" else self.predictor

    @property
    def scaling_extra(self) -> dict[str, float]:
        """What the autoscalers read beside ScalingOptions' shared fields."""
        return {"interval_s": self.scaling_interval_s, "stable_window_s": self.stable_window_s}

    # ---- checks ----------------------------------------------------------------------
    def validate(self) -> None:
        """ValueError (one line, in the CLI's words) on a spec no fleet can run."""
        from sloserve.cluster.autoscale import AUTOSCALERS
        from sloserve.cluster.forecast import FORECASTERS
        from sloserve.cluster.migration import make_migration_policy
        from sloserve.cluster.mixed_handoff import make_mixed_handoff
        from sloserve.cluster.routers import ROUTERS

        if self.instances < 1:
            raise ValueError("--instances must be >= 1")
        for name in (self.router, self.decode_router):
            if name is not None and name not in ROUTERS:
                raise ValueError(f"unknown router {name!r}; choose from {sorted(ROUTERS)}")
        if self.pd is not None and sum(self.pd) != self.instances:
            raise ValueError(f"--pd {self.pd_text} makes {sum(self.pd)} instances but --instances is "
                             f"{self.instances}")
        if self.router_epsilon < 0:
            raise ValueError("--router-epsilon must be >= 0")
        if self.pd_transfer not in PD_TRANSFERS:
            raise ValueError(f"unknown --pd-transfer {self.pd_transfer!r}; use one of {', '.join(PD_TRANSFERS)}")
        if not self.migration_interval_s > 0:
            raise ValueError(f"--migration-interval must be > 0 s, got {self.migration_interval_s}")
        make_migration_policy(self.migration)  # an unknown name fails here
        make_mixed_handoff(self.mixed_handoff, self.handoff_tokens)
        if self.pd is not None and self.mixed_handoff != "never":
            raise ValueError("--mixed-handoff hands off between mixed instances; a --pd fleet has none")
        if self.pd is None and self.mixed_handoff == "never" and self.decode_router:
            raise ValueError("--decode-router needs --pd P:D or --mixed-handoff")
        if self.pd is None and (self.prefill_pool != PoolSettings() or self.decode_pool != PoolSettings()):
            raise ValueError("--pd-prefill and --pd-decode need --pd P:D")
        if self.autoscale is None:
            if self.min_instances not in (None, self.instances):
                raise ValueError("--instances MIN:MAX needs --autoscale POLICY")
            if self.pd_min is not None or self.pd_capacity is not None:
                raise ValueError("--pd-min and --pd-capacity need --pd and --autoscale")
            return
        if self.autoscale not in AUTOSCALERS:
            raise ValueError(f"unknown autoscaler {self.autoscale!r}; choose from {sorted(AUTOSCALERS)}")
        if self.forecaster not in FORECASTERS:
            raise ValueError(f"unknown forecaster {self.forecaster!r}; choose from {sorted(FORECASTERS)}")
        if not 0 < self.forecast_level < 1:
            raise ValueError(f"--forecast-level must be in (0, 1), got {self.forecast_level:g}")
        if not self.scaling_interval_s > 0 or self.scale_down_delay_s < 0 or not 0 < self.target_utilization <= 1 \
                or not self.stable_window_s > 0:
            raise ValueError("need --scaling-interval > 0, --scale-down-delay >= 0, 0 < --target-utilization <= 1 "
                             "and --stable-window > 0")
        if self.pd is not None:
            if self.min_instances is not None:
                raise ValueError("a --pd fleet takes its pools' bounds from --pd (the most) and --pd-min (the "
                                 "fewest), not --instances MIN:MAX")
            if not all(1 <= low <= high for low, high in self.pool_bounds.values()):
                raise ValueError(f"--pd-min {pair_text(self.pd_min)} needs 1 <= min <= --pd {self.pd_text} in "
                                 "each pool")
            if self.pd_capacity is not None and not all(c > 0 for c in self.pd_capacity):
                raise ValueError("--pd-capacity needs two positive rates, P_RPS:D_RPS")
        else:
            if self.pd_min is not None:
                raise ValueError("--pd-min needs --pd (the most instances of each pool)")
            if not 0 <= self.fewest <= self.instances:
                raise ValueError(f"--instances MIN:MAX needs 0 <= MIN <= MAX, got {self.fewest}:{self.instances}")
            if self.capacity_rps is not None and not self.capacity_rps > 0:
                raise ValueError(f"--capacity must be > 0 req/s, got {self.capacity_rps:g}")

    # ---- files -----------------------------------------------------------------------
    def as_dict(self) -> dict[str, Any]:
        """The spec as a YAML file writes it (pools as their SPEC strings)."""
        out = asdict(self)
        for key in ("pd", "pd_min"):
            out[key] = None if getattr(self, key) is None else pair_text(getattr(self, key))
        for key in ("prefill_pool", "decode_pool"):
            out[key] = pool_text(getattr(self, key))
        if self.pd_capacity is not None:
            out["pd_capacity"] = ":".join(f"{c:g}" for c in self.pd_capacity)
        return out

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], base: Optional["FleetSpec"] = None, where: str = "fleet") \
            -> "FleetSpec":
        """`base` (default: the defaults) with the settings of `raw` (a YAML file's mapping: field
        names or the CLI flags' names, dashes or underscores; `instances` may be "MIN:MAX")."""
        known = {f.name for f in fields(cls)}
        changes: dict[str, Any] = {}
        for key, value in raw.items():
            name = str(key).replace("-", "_")
            name = FLAG_FIELDS.get(name, name)
            if name == "instances" and isinstance(value, str):
                low, high = parse_instance_range(value)
                changes["instances"] = high
                if low != high:
                    changes["min_instances"] = low
                continue
            if name not in known:
                raise ValueError(f"{where}: unknown setting {key!r}; known: {', '.join(sorted(known))}")
            if name in ("prefill_pool", "decode_pool"):
                value = PoolSettings.parse(str(value or ""))
            changes[name] = value  # "P:D" texts are parsed by the constructor
        return replace(base or cls(), **changes)

    @classmethod
    def load(cls, path: str | Path, base: Optional["FleetSpec"] = None) -> "FleetSpec":
        import yaml

        text = Path(path).read_text()
        raw = yaml.safe_load(text) or {}
        if not isinstance(raw, Mapping):
            raise ValueError(f"{path}: a fleet file is a mapping of settings, got {type(raw).__name__}")
        return cls.from_mapping(raw.get("fleet", raw) if isinstance(raw.get("fleet"), Mapping) else raw,
                                base, where=str(path))


def parse_pd(text: "str | Pair", flag: str = "--pd") -> Pair:
    """`--pd P:D` -> (prefill instances, decode instances), both at least 1 (a pair passes through,
    checked)."""
    try:
        p, d = (int(x) for x in (text.split(":") if isinstance(text, str) else text))
    except (TypeError, ValueError):
        raise ValueError(f"{flag} takes P:D (prefill:decode instance counts), got {text!r}") from None
    if p < 1 or d < 1:
        raise ValueError(f"{flag} needs at least one prefill and one decode instance, got {pair_text((p, d))}")
    return p, d


def pair_text(pair: tuple) -> str:
    """(P, D) as the flags write it: "P:D"."""
    return ":".join(f"{x:g}" if isinstance(x, float) else str(x) for x in pair)


def parse_pd_capacity(text: Optional[str]) -> Optional[tuple[float, float]]:
    """`--pd-capacity P_RPS:D_RPS` -> (req/s of one prefill instance, of one decode instance)."""
    if text is None:
        return None
    try:
        p, d = (float(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--pd-capacity takes P_RPS:D_RPS (two numbers), got {text!r}") from None
    return p, d


def pool_text(pool: PoolSettings) -> str:
    """`pool` as `--pd-prefill` writes it ("" for no change)."""
    names = {v: k for k, v in PoolSettings.KEYS.items()}
    return ",".join(f"{names[f.name]}={getattr(pool, f.name)}" for f in fields(pool)
                    if getattr(pool, f.name) is not None)
