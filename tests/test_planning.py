"""Capacity planning: the rate search, and the prefill/decode planner on constructed cases whose
winner follows from the cost model (a 2,048-token prefill chunk of Llama-3.1-8B on an H100 takes
longer than a 30 ms TPOT, so a colocated fleet cannot hold that TPOT while it prefills long
prompts; with a loose TPOT it uses every GPU for both phases and wins)."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from fleet_helpers import sim_config
from sloserve.bench.metrics import SLO
from sloserve.planning import Layout, at_rate, layouts, max_rate, plan
from sloserve.simulation import FleetConfig, PoolSettings
from sloserve.workload.types import WorkloadRequest


def test_max_rate_finds_the_threshold_from_either_side():
    for start in (0.5, 7.0, 40.0):
        found = max_rate(lambda r: r <= 7.3, start, iters=12)
        assert 7.3 * 0.995 <= found <= 7.3
    assert max_rate(lambda r: False, 1.0, iters=3) == 0.0
    assert max_rate(lambda r: True, 1.0, iters=3) == 2.0 ** 12  # capped, never endless


def test_at_rate_keeps_the_pattern():
    reqs = [WorkloadRequest(arrival_s=t, prompt_len=10, output_len=5) for t in (0.0, 1.0, 3.0, 4.0)]
    faster = at_rate(reqs, 3.0)  # native: 3 gaps in 4 s = 0.75 req/s
    assert [r.arrival_s for r in faster] == pytest.approx([0.0, 0.25, 0.75, 1.0])


def long_prompts(n: int = 120) -> list[WorkloadRequest]:
    rng = random.Random(0)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(1.0)
        out.append(WorkloadRequest(arrival_s=t, prompt_len=6000, output_len=64))
    return out


FLEET = sim_config(hardware="h100-80g", model="llama-3.1-8b", router="least-requests")


@pytest.mark.slow
def test_a_tight_tpot_over_long_prompts_is_won_by_a_prefill_heavy_split():
    rows = plan(long_prompts(), FLEET, SLO(ttft_s=2.0, tpot_s=0.03), 4, layouts(4))
    assert [r.per_gpu for r in rows] == sorted((r.per_gpu for r in rows), reverse=True)
    assert rows[0].layout == Layout("3:1")
    colocated = next(r for r in rows if r.layout.pd is None)
    assert rows[0].per_gpu > 1.2 * colocated.per_gpu


@pytest.mark.slow
def test_a_loose_tpot_is_won_by_the_colocated_fleet():
    rows = plan(long_prompts(), FLEET, SLO(ttft_s=2.0, tpot_s=0.2), 4, layouts(4))
    assert rows[0].layout == Layout()
    assert all(r.gpus == 4 for r in rows)


def test_layouts_cover_every_split_and_pool_setting():
    pools = [PoolSettings(max_num_batched_tokens=2048), PoolSettings(max_num_batched_tokens=8192)]
    found = layouts(3, prefill_pools=pools)
    assert [x.label for x in found] == ["colocated", "1:2 P[max_num_batched_tokens=2048]",
                                       "1:2 P[max_num_batched_tokens=8192]", "2:1 P[max_num_batched_tokens=2048]",
                                       "2:1 P[max_num_batched_tokens=8192]"]


def test_plan_command(tmp_path):
    out = tmp_path / "plan"
    cmd = [sys.executable, "-m", "sloserve.cli", "plan", "--workload", "synthetic", "--input-len", "6000",
           "--output-len", "64", "--rate", "1", "--num-requests", "60", "--gpus", "2", "--slo", "ttft=2000,tpot=30",
           "--decode-pools", "seqs=256;seqs=64", "--no-progress", "--out", str(out)]
    # rates held 20 s, not the default minute (test_plan_holds_each_rate_for_a_minute_by_default_and_says_so):
    # 6,000-token prompts at ~7 req/s are ~400 requests a probe at 60 s
    done = subprocess.run(cmd + ["--sustain", "20"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    record = json.loads((out / "plan.json").read_text())
    assert {r["layout"] for r in record["rows"]} == {"colocated", "1:1 D[max_num_seqs=256]", "1:1 D[max_num_seqs=64]"}
    assert (out / "plan.png").stat().st_size > 0 and "best:" in done.stdout
    assert record["sustain_s"] == 20 and all(r["held_s"] >= 20 for r in record["rows"])
    assert "D[max_num_seqs=" in done.stdout  # the best line names pool settings (not read as markup)
    bad = subprocess.run(cmd[:-2] + ["--gpus", "1", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "gpus" in bad.stderr and "Traceback" not in bad.stderr
    bad = subprocess.run(cmd + ["--sustain", "-1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--sustain" in bad.stderr and "Traceback" not in bad.stderr


def test_a_sustained_search_finds_a_rate_that_holds_and_a_squeezed_sample_does_not():
    """With a loose TTFT target, a small sample squeezed to any rate arrives as one burst that the
    fleet absorbs: the search reports a transient (2.5x here). With a minimum duration of arrivals
    per probe, a rate past capacity builds a queue for the whole window; what it finds is the edge
    (at 5 s of TTFT a 60 s window cannot tell a few percent over capacity: the found rate itself
    drops to 72% on 120 s), and 95% of it holds on windows of 120 s, where the transient fails."""
    from sloserve.planning import attainment, goodput, sustained

    def first(n: int) -> list[WorkloadRequest]:
        local = random.Random(1)
        t, out = 0.0, []
        for _ in range(n):
            t += local.expovariate(1.0)
            out.append(WorkloadRequest(arrival_s=t, prompt_len=local.randint(200, 1200), output_len=local.randint(20, 200)))
        return out

    # the stream is a function of n only: the same first n requests every time
    assert [r.prompt_len for r in first(50)] == [r.prompt_len for r in first(80)[:50]]
    fleet = FleetConfig(hardware="a10-24g", model="llama-3.1-8b")
    slo = SLO(ttft_s=5.0, tpot_s=0.2)
    sample = first(60)
    squeezed = goodput(sample, fleet, slo, iters=4)
    probe = sustained(first, len(sample), 60.0, 20000)
    held = goodput(sample, fleet, slo, iters=4, requests_at=probe)
    assert held < 0.7 * squeezed, (held, squeezed)
    longer = sustained(first, len(sample), 120.0, 20000)
    assert attainment(longer(0.95 * held), fleet, slo)[0] >= 0.9
    assert attainment(longer(squeezed), fleet, slo)[0] < 0.5
    # the probe's size: a base sample at low rates, the duration's worth above, capped
    assert len(probe(0.1)) == len(sample) and len(probe(10.0)) == 600 and len(sustained(first, 60, 60.0, 300)(10.0)) == 300


def test_a_search_credits_no_rate_its_sample_cannot_hold():
    """A fleet that absorbs any burst (every probe meets the SLO) is the trap: squeezing a fixed
    sample, the search runs to its bracket's end (2^12 x the start). Held for 60 s of arrivals, a
    rate that would need more requests than the sample gives counts as not met: the answer is the
    most the sample can show, flagged as a lower bound, and it lasted 60 s."""
    from sloserve.planning import search_rate, sustained

    def first(n: int) -> list[WorkloadRequest]:
        return [WorkloadRequest(arrival_s=float(i), prompt_len=100, output_len=10) for i in range(n)]

    def always(tried, rate) -> bool:
        return True

    squeezed = search_rate(always, lambda rate: at_rate(first(50), rate), 1.0, iters=4)
    assert squeezed.rps == 2.0 ** 12 and not squeezed.limited and squeezed.held_s < 0.02
    probe = sustained(first, 50, 60.0, 300)  # 300 requests hold 60 s up to 5 req/s
    held = search_rate(always, probe, 1.0, iters=4)
    assert held.limited and 5.0 / 2 ** (1 / 16) <= held.rps <= 5.0 < held.refused_rps
    assert held.held_s >= 60.0 and held.requests == len(probe(held.rps)) and held.refused_requests == 300
    # a rate that fails on its merits below what the sample holds: an answer, not a bound
    merits = search_rate(lambda tried, rate: rate <= 3.0, probe, 1.0, iters=6)
    assert not merits.limited and 3.0 / 2 ** (1 / 64) <= merits.rps <= 3.0 and merits.held_s >= 60.0
    # a workload that ends before the cap bounds the search the same way
    short_trace = sustained(lambda n: first(min(n, 120)), 50, 60.0, 20000)
    ended = search_rate(always, short_trace, 1.0, iters=4)
    assert ended.limited and ended.rps <= 2.0 and ended.refused_requests == 120


def test_a_capacity_the_sample_cannot_hold_is_a_lower_bound_and_more_of_the_workload_lifts_it(tmp_path, caplog):
    """One A10 serves 1,500-token prompts of 8B at ~2.5 req/s within these targets: far more than the
    0.5 req/s that 30 requests can hold for 60 s. The capacity model says so (a lower bound, warned
    again when read back from the cache), and measures it when it may draw more of the workload."""
    from sloserve import planning
    from sloserve.user_cache import JsonCache

    def first(n: int) -> list[WorkloadRequest]:
        rng = random.Random(2)
        t, out = 0.0, []
        for _ in range(n):
            t += rng.expovariate(1.0)
            out.append(WorkloadRequest(arrival_s=t, prompt_len=1500, output_len=32))
        return out

    cfg = FleetConfig(hardware="a10-24g", model="llama-3.1-8b")
    slo = SLO(ttft_s=2.0, tpot_s=0.2)
    cache = JsonCache(tmp_path / "capacity.json")
    with caplog.at_level("WARNING", logger="sloserve.planning"):
        bound = planning.instance_capacity(first(30), cfg, slo, iters=2, cache=cache)
    assert 0 < bound <= 30 / 60 and "is a lower bound" in caplog.text and "the sample gave 30" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="sloserve.planning"):
        assert planning.instance_capacity(first(30), cfg, slo, iters=2, cache=cache) == bound
    assert "is a lower bound" in caplog.text  # the cache keeps the warning with the number
    caplog.clear()
    with caplog.at_level("WARNING", logger="sloserve.planning"):
        measured = planning.instance_capacity(first(30), cfg, slo, iters=2, cache=cache, more=first)
    assert measured > 1.5 * bound and "lower bound" not in caplog.text
    # and it holds: 60 s at 90% of it meets the SLO
    assert planning.attainment(at_rate(first(round(0.9 * measured * 60)), 0.9 * measured), cfg, slo)[0] >= 0.9


def plan_cmd(out, *extra: str) -> list[str]:
    """A small plan (2 A10s, one bisection step, 2,000-token prompts: ~1 req/s per GPU, so 60 s of
    arrivals is ~100 requests per probe)."""
    return [sys.executable, "-m", "sloserve.cli", "plan", "--workload", "synthetic", "--input-len", "2000",
            "--output-len", "64", "--rate", "1", "--num-requests", "40", "--gpus", "2", "--hardware", "a10-24g",
            "--slo", "ttft=2000,tpot=100", "--iters", "1", "--no-progress", "--out", str(out), *extra]


def test_plan_holds_each_rate_for_a_minute_by_default_and_says_so(tmp_path):
    from sloserve.planning import CAPACITY_SUSTAIN_S, SUSTAIN_S

    assert SUSTAIN_S == CAPACITY_SUSTAIN_S == 60.0
    done = subprocess.run(plan_cmd(tmp_path / "a"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert record["sustain_s"] == SUSTAIN_S and len(record["rows"]) == 2
    for row in record["rows"]:
        # the found rate's probe lasted the minute: more requests than the workload's 40, as many as 60 s need
        assert row["goodput_rps"] > 0 and row["held_s"] >= SUSTAIN_S and not row["lower_bound"] and not row["short"]
        assert row["probe_requests"] >= row["goodput_rps"] * SUSTAIN_S and row["probe_requests"] > 40
    flat = " ".join(done.stdout.split())  # the table's title wraps
    assert "each rate held >= 60 s of arrivals" in flat and "warning" not in flat
    best = next(line for line in done.stdout.splitlines() if line.startswith("best:"))
    assert f"held {round(record['rows'][0]['held_s'])} s of arrivals" in best


def test_plan_marks_rates_its_sample_cannot_hold(tmp_path):
    """--max-requests 50 holds 60 s only up to 0.83 req/s, under what the fleet serves: every row is a
    lower bound, marked, and one line says why. --sustain 0 squeezes the workload's 40 requests into
    a burst of seconds: every row is marked as held less than the default's minute."""
    capped = subprocess.run(plan_cmd(tmp_path / "b", "--max-requests", "50"), capture_output=True, text=True,
                            timeout=300)
    assert capped.returncode == 0, capped.stderr
    rows = json.loads((tmp_path / "b" / "plan.json").read_text())["rows"]
    assert all(r["lower_bound"] and r["held_s"] >= 60 and r["goodput_rps"] <= 50 / 60 for r in rows)
    warning = [line for line in capped.stdout.splitlines() if "warning:" in line]
    assert len(warning) == 1 and "2 of 2 rows (marked >=) are lower bounds" in warning[0]
    assert "--max-requests" in capped.stdout and capped.stdout.count(">=0.") >= 2
    squeezed = subprocess.run(plan_cmd(tmp_path / "c", "--sustain", "0"), capture_output=True, text=True,
                              timeout=300)
    assert squeezed.returncode == 0, squeezed.stderr
    rows = json.loads((tmp_path / "c" / "plan.json").read_text())["rows"]
    assert all(r["short"] and r["held_s"] < 60 and r["probe_requests"] == 40 for r in rows)
    assert "held less than 60 s of arrivals" in squeezed.stdout and "a burst the fleet absorbs" in squeezed.stdout


