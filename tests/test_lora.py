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
from sloserve.config import ModelConfig
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
    """Adapter name -> (PEFT directory, transformers' model with it merged)."""
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
        out[name] = (str(directory), model.merge_and_unload().eval())
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
        model = hf_reference if lora is None else adapters[lora][1]
        assert out.token_ids == reference(model, prompt), (lora, len(prompt))
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
    assert registry.names() == ["b", "c"] and registry.users("a") == 1
    with pytest.raises(LoraError, match="unloaded, still finishing"):
        registry.load("a", path)
    registry.release("a")
    assert "a" not in registry.resident()
    registry.load("a", path)
