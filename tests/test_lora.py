"""LoRA adapters (engine/lora.py): PEFT adapters built with peft on the HF form of the embedded
model, served beside the base in one batch, each equal to the same model with that adapter merged
into its weights (transformers' forward of peft's merge); the prefix cache keyed by adapter; bad
adapters refused with a message; an adapter unloaded under use finishing its requests."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine_helpers import EXACT
from sloserve import LLM, SamplingParams
from sloserve.core.config import ModelConfig
from sloserve.engine.lora import LoraError, LoraRegistry, load_peft_adapter, parse_lora_option

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Three unlike adapters: every projection at rank 8; q and v at rank 4 with rsLoRA; the MLP and o
# at rank 16 with down_proj's alpha from alpha_pattern.
ADAPTERS = {
    "all-r8": dict(r=8, lora_alpha=16, target_modules=ALL),
    "qv-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
    "mlp-r16": dict(r=16, lora_alpha=16, target_modules=["o_proj", "gate_proj", "up_proj", "down_proj"],
                    alpha_pattern={"down_proj": 48}),
}
PROMPTS = [[1, 504, 3458, 282, 4649, 314, 216] + list(range(1000, 1000 + n)) for n in (3, 20, 40, 9)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(hf_reference, tmp_path_factory):
    """Adapter name -> (PEFT directory, {prompt: transformers' greedy tokens for it, the adapter
    merged}). The merged models are dropped once their PROMPTS are answered: three fp32 copies of
    the model held all module long pushed a test worker toward the machine's memory limit."""
    from peft import LoraConfig, get_peft_model

    out = {}
    for seed, (name, cfg) in enumerate(ADAPTERS.items(), start=1):
        model = get_peft_model(copy.deepcopy(hf_reference), LoraConfig(**cfg))
        g = torch.Generator().manual_seed(seed)
        for pname, p in model.named_parameters():
            if "lora_B" in pname:  # peft starts B at zero (no effect): random non-zero weights instead
                p.data = torch.randn(p.shape, generator=g) * 0.05
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory)
        merged = model.merge_and_unload().eval()
        out[name] = (str(directory), {tuple(p): reference(merged, p) for p in PROMPTS})
        del model, merged
    return out


@pytest.fixture(scope="module")
def lora_llm(adapters):
    return LLM(**EXACT, lora_modules={name: d for name, (d, _) in adapters.items()}, max_loras=2)


def reference(model, prompt: list[int], n: int = 8) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
def test_mixed_batch_equals_each_adapter_merged(lora_llm, adapters, hf_reference):
    """3 adapters and the base in one batch (and the same prompt under two adapters): each
    request's greedy tokens equal transformers' on the model with its adapter merged."""
    names = list(ADAPTERS)
    loras = names + [None, names[0]]
    prompts = PROMPTS + [PROMPTS[1]]
    outs = lora_llm.generate(prompts, GREEDY, lora=loras)
    for prompt, lora, out in zip(prompts, loras, outs):
        expected = reference(hf_reference, prompt) if lora is None else adapters[lora][1][tuple(prompt)]
        assert out.token_ids == expected, (lora, len(prompt))
    base = lora_llm.generate(prompts[:3], GREEDY)  # equal to transformers' base model (test_engine)
    changed = sum(o.token_ids != b.token_ids for o, b in zip(outs[:3], base))
    assert changed >= 2, "the adapters should change what the base model says"


