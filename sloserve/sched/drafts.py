"""Draft proposers for speculative decoding that need no second model.

A proposer guesses the next few tokens of a request from what it can see; the engine
verifies every guess in one forward pass and keeps the longest prefix the model agrees
with, so a wrong guess costs compute, never correctness. Prompt lookup (n-gram matching
against the request's own prompt and output) hits often where outputs copy their input:
code edits, summaries, extraction, multi-turn chat that quotes earlier turns.

Pure Python, no torch: the scheduler calls it while planning a step.
"""
from __future__ import annotations

from array import array
from typing import Protocol, Sequence

from sloserve.core.types import Request


class DraftProposer(Protocol):
    """Up to `k` guessed next tokens of `request` (fewer, or none, when it has no guess)."""

    name: str

    def propose(self, request: Request, k: int) -> list[int]: ...


class PromptLookupProposer:
    """The continuation of the latest earlier occurrence of the request's last n tokens
    (n from `max_ngram` down to `min_ngram`): prompt lookup decoding.

    The search runs in C: token ids are packed into 4-byte words and `bytes.rfind` looks for
    the suffix's bytes; a hit at an offset that is not a word boundary is skipped."""

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(self, request: Request, k: int) -> list[int]:
        if k <= 0:
            return []
        return lookup(request.prompt_token_ids, request.output_token_ids, k, self.max_ngram, self.min_ngram)


def lookup(prompt: Sequence[int], output: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Prompt lookup over prompt + output (see PromptLookupProposer)."""
    tokens = array("I", prompt)
    tokens.extend(output)
    n_tokens = len(tokens)
    data = tokens.tobytes()
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = data[(n_tokens - n) * 4:]
        end = (n_tokens - 1) * 4  # a match must end before the suffix itself does
        while True:
            at = data.rfind(suffix, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                start = at // 4 + n
                return tokens[start:start + k].tolist()
            end = at + len(suffix) - 1  # misaligned: look further left
    return []


PROPOSERS = {PromptLookupProposer.name: PromptLookupProposer}


def make_proposer(name: str) -> DraftProposer:
    try:
        return PROPOSERS[name]()
    except KeyError:
        raise ValueError(f"unknown draft proposer {name!r}; choose from {', '.join(sorted(PROPOSERS))}") from None
