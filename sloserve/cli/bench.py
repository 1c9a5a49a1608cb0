"""`sloserve bench` and `sloserve bench compare`: argument parsing, progress bar, printed tables.

`bench/` itself never prints: this module prints for it (through rich); everything it calls
logs instead.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from sloserve.bench.structured import STRUCTURED_KINDS
from sloserve.cli.workload_args import add_workload_args, resolve_rates, workload_spec_from_args


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark any OpenAI-compatible server (sloserve, vLLM, SGLang, llama.cpp)",
                       description="Send a workload to an OpenAI-compatible server and report TTFT, TPOT, ITL, E2E, "
                                   "throughput, SLO attainment and goodput. `sloserve bench compare A.json B.json` "
                                   "puts result files side by side.")
    g = p.add_argument_group("server")
    g.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    g.add_argument("--model", help="model name to send (default: the first one the server lists)")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    g.add_argument("--backend", choices=["openai", "llamacpp"], default="openai",
                   help="openai: max_tokens + ignore_eos (sloserve, vLLM, SGLang); llamacpp: also n_predict")
    g.add_argument("--api-key", help="bearer token (tenants' keys come from --classes)")
    g.add_argument("--extra-body", type=json.loads, default={}, metavar="JSON", help="fields merged into every body")
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="let the model stop early (output lengths then differ from the workload's)")
    g.add_argument("--structured", choices=STRUCTURED_KINDS,
                   help="chat: every request asks for a JSON record under a schema (json) or forces a call to one of "
                        "three tools (tools); outputs end when the constraint completes (no ignore_eos)")
    g.add_argument("--request-timeout", type=float, default=300.0, metavar="S", help="total time per request")
    g.add_argument("--drain-timeout", type=float, default=60.0, metavar="S",
                   help="with --duration: how long requests in flight may run past it")
    w = add_workload_args(p)
    r = p.add_argument_group("results")
    r.add_argument("--slo", help="targets in ms, e.g. ttft=500,tpot=50,e2e=10000 (goodput counts requests meeting all)")
    w.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="send N requests before measuring, one alone and then the rest at once (not recorded; all failing aborts the run)")
    r.add_argument("--out", default="bench-out", metavar="DIR", help="results.json, report.md and PNGs go here")
    r.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_bench)

    csub = p.add_subparsers(dest="bench_command")
    c = csub.add_parser("compare", help="side-by-side table with ratios and an overlaid CDF plot")
    c.add_argument("results", nargs="+", metavar="RESULT.json")
    c.add_argument("--out", default="bench-compare", metavar="DIR", help="compare.md and latency_cdf.png go here")
    c.set_defaults(func=cmd_compare)


def _plan(args: argparse.Namespace):
    from sloserve.bench.client import ClientConfig
    from sloserve.bench.metrics import SLO
    from sloserve.bench.runner import BenchPlan

    if not args.base_url:
        raise ValueError("--base-url is required")
    if args.endpoint == "chat" and args.prompt_format == "tokens":
        raise ValueError("the chat endpoint takes text prompts; use --prompt-format text")
    spec = workload_spec_from_args(args)
    mix = spec.mix
    client = ClientConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint, backend=args.backend, api_key=args.api_key,
        tenant_keys={t.name: t.api_key for t in mix.tenants if t.api_key} if mix else {},
        send_qos_class=mix is not None and bool(mix.classes), max_concurrency=args.max_concurrency,
        request_timeout_s=args.request_timeout, drain_timeout_s=args.drain_timeout,
        ignore_eos=not args.no_ignore_eos, extra_body=args.extra_body, structured=args.structured)
    rates = resolve_rates(args, spec)
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")  # metadata only, not a measurement
    return BenchPlan(spec, client, rates, SLO.parse(args.slo) if args.slo else SLO(), args.prompt_format,
                     Path(args.out), args.warmup, {"started_at": started, "classes_file": args.classes})


def cmd_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markdown import Markdown
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from sloserve.bench.report import fmt_rate, run_markdown, sweep_markdown
    from sloserve.bench.runner import BenchError, default_synthesizer, run_plan, write_outputs
    from sloserve.bench.tokenizer import load_bench_tokenizer

    plan = _plan(args)
    console = Console(stderr=True)
    synthesizer = default_synthesizer(load_bench_tokenizer(args.tokenizer), args.seed)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.fields[failed]} failed"), console=console, disable=args.no_progress,
                        transient=False)
    state: dict[str, Optional[int]] = {"task": None}
    failed = [0]

    def on_run_start(rate: Optional[float], n: int) -> None:
        failed[0] = 0
        desc = f"rate {fmt_rate(rate)}" if rate is not None else "replay" if plan.spec.replay else "burst"
        state["task"] = progress.add_task(desc, total=n, failed=0)

    def on_record(rec) -> None:
        if not rec.success:
            failed[0] += 1
        if state["task"] is not None:
            progress.update(state["task"], advance=1, failed=failed[0])

    try:
        with progress:
            results = run_plan(plan, synthesizer, on_run_start, on_record, write=False)
    except BenchError as exc:
        console.print(f"sloserve bench: {exc}")
        return 1
    paths = write_outputs(results, plan.out_dir) if plan.out_dir else []
    out = Console()
    if len(results) > 1:
        out.print(Markdown(sweep_markdown(results)))
    for r in results:
        out.print(Markdown(run_markdown(r)))
    console.print("wrote " + ", ".join(str(p) for p in paths))
    total = sum(r.summary.overall.num_requests for r in results)
    ok = sum(r.summary.overall.completed for r in results)
    return 0 if total == 0 or ok > 0 else 1


def cmd_compare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markdown import Markdown

    from sloserve.bench.compare import compare_markdown, load_systems, per_rate_markdown

    runs, labels, systems = load_systems(args.results)
    if not runs:
        raise ValueError("no runs in the given files")
    text = compare_markdown(runs, labels)
    by_rate = per_rate_markdown(runs, systems)
    if by_rate:
        text += "\n" + by_rate
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(text, encoding="utf-8")
    written = [out / "compare.md"]
    try:
        from sloserve.bench.plots import plot_latency_cdfs

        written.append(plot_latency_cdfs(runs, out / "latency_cdf.png", labels))
    except ImportError as exc:
        print(f"no plot: {exc}", file=sys.stderr)
    Console().print(Markdown(text))
    Console(stderr=True).print("wrote " + ", ".join(map(str, written)))
    return 0
