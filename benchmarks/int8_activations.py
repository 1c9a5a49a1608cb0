#!/usr/bin/env python3
"""Int8 activations against torch's weight-only kernels, side by side in one process: the LM head
(W8A8, int8 codes) and the 4-bit layers (W4A8, the GGUF's own codes).

1. Kernels alone, over the embedded model's own matrices: the int8 head [49,152 x 576] (weight-only
   vs W8A8) and one layer's four int4 linears (qkv, o, gate_up, down; torch's int4 kernel vs W4A8,
   times the 30 layers), best of 3 x 20 calls, at 1-16 rows.
2. One greedy stream of 128 tokens on the default configuration (the Q4_1 file's int4 layers,
   dtype auto), three ways, the order rotated between rounds (6 rounds): `weight-only` (both
   parts on torch's kernels), `head` (the W8A8 head alone: the default before the W4A8 layers),
   `head+layers` (today's default). Two engines (the layers' packing differs); the head's kernel
   is switched on the first between rounds.
3. Quality against the float32 reference (held-out ShareGPT, first 256 tokens of 40 texts):
   perplexity ratio and teacher-forced top-1 agreement of the same three, without the dense copy
   (so every row runs the packed kernels).

Nothing else should run meanwhile (two cores). Output: tables and
benchmarks/results/int8-activations-STAMP.json, figure benchmarks/figures/int8_activations.png.
(The head's part ran alone as benchmarks/head_w8a8.py before 2026-12-03 16:00 UTC.)

    .venv/bin/python benchmarks/int8_activations.py          # ~5 minutes on 2 cores
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from figure import measured_ticks, save  # noqa: E402
from migration_downtime import cpu_model  # noqa: E402
from sloserve.core.config import EngineConfig  # noqa: E402
from sloserve.engine.kernels import load_fused_ops  # noqa: E402
from sloserve.engine.llm import LLM  # noqa: E402
from sloserve.engine.quality import load_texts, perplexity, top1_agreement  # noqa: E402
from sloserve.engine.quant import GroupAffine4, Int4Linear, Int8Linear  # noqa: E402
from sloserve.engine.weights import load_model  # noqa: E402
from sloserve.core.types import SamplingParams  # noqa: E402

ROWS = (1, 2, 4, 8, 16)
LAYER_MATRICES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                  "down": ("down_proj",)}
CONFIGS = ("weight-only", "head", "head+layers")


def best_ms(fn, x: torch.Tensor) -> float:
    fn(x)
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(20):
            fn(x)
        times.append((time.perf_counter() - start) / 20)
    return min(times) * 1e3


def head_kernels(head: Int8Linear, kernels: tuple) -> None:
    """Switch the head between torch's weight-only kernel ((None, None)) and its W8A8 ones
    ((column kernel, tiled kernel or None), as the engine built it)."""
    head.w8a8, head.tiled = kernels


def head_alone(head: Int8Linear, kernels: tuple, dtype: torch.dtype) -> list[dict]:
    out = []
    for rows in ROWS:
        x = torch.randn(rows, head.codes.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
        head_kernels(head, (None, None))
        weight_only = best_ms(head, x)
        head_kernels(head, kernels)
        out.append({"rows": rows, "weight_only_ms": weight_only, "a8_ms": best_ms(head, x)})
    return out


def layers_alone(kernels, dtype: torch.dtype, num_layers: int) -> list[dict]:
    """Layer 0's four 4-bit matrices from the file, each in both packings; ms for all the layers."""
    weights = load_model(None, keep_int4=True).weights
    pairs, w_in = {}, {}
    for name, parts in LAYER_MATRICES.items():
        prefix = "model.layers.0.self_attn." if name in ("qkv", "o") else "model.layers.0.mlp."
        w = GroupAffine4.cat([weights[prefix + p + ".weight"] for p in parts])
        pairs[name] = (Int4Linear(w), Int4Linear(w, w4a8=kernels.int4_gemv))
        w_in[name] = w.shape[1]
    out = []
    for rows in ROWS:
        row = {"rows": rows, "weight_only_ms": 0.0, "a8_ms": 0.0}
        for name, (torch_form, a8_form) in pairs.items():
            x = torch.randn(rows, w_in[name], generator=torch.Generator().manual_seed(rows)).to(dtype)
            row[f"{name}_weight_only_ms"], row[f"{name}_a8_ms"] = best_ms(torch_form, x), best_ms(a8_form, x)
            row["weight_only_ms"] += row[f"{name}_weight_only_ms"] * num_layers
            row["a8_ms"] += row[f"{name}_a8_ms"] * num_layers
        out.append(row)
    return out


