"""Prefill/decode disaggregation on a real fleet (`sloserve serve --pd P:D`, the embedded model,
worker processes, 127.0.0.1). Every stream is prefilled on the prefill instance and handed to a
decode instance after its first token; the client sees one stream with each token once and
exactly the text a colocated run gives (the reference: a worker asked directly). A non-streamed
call is relayed as a stream and handed off too, and answered whole with the JSON the worker would
have sent; one with several choices is split into one such call per choice and put back together. Failures: a decode
instance dying after the hand-off, every decode instance gone before it. Pools end free every
time. (test_pd_live.py: the live transfer, per-pool settings, the prefill instance gone.)"""
from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import OpenAI

from migration_helpers import admin, all_healthy, colocated, handoffs, instances, pools_free, running_fleet, stream
from server_helpers import wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
GREEDY = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_tokens": 32, "temperature": 0.9, "seed": 77, "ignore_eos": True}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    with running_fleet(["--pd", "1:2", "--pd-transfer", "blocking"], tmp_path_factory, 3) as server:
        yield server


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_handed_off_stream_matches_colocated_output(fleet, params):
    base = fleet.base_url
    info = instances(base)
    assert [d["role"] for d in info["data"]] == ["prefill", "decode", "decode"]
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    expected = colocated(base, prompt, params)
    before, resumed_before = handoffs(base), instances(base)["counters"]["resumed_midstream"]
    text, _ = stream(base, prompt, params)
    assert text == expected
    after, resumed = handoffs(base), instances(base)["counters"]["resumed_midstream"] - resumed_before
    assert after["completed"] == before["completed"] + 1 and after["bytes"] > before["bytes"]
    # A stream whose decode instance stalls under load resumes elsewhere (the text above is still exact); one that
    # resumed on the prefill instance may finish there. Without a resume, nothing decodes on the prefill instance.
    on_prefill = after["decoded_on_prefill"] - before["decoded_on_prefill"]
    assert after["transfer"] == "blocking" and on_prefill <= resumed, (resumed, fleet.log()[-6000:])
    wait_for(lambda: pools_free(base), 30, interval=0.3, what="every KV pool free")
    metrics = admin("GET", base + "/metrics").text
    for name in ("sloserve:pd_handoffs_completed_total", "sloserve:pd_handoff_bytes_total",
                 "sloserve:pd_handoff_seconds_bucket", 'sloserve:instance_role{instance="1",role="decode"}'):
        assert name in metrics, name


def test_concurrent_streams_spread_over_the_decode_pool(fleet):
    base = fleet.base_url
    prompts = [f"Tell me fact number {i} about the ocean." for i in range(6)]
    expected = {p: colocated(base, p, GREEDY) for p in prompts}
    routed_before = [d["routed"] for d in instances(base)["data"]]
    before = handoffs(base)["completed"]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda p: stream(base, p, GREEDY)[0], prompts))
    assert results == [expected[p] for p in prompts]
    assert handoffs(base)["completed"] == before + 6
    routed = [d["routed"] - b for d, b in zip(instances(base)["data"], routed_before)]
    assert routed[0] == 6 and routed[1] >= 1 and routed[2] >= 1, routed  # both decode instances took some
    wait_for(lambda: pools_free(base), 30, interval=0.3, what="every KV pool free")


