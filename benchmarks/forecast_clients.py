#!/usr/bin/env python3
"""Do per-client ServeGen windows forecast the total better than the last value? A dev-split study.

The forecasting decision's cells (benchmarks/suite/forecasting.yaml) forecast a ServeGen service's
total request rate from the total alone, and nothing there beats naive. Most of naive's large
errors come from one client switching a burst on or off (m-small: one client behind 81-98% of the
change in each of the 25 worst windows), so this study forecasts each client and sums:
- `client-level`: LightGBM on every client's recent rates, its rate a day before the target, its
  median and its day's mean, and the target's time of day; L1 loss (a median), so a burst that
  usually ends is forecast to end;
- `client-change`: the same, predicting the change from the client's last rate (a client that
  holds steady stays where it is);
- `client-mean`: their average.
Each is trained, for each cell, on the days before the cell's day; scored as `sloserve evaluate`
scores forecasters (MAPE and max APE of the forecast `horizon_s` ahead, over every origin of the
day whose target window is known), against naive. Only dev cells are read: this is where a
per-client forecaster would be designed; its claim would be the test split once frozen.

    .venv/bin/python benchmarks/forecast_clients.py [--series m-large,m-mid,m-small] [--horizons 600,1800]
Writes benchmarks/results/forecast-clients-<time>/{forecast_clients.json,forecast_clients.md}.
"""
from __future__ import annotations

import argparse
import csv
import json
from datetime import datetime, timezone
from pathlib import Path

import lightgbm as lgb
import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from sloserve.evaluation.suite import load_grid
from sloserve.workload.series import servegen_series
from sloserve.workload.traces import shared_path
from sloserve.workload.servegen import open_text

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LAGS = 6
VARIANTS = ("naive", "client-level", "client-change", "client-mean")


