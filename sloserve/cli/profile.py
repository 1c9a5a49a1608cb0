"""`sloserve profile`: time the engine's steps over a grid of shapes and fit the cost model the
simulator prices steps with (`simulate --profile FILE`)."""
from __future__ import annotations

import argparse

from sloserve.cli.engine_args import add_engine_args, engine_config_from_args


def add_profile_parser(sub: argparse._SubParsersAction) -> None:
    prof = sub.add_parser("profile", help="measure the engine's step times and fit the simulator's cost model")
    prof.add_argument("--out", default="profile.json")
    prof.add_argument("--quick", action="store_true", help="a small grid (seconds, not minutes)")
    prof.add_argument("--repeats", type=int, default=3)
    add_engine_args(prof)
    prof.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from sloserve.engine.llm_engine import LLMEngine
    from sloserve.profiler import FULL_GRID, QUICK_GRID, profile_engine

    engine = LLMEngine(engine_config_from_args(args))
    with Progress(transient=True) as bar:
        task = bar.add_task("profiling step shapes", total=None)
        profile = profile_engine(engine, QUICK_GRID if args.quick else FULL_GRID, repeats=args.repeats,
                                 on_point=lambda done, total: bar.update(task, completed=done, total=total))
    profile.save(args.out)
    print(f"{len(profile.samples)} step shapes, mean relative fit error {100 * profile.fit_error:.1f}% -> {args.out}")
    return 0
