#!/usr/bin/env python3
"""The W8A8 LM head against torch's weight-only int8 kernel, side by side in one process.

1. The head alone: [rows, 576] x the embedded model's int8 head [49,152 x 576], both kernels
   over the same codes and scales, best of 3 x 20 calls, at 1-16 rows.
2. One engine (the default configuration: the Q4_1 file's int4 layers, dtype auto), a single
   greedy stream of 128 tokens, the head's kernel switched between rounds (alternating order,
   6 rounds): ms per token, and how many tokens the two runs share.
3. Quality against the float32 reference (held-out ShareGPT, first 256 tokens of 40 texts):
   perplexity ratio and teacher-forced top-1 agreement, the int4 layers with each head and no
   dense copy (so every row runs the packed head).

Nothing else should run meanwhile (two cores). Output: a table and
benchmarks/results/head-w8a8-STAMP.json.

    .venv/bin/python benchmarks/head_w8a8.py          # ~3 minutes on 2 cores
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
from sloserve.config import EngineConfig  # noqa: E402
from sloserve.engine.kernels import load_fused_ops  # noqa: E402
from sloserve.engine.llm import LLM  # noqa: E402
from sloserve.engine.quality import load_texts, perplexity, top1_agreement  # noqa: E402
from sloserve.engine.quant import Int8Linear  # noqa: E402
from sloserve.types import SamplingParams  # noqa: E402

ROWS = (1, 2, 4, 8, 16)


def head_alone(head: Int8Linear, kernel, dtype: torch.dtype) -> list[dict]:
    out = []
    for rows in ROWS:
        x = torch.randn(rows, head.codes.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
        best = {}
        for name, w8a8 in (("weight-only", None), ("w8a8", kernel)):
            head.w8a8 = w8a8
            head(x)
            times = []
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(20):
                    head(x)
                times.append((time.perf_counter() - start) / 20)
            best[name] = min(times)
        head.w8a8 = kernel
        out.append({"rows": rows, "weight_only_ms": best["weight-only"] * 1e3, "w8a8_ms": best["w8a8"] * 1e3})
    return out


def single_stream(llm: LLM, head: Int8Linear, kernel, rounds: int = 6, tokens: int = 128) -> dict:
    prompt = llm.tokenizer.encode("Write a long story about a lighthouse keeper and the sea.")
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up
    ms: dict[str, list[float]] = {"w8a8": [], "weight-only": []}
    ids: dict[str, list[int]] = {}
    for r in range(rounds):
        for name in (("w8a8", "weight-only") if r % 2 == 0 else ("weight-only", "w8a8")):
            head.w8a8 = kernel if name == "w8a8" else None
            start = time.perf_counter()
            out = llm.generate([prompt], params)[0]
            ms[name].append((time.perf_counter() - start) / tokens * 1e3)
            ids[name] = out.token_ids
    head.w8a8 = kernel
    shared = next((i for i, (a, b) in enumerate(zip(ids["w8a8"], ids["weight-only"])) if a != b), tokens)
    return {"ms_per_token": ms, "median": {k: statistics.median(v) for k, v in ms.items()},
            "rounds_won_by_w8a8": sum(a < b for a, b in zip(ms["w8a8"], ms["weight-only"])),
            "common_prefix_tokens": shared}


def quality(texts: int) -> dict:
    ref = LLM(config=EngineConfig(dtype="float32", quantization="none"))
    ids = [ref.tokenizer.encode(t)[:256] for t in load_texts(REPO / "tests" / "data" / "heldout_sharegpt.jsonl", texts)]
    base = perplexity(ref.engine.model, ids)
    out = {"reference_perplexity": base}
    for name, on in (("w8a8", True), ("weight-only", False)):
        cand = LLM(config=EngineConfig(quantization="int4", quantized_dense_copy=False, head_w8a8=on))
        out[name] = {"perplexity_ratio": perplexity(cand.engine.model, ids) / base,
                     "top1_agreement": top1_agreement(ref.engine.model, cand.engine.model, ids)}
        del cand
    return out


def main() -> int:
    console = Console(width=140)
    kernels = load_fused_ops()
    if kernels is None or not kernels.int8_gemv_supported():
        console.print("no native W8A8 kernel on this machine (it needs AVX2 and a compiler)")
        return 1
    llm = LLM()
    model = llm.engine.model
    head = getattr(model.lm_head, "small", model.lm_head)
    if not isinstance(head, Int8Linear) or head.w8a8 is None:
        console.print("the default engine has no W8A8 head here")
        return 1
    kernel = head.w8a8
    alone = head_alone(head, kernel, llm.engine.dtype)
    stream = single_stream(llm, head, kernel)
    del llm, model
    qual = quality(40)

    cpu = cpu_model()
    table = Table(title=f"LM head [49152 x 576] int8, {cpu}, {torch.get_num_threads()} threads")
    for col in ("rows", "weight-only ms", "W8A8 ms", "speed-up"):
        table.add_column(col, justify="right")
    for r in alone:
        table.add_row(str(r["rows"]), f"{r['weight_only_ms']:.3f}", f"{r['w8a8_ms']:.3f}",
                      f"{r['weight_only_ms'] / r['w8a8_ms']:.2f}x")
    console.print(table)
    med = stream["median"]
    console.print(f"single stream, 128 tokens, 6 rounds: W8A8 {med['w8a8']:.2f} ms/token, weight-only "
                  f"{med['weight-only']:.2f} ({med['weight-only'] / med['w8a8']:.2f}x), rounds won "
                  f"{stream['rounds_won_by_w8a8']}/6, same first {stream['common_prefix_tokens']} tokens")
    for name in ("w8a8", "weight-only"):
        console.print(f"quality {name}: perplexity ratio {qual[name]['perplexity_ratio']:.4f}, top-1 "
                      f"{qual[name]['top1_agreement']:.4f}")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = REPO / "benchmarks" / "results" / f"head-w8a8-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu, "head_alone": alone, "single_stream": stream, "quality": qual}, indent=1))
    console.print(f"results: {out}")
    plot(alone, med, REPO / "benchmarks" / "figures" / "head_w8a8.png", cpu)
    return 0


def plot(alone: list[dict], stream: dict, path: Path, cpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    rows = [r["rows"] for r in alone]
    ax1.plot(rows, [r["weight_only_ms"] for r in alone], "o-", label="weight-only (bf16 activations)")
    ax1.plot(rows, [r["w8a8_ms"] for r in alone], "s-", label="W8A8 (int8 activations)")
    ax1.set(xscale="log", xlabel="rows", ylabel="ms per call", title="LM head 49152 x 576, int8 weights")
    measured_ticks(ax1, rows)
    names = ["weight-only", "w8a8"]
    ax2.bar(names, [stream[n] for n in names], color=["C0", "C1"])
    ax2.set(ylabel="ms per token (median)", title="one greedy stream, default engine")
    ax2.grid(alpha=0.3, axis="y")
    save(fig, path, f"sloserve W8A8 LM head on {cpu}")


if __name__ == "__main__":
    raise SystemExit(main())
