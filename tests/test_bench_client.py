"""The streaming client against a misbehaving local server: failures counted, bounds kept, schedule kept."""
from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from sloserve.bench.client import BenchClient, ClientConfig, request_body, request_headers
from sloserve.bench.fake_server import FakeOpenAIServer, FakeServerConfig
from sloserve.bench.metrics import summarize
from sloserve.workload.arrivals import ArrivalProcess
from sloserve.workload.transforms import with_arrivals
from sloserve.workload.types import WorkloadRequest


@pytest.fixture(scope="module")
def server():
    with FakeOpenAIServer(FakeServerConfig(token_delay_s=0.002, slow_first_token_s=0.4)) as srv:
        yield srv


def _req(mode: str, i: int, t: float = 0.0, out: int = 5) -> WorkloadRequest:
    return WorkloadRequest(t, 3, out, prompt_text=f"mode:{mode} please", request_id=f"{mode}-{i}")


def _run(cfg: ClientConfig, reqs, **kw):
    return asyncio.run(BenchClient(cfg, **kw).run(reqs))


def test_request_body_and_headers():
    cfg = ClientConfig("http://h:1/v1/", api_key="k0", tenant_keys={"alice": "ka"}, send_qos_class=True)
    assert cfg.url == "http://h:1/v1/completions"
    r = WorkloadRequest(0, 3, 7, tenant="alice", qos_class="gold", prompt_token_ids=[5, 6, 7])
    body = request_body(r, cfg, "m")
    assert body == {"model": "m", "prompt": [5, 6, 7], "max_tokens": 7, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True}
    h = request_headers(r, cfg)
    assert h["Authorization"] == "Bearer ka" and h["X-QoS-Class"] == "gold"
    assert request_headers(WorkloadRequest(0, 1, 1), cfg)["Authorization"] == "Bearer k0"
    llama = ClientConfig("http://h:1", endpoint="chat", backend="llamacpp", extra_body={"top_k": 1})
    chat = request_body(WorkloadRequest(0, 1, 0, prompt_text="hi"), llama, None)
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["n_predict"] == 1 == chat["max_tokens"]
    assert chat["top_k"] == 1 and "model" not in chat and llama.url == "http://h:1/v1/chat/completions"
    with pytest.raises(ValueError):
        request_body(WorkloadRequest(0, 1, 1, prompt_token_ids=[1]), llama, None)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_failure_is_counted_and_the_run_is_bounded(server, endpoint):
    modes = ["ok", "slow", "drop", "429", "500", "hang", "trickle", "ok"] * 2
    reqs = [_req(m, i, t=0.01 * i) for i, m in enumerate(modes)]
    cfg = ClientConfig(server.base_url, endpoint=endpoint, request_timeout_s=1.5)
    start = time.monotonic()
    res = _run(cfg, reqs)
    elapsed = time.monotonic() - start
    assert elapsed < 0.16 + 1.5 + 1.0  # last send + one request timeout + slack: never hangs
    assert len(res.records) == len(reqs) and [r.index for r in res.records] == list(range(len(reqs)))
    kinds = {m: [r.error_kind for r, mm in zip(res.records, modes) if mm == m] for m in set(modes)}
    assert kinds == {"ok": [None] * 4, "slow": [None] * 2, "drop": ["connection"] * 2, "429": ["http_429"] * 2,
                     "500": ["http_5xx"] * 2, "hang": ["timeout"] * 2, "trickle": ["timeout"] * 2}
    summary = summarize(res.records, res.duration_s)
    assert summary.errors == {"http_429": 2, "http_5xx": 2, "timeout": 4, "connection": 2}
    assert summary.overall.completed == 6
    for r, m in zip(res.records, modes):
        if m in ("429", "500"):
            assert r.http_status == int(m) and f"fake {m}" in r.error
        if m == "drop":
            assert r.ttft_s is not None and r.e2e_s is None and len(r.itl_s) == 1  # two tokens arrived
        if r.success:
            assert r.ttft_s <= r.e2e_s and len(r.itl_s) == r.output_tokens - 1 == 4
            assert r.prompt_tokens is not None and r.finish_reason == "length"
        if m == "slow":
            assert r.ttft_s >= 0.4
    assert len(server.received) >= len(reqs)


def test_duration_bound_cuts_in_flight_and_unsent(server):
    # 2 slots, both taken by hanging requests: the rest wait, then the duration ends the run
    reqs = [_req("hang", 0), _req("hang", 1)] + [_req("ok", i, t=0.05) for i in range(2, 6)]
    cfg = ClientConfig(server.base_url, max_concurrency=2, request_timeout_s=30, duration_s=0.5,
                       drain_timeout_s=0.5)
    start = time.monotonic()
    res = _run(cfg, reqs)
    assert time.monotonic() - start < 0.5 + 0.5 + 1.0
    assert [r.error_kind for r in res.records] == ["cancelled", "cancelled"]
    assert res.num_unsent == 4


