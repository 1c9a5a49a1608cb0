"""The fleet timeline: what the dashboard, `sloserve top` and report.html read.

Units: rates from cumulative counters, per-class percentiles and totals, pollers' cursors,
bounds, JSON. Simulator: recording changes no decision (the same run with and without a
timeline ends every request at the same times), frames fall on the interval, and an
autoscaled, draining fleet's events (scale, start, ready, drain, stop, migrations) are there,
in order, with the instance states the frames show.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from sloserve.simulation import FleetConfig, build_fleet, sim_requests, simulate
from sloserve.timeline import (DRAIN, EVENT_KINDS, INSTANCE_READY, MIGRATION, SCALE, START, STOP, FleetTimeline,
                               InstanceReading)
from test_autoscale import burst_workload, fleet as autoscaled_fleet


def reading(i: int = 0, **kw) -> InstanceReading:
    return InstanceReading(i, **kw)


def test_rates_come_from_the_counters_change_over_the_interval():
    tl = FleetTimeline(interval_s=2.0)
    first = tl.sample(10.0, [reading(0, prefix_queries=100, prefix_hits=50, output_tokens=1000)])
    assert first.instances[0].tokens_per_s == 0.0 and first.instances[0].prefix_hit_rate is None  # no interval yet
    second = tl.sample(12.0, [reading(0, prefix_queries=300, prefix_hits=200, output_tokens=1400, running=3,
                                      kv_blocks_used=5, kv_blocks_total=20)])
    s = second.instances[0]
    assert s.tokens_per_s == 200.0 and s.prefix_hit_rate == 0.75 and s.kv_usage == 0.25 and s.running == 3
    idle = tl.sample(14.0, [reading(0, prefix_queries=300, prefix_hits=200, output_tokens=1400)])
    assert idle.instances[0].prefix_hit_rate is None and idle.instances[0].tokens_per_s == 0.0
    # A worker replaced by a fresh one restarts its counters: no negative rate.
    restarted = tl.sample(16.0, [reading(0, output_tokens=10)])
    assert restarted.instances[0].tokens_per_s == 0.0


def test_classes_get_their_intervals_percentiles_and_totals_since_the_start():
    tl = FleetTimeline()
    for k in range(100):
        tl.finished("interactive", ttft_s=k / 100, tpot_s=0.01, attained=k < 90)
    tl.finished("batch", ttft_s=None, tpot_s=None, attained=True)  # a one-token answer without timing
    frame = tl.sample(1.0, [])
    by = {c.qos_class: c for c in frame.classes}
    inter = by["interactive"]
    assert (inter.finished, inter.attained, inter.attainment) == (100, 90, 0.9)
    assert inter.ttft_s[0] == pytest.approx(0.495) and inter.ttft_s[2] == pytest.approx(0.9801)
    assert by["batch"].ttft_s == (None, None, None) and by["batch"].finished == 1
    assert tl.sample(2.0, []).classes == ()  # the next interval starts empty ...
    assert tl.to_totals() == {"batch": (1, 1), "interactive": (100, 90)}  # ... the totals stay


def test_pollers_get_only_what_they_have_not_seen_and_the_json_is_strict():
    tl = FleetTimeline(interval_s=1.0)
    tl.event(0.5, SCALE, None, "target 2")
    tl.sample(1.0, [reading(0, kv_blocks_total=10)])
    tl.event(1.5, START, 1, "scale up")
    tl.sample(2.0, [reading(0), reading(1, status="starting")])
    everything = tl.to_dict()
    assert [f["t"] for f in everything["frames"]] == [1.0, 2.0] and everything["now"] == 2.0
    assert [e["seq"] for e in everything["events"]] == [1, 2]
    later = tl.to_dict(since=1.0, after_event=1)
    assert [f["t"] for f in later["frames"]] == [2.0] and [e["kind"] for e in later["events"]] == [START]
    # An event recorded after a frame but timed before it still reaches a poller once.
    tl.event(1.9, STOP, 1, "cancelled")
    assert [e["kind"] for e in tl.to_dict(since=2.0, after_event=2)["events"]] == [STOP]
    assert [f["t"] for f in tl.to_dict(last=1)["frames"]] == [2.0] and tl.to_dict(last=0)["frames"] == []
    assert len(tl.to_dict(last=5)["frames"]) == 2
    json.dumps(tl.to_dict(), allow_nan=False)  # no NaN or infinity anywhere
    with pytest.raises(ValueError, match="unknown fleet event"):
        tl.event(3.0, "explosion")
    with pytest.raises(ValueError, match="positive"):
        FleetTimeline(interval_s=0)


def test_a_live_timeline_is_bounded():
    tl = FleetTimeline(max_frames=5, max_events=3)
    for t in range(20):
        tl.sample(float(t), [reading(0)])
        tl.event(float(t), SCALE)
    d = tl.to_dict()
    assert [f["t"] for f in d["frames"]] == [15.0, 16.0, 17.0, 18.0, 19.0]
    assert len(d["events"]) == 3 and d["num_events"] == 20


# ------------------------------------------------------------------ the simulator records it


def scaled() -> FleetConfig:
    return autoscaled_fleet(migration="drain")


@pytest.mark.slow
def test_recording_changes_no_decision_and_shows_the_autoscaled_fleet():
    # Quiet, a burst that needs more instances, quiet again (shorter than the autoscaling test's).
    reqs = burst_workload(((2.0, 200.0), (14.0, 420.0), (1.0, 1100.0)), seed=3, max_prompt=1500, max_output=300)
    plain_records, plain = simulate(build_fleet(scaled()), sim_requests(reqs))
    tl = FleetTimeline(interval_s=5.0, source="simulated", max_frames=10_000)
    records, result = simulate(build_fleet(scaled()), sim_requests(reqs), timeline=tl,
                               met=lambda r: r.ttft_s is not None and r.ttft_s < 1.0)
    # Same decisions: every request starts and ends at the same simulated times.
    assert [(r.ttft_s, r.e2e_s) for r in records] == [(r.ttft_s, r.e2e_s) for r in plain_records]
    assert result.scaling["timeline"] == plain.scaling["timeline"] and result.end_time == plain.end_time

    frames = list(tl.frames)
    assert [f.t for f in frames] == [5.0 * k for k in range(len(frames))]  # on the interval, from 0
    assert frames[-1].t >= result.end_time - 5.0
    assert sum(c.finished for f in frames for c in f.classes) == len(reqs) == tl.to_totals()["default"][0]
    attained = sum(1 for r in records if r.ttft_s < 1.0)
    assert tl.to_totals()["default"][1] == attained
    # Tokens/s over the frames add up to the tokens generated (each interval's count / its length).
    tokens = sum(s.tokens_per_s * 5.0 for f in frames for s in f.instances)
    assert tokens == pytest.approx(sum(r.output_len for r in reqs), rel=1e-6)

    kinds = [e.kind for e in tl.events]
    assert set(kinds) <= set(EVENT_KINDS)
    assert kinds.count(SCALE) >= 2 and kinds.count(START) >= 3 and kinds.count(DRAIN) >= 2 and STOP in kinds
    assert kinds.count(INSTANCE_READY) == kinds.count(START) - sum(1 for e in tl.events if e.kind == STOP
                                                                   and "cancelled" in e.detail)
    assert all(a.t <= b.t for a, b in zip(tl.events, list(tl.events)[1:]))
    # A started slot shows as starting until its cold start ends, then ready.
    start = next(e for e in tl.events if e.kind == START)
    ready = next(e for e in tl.events if e.kind == INSTANCE_READY and e.instance == start.instance)
    assert ready.t - start.t == pytest.approx(60.0)
    between = [f for f in frames if start.t < f.t < ready.t]
    assert between and all(f.instances[start.instance].status == "starting" for f in between)
    assert any(s.status == "stopped" for s in frames[0].instances)
    peak = max(sum(s.status == "ready" for s in f.instances) for f in frames)
    assert peak == max(row[1] for row in result.scaling["timeline"])
    # Drained instances' running requests moved: migrations are listed with their outcome.
    moved = [e for e in tl.events if e.kind == MIGRATION]
    assert len(moved) == result.migration["started"] and all("(drain)" in e.detail for e in moved)


def test_simulate_writes_report_html_with_the_timeline(tmp_path):
    out = tmp_path / "out"
    res = subprocess.run(
        [sys.executable, "-m", "sloserve.cli", "simulate", "--workload", "azure-conv", "--replay", "--duration", "60",
         "--instances", "2", "--hardware", "a10-24g", "--model", "llama-2-7b", "--timeline-interval", "5",
         "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    page = (out / "report.html").read_text()
    start = page.index('<script type="application/json" id="timeline-data">') + len(
        '<script type="application/json" id="timeline-data">')
    data = json.loads(page[start:page.index("</script>", start)])
    assert data["source"] == "simulated" and data["interval_s"] == 5.0
    assert len(data["frames"]) >= 12 and {len(f["instances"]) for f in data["frames"]} == {2}
    completed = json.loads((out / "results.json").read_text())["runs"][0]["outcome"]["completed"]
    assert data["totals"]["default"]["finished"] == completed
    assert not math.isnan(sum(f["instances"][0]["tokens_per_s"] for f in data["frames"]))
