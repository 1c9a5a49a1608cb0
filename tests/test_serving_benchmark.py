"""benchmarks/serving.py's options that change what sloserve runs: told the run's SLO, the server
gets a QoS config it accepts, whose default class carries exactly the --slo targets, and the
slo policy; the run's label says so; asked without an SLO to give, the script refuses."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serving  # noqa: E402

from sloserve.server.qos import load_qos_config  # noqa: E402


def parse(monkeypatch, *argv):
    monkeypatch.setattr(sys, "argv", ["serving.py", *argv])
    return serving.parse_args()


def test_told_the_slo_sloserve_gets_it_as_its_default_class_and_the_slo_policy(monkeypatch, tmp_path):
    args = parse(monkeypatch, "--slo", "ttft=5000,tpot=250", "--sloserve-slo-scheduling",
                 "--sloserve-precision", "bfloat16+none")
    flags = serving.slo_scheduling_args(args, tmp_path)
    assert flags[:2] == ["--scheduling-policy", "slo"] and flags[2] == "--qos-config"
    registry = load_qos_config(flags[3])
    bench = registry.classes[registry.default_class]
    assert math.isclose(bench.ttft_target_s, 5.0) and math.isclose(bench.tbt_target_s, 0.25)
    assert bench.slo == args.slo_targets  # the class's SLO is the one the run measures
    assert serving.label("sloserve", args) == "sloserve bfloat16, slo scheduler"
    assert serving.system_record("sloserve", args)["scheduling"].startswith("slo")


def test_without_the_flag_sloserve_runs_its_defaults(monkeypatch, tmp_path):
    args = parse(monkeypatch, "--slo", "ttft=5000,tpot=250")
    assert serving.slo_scheduling_args(args, tmp_path) == [] and not list(tmp_path.iterdir())
    assert "slo scheduler" not in serving.label("sloserve", args)


@pytest.mark.parametrize("argv", [
    ("--sloserve-slo-scheduling",),  # no SLO to give it
    ("--slo", "e2e=9000", "--sloserve-slo-scheduling"),  # nothing a QoS class can carry
    ("--slo", "ttft=500", "--sloserve-slo-scheduling", "--server-arg=--scheduling-policy=edf"),  # two policies
])
def test_an_slo_scheduling_run_that_cannot_say_what_ran_is_refused(monkeypatch, argv):
    with pytest.raises(SystemExit):
        parse(monkeypatch, *argv)
