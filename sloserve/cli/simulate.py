"""`sloserve simulate`: a fleet on modelled hardware, with `sloserve bench`'s workloads and reports."""
from __future__ import annotations

import argparse
import gc
import math
import time
from dataclasses import replace
from pathlib import Path


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    from sloserve.cli.workload_args import add_workload_args

    p = sub.add_parser("simulate", help="simulate a fleet running the real schedulers on modelled hardware")
    add_fleet_args(p)
    add_workload_args(p)
    r = p.add_argument_group("results")
    r.add_argument("--slo", help="targets in ms, e.g. ttft=500,tpot=50,e2e=10000")
    r.add_argument("--out", default="sim-out", metavar="DIR",
                   help="results.json, report.md, PNGs, report.html (the fleet over time) and fleet.yaml (the "
                        "controller's settings, for `sloserve serve --fleet`) go here")
    r.add_argument("--timeline-interval", type=float, default=None, metavar="S",
                   help="simulated seconds between two frames of report.html (default: about 600 frames per run)")
    r.add_argument("--token-gaps", action="store_true",
                   help="keep every request's gaps between tokens, so the results have ITL like a real run's "
                        "(memory grows with output tokens)")
    r.add_argument("--no-progress", action="store_true")
    d = p.add_argument_group("fidelity")
    d.add_argument("--fidelity", choices=["discrete", "fluid"], default="discrete",
                   help="discrete: every request through the simulated schedulers; fluid: an autoscaled fleet over "
                        "hours or days of --demand at flow level, requests priced by a response curve the discrete "
                        "simulator measures first on --workload's request shapes (writes fluid.json, scaling.png)")
    d.add_argument("--demand", metavar="SERIES|NAME=SERIES", action="append",
                   help="fluid: the request rate over time, servegen:MODEL or a trace (as `sloserve forecast "
                        "--series`); --start/--duration pick the window, --rate R scales it to a mean of R req/s; "
                        "predictive/hybrid train on what comes before the window unless --scaling-history is given. "
                        "Repeat as NAME=SERIES for several services, each its own pool (writes services.json)")
    d.add_argument("--budget", type=int, metavar="N",
                   help="fluid, several services: the most instances all their pools hold together (default: no "
                        "limit); a round's wants beyond it go where they keep the most requests within the SLO")
    p.set_defaults(func=cmd_simulate)


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from sloserve.cli.workload_args import add_workload_args
    from sloserve.planning import SUSTAIN_S

    p = sub.add_parser("plan", help="the best prefill/decode split (and pool settings) for a workload and SLO, "
                                    "against the best colocated fleet, on the simulator")
    add_fleet_args(p)
    add_workload_args(p)
    g = p.add_argument_group("plan")
    g.add_argument("--gpus", type=int, required=True, help="devices to place (colocated: --gpus / --tp instances)")
    g.add_argument("--slo", required=True, help="targets in ms, e.g. ttft=500,tpot=25 (goodput counts requests "
                   "meeting all of them)")
    g.add_argument("--prefill-pools", default="", metavar="SPEC;SPEC",
                   help="prefill pool settings to try, ';'-separated (each as --pd-prefill; default: the fleet's)")
    g.add_argument("--decode-pools", default="", metavar="SPEC;SPEC", help="decode pool settings to try, as above")
    g.add_argument("--iters", type=int, default=3, help="bisection steps of each goodput search")
    g.add_argument("--sustain", type=float, default=SUSTAIN_S, metavar="S",
                   help="hold each rate tried for at least S seconds of arrivals (default %(default)g: a rate 2%% "
                        "past capacity fails a 1 s TTFT): more of the workload (up to --max-requests), not the same "
                        "requests squeezed, which a loose TTFT absorbs as one burst. A rate the sample cannot hold "
                        "that long is not credited: the row is then a lower bound (marked >=). 0: the workload as "
                        "given, squeezed to each rate (rows it held under %(default)g s are marked !)")
    g.add_argument("--max-requests", type=int, default=20000,
                   help="most requests per rate tried (with --sustain S: rates up to N / S req/s can be shown)")
    g.add_argument("--out", default="plan-out", metavar="DIR", help="plan.json and plan.png go here")
    g.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_plan)


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    """The fleet controller's options (fleet_args.py, shared with `serve`), then what a
    simulated fleet adds: hardware, model, links, instance scheduling, tiers, energy, ..."""
    from sloserve.cli.fleet_args import add_fleet_spec_args
    from sloserve.core.config import PREEMPTION_VICTIMS
    from sloserve.sched.policies import POLICIES
    from sloserve.sim.catalog import MODELS
    from sloserve.sim.hardware import DEFAULT_LINK, HARDWARE, LINKS

    add_fleet_spec_args(p)
    f = p.add_argument_group("simulated fleet")
    f.add_argument("--hardware", default="h100-80g", help=f"one of {sorted(HARDWARE)}")
    f.add_argument("--model", default="llama-3.1-8b", help=f"one of {sorted(MODELS)}")
    f.add_argument("--tp", type=int, default=1, help="tensor-parallel degree per instance")
    f.add_argument("--no-online-predictor", action="store_true", help="do not learn from completed requests")
    f.add_argument("--link", default=DEFAULT_LINK, help=f"link KV migrates over between instances: one of {sorted(LINKS)}")
    f.add_argument("--scheduler", default="fcfs", help=f"instance scheduling policy: one of {sorted(POLICIES)}")
    f.add_argument("--profile", help="price steps with a `sloserve profile` file instead of the roofline model")
    f.add_argument("--max-num-batched-tokens", type=int, default=2048)
    f.add_argument("--max-num-seqs", type=int, default=256)
    f.add_argument("--block-size", type=int, default=16)
    f.add_argument("--num-blocks", type=int, help="KV blocks per instance (default: what device memory leaves)")
    f.add_argument("--no-prefix-caching", action="store_true")
    f.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap", "auto"],
                   help="preempt by recompute, swap to host memory, or per victim by cost (auto)")
    f.add_argument("--preemption-victim", default=PREEMPTION_VICTIMS[0], choices=PREEMPTION_VICTIMS,
                   help="under memory pressure preempt the request with the most SLO slack (default; it then sits out "
                        "half of it), or the lowest-ranked one (rank)")
    f.add_argument("--swap-space", type=float, default=4.0, metavar="GIB",
                   help="host memory per device for swapped-out KV (with --preemption-mode swap/auto)")
    f.add_argument("--no-fast-forward", action="store_true", help="one event per step (slower, same decisions)")
    t = p.add_argument_group("KV tiers (the prefix cache below device memory)")
    t.add_argument("--kv-host-gib", type=float, default=0.0, metavar="GIB",
                   help="host memory per instance for cached blocks evicted from the device")
    t.add_argument("--kv-disk-gib", type=float, default=0.0, metavar="GIB", help="local NVMe per instance")
    t.add_argument("--kv-write-through", action="store_true",
                   help="with host and disk tiers, write every evicted block to the disk at once (default: write-back)")
    t.add_argument("--kv-store-gib", type=float, default=0.0, metavar="GIB",
                   help="a shared KV store every instance reaches (fleet-wide size)")
    t.add_argument("--kv-store-link", default=DEFAULT_LINK, help=f"link to the shared store: one of {sorted(LINKS)}")
    from sloserve.sched.clocks import CLOCK_POLICIES

    e = p.add_argument_group("energy")
    e.add_argument("--clock-policy", metavar="POLICY",
                   help=f"lock each step's SM clock and book the fleet's energy: one of {sorted(CLOCK_POLICIES)} "
                        "(max: the baseline; slo-slack: spend SLO slack on lower clocks)")
    from sloserve.cluster.experts import EXPERT_PLACERS

    x = p.add_argument_group("mixture-of-experts placement (each instance: an expert-parallel group of --tp GPUs)")
    x.add_argument("--experts", metavar="POLICY", help=f"place the experts: one of {sorted(EXPERT_PLACERS)}")
    x.add_argument("--expert-skew", type=float, default=0.6,
                   help="spread of the experts' log-popularity per layer (0: every expert equally popular)")
    x.add_argument("--expert-drift", type=float, default=1800.0, metavar="S",
                   help="time constant of the popularity's drift (0: fixed popularity)")
    x.add_argument("--expert-interval", type=float, default=600.0, metavar="S", help="how often rebalance re-places")
    x.add_argument("--expert-redundant", type=int, default=1,
                   help="extra expert copies per GPU per layer (replicate-hot, rebalance)")
    x.add_argument("--expert-offload", type=float, default=0.25,
                   help="share of each layer's experts offload-cold keeps in host memory")
    from sloserve.cluster.stages import STAGE_POLICIES

    g = p.add_argument_group("pipeline parallelism (each instance: --pp stages of --tp GPUs)")
    g.add_argument("--pp", type=int, default=1, help="pipeline stages per instance (default 1: none)")
    g.add_argument("--stages", default="even", metavar="POLICY",
                   help=f"how the layers are split over the stages: one of {sorted(STAGE_POLICIES)} (even: the "
                        "engine default; profiled: balanced once for a decode step; dynamic: re-split when the "
                        "stages stay unbalanced)")
    g.add_argument("--stage-window", type=float, default=30.0, metavar="S", help="dynamic: window of stage times")
    g.add_argument("--stage-threshold", type=float, default=0.05,
                   help="dynamic: re-split when the slowest stage is this much slower than the best split's")
    g.add_argument("--stage-link", default="nvlink-h100", help=f"link between stages: one of {sorted(LINKS)}")
    a = p.add_argument_group("autoscaling (simulated instances)")
    a.add_argument("--cold-start", type=float, default=120.0, metavar="S", help="start to ready, weights from storage")
    a.add_argument("--warm-start", type=float, metavar="S",
                   help="start to ready when the weights are still in host memory (with --keep-alive)")
    a.add_argument("--keep-alive", type=float, default=0.0, metavar="S",
                   help="how long a stopped instance's weights stay in host memory (a warm pool)")


