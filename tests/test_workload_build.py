"""Transforms, class/tenant mixes and the workload pipeline (what `sloserve bench` sends)."""
from __future__ import annotations

import math
import statistics

import pytest

from sloserve.workload import traces
from sloserve.workload.build import WorkloadSpec, build_stream
from sloserve.workload.mix import MixCounts, assign_mix, load_mix, parse_mix
from sloserve.workload.transforms import (clip_lengths, cut, scale_to_rate, spread_ties, time_scale, time_window,
                                          with_arrivals)
from sloserve.workload.arrivals import ArrivalProcess
from sloserve.workload.types import WorkloadRequest, is_sorted_by_arrival

HAVE_DATA = (traces.data_dir() / "azure_llm_2023_conv.csv.gz").is_file()
needs_data = pytest.mark.skipif(not HAVE_DATA, reason="shared traces not found")


def _reqs(times, **kw):
    return [WorkloadRequest(t, 10, 5, request_id=f"r{i}", **kw) for i, t in enumerate(times)]


def test_window_and_time_scale():
    reqs = _reqs([0, 1, 2, 3, 4, 5])
    win = list(time_window(reqs, 2, 2.5))
    assert [r.arrival_s for r in win] == [0, 1, 2] and [r.request_id for r in win] == ["r2", "r3", "r4"]
    assert [r.arrival_s for r in time_scale(win, 2)] == [0, 0.5, 1]
    assert reqs[2].arrival_s == 2  # inputs are never mutated
    with pytest.raises(ValueError):
        list(time_scale(reqs, 0))


def test_scale_to_rate_keeps_the_pattern():
    reqs = _reqs([10, 10.5, 13, 14])  # 3 gaps over 4 s = 0.75 req/s
    scaled = scale_to_rate(reqs, 3.0)
    assert [r.arrival_s for r in scaled] == pytest.approx([0, 0.125, 0.75, 1.0])
    assert [r.arrival_s for r in scale_to_rate(reqs, math.inf)] == [0, 0, 0, 0]


def test_with_arrivals_replaces_times_only():
    reqs = _reqs([0] * 2000)
    out = list(with_arrivals(reqs, ArrivalProcess("poisson", 50.0), seed=1))
    assert out[0].arrival_s == 0 and is_sorted_by_arrival(out)
    assert (len(out) - 1) / out[-1].arrival_s == pytest.approx(50, rel=0.1)
    assert [r.request_id for r in out] == [r.request_id for r in reqs]


def test_spread_ties():
    reqs = _reqs([0, 0, 0, 3, 3, 6])
    out = spread_ties(reqs)
    assert [r.arrival_s for r in out] == pytest.approx([0, 1, 2, 3, 4.5, 6])


def test_clip_lengths_drops_hash_blocks_beyond_the_prompt():
    r = WorkloadRequest(0, 1500, 900, hash_ids=(1, 2, 3), hash_block_size=512, prompt_token_ids=list(range(1500)))
    c = next(clip_lengths([r], max_prompt_len=600, max_output_len=64))
    assert (c.prompt_len, c.output_len, c.hash_ids, len(c.prompt_token_ids)) == (600, 64, (1, 2), 600)
    z = next(clip_lengths([WorkloadRequest(0, 5, 0)]))
    assert z.output_len == 1  # a server cannot be asked for zero tokens


def test_cut_bounds():
    reqs = _reqs([0, 1, 2, 3])
    assert len(cut(reqs, num_requests=2)) == 2
    assert len(cut(reqs, duration_s=2.5)) == 3
    assert len(cut(reqs, num_requests=2, duration_s=2.5)) == 2
    with pytest.raises(ValueError, match="bound"):
        cut(iter(lambda: WorkloadRequest(0, 1, 1), None), duration_s=1, max_requests=50)


MIX = {
    "default_class": "standard",
    "classes": {"interactive": {"ttft_ms": 500, "tbt_ms": 100, "share": 0.25},
                "standard": {"ttft_s": 2, "e2e_s": 30, "share": 0.75}},
    "api_keys": {"sk-a": {"tenant": "alice", "share": 0.5}, "sk-b": "bob"},
}


