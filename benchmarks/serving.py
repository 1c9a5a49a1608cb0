#!/usr/bin/env python3
"""Online serving benchmark: ShareGPT prompts at Poisson request rates against `sloserve serve`.

A small, self-contained asyncio streaming client (httpx). For each request rate it sends
--num-prompts ShareGPT first-turn prompts (completions API, streamed, EOS ignored, output
length = the ShareGPT reply's length capped at --max-tokens) with exponential
inter-arrival times, and measures on the client:

* TTFT: request sent -> first chunk with text
* ITL: gaps between consecutive chunks with text
* TPOT: (E2E - TTFT) / (output tokens - 1), per request
* throughput: requests/s, output tokens/s and total tokens/s over the rate's wall time

It prints p50/p99 per rate and writes a JSON and a PNG under benchmarks/results/. Without
--base-url it starts `sloserve serve` itself on a free loopback port (--server-arg passes
options through). Usage: `python benchmarks/serving.py --help`.
"""
from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Optional

import httpx
import numpy as np

from sloserve.bench.local_server import LocalServer

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATASET = REPO_ROOT.parent / "shared" / "data" / "sharegpt_v3_first_turn.jsonl.gz"
DEFAULT_OUTPUT_DIR = REPO_ROOT / "benchmarks" / "results"


@dataclass
class Sample:
    prompt: str
    max_tokens: int


@dataclass
class Result:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: Optional[float] = None
    e2e: Optional[float] = None
    itls: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> Optional[float]:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def load_sharegpt(path: Path, n: int, seed: int, max_prompt_tokens: int, max_tokens: int) -> list[Sample]:
    """n random first-turn prompts short enough for a CPU (cl100k counts, close to the model's)."""
    rows = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if 4 <= row["prompt_tokens_cl100k"] <= max_prompt_tokens and row["response_tokens_cl100k"] >= 2:
                rows.append(row)
    if len(rows) < n:
        raise SystemExit(f"only {len(rows)} prompts of at most {max_prompt_tokens} tokens in {path}")
    picked = random.Random(seed).sample(rows, n)
    return [Sample(r["prompt"], min(max_tokens, r["response_tokens_cl100k"])) for r in picked]


async def send(client: httpx.AsyncClient, model: str, sample: Sample) -> Result:
    body = {"model": model, "prompt": sample.prompt, "max_tokens": sample.max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    result = Result(ok=False)
    start = time.perf_counter()
    last: Optional[float] = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if last is None:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
        result.e2e = time.perf_counter() - start
        result.ok = result.output_tokens > 0
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_rate(base_url: str, model: str, samples: list[Sample], rate: float, seed: int,
                   progress, task) -> tuple[list[Result], float]:
    """Send every sample with Poisson arrivals at `rate` req/s (inf = all at once)."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(samples), max_keepalive_connections=len(samples))
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def timed(sample: Sample) -> Result:
            r = await send(client, model, sample)
            progress.advance(task)
            return r

        start = time.perf_counter()
        tasks = []
        for i, sample in enumerate(samples):
            tasks.append(asyncio.create_task(timed(sample)))
            if rate != float("inf") and i + 1 < len(samples):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarize(rate: float, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]

    def pct(values: list[float]) -> dict:
        if not values:
            return {"mean": None, "p50": None, "p99": None}
        a = np.asarray(values) * 1000.0
        return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}

    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "request_rate": rate if rate != float("inf") else "inf",
        "num_requests": len(results),
        "num_ok": len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "ttft_ms": pct([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": pct([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": pct([g for r in ok for g in r.itls]),
        "e2e_ms": pct([r.e2e for r in ok if r.e2e is not None]),
    }


def print_table(summaries: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="sloserve serving benchmark (ms; throughput per second)")
    for col in ("rate", "ok", "req/s", "out tok/s", "tot tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
                "ITL p50", "ITL p99"):
        table.add_column(col, justify="right")

    def f(x: Optional[float]) -> str:
        return "-" if x is None else f"{x:.1f}"

    for s in summaries:
        table.add_row(str(s["request_rate"]), f"{s['num_ok']}/{s['num_requests']}", f"{s['request_throughput']:.2f}",
                      f(s["output_token_throughput"]), f(s["total_token_throughput"]),
                      f(s["ttft_ms"]["p50"]), f(s["ttft_ms"]["p99"]), f(s["tpot_ms"]["p50"]), f(s["tpot_ms"]["p99"]),
                      f(s["itl_ms"]["p50"]), f(s["itl_ms"]["p99"]))
    Console(width=160).print(table)


def plot(summaries: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [s["request_rate"] if s["request_rate"] != "inf" else max(
        [x["request_rate"] for x in summaries if x["request_rate"] != "inf"] or [1]) * 2 for s in summaries]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "itl_ms"), ("TTFT", "TPOT", "ITL")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(rates, [s[key][q] if s[key][q] is not None else np.nan for s in summaries], style, label=q)
        ax.set_title(f"{title} (ms)")
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("sloserve serve: ShareGPT prompts, Poisson arrivals")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", help="a running server (default: start `sloserve serve` here)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="passed to the self-started server (repeatable, e.g. --server-arg=--num-threads=1)")
    p.add_argument("--model", help="`model` field (default: the server's first model)")
    p.add_argument("--dataset", type=Path, default=DEFAULT_DATASET)
    p.add_argument("--num-prompts", type=int, default=50, help="requests per rate")
    p.add_argument("--request-rates", default="0.5,1,2", help="comma-separated req/s; 'inf' = all at once")
    p.add_argument("--max-tokens", type=int, default=64, help="cap on output tokens per request")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="skip longer ShareGPT prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    return p.parse_args(argv)


async def bench(args: argparse.Namespace, base_url: str) -> list[dict]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    model = args.model or httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    samples = load_sharegpt(args.dataset, args.num_prompts, args.seed, args.max_prompt_tokens, args.max_tokens)
    rates = [float(r) for r in args.request_rates.split(",")]
    summaries = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as bar:
        for i, rate in enumerate(rates):
            task = bar.add_task(f"rate {rate:g} req/s", total=len(samples))
            results, duration = await run_rate(base_url, model, samples, rate, args.seed + i, bar, task)
            summaries.append(summarize(rate, results, duration))
    return summaries


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    server = None
    if args.base_url is None:
        server = LocalServer(args.server_arg, args.output_dir / f"serving-{stamp}.server.log")
        server.wait_ready()
        base_url = server.base_url
    else:
        base_url = args.base_url.rstrip("/")
    try:
        summaries = asyncio.run(bench(args, base_url))
    finally:
        exit_code = server.stop() if server is not None else None
    print_table(summaries)
    report = {
        "timestamp": stamp, "base_url": base_url, "self_started_server": server is not None,
        "server_exit_code": exit_code, "args": {k: str(v) for k, v in vars(args).items()},
        "cpu_count": os.cpu_count(), "results": summaries,
    }
    json_path = args.output_dir / f"serving-{stamp}.json"
    png_path = args.output_dir / f"serving-{stamp}.png"
    json_path.write_text(json.dumps(report, indent=2))
    plot(summaries, png_path)
    print(f"wrote {json_path.relative_to(REPO_ROOT) if json_path.is_relative_to(REPO_ROOT) else json_path}")
    print(f"wrote {png_path.relative_to(REPO_ROOT) if png_path.is_relative_to(REPO_ROOT) else png_path}")
    return 0 if all(s["num_ok"] == s["num_requests"] for s in summaries) else 1


if __name__ == "__main__":
    sys.exit(main())
