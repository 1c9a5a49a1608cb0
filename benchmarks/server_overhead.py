#!/usr/bin/env python3
"""Where a serving step's time goes: `sloserve serve` against the same engine offline, step by step.

A single greedy stream decodes one token a step, so each step's wall time is one token's TPOT.
The engine's step trace (`--step-trace`) splits it into scheduling, the model runner and output
processing, and the distance from one step's end to the next one's start is the *gap*: time the
engine thread spent outside its own step (in the server: handing the token to the HTTP event loop
and waiting for the GIL back; offline: the `LLM.generate` loop folding outputs). The model's own
time should not depend on the server, so any difference in TPOT between the server and the
offline engine is in the gap.

Systems, alternated round by round so that the machine's drift hits them alike:
* `sloserve serve --event-loop asyncio` and `--event-loop uvloop` (the default where installed),
  each sent `--repeats` streaming completions (official `openai` client, EOS ignored) after one
  uncounted warm-up;
* `offline`: `LLM.generate` in this process, the same prompts and token counts.

    python benchmarks/server_overhead.py --rounds 3 --repeats 3 --max-tokens 256
Writes benchmarks/results/server_overhead-STAMP.json and .png (median split of a decode step).
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
from typing import Optional

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import machine_info  # noqa: E402  (the benchmarks' shared helpers)

from sloserve.bench.local_server import LocalServer  # noqa: E402
from sloserve.engine.step_trace import StepRecord  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
PARTS = ("schedule", "execute", "process", "gap")


def decode_split(trace: Path) -> dict[str, float]:
    """Median ms of each part over consecutive one-token decode steps, and their period."""
    steps = [StepRecord.from_json(line) for line in trace.read_text().splitlines() if line.strip()]
    rows = []
    for a, b in zip(steps, steps[1:]):
        if a.load.num_tokens == a.load.num_decodes == 1 and b.load.num_tokens == b.load.num_decodes == 1:
            rows.append((a.schedule_s, a.execute_s, a.process_s, b.start_s - a.end_s, b.start_s - a.start_s))
    if not rows:
        raise SystemExit(f"server_overhead: no consecutive decode steps in {trace}")
    split = {part: 1000 * statistics.median(r[i] for r in rows) for i, part in enumerate(PARTS)}
    split["period"] = 1000 * statistics.median(r[4] for r in rows)
    split["steps"] = len(rows)
    return split


def server_system(loop: str, args: argparse.Namespace, workdir: Path, rnd: int) -> dict:
    import openai

    trace = workdir / f"{loop}-{rnd}.jsonl"
    threads = ["--num-threads", str(args.threads)] if args.threads else []
    server = LocalServer(["--event-loop", loop, "--step-trace", str(trace), *threads], workdir / f"{loop}-{rnd}.log")
    try:
        server.wait_ready()
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        tpots = []
        for i in range(args.repeats + 1):
            stamps = []
            for _ in client.completions.create(model=model, prompt=f"[{loop} {rnd} {i}] {PROMPT}", stream=True,
                                               max_tokens=args.max_tokens, temperature=0.0,
                                               extra_body={"ignore_eos": True}):
                stamps.append(time.perf_counter())
            if i:  # the first request warms up
                tpots.append(1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1))
    finally:
        server.stop()
    return {"system": f"serve --event-loop {loop}", "round": rnd, "client_tpot_ms": tpots, **decode_split(trace)}


def offline_system(args: argparse.Namespace, workdir: Path, rnd: int) -> dict:
    from sloserve.core.config import EngineConfig
    from sloserve.engine.llm import LLM
    from sloserve.core.types import SamplingParams

    trace = workdir / f"offline-{rnd}.jsonl"
    llm = LLM(config=EngineConfig(step_trace=str(trace), num_threads=args.threads))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    per_token = []
    for i in range(args.repeats + 1):
        start = time.perf_counter()
        llm.generate([f"[offline {rnd} {i}] {PROMPT}"], params)
        if i:
            per_token.append(1000 * (time.perf_counter() - start) / args.max_tokens)
    llm.engine.close()
    return {"system": "offline LLM.generate", "round": rnd, "e2e_ms_per_token": per_token, **decode_split(trace)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every system once (default 3)")
    p.add_argument("--repeats", type=int, default=3, help="timed requests per system and round (default 3)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--loops", default="asyncio,uvloop", help="event loops to serve with (default asyncio,uvloop)")
    p.add_argument("--no-offline", action="store_true", help="skip the offline engine")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the server's default)")
    args = p.parse_args(argv)
    loops = [x for x in args.loops.split(",") if x]
    rows = []
    console = Console()
    with tempfile.TemporaryDirectory() as tmp, Progress(console=console) as progress:
        workdir = Path(tmp)
        task = progress.add_task("rounds", total=args.rounds * (len(loops) + (not args.no_offline)))
        for rnd in range(args.rounds):
            for loop in loops:
                rows.append(server_system(loop, args, workdir, rnd))
                progress.advance(task)
            if not args.no_offline:
                rows.append(offline_system(args, workdir, rnd))
                progress.advance(task)
    systems = list(dict.fromkeys(r["system"] for r in rows))
    table = Table(title=f"One greedy stream, {args.max_tokens} tokens: median ms of a decode step "
                        f"({args.rounds} rounds, alternating)")
    for col in ("system", "round", *PARTS, "step period", "client TPOT p50"):
        table.add_column(col, justify="right")
    for r in rows:
        tpot = r.get("client_tpot_ms") or r.get("e2e_ms_per_token")
        table.add_row(r["system"], str(r["round"]), *(f"{r[k]:.2f}" for k in PARTS), f"{r['period']:.2f}",
                      f"{statistics.median(tpot):.2f}")
    console.print(table)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"server_overhead-{stamp}.json"
    path.write_text(json.dumps({"date": stamp, "machine": machine_info(), "args": vars(args), "rows": rows}, indent=1))
    plot(rows, systems, path.with_suffix(".png"))
    console.print(f"wrote {path}")
    return 0


def plot(rows: list[dict], systems: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    bottoms = [0.0] * len(systems)
    for part in PARTS:
        values = [statistics.median(r[part] for r in rows if r["system"] == s) for s in systems]
        ax.barh(systems, values, left=bottoms, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    ax.set_xlabel("ms per decode step (median over rounds of the per-round medians)")
    ax.legend(ncol=4, fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
