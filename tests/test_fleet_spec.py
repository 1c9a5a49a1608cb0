"""One description of a fleet (cluster/spec.FleetSpec) and one assembly of its controller
(cluster/assembly.build_controller): `serve` and `simulate` define the controller's options once
and resolve them to the same spec; the real fleet's FrontConfig, the simulated fleet's FleetConfig
and the evaluation suite's fleet hold that spec (no flat copies) and build the same controller from
it; a YAML file describes the same spec, and flags given win over it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fleet_helpers import StandInHandle
from sloserve.cli import build_parser
from sloserve.cluster.spec import FleetSpec
from sloserve.cli.fleet_args import resolve_fleet_args
from sloserve.core.config import PoolSettings
from sloserve.front.multi import build_worker_fleet
from sloserve.simulation import FleetConfig, build_fleet, make_predictions
from sloserve.workers.fleet import FrontConfig

NON_DEFAULT = ["--instances", "2:6", "--router", "predicted-load", "--migration", "balance,defrag",
               "--migration-interval", "0.25", "--autoscale", "reactive", "--capacity", "3",
               "--scaling-interval", "20", "--scale-down-delay", "120", "--target-utilization", "0.7",
               "--stable-window", "30", "--forecaster", "gbm", "--forecast-level", "0.8", "--router-epsilon", "0.1"]
PD = ["--pd", "2:3", "--pd-transfer", "blocking", "--decode-router", "least-kv", "--pd-prefill", "budget=4096",
      "--pd-decode", "seqs=64", "--autoscale", "reactive", "--pd-min", "1:2", "--pd-capacity", "2:5"]
HANDOFF = ["--instances", "3", "--mixed-handoff", "prefill-pressure", "--decode-router", "least-kv",
           "--router", "prefix-affinity"]
CASES = [[], NON_DEFAULT, PD, HANDOFF]
IDS = ["defaults", "autoscaled", "disaggregated", "mixed-handoff"]
SRC = Path(__file__).resolve().parents[1] / "sloserve"


def resolved(command: str, argv: list[str]) -> FleetSpec:
    args = build_parser().parse_args([command, *argv])
    spec = resolve_fleet_args(args)
    assert spec is not None
    return spec


def controller_shape(controller) -> dict:
    """What a controller decides with: its policies by type and their settings."""
    def router(r):
        return (type(r).__name__, getattr(r, "epsilon", None), getattr(r, "predictions", None) is not None)

    migration = controller.migration
    return {"router": router(controller.router), "decode_router": router(controller.decode_router),
            "separate_decode_router": controller.decode_router is not controller.router,
            "migration": sorted(type(p).__name__ for p in getattr(migration, "policies", [migration])),
            "mixed_handoff": type(controller.mixed_handoff).__name__,
            "scalers": {pool: (type(p.autoscaler).__name__, p.min_instances, p.max_instances, p.scale_down_delay_s)
                        for pool, p in controller.scalers.items()}}


@pytest.mark.parametrize("argv", CASES, ids=IDS)
def test_serve_and_simulate_resolve_the_same_flags_to_the_same_spec(argv):
    served, simulated = resolved("serve", argv), resolved("simulate", argv)
    assert served == simulated
    served.validate()


@pytest.mark.parametrize("argv", CASES, ids=IDS)
def test_one_spec_assembles_the_same_controller_for_the_real_and_the_simulated_fleet(argv):
    spec = resolved("serve", argv)
    real = build_worker_fleet(lambda slot: StandInHandle(), FrontConfig(spec))
    simulated_cfg = FleetConfig(spec, hardware="h100-80g", model="llama-3.1-8b")
    simulated = build_fleet(simulated_cfg, make_predictions(simulated_cfg))
    assert real.config.fleet is spec and simulated_cfg.fleet is spec
    ours, theirs = controller_shape(real.controller), controller_shape(simulated.controller)
    # The one difference, by design: an operator may drain a real worker whatever --migration says.
    assert ours.pop("migration") == sorted({"DrainPolicy", *theirs.pop("migration")} - {"NoMigration"})
    assert ours == theirs
    assert [i.role for i in real.instances] == simulated.roles == list(spec.roles)
    assert simulated.migration_interval_s == spec.migration_interval_s


def test_the_evaluation_suite_runs_the_controller_the_spec_describes():
    from sloserve.evaluation.fleet import DECODE_ROUTER, MIGRATION_INTERVAL_S, PREDICTOR, Policy, Setting, fleet_config

    setting = Setting("sharegpt", "h100-80g", "llama-3.1-8b", tp=1, instances=4, slo=1.0, link="infiniband-ndr")
    cfg = fleet_config(setting, Policy("predicted-load", "balance", pd="1:3"))
    spec = FleetSpec(instances=4, router="predicted-load", migration="balance", pd=(1, 3), decode_router=DECODE_ROUTER,
                     predictor=PREDICTOR, migration_interval_s=MIGRATION_INTERVAL_S)
    assert cfg.fleet == spec
    direct = FleetConfig(spec, hardware=cfg.hardware, model=cfg.model, tp=cfg.tp, link=cfg.link)
    assert controller_shape(build_fleet(cfg, make_predictions(cfg)).controller) == \
        controller_shape(build_fleet(direct, make_predictions(direct)).controller)


def test_no_module_outside_the_spec_parses_p_d_and_no_config_copies_the_spec():
    """"P:D" is parsed once, by cluster/spec.py; the backend configs hold a FleetSpec, not its fields."""
    spec_fields = set(FleetSpec.__dataclass_fields__) - {"instances"}  # FleetConfig keeps `initial_instances`
    assert not spec_fields & set(FrontConfig.__dataclass_fields__)
    assert not spec_fields & set(FleetConfig.__dataclass_fields__)
    for path in SRC.rglob("*.py"):
        if path.name == "spec.py" and path.parent.name == "cluster":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                assert name not in ("parse_pd", "parse_pd_capacity"), f"{path.relative_to(SRC)}:{node.lineno}"


def test_p_d_is_a_typed_pair_from_either_spelling():
    assert FleetSpec(pd="1:3") == FleetSpec(pd=(1, 3)) == FleetSpec(instances=4, pd=(1, 3))
    assert FleetSpec(pd="1:3").instances == 4 and FleetSpec(pd="1:3").pd_text == "1:3"
    assert FleetSpec(instances=6, pd=(1, 3)).with_pd("2:4").instances == 6
    with pytest.raises(ValueError, match="--pd takes P:D"):
        FleetSpec(pd="3")
    with pytest.raises(ValueError, match="at least one prefill"):
        FleetSpec(pd="0:2")
    with pytest.raises(ValueError, match="--pd-min"):
        FleetSpec(pd="2:2", pd_min="0:1")


def test_the_predictor_is_loaded_where_a_policy_reads_it():
    assert FleetSpec().resolved_predictor is None
    assert FleetSpec(router="predicted-load").resolved_predictor == "default"
    assert FleetSpec(router="round-robin", predictor="default").resolved_predictor == "default"
    assert FleetSpec(router="predicted-load", predictor="none").resolved_predictor is None


def test_a_fleet_file_describes_the_spec_and_flags_given_win(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text("router: predicted-load\ninstances: '1:4'\nautoscale: reactive\ncapacity: 2.5\n"
                    "scale-down-delay: 90\npd_transfer: blocking\n")  # flag names or field names
    spec = resolved("simulate", ["--fleet", str(path), "--router", "least-kv"])
    assert spec == resolved("serve", ["--fleet", str(path), "--router", "least-kv"])
    assert (spec.router, spec.instances, spec.min_instances, spec.autoscale) == ("least-kv", 4, 1, "reactive")
    assert (spec.capacity_rps, spec.scale_down_delay_s, spec.pd_transfer) == (2.5, 90.0, "blocking")
    again = tmp_path / "again.yaml"  # what a spec writes, it reads back
    import yaml

    again.write_text(yaml.safe_dump(spec.as_dict()))
    assert FleetSpec.load(again) == spec


def test_pool_settings_and_pd_round_trip_through_a_file(tmp_path):
    spec = FleetSpec(instances=5, pd="2:3", prefill_pool=PoolSettings(max_num_batched_tokens=4096),
                     decode_pool=PoolSettings(max_num_seqs=64), autoscale="reactive", pd_min="1:1",
                     pd_capacity=(2.0, 8.0))
    import yaml

    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(spec.as_dict()))
    assert FleetSpec.load(path) == spec
    assert spec.roles == ("prefill",) * 2 + ("decode",) * 3


@pytest.mark.parametrize("spec, message", [
    (FleetSpec(router="nope"), "unknown router"),
    (FleetSpec(instances=3, pd="1:1"), "makes 2 instances"),
    (FleetSpec(pd_transfer="teleport"), "unknown --pd-transfer"),
    (FleetSpec(instances=2, decode_router="least-kv"), "needs --pd"),
    (FleetSpec(instances=2, min_instances=1), "needs --autoscale"),
    (FleetSpec(instances=2, autoscale="reactive", forecast_level=1.5), "forecast-level"),
    (FleetSpec(instances=2, pd="1:1", mixed_handoff="always"), "a --pd fleet has none"),
])
def test_a_spec_no_fleet_can_run_is_one_clear_error(spec, message):
    with pytest.raises(ValueError, match=message):
        spec.validate()


@pytest.mark.parametrize("spec, message", [
    (FleetSpec(instances=2, decode_router="least-kv"), "needs --pd"),
    (FleetSpec(instances=2, pd="1:1", mixed_handoff="always"), "a --pd fleet has none"),
    (FleetSpec(instances=2, migration_interval_s=0.0), "migration-interval"),
])
def test_the_simulated_fleet_checks_the_controller_settings_as_the_spec_does(spec, message):
    with pytest.raises(ValueError, match=message):
        FleetConfig(spec).validate()


def test_a_fixed_part_of_a_fleet_drops_what_only_scaling_and_hand_offs_use():
    pd = FleetConfig(FleetSpec(instances=4, pd="2:2", decode_router="least-kv", autoscale="reactive",
                               prefill_pool=PoolSettings(max_num_seqs=8), pd_min="1:1", pd_capacity=(2.0, 3.0)))
    pd.validate()
    colocated = pd.fixed(instances=1, pd=None).fleet
    FleetConfig(colocated).validate()  # no decode router, pool overrides or P/D bounds left to refuse
    assert (colocated.autoscale, colocated.pd_min, colocated.pd_capacity, colocated.decode_router) == \
        (None, None, None, None)
    assert colocated.prefill_pool == PoolSettings()
    pools = pd.fixed()
    pools.validate()
    assert (pools.fleet.pd, pools.fleet.decode_router, pools.fleet.prefill_pool.max_num_seqs) == ((2, 2), "least-kv", 8)


def test_the_simulator_refuses_the_real_fleets_live_transfer():
    with pytest.raises(ValueError, match="real fleet's"):
        FleetConfig(FleetSpec(instances=2, pd="1:1", pd_transfer="live")).validate()


def test_a_fleet_file_with_an_unknown_setting_is_refused(tmp_path):
    path = tmp_path / "fleet.yaml"
    path.write_text("routr: least-kv\n")
    with pytest.raises(ValueError, match="unknown setting 'routr'"):
        resolved("serve", ["--fleet", str(path)])


def test_a_simulated_fleet_is_written_as_a_file_serve_reads(tmp_path):
    from sloserve.cli import main

    out = tmp_path / "sim"
    assert main(["simulate", "--workload", "sharegpt", "--num-requests", "30", "--rate", "5", "--instances", "3",
                 "--router", "predicted-load", "--migration", "balance", "--out", str(out), "--no-progress"]) == 0
    written = FleetSpec.load(out / "fleet.yaml")
    assert (written.instances, written.router, written.migration, written.resolved_predictor) == \
        (3, "predicted-load", "balance", "default")
    assert resolved("serve", ["--fleet", str(out / "fleet.yaml")]) == written