def test_mix_parse_and_assign(tmp_path):
    mix = parse_mix(MIX)
    assert mix.class_spec("interactive").qos.ttft_target_s == 0.5
    assert mix.class_spec("interactive").qos.tbt_target_s == pytest.approx(0.1)
    assert mix.class_spec("standard").e2e_target_s == 30 and math.isinf(mix.class_spec("standard").qos.tbt_target_s)
    assert mix.api_key("alice") == "sk-a" and mix.api_key("bob") == "sk-b"
    reqs = _reqs([0] * 4000)
    out = list(assign_mix(reqs, mix, seed=3))
    counts = MixCounts.of(out)
    assert counts.classes["interactive"] / 4000 == pytest.approx(0.25, abs=0.03)
    assert counts.tenants["alice"] / 4000 == pytest.approx(0.5, abs=0.03)
    assert out == list(assign_mix(reqs, mix, seed=3))
    f = tmp_path / "classes.yaml"
    f.write_text("classes:\n  gold: {ttft_ms: 100}\n  silver: {ttft_ms: 900}\n")
    assert [c.name for c in load_mix(f).classes] == ["gold", "silver"]
    for bad in ({"classes": {"x": {"ttft": 1}}}, {"clases": {}}, {"classes": {"x": {"ttft_ms": -1}}},
                {"default_class": "nope", "classes": {"x": {}}}):
        with pytest.raises(ValueError):
            parse_mix(bad)


def test_synthetic_poisson_stream():
    reqs = build_stream(WorkloadSpec("synthetic", rate=20.0, num_requests=500, input_len=32, output_len=4, seed=2))
    assert len(reqs) == 500 and {(r.prompt_len, r.output_len) for r in reqs} == {(32, 4)}
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    assert 1 / statistics.fmean(gaps) == pytest.approx(20, rel=0.15)
    same = build_stream(WorkloadSpec("synthetic", rate=20.0, num_requests=500, input_len=32, output_len=4, seed=2))
    assert same == reqs
    burst = build_stream(WorkloadSpec("synthetic", num_requests=5))
    assert [r.arrival_s for r in burst] == [0] * 5


@needs_data
def test_replay_window_and_time_scale():
    full = traces.load_azure(traces.shared_path("azure-conv"))
    spec = WorkloadSpec("azure-conv", replay=True, start_s=600, duration_s=30, time_scale=3.0)
    reqs = build_stream(spec)
    expected = [r for r in full if 600 <= r.arrival_s < 600 + 90]
    assert len(reqs) == len(expected) > 0
    assert [r.arrival_s for r in reqs] == pytest.approx([(r.arrival_s - 600) / 3 for r in expected])
    assert all(r.arrival_s < 30 for r in reqs)


@needs_data
def test_trace_pattern_rescaled_to_rate_and_clipped():
    reqs = build_stream(WorkloadSpec("mooncake-conv", rate=2.0, arrival_process="trace", num_requests=300,
                                     max_prompt_len=2048, max_output_len=16))
    assert len(reqs) == 300
    assert (len(reqs) - 1) / (reqs[-1].arrival_s - reqs[0].arrival_s) == pytest.approx(2.0, rel=1e-6)
    assert max(r.prompt_len for r in reqs) == 2048 and max(r.output_len for r in reqs) <= 16
    assert all(len(r.hash_ids) == math.ceil(r.prompt_len / 512) for r in reqs)
    # the quantized conversation trace is spread, not sent in 3-second bursts
    assert len({r.arrival_s for r in reqs}) > 250


@needs_data
def test_servegen_workload_rate_and_tenants():
    reqs = build_stream(WorkloadSpec("servegen", rate=5.0, duration_s=120, start_s=72000, seed=1))
    assert (len(reqs) / 120) == pytest.approx(5.0, rel=0.3)
    assert len({r.tenant for r in reqs}) > 3 and all(r.tenant.startswith("client-") for r in reqs)
    assert all(r.prompt_text for r in reqs) and is_sorted_by_arrival(reqs)


def test_spec_validation():
    for spec in (WorkloadSpec("synthetic", rate=1.0), WorkloadSpec("synthetic", rate=math.inf, duration_s=5),
                 WorkloadSpec("nope", num_requests=1), WorkloadSpec("synthetic", rate=1.0, replay=True, num_requests=1),
                 WorkloadSpec("synthetic", rate=-1.0, num_requests=1)):
        with pytest.raises(ValueError):
            spec.validate()
    with pytest.raises(ValueError, match="no arrival times"):
        build_stream(WorkloadSpec("synthetic", replay=True, num_requests=3))
