"""Summary metrics, SLOs, result files, markdown, plots and comparison, from hand-made records."""
from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from sloserve.bench.compare import compare_markdown, compare_rows, load_runs
from sloserve.bench.metrics import SLO, Stats, Summary, percentile, summarize
from sloserve.bench.plots import write_plots
from sloserve.core.records import RequestRecord
from sloserve.bench.report import report_markdown, run_markdown
from sloserve.bench.result import BenchResult, load_results, save_results


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        xs = sorted(rng.exponential(size=n).tolist())
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], 50))
    s = Stats.of([3.0, 1.0, 2.0])
    assert (s.count, s.mean, s.min, s.max, s.p(50)) == (3, 2.0, 1.0, 3.0, 2.0)


def _records():
    """6 successes in two classes, a 429 and a dropped stream, over a 10 s run."""
    recs = []
    for i in range(6):
        ttft = 0.1 * (i + 1)
        itl = [0.02 + 0.01 * i] * 4
        recs.append(RequestRecord(i, qos_class="gold" if i < 3 else "silver", send_s=float(i), ttft_s=ttft,
                                  itl_s=itl, e2e_s=ttft + sum(itl), prompt_len=100, prompt_tokens=100,
                                  output_len=5, output_tokens=5, num_chunks=5, finish_reason="length",
                                  http_status=200))
    recs.append(RequestRecord(6, qos_class="gold", send_s=6.0, http_status=429, error_kind="http_429", error="busy"))
    recs.append(RequestRecord(7, qos_class="silver", send_s=7.0, ttft_s=0.2, itl_s=[0.05], http_status=200,
                              error_kind="connection", error="peer closed"))
    return recs


def test_summary_matches_records():
    recs = _records()
    s = summarize(recs, duration_s=10.0, slo=SLO(ttft_s=0.45), class_slos={"gold": SLO(tpot_s=0.025)})
    ok = [r for r in recs if r.success]
    g = s.overall
    assert (g.num_requests, g.completed, g.failed) == (8, 6, 2)
    assert s.errors == {"http_429": 1, "connection": 1}
    assert g.request_throughput == pytest.approx(0.6)
    assert g.output_throughput == pytest.approx(30 / 10) and g.total_token_throughput == pytest.approx(630 / 10)
    assert g.latency["ttft"].mean == pytest.approx(statistics.fmean(r.ttft_s for r in ok))
    tpots = [(r.e2e_s - r.ttft_s) / 4 for r in ok]
    assert g.latency["tpot"].mean == pytest.approx(statistics.fmean(tpots))
    assert g.latency["tpot"].p(99) == pytest.approx(float(np.percentile(tpots, 99)))
    assert g.latency["itl"].count == 24  # pooled gaps of successful requests only
    assert g.latency["e2e"].max == pytest.approx(max(r.e2e_s for r in ok))
    assert g.latency["normalized_e2e"].mean == pytest.approx(statistics.fmean(r.e2e_s / 5 for r in ok))
    # gold: TTFT <= 0.45 (base) and TPOT <= 0.025 -> only request 0 (tpot 0.02); the 429 is a miss
    # silver: TTFT <= 0.45 -> request 3 (0.4); 4, 5 too slow; the dropped stream is a miss
    assert s.per_class["gold"].slo == SLO(0.45, 0.025, None)
    assert (s.per_class["gold"].slo_met, s.per_class["silver"].slo_met) == (1, 1)
    assert s.per_class["gold"].slo_attainment == pytest.approx(1 / 4)
    assert g.slo_met == 2 and g.slo_attainment == pytest.approx(2 / 8) and g.goodput == pytest.approx(0.2)


def test_no_slo_means_no_goodput_and_tpot_needs_two_tokens():
    one = RequestRecord(0, ttft_s=0.1, e2e_s=0.1, output_tokens=1, num_chunks=1)
    assert one.tpot_s is None and one.normalized_e2e_s == pytest.approx(0.1)
    s = summarize([one])
    assert s.overall.goodput is None and s.overall.slo_attainment is None
    assert s.duration_s == pytest.approx(0.1)
    assert SLO(tpot_s=0.001).met(one)  # TPOT is undefined for one token, so it cannot be missed


