#!/usr/bin/env python3
"""Precision study: step time, weight memory and quality of every precision the engine offers,
side by side in one run, against the float32 reference.

For each precision (float32; bfloat16; int8 and int4 weights with bf16 activations, each with
and without the dense copy for large steps; and the default, dtype and quantization `auto`):
- weight bytes as the forward reads them, and the weight-read bandwidth a 1-sequence decode
  step reaches (bytes / step time: a decode step at one sequence is memory-bound);
- the median decode step at 1, 4, 16 and 64 running sequences (128-token prompts), and a
  512-token prefill (one step), each with its speed-up over float32;
- perplexity on held-out text (tests/data/heldout_sharegpt.jsonl: 100 ShareGPT prompts, first
  256 tokens each) as a ratio to float32's, and teacher-forced greedy top-1 agreement with
  float32, checked against the tolerances in sloserve/engine/quality.py.

Every engine loads in this one process, one after the other; nothing else should run meanwhile
(two cores: any other busy process distorts every number). Output: a rich table,
benchmarks/results/precision-STAMP.json and a PNG beside it.

    .venv/bin/python benchmarks/precision.py            # ~4 minutes on 2 cores
    .venv/bin/python benchmarks/precision.py --texts 20 --batches 1,16
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from offline_throughput import machine_info, usable_cores  # noqa: E402

from sloserve.core.config import EngineConfig  # noqa: E402
from sloserve.engine.llm import LLM  # noqa: E402
from sloserve.engine.quality import TOLERANCES, load_texts, perplexity, top1_agreement  # noqa: E402
from sloserve.core.types import SamplingParams  # noqa: E402

HELDOUT = REPO / "tests" / "data" / "heldout_sharegpt.jsonl"
# label -> (EngineConfig settings, tolerance row or None)
PRECISIONS: dict[str, tuple[dict[str, Any], str | None]] = {
    "float32": (dict(dtype="float32", quantization="none"), None),
    "bfloat16": (dict(dtype="bfloat16", quantization="none"), "bfloat16"),
    "int8 only": (dict(dtype="bfloat16", quantization="int8", quantized_dense_copy=False), "int8"),
    "int8 + dense copy": (dict(dtype="bfloat16", quantization="int8"), "int8"),
    "int4 only": (dict(dtype="bfloat16", quantization="int4", quantized_dense_copy=False), "int4"),
    "int4 + dense copy": (dict(dtype="bfloat16", quantization="int4"), "int4"),
    "default (auto/auto)": (dict(), "int4"),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma-separated labels from the list above")
    p.add_argument("--batches", default="1,4,16,64", help="running sequences per decode measurement")
    p.add_argument("--texts", type=int, default=100, help="held-out texts scored for perplexity")
    p.add_argument("--text-tokens", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=24, help="output tokens per decode measurement")
    p.add_argument("--output-dir", type=Path, default=REPO / "benchmarks" / "results")
    return p.parse_args()


def decode_step_ms(llm: LLM, batch: int, steps: int) -> float:
    """Median step time once `batch` sequences of 128-token prompts are all decoding."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add(engine.make_request([(7 * i + j) % 40000 + 100 for j in range(128)], params))
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[-(steps // 2):]) * 1e3  # the decode-only tail


def prefill_ms(llm: LLM, tokens: int = 512) -> float:
    params = SamplingParams(max_tokens=1, temperature=0)
    best = float("inf")
    for rep in range(3):
        prompt = [(13 * j + rep) % 40000 + 100 for j in range(tokens)]  # fresh ids: no prefix-cache hit
        t0 = time.perf_counter()
        llm.generate([prompt], params)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> int:
    args = parse_args()
    labels = [s.strip() for s in args.precisions.split(",") if s.strip()]
    unknown = [s for s in labels if s not in PRECISIONS]
    if unknown:
        print(f"unknown precision(s) {unknown}; known: {list(PRECISIONS)}", file=sys.stderr)
        return 2
    if "float32" not in labels:
        labels.insert(0, "float32")  # the reference every ratio is taken against
    batches = [int(b) for b in args.batches.split(",")]
    texts = load_texts(HELDOUT, args.texts)
    threads = usable_cores()
    console = Console()
    rows: dict[str, dict[str, Any]] = {}
    reference = None
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("precisions", total=len(labels))
        for label in labels:
            settings, _ = PRECISIONS[label]
            bar.update(task, description=f"{label}: loading")
            llm = LLM(config=EngineConfig(num_threads=threads, **settings))
            ids = [llm.tokenizer.encode(t)[: args.text_tokens] for t in texts]
            llm.generate([[100, 101, 102, 103]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
            bar.update(task, description=f"{label}: timing")
            row: dict[str, Any] = {
                "settings": settings, "dtype": str(llm.engine.dtype).removeprefix("torch."),
                "quantization": llm.engine.quantization, "weight_mb": llm.engine.model.weight_bytes / 1e6,
                "decode_ms": {b: decode_step_ms(llm, b, args.decode_steps) for b in batches},
                "prefill512_ms": prefill_ms(llm),
            }
            bar.update(task, description=f"{label}: quality")
            row["perplexity"] = perplexity(llm.engine.model, ids)
            if reference is None:
                reference = llm
                row["top1_agreement"] = 1.0
            else:
                row["top1_agreement"] = top1_agreement(reference.engine.model, llm.engine.model, ids)
                del llm
                gc.collect()
            rows[label] = row
            bar.advance(task)

    ref = rows["float32"]
    for label, row in rows.items():
        row["speedup"] = {b: ref["decode_ms"][b] / row["decode_ms"][b] for b in batches}
        row["prefill_speedup"] = ref["prefill512_ms"] / row["prefill512_ms"]
        row["perplexity_ratio"] = row["perplexity"] / ref["perplexity"]
        row["decode1_weight_gbps"] = row["weight_mb"] / row["decode_ms"][batches[0]] if batches[0] == 1 else None
        tolerance = PRECISIONS[label][1]
        if tolerance is not None:
            t = TOLERANCES[tolerance]
            row["within_tolerance"] = (row["perplexity_ratio"] <= t.max_perplexity_ratio
                                       and row["top1_agreement"] >= t.min_top1_agreement)

    table = Table(title=f"precisions on {machine_info()['cpu']}, {threads} threads (speed-up vs float32)")
    for col in ["precision", "weights MB", *[f"decode B={b} ms" for b in batches], "prefill 512 ms",
                "ppl (ratio)", "top-1 agree", "tolerance"]:
        table.add_column(col, justify="left" if col == "precision" else "right")
    for label, row in rows.items():
        table.add_row(
            label, f"{row['weight_mb']:.0f}",
            *[f"{row['decode_ms'][b]:.1f} ({row['speedup'][b]:.2f}x)" for b in batches],
            f"{row['prefill512_ms']:.0f} ({row['prefill_speedup']:.2f}x)",
            f"{row['perplexity']:.3f} ({row['perplexity_ratio']:.4f})", f"{row['top1_agreement']:.4f}",
            {True: "ok", False: "MISSED", None: "ref"}[row.get("within_tolerance")],
        )
    console.print(table)

    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    out = args.output_dir / f"precision-{stamp}.json"
    out.write_text(json.dumps({"machine": machine_info(), "threads": threads, "texts": len(texts),
                               "text_tokens": args.text_tokens, "batches": batches,
                               "tolerances": {k: vars(v) for k, v in TOLERANCES.items()}, "rows": rows},
                              indent=1, default=str))
    plot(rows, batches, out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png').name}")
    return 0


def plot(rows: dict[str, dict[str, Any]], batches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / len(rows)
    for i, (label, row) in enumerate(rows.items()):
        xs = [j + i * width for j in range(len(batches))]
        ax.bar(xs, [row["decode_ms"][b] for b in batches], width, label=label)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"{b} seq" for b in batches])
    ax.set_ylabel("decode step (ms, lower is better)")
    ax.legend(fontsize=8)
    ax2.barh(list(rows), [row["weight_mb"] for row in rows.values()])
    ax2.set_xlabel("weight MB")
    ax2.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
