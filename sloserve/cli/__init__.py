"""The `sloserve` command line: one module of this package per command (serve.py, simulate.py, ...)
and one per set of options several commands share (engine_args.py, fleet_args.py,
workload_args.py). The top layer: no other sloserve module imports from this package."""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sloserve", description="SLO-driven LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    from sloserve.cli.generate import add_generate_parser
    from sloserve.cli.profile import add_profile_parser
    from sloserve.cli.serve import add_serve_parser

    add_generate_parser(sub)
    add_profile_parser(sub)
    add_serve_parser(sub)
    from sloserve.cli.bench import add_bench_parser  # `sloserve bench` and `sloserve bench compare`

    add_bench_parser(sub)
    from sloserve.cli.simulate import add_plan_parser, add_simulate_parser

    add_simulate_parser(sub)
    add_plan_parser(sub)
    from sloserve.cli.forecast import add_forecast_parser
    from sloserve.cli.train_predictor import add_train_predictor_parser

    add_train_predictor_parser(sub)
    add_forecast_parser(sub)
    from sloserve.cli.kv_store import add_kv_store_parser

    add_kv_store_parser(sub)
    from sloserve.cli.place import add_place_parser

    add_place_parser(sub)
    from sloserve.cli.top import add_top_parser

    add_top_parser(sub)
    from sloserve.cli.evaluate import add_evaluate_parser

    add_evaluate_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        from sloserve.cli.fleet_args import resolve_fleet_args

        resolve_fleet_args(args)
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"sloserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