def test_slo_parse():
    assert SLO.parse("ttft=500,tpot=50") == SLO(0.5, 0.05, None)
    assert SLO.parse("e2el=2000") == SLO(e2e_s=2.0)
    for bad in ("ttft", "itl=5", "ttft=abc", "ttft=-1"):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def _result(label="run", rate=2.0, scale=1.0):
    recs = _records()
    for r in recs:
        if r.ttft_s is not None:
            r.ttft_s *= scale
    return BenchResult(label, summarize(recs, 10.0, SLO(ttft_s=0.45)), recs, rate,
                       {"base_url": "http://x", "model": "m", "workload": "synthetic"})


def test_result_file_roundtrip(tmp_path):
    results = [_result(rate=1.0), _result(rate=math.inf)]
    save_results(tmp_path / "r.json", results)
    back = load_results(tmp_path / "r.json")
    assert [r.rate for r in back] == [1.0, math.inf]
    assert back[0].records == results[0].records
    p99 = results[0].summary.overall.latency["ttft"].p(99)
    assert back[0].summary.overall.latency["ttft"].p(99) == pytest.approx(p99)
    assert Summary.from_dict(results[0].summary.to_dict()).per_class.keys() == {"gold", "silver"}
    (tmp_path / "bad.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError):
        load_results(tmp_path / "bad.json")


def test_markdown_and_plots(tmp_path):
    results = [_result(rate=1.0), _result(rate=2.0, scale=2.0)]
    md = report_markdown(results)
    assert "## Rate sweep" in md and "| TTFT |" in md and "http_429 1, connection 1" in md
    single = run_markdown(results[0])
    ttft = results[0].summary.overall.latency["ttft"]
    assert f"{ttft.mean * 1000:.1f}" in single and "| gold |" in single and "25.0 %" in single
    paths = write_plots(results, tmp_path)
    assert {p.name for p in paths} == {"latency_cdf.png", "throughput_latency.png", "slo_attainment.png"}
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_ratios(tmp_path):
    save_results(tmp_path / "a.json", [_result("A")])
    save_results(tmp_path / "b.json", [_result("B", scale=2.0)])
    runs, labels = load_runs([tmp_path / "a.json", tmp_path / "b.json"])
    assert labels == ["A", "B"]
    rows = {r[0]: r for r in compare_rows(runs)}
    assert rows["TTFT mean (ms) ↓"][3] == "2.00×"
    assert rows["request throughput (req/s) ↑"][3] == "1.00×"
    assert "Baseline: **A**" in compare_markdown(runs, labels)


def test_per_rate_view_sets_each_system_against_the_first_at_the_same_rate(tmp_path):
    from sloserve.bench.compare import load_systems, per_rate_markdown

    (tmp_path / "vllm").mkdir()
    (tmp_path / "sloserve").mkdir()
    save_results(tmp_path / "vllm" / "results.json", [_result("vllm", rate=2.0), _result("vllm", rate=4.0)])
    save_results(tmp_path / "sloserve" / "results.json",
                 [_result("sloserve", rate=2.0, scale=0.5), _result("sloserve", rate=8.0, scale=0.5)])
    runs, _, systems = load_systems([tmp_path / "vllm" / "results.json", tmp_path / "sloserve" / "results.json"])
    assert systems == ["vllm", "vllm", "sloserve", "sloserve"]  # alike stems: the folders name the systems
    md = per_rate_markdown(runs, systems)
    assert "### At 2 req/s" in md and "4 req/s" not in md and "8 req/s" not in md  # only rates both ran
    ttft = next(line for line in md.splitlines() if line.startswith("| TTFT p50"))
    assert ttft.rstrip(" |").endswith("0.50×")  # sloserve's TTFT against vLLM's at 2 req/s
    assert per_rate_markdown(runs[:2], systems[:2]) == ""  # one system: nothing to set side by side


def test_workload_and_report_code_do_not_import_torch_or_the_engine():
    """The simulator reuses these modules; they must stay free of torch and the engine."""
    import subprocess
    import sys

    code = ("import sys; import sloserve.workload, sloserve.workload.build, sloserve.workload.synth, "
            "sloserve.bench.metrics, sloserve.bench.report, sloserve.bench.plots, sloserve.bench.compare, "
            "sloserve.bench.client, sloserve.bench.runner; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('sloserve.engine')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
