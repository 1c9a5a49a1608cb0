"""Trace loaders on the shared files: row counts, monotone arrivals, token totals.

Expectations are computed here independently with csv/json/gzip (and datetime.fromisoformat),
not with the loaders' own helpers, so a parsing bug cannot agree with itself.
"""
from __future__ import annotations

import csv
import gzip
import json
import math
from datetime import datetime

import pytest

from sloserve.workload import traces
from sloserve.workload.servegen import ClientWindow, load_client_windows, mean_total_rate, servegen_arrivals
from sloserve.workload.types import WorkloadRequest, is_sorted_by_arrival

DATA = traces.data_dir()
pytestmark = pytest.mark.skipif(not (DATA / "sharegpt_v3_first_turn.jsonl.gz").is_file(),
                                reason=f"shared traces not found in {DATA}")


def _csv_rows(name):
    with gzip.open(DATA / name, "rt", newline="") as f:
        return list(csv.DictReader(f))


def _jsonl(name):
    with gzip.open(DATA / name, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("workload, rows", [("azure-code", 8819), ("azure-conv", 19366)])
def test_azure_matches_file(workload, rows):
    raw = _csv_rows(traces.SHARED_FILES[workload])
    reqs = traces.load_azure(traces.shared_path(workload), workload)
    assert len(raw) == rows == len(reqs)
    assert sum(r.prompt_len for r in reqs) == sum(int(x["ContextTokens"]) for x in raw)
    assert sum(r.output_len for r in reqs) == sum(int(x["GeneratedTokens"]) for x in raw)
    assert reqs[0].arrival_s == 0.0 and is_sorted_by_arrival(reqs)
    t = [datetime.fromisoformat(x["TIMESTAMP"]) for x in raw]
    for i in (1, len(raw) // 2, len(raw) - 1):
        assert reqs[i].arrival_s == pytest.approx((t[i] - t[0]).total_seconds(), abs=1e-6)
    assert len({r.request_id for r in reqs}) == len(reqs)


@pytest.mark.parametrize("workload, rows", [("mooncake-conv", 12031), ("mooncake-synthetic", 3993)])
def test_mooncake_matches_file(workload, rows):
    raw = _jsonl(traces.SHARED_FILES[workload])
    reqs = traces.load_mooncake(traces.shared_path(workload), workload)
    assert len(raw) == rows == len(reqs)
    assert sum(r.prompt_len for r in reqs) == sum(x["input_length"] for x in raw)
    assert sum(r.output_len for r in reqs) == sum(x["output_length"] for x in raw)
    assert is_sorted_by_arrival(reqs)
    assert [r.arrival_s for r in reqs] == [(x["timestamp"] - raw[0]["timestamp"]) / 1000 for x in raw]
    for r, x in zip(reqs, raw):
        assert list(r.hash_ids) == x["hash_ids"]
        assert r.hash_block_size == 512 and len(r.hash_ids) == math.ceil(r.prompt_len / 512)


def test_sharegpt_matches_file():
    raw = _jsonl(traces.SHARED_FILES["sharegpt"])
    reqs = traces.load_sharegpt(traces.shared_path("sharegpt"))
    assert len(raw) == 17345 == len(reqs)
    assert sum(r.prompt_len for r in reqs) == sum(x["prompt_tokens_cl100k"] for x in raw)
    assert sum(r.output_len for r in reqs) == sum(x["response_tokens_cl100k"] for x in raw)
    assert [r.prompt_text for r in reqs[:50]] == [x["prompt"] for x in raw[:50]]
    starts = traces.load_sharegpt(traces.shared_path("sharegpt"), conversation_starts_only=True)
    assert len(starts) == sum(1 for x in raw if x["is_conversation_start"]) == 9387


def test_servegen_windows_and_arrivals():
    path = traces.shared_path("servegen")
    raw = [x for x in _csv_rows(traces.SHARED_FILES["servegen"])
           if x["model"] == "m-large" and 0 <= float(x["window_start_s"]) < 1200 and float(x["rate_rps"]) > 0]
    windows = load_client_windows(path, "m-large", 0, 1200)
    assert len(windows) == len(raw)
    assert sum(w.rate_rps for w in windows) == pytest.approx(sum(float(x["rate_rps"]) for x in raw))
    # 10 % of the published rates over the first window: expect sum(rate) * 0.1 * 600 arrivals
    first = [w for w in windows if w.window_start_s == 0]
    arrivals = list(servegen_arrivals(first, seed=3, start_s=0, end_s=600, rate_scale=0.1))
    times = [t for t, _ in arrivals]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 600
    expected = sum(w.rate_rps for w in first) * 0.1 * 600
    assert abs(len(arrivals) - expected) < 0.25 * expected
    assert {c for _, c in arrivals} <= {w.client_id for w in first}
    assert list(servegen_arrivals(first, seed=3, start_s=0, end_s=600, rate_scale=0.1)) == arrivals
    # a sub-range is cut from the same draws
    sub = list(servegen_arrivals(first, seed=3, start_s=100, end_s=200, rate_scale=0.1))
    full = [(t, c) for t, c in arrivals if 100 <= t < 200]
    assert [c for _, c in sub] == [c for _, c in full]
    assert [t + 100 for t, _ in sub] == pytest.approx([t for t, _ in full])
    assert mean_total_rate(windows) == pytest.approx(sum(w.rate_rps for w in windows) / 2)


def test_servegen_client_rate_is_exact_in_expectation():
    """Scale is derived from the rate and the fitted shape: long-run rate = published rate."""
    for dist, shape in (("Gamma", 0.3), ("Weibull", 0.6)):
        w = ClientWindow("m", 1, 0.0, 5.0, 2.0, dist, shape, 123.0)
        count = 0
        for t in w.process().arrival_times(1):
            if t >= 2000:
                break
            count += 1
        assert count / 2000 == pytest.approx(5.0, rel=0.1), dist


def test_user_files_in_the_same_formats(tmp_path):
    azure = tmp_path / "mine.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-01-01 00:00:00.5000000,10,2\n"
                     "2024-01-01 00:00:02.2500000,20,3\n")
    moon = tmp_path / "mine.jsonl"
    moon.write_text('{"timestamp": 1000, "input_length": 600, "output_length": 4, "hash_ids": [7, 8]}\n'
                    '{"timestamp": 1500, "input_length": 100, "output_length": 5, "hash_ids": [7]}\n')
    assert traces.sniff_format(azure) == "azure" and traces.sniff_format(moon) == "mooncake"
    a = traces.load_file(azure)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in a] == [(0.0, 10, 2), (1.75, 20, 3)]
    m = traces.load_file(moon)
    assert [(r.arrival_s, r.hash_ids) for r in m] == [(0.0, (7, 8)), (0.5, (7,))]
    native = tmp_path / "native.jsonl"
    traces.save_native(native, m)
    assert traces.sniff_format(native) == "native" and traces.load_file(native) == m
    gz = tmp_path / "mine.csv.gz"
    gz.write_bytes(gzip.compress(azure.read_bytes()))
    assert traces.load_file(gz, source="mine.csv") == a
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="unrecognized CSV header"):
        traces.load_file(bad)


def test_workload_request_roundtrip_and_validation():
    r = WorkloadRequest(1.5, 10, 3, tenant="t", qos_class="gold", hash_ids=[1, 2], hash_block_size=16,
                        request_id="x")
    assert r.hash_ids == (1, 2)
    assert WorkloadRequest.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    with pytest.raises(ValueError):
        WorkloadRequest(0.0, -1, 3)
    with pytest.raises(ValueError, match="unknown"):
        WorkloadRequest.from_dict({"arrival_s": 0, "prompt_len": 1, "output_len": 1, "bogus": 1})