def fleet_config_from_args(args: argparse.Namespace):
    from sloserve.cli.fleet_args import spec_from_args
    from sloserve.core.config import PREEMPTION_VICTIMS, CacheConfig, SchedulerConfig
    from sloserve.sim.hardware import DEFAULT_LINK
    from sloserve.simulation import FleetConfig

    spec = getattr(args, "fleet_spec", None) or spec_from_args(args)
    spec.validate()
    return FleetConfig(
        spec, hardware=args.hardware, model=args.model, tp=args.tp,
        scheduler=SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                                  policy=args.scheduler, preemption_mode=args.preemption_mode,
                                  preemption_victim=getattr(args, "preemption_victim", PREEMPTION_VICTIMS[0])),
        cache=CacheConfig(block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
                          swap_space_gib=args.swap_space, host_tier_gib=getattr(args, "kv_host_gib", 0.0),
                          disk_tier_gib=getattr(args, "kv_disk_gib", 0.0),
                          tier_write_back=not getattr(args, "kv_write_through", False)),
        kv_store_gib=getattr(args, "kv_store_gib", 0.0), kv_store_link=getattr(args, "kv_store_link", DEFAULT_LINK),
        profile=args.profile, num_blocks=args.num_blocks, fast_forward=not args.no_fast_forward,
        online_predictor=not args.no_online_predictor, link=args.link,
        cold_start_s=getattr(args, "cold_start", 120.0), warm_start_s=getattr(args, "warm_start", None),
        keep_alive_s=getattr(args, "keep_alive", 0.0),
        clock_policy=getattr(args, "clock_policy", None), experts=getattr(args, "experts", None),
        expert_skew=getattr(args, "expert_skew", 0.6), expert_drift_s=getattr(args, "expert_drift", 1800.0),
        expert_interval_s=getattr(args, "expert_interval", 600.0),
        expert_redundant=getattr(args, "expert_redundant", 1), expert_offload=getattr(args, "expert_offload", 0.25),
        pp=getattr(args, "pp", 1), stages=getattr(args, "stages", "even"),
        stage_window_s=getattr(args, "stage_window", 30.0), stage_threshold=getattr(args, "stage_threshold", 0.05),
        stage_link=getattr(args, "stage_link", "nvlink-h100"))


