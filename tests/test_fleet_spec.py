"""One description of a fleet (cluster/spec.FleetSpec): `serve` and `simulate` define the
controller's options once and resolve them to the same spec, the real fleet's FrontConfig and the
simulated fleet's FleetConfig built from one spec run the controller with the same settings (and
their defaults are the same), a YAML file describes the same spec, and flags given win over it."""
from __future__ import annotations

from dataclasses import fields

import pytest

from sloserve.cli import build_parser
from sloserve.cluster.spec import FleetSpec
from sloserve.cli.fleet_args import resolve_fleet_args
from sloserve.core.config import PoolSettings
from sloserve.front.multi import front_config
from sloserve.simulation import FleetConfig
from sloserve.workers.fleet import FrontConfig

# FleetSpec fields both backend configs carry flat, under the same name and meaning.
# Left out, with why: instances/min_instances/pd/prefill_pool/decode_pool (the real fleet holds them
# as slots, roles and worker specs), predictor (each config holds the resolved one: compared below),
# capacity_rps/pd_min/pd_capacity (the real front keeps them as 0.0 and tuples).
SHARED = ("router", "decode_router", "migration", "migration_interval_s", "pd_transfer", "mixed_handoff",
          "mixed_handoff_tokens", "autoscale", "scaling_interval_s", "scale_down_delay_s", "target_utilization",
          "stable_window_s", "forecaster", "forecast_level")

NON_DEFAULT = ["--instances", "2:6", "--router", "predicted-load", "--migration", "balance,defrag",
               "--migration-interval", "0.25", "--autoscale", "reactive", "--capacity", "3",
               "--scaling-interval", "20", "--scale-down-delay", "120", "--target-utilization", "0.7",
               "--stable-window", "30", "--forecaster", "gbm", "--forecast-level", "0.8"]
PD = ["--pd", "2:3", "--pd-transfer", "blocking", "--decode-router", "least-kv", "--pd-prefill", "budget=4096",
      "--pd-decode", "seqs=64"]


def resolved(command: str, argv: list[str]) -> FleetSpec:
    args = build_parser().parse_args([command, *argv])
    spec = resolve_fleet_args(args)
    assert spec is not None
    return spec


def test_every_config_field_the_spec_shares_exists_on_both_backends():
    names = {f.name for f in fields(FleetSpec)}
    for name in SHARED:
        assert name in names and hasattr(FrontConfig(), name) and hasattr(FleetConfig(), name), name


@pytest.mark.parametrize("argv", [[], NON_DEFAULT, PD], ids=["defaults", "autoscaled", "disaggregated"])
def test_serve_and_simulate_resolve_the_same_flags_to_the_same_spec(argv):
    served, simulated = resolved("serve", argv), resolved("simulate", argv)
    assert served == simulated
    served.validate()


@pytest.mark.parametrize("argv", [[], NON_DEFAULT, PD], ids=["defaults", "autoscaled", "disaggregated"])
def test_one_spec_builds_both_fleets_with_the_same_controller_settings(argv):
    spec = resolved("serve", argv)
    real, simulated = front_config(spec), FleetConfig.from_spec(spec)
    diff = {name: (getattr(real, name), getattr(simulated, name)) for name in SHARED
            if getattr(real, name) != getattr(simulated, name)}
    assert not diff, diff
    assert real.predictor == simulated.predictor == spec.resolved_predictor
    assert simulated.spec.instances == spec.instances and simulated.spec.pd == spec.pd


def test_the_two_configs_default_alike():
    real, simulated, spec = FrontConfig(), FleetConfig(), FleetSpec()
    diff = {name: (getattr(real, name), getattr(simulated, name)) for name in SHARED
            if getattr(real, name) != getattr(simulated, name)}
    assert not diff, diff
    assert real.predictor == simulated.predictor == spec.resolved_predictor is None
    assert real.router == "least-requests" and real.pd_transfer == "pipelined"


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
        FleetConfig.from_spec(spec).validate()


def test_a_fixed_part_of_a_fleet_drops_what_only_scaling_and_hand_offs_use():
    pd = FleetConfig.from_spec(FleetSpec(instances=4, pd="2:2", decode_router="least-kv", autoscale="reactive",
                                         prefill_pool=PoolSettings(max_num_seqs=8), pd_min="1:1",
                                         pd_capacity=(2.0, 3.0)))
    pd.validate()
    colocated = pd.fixed(instances=1, pd=None)
    colocated.validate()  # no decode router, pool overrides or P/D bounds left to refuse
    assert (colocated.autoscale, colocated.pd_min, colocated.pd_capacity, colocated.decode_router) == \
        (None, None, None, None)
    assert colocated.prefill_pool == PoolSettings()
    pools = pd.fixed()
    pools.validate()
    assert (pools.pd, pools.decode_router, pools.prefill_pool.max_num_seqs) == ("2:2", "least-kv", 8)


def test_the_simulator_refuses_the_real_fleets_live_transfer():
    with pytest.raises(ValueError, match="real fleet's"):
        FleetConfig.from_spec(FleetSpec(instances=2, pd="1:1", pd_transfer="live")).validate()


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
    assert (written.instances, written.router, written.migration, written.predictor) == \
        (3, "predicted-load", "balance", "default")
    assert resolved("serve", ["--fleet", str(out / "fleet.yaml")]) == written
