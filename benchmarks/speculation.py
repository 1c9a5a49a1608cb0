#!/usr/bin/env python3
"""Speculative decoding with prompt-lookup drafts: acceptance and TPOT gain, side by side.

Three prompt sets from ShareGPT first turns (../shared/data), chat-templated for the embedded
SmolLM2-135M-Instruct:

* `sharegpt`: ordinary first turns (drafts rarely hit: answers seldom copy the question);
* `code`: first turns that contain code (a fence or `def`/`function`/`class`), asked as is:
  answers quote and edit the code, so drafts hit more often;
* `summarize`: "Summarize the following text." over a long first turn.

For each set the same prompts run twice in one process, on two engines built the same way but
for `--speculative off` / `prompt-lookup` (each engine alone on the cores while it runs), at
`--concurrency` requests in flight (a closed loop: a new request starts when one ends), greedy,
`--max-tokens` tokens (EOS honoured, so both runs produce the very same tokens when the
speculative path is exact). Per request: TPOT = (last token - first token) / (tokens - 1),
from the engine's own output times. Reported: TPOT p50 and mean, output tok/s, the acceptance
rate (accepted / proposed drafts), verify steps, and how many outputs are identical to the
plain run's (the engine's default precision may pick another token at a near-tie, because a
verify computes a position through the chunk path, not the decode kernel; `--exact` runs
float32 with dense weights, where they must all match).

    python benchmarks/speculation.py --num-prompts 24 --max-tokens 128 --concurrency 1
Writes benchmarks/results/speculation-STAMP.json and .png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import machine_info, usable_cores  # noqa: E402

from sloserve.core.config import EngineConfig, SchedulerConfig  # noqa: E402
from sloserve.engine.llm_engine import LLMEngine  # noqa: E402
from sloserve.core.types import SamplingParams  # noqa: E402
from sloserve.workload.traces import iter_sharegpt, shared_path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SETS = ("sharegpt", "code", "summarize")
CODE_MARKERS = ("```", "def ", "function ", "class ", "#include", "public static")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, from {', '.join(SETS)}")
    p.add_argument("--num-prompts", type=int, default=24, help="per set")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=768, help="longer prompts are skipped")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--exact", action="store_true", help="float32 and dense weights (outputs must match)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.set_list = [s.strip() for s in args.sets.split(",") if s.strip()]
    for name in args.set_list:
        if name not in SETS:
            p.error(f"--sets: unknown set {name!r} (choose from {', '.join(SETS)})")
    if args.num_prompts < 1 or args.max_tokens < 2 or args.concurrency < 1:
        p.error("--num-prompts and --concurrency must be >= 1, --max-tokens >= 2")
    args.num_threads = args.num_threads or usable_cores()
    return args


def pick_prompts(name: str, count: int, max_tokens: int, tokenizer, skip: int) -> list[list[int]]:
    """`count` chat-templated prompts of set `name`, in file order after the first `skip` records."""
    out: list[list[int]] = []
    for i, record in enumerate(iter_sharegpt(shared_path("sharegpt"))):
        if i < skip:
            continue
        text = record["prompt"]
        if name == "code" and not any(m in text for m in CODE_MARKERS):
            continue
        if name == "summarize":
            if len(text) < 1500:
                continue
            text = f"Summarize the following text.\n\n{text}"
        ids = tokenizer.encode_chat([{"role": "user", "content": text}])
        if len(ids) > max_tokens:
            continue
        out.append(ids)
        if len(out) == count:
            break
    return out


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, concurrency: int,
               progress: Progress, label: str) -> dict[str, Any]:
    """Closed loop at `concurrency`; per request its tokens and TPOT from the engine's clock."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    task = progress.add_task(label, total=len(prompts))
    tokens: dict[str, list[int]] = {}
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    queue = list(enumerate(prompts))
    in_flight = 0
    spec = engine.scheduler.speculator
    before = (spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens, spec.stats.num_verify_steps) \
        if spec else (0, 0, 0)
    steps_before = engine.scheduler.stats.num_steps
    t0 = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            i, ids = queue.pop(0)
            engine.add_request(list(ids), params, request_id=f"p{i}")
            tokens[f"p{i}"] = []
            in_flight += 1
        for out in engine.step():
            now = time.perf_counter()
            if out.delta_token_ids:
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
                tokens[out.request_id].extend(out.delta_token_ids)
            if out.finished:
                in_flight -= 1
                progress.advance(task)
    wall = time.perf_counter() - t0
    tpot = [(last[r] - first[r]) / (len(t) - 1) for r, t in tokens.items() if len(t) > 1]
    after = (spec.stats.num_draft_tokens, spec.stats.num_accepted_tokens, spec.stats.num_verify_steps) \
        if spec else (0, 0, 0)
    drafts, accepted, verifies = (a - b for a, b in zip(after, before))
    n_out = sum(len(t) for t in tokens.values())
    return {
        "wall_s": wall, "output_tokens": n_out, "output_tok_s": n_out / wall,
        "tpot_p50_ms": 1000 * statistics.median(tpot) if tpot else None,
        "tpot_mean_ms": 1000 * statistics.fmean(tpot) if tpot else None,
        "steps": engine.scheduler.stats.num_steps - steps_before,
        "draft_tokens": drafts, "accepted_tokens": accepted, "verify_steps": verifies,
        "acceptance": accepted / drafts if drafts else None,
        "tokens": [tokens[f"p{i}"] for i in range(len(prompts))],
    }


