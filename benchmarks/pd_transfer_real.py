#!/usr/bin/env python3
"""P/D hand-off transfers on real workers: blocking, live and pipelined against prompt length.

For each transfer, `sloserve serve --pd 1:1 --pd-transfer T` (embedded model, one thread per
worker, the prefill pool computing --prefill-budget prompt tokens a step) on a free 127.0.0.1
port. For each prompt length, streamed greedy completions of fresh random token-id prompts (no
prefix cache shortens a copy; the same prompts for every transfer) are sent one at a time.
Per request:

  ttft       the client's first token (computed on the prefill worker)
  handoff    the front's hand-off latency: first token on the prefill worker to the next
             one on the decode worker (/v1/instances), i.e. what the second token waits for
  max gap    the client's longest wait between two tokens (the hand-off's pause, as the client
             sees it: the prefill worker may decode a few tokens before the pause)
  MB         KV bytes the hand-off moved; early MB: those sent while the prompt was computed
             (pipelined only)

Every transfer must give the client the same text for the same prompt (checked). Output: a table,
benchmarks/results/pd-transfer-real-STAMP.json and benchmarks/figures/pd_transfer_real.png.

    python benchmarks/pd_transfer_real.py                          # 512 .. 4096 tokens, 3 runs (~8 min)
    python benchmarks/pd_transfer_real.py --lengths 1024 --runs 1
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from figure import measured_ticks, save  # noqa: E402
from migration_downtime import ADMIN, cpu_model, wait_healthy  # noqa: E402  (the same admin client)
from sloserve.bench.local_server import LocalServer  # noqa: E402

TRANSFERS = ("blocking", "live", "pipelined")
MAX_TOKENS = 16
KV_BYTES_PER_TOKEN = 46080  # the embedded model's KV in fp32, the most it takes (sizes the pool)


def handoffs(base: str) -> dict:
    r = httpx.get(base + "/v1/instances", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    return r.json()["handoffs"]


def run_one(base: str, prompt: list[int]) -> dict:
    """One streamed request; the client's token times and what the front counted for it."""
    before = handoffs(base)
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    started = time.perf_counter()
    times: list[float] = []
    texts: list[str] = []
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if event.get("choices"):
                    times.append(time.perf_counter())
                    texts.append(event["choices"][0]["text"])
    after = handoffs(base)
    done = after["completed"] - before["completed"]
    latency_sum = (after["mean_latency_s"] or 0) * after["completed"] - (before["mean_latency_s"] or 0) * before["completed"]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"handed_off": done == 1, "ttft_s": times[0] - started, "max_gap_s": max(gaps),
            "handoff_s": latency_sum if done == 1 else None, "kv_bytes": after["bytes"] - before["bytes"],
            "early_bytes": after["pipelined_bytes"] - before["pipelined_bytes"],
            "downtime_s": after["downtime_s"] - before["downtime_s"], "text": "".join(texts), "tokens": len(texts)}