def cmd_simulate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markdown import Markdown
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from sloserve.bench.metrics import SLO, slo_checker, summarize
    from sloserve.bench.report import fmt_rate, run_markdown, sweep_markdown
    from sloserve.bench.result import BenchResult
    from sloserve.bench.runner import class_slos, write_outputs
    from sloserve.cli.workload_args import resolve_rates, workload_spec_from_args
    from sloserve.simulation import build_fleet, make_predictions, sim_requests, simulate
    from sloserve.timeline import FleetTimeline
    from sloserve.workload.build import build_stream

    if args.fidelity == "fluid":
        return simulate_fluid(args)
    if args.demand or args.budget is not None:
        raise ValueError("--demand and --budget are the fluid fleet's: add --fidelity fluid (a discrete run's "
                         "arrivals come from --workload and --rate)")
    spec = workload_spec_from_args(args)
    rates = resolve_rates(args, spec)
    fleet = fleet_config_from_args(args)
    fs = fleet.fleet  # the controller's side
    slo = SLO.parse(args.slo) if args.slo else SLO()
    if fs.autoscale is not None:
        fleet = prepare_autoscaling(fleet, args, spec, slo)
        fs = fleet.fleet
    fleet.validate()
    build_fleet(fleet, make_predictions(fleet))  # fail on bad names (and a bad predictor file) before any work
    classes = {c.name: c.qos for c in spec.mix.classes} if spec.mix else {}
    console = Console(stderr=True)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("sim {task.fields[sim_time]:.1f} s"), TimeElapsedColumn(), console=console,
                        disable=args.no_progress)
    results = []
    with progress:
        for rate in rates:
            run_spec = spec if rate is None else replace(spec, rate=rate, replay=False)
            stream = build_stream(run_spec)
            gc.freeze()  # the workload is only read from here on: spare the collector re-walking it
            desc = f"rate {fmt_rate(rate)}" if rate is not None else ("replay" if run_spec.replay else "burst")
            task = progress.add_task(desc, total=len(stream), sim_time=0.0)
            predictions = make_predictions(fleet)
            sim = build_fleet(fleet, predictions)
            timeline = FleetTimeline(timeline_interval(args.timeline_interval, stream), "simulated",
                                     max_frames=1_000_000, max_events=100_000)
            timeline.meta.update(model=fleet.model, hardware=fleet.hardware, instances=fs.instances,
                                 router=fs.router, workload=run_spec.name, rate=fmt_rate(rate))
            met = slo_checker(slo, class_slos(spec.mix))
            wall0 = time.perf_counter()
            records, result = simulate(
                sim, sim_requests(stream, classes, predictions, token_gaps=args.token_gaps),
                on_progress=lambda t, n: progress.update(task, completed=n, sim_time=t), predictions=predictions,
                timeline=timeline, met=met)
            wall = time.perf_counter() - wall0
            summary = summarize(records, None, slo, class_slos(spec.mix))
            config = {
                "simulated": True, "workload": run_spec.name, "rate": fmt_rate(rate), "replay": run_spec.replay,
                "instances": fs.instances, "hardware": fleet.hardware, "model": fleet.model, "tp": fleet.tp,
                "router": fs.router, "predictor": fs.resolved_predictor, "scheduler": fleet.scheduler.policy,
                "profile": fleet.profile, "migration": fs.migration, "link": fleet.link,
                "pd": fs.pd_text, "pd_transfer": fs.pd_transfer,
                "mixed_handoff": fs.mixed_handoff, "prefill_pool": vars(fs.prefill_pool),
                "decode_pool": vars(fs.decode_pool), "autoscale": fs.autoscale,
                "min_instances": fs.fewest if fs.autoscale else None,
                "capacity_rps": fs.capacity_rps, "cold_start_s": fleet.cold_start_s if fs.autoscale else None,
                "pd_min": "{}:{}".format(*(low for low, _ in fs.pool_bounds.values()))
                if fs.pd and fs.autoscale else None,
                "pd_capacity": fs.pd_capacity, "clock_policy": fleet.clock_policy, "experts": fleet.experts,
                "pp": fleet.pp, "stages": fleet.stages if fleet.pp > 1 else None,
                "kv_tiers": {"host_gib": fleet.cache.host_tier_gib, "disk_gib": fleet.cache.disk_tier_gib,
                             "store_gib": fleet.kv_store_gib},
            }
            outcome = {
                "num_requests": len(stream), "completed": result.num_finished, "rejected": len(stream) - result.num_finished,
                "migrations": result.migration, "handoffs": result.handoffs, "scaling": result.scaling,
                "energy": energy_report(result.energy, records), "expert_books": result.experts,
                "expert_weights_gb": [i.cost_model.weight_bytes() / 1e9 for i in sim.instances] if fleet.experts else None,
                "stage_books": result.stages, "kv_blocks": [i.kv.pool.num_blocks for i in sim.instances],
                "preemptions": sum(i.scheduler.stats.num_preemptions for i in sim.instances),
                "prefix_hit_rate": (sum(i.kv.stats.hits for i in sim.instances)
                                    / max(1, sum(i.kv.stats.queries for i in sim.instances))),
                "tier_loads": {"loads": sum(i.scheduler.stats.num_tier_loads for i in sim.instances),
                               "prefetches": sum(i.scheduler.stats.num_tier_prefetches for i in sim.instances)},
                "sim_end_s": result.end_time, "wall_s": wall, "events": result.num_events,
                "speedup_vs_real_time": result.end_time / wall if wall > 0 else None,
            }
            label = f"sim {fs.instances}x {fleet.model} on {fleet.hardware} · {run_spec.name} · {desc}"
            results.append(BenchResult(label, summary, records, rate, config, timeline=timeline.to_dict(),
                                       outcome=outcome))
    paths = write_outputs(results, Path(args.out))
    paths.append(write_fleet_file(fs, Path(args.out)))
    if fs.autoscale is not None:
        paths.append(plot_scaling(results, Path(args.out) / "scaling.png"))
    out = Console()
    if len(results) > 1:
        out.print(Markdown(sweep_markdown(results)))
    for r in results:
        out.print(Markdown(run_markdown(r)))
        c = {**r.config, **r.outcome}
        out.print(f"completed {c['completed']}/{c['num_requests']} requests; simulated {c['sim_end_s']:.1f} s "
                  f"in {c['wall_s']:.1f} s of wall time ({c['speedup_vs_real_time'] or 0:.0f}x real time); "
                  f"{c['preemptions']} preemptions")
        sc = c.get("scaling")
        if sc:
            peak = max((row[1] for row in sc["timeline"]), default=0)
            if c["pd"]:
                (p_cap, d_cap), hours = c["pd_capacity"], sc["pool_instance_hours"]
                sizes = (f"prefill {c['pd_min'].split(':')[0]}-{c['pd'].split(':')[0]} at {p_cap:.2f} req/s each, "
                         f"decode {c['pd_min'].split(':')[1]}-{c['pd'].split(':')[1]} at {d_cap:.2f}")
                split = f" (prefill {hours['prefill']:.2f}, decode {hours['decode']:.2f})"
            else:
                sizes = f"{c['min_instances']}-{c['instances']} instances, {c['capacity_rps']:.2f} req/s each"
                split = ""
            out.print(f"autoscaling ({c['autoscale']}, {sizes}, cold start {c['cold_start_s']:g} s): "
                      f"{sc['instance_hours']:.2f} instance-hours{split}, {sc['cold_starts']} cold + "
                      f"{sc['warm_starts']} warm starts, {sc['drained']} drained, peak {peak} ready")
        h = c.get("handoffs")
        if h:
            who = f"P/D {c['pd']}" if c["pd"] else f"mixed hand-off ({c.get('mixed_handoff')})"
            out.print(f"{who} ({c['pd_transfer']} over {c['link']}): {h['completed']} hand-offs, "
                      f"{h['aborted']} aborted; {h['bytes'] / 1e9:.2f} GB of KV, mean wait "
                      f"{1e3 * h['downtime_s'] / max(1, h['completed']):.1f} ms per hand-off")
        en = c.get("energy")
        if en:
            pc, dc = en["prefill_mean_clock"], en["decode_mean_clock"]
            out.print(f"energy ({c['clock_policy']} clock): {en['total_j'] / 3.6e6:.3f} kWh, "
                      f"{en['joules_per_request']:.1f} J per request, {en['joules_per_output_token']:.3f} J per "
                      f"output token ({en['idle_j'] / max(en['total_j'], 1e-12):.0%} idle); mean clock prefill "
                      f"{'-' if pc is None else f'{pc:.0%}'}, decode {'-' if dc is None else f'{dc:.0%}'}")
        if c.get("experts"):
            x = c["expert_books"][0]
            out.print(f"experts ({c['experts']}): mean straggler {x['mean_straggler']:.2f}x an even share, "
                      f"{x['replacements']} re-placements moving {x['moved_bytes'] / 1e9:.1f} GB "
                      f"({x['stall_s']:.2f} s stalled), {x['fetched_bytes'] / 1e9:.1f} GB fetched from host; "
                      f"weights {c['expert_weights_gb'][0]:.1f} GB per GPU, {c['kv_blocks'][0]} KV blocks")
        if c.get("stage_books"):
            books = c["stage_books"]
            last = books[0]["partitions"][-1][1]
            out.print(f"pipeline ({c['pp']} stages, {c['stages']}): layers {'/'.join(map(str, last))} at the end, "
                      f"{sum(b['moves'] for b in books)} re-splits moving {sum(b['layers_moved'] for b in books)} "
                      f"layers ({sum(b['stall_s'] for b in books):.2f} s stalled); slowest stage "
                      f"{sum(b['mean_imbalance'] for b in books) / len(books):.3f}x the mean")
        m = c["migrations"]
        if m:
            out.print(f"migration ({c['migration']} over {c['link']}): {m['started']} started, {m['completed']} "
                      f"completed, {m['aborted']} aborted; {m['bytes'] / 1e9:.2f} GB moved, "
                      f"{1e3 * m['downtime_s']:.0f} ms of downtime in total")
    console.print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def simulate_fluid(args: argparse.Namespace) -> int:
    """`simulate --fidelity fluid` (fluid.py): the fleet's capacity as a discrete run measures it, then
    the demand window at flow level."""
    from types import SimpleNamespace

    from rich.console import Console

    from sloserve.cli.fluid import fluid_inputs, run_fluid

    fleet = fleet_config_from_args(args)
    if args.demand and (len(args.demand) > 1 or "=" in args.demand[0]) or args.budget is not None:
        from sloserve.cli.fluid import simulate_services

        return simulate_services(args, fleet, prepare_autoscaling)
    slo, spec, run = fluid_inputs(args, fleet)
    console = Console(stderr=True)
    console.print(f"capacity of one {fleet.model} instance on {fleet.hardware} at {args.slo} ...")
    fleet = prepare_autoscaling(fleet, args, spec, slo)
    fleet.validate()
    record, label, summary = run_fluid(args, fleet, spec, run, slo, console)
    figure = plot_scaling([SimpleNamespace(label=label, outcome={"scaling": record["scaling"]})],
                          Path(args.out) / "scaling.png")
    out = Console()
    out.print(label)
    out.print(summary)
    console.print(f"wrote {Path(args.out) / 'fluid.json'} and {figure}")
    return 0


