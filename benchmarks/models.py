"""Shape-alike models with seeded random weights, written once for every engine to read: a Hugging
Face directory (safetensors), the same as an int8 W8A8 checkpoint (compressed-tensors, for vLLM)
and GGUF files (F32, F16, BF16, Q8_0, Q4_0), the same weights in each.

Engine speed on a 135M model measures per-step overhead more than kernels; users serve 0.5-8B
models. Speed does not depend on what the weights mean when EOS is ignored, so a model with the
dimensions of Qwen2.5-0.5B or Llama-3.2-1B and random weights is what a like-for-like comparison
needs, and no download. The tokenizer is the embedded SmolLM2's (its 49,152 tokens, merges and
chat template) with control tokens `<|pad_N|>` up to the shape's vocabulary, so the embedding and
LM-head matrices have their real sizes and every engine can detokenize every id.

    .venv/bin/python benchmarks/models.py --shape llama-3.2-1b --formats hf,bf16,q8_0,q4_0
    # -> benchmarks/results/models/llama-3.2-1b/{hf/, llama-3.2-1b-bf16.gguf, ...}

What the files are is checked by tests/test_bench_models.py on a tiny shape: the GGUF and the HF
directory load into sloserve and into transformers and give the same greedy tokens.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "models"
GGUF_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


@dataclass(frozen=True)
class Shape:
    arch: str  # "llama" or "qwen2"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    qkv_bias: bool  # Qwen2's q/k/v projections carry biases
    tied: bool = True  # the LM head is the embedding
    init_std: float = 0.02  # the tiny shapes draw larger weights, so attention moves their greedy tokens

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


# Published dimensions (the models' config.json); context capped at 8192: what the benchmarks use,
# and no RoPE scaling to reproduce (it changes no step's cost).
SHAPES = {
    "qwen2.5-0.5b": Shape("qwen2", 896, 4864, 24, 14, 2, 151_936, 8192, 1_000_000.0, 1e-6, qkv_bias=True),
    "llama-3.2-1b": Shape("llama", 2048, 8192, 16, 32, 8, 128_256, 8192, 500_000.0, 1e-5, qkv_bias=False),
    # the embedded model's dimensions (SmolLM2-135M), for gemm_ceiling.py and random-weight peers
    "smollm2-135m": Shape("llama", 576, 1536, 30, 9, 3, 49_152, 8192, 100_000.0, 1e-5, qkv_bias=False),
    # for the tests: seconds to write and load
    "tiny-llama": Shape("llama", 64, 128, 2, 4, 2, 49_216, 512, 10_000.0, 1e-5, qkv_bias=False, init_std=0.3),
    "tiny-qwen2": Shape("qwen2", 64, 128, 2, 4, 2, 49_216, 512, 10_000.0, 1e-6, qkv_bias=True, init_std=0.3),
    # for the tests that run stock vLLM-CPU workers: its CPU attention takes head_dim 64 (not 16); a context
    # of 2048 leaves prompts room for several of its 128-token KV blocks; deep enough that a long stream is still
    # being generated while a test stops its worker (hundreds of tokens a second on one core, not thousands)
    "small-llama-h64": Shape("llama", 256, 1024, 8, 4, 2, 49_216, 2048, 10_000.0, 1e-5, qkv_bias=False,
                             init_std=0.3),
}


def tokenizer_metadata(vocab: int) -> dict:
    """The embedded model's GGUF tokenizer metadata, padded with control tokens to `vocab` ids."""
    from sloserve.engine.gguf_file import read_gguf
    from sloserve.engine.weights import embedded_model_path

    meta = read_gguf(embedded_model_path()).metadata
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    if vocab < len(tokens):
        raise ValueError(f"a vocabulary of {vocab} is smaller than the tokenizer's {len(tokens)}")
    pads = vocab - len(tokens)
    return {**{k: v for k, v in meta.items() if k.startswith("tokenizer.")},
            "tokenizer.ggml.tokens": tokens + [f"<|pad_{i}|>" for i in range(pads)],
            "tokenizer.ggml.token_type": types + [3] * pads}  # 3: control