def run_transfer(transfer: str, prompts: dict[int, list[list[int]]], args, log: Path, progress, task) -> list[dict]:
    longest = max(prompts) + MAX_TOKENS + 16
    gib = max(0.2, 2 * longest * KV_BYTES_PER_TOKEN / 2**30)
    server = LocalServer(["--pd", "1:1", "--pd-transfer", transfer, "--pd-prefill", f"budget={args.prefill_budget}",
                          "--admin-key", ADMIN, "--num-threads", "2", "--kv-cache-gib", f"{gib:.2f}",
                          "--max-num-seqs", "4", "--no-shed-unattainable"], log)
    rows = []
    try:
        wait_healthy(server, 2)
        warm = [random.Random(-1).randrange(100, 40000) for _ in range(64)]
        run_one(server.base_url, warm)  # the first request of a fresh worker pays its warm-up
        for length, runs in prompts.items():
            for i, prompt in enumerate(runs):
                rows.append({"transfer": transfer, "context": length, "run": i, **run_one(server.base_url, prompt)})
                progress.advance(task)
    finally:
        server.stop()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--prefill-budget", type=int, default=512, help="prompt tokens the prefill worker computes a step")
    p.add_argument("--transfers", default=",".join(TRANSFERS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot-only", metavar="JSON", help="redraw the figure from a results file, run nothing")
    args = p.parse_args()
    figure = REPO / "benchmarks" / "figures" / "pd_transfer_real.png"
    if args.plot_only:
        saved = json.loads(Path(args.plot_only).read_text())
        plot(saved["summary"], figure, saved["cpu"], saved["prefill_budget"])
        return 0
    transfers = [t for t in args.transfers.split(",") if t]
    console = Console(width=150)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    results_dir = REPO / "benchmarks" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    prompts = {n: [[rng.randrange(100, 40000) for _ in range(n)] for _ in range(args.runs)] for n in args.lengths}
    rows: list[dict] = []
    with Progress(console=console) as progress:
        task = progress.add_task("hand-offs", total=len(transfers) * len(args.lengths) * args.runs)
        for transfer in transfers:
            rows += run_transfer(transfer, prompts, args, results_dir / f"pd-transfer-real-{stamp}-{transfer}.log",
                                 progress, task)

    reference = {(r["context"], r["run"]): r["text"] for r in rows if r["transfer"] == transfers[0]}
    for r in rows:
        r["identical"] = r.pop("text") == reference[(r["context"], r["run"])]
    table = Table(title=f"P/D hand-off transfers, 1 prefill + 1 decode worker ({cpu_model()}, "
                        f"prefill {args.prefill_budget} tokens a step)")
    for col in ("context", "transfer", "TTFT ms", "hand-off ms", "max gap ms", "downtime ms", "MB", "early MB",
                "identical"):
        table.add_column(col, justify="right")
    summary: dict = {}
    for length in args.lengths:
        for transfer in transfers:
            runs = [r for r in rows if r["context"] == length and r["transfer"] == transfer and r["handed_off"]]
            if not runs:
                continue
            med = {k: statistics.median(r[k] for r in runs) for k in ("ttft_s", "handoff_s", "max_gap_s", "downtime_s",
                                                                       "kv_bytes", "early_bytes")}
            same = all(r["identical"] for r in runs)
            summary.setdefault(str(length), {})[transfer] = {**med, "runs": len(runs), "all_identical": same}
            table.add_row(str(length), transfer, f"{med['ttft_s'] * 1e3:.0f}", f"{med['handoff_s'] * 1e3:.0f}",
                          f"{med['max_gap_s'] * 1e3:.0f}", f"{med['downtime_s'] * 1e3:.0f}", f"{med['kv_bytes'] / 1e6:.1f}",
                          f"{med['early_bytes'] / 1e6:.1f}", str(same))
    console.print(table)
    out = results_dir / f"pd-transfer-real-{stamp}.json"
    out.write_text(json.dumps({"cpu": cpu_model(), "date": stamp, "max_tokens": MAX_TOKENS,
                               "prefill_budget": args.prefill_budget, "summary": summary, "runs": rows}, indent=1))
    console.print(f"results: {out}")
    plot(summary, figure, cpu_model(), args.prefill_budget)
    failed = [r for r in rows if not r["handed_off"] or not r["identical"]]
    if failed:
        console.print(f"[red]{len(failed)} requests were not handed off or changed the output[/red]")
        return 1
    return 0


def plot(summary: dict, path: Path, cpu: str, budget: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted(int(k) for k in summary)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for transfer, style in zip(TRANSFERS, ("o-", "s--", "^-")):
        xs = [n for n in lengths if transfer in summary[str(n)]]
        ax1.plot(xs, [summary[str(n)][transfer]["handoff_s"] * 1e3 for n in xs], style, label=transfer)
        ax2.plot(xs, [summary[str(n)][transfer]["ttft_s"] * 1e3 for n in xs], style, label=transfer)
    ax1.set(xscale="log", xlabel="prompt (tokens)", ylabel="ms (median)",
            title="hand-off: first token to the next, on the decode worker")
    ax2.set(xscale="log", xlabel="prompt (tokens)", ylabel="ms (median)", title="TTFT (prefill worker)")
    for ax in (ax1, ax2):
        measured_ticks(ax, lengths)
    save(fig, path, f"sloserve P/D hand-off transfers, 1+1 workers of SmolLM2-135M on {cpu}, prefill {budget} "
                    f"tokens a step")


if __name__ == "__main__":
    raise SystemExit(main())
