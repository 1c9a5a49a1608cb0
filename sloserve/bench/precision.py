"""Precision specs for the benchmarks: one string names the engine's dtype and weight quantization.

    default          the engine's own defaults (dtype auto, quantization auto, dense copy kept):
                     no engine arguments, no `sloserve serve` flags
    D                dtype D, quantization none (`float32` is the exact reference configuration)
    D+Q              dtype D, quantization Q (`bfloat16+int8`, `float32+int4`, `bfloat16+auto`)
    D+Q/only         the same without the dense 16-bit copy of the quantized linears
                     (`quantized_dense_copy=False`, `sloserve serve --quantized-only`)
    SPEC@K           any of these with bf16 attention on native path K (amx|avx512_bf16|portable;
                     `attention_kernel=K`, `sloserve serve --attention-kernel K`), e.g. `default@portable`

D is one of auto|float32|bfloat16, Q one of auto|none|int8|int4|w8a8 (the choices of `sloserve serve
--dtype/--quantization`). No torch import here: the benchmarks' parents parse specs before any
engine exists (sloserve.core.config imports no torch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sloserve.core.config import ATTENTION_KERNELS

DTYPES = ("auto", "float32", "bfloat16")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "w8a8")
DEFAULT = "default"
SYNTAX = ("default, D, D+Q or D+Q/only, each optionally @K (D: auto|float32|bfloat16, Q: auto|none|int8|int4|w8a8, "
          "K: amx|avx512_bf16|portable)")


@dataclass(frozen=True)
class Precision:
    """One parsed spec. `label` is its canonical spelling (`float32+none` -> `float32`)."""

    label: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    serve_args: tuple[str, ...] = ()  # `sloserve serve` flags

    @property
    def is_default(self) -> bool:
        return self.label == DEFAULT


def precision_flags(spec: str) -> tuple[dict[str, Any], list[str]]:
    """`spec` -> (EngineConfig keyword arguments, `sloserve serve` arguments); ValueError if malformed.

    >>> precision_flags("bfloat16+int4/only")
    ({'dtype': 'bfloat16', 'quantization': 'int4', 'quantized_dense_copy': False}, \
['--dtype', 'bfloat16', '--quantization', 'int4', '--quantized-only'])
    """
    p = parse_precision(spec)
    return dict(p.engine_kwargs), list(p.serve_args)


def parse_precision(spec: str) -> Precision:
    text, at, kernel = spec.strip().partition("@")
    if at:
        if kernel not in ATTENTION_KERNELS:
            raise ValueError(f"precision {spec!r}: attention kernel {kernel!r} is not one of "
                             f"{'|'.join(ATTENTION_KERNELS)} (expected {SYNTAX})")
        base = parse_precision(text)
        if kernel == "auto":
            return base
        return Precision(f"{base.label}@{kernel}", {**base.engine_kwargs, "attention_kernel": kernel},
                         base.serve_args + ("--attention-kernel", kernel))
    if text == DEFAULT:
        return Precision(DEFAULT)
    body, slash, suffix = text.partition("/")
    if slash and suffix != "only":
        raise ValueError(f"precision {spec!r}: the only suffix is /only (expected {SYNTAX})")
    dtype, plus, quant = body.partition("+")
    if dtype not in DTYPES:
        raise ValueError(f"precision {spec!r}: dtype {dtype!r} is not one of {'|'.join(DTYPES)} (expected {SYNTAX})")
    if plus and quant not in QUANTIZATIONS:
        raise ValueError(f"precision {spec!r}: quantization {quant!r} is not one of {'|'.join(QUANTIZATIONS)} "
                         f"(expected {SYNTAX})")
    quant = quant or "none"
    if slash and quant == "none":
        raise ValueError(f"precision {spec!r}: /only needs a quantization (D+Q/only, Q not none)")
    kwargs: dict[str, Any] = {"dtype": dtype, "quantization": quant}
    args = ["--dtype", dtype, "--quantization", quant]
    if slash:
        kwargs["quantized_dense_copy"] = False
        args.append("--quantized-only")
    label = dtype if quant == "none" else f"{dtype}+{quant}" + ("/only" if slash else "")
    return Precision(label, kwargs, tuple(args))


def parse_precision_list(text: str) -> list[Precision]:
    """A comma-separated list; order kept, specs that mean the same thing kept once; ValueError if empty."""
    out: dict[str, Precision] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        p = parse_precision(item)
        out.setdefault(p.label, p)
    if not out:
        raise ValueError(f"no precision given (each item: {SYNTAX})")
    return list(out.values())


def checkpoint_quantization(model_dir) -> str:
    """How a Hugging Face-format checkpoint (a peer's copy of the weights) stores them: "none", or
    its config.json's quantization in short, e.g. "int8 W8A8 (compressed-tensors)" for int8
    weights with int8 activations per token; "?" where config.json cannot be read."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return "?"
    quant = config.get("quantization_config")
    if not quant:
        return "none"
    method = quant.get("quant_method", "?")
    for group in (quant.get("config_groups") or {}).values():
        weights, acts = group.get("weights") or {}, group.get("input_activations") or {}
        if weights.get("type") == "int":
            scheme = f"W{weights.get('num_bits')}A{acts.get('num_bits', 16) if acts else 16}"
            return f"int{weights.get('num_bits')} {scheme} ({method})"
    return method
