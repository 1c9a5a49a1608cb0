"""What serving LoRA adapters costs: decode throughput of a batch that mixes adapters against the
same batch on the base model and on one adapter.

The embedded model at its default precision (or `--dtype`/`--quantization`) generates `--batch`
requests of `--tokens` tokens each (greedy, EOS ignored, 32-token prompts) four ways, interleaved
`--rounds` times: every request on the base model; every one on one adapter; the requests spread
round-robin over 4 adapters; over 16. The adapters are PEFT-format directories written here with
seeded random weights (rank `--rank`, every projection q/k/v/o/gate/up/down), so throughput does
not depend on what they mean. Reported: output tokens per second, median and range, and each
row's ratio to the base model's in the same round.

    .venv/bin/python benchmarks/lora.py [--batch 32] [--tokens 64] [--rank 16] [--rounds 3]
    .venv/bin/python benchmarks/lora.py --dtype bfloat16 --quantization none --export DIR   # for vLLM's peer
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.progress import Progress  # noqa: E402
from rich.table import Table  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from sloserve import LLM, SamplingParams  # noqa: E402
from sloserve.core.config import ModelConfig  # noqa: E402
from sloserve.engine.lora import part_shapes  # noqa: E402

MODULES = {"qkv": ("self_attn", ["q_proj", "k_proj", "v_proj"]), "o": ("self_attn", ["o_proj"]),
           "gate_up": ("mlp", ["gate_proj", "up_proj"]), "down": ("mlp", ["down_proj"])}


def write_adapter(directory: Path, config: ModelConfig, rank: int, seed: int) -> str:
    """A PEFT LoRA directory for `config` with random weights on every projection."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for part, shapes in part_shapes(config).items():
            group, names = MODULES[part]
            for name, (out_f, in_f) in zip(names, shapes):
                key = f"base_model.model.model.layers.{layer}.{group}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) / in_f ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.01
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": [n for _, names in MODULES.values() for n in names]}))
    return str(directory)


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--export", type=Path, metavar="DIR",
                    help="keep the adapters and the prompts in DIR (run.json) for the vLLM peer "
                         "(benchmarks/peers/vllm_lora.py) and measure nothing")
    args = ap.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        if args.export is not None:
            tmp = str(args.export)
        probe = LLM(dtype=args.dtype, quantization=args.quantization, max_num_seqs=args.batch)
        config = probe.engine.model_config
        adapters = {f"a{i}": write_adapter(Path(tmp) / f"a{i}", config, args.rank, seed=i) for i in range(16)}
        del probe
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1000, 20000, (32,), generator=g).tolist() for _ in range(args.batch)]
        if args.export is not None:
            (args.export / "run.json").write_text(json.dumps({"prompts": prompts, "adapters": adapters,
                                                             "tokens": args.tokens, "rank": args.rank}))
            console.print(f"wrote {args.export / 'run.json'} and 16 adapters")
            return 0
        llm = LLM(dtype=args.dtype, quantization=args.quantization, max_num_seqs=args.batch,
                  max_num_batched_tokens=max(512, 32 * args.batch), lora_modules=adapters, max_loras=16)
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        names = list(adapters)
        layouts = {"base model": [None] * args.batch, "1 adapter": ["a0"] * args.batch,
                   "4 adapters": [names[i % 4] for i in range(args.batch)],
                   "16 adapters": [names[i % 16] for i in range(args.batch)]}
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0), lora=["a0", None])  # warm
        rates: dict[str, list[float]] = {k: [] for k in layouts}
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("rounds", total=args.rounds * len(layouts))
            for _ in range(args.rounds):
                for name, loras in layouts.items():
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, params, lora=loras)
                    rates[name].append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
                    progress.advance(task)
    precision = llm.engine.precision
    table = Table(title=f"LoRA decode throughput: {args.batch} requests x {args.tokens} tokens, rank {args.rank}, "
                        f"{precision}; {cpu_name()}, {torch.get_num_threads()} threads; median (range) of "
                        f"{args.rounds} interleaved rounds")
    for col in ("batch", "output tok/s", "ratio to the base model (same round)"):
        table.add_column(col)
    base = rates["base model"]
    for name, values in rates.items():
        ratios = [v / b for v, b in zip(values, base)]
        table.add_row(name, f"{statistics.median(values):.0f} ({min(values):.0f}-{max(values):.0f})",
                      f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