def make_engine(args: argparse.Namespace, speculative: str) -> LLMEngine:
    precision = dict(dtype="float32", quantization="none") if args.exact else {}
    return LLMEngine(EngineConfig(**precision, num_threads=args.num_threads, seed=args.seed,
                                  scheduler=SchedulerConfig(speculative=speculative,
                                                            num_speculative_tokens=args.num_speculative_tokens)))


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 140)
    plain, spec = make_engine(args, "off"), make_engine(args, "prompt-lookup")
    results: dict[str, Any] = {}
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        for n, name in enumerate(args.set_list):
            prompts = pick_prompts(name, args.num_prompts, args.max_prompt_tokens, plain.tokenizer, skip=1000 * n)
            warm = prompts[:1]
            run_engine(plain, warm, 8, 1, progress, f"{name}: warm-up")
            run_engine(spec, warm, 8, 1, progress, f"{name}: warm-up")
            off = run_engine(plain, prompts, args.max_tokens, args.concurrency, progress, f"{name}: off")
            on = run_engine(spec, prompts, args.max_tokens, args.concurrency, progress, f"{name}: prompt-lookup")
            same = sum(a == b for a, b in zip(off.pop("tokens"), on.pop("tokens")))
            results[name] = {"num_prompts": len(prompts),
                             "prompt_tokens_mean": statistics.fmean(len(p) for p in prompts),
                             "off": off, "prompt-lookup": on, "identical_outputs": same,
                             "tpot_ratio": on["tpot_p50_ms"] / off["tpot_p50_ms"]}
    report = {"benchmark": "speculation", "date": datetime.now().isoformat(timespec="seconds"),
              "machine": machine_info(),
              "settings": {k: v for k, v in vars(args).items() if k not in ("output_dir", "set_list")},
              "engine": {"dtype": str(spec.dtype).removeprefix("torch."), "quantization": spec.quantization},
              "sets": results}
    table = Table(title=f"prompt-lookup speculation, {args.concurrency} in flight, {report['engine']}")
    for col in ("set", "prompts", "TPOT p50 off", "TPOT p50 on", "on/off", "tok/s off", "tok/s on",
                "acceptance", "verify steps", "identical"):
        table.add_column(col, justify="right")
    for name, r in results.items():
        off, on = r["off"], r["prompt-lookup"]
        table.add_row(name, str(r["num_prompts"]), f"{off['tpot_p50_ms']:.2f} ms", f"{on['tpot_p50_ms']:.2f} ms",
                      f"{r['tpot_ratio']:.2f}x", f"{off['output_tok_s']:.1f}", f"{on['output_tok_s']:.1f}",
                      "-" if on["acceptance"] is None else f"{on['acceptance']:.2f}", str(on["verify_steps"]),
                      f"{r['identical_outputs']}/{r['num_prompts']}")
    console.print(table)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    json_path = args.output_dir / f"speculation-{stamp}.json"
    json_path.write_text(json.dumps(report, indent=2))
    png_path = json_path.with_suffix(".png")
    plot(results, png_path, f"{report['machine']['cpu']}, {args.concurrency} in flight")
    console.print(f"wrote {json_path} and {png_path}")
    return 0


def plot(results: dict[str, Any], path: Path, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    xs = range(len(names))
    ax.bar([x - width / 2 for x in xs], [results[n]["off"]["tpot_p50_ms"] for n in names], width, label="off")
    ax.bar([x + width / 2 for x in xs], [results[n]["prompt-lookup"]["tpot_p50_ms"] for n in names], width,
           label="prompt-lookup")
    for x, n in zip(xs, names):
        acc = results[n]["prompt-lookup"]["acceptance"]
        ax.annotate("" if acc is None else f"acc {acc:.2f}", (x + width / 2, results[n]["prompt-lookup"]["tpot_p50_ms"]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("TPOT p50 (ms)")
    ax.set_title(f"Speculative decoding (prompt lookup)\n{subtitle}", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
