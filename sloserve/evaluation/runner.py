"""Runs the cells of a split: every (cell, seed) is one job, in a process pool of `jobs` workers
(in this process when jobs is 1); the seeds of a cell are then judged together. Writes
results.json (cells, split, metrics, verdicts, the git commit and the date) into
`<out>/evaluate-<split>-<UTC time>/`. With a checkpoint file, finished jobs are kept as they
finish and restored by the next run (evaluation/checkpoint.py)."""
from __future__ import annotations

import gzip
import json
import subprocess
import time
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from sloserve.evaluation.checkpoint import Checkpoint, job_key
from sloserve.evaluation.decisions import DECISIONS, make_decision, measure_of
from sloserve.evaluation.result import CellResult
from sloserve.evaluation.suite import REPO_ROOT, SPLITS, Cell, cells
from sloserve.core.records import jsonable

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


@dataclass
class Evaluation:
    """One `sloserve evaluate` run."""

    split: str  # dev, test or both
    quick: bool
    seeds: int
    decisions: list[str]
    measures: dict[str, Any]  # decision -> how its cells were measured (its measure_type)
    commit: str
    dirty: bool
    date: str
    cells: list[CellResult] = field(default_factory=list)
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        return jsonable({"suite": "sloserve evaluate", "split": self.split, "quick": self.quick, "seeds": self.seeds,
                         "decisions": self.decisions, "measure": {d: m.as_dict() for d, m in self.measures.items()},
                         "commit": self.commit, "dirty": self.dirty, "date": self.date, "wall_s": self.wall_s,
                         "cells": [c.as_dict() for c in self.cells]})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Evaluation":
        return cls(d["split"], bool(d["quick"]), int(d["seeds"]), list(d["decisions"]),
                   {k: DECISIONS[k].measure_type.parse(v) for k, v in d["measure"].items()}, d["commit"], bool(d["dirty"]), d["date"],
                   [CellResult.from_dict(c, DECISIONS[c["decision"]].metrics_type) for c in d["cells"]], float(d.get("wall_s", 0.0)))

    @classmethod
    def load(cls, path: Path) -> "Evaluation":
        """A run's results.json, or results.json.gz (as benchmarks/suite/runs/ keeps them)."""
        path = Path(path)
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        return cls.from_dict(json.loads(raw))


def git_state(root: Path = REPO_ROOT) -> tuple[str, bool]:
    """(HEAD's commit, whether the work tree differs from it outside the runs' own outputs under
    benchmarks/suite/runs); ("unknown", True) outside a checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", ".", ":!benchmarks/suite/runs"], cwd=root,
                                    capture_output=True, text=True, check=True).stdout.strip())
        return commit, dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown", True


def _job(decision: str, measure: Any, cell: Cell, seed: int) -> dict[str, Any]:
    """One seed of one cell (what a worker process runs)."""
    return make_decision(decision, measure).run(cell, seed)


def planned(decisions: Sequence[str], split: str, quick: bool) -> list[tuple[str, Any, Cell]]:
    """(decision, how it is measured, cell) for every cell of `split` of every decision."""
    out = []
    for name in decisions:
        make_decision(name)  # an unknown name fails before any work
        measure = measure_of(name, quick)
        out.extend((name, measure, c) for c in cells(name, None if split == "both" else split, quick))
    return out


def run_evaluation(decisions: Sequence[str], split: str = "dev", quick: bool = False, seeds: int = 2, jobs: int = 1,
                   on_done: Optional[Callable[[str], None]] = None,
                   checkpoint: Optional[Path] = None) -> Evaluation:
    """Run every cell of `split` of `decisions` with seeds 0..seeds-1 and judge each cell.
    `on_done(label)` is called as each (cell, seed) finishes (or is restored from `checkpoint`:
    see evaluation/checkpoint.py)."""
    if split not in (*SPLITS, "both"):
        raise ValueError(f"--split must be dev, test or both, got {split!r}")
    if seeds < 2:
        raise ValueError(f"--seeds must be >= 2 (a tie is judged against how much the per-seed ratios disagree), got {seeds}")
    if jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    work = planned(decisions, split, quick)
    if not work:
        raise ValueError(f"no {split} cells in the {'quick ' if quick else ''}grid of {', '.join(decisions)}")
    commit, dirty = git_state()
    run = Evaluation(split, quick, seeds, list(decisions), {d: m for d, m, _ in work}, commit, dirty,
                     datetime.now(timezone.utc).isoformat(timespec="seconds"))
    t0 = time.perf_counter()
    kept = Checkpoint(checkpoint) if checkpoint is not None else None
    restored = kept.restore() if kept is not None else {}
    done: dict[tuple[int, int], dict[str, Any]] = {}
    todo: list[tuple[tuple[int, int], str, Any, Cell, int]] = []
    for i, (d, m, c) in enumerate(work):
        for s in range(seeds):
            key = job_key(d, m, c, s)
            if key in restored:
                done[(i, s)] = restored[key]
                if on_done:
                    on_done(f"{d} {c.label} seed {s} (restored)")
            else:
                todo.append(((i, s), d, m, c, s))

    def finished(slot: tuple[int, int], metrics: dict[str, Any]) -> None:
        done[slot] = metrics
        d, m, c = work[slot[0]]
        if kept is not None:
            kept.record(job_key(d, m, c, slot[1]), d, metrics)
        if on_done:
            on_done(f"{d} {c.label} seed {slot[1]}")

    if jobs == 1:
        for slot, d, m, c, s in todo:
            finished(slot, _job(d, m, c, s))
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            futures: dict[Future, tuple[int, int]] = {pool.submit(_job, d, m, c, s): slot for slot, d, m, c, s in todo}
            for f in as_completed(futures):
                finished(futures[f], f.result())
    for i, (d, m, c) in enumerate(work):
        per_seed = [done[(i, s)] for s in range(seeds)]
        metrics = {p: [runs[p] for runs in per_seed] for p in per_seed[0]}
        wall = sum(x.wall_s for runs in per_seed for x in runs.values())
        run.cells.append(CellResult(c, metrics, make_decision(d, m).judge(c, metrics), wall))
    run.wall_s = time.perf_counter() - t0
    return run


def write_results(run: Evaluation, out: Optional[Path] = None) -> Path:
    """results.json in a new `evaluate-<split>-<UTC time>` folder under `out` (benchmarks/results); its path."""
    parent = Path(out) if out is not None else RESULTS_DIR
    stamp = datetime.fromisoformat(run.date).strftime("%Y%m%d-%H%M%S")
    folder = parent / f"evaluate-{run.split}-{stamp}"
    n = 1
    while folder.exists():
        n += 1
        folder = parent / f"evaluate-{run.split}-{stamp}-{n}"
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(run.as_dict(), indent=1))
    return folder
