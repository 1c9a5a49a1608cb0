#!/usr/bin/env python3
"""What a model's linears can reach on this CPU: the ceiling an offline-throughput ratio lives under.

For a model shape (benchmarks/models.py's SHAPES) it times one forward's worth of linears (every
layer's fused q/k/v, o, fused gate/up and down, plus the LM head) at several row counts, with the
kernels the engine runs: oneDNN's prepacked bf16 GEMM (what both sloserve and vLLM-CPU run in bf16),
oneDNN's int8 GEMM with activations quantized per token (`--quantization w8a8`, quant.W8A8Linear:
the scheme vLLM runs a W8A8 checkpoint with) and, where the native kernels are built, sloserve's
tiled W8A8 product (activations per 32-element block: the int8 LM head's kernel). Weights are random
(speed does not depend on them). Rounds alternate the kernels' order; the median is reported as
GFLOP/s (2 x rows x weights per call).

If two engines both spend most of an offline run in these GEMMs, neither can lead the other by
more than the share of the run spent elsewhere: the effective GFLOP/s an offline run reports (its
FLOPs over its wall time) against this ceiling says how much is left to win.

    .venv/bin/python benchmarks/gemm_ceiling.py --shape llama-3.2-1b     # ~2 minutes on 2 cores
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
from models import SHAPES, Shape  # noqa: E402
from offline_throughput import machine_info  # noqa: E402

from sloserve.engine.kernels import load_fused_ops  # noqa: E402
from sloserve.engine.quant import DenseLinear, W8A8Linear, can_prepack, int8_linear, w8a8_available  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
ROWS = (1, 16, 48, 128, 512, 2048)


def linear_shapes(shape: Shape) -> list[tuple[str, int, int, int]]:
    """(name, out, in, count) of one forward's linears, fused as the engine fuses them."""
    kv = shape.kv_heads * shape.head_dim
    return [("qkv", shape.hidden + 2 * kv, shape.hidden, shape.layers),
            ("o", shape.hidden, shape.hidden, shape.layers),
            ("gate_up", 2 * shape.intermediate, shape.hidden, shape.layers),
            ("down", shape.hidden, shape.intermediate, shape.layers),
            ("head", shape.vocab, shape.hidden, 1)]


def seconds(fn, min_s: float = 0.3) -> float:
    """Seconds per call: one warm call, then repeats until `min_s` has passed."""
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts (tokens in one step)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None, help="default: torch's")
    p.add_argument("--output-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    console = Console(width=120)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if not can_prepack(torch.bfloat16, torch.device("cpu")):
        console.print("gemm_ceiling.py: error: oneDNN cannot prepack bf16 weights on this CPU (needs AVX-512)")
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    shape = SHAPES[args.shape]
    ops = load_fused_ops()
    tiled = ops is not None and hasattr(ops, "int8_tiles_supported") and ops.int8_tiles_supported()
    per_token = w8a8_available(torch.device("cpu"))
    kernels = ["bf16 oneDNN"] + (["int8 per token, oneDNN"] if per_token else []) + \
        (["int8 per 32, tiled"] if tiled else [])
    gen = torch.Generator().manual_seed(0)
    linears: dict[str, list] = {k: [] for k in kernels}
    for name, out, inp, count in linear_shapes(shape):
        w = torch.randn(out, inp, generator=gen) * 0.02
        linears["bf16 oneDNN"].append((DenseLinear(w.to(torch.bfloat16), prepack=True), inp, count))
        if per_token:
            linears["int8 per token, oneDNN"].append((W8A8Linear(w, quantize=getattr(ops, "quantize_rows_u8", None)),
                                                      inp, count))
        if tiled:
            linears["int8 per 32, tiled"].append((int8_linear(w, ops=ops), inp, count))
        del w
    weights = sum(out * inp * count for _, out, inp, count in linear_shapes(shape))
    times: dict[str, dict[int, list[float]]] = {k: {r: [] for r in rows} for k in kernels}
    with torch.inference_mode(), Progress(console=console) as progress:
        task = progress.add_task(f"{args.shape}: rounds", total=args.rounds * len(rows))
        for rnd in range(args.rounds):
            for r in rows:
                xs = {inp: torch.randn(r, inp, generator=gen).to(torch.bfloat16)
                      for inp in {inp for _, _, inp, _ in linear_shapes(shape)}}
                for kernel in (kernels if rnd % 2 == 0 else kernels[::-1]):
                    # one forward: each distinct linear timed once, weighted by how often it runs
                    total = sum(seconds(lambda: lin(xs[inp]), 0.2) * count for lin, inp, count in linears[kernel])
                    times[kernel][r].append(total)
                progress.advance(task)
    gflops = {k: {r: 2 * r * weights / statistics.median(v) / 1e9 for r, v in per.items()} for k, per in times.items()}
    table = Table(title=f"{args.shape} linears ({weights / 1e9:.2f}B weights per forward), GFLOP/s (median of "
                        f"{args.rounds} rounds), {torch.get_num_threads()} threads")
    table.add_column("rows", justify="right")
    for k in kernels:
        table.add_column(k, justify="right")
    for r in rows:
        table.add_row(str(r), *(f"{gflops[k][r]:.0f}" for k in kernels))
    console.print(table)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    path = args.output_dir / f"gemm_ceiling-{args.shape}-{stamp}.json"
    path.write_text(json.dumps({"machine": machine_info(), "args": {**vars(args), "output_dir": str(args.output_dir)},
                                "weights": weights,
                                "forward_seconds": {k: {str(r): v for r, v in per.items()} for k, per in times.items()},
                                "gflops_median": {k: {str(r): v for r, v in per.items()} for k, per in gflops.items()}},
                               indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for k in kernels:
        ax.plot(rows, [gflops[k][r] for r in rows], marker="o", label=k)
    ax.set_xscale("log")
    ax.set_xlabel("rows per step")
    ax.set_ylabel("GFLOP/s")
    measured_ticks(ax, rows)
    save(fig, path.with_suffix(".png"), f"{args.shape}: one forward's linears, {torch.get_num_threads()} threads")
    console.print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
