"""The engine's options, defined once for every command that runs an engine (`generate`, `profile`,
`serve`): `add_engine_args` adds them, `engine_config_from_args` turns them into an EngineConfig."""
from __future__ import annotations

import argparse
from typing import Optional


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from sloserve.core.config import ATTENTION_KERNELS, PREEMPTION_VICTIMS

    g = p.add_argument_group("engine")
    g.add_argument("--model", action="append", metavar="PATH|NAME=PATH",
                   help="GGUF file or HF model directory (default: embedded SmolLM2-135M-Instruct); `serve` takes "
                        "several as NAME=PATH, each its own pool of workers behind one front, routed by `model`")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    g.add_argument("--device", default="auto", help="cpu, cuda or auto")
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4", "w8a8"],
                   help="quantization of the linears: int8/int4 weights (auto: the model file's own class), or w8a8: "
                        "int8 weights and int8 activations per token in the layers, the head dense (vLLM's W8A8)")
    g.add_argument("--quantized-only", action="store_true",
                   help="keep no dense copy of quantized linears for large steps (least memory; slower prefill)")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: OMP_NUM_THREADS, else the cores available)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides --kv-cache-gib)")
    g.add_argument("--kv-cache-gib", type=float, default=1.0)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="per-step token budget")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--scheduling-policy", default="fcfs", help="fcfs, priority, edf, slo or vtc")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap", "auto"],
                   help="preempt by recompute, by swap to host memory, or per victim by cost (auto)")
    g.add_argument("--preemption-victim", default=PREEMPTION_VICTIMS[0], choices=PREEMPTION_VICTIMS,
                   help="under memory pressure preempt the request with the most SLO slack (default; it then sits out "
                        "half of it), or the lowest-ranked one (rank)")
    g.add_argument("--speculative", default="off", choices=["off", "prompt-lookup"],
                   help="speculative decoding with drafts from the request's own tokens, per step when it pays")
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts per request and step, at most")
    g.add_argument("--speculative-max-batch", type=int, default=8, help="no drafts in steps with more decodes")
    g.add_argument("--swap-space", type=float, default=4.0, metavar="GIB", help="host memory for swapped-out KV")
    add_kv_tier_args(g)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-native-kernels", action="store_true", help="use the portable attention path only")
    g.add_argument("--no-head-w8a8", action="store_true",
                   help="keep the int8 LM head's activations in bf16 (default: int8 per 32-element block, integer "
                        "dot products, where the native kernel builds)")
    g.add_argument("--no-layers-a8", action="store_true",
                   help="keep the int4 layers' activations in bf16 (default: int8 per 32-element block times the "
                        "4-bit codes in integer arithmetic, where the native kernel builds)")
    g.add_argument("--attention-kernel", default="auto", choices=ATTENTION_KERNELS,
                   help="native path of bf16 attention (auto: the fastest this CPU has: amx, then avx512_bf16)")
    g.add_argument("--step-trace", metavar="FILE", help="write one JSON line per engine step (timings and load)")
    g.add_argument("--lora", action="append", default=[], metavar="NAME=PATH",
                   help="serve a PEFT LoRA adapter directory as model NAME (repeatable); requests name it as their "
                        "model; more load at run time (POST /v1/load_lora_adapter, with --admin-key)")
    g.add_argument("--max-loras", type=int, default=4,
                   help="adapters kept in the compute device's form, least recently used out first")
    g.add_argument("--max-lora-rank", type=int, default=64, help="the largest rank an adapter may have")


def add_kv_tier_args(g) -> None:
    """The prefix cache's lower tiers: the same options on every command that runs an engine or a simulation."""
    from sloserve.core.config import KV_DTYPES, KV_FLUSH_ORDERS

    g.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="what the KV cache stores (int8: per-token scales, dequantized in attention)")
    g.add_argument("--kv-host-gib", type=float, default=0.0, metavar="GIB",
                   help="host memory for prefix-cache blocks evicted from the device (0: none)")
    g.add_argument("--kv-disk-dir", default=None, metavar="DIR",
                   help="local-disk tier of the prefix cache (kept across restarts; per worker subdirectory)")
    g.add_argument("--kv-disk-gib", type=float, default=4.0, metavar="GIB", help="size bound of --kv-disk-dir")
    g.add_argument("--kv-store", default=None, metavar="URL",
                   help="shared KV store of the fleet, e.g. redis://127.0.0.1:6379/0 (see `sloserve kv-store`)")
    g.add_argument("--kv-write-through", action="store_true",
                   help="with host and disk tiers, write every evicted block to the disk at once "
                        "(default: the disk gets what host memory evicts)")
    g.add_argument("--kv-flush-order", default=KV_FLUSH_ORDERS[0], choices=KV_FLUSH_ORDERS,
                   help="a clean stop (SIGTERM, within what the drain leaves of --grace-period) writes the blocks "
                        "only host memory and the device hold to --kv-disk-dir, most prefix hits first (default), "
                        "most recently used first (newest), or none (off)")


def lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """`--lora NAME=PATH` values as (name, absolute path); a repeated name is an error."""
    import os

    from sloserve.engine.lora import parse_lora_option

    out: dict[str, str] = {}
    for value in values:
        name, path = parse_lora_option(value)
        if name in out:
            raise ValueError(f"--lora {name!r} is given twice")
        out[name] = os.path.abspath(path)
    return list(out.items())


def single_model(values: Optional[list[str]]) -> Optional[str]:
    """The one `--model` path (None: the embedded model); `NAME=PATH` gives PATH."""
    if not values:
        return None
    if len(values) > 1:
        raise ValueError("several --model values: only `sloserve serve` runs several models (as NAME=PATH)")
    from sloserve.front.models import parse_model_args

    return parse_model_args(values)[0][1]


def engine_config_from_args(args: argparse.Namespace):
    from sloserve.core.config import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(
        model=single_model(args.model), dtype=args.dtype, device=args.device, quantization=args.quantization,
        quantized_dense_copy=not args.quantized_only,
        num_threads=args.num_threads,
        max_model_len=args.max_model_len, seed=args.seed, native_kernels=not args.no_native_kernels,
        head_w8a8=not args.no_head_w8a8, layers_a8=not args.no_layers_a8,
        attention_kernel=args.attention_kernel, step_trace=args.step_trace,
        lora_modules=tuple(lora_modules(args.lora)), max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
        cache=CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_gib=args.kv_cache_gib,
                          enable_prefix_caching=not args.no_prefix_caching, swap_space_gib=args.swap_space,
                          kv_dtype=args.kv_dtype, host_tier_gib=args.kv_host_gib, disk_tier_dir=args.kv_disk_dir,
                          disk_tier_gib=args.kv_disk_gib, kv_store_url=args.kv_store,
                          tier_write_back=not args.kv_write_through, tier_flush_order=args.kv_flush_order),
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                                  enable_chunked_prefill=not args.no_chunked_prefill, policy=args.scheduling_policy,
                                  preemption_mode=args.preemption_mode, preemption_victim=args.preemption_victim,
                                  speculative=args.speculative,
                                  num_speculative_tokens=args.num_speculative_tokens,
                                  speculative_max_batch=args.speculative_max_batch),
    )
