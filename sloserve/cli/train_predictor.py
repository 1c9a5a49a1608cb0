"""`sloserve train-predictor`: fit the output-length predictor on ShareGPT and report it
beside two baselines on a held-out split. With the defaults it rebuilds the predictor
shipped in the package (`sloserve/cluster/predictor_default.json`)."""
from __future__ import annotations

import argparse
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

logger = logging.getLogger(__name__)


def add_train_predictor_parser(sub: argparse._SubParsersAction) -> None:
    # numpy and the trainer load only when the command runs, not whenever the CLI parses
    p = sub.add_parser("train-predictor", help="train the output-length predictor the routers use")
    p.add_argument("--data", help="ShareGPT first-turn JSONL(.gz) (default: the shared sharegpt_v3_first_turn file)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "cluster" / "predictor_default.json"),
                   help="where to save it (default: the packaged default)")
    p.add_argument("--limit", type=int, help="use only the first N records (quick runs, tests)")
    p.add_argument("--epochs", type=int, help="default 8")
    p.add_argument("--batch-size", type=int, help="default 256")
    p.add_argument("--lr", type=float, help="Adam step size, default 0.01")
    p.add_argument("--l2", type=float, help="weight decay, default 1e-5")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", metavar="FILE", help="also write the held-out report as JSON here")
    p.set_defaults(func=cmd_train_predictor)


def cmd_train_predictor(args: argparse.Namespace) -> int:
    from sloserve.cluster.predict import (GlobalMedianBaseline, LinearLengthBaseline, TrainConfig, evaluate,
                                          load_examples, report_markdown, split, train)

    given = {k: getattr(args, k) for k in ("epochs", "batch_size", "lr", "l2", "seed") if getattr(args, k) is not None}
    cfg = TrainConfig(**given)
    if cfg.epochs < 1 or cfg.batch_size < 1 or not cfg.lr > 0 or cfg.l2 < 0:
        raise ValueError("epochs and batch size must be >= 1, lr > 0, l2 >= 0")
    examples = load_examples(args.data, args.limit)
    train_set, held = split(examples, cfg.holdout_mod)
    if not train_set or not held:
        raise ValueError(f"need examples on both sides of the split; got {len(train_set)} train, {len(held)} held out")
    logger.info("%d examples: %d train, %d held out", len(examples), len(train_set), len(held))
    t0 = time.perf_counter()
    model = train(train_set, cfg)
    train_s = time.perf_counter() - t0
    reports = [
        evaluate("global median", GlobalMedianBaseline(train_set).predict, held),
        evaluate("linear on prompt length", LinearLengthBaseline(train_set).predict, held),
        evaluate("sloserve: length only (simulation)", model.predict, held, use_text=False, clock=time.perf_counter),
        evaluate("sloserve: text + length", model.predict, held, clock=time.perf_counter),
    ]
    model.meta["heldout"] = {r.name: {k: (round(v, 4) if isinstance(v, float) else v)
                                      for k, v in asdict(r).items() if k not in ("name", "mean_us")}
                             for r in reports}
    model.meta["data"] = {"records": len(examples), "train": len(train_set), "heldout": len(held),
                          "source": "sharegpt_v3_first_turn.jsonl.gz" if not args.data else Path(args.data).name}
    model.save(args.out)
    print(report_markdown(reports))
    print(f"\ntrained in {train_s:.1f} s on {len(train_set)} prompts; held out {len(held)}; saved {args.out} "
          f"({Path(args.out).stat().st_size / 1024:.0f} KiB)")
    if args.report:
        Path(args.report).write_text(json.dumps({"reports": [asdict(r) for r in reports], "train_s": train_s},
                                                indent=1))
    return 0
