"""The fleet controller's options, defined once for `sloserve serve` and `sloserve simulate` (and
`plan`): `add_fleet_spec_args` adds them, `resolve_fleet_args` turns them into a FleetSpec.

Every option's argparse default is None and its help names the FleetSpec default, so a value from
`--fleet FILE` applies wherever the flag was not given, and a flag given wins over the file.
After `resolve_fleet_args`, `args.fleet_spec` is the spec and each option's attribute holds the
resolved value (so `args.router` reads the same whichever way it was set)."""
from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any, Optional

from sloserve.cluster.spec import FLAG_FIELDS, PD_TRANSFERS, FleetSpec, pair_text
from sloserve.core.config import PoolSettings, parse_instance_range

_DEFAULT = FleetSpec()

# flag -> FleetSpec field, for the options that map one to one
_FLAGS = {flag: FLAG_FIELDS.get(flag, flag) for flag in (
    "router", "decode_router", "router_seed", "router_epsilon", "predictor", "migration", "migration_interval", "pd", "pd_transfer", "mixed_handoff",
    "mixed_handoff_tokens", "autoscale", "capacity", "pd_min", "scaling_interval", "scale_down_delay",
    "target_utilization", "stable_window", "forecaster", "forecast_level")}


def _default(name: str) -> str:
    value = getattr(_DEFAULT, name)
    return "none" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def add_fleet_spec_args(p: argparse.ArgumentParser) -> None:
    """The controller's options (one definition; their defaults live in FleetSpec)."""
    from sloserve.cluster.autoscale import AUTOSCALERS
    from sloserve.cluster.forecast import FORECASTERS
    from sloserve.cluster.migration import MIGRATION_POLICIES
    from sloserve.cluster.mixed_handoff import MIXED_HANDOFFS
    from sloserve.cluster.routers import ROUTERS

    f = p.add_argument_group("fleet controller (the same options and defaults for `serve` and `simulate`)")
    f.add_argument("--fleet", metavar="FILE",
                   help="a YAML file of these settings (names as the flags', e.g. `router: predicted-load`, "
                        "`instances: 2:8`); flags given here win over it")
    f.add_argument("--instances", metavar="N|MIN:MAX",
                   help="instances behind the router (default 1); MIN:MAX with --autoscale (MIN may be 0: scale to "
                        "zero); with --pd, P + D")
    f.add_argument("--router", help=f"routing policy: one of {sorted(ROUTERS)} (default {_default('router')})")
    f.add_argument("--decode-router", metavar="POLICY",
                   help="picks the decode instance of a hand-off (--pd or --mixed-handoff; default: --router)")
    f.add_argument("--router-seed", type=int, help=f"seed of randomized routers (power-of-two; default "
                                                   f"{_default('router_seed')})")
    f.add_argument("--router-epsilon", type=float, help=f"prefix-affinity's load bound: an instance takes up to "
                                                        f"(1 + e) x the mean load (default {_default('router_epsilon')})")
    f.add_argument("--predictor", metavar="auto|default|none|FILE",
                   help="output-length predictor: auto (the packaged one where a policy reads it, i.e. "
                        "predicted-load routing; default), the packaged `default`, a `sloserve train-predictor` "
                        "file, or none")
    f.add_argument("--migration", metavar="POLICIES",
                   help=f"live migration of running requests: none (default) or a comma list of "
                        f"{sorted(MIGRATION_POLICIES)}")
    f.add_argument("--migration-interval", type=float, metavar="S",
                   help=f"how often the controller looks for moves (default {_default('migration_interval_s')} s)")
    f.add_argument("--pd", metavar="P:D",
                   help="prefill/decode disaggregation: P prefill and D decode instances (implies --instances P+D); "
                        "each request's KV moves to a decode instance after its first token")
    f.add_argument("--pd-transfer", choices=PD_TRANSFERS,
                   help=f"the hand-off's copy (default {_default('pd_transfer')}): pipelined (the decode instance is "
                        "picked at arrival and gets each KV block as the prefill computes it), blocking (all of it "
                        "after the first token) or live (pre-copy while the prefill instance keeps decoding; real "
                        "fleet only)")
    f.add_argument("--pd-prefill", metavar="SPEC",
                   help="prefill pool settings: budget=TOKENS,seqs=N,chunk=TOKENS (simulator also tp=N; any subset)")
    f.add_argument("--pd-decode", metavar="SPEC", help="decode pool settings, as --pd-prefill")
    f.add_argument("--mixed-handoff", choices=sorted(MIXED_HANDOFFS),
                   help="without --pd: a request prefilled on one instance decodes on another (picked by "
                        "--decode-router) when this policy says it pays (Llumnix-style; default never)")
    f.add_argument("--mixed-handoff-tokens", type=int, metavar="TOKENS",
                   help="prefill-pressure: hand off when the source has this many prompt tokens queued")
    a = p.add_argument_group("autoscaling (fleet controller)")
    a.add_argument("--autoscale", metavar="POLICY",
                   help=f"start and stop instances between MIN and MAX of --instances: one of {sorted(AUTOSCALERS)}")
    a.add_argument("--capacity", type=float, metavar="RPS", help="requests/s one instance sustains within the SLOs")
    a.add_argument("--pd-min", metavar="P:D", help="with --pd and --autoscale: the fewest prefill and decode "
                   "instances (default 1:1; --pd is the most); each pool is scaled on its own")
    a.add_argument("--pd-capacity", metavar="P_RPS:D_RPS",
                   help="with --pd and --autoscale: requests/s one prefill and one decode instance sustain")
    a.add_argument("--scaling-interval", type=float, metavar="S",
                   help=f"seconds between decisions (default {_default('scaling_interval_s')})")
    a.add_argument("--scale-down-delay", type=float, metavar="S",
                   help=f"a lower target must hold this long before an instance drains (default "
                        f"{_default('scale_down_delay_s')})")
    a.add_argument("--target-utilization", type=float,
                   help=f"share of an instance's capacity planned for (default {_default('target_utilization')})")
    a.add_argument("--stable-window", type=float, metavar="S",
                   help=f"reactive/hybrid: demand is averaged over S seconds (default {_default('stable_window_s')})")
    a.add_argument("--forecaster", help=f"predictive/hybrid: one of {sorted(FORECASTERS)} (default "
                                        f"{_default('forecaster')})")
    a.add_argument("--forecast-level", type=float,
                   help=f"predictive/hybrid: plan for the top of this forecast band (0-1; lower: fewer instances, "
                        f"more risk; default {_default('forecast_level')})")
    a.add_argument("--scaling-history", metavar="SERIES",
                   help="past demand that trains the forecaster: servegen:MODEL or a trace (as `sloserve forecast "
                        "--series`)")


