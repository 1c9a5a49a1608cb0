"""`sloserve simulate --fidelity fluid`: an autoscaled fleet over days of demand, at flow level.

The discrete simulator walks every request through the schedulers: a day of tens of millions of
requests is out of its reach. The fluid fleet (sim/fluid.py) runs the same controller, scale
planners and instance lifecycle on a demand *rate* (`--demand`, a series as `sloserve forecast
--series` reads), and prices requests with a response curve the discrete simulator measures first
on the workload's own request shapes (`--workload`). What it cannot say (per-request latencies,
queueing inside an instance beyond the curve) the discrete mode can, on shorter windows.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np


def demand_window(series, start_s: float, duration_s: float | None, mean_rps: float | None):
    """(history before the window, the window) of `series`, both scaled so that the window's mean is
    `mean_rps` (None: the series' own values). Missing windows (NaN) read as the series' median."""
    from sloserve.workload.series import Series

    values = np.asarray(series.values, dtype=float)
    if np.isnan(values).all():
        raise ValueError(f"--demand {series.name}: no values")
    values = np.nan_to_num(values, nan=float(np.nanmedian(values)))
    first = round(start_s / series.step_s)
    n = len(values) - first if duration_s is None else math.ceil(duration_s / series.step_s - 1e-9)
    if not 0 <= first < len(values) or n < 1 or first + n > len(values):
        span = len(values) * series.step_s
        raise ValueError(f"--demand {series.name} spans {span / 3600:g} h in steps of {series.step_s:g} s: "
                         f"--start {start_s:g} s with --duration {duration_s} s falls outside it")
    run = values[first:first + n]
    scale = 1.0 if mean_rps is None else mean_rps / max(float(run.mean()), 1e-12)
    start = series.start_s + first * series.step_s
    return (Series("history", values[:first] * scale, series.step_s, series.start_s),
            Series("demand", run * scale, series.step_s, start))


def enough(reqs: list, n: int) -> list:
    """`reqs` (Poisson arrivals) repeated, each copy after the last, until there are `n`: a trace file
    smaller than the curve's highest load needs still gives its request shapes."""
    if not reqs:
        raise ValueError("the workload gave no requests")
    out, offset, k = list(reqs[:n]), 0.0, 0
    span = reqs[-1].arrival_s + 1.0
    while len(out) < n:
        k += 1
        offset += span
        out += [replace(r, arrival_s=r.arrival_s + offset, request_id=f"{r.request_id}~{k}")
                for r in reqs[:n - len(out)]]
    return out


def check_fluid(args: argparse.Namespace, fleet) -> None:
    """ValueError (one line) on what a fluid run cannot take."""
    if not args.slo:
        raise ValueError("--fidelity fluid needs --slo: the response curve prices requests against it")
    if fleet.fleet.autoscale is None or fleet.fleet.pd:
        raise ValueError("--fidelity fluid runs autoscaled colocated fleets: give --autoscale, drop --pd")
    if args.rate is not None and len(args.rate) > 1:
        raise ValueError("--fidelity fluid takes one --rate (the demand window's mean), not a sweep")


def request_shapes(args: argparse.Namespace):
    """The workload as a fluid run reads it: request shapes only, Poisson arrivals from its start
    (the arrival rate is the demand window's)."""
    from sloserve.cli.workload_args import workload_spec_from_args

    return replace(workload_spec_from_args(args), rate=1.0, replay=False, start_s=0.0, duration_s=None,
                   arrival_process="poisson")


def fluid_inputs(args: argparse.Namespace, fleet) -> tuple:
    """(SLO, the workload spec giving request shapes, the demand window) of a fluid run, with the
    demand before the window set on `fleet` as its forecaster's history when it needs one."""
    from sloserve.bench.metrics import SLO
    from sloserve.workload.series import load_series

    if not args.demand:
        raise ValueError("--fidelity fluid needs --demand SERIES (servegen:MODEL or a trace): the request rate to run")
    check_fluid(args, fleet)
    series = load_series(args.demand[0], "requests", 600.0)
    history, run = demand_window(series, args.start, args.duration, args.rate[0] if args.rate else None)
    spec = request_shapes(args)
    if args.scaling_history is None and fleet.fleet.autoscale in ("predictive", "hybrid"):
        if len(history) < 2:
            raise ValueError("predictive/hybrid need demand before the window: a later --start, or --scaling-history")
        fleet.scaling_history = history  # the demand before the window, scaled as the window is
        fleet.demand_step_s = min(fleet.demand_step_s, history.step_s)
    if fleet.fleet.autoscale == "oracle":
        fleet.scaling_future = run  # the yardstick knows the demand it is given: a user's own series included
    return SLO.parse(args.slo), spec, run


def run_fluid(args: argparse.Namespace, fleet, spec, run, slo, console) -> tuple[dict, str, str]:
    """Measure the response curve, run the fleet on the demand window, write fluid.json. Returns the
    record, a title and a one-paragraph summary. `fleet` has its capacity (simulate.prepare_autoscaling)."""
    from sloserve.simulation import build_fluid

    fs = fleet.fleet
    capacity = float(fs.capacity_rps)
    curve = measure_curve(fleet, spec, slo, console)
    wall0 = time.perf_counter()
    result = build_fluid(fleet, curve, slo.ttft_s, seed=args.seed).run(run.values, run.step_s)
    wall = time.perf_counter() - wall0
    sc = result.scaling
    hours = len(run) * run.step_s / 3600
    peak_need = math.ceil(float(run.values.max()) / (capacity * fs.target_utilization))
    record = {
        "fidelity": "fluid", "demand": args.demand[0], "start_s": args.start, "duration_s": hours * 3600,
        "mean_rps": float(run.values.mean()), "peak_rps": float(run.values.max()), "workload": spec.name,
        "slo": args.slo, "model": fleet.model, "hardware": fleet.hardware, "tp": fleet.tp,
        "autoscale": fs.autoscale, "forecaster": fs.forecaster if fs.autoscale in ("predictive", "hybrid")
        else None, "min_instances": fs.fewest, "max_instances": fs.instances,
        "cold_start_s": fleet.cold_start_s, "target_utilization": fs.target_utilization,
        "capacity_rps": capacity, "response_curve": curve.as_dict(),
        "requests": result.requests, "attainment": result.attainment, "unserved": result.unserved,
        "instance_hours": sc["instance_hours"], "gpu_hours": sc["instance_hours"] * fleet.tp,
        "static_peak_instance_hours": peak_need * hours, "cold_starts": sc["cold_starts"],
        "warm_starts": sc["warm_starts"], "scaling": sc, "windows": result.windows, "wall_s": wall,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "fluid.json").write_text(json.dumps(record, indent=1))
    label = (f"fluid · {fs.autoscale} · {args.demand[0]} ({hours:g} h, mean {record['mean_rps']:.1f} req/s) · "
             f"{fleet.model} on {fleet.hardware} · cold start {fleet.cold_start_s:g} s")
    peak = max((row[1] for row in sc["timeline"]), default=0)
    summary = (f"{sc['instance_hours']:.2f} instance-hours ({sc['instance_hours'] / max(1e-9, peak_need * hours):.3f}x "
               f"static at the peak's {peak_need} instances), SLO attainment {100 * result.attainment:.3f}% of "
               f"{result.requests:,.0f} requests ({result.unserved:,.0f} unserved at the end); {sc['cold_starts']} "
               f"cold + {sc['warm_starts']} warm starts, peak {peak} ready; {wall:.1f} s of wall time")
    return record, label, summary


def measure_curve(fleet, spec, slo, console):
    """The response curve (planning.response_curve) of `fleet`'s instances on `spec`'s request shapes."""
    from sloserve.planning import CURVE_DURATION_S, CURVE_INSTANCES, CURVE_LOADS, response_curve
    from sloserve.workload.build import build_stream

    capacity = float(fleet.fleet.capacity_rps)
    need = math.ceil(max(CURVE_LOADS) * capacity * CURVE_INSTANCES * CURVE_DURATION_S * 1.05)
    console.print(f"response curve: {CURVE_INSTANCES} instances at {len(CURVE_LOADS)} loads, {CURVE_DURATION_S:g} s "
                  f"each ({need} requests of {spec.name}) ...")
    return response_curve(enough(build_stream(replace(spec, num_requests=need)), need), fleet, slo, capacity)


def parse_services(values) -> list[tuple[str, str]]:
    """`--demand NAME=SERIES` values as (name, series); every one named, each name once."""
    out = []
    for value in values or ():
        name, sep, series = value.partition("=")
        if not sep or not name or not series:
            raise ValueError(f"--demand {value!r}: with several services, give each as NAME=SERIES")
        out.append((name, series))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError("--demand: each service's name once")
    if not out:
        raise ValueError("--budget shares instances among services: give each as --demand NAME=SERIES")
    return out


def simulate_services(args: argparse.Namespace, fleet, prepare_autoscaling) -> int:
    """`simulate --fidelity fluid --demand A=SERIES --demand B=SERIES [--budget N]`: each service its
    own pool of `fleet` (its own autoscaler; predictive ones trained on that service's own history),
    stepped together (sim/services.py); writes services.json with each service's books.
    `prepare_autoscaling`: simulate's, which measures the capacity of one instance when not given."""
    from rich.console import Console
    from rich.table import Table

    from sloserve.bench.metrics import SLO
    from sloserve.sim.services import ServiceFleets
    from sloserve.simulation import build_fluid
    from sloserve.workload.series import load_series

    services = parse_services(args.demand)
    check_fluid(args, fleet)
    if args.budget is not None and args.budget < 1:
        raise ValueError(f"--budget must be >= 1 instance, got {args.budget}")
    windows = {name: demand_window(load_series(series, "requests", 600.0), args.start, args.duration, None)
               for name, series in services}
    steps = {w.step_s for _, w in windows.values()}
    if len(steps) != 1:
        raise ValueError("the services' demand series must share one step")
    if args.rate:  # the services' mean together becomes --rate, each keeping its share
        scale = args.rate[0] / max(sum(float(w.values.mean()) for _, w in windows.values()), 1e-12)
        windows = {n: (replace(h, values=h.values * scale), replace(w, values=w.values * scale))
                   for n, (h, w) in windows.items()}
    slo = SLO.parse(args.slo)
    spec = request_shapes(args)
    console = Console(stderr=True)
    console.print(f"capacity of one {fleet.model} instance on {fleet.hardware} at {args.slo} ...")
    fleet = prepare_autoscaling(fleet, args, spec, slo)
    fleet.validate()
    curve = measure_curve(fleet, spec, slo, console)
    fleets = {}
    for i, (name, (history, window)) in enumerate(windows.items()):
        own = replace(fleet)
        if own.fleet.autoscale == "oracle":
            own.scaling_future = window  # this service's own demand, known in advance
        if own.fleet.autoscale in ("predictive", "hybrid") and args.scaling_history is None:
            if len(history) < 2:
                raise ValueError("predictive/hybrid need each service's demand before the window: a later --start")
            own.scaling_history = history  # this service's own past: its forecaster is its own
            own.demand_step_s = min(own.demand_step_s, history.step_s)
        fleets[name] = build_fluid(own, curve, slo.ttft_s, seed=args.seed + i)
    step_s = steps.pop()
    wall0 = time.perf_counter()
    result = ServiceFleets(fleets, args.budget).run({n: w.values for n, (_, w) in windows.items()}, step_s)
    wall = time.perf_counter() - wall0
    record = {"fidelity": "fluid", "demand": {n: s for n, s in services}, "budget": args.budget,
              "start_s": args.start, "duration_s": len(next(iter(windows.values()))[1]) * step_s,
              "workload": spec.name, "slo": args.slo, "model": fleet.model, "hardware": fleet.hardware,
              "autoscale": fleet.fleet.autoscale, "capacity_rps": float(fleet.fleet.capacity_rps),
              "response_curve": curve.as_dict(), "wall_s": wall, **result.as_dict()}
    record["timelines"] = {name: r.scaling["timeline"] for name, r in result.services.items()}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "services.json").write_text(json.dumps(record, indent=1))
    table = Table(title=f"{len(services)} services · {fleet.fleet.autoscale} · budget "
                        f"{args.budget if args.budget is not None else 'none'} · {fleet.model} on {fleet.hardware}")
    for column in ("service", "demand", "requests", "SLO attainment", "instance-hours", "cold starts"):
        table.add_column(column, justify="right")
    books = result.as_dict()["services"]
    for name, series in services:
        b = books[name]
        table.add_row(name, series, f"{b['requests']:,.0f}", f"{100 * b['attainment']:.3f}%",
                      f"{b['instance_hours']:.2f}", str(b["cold_starts"]))
    table.add_row("all", "", f"{sum(b['requests'] for b in books.values()):,.0f}",
                  f"{100 * result.attainment:.3f}%", f"{result.instance_hours:.2f}",
                  str(sum(b["cold_starts"] for b in books.values())))
    Console().print(table)
    console.print(f"wrote {out_dir / 'services.json'}")
    return 0
