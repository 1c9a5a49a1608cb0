#!/usr/bin/env python3
"""Heterogeneous models and GPUs (BOute, issue 19 part 2): the routing split between a small and
a large model and their deployment over GPU types, searched jointly by multi-objective Bayesian
optimisation and one after the other, each with the same trials and seeds; the Pareto fronts of
cost vs P95 latency and the comparison at equal cost and equal latency. Runs `sloserve place`.

    python benchmarks/sim_hetero.py                      # the study in BENCHMARKS.md (~30-40 min)
    python benchmarks/sim_hetero.py --quick              # 20 trials, one seed (~3 min)
Writes benchmarks/results/place-STAMP/ and benchmarks/figures/hetero-front.png.
"""
from __future__ import annotations

import argparse
import platform
import shutil
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sloserve.cli import main as sloserve  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rate", default="20")
    p.add_argument("--duration", default="120")
    p.add_argument("--trials", default="80")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--gpus", default="h100-80g=8,a100-80g=8,a10-24g=16")
    args = p.parse_args()
    if args.quick:
        args.trials, args.seeds = "20", "0"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    out = REPO / "benchmarks" / "results" / f"place-{stamp}"
    t0 = time.perf_counter()
    rc = sloserve(["place", "--rate", args.rate, "--duration", args.duration, "--trials", args.trials,
                   "--search-seeds", args.seeds, "--gpus", args.gpus, "--out", str(out)])
    if rc == 0:
        figure = REPO / "benchmarks" / "figures" / "hetero-front.png"
        shutil.copyfile(out / "front.png", figure)
        print(f"{time.perf_counter() - t0:.0f} s on {platform.processor() or platform.machine()}; figure {figure}")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