@pytest.mark.slow
def test_prefix_cache_is_keyed_by_adapter(lora_llm):
    prompt = list(range(2000, 2000 + 64))
    one = SamplingParams(max_tokens=1, temperature=0)
    first = lora_llm.generate([prompt], one, lora="all-r8")[0]
    other = lora_llm.generate([prompt], one, lora="qv-r4")[0]
    base = lora_llm.generate([prompt], one)[0]
    again = lora_llm.generate([prompt], one, lora="all-r8")[0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0  # another adapter's KV is not theirs
    assert again.num_cached_tokens >= 48  # its own adapter's is


@pytest.mark.slow
def test_unloaded_under_use_finishes_its_requests(lora_llm, adapters):
    engine = lora_llm.engine
    name, (directory, _) = "qv-r4", adapters["qv-r4"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    request = engine.make_request(PROMPTS[0], params, lora=name)
    engine.add(request)
    outs = engine.step()
    engine.loras.unload(name)
    assert name not in engine.loras.names()
    with pytest.raises(LoraError, match="not loaded"):
        engine.make_request(PROMPTS[0], params, lora=name)
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].finish_reason == "length"  # the rest of its output, with its adapter
    assert sum(len(out.delta_token_ids) for out in outs) == 8
    assert engine.loras.users(name) == 0 and name not in engine.loras.resident()
    engine.loras.load(name, directory)  # the name is free again
    assert name in engine.loras.names()


def small_config() -> ModelConfig:
    return ModelConfig("llama", vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=4)


def write_adapter(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return str(directory)


def key(layer: int, module: str, which: str) -> str:
    group = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"base_model.model.model.layers.{layer}.{group}.{module}.lora_{which}.weight"


def test_fused_layout_and_scaling(tmp_path):
    """q and v of one layer fuse into the qkv projection: A stacked, B block-diagonal with the
    scaling (alpha / r, alpha / sqrt(r) under rsLoRA) folded in."""
    cfg = small_config()
    a_q, b_q = torch.randn(2, 16), torch.randn(16, 2)
    a_v, b_v = torch.randn(2, 16), torch.randn(8, 2)
    path = write_adapter(tmp_path / "qv", {"r": 2, "lora_alpha": 4, "use_rslora": True},
                         {key(1, "q_proj", "A"): a_q, key(1, "q_proj", "B"): b_q,
                          key(1, "v_proj", "A"): a_v, key(1, "v_proj", "B"): b_v})
    adapter = load_peft_adapter("qv", path, cfg)
    assert adapter.layers[0] == {} and set(adapter.layers[1]) == {"qkv"}
    a, b = adapter.layers[1]["qkv"]
    x = torch.randn(3, 16)
    delta = (x @ a.t()) @ b.t()
    scale = 4 / 2 ** 0.5
    torch.testing.assert_close(delta[:, :16], scale * (x @ a_q.t()) @ b_q.t())
    torch.testing.assert_close(delta[:, 16:24], torch.zeros(3, 8))  # k is untouched
    torch.testing.assert_close(delta[:, 24:], scale * (x @ a_v.t()) @ b_v.t())
    assert adapter.target_modules == ("q_proj", "v_proj") and adapter.rank == 2


@pytest.mark.parametrize("config, tensors, message", [
    ({"r": 2, "use_dora": True}, None, "DoRA"),
    ({"r": 2, "modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({"r": 2, "bias": "all"}, None, "bias"),
    ({"r": 2, "fan_in_fan_out": True}, None, "fan_in_fan_out"),
    ({"r": 2}, {key(0, "q_proj", "A"): torch.randn(2, 15), key(0, "q_proj", "B"): torch.randn(16, 2)}, "needs A"),
    ({"r": 2}, {key(5, "q_proj", "A"): torch.randn(2, 16), key(5, "q_proj", "B"): torch.randn(16, 2)}, "layer 5"),
    ({"r": 2}, {key(0, "q_proj", "A"): torch.randn(2, 16)}, "without its pair"),
    ({"r": 2}, {"base_model.model.model.embed_tokens.lora_A.weight": torch.randn(2, 32)}, "not a LoRA matrix"),
    ({"r": 128}, {key(0, "o_proj", "A"): torch.randn(128, 16), key(0, "o_proj", "B"): torch.randn(16, 128)},
     "max-lora-rank"),
    ({"r": 2}, {key(0, "o_proj", "A"): torch.full((2, 16), float("nan")), key(0, "o_proj", "B"): torch.randn(16, 2)},
     "NaN"),
])
def test_bad_adapters_are_refused_by_name(tmp_path, config, tensors, message):
    good = {key(0, "q_proj", "A"): torch.randn(2, 16), key(0, "q_proj", "B"): torch.randn(16, 2)}
    path = write_adapter(tmp_path / "bad", config, good if tensors is None else tensors)
    with pytest.raises(LoraError, match=message) as info:
        load_peft_adapter("bad", path, small_config())
    assert "adapter 'bad'" in str(info.value)


def test_missing_files_and_names(tmp_path):
    cfg = small_config()
    with pytest.raises(LoraError, match="adapter_config.json"):
        load_peft_adapter("x", str(tmp_path / "nowhere"), cfg)
    (tmp_path / "cfg-only").mkdir()
    (tmp_path / "cfg-only" / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraError, match="not readable JSON"):
        load_peft_adapter("x", str(tmp_path / "cfg-only"), cfg)
    (tmp_path / "cfg-only" / "adapter_config.json").write_text('{"r": 2}')
    with pytest.raises(LoraError, match="safetensors"):
        load_peft_adapter("x", str(tmp_path / "cfg-only"), cfg)
    for bad in ("", "has space", "x" * 200, "-lead"):
        with pytest.raises(LoraError, match="adapter name"):
            parse_lora_option(f"{bad}=/tmp")
    with pytest.raises(LoraError, match="NAME=PATH"):
        parse_lora_option("justaname")
    assert parse_lora_option("sql-v2=/adapters/sql") == ("sql-v2", "/adapters/sql")


def test_registry_keeps_the_last_used_resident_and_refuses_duplicates(tmp_path):
    cfg = small_config()
    tensors = {key(0, "q_proj", "A"): torch.randn(2, 16), key(0, "q_proj", "B"): torch.randn(16, 2)}
    path = write_adapter(tmp_path / "a", {"r": 2}, tensors)
    registry = LoraRegistry(cfg, torch.float32, torch.device("cpu"), max_loras=2)
    for name in "abc":
        registry.load(name, path)
    with pytest.raises(LoraError, match="already loaded"):
        registry.load("a", path)
    registry.for_step(["a"])
    registry.for_step(["b"])
    registry.for_step(["c"])
    assert registry.resident() == ["b", "c"]
    registry.for_step(["a", "b", "c"])  # a step may use more than max_loras: all stay for it
    assert registry.resident() == ["a", "b", "c"]
    registry.for_step(["a"])
    assert registry.resident() == ["c", "a"]
    registry.acquire("a")
    registry.unload("a")
    assert registry.names() == ("b", "c") and registry.users("a") == 1
    with pytest.raises(LoraError, match="unloaded, still finishing"):
        registry.load("a", path)
    registry.release("a")
    assert "a" not in registry.resident()
    registry.load("a", path)


# ---------------------------------------------------------------- over HTTP, with the official client

ADMIN = "sk-admin-test"
QOS = """
api_keys:
  sk-alice: {tenant: alice, adapters: [all-r8]}
  sk-bob: {tenant: bob, adapters: []}
  sk-ops: {tenant: ops}
"""


@pytest.fixture(scope="module")
def lora_server(adapters, tmp_path_factory):
    from server_helpers import ServerProcess

    directory = tmp_path_factory.mktemp("lora-server")
    (directory / "qos.yaml").write_text(QOS)
    proc = ServerProcess(["--lora", f"all-r8={adapters['all-r8'][0]}", "--admin-key", ADMIN,
                          "--qos-config", str(directory / "qos.yaml")], directory / "server.log")
    yield proc
    proc.kill()


def client(server, key: str):
    import openai

    return openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)


@pytest.mark.slow
def test_server_serves_adapters_by_model_name(lora_server, lora_llm):
    """The adapter named as `model` gives what the offline engine gives with it, streamed or not;
    /v1/models lists it under its base; a key may use only the adapters its config names."""
    alice, bob = client(lora_server, "sk-alice"), client(lora_server, "sk-bob")
    ids = [m.id for m in alice.models.list().data]
    assert ids[-1] == "all-r8" and len(ids) == 2
    assert [m.id for m in bob.models.list().data] == ids[:1]
    card = [m for m in alice.models.list().data if m.id == "all-r8"][0]
    assert card.model_extra["parent"] == ids[0]

    mine = lora_llm.generate(PROMPTS, GREEDY, lora="all-r8")
    theirs = lora_llm.generate(PROMPTS, GREEDY)
    prompt, want = next((p, m.token_ids) for p, m, b in zip(PROMPTS, mine, theirs) if m.token_ids != b.token_ids)
    text = lora_llm.tokenizer.decode(want)
    out = alice.completions.create(model="all-r8", prompt=prompt, max_tokens=8, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert out.model == "all-r8" and out.choices[0].text == text
    streamed = "".join(c.choices[0].text for c in alice.completions.create(
        model="all-r8", prompt=prompt, max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True})
        if c.choices)
    assert streamed == text
    base = alice.completions.create(model=ids[0], prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert base.choices[0].text != text

    import openai
    with pytest.raises(openai.NotFoundError) as info:
        bob.completions.create(model="all-r8", prompt=prompt, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    assert "all-r8" not in info.value.body["message"].split("available:")[1]


@pytest.mark.slow
def test_adapters_load_and_unload_under_load_lose_nothing(lora_server, adapters):
    """Streams on an adapter go on while it is unloaded and another is loaded; every stream ends
    with its full output; afterwards the unloaded name is 404 and the new one serves."""
    import concurrent.futures

    import httpx
    import openai

    ops = client(lora_server, "sk-ops")
    admin = {"Authorization": f"Bearer {ADMIN}"}
    url = lora_server.base_url
    assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "qv-r4", "lora_path": "/x"}).status_code == 401
    assert httpx.post(f"{url}/v1/load_lora_adapter", headers={"Authorization": "Bearer sk-ops"},
                      json={"lora_name": "qv-r4", "lora_path": adapters["qv-r4"][0]}).status_code == 403
    bad = httpx.post(f"{url}/v1/load_lora_adapter", headers=admin, json={"lora_name": "qv-r4", "lora_path": "/nowhere"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_lora_adapter"
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", headers=admin,
                        json={"lora_name": "qv-r4", "lora_path": adapters["qv-r4"][0]})
    assert loaded.status_code == 200 and loaded.json()["rank"] == 4
    again = httpx.post(f"{url}/v1/load_lora_adapter", headers=admin,
                       json={"lora_name": "qv-r4", "lora_path": adapters["qv-r4"][0]})
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]

    def stream(i: int) -> tuple[int, str]:
        chunks = list(ops.completions.create(model="qv-r4", prompt=PROMPTS[i % 4], max_tokens=24, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True},
                                             stream_options={"include_usage": True}))
        return chunks[-1].usage.completion_tokens, [c for c in chunks if c.choices][-1].choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(stream, i) for i in range(4)]
        import time
        time.sleep(1.0)  # the streams are under way
        unloaded = httpx.post(f"{url}/v1/unload_lora_adapter", headers=admin, json={"lora_name": "qv-r4"})
        assert unloaded.status_code == 200
        mlp = httpx.post(f"{url}/v1/load_lora_adapter", headers=admin,
                         json={"lora_name": "mlp-r16", "lora_path": adapters["mlp-r16"][0]})
        assert mlp.status_code == 200
        results = [f.result(timeout=300) for f in futures]
    assert results == [(24, "length")] * 4
    with pytest.raises(openai.NotFoundError):
        ops.completions.create(model="qv-r4", prompt=PROMPTS[0], max_tokens=2)
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", headers=admin, json={"lora_name": "qv-r4"})
    assert gone.status_code == 404
    assert ops.completions.create(model="mlp-r16", prompt=PROMPTS[0], max_tokens=2).usage.completion_tokens >= 1
    assert "mlp-r16" in [m.id for m in ops.models.list().data]
    metrics = httpx.get(f"{url}/metrics", headers=admin).text
    assert 'sloserve:request_success_total{finished_reason="length",model_name="qv-r4"} 4.0' in metrics


@pytest.mark.slow
def test_fleet_front_fans_adapters_out_to_every_worker(adapters, lora_llm, tmp_path):
    """`serve --instances 2`: an adapter given at start and one loaded at the front both serve
    from either worker (the same greedy text as the offline engine); a load no worker can take
    is the workers' 400; unloading at the front makes the name 404 everywhere."""
    import httpx
    import openai

    from server_helpers import ServerProcess

    proc = ServerProcess(["--instances", "2", "--router", "round-robin", "--lora",
                          f"all-r8={adapters['all-r8'][0]}", "--admin-key", ADMIN], tmp_path / "front.log")
    try:
        api = client(proc, "none")
        admin = {"Authorization": f"Bearer {ADMIN}"}
        url = proc.base_url
        assert httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}).status_code == 401
        bad = httpx.post(f"{url}/v1/load_lora_adapter", headers=admin, json={"lora_name": "x", "lora_path": "/nowhere"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_lora_adapter"
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", headers=admin,
                            json={"lora_name": "qv-r4", "lora_path": adapters["qv-r4"][0]})
        assert loaded.status_code == 200 and loaded.json()["instances"] == 2
        assert {"all-r8", "qv-r4"} <= {m.id for m in api.models.list().data}
        for name in ("all-r8", "qv-r4"):
            want = lora_llm.tokenizer.decode(lora_llm.generate([PROMPTS[1]], GREEDY, lora=name)[0].token_ids)
            for _ in range(2):  # round-robin: once on each worker
                out = api.completions.create(model=name, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
                assert out.choices[0].text == want, name
        gone = httpx.post(f"{url}/v1/unload_lora_adapter", headers=admin, json={"lora_name": "qv-r4"})
        assert gone.status_code == 200 and gone.json()["instances"] == 2
        for _ in range(2):
            with pytest.raises(openai.NotFoundError):
                api.completions.create(model="qv-r4", prompt=PROMPTS[1], max_tokens=2)
        assert httpx.post(f"{url}/v1/unload_lora_adapter", headers=admin,
                          json={"lora_name": "qv-r4"}).status_code == 404
    finally:
        proc.kill()


def test_stacked_deltas_equal_one_adapter_at_a_time(tmp_path):
    """A step mixing adapters computes them stacked (one GEMM pair, rows masked to their own
    adapter's columns): the same deltas as adapter by adapter, rows of the base model untouched,
    a resident adapter the step does not use changing nothing."""
    from sloserve.engine.lora import LoraBatch, LoraStack

    cfg = small_config()
    g = torch.Generator().manual_seed(0)
    adapters = []
    for i, (r, modules) in enumerate([(2, ["q_proj", "v_proj"]), (4, ["q_proj", "o_proj", "down_proj"]),
                                      (3, ["gate_proj", "up_proj", "down_proj"])]):
        shapes = {"q_proj": (16, 16), "k_proj": (8, 16), "v_proj": (8, 16), "o_proj": (16, 16),
                  "gate_proj": (24, 16), "up_proj": (24, 16), "down_proj": (16, 24)}
        tensors = {}
        for layer in range(2):
            for m in modules:
                out_f, in_f = shapes[m]
                tensors[key(layer, m, "A")] = torch.randn(r, in_f, generator=g)
                tensors[key(layer, m, "B")] = torch.randn(out_f, r, generator=g)
        adapters.append(load_peft_adapter(f"a{i}", write_adapter(tmp_path / f"a{i}", {"r": r}, tensors), cfg))
    rows = [torch.tensor([0, 3, 4]), torch.tensor([1, 5])]  # a0 and a1 in the step; rows 2 and 6: the base model
    groups = [(adapters[0], rows[0]), (adapters[1], rows[1])]
    stacked = LoraBatch(groups, LoraStack.of(adapters))  # a2 resident, not in the step
    plain = LoraBatch(groups)
    widths = {"qkv": (16, 32), "o": (16, 16), "gate_up": (16, 48), "down": (24, 16)}
    for layer in range(2):
        for part, (in_f, out_f) in widths.items():
            x, base = torch.randn(7, in_f, generator=g), torch.randn(7, out_f, generator=g)
            one, two = base.clone(), base.clone()
            stacked.add(layer, part, x, one)
            plain.add(layer, part, x, two)
            torch.testing.assert_close(one, two)
            torch.testing.assert_close(one[[2, 6]], base[[2, 6]])