def test_openai_chat_stream_through_a_handoff(fleet):
    client = OpenAI(base_url=fleet.base_url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Name five colours."}]
    before = handoffs(fleet.base_url)["completed"]
    pieces, usage = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert "".join(pieces) == plain.choices[0].message.content
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens
    assert handoffs(fleet.base_url)["completed"] == before + 2  # the plain call is handed off too


def test_a_non_streamed_call_is_handed_off_and_answered_whole(fleet):
    """Decoded on a decode instance, yet the client gets the one JSON answer the worker sends
    for a non-streamed call: the same text, logprobs, finish reason and usage as the stream."""
    base = fleet.base_url
    prompt = "Explain why the sky is blue in two sentences."
    params = {**GREEDY, "logprobs": 2}
    ref = colocated(base, prompt, params, whole=True)
    expected, ref_lp = ref["choices"][0]["text"], ref["choices"][0]["logprobs"]
    before = handoffs(base)["completed"]
    r = httpx.post(base + "/v1/completions", json={"prompt": prompt, **params}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json" and r.headers["x-request-id"]
    answer = r.json()
    assert handoffs(base)["completed"] == before + 1
    assert set(answer) == {"id", "object", "created", "model", "choices", "usage"}
    assert answer["object"] == "text_completion" and answer["id"].startswith("cmpl-")
    (choice,) = answer["choices"]
    assert choice["text"] == expected and choice["finish_reason"] == "length" and choice["index"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == GREEDY["max_tokens"]
    assert lp["tokens"] == ref_lp["tokens"] and lp["text_offset"] == ref_lp["text_offset"]
    assert lp["token_logprobs"] == pytest.approx(ref_lp["token_logprobs"], abs=0.05)
    assert [sorted(t) for t in lp["top_logprobs"]] == [sorted(t) for t in ref_lp["top_logprobs"]]
    assert answer["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert answer["usage"]["prompt_tokens_details"] == {"cached_tokens": answer["usage"]["prompt_tokens_details"]
                                                        ["cached_tokens"]}
    wait_for(lambda: pools_free(base), 30, interval=0.3, what="every KV pool free")


def test_a_call_with_several_choices_is_split_and_each_choice_handed_off(fleet):
    """n = 2 over two prompts: four one-choice calls, each handed off, answered as the one JSON the
    worker sends for the whole call (same order, seeds, texts, usage counting each prompt once)."""
    base = fleet.base_url
    prompts = ["Name three rivers in Europe.", "Describe a cat in one sentence."]
    params = {**SEEDED, "max_tokens": 16, "logprobs": 1, "n": 2}
    ref = colocated(base, prompts, params, whole=True)  # the worker's own four choices
    before = handoffs(base)["completed"]
    splits = instances(base)["counters"]["split_calls"]
    r = httpx.post(base + "/v1/completions", json={"prompt": prompts, **params}, headers={"X-Request-Id": "split-1"},
                   timeout=180)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert r.headers["x-request-id"] == answer["id"] == "split-1"
    assert handoffs(base)["completed"] == before + 4 and instances(base)["counters"]["split_calls"] == splits + 1
    assert set(answer) == set(ref) and answer["object"] == "text_completion"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]] == \
        [(c["index"], c["text"], c["finish_reason"]) for c in ref["choices"]]
    assert [c["logprobs"]["tokens"] for c in answer["choices"]] == [c["logprobs"]["tokens"] for c in ref["choices"]]
    assert answer["choices"][0]["text"] != answer["choices"][1]["text"]  # two samples of one prompt differ
    usage = answer["usage"]
    assert usage["prompt_tokens"] == ref["usage"]["prompt_tokens"] and usage["completion_tokens"] == 4 * 16
    assert usage["total_tokens"] == usage["prompt_tokens"] + 64

    # One part the worker refuses (its prompt and max_tokens overflow the context) ends the
    # others, which had started: the client gets that part's error, and no KV block stays taken.
    short = httpx.post(fleet.base_url + "/tokenize", json={"prompt": prompts[0]}).json()["tokens"]
    r = httpx.post(base + "/v1/completions", json={"prompt": [short, [42] * 8100], "n": 2, "max_tokens": 200,
                                                   "ignore_eos": True}, timeout=180)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    wait_for(lambda: pools_free(base), 30, interval=0.3, what="every KV pool free")


def test_a_stream_with_several_choices_is_split_and_each_choice_handed_off(fleet):
    """The openai client's n = 2 stream: each choice a stream of its own, handed off, merged into
    one stream (one id, one usage chunk) whose choices equal the worker's own."""
    client = OpenAI(base_url=fleet.base_url + "/v1", api_key="none")
    prompt = "Write a haiku about the moon."
    params = {"max_tokens": 16, "temperature": 0.9, "seed": 5, "n": 2}
    ref = colocated(fleet.base_url, prompt, {**params, "ignore_eos": True}, whole=True)
    before = handoffs(fleet.base_url)["completed"]
    texts, ids, usage = {0: "", 1: ""}, set(), None
    for chunk in client.completions.create(model=MODEL, prompt=prompt, stream=True, extra_body={"ignore_eos": True},
                                           stream_options={"include_usage": True}, **params):
        ids.add(chunk.id)
        for choice in chunk.choices:
            texts[choice.index] += choice.text
        if chunk.usage:
            assert usage is None
            usage = chunk.usage
    assert handoffs(fleet.base_url)["completed"] == before + 2 and len(ids) == 1
    assert [texts[0], texts[1]] == [c["text"] for c in ref["choices"]] and texts[0] != texts[1]
    assert usage.completion_tokens == 32 and usage.prompt_tokens == ref["usage"]["prompt_tokens"]

    # Chat: each choice opens with its role and is handed off; a part refused before it
    # starts fails the stream's call with the worker's 400 (nothing was sent yet).
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=8, temperature=0, n=2, stream=True)
    roles, contents = {}, {0: "", 1: ""}
    for chunk in chat:
        for choice in chunk.choices:
            roles.setdefault(choice.index, choice.delta.role)
            contents[choice.index] += choice.delta.content or ""
    assert roles == {0: "assistant", 1: "assistant"} and contents[0] == contents[1] != ""  # greedy: twice the same
    assert handoffs(fleet.base_url)["completed"] == before + 4
    short = httpx.post(fleet.base_url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    r = httpx.post(fleet.base_url + "/v1/completions", json={"prompt": [short, [42] * 8100], "max_tokens": 200,
                                                             "stream": True}, timeout=180)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    wait_for(lambda: pools_free(fleet.base_url), 30, interval=0.3, what="every KV pool free")


def test_openai_chat_answered_whole_after_a_handoff_equals_its_stream(fleet):
    client = OpenAI(base_url=fleet.base_url + "/v1", api_key="none")
    messages = [{"role": "user", "content": "Give me three tips for sleeping well."}]
    args = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0, logprobs=True, top_logprobs=2)
    before = handoffs(fleet.base_url)["completed"]
    whole = client.chat.completions.create(**args)
    pieces, tokens = [], []
    for chunk in client.chat.completions.create(**args, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            if chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                tokens += [t.token for t in chunk.choices[0].logprobs.content]
    assert handoffs(fleet.base_url)["completed"] == before + 2
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == "".join(pieces)
    assert [t.token for t in whole.choices[0].logprobs.content] == tokens
    assert all(len(t.top_logprobs) == 2 for t in whole.choices[0].logprobs.content)
    assert whole.usage.completion_tokens == len(tokens) == 20


def test_a_decode_instance_dying_after_the_handoff_loses_nothing(fleet):
    """The stream fails over (its prompt and tokens are computed again on the prefill instance)
    and is handed off again, to the other decode instance."""
    base = fleet.base_url
    params = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}
    prompt = "Describe a walk through a quiet forest in autumn."
    expected = colocated(base, prompt, params)
    before = instances(base)
    body = {"prompt": prompt, "stream": True, **params}
    texts: list[str] = []
    killed = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=180) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            texts.append(event["choices"][0]["text"])
            if len(texts) == 12 and not killed:
                victim = next(d for d in instances(base)["data"] if d["role"] == "decode" and d["in_flight"] > 0)
                os.kill(victim["pid"], signal.SIGKILL)
                killed.append(victim["instance"])
    assert killed and "".join(texts) == expected
    after = instances(base)
    assert after["counters"]["resumed_midstream"] == before["counters"]["resumed_midstream"] + 1
    assert after["handoffs"]["completed"] == before["handoffs"]["completed"] + 2
    all_healthy(base, 3)
    wait_for(lambda: pools_free(base), 60, interval=0.5, what="every KV pool free")


def test_with_every_decode_instance_gone_the_stream_decodes_where_it_was_prefilled(fleet):
    base = fleet.base_url
    prompt = "List three reasons to learn to cook."
    expected = colocated(base, prompt, GREEDY)
    before = handoffs(base)["decoded_on_prefill"]
    for d in instances(base)["data"]:
        if d["role"] == "decode":
            os.kill(d["pid"], signal.SIGKILL)
    text, _ = stream(base, prompt, GREEDY)
    assert text == expected
    assert handoffs(base)["decoded_on_prefill"] == before + 1
    all_healthy(base, 3)
    wait_for(lambda: pools_free(base), 60, interval=0.5, what="every KV pool free")
