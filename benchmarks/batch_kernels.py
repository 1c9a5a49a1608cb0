#!/usr/bin/env python3
"""The kernels of a large decode step, each against what it replaced, alternating in one process.

1. Decode attention over a bf16 cache: the portable vector loop against the AVX512-BF16 kernel
   (vdpbf16ps, memory asked for a pass ahead), for 200 sequences of ShareGPT-like contexts (mean
   ~205 positions) through the embedded model's 30 layers, with each sequence's blocks in order and
   scattered over a 2 GiB pool (as a long-running server's pool ends up).
2. The int8 LM head [49,152 x 576] at 1-200 rows: the column W8A8 kernel, the tiled one (VNNI-512),
   and the dense bf16 copy the engine kept for large steps before the tiled kernel.

Rounds alternate the order of the contenders; the median of the rounds is reported. Nothing else
should run meanwhile (two cores). Output: tables, benchmarks/results/batch_kernels-STAMP.json and a
figure beside it.

    .venv/bin/python benchmarks/batch_kernels.py            # ~2 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from figure import measured_ticks, save  # noqa: E402
from offline_throughput import machine_info  # noqa: E402

from sloserve.engine.kernels import attention_kernels, load_fused_ops  # noqa: E402
from sloserve.engine.quant import DenseLinear, Int8Linear  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
LAYERS, KV_HEADS, HEADS, HEAD_DIM, BLOCK = 30, 3, 9, 64, 16  # SmolLM2-135M
VOCAB, HIDDEN = 49152, 576
HEAD_ROWS = (1, 4, 16, 64, 200)


def best(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def attention_cases(sequences: int, pool_gib: float, seed: int = 0) -> dict:
    """Per layout, the seconds of one step's attention (all layers) for each kernel, per round."""
    gen = torch.Generator().manual_seed(seed)
    slots = int(pool_gib * 2**30 / (LAYERS * 2 * KV_HEADS * HEAD_DIM * 2)) // BLOCK * BLOCK
    cache = torch.empty(LAYERS, 2, slots, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    cache.normal_(generator=gen)
    ctx = torch.randint(30, 400, (sequences,), generator=gen)
    ctx = (ctx * 205 / ctx.float().mean()).long()
    width = int(-(-ctx.max() // BLOCK))
    blocks = slots // BLOCK
    q = torch.randn(sequences, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
    layouts = {"in order": torch.arange(sequences * width).view(sequences, width),
               "scattered": torch.randperm(blocks, generator=gen)[:sequences * width].view(sequences, width)}
    return {"cache": cache, "ctx": ctx, "q": q, "layouts": layouts}


def run_attention(ops, case: dict, kernel: str, tables: torch.Tensor) -> None:
    cache, ctx, q = case["cache"], case["ctx"], case["q"]
    for layer in range(LAYERS):
        ops.paged_decode_attention(q, cache[layer, 0], cache[layer, 1], tables, ctx, BLOCK, HEAD_DIM ** -0.5, 0,
                                   kernel)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--sequences", type=int, default=200)
    p.add_argument("--pool-gib", type=float, default=2.0)
    args = p.parse_args()
    console = Console(width=140)
    ops = load_fused_ops()
    if ops is None:
        console.print("no native kernels on this machine (they need a C++ compiler)")
        return 1
    attn_kernels = ["portable"] + [k for k in ("avx512_bf16",) if k in attention_kernels()]
    head_forms = ["column W8A8", "dense bf16"] + (["tiled W8A8"] if ops.int8_tiles_supported() else [])
    case = attention_cases(args.sequences, args.pool_gib)
    w = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1)) * 0.05
    column = Int8Linear(w, w8a8=ops.int8_gemv)
    tiled = Int8Linear(w, w8a8=ops.int8_gemv, tiled=ops.int8_tile_gemm) if "tiled W8A8" in head_forms else None
    dense = DenseLinear(column.dequantized(torch.bfloat16), prepack=True)
    heads = {"column W8A8": column, "dense bf16": dense, "tiled W8A8": tiled}
    attn: dict = {layout: {k: [] for k in attn_kernels} for layout in case["layouts"]}
    head: dict = {rows: {f: [] for f in head_forms} for rows in HEAD_ROWS}
    with torch.inference_mode(), Progress(console=console) as progress:
        task = progress.add_task("rounds", total=args.rounds)
        for r in range(args.rounds):
            for layout, tables in case["layouts"].items():
                for kernel in (attn_kernels if r % 2 == 0 else attn_kernels[::-1]):
                    attn[layout][kernel].append(best(lambda: run_attention(ops, case, kernel, tables), 3))
            for rows in HEAD_ROWS:
                x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
                for form in (head_forms if r % 2 == 0 else head_forms[::-1]):
                    head[rows][form].append(best(lambda: heads[form](x), 20 if rows <= 16 else 5))
            progress.advance(task)
    median = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    table = Table(title=f"Decode attention, {args.sequences} sequences (mean context {case['ctx'].float().mean():.0f}),"
                        f" {LAYERS} layers, bf16 cache in a {args.pool_gib:g} GiB pool: ms per step (median)")
    table.add_column("blocks")
    for k in attn_kernels:
        table.add_column(k, justify="right")
    table.add_column("speed-up", justify="right")
    summary_attn = {}
    for layout, per in attn.items():
        ms = {k: median(v) for k, v in per.items()}
        summary_attn[layout] = ms
        table.add_row(layout, *(f"{ms[k]:.1f}" for k in attn_kernels),
                      f"{ms['portable'] / ms[attn_kernels[-1]]:.2f}x")
    console.print(table)
    table = Table(title=f"LM head {VOCAB} x {HIDDEN}, int8 codes: ms per call (median)")
    table.add_column("rows", justify="right")
    for f in head_forms:
        table.add_column(f, justify="right")
    summary_head = {}
    for rows, per in head.items():
        ms = {f: median(v) for f, v in per.items()}
        summary_head[rows] = ms
        table.add_row(str(rows), *(f"{ms[f]:.2f}" for f in head_forms))
    console.print(table)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"batch_kernels-{stamp}.json"
    path.write_text(json.dumps({"machine": machine_info(), "args": vars(args), "attention_ms": attn,
                                "head_ms": {str(k): v for k, v in head.items()},
                                "summary": {"attention_ms": summary_attn,
                                            "head_ms": {str(k): v for k, v in summary_head.items()}}}, indent=1))
    plot(summary_attn, summary_head, attn_kernels, head_forms, path.with_suffix(".png"))
    console.print(f"wrote {path}")
    return 0


def plot(attn: dict, head: dict, attn_kernels: list[str], head_forms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    layouts = list(attn)
    width = 0.8 / len(attn_kernels)
    for i, k in enumerate(attn_kernels):
        left.bar([x + (i - (len(attn_kernels) - 1) / 2) * width for x in range(len(layouts))],
                 [attn[l][k] for l in layouts], width, label=k)
    left.set_xticks(range(len(layouts)), layouts)
    left.set_ylabel("ms per decode step (30 layers)")
    left.set_title("decode attention, 200 sequences")
    left.legend()
    rows = list(head)
    for f in head_forms:
        right.plot(rows, [head[r][f] for r in rows], marker="o", label=f)
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("rows")
    right.set_ylabel("ms per call")
    right.set_title("LM head 49152 x 576")
    measured_ticks(right, rows)
    save(fig, path, "each contender alternating in one process; median of the rounds")


if __name__ == "__main__":
    sys.exit(main())
