"""The workload options, defined once for `sloserve bench`, `simulate` and `plan`:
`add_workload_args` adds them, `workload_spec_from_args` turns them into a WorkloadSpec and
`resolve_rates` into the runs to make."""
from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Optional

WORKLOAD_HELP = ("sharegpt, azure-code, azure-conv, mooncake-conv, mooncake-synthetic, servegen, synthetic, "
                 "or a file in one of those formats")


def parse_rates(text: str) -> list[float]:
    """`2` or `1,2,4` or `inf` -> rates in req/s."""
    rates = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            r = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad rate {part!r}: a number of requests per second or inf") from None
        if not r > 0:
            raise argparse.ArgumentTypeError(f"rate must be > 0, got {part}")
        rates.append(r)
    if not rates:
        raise argparse.ArgumentTypeError("no rate given")
    return rates


def add_workload_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """The workload options shared by `sloserve bench` and `sloserve simulate`."""
    w = p.add_argument_group("workload")
    w.add_argument("--workload", default="sharegpt", help=WORKLOAD_HELP)
    mode = w.add_mutually_exclusive_group()
    mode.add_argument("--rate", type=parse_rates, metavar="R[,R2,...]",
                      help="requests/s (inf = all at once); several values run a sweep")
    mode.add_argument("--replay", action="store_true", help="use the trace's own arrival times")
    w.add_argument("--arrival-process", default="auto", choices=["auto", "poisson", "gamma", "weibull", "trace"],
                   help="how --rate arrivals are drawn; trace = the trace's own pattern rescaled to the rate "
                        "(auto: trace for servegen, else poisson)")
    w.add_argument("--cv", type=float, default=1.0, help="burstiness (inter-arrival CV) for gamma/weibull")
    w.add_argument("--num-requests", type=int, help="send this many requests (default 100 without --duration)")
    w.add_argument("--duration", type=float, metavar="S", help="stop sending after S seconds")
    w.add_argument("--start", type=float, default=0.0, metavar="S", help="skip the trace's first S seconds")
    w.add_argument("--time-scale", type=float, default=1.0, help="replay F times faster")
    w.add_argument("--max-concurrency", type=int, help="at most C requests in flight")
    w.add_argument("--max-prompt-len", type=int, help="clip prompts to this many tokens (small context windows)")
    w.add_argument("--max-output-len", type=int, help="clip output lengths")
    w.add_argument("--input-len", type=int, default=256, help="synthetic workload: prompt tokens")
    w.add_argument("--output-len", type=int, default=64, help="synthetic workload: output tokens")
    w.add_argument("--servegen-model", default="m-large",
                   help="servegen: m-large, m-mid, m-small, mm-image or deepseek-r1")
    w.add_argument("--classes", metavar="FILE", help="QoS classes / tenants with shares and targets (YAML or JSON)")
    w.add_argument("--structured-share", type=float, default=None, metavar="F",
                   help="fraction of requests under a structured output's token mask, drawn by seed: the simulator "
                        "prices their masks, `bench --structured` sends its constraint with them (default: every "
                        "request with --structured, none in a simulation)")
    w.add_argument("--prompt-format", choices=["text", "tokens"], default="text",
                   help="send prompts as text (any server) or token ids (exact lengths; completions only)")
    w.add_argument("--tokenizer", help="tokenizer.json, GGUF or HF dir of the served model (default: embedded model)")
    w.add_argument("--seed", type=int, default=0)
    return w


def workload_spec_from_args(args: argparse.Namespace):
    """A WorkloadSpec from the shared workload options (rate left open: callers sweep it)."""
    from sloserve.workload.build import WorkloadSpec
    from sloserve.workload.mix import load_mix

    mix = load_mix(args.classes) if args.classes else None
    num = args.num_requests if args.num_requests is not None or args.duration is not None else 100
    spec = WorkloadSpec(
        name=args.workload, seed=args.seed, replay=args.replay, rate=None, arrival_process=args.arrival_process,
        cv=args.cv, time_scale=args.time_scale, start_s=args.start, num_requests=num, duration_s=args.duration,
        max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len, input_len=args.input_len,
        output_len=args.output_len, servegen_model=args.servegen_model, mix=mix,
        structured_share=structured_share(args))
    return spec


def structured_share(args: argparse.Namespace) -> float:
    """--structured-share, defaulting to every request when `bench --structured` asks for constraints."""
    if args.structured_share is not None:
        return args.structured_share
    return 1.0 if getattr(args, "structured", None) else 0.0


def resolve_rates(args: argparse.Namespace, spec) -> list[Optional[float]]:
    """The runs to make: one per --rate, or one replay/burst (None). Validates each before any work."""
    rates = args.rate if args.rate else [None]
    if rates == [None] and not args.replay:
        # no mode given: replay what has arrival times, send the rest at once
        spec.validate()
        spec.replay = spec.has_trace_times
    for rate in rates:
        replace(spec, rate=rate, replay=spec.replay if rate is None else False).validate()
    return rates
