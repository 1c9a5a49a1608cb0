#!/usr/bin/env python3
"""Prefill/decode disaggregation on real workers: colocated vs disaggregated at the same
instance count, on this machine, in one run.

Configurations (all `sloserve serve` with worker processes on 127.0.0.1, the embedded model,
the machine's cores split evenly between the workers):
  colocated   --instances N (least-requests routing, chunked prefill on every instance)
  pd          --pd P:D (streams handed from the prefill to a decode instance after the first
              token; blocking copy), and optionally pd-live (--pd-transfer live)
Every configuration gets the identical requests (ShareGPT first turns as token ids, the
reply's length as output length, EOS ignored, the same Poisson arrival times per rate) from
`sloserve bench`'s client, one configuration at a time. Per rate: TTFT / TPOT p50 and p99,
output throughput, SLO attainment and goodput (requests/s meeting --slo), and for the P/D runs
the hand-offs (completed, bytes, mean latency from the first token on the prefill instance to
the next on the decode instance) read from /v1/instances.

On a machine with few cores the pools share them (each worker gets cores/N threads), so this
measures the cost of the hand-off and of splitting the cores, not what separate GPUs gain.

Output: benchmarks/results/pd-real-STAMP/ (each configuration's results + pd_real.json) and
benchmarks/figures/pd_real.png.

    python benchmarks/pd_real.py                       # 2 instances: colocated vs 1:1, rates 1,2,4
    python benchmarks/pd_real.py --rates 2 --num-requests 30 --live
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sloserve.bench.client import ClientConfig  # noqa: E402
from sloserve.bench.local_server import LocalServer  # noqa: E402
from sloserve.bench.metrics import SLO  # noqa: E402
from sloserve.bench.report import fmt_rate  # noqa: E402
from sloserve.bench.result import BenchResult  # noqa: E402
from sloserve.bench.runner import BenchPlan, default_synthesizer, run_plan, write_outputs  # noqa: E402
from sloserve.bench.tokenizer import load_bench_tokenizer  # noqa: E402
from sloserve.workload.build import WorkloadSpec  # noqa: E402

SERVED_NAME = "smollm2-135m"
ADMIN = "bench-admin"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pd", default="1:1", help="the disaggregated split P:D (colocated runs P+D instances)")
    p.add_argument("--live", action="store_true", help="also run the P/D fleet with --pd-transfer live")
    p.add_argument("--rates", default="1,2,4", help="comma-separated Poisson rates, req/s")
    p.add_argument("--num-requests", type=int, default=40, help="requests per rate")
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--max-output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--slo", default="ttft=1000,tpot=100", help="goodput targets in ms (ttft=, tpot=, e2e=)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="default: benchmarks/results/pd-real-STAMP")
    return p.parse_args()


def configurations(args: argparse.Namespace) -> dict[str, list[str]]:
    p, d = (int(x) for x in args.pd.split(":"))
    configs = {"colocated": ["--instances", str(p + d), "--router", "least-requests"],
               f"pd {args.pd}": ["--pd", args.pd, "--router", "least-requests", "--decode-router", "least-requests"]}
    if args.live:
        configs[f"pd {args.pd} live"] = [*configs[f"pd {args.pd}"], "--pd-transfer", "live"]
    return configs


def run_config(name: str, flags: list[str], args: argparse.Namespace, rates: list[float], out: Path,
               console: Console, synthesizer) -> tuple[list[BenchResult], list[Optional[dict]]]:
    console.rule(f"{name}: starting {' '.join(flags)}")
    slug = name.replace(" ", "-").replace(":", "")
    server = LocalServer([*flags, "--max-num-seqs", str(args.max_num_seqs), "--served-model-name", SERVED_NAME,
                          "--admin-key", ADMIN, "--log-level", "warning"], out / f"{slug}.server.log")
    handoffs: list[Optional[dict]] = []
    try:
        server.wait_ready(timeout=600)
        spec = WorkloadSpec("sharegpt", seed=args.seed, num_requests=args.num_requests,
                            max_prompt_len=args.max_prompt_len, max_output_len=args.max_output_len)
        client = ClientConfig(base_url=server.base_url, model=SERVED_NAME, request_timeout_s=900)
        plan = BenchPlan(spec, client, rates, slo=SLO.parse(args.slo), prompt_format="tokens", warmup=2,
                         extra_config={"config": name, "flags": flags})
        progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=console)
        task: list[Optional[int]] = [None]

        def on_run_start(rate: Optional[float], n: int) -> None:
            if task[0] is not None:  # the previous rate's run ended: its hand-off counters
                handoffs.append(fleet_handoffs(server.base_url))
            task[0] = progress.add_task(f"{name} · rate {fmt_rate(rate)}", total=n)

        with progress:
            results = run_plan(plan, synthesizer, on_run_start,
                               lambda rec: progress.advance(task[0]) if task[0] is not None else None, write=False)
        handoffs.append(fleet_handoffs(server.base_url))
    finally:
        server.stop()
    for r in results:
        r.label = f"{name} · rate {fmt_rate(r.rate)}"
    write_outputs(results, out / slug)
    return results, per_run(handoffs)


def fleet_handoffs(base: str) -> Optional[dict]:
    info = httpx.get(base + "/v1/instances", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30).json()
    return info.get("handoffs")


def per_run(cumulative: list[Optional[dict]]) -> list[Optional[dict]]:
    """Cumulative counters after each rate -> each rate's own (mean latency is the cumulative mean)."""
    out, prev = [], None
    for c in cumulative:
        if c is None:
            out.append(None)
            continue
        keys = ("completed", "aborted", "bytes", "decoded_on_prefill")
        out.append({**{k: c[k] - (prev[k] if prev else 0) for k in keys}, "mean_latency_s": c["mean_latency_s"]})
        prev = c
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(17, 4), layout="constrained")
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]
        rates = [r["rate"] for r in mine]
        for ax, key in zip(axes, ("ttft", "tpot")):
            ax.plot(rates, [r[f"{key}_p50_ms"] for r in mine], "o-", label=f"{name} p50")
            ax.plot(rates, [r[f"{key}_p99_ms"] for r in mine], "s--", label=f"{name} p99")
        axes[2].plot(rates, [r["output_tok_s"] for r in mine], "o-", label=name)
        axes[3].plot(rates, [r["goodput"] for r in mine], "o-", label=name)
    for ax, title in zip(axes, ("TTFT (ms)", "TPOT (ms)", "output throughput (tok/s)", "goodput (req/s within SLO)")):
        ax.set_title(title)
        ax.set_xlabel("offered rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("colocated vs prefill/decode-disaggregated workers on one CPU host (same requests)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    args = parse_args()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = args.out or REPO / "benchmarks" / "results" / f"pd-real-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
    rates = [float(r) for r in args.rates.split(",")]
    synthesizer = default_synthesizer(load_bench_tokenizer(None), args.seed)
    rows = []
    for name, flags in configurations(args).items():
        results, handoffs = run_config(name, flags, args, rates, out, console, synthesizer)
        for r, h in zip(results, handoffs):
            o = r.summary.overall
            rows.append({"config": name, "rate": r.rate, "completed": o.completed, "failed": o.failed,
                         **{f"{m}_p{q}_ms": 1e3 * o.latency[m].p(q) for m in ("ttft", "tpot") for q in (50, 99)},
                         "output_tok_s": o.output_throughput, "attainment": o.slo_attainment, "goodput": o.goodput,
                         "handoffs": h})
    table = Table(title=f"colocated vs P/D {args.pd}, SLO {args.slo} ms ({platform.processor() or 'cpu'}, "
                        f"{os.cpu_count()} cpus)")
    for col in ("config", "rate", "TTFT p50/p99 ms", "TPOT p50/p99 ms", "tok/s", "SLO met", "goodput",
                "hand-offs (MB, mean ms)"):
        table.add_column(col)
    for r in rows:
        h = r["handoffs"]
        table.add_row(r["config"], fmt_rate(r["rate"]), f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}",
                      f"{r['tpot_p50_ms']:.1f} / {r['tpot_p99_ms']:.1f}", f"{r['output_tok_s']:.1f}",
                      f"{100 * r['attainment']:.0f}%", f"{r['goodput']:.2f}",
                      "-" if h is None else f"{h['completed']} ({h['bytes'] / 1e6:.1f}, "
                      f"{1e3 * (h['mean_latency_s'] or 0):.0f}); local {h['decoded_on_prefill']}")
    console.print(table)
    (out / "pd_real.json").write_text(json.dumps({
        "started_utc": stamp, "machine": {"cpus": os.cpu_count(), "processor": platform.processor()},
        "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=1))
    plot(rows, REPO / "benchmarks" / "figures" / "pd_real.png")
    console.print(f"wrote {out} and benchmarks/figures/pd_real.png")
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
