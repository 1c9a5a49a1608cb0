#!/usr/bin/env python3
"""Does any KV ever leave device memory in the KV-tier cells? A dev-split study.

The tiers decision (benchmarks/suite/tiers.yaml) tied device-only KV in every dev cell. A lower tier
can only serve a prefix the device cache has evicted, so this reads, for each dev cell and seed, the
window the suite tries at the cell's capacity (the device-only fleet's goodput at 90%, from a dev
run's results.json.gz) and runs the `+host` fleet on it once, counting:
- the prompt tokens of the window and the distinct KV blocks their prefixes need, against the
  blocks the fleet's devices hold;
- blocks the devices demoted to the host tier, blocks read back from it (prefix hits a device
  alone would have recomputed), and the device prefix hit rate.
Only dev cells are read (a test cell is refused): this is where the grid's reach is examined.

    .venv/bin/python benchmarks/tiers_reuse.py [--run benchmarks/suite/runs/tiers-dev-20261207] [--seeds 0,1]
Writes benchmarks/results/tiers-reuse-<time>/{tiers_reuse.json,tiers_reuse.md}.
"""
from __future__ import annotations

import argparse
import gzip
import json
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from sloserve.evaluation.decisions.tiers import ROUTER, TiersDecision
from sloserve.evaluation.fleet import Policy, Setting, fleet_config
from sloserve.evaluation.metrics import probe_for
from sloserve.evaluation.suite import Cell, Measure, load_grid, split_of
from sloserve.simulation import build_fleet, make_predictions, sim_requests, simulate

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_RUN = ROOT / "benchmarks" / "suite" / "runs" / "tiers-dev-20261207"


def capacities(run: Path) -> dict[tuple[str, int], float]:
    """(cell description, seed) -> the device-only fleet's goodput at 90% in that run."""
    with gzip.open(run / "results.json.gz", "rt") as f:
        doc = json.load(f)
    if doc["split"] != "dev":
        raise SystemExit(f"{run} is a {doc['split']} run; this study reads dev runs only")
    return {(c["description"], m["seed"]): m["goodput90"]["rps"]
            for c in doc["cells"] for m in c["metrics"][ROUTER]}


def measure(cell: Cell, seed: int, rate: float, tiers: str, how: Measure) -> dict:
    setting = Setting.of(cell.params)
    probe = probe_for(setting, seed, how)
    tried = probe(rate)
    cfg = fleet_config(setting, Policy(ROUTER, tiers=tiers))
    predictions = make_predictions(cfg)
    sim = build_fleet(cfg, predictions)
    simulate(sim, sim_requests(tried, None, predictions=predictions), predictions=predictions)
    block = cfg.cache.block_size
    saved = loaded = queries = hits = device_blocks = 0
    for inst in sim.instances:
        kv = inst.kv
        device_blocks += kv.num_blocks
        queries += kv.stats.queries
        hits += kv.stats.hits
        for stats in kv.tiers.stats().values():
            saved += stats.saved
            loaded += stats.loaded
    shared = {h for r in tried for h in (r.hash_ids or ())}
    hashed = {r.hash_block_size for r in tried if r.hash_ids}
    distinct = len(shared) * hashed.pop() // block if len(hashed) == 1 else None  # the prefixes' blocks
    return {"cell": cell.label, "seed": seed, "rate_rps": rate, "requests": len(tried),
            "prompt_blocks": sum(r.prompt_len for r in tried) // block, "distinct_prefix_blocks": distinct,
            "device_blocks": device_blocks, "device_hit_rate": hits / queries if queries else 0.0,
            "demoted_blocks": saved, "loaded_blocks": loaded}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", type=Path, default=DEFAULT_RUN, help="a dev run of the tiers decision")
    ap.add_argument("--seeds", default="0,1", help="seeds to read (the run's windows)")
    ap.add_argument("--tiers", default="+host", help="the tier policy to count (evaluation/fleet.TIERS)")
    args = ap.parse_args()
    caps = capacities(args.run)
    seeds = [int(s) for s in args.seeds.split(",")]
    grid = load_grid("tiers")
    how = grid.measure_as(TiersDecision.measure_type)
    dev = [c for c in grid.cells if split_of(c) == "dev"]
    rows = []
    with Progress(console=Console(stderr=True)) as progress:
        task = progress.add_task("tiers dev cells", total=len(dev) * len(seeds))
        for cell in dev:
            for seed in seeds:
                rate = caps.get((cell.description, seed))
                if rate:
                    rows.append(measure(cell, seed, rate, args.tiers, how))
                progress.advance(task)
    out = RESULTS / f"tiers-reuse-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    doc = {"run": str(args.run), "tiers": args.tiers, "rows": rows}
    (out / "tiers_reuse.json").write_text(json.dumps(doc, indent=1))
    head = ["cell", "seed", "rate", "requests", "prompt blocks", "distinct prefix blocks", "device blocks",
            "device hit rate", f"demoted to {args.tiers}", "loaded back"]
    table = Table(*head)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["cell"], str(r["seed"]), f"{r['rate_rps']:.2f}", str(r["requests"]), str(r["prompt_blocks"]),
                 "-" if r["distinct_prefix_blocks"] is None else str(r["distinct_prefix_blocks"]),
                 str(r["device_blocks"]), f"{r['device_hit_rate']:.1%}", str(r["demoted_blocks"]),
                 str(r["loaded_blocks"])]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    (out / "tiers_reuse.md").write_text("\n".join(lines) + "\n")
    Console(width=200).print(table)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
