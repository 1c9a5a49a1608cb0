"""The `sloserve` command line."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from sloserve.config import ATTENTION_KERNELS, PREEMPTION_VICTIMS

    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or HF model directory (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    g.add_argument("--device", default="auto", help="cpu, cuda or auto")
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="weight-only quantization of the linears (auto: the model file's own class)")
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
    from sloserve.config import KV_DTYPES, KV_FLUSH_ORDERS

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


def engine_config_from_args(args: argparse.Namespace):
    from sloserve.config import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device, quantization=args.quantization,
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


def cmd_generate(args: argparse.Namespace) -> int:
    from sloserve.engine.llm_engine import LLMEngine
    from sloserve.types import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed_sampling, stop=args.stop or [], ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty,
    )
    engine = LLMEngine(engine_config_from_args(args))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            final = out
    sys.stdout.write("\n")
    if final is not None:
        logging.getLogger("sloserve").info(
            "%d prompt + %d output tokens, finish_reason=%s", len(final.prompt_token_ids), final.num_output_tokens,
            final.finish_reason,
        )
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from sloserve.engine.llm_engine import LLMEngine
    from sloserve.profiler import FULL_GRID, QUICK_GRID, profile_engine

    engine = LLMEngine(engine_config_from_args(args))
    with Progress(transient=True) as bar:
        task = bar.add_task("profiling step shapes", total=None)
        profile = profile_engine(engine, QUICK_GRID if args.quick else FULL_GRID, repeats=args.repeats,
                                 on_point=lambda done, total: bar.update(task, completed=done, total=total))
    profile.save(args.out)
    print(f"{len(profile.samples)} step shapes, mean relative fit error {100 * profile.fit_error:.1f}% -> {args.out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    from sloserve.config import PoolSettings
    from sloserve.server.launcher import run_server
    from sloserve.server.qos import QoSRegistry, load_qos_config
    from sloserve.server.settings import ServerSettings

    level = logging.DEBUG if args.verbose else getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    registry = load_qos_config(args.qos_config) if args.qos_config else QoSRegistry()
    if args.cache_isolation:
        registry = registry.with_cache_isolation(args.cache_isolation)
    keys = list(args.api_key or [])
    if os.environ.get("SLOSERVE_API_KEY"):
        keys.append(os.environ["SLOSERVE_API_KEY"])
    settings = ServerSettings(
        served_model_names=list(args.served_model_name or []),
        registry=registry.with_keys(keys),
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_bytes,
        grace_period_s=args.grace_period,
        header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        max_connections=args.max_connections,
        keep_alive_s=args.keep_alive,
        shed_unattainable=not args.no_shed_unattainable,
        stall_timeout_s=args.client_stall_timeout,
        cache_salt_secret=args.cache_salt_secret,
        admin_keys=list(args.admin_key or []),
        timeline_interval_s=args.dashboard_interval,
        event_loop=args.event_loop,
        tool_call_parser=args.tool_call_parser,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
    )
    settings.validate()
    spec = args.fleet_spec
    if spec.instances > 1 or spec.fewest != spec.instances or args.backend != "process" or spec.pd \
            or spec.decode_router or spec.mixed_handoff != "never" or spec.autoscale \
            or spec.prefill_pool != PoolSettings() or spec.decode_pool != PoolSettings():  # run_multi checks them
        from sloserve.front.multi import run_multi

        history = None
        if args.scaling_history:
            from sloserve.cluster.forecast_cli import load_series

            history = load_series(args.scaling_history, "requests", 600.0)
        return run_multi(engine_config_from_args(args), settings, spec, backend=args.backend, host=args.host,
                         port=args.port, qos_config=args.qos_config, api_keys=keys, ray_address=args.ray_address,
                         admin_keys=settings.admin_keys, max_in_flight=args.front_max_in_flight,
                         hang_timeout_s=args.hang_timeout, cold_start_s=args.cold_start, scaling_history=history)
    return run_server(engine_config_from_args(args), settings, host=args.host, port=args.port)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    from sloserve.cluster.spec_cli import add_fleet_spec_args
    from sloserve.server.settings import EVENT_LOOPS, TOOL_PARSER_CHOICES

    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, local only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", action="append", metavar="NAME",
                   help="name clients use in `model` (repeatable; the first is reported; default: the model's name)")
    g.add_argument("--api-key", action="append", metavar="KEY",
                   help="accepted API key (repeatable; also $SLOSERVE_API_KEY); none = no authentication")
    g.add_argument("--admin-key", action="append", metavar="KEY",
                   help="repeatable; when set, /metrics (and /v1/instances on a multi-instance front) need one")
    g.add_argument("--qos-config", metavar="FILE",
                   help="YAML/JSON file: QoS classes, API keys -> tenants, what each key may use, per-tenant limits")
    g.add_argument("--cache-isolation", choices=["tenant", "key", "shared"],
                   help="who shares cached prefixes (default: the QoS config's cache_isolation, else tenant)")
    g.add_argument("--cache-salt-secret", metavar="SECRET",
                   help="keys the prefix cache's per-namespace salts (also $SLOSERVE_CACHE_SECRET; default random)")
    g.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait beyond one full batch (max-num-seqs); more get 429 (default 256)")
    g.add_argument("--grace-period", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT, seconds in-flight requests get to finish before they are aborted; what "
                        "they leave of it bounds writing the KV tiers' blocks to --kv-disk-dir (--kv-flush-order)")
    g.add_argument("--max-body-bytes", type=int, default=4 * 2**20, help="larger request bodies get 413")
    g.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="a request line + headers not received within S seconds: 408 and close (slowloris)")
    g.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                   help="longest wait for each chunk of a request body: then 408 and close")
    g.add_argument("--max-connections", type=int, default=1024, metavar="N",
                   help="open connections; beyond that a new one gets 503 too_many_connections and is closed")
    g.add_argument("--keep-alive", type=float, default=5.0, metavar="S", help="idle keep-alive connections close after S")
    g.add_argument("--event-loop", choices=EVENT_LOOPS, default="auto",
                   help="the HTTP server's event loop: auto = uvloop where installed (less per-token overhead)")
    g.add_argument("--tool-call-parser", choices=TOOL_PARSER_CHOICES, default="auto",
                   help="how chat outputs' tool calls are written and read: auto = the format the chat template "
                        "uses (hermes where it names none, as sloserve's own tool prompt asks)")
    g.add_argument("--grammar-compile-timeout", type=float, default=10.0, metavar="S",
                   help="a constraint (JSON schema, regex, grammar, forced tool calls) not compiled within S seconds "
                        "is refused with 400 constraint_too_complex; compiles run off the event loop")
    g.add_argument("--client-stall-timeout", type=float, default=60.0, metavar="S",
                   help="end a stream (and abort its requests) whose client accepts no data for S seconds")
    g.add_argument("--no-shed-unattainable", action="store_true",
                   help="queue requests whose predicted TTFT already misses their class target (default: 429 slo_unattainable)")
    g.add_argument("--dashboard-interval", type=float, default=1.0, metavar="S",
                   help="how often /dashboard's fleet timeline samples the instances (default 1 s; the last hour is kept)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    m = p.add_argument_group("multi-instance (the real fleet's own settings)")
    m.add_argument("--backend", default="process", choices=["process", "ray"], help="workers as local processes or Ray actors")
    m.add_argument("--front-max-in-flight", type=int, default=None, metavar="N",
                   help="requests the front proxies at once; more get 429 (default: the workers' combined capacity)")
    m.add_argument("--hang-timeout", type=float, default=60.0, metavar="S",
                   help="a live worker that answers no health poll for S seconds is killed and replaced "
                        "(one that misses 3 polls only leaves routing until it answers)")
    m.add_argument("--ray-address", help="join this Ray cluster (e.g. auto, ray://head:10001) instead of starting one")
    m.add_argument("--cold-start", type=float, default=30.0, metavar="S",
                   help="autoscaling: worker start time assumed until one of this fleet's workers has been timed")
    add_fleet_spec_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sloserve", description="SLO-driven LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    prof = sub.add_parser("profile", help="measure the engine's step times and fit the simulator's cost model")
    prof.add_argument("--out", default="profile.json")
    prof.add_argument("--quick", action="store_true", help="a small grid (seconds, not minutes)")
    prof.add_argument("--repeats", type=int, default=3)
    add_engine_args(prof)
    prof.set_defaults(func=cmd_profile)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (continuous batching across requests)")
    add_serve_args(serve)
    add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)

    from sloserve.bench.cli import add_bench_parser  # `sloserve bench` and `sloserve bench compare`

    add_bench_parser(sub)
    from sloserve.sim_cli import add_plan_parser, add_simulate_parser

    add_simulate_parser(sub)
    add_plan_parser(sub)
    from sloserve.cluster.forecast_cli import add_forecast_parser
    from sloserve.cluster.train_cli import add_train_predictor_parser

    add_train_predictor_parser(sub)
    add_forecast_parser(sub)
    from sloserve.kv_store_cli import add_kv_store_parser

    add_kv_store_parser(sub)
    from sloserve.hetero_cli import add_place_parser

    add_place_parser(sub)
    from sloserve.top import add_top_parser

    add_top_parser(sub)
    from sloserve.evaluation.cli import add_evaluate_parser

    add_evaluate_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        from sloserve.cluster.spec_cli import resolve_fleet_args

        resolve_fleet_args(args)
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"sloserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
