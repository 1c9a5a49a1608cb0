#!/usr/bin/env python3
"""The native whole-stack decode (kernels/decode_stack.cpp) against the Python layer loop it replaces.

Both run the same kernels in the same order (bit-identical outputs, tests/test_quant.py); the
stack makes one call into C++ per decode step instead of about a dozen per layer. Measured in one
process on the default engine (the embedded Q4_1 model: W4A8 layers, W8A8 head), by greedy
generation of `--max-tokens` tokens for batches of 1, 4 and 16 streams, the two paths alternating
round by round so that the machine's drift hits both alike. Reports ms per decode step (the
engine's step trace: decode-only steps) and end-to-end output tokens/s.

`--compare isa` times the same stack twice instead: its int8 products (the W4A8 layers and the
W8A8 head) on AVX2's vpmaddubsw against AVX512-VNNI's vpdpbusd (same bits; needs a VNNI CPU).

    python benchmarks/decode_stack.py --rounds 4 --batches 1,4,16 --max-tokens 128
    python benchmarks/decode_stack.py --compare isa
Writes benchmarks/results/decode_stack[-isa]-STAMP.json and .png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import machine_info  # noqa: E402

from sloserve.core.config import EngineConfig  # noqa: E402
from sloserve.engine.llm import LLM  # noqa: E402
from sloserve.engine.step_trace import StepRecord  # noqa: E402
from sloserve.core.types import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# path names (baseline first) and their labels, per comparison
COMPARISONS = {"stack": (("loop", "stack"), ("Python layer loop", "native stack")),
               "isa": (("avx2", "vnni"), ("AVX2 vpmaddubsw", "AVX512-VNNI vpdpbusd"))}
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batches", default="1,4,16", help="streams decoded together (default 1,4,16)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--compare", choices=sorted(COMPARISONS), default="stack",
                   help="stack: native stack vs Python loop; isa: the stack's int8 products on AVX2 vs AVX512-VNNI")
    args = p.parse_args()
    paths, labels = COMPARISONS[args.compare]
    batches = [int(b) for b in args.batches.split(",") if b]
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "steps.jsonl"
        llm = LLM(config=EngineConfig(step_trace=str(trace)))
        model = llm.engine.model
        stack = model.decode_stack
        if stack is None:
            raise SystemExit("decode_stack: this engine has no native decode stack (no AVX2 W4A8 kernels here)")
        if args.compare == "isa" and "vnni" not in llm.engine.model.fused.int8_kernel_isas():
            raise SystemExit("decode_stack: --compare isa needs a CPU with AVX512-VNNI")
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
        rows = []
        with Progress(console=console) as progress:
            task = progress.add_task("rounds", total=args.rounds * len(batches) * 2)
            for rnd in range(args.rounds):
                for batch in batches:
                    for path in paths[::-1] if rnd % 2 else paths:
                        use_path(model, stack, args.compare, path)
                        lines_before = len(trace.read_text().splitlines())
                        start = time.perf_counter()
                        llm.generate([f"[{rnd} {path} {i}] {PROMPT}" for i in range(batch)], params)
                        elapsed = time.perf_counter() - start
                        steps = [StepRecord.from_json(x) for x in trace.read_text().splitlines()[lines_before:]]
                        decode = [s.end_s - s.start_s for s in steps
                                  if s.load.num_decodes == s.load.num_tokens == batch]
                        rows.append({"round": rnd, "batch": batch, "path": path,
                                     "decode_step_ms": 1000 * statistics.median(decode),
                                     "output_tok_s": batch * args.max_tokens / elapsed})
                        progress.advance(task)
        use_path(model, stack, args.compare, paths[1])
        llm.engine.close()
    base, new = paths
    table = Table(title=f"Decode step: {labels[1]} vs {labels[0]} ({args.rounds} alternating rounds)")
    for col in ("streams", f"{base} ms/step", f"{new} ms/step", "speed-up (step)", f"{base} tok/s", f"{new} tok/s"):
        table.add_column(col, justify="right")
    summary = []
    for batch in batches:
        med = {path: {k: statistics.median(r[k] for r in rows if r["batch"] == batch and r["path"] == path)
                      for k in ("decode_step_ms", "output_tok_s")} for path in paths}
        speedup = med[base]["decode_step_ms"] / med[new]["decode_step_ms"]
        summary.append({"batch": batch, **{f"{p}_{k}": v for p in med for k, v in med[p].items()},
                        "step_speedup": speedup})
        table.add_row(str(batch), f"{med[base]['decode_step_ms']:.2f}", f"{med[new]['decode_step_ms']:.2f}",
                      f"{speedup:.2f}x", f"{med[base]['output_tok_s']:.1f}", f"{med[new]['output_tok_s']:.1f}")
    console.print(table)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    suffix = "" if args.compare == "stack" else f"-{args.compare}"
    path = RESULTS / f"decode_stack{suffix}-{stamp}.json"
    path.write_text(json.dumps({"date": stamp, "machine": machine_info(), "args": vars(args), "rows": rows,
                                "summary": summary}, indent=1))
    plot(summary, paths, labels, path.with_suffix(".png"))
    console.print(f"wrote {path}")
    return 0


def use_path(model, stack, compare: str, path: str) -> None:
    """Switch the engine to one side of the comparison."""
    if compare == "stack":
        model.decode_stack = stack if path == "stack" else None
        return
    model.decode_stack = stack
    stack.use_int8_isa(path)
    head = getattr(model.lm_head, "small", model.lm_head)  # a RowDispatchLinear's packed side
    head.tiled = None  # the tiled W8A8 kernel has one ISA (VNNI-512): the column kernel has both
    head.w8a8 = partial(model.fused.int8_gemv, isa=path)


def plot(summary: list[dict], paths: tuple[str, str], labels: tuple[str, str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = range(len(summary))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for offset, name, label in zip((-0.2, 0.2), paths, labels):
        ax.bar([x + offset for x in xs], [s[f"{name}_decode_step_ms"] for s in summary], 0.4, label=label)
    ax.set_xticks(list(xs), [f"{s['batch']} streams" for s in summary])
    ax.set_ylabel("ms per decode step (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
