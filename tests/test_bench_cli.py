"""`sloserve bench` and `sloserve bench compare` end to end against the local fake server."""
from __future__ import annotations

import json

import pytest

from sloserve.bench import tokenizer as bench_tokenizer
from sloserve.bench.fake_server import FakeOpenAIServer, FakeServerConfig
from sloserve.bench.metrics import SLO, summarize
from sloserve.bench.result import load_results
from sloserve.cli import main
from sloserve.workload import traces

pytestmark = pytest.mark.skipif(not (traces.data_dir() / traces.SHARED_FILES["sharegpt"]).is_file(),
                                reason="shared traces not found")


class CharTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


@pytest.fixture
def char_tokenizer(monkeypatch):
    """Skip loading the real tokenizer (torch import); the slow server test uses the real one."""
    monkeypatch.setattr(bench_tokenizer, "load_bench_tokenizer", lambda path: CharTokenizer())


@pytest.fixture(scope="module")
def server():
    with FakeOpenAIServer(FakeServerConfig(token_delay_s=0.001)) as srv:
        yield srv


def test_sweep_with_classes_then_compare(server, char_tokenizer, tmp_path, capsys):
    classes = tmp_path / "classes.yaml"
    classes.write_text("classes:\n  gold: {ttft_ms: 50, share: 0.5}\n  bronze: {ttft_ms: 1000, tbt_ms: 500}\n"
                       "api_keys:\n  sk-a: alice\n  sk-b: bob\n")
    out = tmp_path / "a"
    rc = main(["bench", "--base-url", server.base_url, "--workload", "azure-code", "--rate", "40,80",
               "--num-requests", "24", "--max-output-len", "6", "--max-prompt-len", "300", "--classes", str(classes),
               "--slo", "e2e=5000", "--out", str(out), "--no-progress", "--seed", "3"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Rate sweep" in printed and "TTFT" in printed
    assert {p.name for p in out.iterdir()} == {"results.json", "report.md", "latency_cdf.png",
                                              "throughput_latency.png", "slo_attainment.png", "report.html",
                                              "report-1.html", "report-2.html"}
    # Not a sloserve server (no /dashboard/data): each report's timeline is the client's, per class.
    for k in (1, 2):
        page = (out / f"report-{k}.html").read_text()
        start = page.index('id="timeline-data">') + len('id="timeline-data">')
        timeline = json.loads(page[start:page.index("</script>", start)])
        assert timeline["source"] == "client" and all(f["instances"] == [] for f in timeline["frames"])
        assert sum(t["finished"] for t in timeline["totals"].values()) == 24
        assert set(timeline["totals"]) == {"gold", "bronze"}
    assert (out / "report.html").read_text() == (out / "report-2.html").read_text()  # the highest rate
    results = load_results(out / "results.json")
    assert [r.rate for r in results] == [40.0, 80.0]
    for res in results:
        assert len(res.records) == 24 and all(r.success for r in res.records)
        assert {r.qos_class for r in res.records} == {"gold", "bronze"}
        assert {r.tenant for r in res.records} == {"alice", "bob"}
        assert all(r.output_tokens == r.output_len <= 6 for r in res.records)
        assert all(r.prompt_len <= 300 for r in res.records)
        again = summarize(res.records, res.summary.duration_s, SLO(e2e_s=5.0),
                          {"gold": SLO(ttft_s=0.05), "bronze": SLO(ttft_s=1.0, tpot_s=0.5)})
        assert again.to_dict() == json.loads(json.dumps(res.summary.to_dict()))
        assert res.config["workload"] == "azure-code" and res.config["model"] == "fake-model"
    # the server saw the class header and the tenant's key
    generated = [r for r in server.received if r.path.endswith("/completions")]
    seen = [(r.headers.get("x-qos-class"), r.headers.get("authorization")) for r in generated[-24:]]
    assert {s[0] for s in seen} == {"gold", "bronze"} and {s[1] for s in seen} == {"Bearer sk-a", "Bearer sk-b"}
    body = generated[-1].body
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    assert isinstance(body["prompt"], str)
    # a second result file, then compare
    rc = main(["bench", "--base-url", server.base_url, "--workload", "sharegpt", "--rate", "inf",
               "--num-requests", "10", "--max-output-len", "4", "--out", str(tmp_path / "b"), "--no-progress"])
    assert rc == 0
    rc = main(["bench", "compare", str(out / "results.json"), str(tmp_path / "b" / "results.json"),
               "--out", str(tmp_path / "cmp")])
    assert rc == 0
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "Baseline" in md and "×" in md and md.count("fake-model") >= 3
    assert (tmp_path / "cmp" / "latency_cdf.png").read_bytes()[:4] == b"\x89PNG"


def test_replay_and_token_prompts(server, char_tokenizer, tmp_path):
    rc = main(["bench", "--base-url", server.base_url + "/v1", "--workload", "mooncake-synthetic", "--replay",
               "--time-scale", "20", "--duration", "1", "--max-prompt-len", "1024", "--max-output-len", "3",
               "--prompt-format", "tokens", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    (res,) = load_results(tmp_path / "results.json")
    assert res.rate is None and res.config["replay"] is True and 0 < len(res.records)
    assert all(r.scheduled_s < 1.0 for r in res.records)
    assert all(r.prompt_tokens == r.prompt_len for r in res.records)  # fake server counts the ids it got


@pytest.mark.parametrize("argv, message", [
    (["bench", "--workload", "synthetic"], "--base-url"),
    (["bench", "--base-url", "http://x", "--workload", "nope.csv"], "workload"),
    (["bench", "--base-url", "http://x", "--workload", "sharegpt", "--replay"], "no arrival times"),
    (["bench", "--base-url", "http://x", "--endpoint", "chat", "--prompt-format", "tokens"], "text prompts"),
])
def test_bad_arguments_fail_before_sending(argv, message, capsys, char_tokenizer):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_unreachable_server_fails_in_warm_up(char_tokenizer, tmp_path, capsys):
    rc = main(["bench", "--base-url", "http://127.0.0.1:9", "--model", "m", "--workload", "synthetic",
               "--input-len", "8", "--output-len", "2", "--num-requests", "3", "--request-timeout", "2",
               "--out", str(tmp_path), "--no-progress"])
    assert rc == 1
    assert "warm-up request failed (connection)" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_a_version_1_result_file_is_read_with_its_outcomes_apart(tmp_path):
    """results.json version 1 wrote a simulation's outcomes under `config`; it still loads, with
    them in `outcome`, as version 2 writes them."""
    import json

    from sloserve.bench.result import FORMAT_VERSION, load_results
    from sloserve.cli import main

    assert main(["simulate", "--workload", "sharegpt", "--num-requests", "20", "--rate", "5", "--instances", "2",
                 "--kv-host-gib", "1", "--out", str(tmp_path / "sim"), "--no-progress"]) == 0
    doc = json.loads((tmp_path / "sim" / "results.json").read_text())
    assert doc["version"] == FORMAT_VERSION == 2
    (new,) = load_results(tmp_path / "sim" / "results.json")
    assert new.outcome["completed"] == 20 and "completed" not in new.config and new.config["router"]
    old_run = dict(doc["runs"][0])  # the same run as version 1 wrote it: outcomes inside config
    outcome = old_run.pop("outcome")
    tier_loads = outcome.pop("tier_loads")
    old_run["config"] = {**old_run["config"], **outcome,
                         "kv_tiers": {**old_run["config"]["kv_tiers"], **tier_loads}}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps({"format": "sloserve-bench", "version": 1, "runs": [old_run]}))
    (old,) = load_results(path)
    assert old.config == new.config and old.outcome == new.outcome
