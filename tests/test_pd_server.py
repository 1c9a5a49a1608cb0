"""Prefill/decode disaggregation on a real fleet (`sloserve serve --pd P:D`, the embedded model,
worker processes, 127.0.0.1). Every stream is prefilled on the prefill instance and handed to a
decode instance after its first token; the client sees one stream with each token once and
exactly the text a colocated run gives (non-streamed requests are not handed off: they decode
where they were prefilled, which makes them the colocated reference). Failures: a decode
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

from migration_helpers import admin, all_healthy, colocated, handoffs, instances, pools_free, start_fleet, stream
from server_helpers import wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"
GREEDY = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_tokens": 32, "temperature": 0.9, "seed": 77, "ignore_eos": True}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    server = start_fleet(["--pd", "1:2"], tmp_path_factory, 3)
    try:
        yield server
    finally:
        server.kill()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_handed_off_stream_matches_colocated_output(fleet, params):
    base = fleet.base_url
    info = instances(base)
    assert [d["role"] for d in info["data"]] == ["prefill", "decode", "decode"]
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    expected = colocated(base, prompt, params)
    before = handoffs(base)
    text, _ = stream(base, prompt, params)
    assert text == expected
    after = handoffs(base)
    assert after["completed"] == before["completed"] + 1 and after["bytes"] > before["bytes"]
    assert after["transfer"] == "blocking" and after["decoded_on_prefill"] == 0
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
    assert handoffs(fleet.base_url)["completed"] == before + 1


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