def energy_report(energy: dict, records) -> dict:
    """The run's energy books with per-request and per-token figures ({} without a clock policy)."""
    if not energy:
        return {}
    done = [r for r in records if r.error is None]
    tokens = sum(r.output_tokens or 0 for r in done)
    return {**energy, "joules_per_request": energy["total_j"] / max(1, len(done)),
            "joules_per_output_token": energy["total_j"] / max(1, tokens)}


def write_fleet_file(spec, out_dir: Path) -> Path:
    """The simulated fleet's controller settings as `--fleet` reads them, so `sloserve serve
    --fleet DIR/fleet.yaml` runs what was simulated (the capacity measured here included)."""
    import yaml

    path = out_dir / "fleet.yaml"
    path.write_text("# sloserve simulate's fleet: `sloserve serve --fleet fleet.yaml` runs the same controller\n"
                    + yaml.safe_dump(spec.as_dict(), sort_keys=False))
    return path


def timeline_interval(asked, stream) -> float:
    """Seconds between frames: as asked, else a round value giving about 600 over the arrivals."""
    from sloserve.timeline import frame_interval

    if asked is not None:
        if not asked > 0:
            raise ValueError(f"--timeline-interval must be > 0, got {asked}")
        return float(asked)
    return frame_interval(max((w.arrival_s for w in stream), default=0.0), 600)