def test_concurrency_cap_holds(server):
    reqs = [_req("slow", i) for i in range(6)]
    res = _run(ClientConfig(server.base_url, max_concurrency=2, request_timeout_s=10), reqs)
    assert all(r.success for r in res.records)
    sends = sorted(r.send_s for r in res.records)
    assert sends[2] - sends[0] >= 0.4 and sends[4] - sends[2] >= 0.4  # two at a time, 0.4 s each
    assert all(r.queue_delay_s >= 0 for r in res.records)


def test_rate_control_follows_the_poisson_schedule(server):
    """200 Poisson arrivals at 100 req/s: the client's own log matches the schedule it was given."""
    base = [WorkloadRequest(0, 3, 2, prompt_text="x", request_id=f"p{i}") for i in range(200)]
    reqs = list(with_arrivals(base, ArrivalProcess("poisson", 100.0), seed=11))
    res = _run(ClientConfig(server.base_url, request_timeout_s=10), reqs)
    recs = res.records
    assert [r.scheduled_s for r in recs] == [r.arrival_s for r in reqs]
    lags = [r.dispatch_s - r.scheduled_s for r in recs]
    assert min(lags) >= 0  # never early
    assert statistics.median(lags) < 0.005 and max(lags) < 0.1
    # no cap: sent when released. The fake server runs in a thread of this process, so a send can wait out a GIL
    # switch or two (5 ms each) behind it: bounded like the dispatch lag, not per request to 10 ms
    send_lags = [r.send_s - r.dispatch_s for r in recs]
    assert min(send_lags) >= 0 and statistics.median(send_lags) < 0.005 and max(send_lags) < 0.1, \
        f"send lag median {statistics.median(send_lags) * 1e3:.1f} ms, max {max(send_lags) * 1e3:.1f} ms"
    assert [r.index for r in sorted(recs, key=lambda r: r.dispatch_s)] == list(range(200))
    # the schedule itself is the process asked for
    gaps = [b.scheduled_s - a.scheduled_s for a, b in zip(recs, recs[1:])]
    assert 1 / statistics.fmean(gaps) == pytest.approx(100, rel=0.2)
    achieved = [b.dispatch_s - a.dispatch_s for a, b in zip(recs, recs[1:])]
    assert statistics.fmean(achieved) == pytest.approx(statistics.fmean(gaps), rel=0.05)
    failed = [(r.index, r.error_kind, r.error) for r in recs if not r.success]
    assert not failed, failed


def test_connection_refused_is_a_connection_error():
    res = _run(ClientConfig("http://127.0.0.1:9", model="m", request_timeout_s=2, connect_timeout_s=1),
               [_req("ok", 0)])
    assert res.records[0].error_kind == "connection"


def test_token_chunks_include_empty_text_but_not_the_chat_role_chunk():
    from sloserve.bench.client import _is_token_chunk

    # completions: a token whose text is held back (special token, partial UTF-8) still counts
    assert _is_token_chunk({"index": 0, "text": ""}, "completions")
    assert _is_token_chunk({"index": 0, "text": "Hi", "finish_reason": None}, "completions")
    assert not _is_token_chunk({"index": 0}, "completions")
    # chat: an opening role chunk carries no token (sloserve sends it in the first token's write)
    assert not _is_token_chunk({"index": 0, "delta": {"role": "assistant", "content": ""}}, "chat")
    assert _is_token_chunk({"index": 0, "delta": {"role": "assistant", "content": "Hi"}}, "chat")
    assert _is_token_chunk({"index": 0, "delta": {"content": ""}}, "chat")
    assert _is_token_chunk({"index": 0, "delta": {"reasoning_content": "hm"}}, "chat")
    assert not _is_token_chunk({"index": 0, "delta": {}, "finish_reason": "stop"}, "chat")
    # a tool-call delta carries tokens, with a content field (sloserve) or without one (vLLM)
    assert _is_token_chunk({"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}},
                           "chat")


def test_structured_requests_ask_for_a_record_or_a_forced_call_and_never_ignore_eos():
    import jsonschema

    from sloserve.bench.structured import RECORD, TOOLS

    hi = WorkloadRequest(0, 1, 64, prompt_text="hi", structured=True)
    plain = WorkloadRequest(0, 1, 64, prompt_text="hi")  # outside --structured-share: sent as it is
    assert "response_format" not in request_body(plain, ClientConfig("http://h:1", endpoint="chat", structured="json"),
                                                 None)
    json_body = request_body(hi, ClientConfig("http://h:1", endpoint="chat", structured="json"), None)
    assert json_body["response_format"]["json_schema"]["schema"] == RECORD and "ignore_eos" not in json_body
    tools_body = request_body(hi, ClientConfig("http://h:1", endpoint="chat", structured="tools"), None)
    assert tools_body["tools"] == TOOLS and tools_body["tool_choice"] == "required" and "ignore_eos" not in tools_body
    for tool in TOOLS:  # every tool's parameters are a valid schema
        jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
    with pytest.raises(ValueError, match="chat endpoint"):
        ClientConfig("http://h:1", structured="json")
    with pytest.raises(ValueError, match="structured must be one of"):
        ClientConfig("http://h:1", endpoint="chat", structured="yaml")
