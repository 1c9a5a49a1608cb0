#!/usr/bin/env python3
"""A long fuzz of the single-instance HTTP API (10k+ bodies by default), with a report.

The same driver as tests/test_fuzz_api.py (tests/fuzz_helpers.py): the real app on the real
engine (embedded model, small context) under uvicorn on 127.0.0.1 in this process; per route,
schemathesis's coverage cases, its positive and negative draws with the request headers fuzzed,
raw non-JSON bytes, and valid prompts with every sampling field fuzzed. Afterwards the server
must hold nothing (edge, engine, KV blocks) and give the same greedy text as before.

Prints bodies per route and status, the 5xx count and every finding verbatim (body, headers,
response); writes benchmarks/results/fuzz-STAMP.json. Exit status 1 on a new finding or a
server left unwell; findings matching tests/test_fuzz_api.py's KNOWN_ISSUES are listed apart.

    python benchmarks/fuzz.py                      # ~11k bodies, a few minutes
    python benchmarks/fuzz.py --max-examples 100   # shorter
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the driver lives beside the test that runs it in the suite

from fuzz_helpers import Fuzzer, FuzzReport, ServerUnderTest, summary_lines  # noqa: E402
from test_fuzz_api import KNOWN_ISSUES  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-examples", type=int, default=600, help="hypothesis draws per route and mode")
    p.add_argument("--engine-examples", type=int, default=300, help="valid-prompt bodies per generation route")
    p.add_argument("--max-model-len", type=int, default=96)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a body may take before it counts as unanswered")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="default: benchmarks/results/fuzz-STAMP.json")
    return p.parse_args()


def status_table(report: FuzzReport) -> Table:
    statuses = sorted(report.by_status(), key=str)
    table = Table(title="bodies per route and status")
    table.add_column("route")
    for s in statuses:
        table.add_column(str(s), justify="right")
    table.add_column("total", justify="right")
    routes = sorted({label for label, _, _ in report.counts})
    for route in routes:
        row = [sum(n for (lab, _, st), n in report.counts.items() if lab == route and st == s) for s in statuses]
        table.add_row(route, *map(str, row), str(sum(row)))
    return table


def main() -> int:
    args = parse_args()
    console = Console()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = args.out or REPO / "benchmarks" / "results" / f"fuzz-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    console.rule("starting the server (embedded model, in-process, 127.0.0.1)")
    server = ServerUnderTest.start(max_model_len=args.max_model_len, num_threads=args.num_threads)
    try:
        greedy_before = server.greedy_text()
        progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console)
        with progress:
            task = progress.add_task("fuzzing", total=None)
            fuzzer = Fuzzer(server.base_url, timeout_s=args.timeout, seed=args.seed, known_issues=KNOWN_ISSUES,
                            vocab_size=server.engine.engine.model_config.vocab_size,
                            on_sent=lambda: progress.advance(task))
            for operation in fuzzer.operations():
                progress.update(task, description=f"fuzzing {operation.label}")
                fuzzer.run_all(args.max_examples, engine_examples=args.engine_examples, operations=[operation])
        report = fuzzer.report
        t0 = time.monotonic()
        held = server.wait_idle(60)
        greedy_after = server.greedy_text()
        settle_s = time.monotonic() - t0
    finally:
        server.stop()

    console.print(status_table(report))
    for line in summary_lines(report):
        console.print(line)
    healthy = not any(held.values()) and greedy_after == greedy_before
    console.print(f"after the fuzz: held {held} (settled in {settle_s:.1f}s); greedy text "
                  f"{'unchanged' if greedy_after == greedy_before else f'CHANGED: {greedy_before!r} -> {greedy_after!r}'}")
    for title, findings in (("NEW FINDINGS", report.findings), ("known findings", report.known)):
        if findings:
            console.rule(f"{title}: {len(findings)}")
            for f in findings[:50]:
                console.print(f.describe(), markup=False, highlight=False)
    out.write_text(json.dumps({"started_utc": stamp, "args": {k: str(v) for k, v in vars(args).items()},
                               "report": report.to_dict(), "held_after": held,
                               "greedy_unchanged": greedy_after == greedy_before}, indent=1))
    console.print(f"wrote {out}")
    return 0 if healthy and not report.findings else 1


if __name__ == "__main__":
    raise SystemExit(main())
