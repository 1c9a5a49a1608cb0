"""benchmarks/models.py writes one set of random weights as a Hugging Face directory and as GGUF
files: on its tiny shapes (both architectures) sloserve reading the GGUF, sloserve reading the
directory and transformers reading the directory give the same greedy tokens, and the quantized
GGUF loads with the padded vocabulary."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import models  # noqa: E402

from sloserve import LLM, SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = "Hello there, how are"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_the_gguf_and_the_hf_directory_hold_the_same_model(name, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = models.SHAPES[name]
    hf = models.write_hf(shape, 0, tmp_path / "hf", dtype="float32")
    gguf_f32 = models.write_gguf(shape, 0, tmp_path / "m-f32.gguf", "f32")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    from_gguf = LLM(str(gguf_f32), dtype="float32", quantization="none").generate([PROMPT], greedy)[0].token_ids
    from_hf = LLM(str(hf), dtype="float32", quantization="none").generate([PROMPT], greedy)[0].token_ids
    tok = AutoTokenizer.from_pretrained(hf)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).generate(
        ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    assert from_gguf == from_hf == ref
    assert len(set(ref)) > 3  # weights large enough that attention moves the tokens (RoPE row order checked)
    q8 = LLM(str(models.write_gguf(shape, 0, tmp_path / "m-q8_0.gguf", "q8_0")), dtype="float32")
    assert q8.engine.model_config.vocab_size == shape.vocab == len(tok)
    assert len(q8.generate([PROMPT], greedy)[0].token_ids) == 12


def test_the_w8a8_checkpoint_holds_the_int8_codes_sloserve_computes(tmp_path):
    """vLLM's W8A8 peer (hf-w8a8) and sloserve's `--quantization int8` on the bf16 GGUF hold the
    same layer weights: every linear's int8 codes and scales match the engine's, q/k/v and gate/up
    fused as it fuses them; the rest of the checkpoint is the dense model's."""
    import json

    from safetensors.torch import load_file

    from sloserve.bench.precision import checkpoint_quantization
    from sloserve.core.config import EngineConfig
    from sloserve.engine.quant import Int8Linear

    shape = models.SHAPES["tiny-llama"]
    hf = models.write_hf(shape, 0, tmp_path / "hf-w8a8", w8a8=True)
    gguf_bf16 = models.write_gguf(shape, 0, tmp_path / "m-bf16.gguf", "bf16")
    tensors = load_file(str(hf / "model.safetensors"))
    config = json.loads((hf / "config.json").read_text())
    assert config["quantization_config"]["format"] == "int-quantized"
    assert checkpoint_quantization(hf) == "int8 W8A8 (compressed-tensors)"
    engine = LLM(config=EngineConfig(model=str(gguf_bf16), dtype="bfloat16", quantization="int8",
                                     quantized_dense_copy=False)).engine
    layer = engine.model.layers[1]
    fused = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}
    for part, names in fused.items():
        packed = layer[part]
        assert isinstance(packed, Int8Linear)
        prefix = ["model.layers.1." + ("self_attn." if n.endswith(("q_proj", "k_proj", "v_proj")) else "mlp.") + n
                  for n in names]
        codes = torch.cat([tensors[p + ".weight"] for p in prefix])
        scales = torch.cat([tensors[p + ".weight_scale"] for p in prefix])
        assert codes.dtype == torch.int8 and scales.shape == (codes.shape[0], 1)
        assert torch.equal(codes, packed.codes)
        assert torch.equal(scales.squeeze(1), packed.scale.float())
    dense = dict(models.weights(shape, 0))
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(tensors["model.norm.weight"].float(), torch.from_numpy(dense["model.norm.weight"]))


def test_the_gemm_ceiling_times_a_shapes_linears(tmp_path):
    """benchmarks/gemm_ceiling.py on a tiny shape: one forward's linears timed per kernel and row
    count, written as JSON and a figure."""
    import json

    import gemm_ceiling

    assert gemm_ceiling.main(["--shape", "tiny-llama", "--rows", "1,8", "--rounds", "1",
                              "--output-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("gemm_ceiling-tiny-llama-*.json")
    report = json.loads(path.read_text())
    shape = models.SHAPES["tiny-llama"]
    assert report["weights"] == shape.layers * (shape.hidden * (shape.hidden + 2 * 2 * 16) + shape.hidden ** 2
                                                + 3 * shape.hidden * shape.intermediate) + shape.vocab * shape.hidden
    assert all(g > 0 for per in report["gflops_median"].values() for g in per.values())
    assert set(report["gflops_median"]["bf16 oneDNN"]) == {"1", "8"}
    assert path.with_suffix(".png").is_file()