CAPACITY_PROBE_REQUESTS = 4000


def prepare_autoscaling(fleet, args: argparse.Namespace, spec, slo):
    """`fleet` with the capacity model's answer (unless --capacity) and the forecaster's history,
    before the runs."""
    from sloserve.planning import instance_capacity, pool_capacity
    from sloserve.workload.build import build_stream

    fs = fleet.fleet
    measured = fs.pd_capacity is None if fs.pd else fs.capacity_rps is None
    if measured and slo.empty:
        given = "--pd-capacity P_RPS:D_RPS" if fs.pd else "--capacity RPS"
        raise ValueError(f"autoscaling needs {given}, or --slo to measure it on the workload")
    # rates are held for planning.CAPACITY_SUSTAIN_S of arrivals: 4,000 requests last a minute up to ~66 req/s,
    # and a faster instance's search draws more of the workload (`more`, up to planning.CAPACITY_MOST_REQUESTS).
    # The search stretches the workload's arrival pattern to each rate: one with neither times nor a rate here
    # (--rate is the runs') would be sent all at once, a burst at every rate, so it gets the runs' arrival process
    shaped = spec if spec.rate is not None or spec.replay or spec.has_trace_times else replace(spec, rate=1.0)

    def more(n: int):
        return build_stream(replace(shaped, num_requests=n, duration_s=None))

    head = more(CAPACITY_PROBE_REQUESTS) if measured else []
    if fs.pd and fs.pd_capacity is None:
        fleet = fleet.with_fleet(pd_capacity=pool_capacity(head, fleet, slo, more=more))
        if not all(c > 0 for c in fleet.fleet.pd_capacity):  # type: ignore[union-attr]
            raise ValueError("one pool's instance meets the SLO at no rate on this workload: loosen --slo or "
                             "give --pd-capacity")
    elif not fs.pd and fs.capacity_rps is None:
        fleet = fleet.with_fleet(capacity_rps=instance_capacity(head, fleet.fixed(), slo, more=more))
        if not fleet.fleet.capacity_rps > 0:
            raise ValueError("one instance meets the SLO at no rate on this workload: loosen --slo or give --capacity")
    if args.scaling_history:
        from sloserve.workload.series import load_series

        fleet.scaling_history = load_series(args.scaling_history, "requests", fleet.demand_step_s)
        fleet.demand_step_s = min(fleet.demand_step_s, fleet.scaling_history.step_s)  # type: ignore[attr-defined]
    elif fs.autoscale in ("predictive", "hybrid") and fleet.scaling_history is None:
        raise ValueError(f"--autoscale {fs.autoscale} needs --scaling-history (the demand that trains its forecaster)")
    return fleet


