"""Structured outputs: a request's JSON schema, regex, choice list or grammar, compiled once and
turned into a token mask at every step it samples.

The grammar engine is xgrammar, chosen by measurement against llguidance
(`benchmarks/structured_outputs.py`, BENCHMARKS.md "Structured outputs"): on the embedded model's
49,152-token vocabulary their JSON-schema masks cost about the same at the median (10-14 us a
token), xgrammar's tail is shorter (max 93 us against 1.3 ms) and its regex and choice masks
are 10x cheaper (1-2 us against 20-22 us).

Compiled grammars are cached by constraint; a request's matcher is rebuilt from its output tokens
whenever it is not already in step with them, so a request that was preempted, swapped, migrated
to this engine or resumed after a failover keeps its constraint: the tokens are the state.

The masks are filled on a helper thread while the forward pass runs and applied to the logits rows
of constrained requests before the sampler, which then samples as it would (greedy, seeded or
random) among the allowed tokens. Once the constraint is
complete only the end-of-sequence tokens remain allowed.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from sloserve.core.types import StructuredOutput

MAX_COMPILED = 256  # compiled constraints kept (least recently used dropped)
# JSON is generated compact, with json.dumps's separators (", " and ": ") and no other whitespace:
# a model allowed any whitespace between tokens can spend its whole output on it (the embedded
# model did, even with at most 16 characters per gap).
JSON_SEPARATORS = (", ", ": ")


@dataclass(frozen=True)
class ToolCallFormat:
    """How a model family writes its calls: `prefix`, the calls separated by `separator`, `suffix`;
    each call a JSON object {"name": ..., args_key: {...}}. A forced answer is generated in it and
    server/tool_parsers.py reads it back."""

    prefix: str
    separator: str
    suffix: str
    args_key: str = "arguments"


TOOL_CALL_FORMATS = {
    "hermes": ToolCallFormat("<tool_call>\n", "\n</tool_call>\n<tool_call>\n", "\n</tool_call>"),
    "llama3_json": ToolCallFormat("", "; ", "", args_key="parameters"),
    "mistral": ToolCallFormat("[TOOL_CALLS][", ", ", "]"),
}
MAX_PARALLEL_CALLS = 4  # calls one forced answer may hold when parallel calls are allowed
_ENGINE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[12:00:00] /project/cpp/file.cc:94: " before its message


class StructuredOutputError(ValueError):
    """A constraint the grammar engine cannot compile (the server answers 400, naming `param`)."""

    def __init__(self, message: str, param: str = "response_format"):
        super().__init__(message)
        self.param = param


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are GBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarBackend:
    """The tokenizer's view for the grammar engine, and a cache of compiled constraints."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]):
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles on its grammar thread, the engine in make_request
        self.native: Any = None  # the native kernels' module (engine/kernels), when the engine has them

    def cached(self, constraint: StructuredOutput) -> bool:
        with self._lock:
            return constraint in self._compiled

    def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled form of `constraint` (cached); StructuredOutputError when it does not compile."""
        with self._lock:
            hit = self._compiled.get(constraint)
            if hit is not None:
                self._compiled.move_to_end(constraint)
                return hit
        try:
            compiled = self._compile(constraint)
        except StructuredOutputError as exc:
            raise StructuredOutputError(str(exc), constraint.source) from None
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with its parser's message
            message = _ENGINE_PREFIX.sub("", " ".join(str(exc).split()))[:300]
            raise StructuredOutputError(f"{constraint.source}: the {constraint.kind} constraint does not compile: "
                                        f"{message}", constraint.source) from None
        with self._lock:
            self._compiled[constraint] = compiled
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, c: StructuredOutput) -> Any:
        if c.kind == "json":
            try:
                schema = json.loads(c.spec)  # type: ignore[arg-type]
            except json.JSONDecodeError as exc:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise StructuredOutputError("a JSON schema must be an object")
            return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True, any_whitespace=False,
                                                     separators=JSON_SEPARATORS)
        if c.kind == "json_object":
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                     separators=JSON_SEPARATORS)
        if c.kind == "regex":
            return self.compiler.compile_regex(str(c.spec))
        if c.kind == "choice":
            return self.compiler.compile_grammar(choice_grammar(c.spec))  # type: ignore[arg-type]
        if c.kind == "tool_calls":
            return self.compiler.compile_grammar(self._tool_calls(str(c.spec)))
        return self.compiler.compile_grammar(str(c.spec))

    def _tool_calls(self, spec: str) -> Any:
        """One call (or, with `parallel`, up to MAX_PARALLEL_CALLS) to one of the functions, written
        as the format writes calls, each call's arguments held to the function's parameter schema."""
        try:
            d = json.loads(spec)
            functions = [(f["name"], f.get("parameters") or {"type": "object"}) for f in d["functions"]]
            fmt, parallel = d.get("format", "hermes"), bool(d.get("parallel", False))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise StructuredOutputError(f"a tool_calls constraint must be JSON with functions: {exc}") from None
        if fmt not in TOOL_CALL_FORMATS or not functions:
            raise StructuredOutputError(f"tool_calls format must be one of {', '.join(TOOL_CALL_FORMATS)}, with "
                                        "at least one function")
        form = TOOL_CALL_FORMATS[fmt]
        schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, form.args_key: params},
                             "required": ["name", form.args_key], "additionalProperties": False}
                            for name, params in functions]}
        xgr = self._xgr

        def literal(text: str) -> Any:
            return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")

        call = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=JSON_SEPARATORS)
        chains, chain = [call], call
        for _ in range(MAX_PARALLEL_CALLS - 1 if parallel else 0):
            chain = xgr.Grammar.concat(chain, literal(form.separator), call)
            chains.append(chain)
        calls = xgr.Grammar.union(*chains) if len(chains) > 1 else call
        parts = ([literal(form.prefix)] if form.prefix else []) + [calls] + ([literal(form.suffix)] if form.suffix else [])
        return xgr.Grammar.concat(*parts) if len(parts) > 1 else calls

    def matcher(self, constraint: StructuredOutput) -> "RequestMatcher":
        return RequestMatcher(self._xgr.GrammarMatcher(self.compile(constraint)))

    def masks(self, work: Sequence[tuple[int, "RequestMatcher", Sequence[int]]], num_rows: int
              ) -> tuple[torch.Tensor, list[int]]:
        """The bitmask of a step's `num_rows` logits rows and the rows it constrains. `work`: per
        constrained request, its first row, its matcher (in step with its output) and the drafts it
        verifies: row first + j allows what the constraint allows after drafts 0..j-1; past a
        draft the constraint refuses, the rows repeat that draft's mask (their tokens are never
        accepted). Every matcher ends where it began."""
        bitmask = self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        rows: list[int] = []
        for first, matcher, drafts in work:
            accepted = 0
            for j in range(len(drafts) + 1):
                matcher.fill(bitmask, first + j)
                rows.append(first + j)
                if j < len(drafts) and accepted == j and matcher.try_advance(drafts[j]):
                    accepted += 1
            matcher.rollback(accepted)
        return bitmask, rows

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Mask `logits` in place: each row of `rows` keeps only what its bitmask row allows. On a
        CPU with the native kernels, sloserve's own (AVX-512: 16 logits a mask half-word; xgrammar's
        CPU kernel took 1.7 ms for 16 rows of the 49,152-token vocabulary, 10% of the step)."""
        native = self.native
        if native is not None and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) \
                and logits.is_contiguous():
            native.apply_token_bitmask_(logits, bitmask, torch.tensor(rows, dtype=torch.long), self.vocab_size)
            return
        self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), vocab_size=self.vocab_size,
                                              indices=rows)


class RequestMatcher:
    """One request's place in its constraint: the matcher and how many output tokens it has seen."""

    def __init__(self, matcher: Any):
        self._m = matcher
        self.seen = 0
        self.broken = False  # a token the constraint does not allow was accepted (it cannot happen under the mask)

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Advance over the output tokens not seen yet (all of them for a request new to this engine)."""
        if len(output_token_ids) < self.seen:  # the output was cut back: start again from its first token
            self._m.reset()
            self.seen, self.broken = 0, False
        for token in output_token_ids[self.seen:]:
            if not self.broken and not self._m.accept_token(int(token)):
                self.broken = True
        self.seen = len(output_token_ids)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    def try_advance(self, token: int) -> bool:
        """Accept a draft token if the constraint allows it (undone by `rollback`)."""
        return bool(self._m.accept_token(int(token)))

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)


def hf_view(backend: Any, eos_token: Optional[str]) -> Any:
    """A transformers fast tokenizer around a `tokenizers` one (what the grammar engine reads)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos_token)
