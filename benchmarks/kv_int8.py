#!/usr/bin/env python3
"""The int8 (and bf16) KV cache on the embedded model: context per GiB, quality, and speed at a long-context batch.

- capacity: tokens of context one GiB of KV cache holds, per storage type (float32, bfloat16, int8 with
  one float32 scale per token and head);
- quality, against the float32 cache: held-out ShareGPT texts scored with chunked prefills (every chunk
  after the first reads its context back from the cache): perplexity ratio and top-1 agreement;
- speed: a batch of long prompts (`--batch` x `--context` tokens) generating `--output` tokens each, side by
  side in one run: output tokens/s of the decode phase and of the whole run, for the exact engine
  (float32 compute) and the default engine (its own dtype choice, the GGUF's int4 codes), each with its
  native KV cache and with `--kv-dtype int8`.

    python benchmarks/kv_int8.py --batch 8 --context 1024 --output 64
Writes benchmarks/results/kv_int8-STAMP.json.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from migration_downtime import cpu_model  # noqa: E402

from sloserve.core.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from sloserve.engine.llm_engine import LLMEngine  # noqa: E402
from sloserve.engine.model import KVCache  # noqa: E402
from sloserve.engine.quality import chunked_next_token_logits, load_texts  # noqa: E402
from sloserve.core.types import SamplingParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
HELDOUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "heldout_sharegpt.jsonl"
STORED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


def quality(eng: LLMEngine, texts: list[list[int]], chunk: int) -> dict:
    model = eng.model
    out = {}
    ref_logits = [chunked_next_token_logits(model, ids, torch.float32, chunk) for ids in texts]
    for name in ("bfloat16", "int8"):
        nll_ref = nll = 0.0
        same = total = 0
        for ids, ref in zip(texts, ref_logits):
            logits = chunked_next_token_logits(model, ids, STORED[name], chunk)
            targets = torch.tensor(ids[1:]).unsqueeze(1)
            nll_ref -= float(torch.log_softmax(ref, -1).gather(1, targets).sum())
            nll -= float(torch.log_softmax(logits, -1).gather(1, targets).sum())
            same += int((ref.argmax(-1) == logits.argmax(-1)).sum())
            total += len(ids) - 1
        out[name] = {"perplexity_ratio": math.exp((nll - nll_ref) / total), "top1_agreement": same / total,
                     "positions": total}
    return out


def speed(config: EngineConfig, prompts: list[list[int]], output: int) -> dict:
    eng = LLMEngine(config)
    params = SamplingParams(max_tokens=output, temperature=0.0, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, params)
    started = set()
    t0 = time.perf_counter()
    t_first = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.delta_token_ids:
                started.add(out.request_id)
        if t_first is None and len(started) == len(prompts):
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    decode_tokens = len(prompts) * (output - 1)
    return {"kv_dtype": str(eng.kv_cache.storage_dtype).removeprefix("torch."), "compute": str(eng.dtype),
            "weights": eng.quantization, "kv_blocks": eng.kv.num_blocks,
            "prefill_s": t_first - t0, "decode_tok_s": decode_tokens / (t_end - t_first),
            "total_output_tok_s": len(prompts) * output / (t_end - t0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--texts", type=int, default=8, help="held-out texts scored for quality")
    ap.add_argument("--chunk", type=int, default=32)
    args = ap.parse_args()
    console = Console()
    exact = dict(dtype="float32", quantization="none")
    out: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_model(), "args": vars(args)}
    ref = LLMEngine(EngineConfig(**exact))
    cfg = ref.model_config
    out["tokens_per_gib"] = {name: 2**30 // KVCache.bytes_per_token(cfg, dt) for name, dt in STORED.items()}
    texts = [ref.tokenizer.encode(t)[:192] for t in load_texts(HELDOUT, args.texts)]
    long_text = " ".join(load_texts(HELDOUT, 64))
    ids = ref.tokenizer.encode(long_text)
    prompts = [ids[i * 97:i * 97 + args.context] for i in range(args.batch)]
    if any(len(p) < args.context for p in prompts):
        raise SystemExit("kv_int8: the held-out text is too short for that --context / --batch")
    runs = [("exact", exact, "auto"), ("exact", exact, "int8"), ("default", {}, "auto"), ("default", {}, "int8")]
    with Progress(console=console) as progress:
        task = progress.add_task("quality and speed", total=1 + len(runs))
        out["quality"] = quality(ref, texts, args.chunk)
        del ref
        progress.advance(task)
        out["speed"] = []
        for label, engine_kw, kv in runs:
            config = EngineConfig(**engine_kw, cache=CacheConfig(kv_cache_gib=1.0, kv_dtype=kv),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=args.batch))
            out["speed"].append({"engine": label, **speed(config, prompts, args.output)})
            progress.advance(task)
    t = Table(title=f"KV cache precision ({out['cpu']})")
    for col in ("engine", "compute", "weights", "KV", "tokens/GiB", "prefill s", "decode tok/s", "total tok/s"):
        t.add_column(col, justify="right")
    for r in out["speed"]:
        t.add_row(r["engine"], r["compute"].removeprefix("torch."), r["weights"], r["kv_dtype"],
                  f"{out['tokens_per_gib'].get(r['kv_dtype'], 0):,}", f"{r['prefill_s']:.2f}",
                  f"{r['decode_tok_s']:.1f}", f"{r['total_output_tok_s']:.1f}")
    console.print(t)
    for name, q in out["quality"].items():
        console.print(f"{name} KV vs float32 KV: perplexity x{q['perplexity_ratio']:.4f}, "
                      f"top-1 agreement {100 * q['top1_agreement']:.2f}% over {q['positions']} positions")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"kv_int8-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(out, indent=1))
    console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
