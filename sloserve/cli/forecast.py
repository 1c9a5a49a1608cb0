"""`sloserve forecast`: train demand forecasters on all but the last days of a series, score them
on those days (MAPE, max APE, coverage of the band) and draw what they predicted.

Series: `servegen:MODEL` (ServeGen's total request rate per 10 minutes, 14 days for m-large,
m-mid, m-small) or a request trace (`azure-code`, `azure-conv`, `mooncake-conv`, or a file)
binned into `--step` windows as requests, prompt tokens or output tokens per second."""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODELS = "naive,seasonal-naive,holt-winters,gbm"


def add_forecast_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("forecast", help="train and score demand forecasters on held-out days (autoscaling input)")
    p.add_argument("--series", default="servegen:m-large",
                   help="servegen:MODEL (m-large, m-mid, m-small, ...) or a trace: azure-code, azure-conv, "
                        "mooncake-conv or a file (default: %(default)s)")
    p.add_argument("--metric", default="requests", choices=["requests", "prompt-tokens", "output-tokens"],
                   help="what a trace is binned into, per second (ServeGen series are requests)")
    p.add_argument("--step", type=float, default=60.0, metavar="S", help="bin width for a trace (default 60 s)")
    p.add_argument("--models", default=DEFAULT_MODELS, help="forecasters to score (default: %(default)s)")
    p.add_argument("--horizon", type=float, default=600.0, metavar="S",
                   help="how far ahead to forecast; scored at that step (default 600 s, PreServe's)")
    p.add_argument("--holdout", type=float, default=2 * 86400.0, metavar="S",
                   help="the last S seconds are held out and scored (default two days)")
    p.add_argument("--level", type=float, default=0.9, help="nominal coverage of the band (default 0.9)")
    p.add_argument("--out", type=Path, help="write forecast.json and forecast.png here")
    p.set_defaults(func=cmd_forecast)


def cmd_forecast(args: argparse.Namespace) -> int:
    import math

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from sloserve.cluster.forecast import FORECASTERS, make_forecaster
    from sloserve.cluster.forecast.evaluate import evaluate
    from sloserve.workload.series import load_series

    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in FORECASTERS]
    if unknown or not names:
        raise ValueError(f"unknown forecaster(s) {unknown}; choose from {sorted(FORECASTERS)}")
    if not 0 < args.level < 1:
        raise ValueError(f"--level must be in (0, 1), got {args.level}")
    series = load_series(args.series, args.metric, args.step)
    horizon = max(1, math.ceil(args.horizon / series.step_s - 1e-9))
    holdout = round(args.holdout / series.step_s)
    if not horizon <= holdout < len(series) // 2:
        raise ValueError(f"{series.name}: {len(series)} steps of {series.step_s:g} s; hold out between the horizon "
                         f"({horizon} steps) and half the series, got {holdout} steps (--holdout {args.holdout:g})")
    train, test = series.split(holdout)
    console = Console()
    scores = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        for name in names:
            task = progress.add_task(f"{name}: train, then forecast each held-out step", total=None)
            forecaster = make_forecaster(name, series.step_s, series.start_s, args.level)
            scores.append(evaluate(forecaster, train, test, horizon,
                                   on_step=lambda i, n, t=task: progress.update(t, completed=i, total=n)))
    table = Table(title=f"{series.name} ({series.unit}), {len(train)} steps of {series.step_s:g} s to train, "
                        f"{len(test)} held out; forecast {horizon * series.step_s:g} s ahead")
    for col in ("forecaster", "MAPE", "p95 APE", "max APE", f"band coverage (nominal {args.level:.0%})",
                "band width / actual"):
        table.add_column(col, justify="right")
    for s in scores:
        table.add_row(s.name, f"{s.mape:.1%}", f"{s.p95_ape:.1%}", f"{s.max_ape:.1%}", f"{s.coverage:.1%}",
                      f"{s.band_width:.2f}")
    console.print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {"series": series.name, "unit": series.unit, "step_s": series.step_s, "horizon_steps": horizon,
                   "train_steps": len(train), "holdout_steps": len(test), "level": args.level,
                   "scores": [s.as_dict() for s in scores],
                   "holdout": {"start_s": test.start_s, "actual": [_num(v) for v in scores[0].actual],
                               **{s.name: {"mean": s.mean, "lo": s.lo, "hi": s.hi} for s in scores}}}
        (args.out / "forecast.json").write_text(json.dumps(payload, indent=1))
        plot(series, test, scores, horizon, args.out / "forecast.png")
        console.print(f"wrote {args.out / 'forecast.json'} and {args.out / 'forecast.png'}")
    return 0


def _num(v: float):
    return None if v != v else v  # NaN -> null


def plot(series, test, scores, horizon: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(scores), 1, figsize=(12, 2.4 * len(scores)), sharex=True, layout="constrained")
    axes = [axes] if len(scores) == 1 else list(axes)
    for ax, s in zip(axes, scores):
        hours = [(test.start_s + (i + horizon - 1) * series.step_s) / 3600 for i in range(len(s.actual))]
        ax.fill_between(hours, s.lo, s.hi, alpha=0.25, label=f"{s.level:.0%} band")
        ax.plot(hours, s.actual, color="black", linewidth=0.8, label="actual")
        ax.plot(hours, s.mean, linewidth=0.9, label=f"{s.name} (MAPE {s.mape:.1%}, max APE {s.max_ape:.0%})")
        ax.set_ylabel(series.unit)
        ax.legend(fontsize="small", loc="upper left")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("hours since the series' first midnight")
    fig.suptitle(f"{series.name}: forecasts {horizon * series.step_s:g} s ahead on held-out data")
    fig.savefig(path, dpi=110)
    plt.close(fig)
