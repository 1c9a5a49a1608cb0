#!/usr/bin/env python3
"""The native whole-stack decode (kernels/decode_stack.cpp) against the Python layer loop it replaces.

Both run the same kernels in the same order (bit-identical outputs, tests/test_quant.py); the
stack makes one call into C++ per decode step instead of about a dozen per layer. Measured in one
process on the default engine (the embedded Q4_1 model: W4A8 layers, W8A8 head), by greedy
generation of `--max-tokens` tokens for batches of 1, 4 and 16 streams, the two paths alternating
round by round so that the machine's drift hits both alike. Reports ms per decode step (the
engine's step trace: decode-only steps) and end-to-end output tokens/s.

    python benchmarks/decode_stack.py --rounds 4 --batches 1,4,16 --max-tokens 128
Writes benchmarks/results/decode_stack-STAMP.json and .png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import machine_info  # noqa: E402

from sloserve.config import EngineConfig  # noqa: E402
from sloserve.engine.llm import LLM  # noqa: E402
from sloserve.engine.step_trace import StepRecord  # noqa: E402
from sloserve.types import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--batches", default="1,4,16", help="streams decoded together (default 1,4,16)")
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "steps.jsonl"
        llm = LLM(config=EngineConfig(step_trace=str(trace)))
        model = llm.engine.model
        stack = model.decode_stack
        if stack is None:
            raise SystemExit("decode_stack: this engine has no native decode stack (no AVX2 W4A8 kernels here)")
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
        rows = []
        with Progress(console=console) as progress:
            task = progress.add_task("rounds", total=args.rounds * len(batches) * 2)
            for rnd in range(args.rounds):
                for batch in batches:
                    for path in ("stack", "loop"):
                        model.decode_stack = stack if path == "stack" else None
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
        model.decode_stack = stack
        llm.engine.close()
    table = Table(title=f"Decode step: native stack vs Python layer loop ({args.rounds} alternating rounds)")
    for col in ("streams", "loop ms/step", "stack ms/step", "speed-up (step)", "loop tok/s", "stack tok/s"):
        table.add_column(col, justify="right")
    summary = []
    for batch in batches:
        med = {path: {k: statistics.median(r[k] for r in rows if r["batch"] == batch and r["path"] == path)
                      for k in ("decode_step_ms", "output_tok_s")} for path in ("loop", "stack")}
        speedup = med["loop"]["decode_step_ms"] / med["stack"]["decode_step_ms"]
        summary.append({"batch": batch, **{f"{p}_{k}": v for p in med for k, v in med[p].items()},
                        "step_speedup": speedup})
        table.add_row(str(batch), f"{med['loop']['decode_step_ms']:.2f}", f"{med['stack']['decode_step_ms']:.2f}",
                      f"{speedup:.2f}x", f"{med['loop']['output_tok_s']:.1f}", f"{med['stack']['output_tok_s']:.1f}")
    console.print(table)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"decode_stack-{stamp}.json"
    path.write_text(json.dumps({"date": stamp, "machine": machine_info(), "args": vars(args), "rows": rows,
                                "summary": summary}, indent=1))
    plot(summary, path.with_suffix(".png"))
    console.print(f"wrote {path}")
    return 0


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = range(len(summary))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar([x - 0.2 for x in xs], [s["loop_decode_step_ms"] for s in summary], 0.4, label="Python layer loop")
    ax.bar([x + 0.2 for x in xs], [s["stack_decode_step_ms"] for s in summary], 0.4, label="native stack")
    ax.set_xticks(list(xs), [f"{s['batch']} streams" for s in summary])
    ax.set_ylabel("ms per decode step (median)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