def single_stream(plain: LLM, fast: LLM, rounds: int = 6, tokens: int = 128) -> dict:
    """`plain` has torch's int4 layers (its head switched between kernels), `fast` the W4A8 ones."""
    head = getattr(plain.engine.model.lm_head, "small", plain.engine.model.lm_head)
    kernels = (head.w8a8, head.tiled)
    prompt = plain.tokenizer.encode("Write a long story about a lighthouse keeper and the sea.")
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    plain.generate([prompt], params)  # warm-up
    fast.generate([prompt], params)
    ms: dict[str, list[float]] = {c: [] for c in CONFIGS}
    ids: dict[str, list[int]] = {}
    for r in range(rounds):
        for name in CONFIGS[r % 3:] + CONFIGS[:r % 3]:
            head_kernels(head, kernels if name == "head" else (None, None))
            llm = fast if name == "head+layers" else plain
            start = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            ms[name].append((time.perf_counter() - start) / tokens * 1e3)
            ids[name] = out.token_ids
    head_kernels(head, kernels)

    def shared(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return {"ms_per_token": ms, "median": {k: statistics.median(v) for k, v in ms.items()},
            "rounds_won_by_head+layers": sum(all(ms["head+layers"][r] < ms[c][r] for c in CONFIGS[:2])
                                             for r in range(rounds)),
            "common_prefix_with_weight_only": {c: shared(ids[c], ids["weight-only"]) for c in CONFIGS[1:]}}


def quality(texts: int) -> dict:
    ref = LLM(config=EngineConfig(dtype="float32", quantization="none"))
    ids = [ref.tokenizer.encode(t)[:256] for t in load_texts(REPO / "tests" / "data" / "heldout_sharegpt.jsonl", texts)]
    base = perplexity(ref.engine.model, ids)
    out = {"reference_perplexity": base}
    for name in CONFIGS:
        cand = LLM(config=EngineConfig(quantization="int4", quantized_dense_copy=False,
                                       head_w8a8=name != "weight-only", layers_a8=name == "head+layers"))
        out[name] = {"perplexity_ratio": perplexity(cand.engine.model, ids) / base,
                     "top1_agreement": top1_agreement(ref.engine.model, cand.engine.model, ids)}
        del cand
    return out


def main() -> int:
    console = Console(width=140)
    kernels = load_fused_ops()
    if kernels is None or not kernels.int8_gemv_supported():
        console.print("no native int8-activation kernels on this machine (they need AVX2 and a compiler)")
        return 1
    fast = LLM()
    plain = LLM(config=EngineConfig(layers_a8=False))
    model = plain.engine.model
    head = getattr(model.lm_head, "small", model.lm_head)
    if not isinstance(head, Int8Linear) or head.w8a8 is None or not fast.engine.model.layers_a8:
        console.print("the default engine runs no int8 activations here")
        return 1
    dtype, num_layers = plain.engine.dtype, len(model.layers)
    alone = {"head": head_alone(head, (head.w8a8, head.tiled), dtype), "layers": layers_alone(kernels, dtype, num_layers)}
    stream = single_stream(plain, fast)
    dense_above = {"head+layers": fast.engine.dense_above, "weight-only": plain.engine.dense_above}
    del fast, plain, model, head
    qual = quality(40)

    cpu = cpu_model()
    for part, title in (("head", "LM head [49152 x 576] int8: weight-only vs W8A8"),
                        ("layers", f"{num_layers} layers' int4 linears: torch's kernel vs W4A8")):
        table = Table(title=f"{title}, {cpu}, {torch.get_num_threads()} threads")
        for col in ("rows", "weight-only ms", "int8 activations ms", "speed-up"):
            table.add_column(col, justify="right")
        for r in alone[part]:
            table.add_row(str(r["rows"]), f"{r['weight_only_ms']:.3f}", f"{r['a8_ms']:.3f}",
                          f"{r['weight_only_ms'] / r['a8_ms']:.2f}x")
        console.print(table)
    med = stream["median"]
    console.print("single stream, 128 tokens, 6 rounds, ms/token (median): " + ", ".join(
        f"{c} {med[c]:.2f}" for c in CONFIGS) + f"; head+layers fastest in {stream['rounds_won_by_head+layers']}/6"
        f"; tokens shared with weight-only {stream['common_prefix_with_weight_only']}")
    console.print(f"dense copy above (rows): {dense_above}")
    for name in CONFIGS:
        console.print(f"quality {name}: perplexity ratio {qual[name]['perplexity_ratio']:.4f}, top-1 "
                      f"{qual[name]['top1_agreement']:.4f}")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = REPO / "benchmarks" / "results" / f"int8-activations-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu, "alone": alone, "single_stream": stream, "dense_above": dense_above,
                               "quality": qual}, indent=1))
    console.print(f"results: {out}")
    plot(alone, med, REPO / "benchmarks" / "figures" / "int8_activations.png", cpu)
    return 0


def plot(alone: dict, stream: dict, path: Path, cpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for ax, part, title in ((axes[0], "head", "LM head 49152 x 576, int8 codes"),
                            (axes[1], "layers", "30 layers' linears, int4 codes")):
        rows = [r["rows"] for r in alone[part]]
        ax.plot(rows, [r["weight_only_ms"] for r in alone[part]], "o-", label="weight-only (bf16 activations)")
        ax.plot(rows, [r["a8_ms"] for r in alone[part]], "s-", label="int8 activations")
        ax.set(xscale="log", xlabel="rows", ylabel="ms per call", title=title)
        measured_ticks(ax, rows)
    axes[2].bar(list(CONFIGS), [stream[c] for c in CONFIGS], color=["C0", "C1", "C2"])
    axes[2].set(ylabel="ms per token (median)", title="one greedy stream, default engine")
    axes[2].grid(alpha=0.3, axis="y")
    save(fig, path, f"sloserve int8 activations (W8A8 head, W4A8 layers) on {cpu}")


if __name__ == "__main__":
    raise SystemExit(main())