def spec_from_args(args: argparse.Namespace, base: Optional[FleetSpec] = None) -> FleetSpec:
    """The spec the flags describe over `base` (the `--fleet` file's, else the defaults)."""
    if base is None:
        base = FleetSpec.load(args.fleet) if getattr(args, "fleet", None) else FleetSpec()
    changes: dict[str, Any] = {}
    for flag, name in _FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            changes[name] = value
    if getattr(args, "pd_capacity", None) is not None:
        changes["pd_capacity"] = args.pd_capacity  # "P_RPS:D_RPS", parsed by the spec
    for flag, name in (("pd_prefill", "prefill_pool"), ("pd_decode", "decode_pool")):
        if getattr(args, flag, None) is not None:
            changes[name] = PoolSettings.parse(getattr(args, flag))
    instances = getattr(args, "instances", None)
    if instances is not None:
        low, high = parse_instance_range(instances)
        changes.update(instances=high, min_instances=low if ":" in str(instances) else None)
    if "pd" in changes and "instances" not in changes:  # --pd 1:2 alone means 3 instances
        return base.with_pd(changes.pop("pd"), **changes)
    return replace(base, **changes)


def resolve_fleet_args(args: argparse.Namespace) -> Optional[FleetSpec]:
    """Resolve the controller's options of a parsed command line in place (see the module
    docstring); None for a command without them."""
    if not hasattr(args, "router") or not hasattr(args, "fleet"):
        return None
    spec = spec_from_args(args)
    args.fleet_spec = spec
    for flag, name in _FLAGS.items():
        setattr(args, flag, getattr(spec, name))
    args.pd, args.pd_min = spec.pd_text, None if spec.pd_min is None else pair_text(spec.pd_min)
    args.capacity = spec.capacity_rps
    args.pd_capacity = None if spec.pd_capacity is None else ":".join(f"{c:g}" for c in spec.pd_capacity)
    from sloserve.cluster.spec import pool_text

    args.pd_prefill, args.pd_decode = pool_text(spec.prefill_pool), pool_text(spec.decode_pool)
    ranged = spec.pd is None and spec.min_instances is not None and spec.min_instances != spec.instances
    args.instances = f"{spec.min_instances}:{spec.instances}" if ranged else str(spec.instances)
    return spec


