"""`sloserve serve` end to end over 127.0.0.1 with the official `openai` client.

One server subprocess for the module (API keys and QoS classes configured); the offline
engine of the test process is the reference for greedy output.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from api_cases import BAD_REQUESTS, KEY, MAX_BODY, OTHER_KEY, QOS_CONFIG, send_bad_request
from server_helpers import ServerProcess, metric, scrape, wait_for
from sloserve import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MESSAGES = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    cfg = tmp / "qos.json"
    cfg.write_text(json.dumps(QOS_CONFIG))
    # The "impossible" class must be admitted to be measured: no shedding of unattainable TTFTs here.
    srv = ServerProcess(["--qos-config", str(cfg), "--max-body-bytes", str(MAX_BODY), "--no-shed-unattainable"],
                        tmp / "server.log")
    yield srv
    srv.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


# --------------------------------------------------------------------------- basics


def test_health_models_and_open_routes(server, client, llm):
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == [llm.engine.model_name]
    assert httpx.get(server.base_url + "/metrics").status_code == 200  # no key needed


def test_completion_matches_offline_greedy(client, model_name, llm):
    for prompt, want in zip(PROMPTS, llm.generate(PROMPTS, greedy())):
        resp = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0)
        assert resp.choices[0].text == want.text
        assert resp.choices[0].finish_reason == want.finish_reason
        assert resp.usage.completion_tokens == len(want.token_ids)
        assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
        stream = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0,
                                           stream=True)
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == want.finish_reason


def test_the_asyncio_event_loop_serves_the_same_stream(tmp_path, llm):
    """uvloop is the default loop where installed; `--event-loop asyncio` is the portable one, kept working."""
    want = llm.generate(PROMPTS[:1], greedy())[0]
    srv = ServerProcess(["--event-loop", "asyncio"], tmp_path / "server.log")
    try:
        plain = openai.OpenAI(base_url=srv.v1, api_key="none", max_retries=0, timeout=120)
        chunks = list(plain.completions.create(model=plain.models.list().data[0].id, prompt=PROMPTS[0],
                                               max_tokens=16, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == want.text
        assert chunks[-1].choices[0].finish_reason == want.finish_reason
    finally:
        srv.kill()


def test_chat_matches_offline_greedy(client, model_name, llm):
    want = llm.chat(MESSAGES, greedy())[0]
    resp = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=16, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == want.text
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids)
    assert resp.usage.completion_tokens == len(want.token_ids)

    chunks = list(client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason


def test_sampling_parameters_are_honoured(client, model_name, llm):
    # stop string, seed reproducibility, n, ignore_eos / min_tokens through extra_body
    base = llm.generate(PROMPTS[0], greedy(24))[0].text
    stop = base.strip().split()[1]
    resp = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert resp.choices[0].finish_reason == "stop" and stop not in resp.choices[0].text
    assert base.startswith(resp.choices[0].text)

    kw = dict(model=model_name, prompt="Once upon a time", max_tokens=8, temperature=1.0, top_p=0.9, seed=1234,
              presence_penalty=0.5, frequency_penalty=0.5,
              extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    first, again = client.completions.create(**kw), client.completions.create(**kw)
    assert first.choices[0].text == again.choices[0].text

    many = client.completions.create(model=model_name, prompt="Hello", max_tokens=4, temperature=0, n=3,
                                     extra_body={"ignore_eos": True})
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert many.usage.completion_tokens == 12
    assert len({c.text for c in many.choices}) == 1  # greedy: every sample equal


def test_logprobs_formats(client, model_name, llm):
    want = llm.generate(PROMPTS[0], greedy(6, logprobs=2, ignore_eos=True))[0]
    resp = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2,
                                     extra_body={"ignore_eos": True})
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for got, ref in zip(lp.token_logprobs, want.logprobs):
        assert got == pytest.approx(ref.logprob, abs=1e-4)
    assert all(len(top) <= 2 for top in lp.top_logprobs)

    chat = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:
        assert bytes(t.bytes).decode() == t.token
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-5)  # greedy picks the top one

    streamed = list(client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=5, temperature=0,
                                                   logprobs=True, top_logprobs=1, stream=True))
    tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == [t.token for t in content]


def test_streamed_completion_logprobs_carry_offsets_across_chunks(client, model_name):
    chunks = list(client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                            logprobs=1, stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert len(tokens) == len(offsets) == 6
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(6)]


def test_tokenize_and_detokenize(http, llm):
    ids = http.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    assert ids == llm.tokenizer.encode("Hello world")
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert chat["tokens"] == llm.tokenizer.encode_chat(MESSAGES)


# --------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("case", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_4xx_in_openai_schema(http, case):
    send_bad_request(http, case)


def test_sdk_raises_typed_errors(server, client, model_name):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model_name, prompt="hi", max_tokens=-1)
    assert bad.value.status_code == 400 and "max_tokens" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0).models.list()


def test_server_still_correct_after_bad_requests(client, model_name, llm):
    want = llm.generate(PROMPTS[1], greedy(8))[0].text
    assert client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=8,
                                     temperature=0).choices[0].text == want


# --------------------------------------------------------------------------- load and lifecycle


def test_32_concurrent_streams_are_batched(server, model_name, llm):
    before = scrape(server.base_url)
    prompts = [f"Write a sentence about the number {i}." for i in range(32)]
    max_tokens = 8

    async def one(aclient: openai.AsyncOpenAI, prompt: str):
        stream = await aclient.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens,
                                                  temperature=0, stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        text, usage, token_chunks = "", None, 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                token_chunks += 1
            if chunk.usage:
                usage = chunk.usage
        assert token_chunks == max_tokens  # one chunk per token, even when its text is empty (EOS ignored)
        return text, usage

    async def main():
        async with openai.AsyncOpenAI(base_url=server.v1, api_key=KEY, max_retries=0, timeout=300) as aclient:
            return await asyncio.wait_for(asyncio.gather(*(one(aclient, p) for p in prompts)), 300)

    results = asyncio.run(main())
    for prompt, (text, usage) in zip(prompts, results):
        assert usage is not None
        assert usage.completion_tokens == max_tokens
        assert usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
        assert usage.total_tokens == usage.prompt_tokens + max_tokens
    after = scrape(server.base_url)
    steps = metric(after, "sloserve:engine_steps_total") - metric(before, "sloserve:engine_steps_total")
    seqs = metric(after, "sloserve:engine_scheduled_seqs_total") - metric(before, "sloserve:engine_scheduled_seqs_total")
    assert metric(after, "sloserve:engine_max_batch_size") > 1
    assert seqs / steps > 4, (seqs, steps)  # 32 x 9 scheduled sequences took far fewer than 32 x 9 steps
    assert metric(after, "sloserve:num_requests_running") == 0


def _idle(server) -> bool:
    s = scrape(server.base_url)
    return (metric(s, "sloserve:num_requests_running") == 0 and metric(s, "sloserve:num_requests_waiting") == 0
            and metric(s, "sloserve:num_requests_in_flight") == 0 and metric(s, "sloserve:kv_cache_usage_perc") == 0)


def test_client_disconnect_mid_stream_aborts(server, model_name):
    body = {"model": model_name, "prompt": "Tell me a very long story.", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=server.v1, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        with c.stream("POST", "/completions", json=body, headers={"X-Request-Id": "drop-stream"}) as response:
            assert response.status_code == 200
            events = 0
            for line in response.iter_lines():
                events += line.startswith("data:")
                if events >= 2:
                    break  # leaving the block mid-body closes the connection
    wait_for(lambda: "id=drop-stream " in server.log(), 30, what="access log line of the dropped stream")
    wait_for(lambda: _idle(server), 30, what="running requests and KV blocks back to 0")
    line = next(l for l in server.log().splitlines() if "id=drop-stream " in l)
    assert "status=499" in line and "finish=abort" in line


def test_client_disconnect_while_waiting_non_streaming_aborts(server, model_name):
    body = {"model": model_name, "prompt": "Count to ten thousand.", "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.v1 + "/completions", json=body, timeout=httpx.Timeout(60, read=1.5),
                   headers={"Authorization": f"Bearer {KEY}", "X-Request-Id": "drop-wait"})
    wait_for(lambda: "id=drop-wait " in server.log(), 30, what="access log line of the dropped request")
    wait_for(lambda: _idle(server), 30, what="running requests and KV blocks back to 0")
    line = next(l for l in server.log().splitlines() if "id=drop-wait " in l)
    assert "status=499" in line and "finish=abort" in line and "output_tokens=2000" not in line


def test_metrics_parse_and_count_what_was_sent(server, model_name, llm):
    before = scrape(server.base_url)
    bob = openai.OpenAI(base_url=server.v1, api_key=OTHER_KEY, max_retries=0, timeout=120)
    prompts = ["One", "Two two", "Three three three"]
    for p in prompts:
        bob.completions.create(model=model_name, prompt=p, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    bob.completions.create(model=model_name, prompt="Four", max_tokens=3, temperature=0,
                           extra_body={"ignore_eos": True, "qos_class": "impossible"})
    bob.completions.create(model=model_name, prompt="Five", max_tokens=3, temperature=0,
                           extra_body={"ignore_eos": True}, extra_headers={"X-QoS-Class": "interactive",
                                                                          "X-Priority": "0"})
    with pytest.raises(openai.BadRequestError):
        bob.completions.create(model=model_name, prompt="x", max_tokens=0)
    after = scrape(server.base_url)

    def delta(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    prompt_tokens = sum(len(llm.tokenizer.encode(p)) for p in prompts + ["Four", "Five"])
    assert delta("sloserve:request_success_total", finished_reason="length") == 5
    assert delta("sloserve:prompt_tokens_total") == prompt_tokens
    assert delta("sloserve:generation_tokens_total") == 3 * 5 + 3 + 3
    assert delta("sloserve:time_to_first_token_seconds_count") == 5
    assert delta("sloserve:e2e_request_latency_seconds_count") == 5
    assert delta("sloserve:inter_token_latency_seconds_count") == 3 * 4 + 2 + 2
    assert delta("sloserve:request_time_per_output_token_seconds_count") == 5
    assert delta("sloserve:http_requests_total", route="/v1/completions", status="200") == 5
    assert delta("sloserve:http_requests_total", route="/v1/completions", status="400") == 1
    # bob's key has no default class: the server default (standard) applies; headers and body pick others
    assert delta("sloserve:slo_requests_total", qos_class="standard") == 3
    assert delta("sloserve:slo_attained_requests_total", qos_class="standard") == 3
    assert delta("sloserve:slo_requests_total", qos_class="impossible") == 1
    assert delta("sloserve:slo_attained_requests_total", qos_class="impossible") == 0
    assert delta("sloserve:slo_requests_total", qos_class="interactive") == 1
    assert metric(after, "sloserve:slo_attainment_ratio", qos_class="impossible") == 0.0
    assert metric(after, "sloserve:kv_cache_usage_perc") == 0
    for name in ("sloserve:prefix_cache_queries_total", "sloserve:prefix_cache_hits_total",
                 "sloserve:num_preemptions_total", "sloserve:num_requests_waiting"):
        assert (name, ()) in after
    log = server.log()
    assert "tenant=bob class=impossible" in log and "tenant=bob class=interactive" in log


def test_access_log_names_tenant_and_class(server, client, model_name):
    client.completions.create(model=model_name, prompt="Hi", max_tokens=2, temperature=0,
                              extra_headers={"X-Request-Id": "alice-req-1"})
    line = wait_for(lambda: next((l for l in server.log().splitlines() if "id=alice-req-1 " in l), None), 10,
                    what="access log line")
    for field in ("tenant=alice", "class=interactive", "status=200", "prompt_tokens=", "output_tokens=2", "ttft=",
                  "e2e=", "finish=length"):
        assert field in line, line