def client_matrix(model: str, n: int, step_s: float) -> np.ndarray:
    """Steps x clients of ServeGen request rates (0 where a client has no window)."""
    rows: list[tuple[int, int, float]] = []
    with open_text(shared_path("servegen")) as f:
        for row in csv.DictReader(f):
            if row["model"] == model:
                rows.append((int(float(row["window_start_s"]) // step_s), int(row["client_id"]), float(row["rate_rps"])))
    clients = sorted({c for _, c, _ in rows})
    col = {c: i for i, c in enumerate(clients)}
    out = np.zeros((n, len(clients)))
    for t, c, rate in rows:
        if t < n:
            out[t, col[c]] += rate
    return out


def features(x: np.ndarray, last: int, h: int, period: int, median: np.ndarray) -> np.ndarray:
    """Per client, for forecasting step last + h from steps up to `last`."""
    cols = [np.log1p(x[last - k]) for k in range(LAGS)]
    cols += [np.log1p(x[last + h - period]), np.log1p(x[last - period]), np.log1p(median),
             np.log1p(x[last - 11:last + 1].mean(0)), np.log1p(x[last - period + 1:last + 1].mean(0))]
    tod = ((last + h) % period) / period
    cols += [np.full(x.shape[1], np.sin(2 * np.pi * tod)), np.full(x.shape[1], np.cos(2 * np.pi * tod))]
    return np.stack(cols, 1)


def fit(x: np.ndarray, lasts: list[int], h: int, period: int, median: np.ndarray, change: bool, seed: int):
    feats = np.concatenate([features(x, t, h, period, median) for t in lasts])
    target = np.concatenate([x[t + h] - (x[t] if change else 0.0) for t in lasts])
    params = {"objective": "l1", "learning_rate": 0.05, "num_leaves": 31, "seed": seed, "verbose": -1,
              "num_threads": 1}
    return lgb.train(params, lgb.Dataset(feats, target), num_boost_round=200)


def score_cell(total: np.ndarray, x: np.ndarray, day: int, h: int, period: int, seed: int) -> dict[str, dict]:
    """Every variant's MAPE and max APE on one held-out day (origins as cluster/forecast/evaluate.py)."""
    first = day * period
    known = np.isfinite(total) & (total > 0)
    median = np.median(x[:first][known[:first]], 0)
    lasts = [t for t in range(period + 12, first - h) if known[t + h] and known[t]]
    level = fit(x, lasts, h, period, median, False, seed)
    change = fit(x, lasts, h, period, median, True, seed)
    ape: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for origin in range(first, first + period - h + 1):
        last, target = origin - 1, origin + h - 1
        if not known[target]:
            continue
        actual = total[target]
        f = features(x, last, h, period, median)
        lv = float(np.maximum(level.predict(f), 0.0).sum())
        ch = float(np.maximum(x[last] + change.predict(f), 0.0).sum())
        naive = total[last] if known[last] else float(x[last].sum())
        for name, value in zip(VARIANTS, (naive, lv, ch, (lv + ch) / 2)):
            ape[name].append(abs(value - actual) / actual)
    return {v: {"mape": float(np.mean(a)), "max_ape": float(np.max(a)), "origins": len(a)} for v, a in ape.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--series", default="m-large,m-mid,m-small")
    ap.add_argument("--horizons", default="600,1800", help="seconds ahead, as the grid's horizon_s")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    series = args.series.split(",")
    horizons = {float(h) for h in args.horizons.split(",")}
    cells = [c for c in load_grid("forecasting").cells
             if c.split == "dev" and c.params["series"] in series and float(c.params.get("horizon_s", 600)) in horizons]
    console = Console()
    rows = []
    with Progress(console=console) as progress:
        task = progress.add_task("dev cells", total=len(cells))
        for model in series:
            s = servegen_series(model)
            total = np.asarray(s.values, dtype=float)
            x = client_matrix(model, len(total), s.step_s)
            for c in (c for c in cells if c.params["series"] == model):
                h = max(1, round(float(c.params.get("horizon_s", 600)) / s.step_s))
                scores = score_cell(total, x, int(c.params["day"]), h, s.steps_per_day, args.seed)
                rows.append({"cell": c.label, "series": model, "day": c.params["day"], "horizon_s": h * s.step_s,
                             "scores": scores})
                progress.advance(task)
    table = Table(title="per-client forecasters against naive, dev cells (MAPE ratio: naive ÷ variant, geo-mean)")
    for col in ("series", "horizon", "cells", *VARIANTS[1:], "max APE naive / best"):
        table.add_column(col)
    md = ["| series | horizon | cells | " + " | ".join(f"{v}: MAPE ratio, wins" for v in VARIANTS[1:])
          + " | naive MAPE | max APE naive / client-level / client-change / client-mean |",
          "|---|---|---|" + "---|" * (len(VARIANTS) - 1) + "---|---|"]
    for model in series:
        for h in sorted(horizons):
            mine = [r for r in rows if r["series"] == model and r["horizon_s"] == h]
            if not mine:
                continue
            cols = []
            for v in VARIANTS[1:]:
                ratios = [r["scores"]["naive"]["mape"] / r["scores"][v]["mape"] for r in mine]
                geo = float(np.exp(np.mean(np.log(ratios))))
                cols.append(f"{geo:.3f} ({sum(x > 1.03 for x in ratios)}/{len(ratios)})")
            worst = {v: max(r["scores"][v]["max_ape"] for r in mine) for v in VARIANTS}
            naive_mape = float(np.mean([r["scores"]["naive"]["mape"] for r in mine]))
            table.add_row(model, f"{h:g} s", str(len(mine)), *cols,
                          f"{100 * worst['naive']:.0f}% / " + " / ".join(f"{100 * worst[v]:.0f}%" for v in VARIANTS[1:]))
            md.append(f"| {model} | {h:g} s | {len(mine)} | " + " | ".join(cols) + f" | {100 * naive_mape:.1f}% | "
                      + " / ".join(f"{100 * worst[v]:.0f}%" for v in VARIANTS) + " |")
    console.print(table)
    out = RESULTS / f"forecast-clients-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "forecast_clients.json").write_text(json.dumps({"split": "dev", "seed": args.seed, "cells": rows}, indent=1))
    (out / "forecast_clients.md").write_text("\n".join(md) + "\n")
    console.print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
