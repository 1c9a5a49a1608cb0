#!/usr/bin/env python3
"""KV tiers on the real CPU engine: multi-turn chat with a device pool too small for it.

Conversations (each first user message a ShareGPT first turn, later turns short follow-ups; the
model's own greedy answers go into the history) are served turn by turn, round robin across the
conversations, one request at a time, so each turn's history has been pushed out of the small
device pool by the other conversations' turns. Layouts, side by side in one run on this machine:
device only; + host-memory tier; + local-disk tier; + both; and a fresh engine restarted on the
disk tier the `+disk` run left, serving one more turn of every conversation (against a cold
engine serving the same turn). Per layout: prefix hit rate (cached prompt tokens / prompt tokens),
TTFT mean / p50 / p90, tier loads; every layout must produce the device-only run's tokens.

    python benchmarks/kv_tiers_real.py --conversations 8 --turns 4 --num-blocks 96
Writes benchmarks/results/kv_tiers_real-STAMP.json and .png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from migration_downtime import cpu_model  # noqa: E402  (the CPU's model name, as every real benchmark writes it)

from sloserve.core.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from sloserve.engine.llm_engine import LLMEngine  # noqa: E402
from sloserve.cli.kv_store import start_kv_store  # noqa: E402
from sloserve.core.types import SamplingParams  # noqa: E402
from sloserve.workload.traces import load_sharegpt, shared_path  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FOLLOW_UPS = ["Can you say that more briefly?", "Give me one concrete example.", "What is the main risk here?",
              "How would you explain it to a child?", "Summarise your answer in one line."]


def engine(num_blocks: int, threads: int, **cache) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", quantization="none", num_threads=threads,
                                  cache=CacheConfig(num_blocks=num_blocks, **cache),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=256)))


def serve(eng: LLMEngine, prompt: list[int], max_tokens: int) -> dict:
    rid = eng.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    t0 = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    text, cached = "", 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid:
                if ttft is None and out.delta_token_ids:
                    ttft = time.perf_counter() - t0
                tokens += out.delta_token_ids
                text += out.delta_text
                cached = out.num_cached_tokens
    return {"ttft_s": ttft, "tokens": tokens, "text": text, "prompt_tokens": len(prompt), "cached_tokens": cached}


def run_chats(eng: LLMEngine, firsts: list[str], turns: int, max_tokens: int, progress, task,
              histories: list[list[dict]] | None = None) -> tuple[list[dict], list[list[dict]]]:
    """Round robin over the conversations, `turns` turns each; returns per-request results and
    the histories (with the model's answers) to continue from."""
    histories = histories or [[] for _ in firsts]
    results = []
    for t in range(turns):
        for c, first in enumerate(firsts):
            history = histories[c]
            user = first if not history else FOLLOW_UPS[(len(history) // 2 + c) % len(FOLLOW_UPS)]
            messages = history + [{"role": "user", "content": user}]
            res = serve(eng, eng.tokenizer.encode_chat(messages), max_tokens)
            res["conversation"], res["turn"] = c, len(history) // 2
            results.append(res)
            histories[c] = messages + [{"role": "assistant", "content": res["text"]}]
            progress.advance(task)
    return results, histories


def measured_links(eng: LLMEngine) -> dict:
    """Each tier's copy speed as the engine measured it while serving (GB/s, one way: a moving
    average over its loads, from a first guess); tiers nothing was loaded from are left out."""
    if eng.tier_cost is None:
        return {}
    stats = eng.kv.tiers.stats()
    return {tier: link.bandwidth / 1e9 for tier, link in eng.tier_cost.links.items()
            if tier in stats and stats[tier].loaded > 0}


def summary(results: list[dict], eng: LLMEngine) -> dict:
    ttfts = sorted(r["ttft_s"] for r in results)
    later = [r for r in results if r["turn"] > 0]
    return {
        "requests": len(results),
        "prefix_hit_rate": sum(r["cached_tokens"] for r in results) / sum(r["prompt_tokens"] for r in results),
        "later_turn_hit_rate": (sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later))
        if later else None,
        "ttft_mean_s": statistics.mean(ttfts), "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "tier_loads": eng.scheduler.stats.num_tier_loads,
        "tiers": {k: vars(v) for k, v in eng.kv.tiers.stats().items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-turn-chars", type=int, default=600, help="ShareGPT first turns cut to this length")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=96, help="device KV pool (16-token blocks)")
    ap.add_argument("--host-gib", type=float, default=0.5)
    ap.add_argument("--disk-gib", type=float, default=2.0)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    firsts = [r.prompt_text[:args.first_turn_chars] for r in load_sharegpt(shared_path("sharegpt"))
              if r.prompt_text and len(r.prompt_text) > args.first_turn_chars // 2][:args.conversations]
    console = Console()
    disk_dir = Path(tempfile.mkdtemp(prefix="sloserve-kv-bench-"))
    store = start_kv_store(max_memory_gib=2.0)
    layouts = {"device": {}, "+host": {"host_tier_gib": args.host_gib},
               "+disk": {"disk_tier_dir": str(disk_dir), "disk_tier_gib": args.disk_gib},
               "+host+disk": {"host_tier_gib": args.host_gib, "disk_tier_dir": str(disk_dir / "both"),
                              "disk_tier_gib": args.disk_gib},
               "+store": {"kv_store_url": store.url}}
    out = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_model(),
           "args": vars(args), "layouts": {}}
    per_run = args.conversations * args.turns
    reference = None
    with Progress(console=console) as progress:
        task = progress.add_task("multi-turn chats", total=per_run * len(layouts) + 2 * args.conversations)
        for name, cache in layouts.items():
            eng = engine(args.num_blocks, args.threads, **cache)
            results, histories = run_chats(eng, firsts, args.turns, args.max_tokens, progress, task)
            tokens = [r["tokens"] for r in results]
            if reference is None:
                reference, ref_histories = tokens, histories
            out["layouts"][name] = {**summary(results, eng), "same_tokens_as_device": tokens == reference,
                                    "measured_link_gb_s": measured_links(eng)}
            eng.close()  # the +disk engine writes its device cache to the disk tier here
            del eng
        # One more turn of every conversation: a restarted engine on +disk's directory, and a cold one.
        for name, cache in (("restart on +disk", layouts["+disk"]), ("cold restart", {})):
            eng = engine(args.num_blocks, args.threads, **cache)
            results, _ = run_chats(eng, firsts, 1, args.max_tokens, progress, task,
                                   histories=[list(h) for h in ref_histories])
            out["layouts"][name] = summary(results, eng)
            del eng
    store.stop()
    table = Table(title=f"{args.conversations} conversations x {args.turns} turns, {args.num_blocks}-block device pool "
                        f"({out['cpu']})")
    for col in ("layout", "prefix hit", "later turns hit", "TTFT mean ms", "p50 ms", "p90 ms", "tier loads", "same tokens",
                "measured GB/s"):
        table.add_column(col, justify="right")
    for name, s in out["layouts"].items():
        table.add_row(name, f"{100 * s['prefix_hit_rate']:.1f}%",
                      "-" if s["later_turn_hit_rate"] is None else f"{100 * s['later_turn_hit_rate']:.1f}%",
                      f"{1e3 * s['ttft_mean_s']:.0f}", f"{1e3 * s['ttft_p50_s']:.0f}", f"{1e3 * s['ttft_p90_s']:.0f}",
                      str(s["tier_loads"]), str(s.get("same_tokens_as_device", "-")),
                      " ".join(f"{k} {v:.2f}" for k, v in s.get("measured_link_gb_s", {}).items()) or "-")
    console.print(table)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"kv_tiers_real-{stamp}.json"
    path.write_text(json.dumps(out, indent=1))
    plot(out, path.with_suffix(".png"))
    console.print(f"wrote {path}")
    return 0


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["layouts"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(names, [1e3 * out["layouts"][n]["ttft_mean_s"] for n in names])
    axes[0].set_ylabel("mean TTFT (ms)")
    axes[1].bar(names, [100 * out["layouts"][n]["prefix_hit_rate"] for n in names])
    axes[1].set_ylabel("prefix hit rate (%)")
    for ax in axes:
        ax.tick_params(axis="x", labelsize=7, rotation=20)
    fig.suptitle(f"KV tiers, real CPU engine ({out['cpu']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
