"""`sloserve evaluate`: the held-out evaluation suite (sloserve/evaluation)."""
from __future__ import annotations

import argparse
from pathlib import Path


def add_evaluate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("evaluate", help="policies against their baselines on held-out settings (dev/test split by a "
                                        "hash of each setting), on the simulator")
    p.add_argument("--decision", action="extend", nargs="+", metavar="NAME",
                   help="decisions to evaluate: routing, migration, disaggregation, autoscaling, forecasting, qos, "
                        "tiers, clocks (default: all; grids in benchmarks/suite/)")
    p.add_argument("--split", default="dev", metavar="dev|test|both",
                   help="which cells: dev (default; what tuning, plots and iteration read), test (the claims: run "
                        "once the policy is frozen) or both")
    p.add_argument("--quick", action="store_true",
                   help="each decision's tiny quick grid, never one of the full grid's test cells: a smoke test "
                        "(1-20 s a decision, ~80 s for all eight on 2 cores)")
    p.add_argument("--seeds", type=int, default=2, help="windows of each trace every policy runs on (>= 2: a tie "
                   "is judged against how much the per-seed ratios disagree)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes (each runs one cell and seed at a time)")
    p.add_argument("--tune", metavar="POLICY",
                   help="search POLICY's declared thresholds on dev cells (optuna) and print the values to commit")
    p.add_argument("--trials", type=int, default=20, help="with --tune: trials")
    p.add_argument("--out", type=Path, metavar="DIR",
                   help="parent of the run's evaluate-<split>-<time>/ folder (default: benchmarks/results)")
    p.add_argument("--checkpoint", type=Path, metavar="FILE",
                   help="append each finished cell and seed to FILE, and skip those FILE already holds that the same "
                        "code measured: a run cut short goes on where it stopped")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar: one line per finished cell and seed instead (for logs)")
    p.set_defaults(func=cmd_evaluate)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from sloserve.evaluation.decisions import DECISIONS
    from sloserve.evaluation.report import print_summary, write_report
    from sloserve.evaluation.runner import planned, run_evaluation, write_results

    if args.split not in ("dev", "test", "both"):
        raise ValueError(f"--split must be dev, test or both, got {args.split!r}")
    decisions = list(dict.fromkeys(args.decision or DECISIONS))
    unknown = [d for d in decisions if d not in DECISIONS]
    if unknown:
        raise ValueError(f"unknown decision {unknown[0]!r}; choose from {', '.join(DECISIONS)}")
    console = Console(stderr=True)
    if args.tune:
        return tune_command(args, decisions, console)
    if args.seeds < 2:
        raise ValueError(f"--seeds must be >= 2 (a tie is judged against how much the per-seed ratios disagree), got {args.seeds}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    total = len(planned(decisions, args.split, args.quick)) * args.seeds
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, disable=args.no_progress)
    with progress:
        task = progress.add_task(f"{args.split} cells x seeds", total=total)

        finished = 0

        def done(label: str) -> None:
            nonlocal finished
            finished += 1
            progress.update(task, advance=1, description=label)
            if args.no_progress:
                console.print(f"[{finished}/{total}] {label}", highlight=False)

        run = run_evaluation(decisions, args.split, args.quick, args.seeds, args.jobs, on_done=done,
                             checkpoint=args.checkpoint)
    folder = write_results(run, args.out)
    paths = write_report(run, folder)
    print_summary(run, Console())
    console.print(f"wrote {folder / 'results.json'}, " + ", ".join(str(p) for p in paths))
    return 0


def tune_command(args: argparse.Namespace, decisions: list[str], console) -> int:
    from sloserve.evaluation.suite import cells
    from sloserve.evaluation.tune import declared, tune

    decision, _ = declared(args.tune)  # a policy without thresholds is refused before any work
    if args.decision and decision.name not in decisions:
        raise ValueError(f"{args.tune} is tuned in the {decision.name} decision, not {', '.join(decisions)}")
    chosen = cells(decision.name, None if args.split == "both" else args.split, args.quick)
    result = tune(args.tune, chosen, args.trials, args.seeds, args.quick,
                  on_trial=lambda n, score: console.print(f"trial {n}: goodput@99 {score:.3f}x the best baseline"))
    print(result.text())
    return 0
