"""The client against a real `sloserve serve` on 127.0.0.1: records are consistent, the summary matches them."""
from __future__ import annotations

import json
import statistics

import pytest

from sloserve.bench.metrics import SLO, summarize
from sloserve.bench.result import load_results
from sloserve.cli import main
from sloserve.workload import traces

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (traces.data_dir() / traces.SHARED_FILES["sharegpt"]).is_file(),
                                 reason="shared traces not found")]

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from server_helpers import ServerProcess

    srv = ServerProcess([], tmp_path_factory.mktemp("bench-server") / "server.log")
    yield srv
    srv.kill()


def _check_records(res, prompt_exact: bool):
    assert len(res.records) == 6
    for r in res.records:
        assert r.success, (r.error_kind, r.error)
        assert r.http_status == 200 and r.finish_reason == "length"
        assert 0 < r.ttft_s <= r.e2e_s
        assert r.output_tokens == MAX_TOKENS  # usage; ignore_eos made the server produce all of them
        if r.num_chunks == r.output_tokens:  # each chunk one token (no multi-byte merges)
            assert len(r.itl_s) == r.output_tokens - 1
        assert len(r.itl_s) == r.num_chunks - 1
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / (MAX_TOKENS - 1))
        assert r.send_s >= r.dispatch_s >= r.scheduled_s
        if prompt_exact:
            assert r.prompt_tokens == r.prompt_len
    # the stored summary is the one the records give
    again = summarize(res.records, res.summary.duration_s, SLO(ttft_s=5.0, tpot_s=1.0))
    assert again.to_dict() == res.summary.to_dict()
    g = res.summary.overall
    assert g.completed == 6 and g.output_tokens == 6 * MAX_TOKENS
    assert g.latency["ttft"].mean == pytest.approx(statistics.fmean(r.ttft_s for r in res.records))
    assert g.latency["itl"].count == sum(len(r.itl_s) for r in res.records)
    assert g.request_throughput == pytest.approx(6 / res.summary.duration_s)


@pytest.mark.parametrize("fmt, endpoint", [("tokens", "completions"), ("text", "chat")])
def test_bench_against_sloserve_serve(server, tmp_path, fmt, endpoint):
    out = tmp_path / fmt
    rc = main(["bench", "--base-url", server.base_url, "--workload", "synthetic", "--input-len", "40",
               "--output-len", str(MAX_TOKENS), "--num-requests", "6", "--rate", "4", "--prompt-format", fmt,
               "--endpoint", endpoint, "--slo", "ttft=5000,tpot=1000", "--out", str(out), "--no-progress",
               "--request-timeout", "120"])
    assert rc == 0
    (res,) = load_results(out / "results.json")
    assert res.config["model"]  # resolved from /v1/models
    _check_records(res, prompt_exact=endpoint == "completions")
    report = (out / "report.md").read_text()
    assert "| TTFT |" in report and "6 / 6 / 0" in report
    # report.html carries the server's own timeline of the run: its instance, these 6 requests.
    page = (out / "report.html").read_text()
    start = page.index('id="timeline-data">') + len('id="timeline-data">')
    timeline = json.loads(page[start:page.index("</script>", start)])
    assert timeline["source"] == "live" and timeline["totals"]["default"]["finished"] == 6
    assert {len(f["instances"]) for f in timeline["frames"]} == {1}
    assert sum(i["tokens_per_s"] for f in timeline["frames"] for i in f["instances"]) > 0


def _prefix_hits(server) -> float:
    import httpx

    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("sloserve:prefix_cache_hits_total"))


def test_a_sweeps_later_rates_are_not_served_from_the_first_rates_cache(server, tmp_path):
    """Every rate of a sweep sends the same prompts; each rate after the first leads them with its
    own tag, so a prefix-caching server computes them again (it found every full block before)."""
    before = _prefix_hits(server)
    rc = main(["bench", "--base-url", server.base_url, "--workload", "sharegpt", "--num-requests", "6",
               "--max-prompt-len", "96", "--max-output-len", "2", "--rate", "40,40,40", "--prompt-format", "tokens",
               "--out", str(tmp_path), "--no-progress", "--request-timeout", "120", "--seed", "5"])
    assert rc == 0
    runs = load_results(tmp_path / "results.json")
    assert [r.summary.overall.completed for r in runs] == [6, 6, 6]
    full_blocks = sum(r.prompt_len // 16 for r in runs[0].records)
    assert full_blocks >= 6  # prompts long enough that a cached copy would be found
    assert _prefix_hits(server) - before < 16 * 2  # at most a block or two that two prompts share by chance
