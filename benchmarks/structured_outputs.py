"""What a structured output costs: the grammar engines' token mask per step, and a constrained
request's decode against the same request unconstrained.

1. Mask cost: for each constraint (JSON schemas of 3 and 12 fields, a regex, a choice list), a
   valid output is fed token by token and the next-token mask is computed before each token, by
   xgrammar (what engine/structured.py uses) and by llguidance when it is installed
   (`pip install llguidance`: the candidate it was chosen against). Interleaved rounds; median,
   p99 and max per token.
2. End to end: the embedded model (default precision, or `--dtype`/`--quantization`) generates the same 3-field JSON greedily,
   once constrained and once unconstrained (ignore_eos, same length), interleaved: the ratio of
   their decode times, for a batch of 1 and of each `--batch` size (that many requests at once,
   each with its own prompt: every row of the batch masked), and the difference per generated
   token: what one masked row adds to a step (what the simulator's MaskCost prices).

    .venv/bin/python benchmarks/structured_outputs.py [--rounds 5] [--batch 1,16,64] [--dtype bfloat16 --quantization none]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from sloserve import LLM  # noqa: E402
from sloserve.engine.structured import choice_grammar, hf_view  # noqa: E402
from sloserve.core.types import SamplingParams, StructuredOutput  # noqa: E402

SMALL = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                          "tags": {"type": "array", "items": {"type": "string"}}},
         "required": ["name", "age", "tags"], "additionalProperties": False}
LARGE = {"type": "object", "properties": {f"field_{i}": ({"type": "integer"} if i % 3 == 0 else {"type": "string"}
                                                         if i % 3 == 1 else {"type": "boolean"}) for i in range(12)},
         "required": [f"field_{i}" for i in range(12)], "additionalProperties": False}
CHOICES = [f"option number {i}" for i in range(50)]


def cases() -> list[tuple[str, StructuredOutput, str]]:
    small_text = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"]})
    large_text = json.dumps({f"field_{i}": (i * 7 if i % 3 == 0 else f"value {i}" if i % 3 == 1 else i % 2 == 0)
                             for i in range(12)})
    return [("json schema, 3 fields", StructuredOutput("json", json.dumps(SMALL)), small_text),
            ("json schema, 12 fields", StructuredOutput("json", json.dumps(LARGE)), large_text),
            ("regex (date)", StructuredOutput("regex", r"\d{4}-\d{2}-\d{2}"), "2026-12-06"),
            ("choice of 50", StructuredOutput("choice", tuple(CHOICES)), CHOICES[37])]


def xgrammar_times(llm: LLM, constraint: StructuredOutput, ids: list[int]) -> list[float]:
    import xgrammar as xgr

    grammar = llm.engine.grammar
    matcher = grammar.matcher(constraint)
    bitmask = xgr.allocate_token_bitmask(1, grammar.vocab_size)
    times = []
    for token in ids:
        t0 = time.perf_counter()
        matcher.fill(bitmask, 0)
        times.append(time.perf_counter() - t0)
        matcher.sync(ids[:len(times)])
    return times


def llguidance_times(tokenizer, constraint: StructuredOutput, ids: list[int], vocab: int) -> list[float]:
    import llguidance
    import llguidance.torch as lltorch

    if constraint.kind == "json":
        grm = llguidance.LLMatcher.grammar_from_json_schema(constraint.spec)
    elif constraint.kind == "regex":
        grm = llguidance.LLMatcher.grammar_from_regex(constraint.spec)
    else:
        grm = llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in constraint.spec))  # type: ignore[union-attr]
    matcher = llguidance.LLMatcher(tokenizer, grm)
    mask = lltorch.allocate_token_bitmask(1, vocab)
    times = []
    for token in ids:
        t0 = time.perf_counter()
        lltorch.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - t0)
        if not matcher.consume_token(token):
            raise RuntimeError(f"llguidance refused token {token}: {matcher.get_error()}")
    return times


def decode_seconds(llm: LLM, params: SamplingParams, batch: int = 1) -> tuple[float, int]:
    """Seconds to generate `batch` requests at once (each its own prompt), and the tokens generated."""
    chats = [[{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(batch)]
    t0 = time.perf_counter()
    outs = llm.chat(chats, params)
    return time.perf_counter() - t0, sum(len(o.token_ids) for o in outs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", default="1", help="batch sizes of the end-to-end comparison, e.g. 1,16,64")
    ap.add_argument("--skip-masks", action="store_true", help="only the end-to-end comparison")
    ap.add_argument("--dtype", default="auto", help="bfloat16 with --quantization none: vLLM's precision")
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args()
    console = Console()
    llm = LLM(dtype=args.dtype, quantization=args.quantization)
    vocab = llm.engine.model_config.vocab_size
    try:
        import llguidance.hf

        eos = llm.tokenizer.eos_token_id
        ll_tok = llguidance.hf.from_tokenizer(hf_view(llm.tokenizer.backend, llm.tokenizer.id_to_token(eos)),
                                              n_vocab=vocab)
    except ImportError:
        ll_tok = None
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    table = Table(title=f"token mask per step, us (median / p99 / max over {args.rounds} rounds; {cpu})")
    for col in ("constraint", "tokens", "xgrammar", "llguidance"):
        table.add_column(col)
    for name, constraint, text in ([] if args.skip_masks else cases()):
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        xg, lg = [], []
        for _ in range(args.rounds):  # interleaved
            xg += xgrammar_times(llm, constraint, ids)
            if ll_tok is not None:
                lg += llguidance_times(ll_tok, constraint, ids, vocab)

        def show(times: list[float]) -> str:
            if not times:
                return "not installed"
            q = sorted(times)
            return (f"{1e6 * statistics.median(q):.0f} / {1e6 * q[int(0.99 * (len(q) - 1))]:.0f} / "
                    f"{1e6 * q[-1]:.0f}")

        table.add_row(name, str(len(ids)), show(xg), show(lg))
    console.print(table)
    constrained = SamplingParams(max_tokens=200, temperature=0,
                                 structured=StructuredOutput("json", json.dumps(SMALL)))
    _, n = decode_seconds(llm, constrained)
    free = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    bounded = SamplingParams(max_tokens=n, temperature=0, structured=constrained.structured)
    for batch in (int(b) for b in args.batch.split(",")):
        ratios, made, per_row, spent = [], [], [], []
        for _ in range(args.rounds):  # per generated token: a constrained output may end before n
            a, ka = decode_seconds(llm, bounded, batch)
            b, kb = decode_seconds(llm, free, batch)
            ratios.append((a / ka) / (b / kb))
            made.append(ka / kb)
            per_row.append(a / ka - b / kb)  # a token is a masked row of one step: its extra seconds
            spent.append(a / ka)
        console.print(f"end to end, batch {batch} (up to {n} tokens each, {llm.engine.precision}): constrained / "
                      f"unconstrained time per generated token median {statistics.median(ratios):.3f} (range "
                      f"{min(ratios):.3f}-{max(ratios):.3f}, {args.rounds} interleaved pairs; constrained outputs "
                      f"{statistics.median(made):.2f}x the tokens); what a masked row adds to a step (the "
                      f"simulator's MaskCost.serial_s): median {1e6 * statistics.median(per_row):.0f} us (range "
                      f"{1e6 * min(per_row):.0f}-{1e6 * max(per_row):.0f}); constrained time per generated token "
                      f"{1e3 * statistics.median(spent):.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