def plot_scaling(results, path: Path) -> Path:
    """Demand and instances over time, one panel per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(11, 3 * len(results)), squeeze=False, layout="constrained")
    for ax, r in zip(axes[:, 0], results):
        rows = r.outcome["scaling"]["timeline"]
        t = [row[0] / 3600 for row in rows]
        ax.step(t, [row[1] for row in rows], where="post", label="ready")
        ax.step(t, [row[1] + row[2] for row in rows], where="post", linestyle="--", label="ready + starting")
        ax.step(t, [row[5] for row in rows], where="post", linestyle=":", label="target")
        for pool in ("prefill", "decode"):  # a disaggregated fleet: each pool's ready instances too
            mine = [row for row in r.outcome["scaling"].get("pool_timeline", []) if row[1] == pool]
            if mine:
                ax.step([row[0] / 3600 for row in mine], [row[2] for row in mine], where="post", alpha=0.7,
                        label=f"{pool} ready")
        ax.set_ylabel("instances")
        twin = ax.twinx()
        twin.plot(t, [row[4] for row in rows], color="gray", alpha=0.6, linewidth=0.8, label="demand (req/s)")
        twin.set_ylabel("req/s")
        ax.set_title(r.label, fontsize="small")
        ax.legend(loc="upper left", fontsize="small")
        twin.legend(loc="upper right", fontsize="small")
    axes[-1, 0].set_xlabel("simulated hours")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from sloserve.bench.metrics import SLO
    from sloserve.cli.workload_args import resolve_rates, workload_spec_from_args
    from sloserve.planning import SUSTAIN_S, layouts, plan, sustained
    from sloserve.simulation import PoolSettings
    from sloserve.workload.build import build_stream

    if args.gpus < 2:
        raise ValueError("--gpus must be >= 2 (a split needs a prefill and a decode instance)")
    spec = workload_spec_from_args(args)
    rates = resolve_rates(args, spec)
    rate = rates[0]
    source = replace(spec, rate=rate, replay=spec.replay if rate is None else False)
    stream = build_stream(source)
    if len(stream) < 2 or stream[-1].arrival_s <= 0:
        raise ValueError("plan needs at least two requests with arrival times: pass --rate R or --replay")
    if args.sustain < 0 or args.max_requests < len(stream):
        raise ValueError(f"--sustain must be >= 0 and --max-requests at least the workload's {len(stream)} requests")
    requests_at = sustained(lambda n: build_stream(replace(source, num_requests=n, duration_s=None)), len(stream),
                            args.sustain, args.max_requests) if args.sustain > 0 else None
    fleet = fleet_config_from_args(args)
    if fleet.fleet.autoscale is not None:
        raise ValueError("plan sizes fixed fleets; drop --autoscale")
    fleet.validate()
    slo = SLO.parse(args.slo)
    pools = [[PoolSettings.parse(x) for x in text.split(";")] if text else [PoolSettings()]
             for text in (args.prefill_pools, args.decode_pools)]
    candidates = layouts(args.gpus, pools[0], pools[1])
    console = Console(stderr=True)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, disable=args.no_progress)
    with progress:
        task = progress.add_task("goodput searches", total=len(candidates))
        rows = plan(stream, fleet, slo, args.gpus, candidates, args.iters, on_done=lambda _: progress.advance(task),
                    requests_at=requests_at)
    # seconds of arrivals a row's rate must have lasted to count as sustained: what --sustain asked, and with
    # --sustain 0 (the workload squeezed) the default's, so that a burst the fleet absorbed is marked all the same
    need_s = args.sustain if args.sustain > 0 else SUSTAIN_S
    short = [r for r in rows if r.goodput > 0 and r.found.held_s < need_s * (1 - 1e-9)]
    limited = [r for r in rows if r.found.limited]

    def mark(r) -> str:  # a lower bound; a rate held too short is marked at its seconds
        return ">=" if r.found.limited else ""

    def secs(x: float) -> str:  # inf: nothing met, nothing held
        return "-" if math.isinf(x) else f"{x:.0f}" if x >= 10 else f"{x:.2g}"

    def label(r) -> str:  # pool settings are in [brackets], which rich reads as markup
        return escape(r.layout.label)

    colocated = next(r for r in rows if r.layout.pd is None)
    best_pd = next((r for r in rows if r.layout.pd is not None), None)
    held = (f"each rate held >= {args.sustain:g} s of arrivals (at most {args.max_requests} requests)"
            if args.sustain > 0 else f"the workload's {len(stream)} requests squeezed to each rate")
    table = Table(title=f"goodput per GPU at >= 90% within {args.slo} ms: {spec.name}, {held}; {args.gpus} x "
                        f"{fleet.hardware}, {fleet.model}, link {fleet.link}")
    for col in ("layout", "GPUs", "goodput req/s", "per GPU", "vs colocated", "held s (requests)"):
        table.add_column(col, justify="right", overflow="fold")
    for r in rows:
        ratio = r.per_gpu / colocated.per_gpu if colocated.per_gpu > 0 else float("inf")
        table.add_row(label(r), str(r.gpus), f"{mark(r)}{r.goodput:.2f}", f"{r.per_gpu:.3f}", f"{ratio:.2f}x",
                      secs(r.found.held_s) + ("!" if r in short else "") + f" ({r.found.requests})")
    out = Console()
    out.print(table)
    winner = rows[0]
    out.print(f"best: {label(winner)} ({mark(winner)}{winner.per_gpu:.3f} req/s per GPU, held "
              f"{secs(winner.found.held_s)}{'!' if winner in short else ''} s of arrivals); best colocated "
              f"{mark(colocated)}{colocated.per_gpu:.3f}"
              + (f"; best P:D {label(best_pd)} {mark(best_pd)}{best_pd.per_gpu:.3f}" if best_pd else ""),
              highlight=False, soft_wrap=True)
    if limited:
        first = min(limited, key=lambda r: r.found.refused_rps)
        out.print(f"[bold red]warning:[/] {len(limited)} of {len(rows)} rows (marked >=) are lower bounds, not "
                  f"goodput: {args.sustain:g} s of arrivals at {first.found.refused_rps:.1f} req/s "
                  f"({label(first)}) needs {math.ceil(first.found.refused_rps * args.sustain)} requests and the "
                  f"sample gave {first.found.refused_requests} ("
                  + (f"--max-requests {args.max_requests}): " if first.found.refused_requests >= args.max_requests
                     else "the end of the workload): ")
                  + "the search credits no rate it cannot hold that long; raise --max-requests or give a longer "
                    "workload", highlight=False, soft_wrap=True)
    if short:
        worst = min(short, key=lambda r: r.found.held_s)
        out.print(f"[bold red]warning:[/] the goodput of {len(short)} of {len(rows)} rows (marked !) held less than "
                  f"{need_s:g} s of arrivals ({label(worst)}: {worst.found.requests} requests at "
                  f"{worst.goodput:.1f} req/s, {secs(worst.found.held_s)} s): a burst the fleet absorbs, not a "
                  "rate it sustains; run without --sustain 0", highlight=False, soft_wrap=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    record = {"workload": spec.name, "requests": len(stream), "sustain_s": args.sustain,
              "max_requests": args.max_requests, "gpus": args.gpus, "slo": args.slo,
              "hardware": fleet.hardware, "model": fleet.model, "link": fleet.link, "pd_transfer": fleet.fleet.pd_transfer,
              "rows": [{"layout": r.layout.label, "pd": r.layout.pd, "prefill_pool": vars(r.layout.prefill_pool),
                        "decode_pool": vars(r.layout.decode_pool), "gpus": r.gpus, "goodput_rps": r.goodput,
                        "per_gpu": r.per_gpu, "held_s": r.found.held_s if r.goodput > 0 else None,
                        "probe_requests": r.found.requests, "lower_bound": r.found.limited,
                        "refused_rps": r.found.refused_rps, "short": r in short} for r in rows]}
    (out_dir / "plan.json").write_text(json.dumps(record, indent=1))
    _plot_plan(rows, out_dir / "plan.png", table.title)
    console.print(f"wrote {out_dir / 'plan.json'} and {out_dir / 'plan.png'}")
    return 0


def _plot_plan(rows, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(rows, key=lambda r: (r.layout.pd is not None, r.layout.label))
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(ordered)), 4))
    ax.bar(range(len(ordered)), [r.per_gpu for r in ordered],
           color=["tab:gray" if r.layout.pd is None else "tab:blue" for r in ordered])
    ax.set_xticks(range(len(ordered)), [r.layout.label for r in ordered], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("goodput per GPU (req/s)")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