def weights(shape: Shape, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face tensor name, float32 array) for every tensor, drawn from `seed`."""
    rng = np.random.default_rng(seed)
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim

    def normal(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * shape.init_std).astype(np.float32)

    yield "model.embed_tokens.weight", normal(shape.vocab, h)
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", np.ones(h, np.float32)
        yield p + "self_attn.q_proj.weight", normal(h, h)
        yield p + "self_attn.k_proj.weight", normal(kv, h)
        yield p + "self_attn.v_proj.weight", normal(kv, h)
        if shape.qkv_bias:
            yield p + "self_attn.q_proj.bias", normal(h)
            yield p + "self_attn.k_proj.bias", normal(kv)
            yield p + "self_attn.v_proj.bias", normal(kv)
        yield p + "self_attn.o_proj.weight", normal(h, h)
        yield p + "post_attention_layernorm.weight", np.ones(h, np.float32)
        yield p + "mlp.gate_proj.weight", normal(shape.intermediate, h)
        yield p + "mlp.up_proj.weight", normal(shape.intermediate, h)
        yield p + "mlp.down_proj.weight", normal(h, shape.intermediate)
    yield "model.norm.weight", np.ones(h, np.float32)
    if not shape.tied:
        yield "lm_head.weight", normal(shape.vocab, h)


# ---------------------------------------------------------------------- Hugging Face directory


def write_hf(shape: Shape, seed: int, out: Path, dtype: str = "bfloat16", w8a8: bool = False) -> Path:
    """`w8a8`: the layers' linears as a compressed-tensors int8 checkpoint (w8a8_tensors), the rest
    in `dtype`; vLLM reads it with its W8A8 kernels (int8 activations, per token)."""
    import torch
    from safetensors.torch import save_file

    from sloserve.engine.tokenizer import Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    meta = tokenizer_metadata(shape.vocab)
    tok = Tokenizer.from_gguf_metadata(meta)
    tok.backend.save(str(out / "tokenizer.json"))
    tokens = meta["tokenizer.ggml.tokens"]
    bos, eos = meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokens[bos], "eos_token": tokens[eos],
        "chat_template": meta.get("tokenizer.chat_template"), "model_max_length": shape.context}, indent=1))
    config = {
        "architectures": ["Qwen2ForCausalLM" if shape.arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": shape.arch, "hidden_size": shape.hidden, "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "vocab_size": shape.vocab,
        "max_position_embeddings": shape.context, "rms_norm_eps": shape.rms_eps, "rope_theta": shape.rope_theta,
        "tie_word_embeddings": shape.tied, "hidden_act": "silu", "bos_token_id": bos, "eos_token_id": eos,
        "torch_dtype": dtype, "attention_bias": shape.qkv_bias,
    }
    if shape.arch == "qwen2":
        config.update(use_sliding_window=False, sliding_window=shape.context, max_window_layers=shape.layers)
    if w8a8:
        config["quantization_config"] = W8A8_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": eos}))
    torch_dtype = getattr(torch, dtype)
    tensors = dict(w8a8_tensors(shape, seed, torch_dtype)) if w8a8 else \
        {name: torch.from_numpy(array).to(torch_dtype).contiguous() for name, array in weights(shape, seed)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# The layers' seven linears per block; embedding, norms and the (tied) head stay dense.
W8A8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# compressed-tensors' description of W8A8 int8: symmetric int8 weights with one scale per output
# channel, activations quantized per token at run time.
W8A8_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                              "dynamic": True},
    }},
    "ignore": ["lm_head"],
}


def w8a8_tensors(shape: Shape, seed: int, dtype) -> Iterator[tuple[str, "torch.Tensor"]]:
    """The model's tensors with every layer linear as int8 codes plus `weight_scale` [out, 1]: the
    codes and (bf16-rounded) scales sloserve's int8 kernels compute from the bf16 GGUF's weights
    (quant.Int8Linear), so `--quantization int8` on that GGUF and vLLM on this directory hold the
    same layer weights."""
    import torch

    from sloserve.engine.quant import Int8Linear

    for name, array in weights(shape, seed):
        tensor = torch.from_numpy(array)
        if name.endswith(".weight") and name.split(".")[-2] in W8A8_LINEARS:
            packed = Int8Linear(tensor.to(torch.bfloat16))
            yield name, packed.codes
            yield name + "_scale", packed.scale.float().unsqueeze(1).contiguous()
        else:
            yield name, tensor.to(dtype).contiguous()


# ---------------------------------------------------------------------- GGUF


def _gguf_name(hf_name: str) -> str:
    table = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
             "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
             "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
             "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.weight": "attn_output.weight",
             "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    if hf_name.startswith("model.layers."):
        _, _, i, rest = hf_name.split(".", 3)
        return f"blk.{i}.{table[rest]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def _interleave_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's half-split RoPE rows in llama.cpp's pairwise order (what its llama arch reads)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(shape: Shape, seed: int, path: Path, kind: str) -> Path:
    import gguf

    qtype = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
             "bf16": gguf.GGMLQuantizationType.BF16, "q8_0": gguf.GGMLQuantizationType.Q8_0,
             "q4_0": gguf.GGMLQuantizationType.Q4_0}[kind]
    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[kind]
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(path.stem)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(shape.vocab)
    w.add_file_type(ftype)
    meta = tokenizer_metadata(shape.vocab)
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(bool(meta.get("tokenizer.ggml.add_bos_token", False)))
    if meta.get("tokenizer.chat_template"):
        w.add_chat_template(meta["tokenizer.chat_template"])
    for name, array in weights(shape, seed):
        if shape.arch == "llama" and name.endswith("q_proj.weight"):
            array = _interleave_rows(array, shape.heads)
        elif shape.arch == "llama" and name.endswith("k_proj.weight"):
            array = _interleave_rows(array, shape.kv_heads)
        if array.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:  # norms and biases stay F32
            w.add_tensor(_gguf_name(name), array)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(_gguf_name(name), array.astype(np.float16))
        else:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_model(name: str, formats: list[str], out: Path = OUT, seed: int = 0) -> list[Path]:
    shape = SHAPES[name]
    written = []
    for fmt in formats:
        if fmt == "hf":
            written.append(write_hf(shape, seed, out / name / "hf"))
        elif fmt == "hf-w8a8":
            written.append(write_hf(shape, seed, out / name / "hf-w8a8", w8a8=True))
        elif fmt in GGUF_TYPES:
            written.append(write_gguf(shape, seed, out / name / f"{name}-{fmt}.gguf", fmt))
        else:
            raise ValueError(f"unknown format {fmt!r}; choose from hf, hf-w8a8, {', '.join(GGUF_TYPES)}")
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--formats", default="hf,bf16,q8_0,q4_0", help=f"hf, hf-w8a8 and/or {', '.join(GGUF_TYPES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    try:
        for path in write_model(args.shape, args.formats.split(","), args.out, args.seed):
            print(path)
    except ValueError as exc:
        print(f"models.py: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
