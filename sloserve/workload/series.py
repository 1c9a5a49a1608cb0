"""Demand as a time series: what forecasters and autoscalers read.

A `Series` is evenly spaced values (requests/s, or prompt / output tokens/s) from `start_s`.
Sources: ServeGen's total request rate per 10-minute window (14 days for its language models),
or any request trace (Azure, Mooncake, ...) binned into `step_s` windows.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from sloserve.workload.traces import SHARED_FILES, PathLike, load_file, open_text, shared_path
from sloserve.workload.types import WorkloadRequest

METRICS = ("requests", "prompt-tokens", "output-tokens")  # per second
DAY_S = 86400.0


@dataclass(frozen=True)
class Series:
    name: str
    values: np.ndarray  # float64, one per step
    step_s: float
    start_s: float = 0.0  # the first window's start, seconds after some midnight (calendar features)
    unit: str = "req/s"

    def __post_init__(self) -> None:
        if self.step_s <= 0:
            raise ValueError(f"step must be > 0 s, got {self.step_s}")

    def __len__(self) -> int:
        return len(self.values)

    @property
    def steps_per_day(self) -> int:
        return max(1, round(DAY_S / self.step_s))

    def split(self, holdout_steps: int) -> tuple["Series", "Series"]:
        """(training part, held-out last `holdout_steps`) — the held-out part keeps its start time."""
        if not 0 < holdout_steps < len(self):
            raise ValueError(f"hold out between 1 and {len(self) - 1} steps, got {holdout_steps}")
        cut = len(self) - holdout_steps
        return (Series(self.name, self.values[:cut], self.step_s, self.start_s, self.unit),
                Series(self.name, self.values[cut:], self.step_s, self.start_s + cut * self.step_s, self.unit))


def servegen_series(model: str = "m-large", path: Optional[PathLike] = None) -> Series:
    """ServeGen's total request rate of `model` per 10-minute window (m-large, m-mid, m-small: 14
    days; mm-image, deepseek-r1: 1 day). Windows the source lacks are NaN, not zero: those with
    a zero total, those under 1% of the series' median (m-mid has runs of 1-7 req/s inside its
    collection gaps, beside a median of ~1,900: no aggregate of a hundred clients dips so), and
    the windows on either side of a gap, which are partial (11 and 15 req/s in m-mid)."""
    rows: dict[float, float] = {}
    with open_text(path or shared_path("servegen-total")) as f:
        for row in csv.DictReader(f):
            if row["model"] == model:
                rows[float(row["window_start_s"])] = float(row["total_rate_rps"])
    if not rows:
        raise ValueError(f"no ServeGen series for model {model!r} (m-large, m-mid, m-small, mm-image, deepseek-r1)")
    starts = sorted(rows)
    step = min(b - a for a, b in zip(starts, starts[1:])) if len(starts) > 1 else 600.0
    values = np.full(round((starts[-1] - starts[0]) / step) + 1, math.nan)
    for s, v in rows.items():
        values[round((s - starts[0]) / step)] = v if v > 0 else math.nan  # zero totals are gaps in the source
    floor = 0.01 * np.nanmedian(values)
    values[values < floor] = math.nan
    gap = np.isnan(values)
    edges = np.zeros_like(gap)
    edges[1:] |= gap[:-1]
    edges[:-1] |= gap[1:]
    values[edges] = math.nan
    return Series(f"servegen {model}", values, step, starts[0])


def binned(requests: Sequence[WorkloadRequest], step_s: float, metric: str = "requests", name: str = "trace",
           start_s: float = 0.0) -> Series:
    """A request trace as `metric` per second in windows of `step_s` (from its first arrival)."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    if not requests:
        raise ValueError("no requests to bin")
    t0 = min(r.arrival_s for r in requests)
    n = int((max(r.arrival_s for r in requests) - t0) // step_s) + 1
    values = np.zeros(n)
    for r in requests:
        weight = {"requests": 1, "prompt-tokens": r.prompt_len, "output-tokens": r.output_len}[metric]
        values[int((r.arrival_s - t0) // step_s)] += weight
    unit = {"requests": "req/s", "prompt-tokens": "prompt tok/s", "output-tokens": "output tok/s"}[metric]
    return Series(f"{name} {metric}", values / step_s, step_s, start_s, unit)


def load_series(spec: str, metric: str, step_s: float) -> Series:
    """The series a command's `--series` (or `--demand`, `--scaling-history`) names:
    `servegen:MODEL` (`servegen:A+B`: their sum), else a request trace (a shared one by name, or a file) binned into `step_s`
    windows as `metric` per second."""
    if spec.startswith("servegen:"):
        names = spec.split(":", 1)[1].split("+")
        if len(names) == 1:
            return servegen_series(names[0])
        parts = [servegen_series(n) for n in names]  # several services' demand together
        if len({(p.step_s, p.start_s, len(p.values)) for p in parts}) != 1:
            raise ValueError(f"--series {spec!r}: the models' series do not share one time axis")
        return Series(spec, np.sum([p.values for p in parts], axis=0), parts[0].step_s, parts[0].start_s)
    if not step_s > 0:
        raise ValueError(f"--step must be > 0 s, got {step_s}")
    path = shared_path(spec) if spec in SHARED_FILES else Path(spec)
    if not Path(path).is_file():
        raise ValueError(f"--series {spec!r}: not servegen:MODEL, a known trace ({', '.join(sorted(SHARED_FILES))}) "
                         "or a file")
    return binned(load_file(path, source=spec), step_s, metric, name=spec)