def test_the_capacity_model_stretches_a_workload_that_has_no_arrival_times(tmp_path, monkeypatch):
    """Synthetic and ShareGPT requests have no arrival times of their own (`--rate` gives the runs
    theirs): sampled as they are, every capacity probe was the same burst at t=0 whatever the rate
    (on one A10, 400 such 2,000-token prompts at once meet a 2 s TTFT at no rate). The sample gets
    the runs' arrival process, and a sample with none is refused."""
    from sloserve import planning
    from sloserve.cli import main

    monkeypatch.setenv("SLOSERVE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "sim"
    assert main(["simulate", "--workload", "synthetic", "--input-len", "2000", "--output-len", "64", "--rate", "1",
                 "--duration", "30", "--instances", "1:2", "--autoscale", "reactive", "--slo", "ttft=2000,tpot=100",
                 "--hardware", "a10-24g", "--no-progress", "--out", str(out)]) == 0
    capacity = json.loads((out / "results.json").read_text())["runs"][0]["config"]["capacity_rps"]
    assert 0.5 < capacity < 3.0
    at_once = [WorkloadRequest(arrival_s=0.0, prompt_len=2000, output_len=64) for _ in range(40)]
    with pytest.raises(ValueError, match="arrive all at once"):
        planning.instance_capacity(at_once, FLEET, SLO(ttft_s=2.0, tpot_s=0.1), cache=None)
