"""`sloserve generate`: text for one prompt from an engine in this process, streamed to stdout."""
from __future__ import annotations

import argparse
import logging
import sys

from sloserve.cli.engine_args import add_engine_args, engine_config_from_args


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from sloserve.engine.llm_engine import LLMEngine
    from sloserve.core.types import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed_sampling, stop=args.stop or [], ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty,
    )
    engine = LLMEngine(engine_config_from_args(args))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            final = out
    sys.stdout.write("\n")
    if final is not None:
        logging.getLogger("sloserve").info(
            "%d prompt + %d output tokens, finish_reason=%s", len(final.prompt_token_ids), final.num_output_tokens,
            final.finish_reason,
        )
    return 0
