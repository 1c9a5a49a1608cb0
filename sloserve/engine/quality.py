"""What a precision costs in quality, against the float32 reference: perplexity on held-out text
and greedy agreement.

Perplexity runs the model's own forward over each text as one prefill (every position's
logits), so it scores the kernels a prefill runs; to score the packed kernels themselves, build
the model without the dense copy (`quantized_dense_copy=False`). Greedy agreement compares what
users see: the tokens generated.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

from sloserve.engine.model import ForwardBatch, KVCache, LlamaModel, PrefillSpan

_BLOCK = 16


@dataclass(frozen=True)
class Tolerance:
    """What a precision may cost against the float32 reference on held-out text."""

    max_perplexity_ratio: float  # its perplexity / float32's
    min_top1_agreement: float  # teacher-forced positions whose argmax equals float32's


# Written down once; tests/test_quant.py holds every precision to its row and
# benchmarks/precision.py reports against it. bf16 rounds activations and weights; int8 adds
# per-channel rounding of the weights (the LM head is int8 in both packed modes); int4 computes
# with the 4-bit GGUF file's own codes, so only the bf16 scales and activations separate it from
# the float32 dequantization.
TOLERANCES = {
    "bfloat16": Tolerance(1.01, 0.95),
    "int8": Tolerance(1.02, 0.93),
    "int4": Tolerance(1.02, 0.93),
    # int8 activations rounded per token (vLLM's W8A8 int8, no smoothing): written after measuring it on
    # the 100 held-out texts (perplexity x1.033, agreement 0.893; per 32-element block instead: x1.007,
    # 0.937), so it guards against regressions and says what the mode costs; it is why w8a8 is opt-in.
    "w8a8": Tolerance(1.04, 0.88),
}


# What a KV cache precision may cost against the float32 cache, scored with chunked prefills
# (each chunk reads its context back from the cache). Measured on 8 held-out texts: bf16 KV
# x1.0000 / 99.9%, int8 KV x1.0021 / 99.0% (BENCHMARKS.md, "KV cache precision").
KV_TOLERANCES = {
    "bfloat16": Tolerance(1.01, 0.97),
    "int8": Tolerance(1.01, 0.97),
}


def next_token_logits(model: LlamaModel, ids: Sequence[int]) -> torch.Tensor:
    """Logits after each prefix ids[: i + 1], i < len(ids) - 1, as float32 [len(ids) - 1, vocab]."""
    n = len(ids)
    if n < 2:
        raise ValueError("need at least two tokens to score")
    cache = KVCache(model.config, -(-n // _BLOCK), _BLOCK, model.dtype, model.device)
    positions = torch.arange(n, device=model.device)
    batch = ForwardBatch(
        input_ids=torch.tensor(list(ids), dtype=torch.long, device=model.device), positions=positions,
        slot_mapping=positions, num_decodes=0, decode_blocks=None, decode_mask=None, decode_context_lens=None,
        prefills=[PrefillSpan(0, n, 0, None)], sample_indices=positions[:-1],
    )
    return model.forward(batch, cache).float()


def chunked_next_token_logits(model: LlamaModel, ids: Sequence[int], kv_dtype: Optional[torch.dtype] = None,
                              chunk: int = _BLOCK) -> torch.Tensor:
    """As next_token_logits, but prefilled `chunk` tokens at a time through a cache storing
    `kv_dtype`: every chunk after the first reads its context back from the cache, so the
    scores include what the cache's precision loses (a one-shot prefill never reads it)."""
    n = len(ids)
    if n < 2:
        raise ValueError("need at least two tokens to score")
    blocks = -(-n // _BLOCK)
    cache = KVCache(model.config, blocks, _BLOCK, model.dtype, model.device, kv_dtype)
    table = torch.arange(blocks, device=model.device)
    out = []
    for start in range(0, n - 1, chunk):
        m = min(chunk, n - start)
        positions = torch.arange(start, start + m, device=model.device)
        context = None if start == 0 else table[:-(-(start + m) // _BLOCK)]
        batch = ForwardBatch(
            input_ids=torch.tensor(list(ids[start:start + m]), dtype=torch.long, device=model.device),
            positions=positions, slot_mapping=positions, num_decodes=0, decode_blocks=None, decode_mask=None,
            decode_context_lens=None, prefills=[PrefillSpan(0, m, start, context)],
            sample_indices=torch.arange(min(m, n - 1 - start), device=model.device),
        )
        out.append(model.forward(batch, cache).float())
    return torch.cat(out)


def next_token_logprobs(model: LlamaModel, ids: Sequence[int], kv_dtype: Optional[torch.dtype] = None,
                        chunk: Optional[int] = None) -> torch.Tensor:
    """log p(ids[i + 1] | ids[: i + 1]) for every i, as float32 [len(ids) - 1]; with `chunk`,
    prefilled in chunks through a cache storing `kv_dtype` (chunked_next_token_logits)."""
    logits = next_token_logits(model, ids) if chunk is None else chunked_next_token_logits(model, ids, kv_dtype, chunk)
    targets = torch.tensor(list(ids[1:]), dtype=torch.long, device=logits.device)
    return torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def perplexity(model: LlamaModel, token_lists: Iterable[Sequence[int]], kv_dtype: Optional[torch.dtype] = None,
               chunk: Optional[int] = None) -> float:
    """exp of the mean negative log-likelihood over every scored token of every text; with
    `chunk`, prefilled in chunks through a cache storing `kv_dtype` (chunked_next_token_logits)."""
    total, count = 0.0, 0
    for ids in token_lists:
        lp = next_token_logprobs(model, ids, kv_dtype, chunk)
        total -= float(lp.sum())
        count += lp.numel()
    return math.exp(total / count)


@dataclass(frozen=True)
class TextScores:
    """A model's teacher-forced scores of some texts, from one prefill per text: its perplexity,
    and its most likely next token at every position of every text."""

    perplexity: float
    choices: tuple[torch.Tensor, ...]  # per text: argmax of the logits after each prefix

    def top1_agreement(self, other: "TextScores") -> float:
        """Fraction of positions where both pick the same next token (see `top1_agreement`)."""
        if len(self.choices) != len(other.choices):
            raise ValueError("scores of different texts")
        same = sum(int((a == b).sum()) for a, b in zip(self.choices, other.choices))
        return same / sum(a.numel() for a in self.choices)


def score_texts(model: LlamaModel, token_lists: Iterable[Sequence[int]]) -> TextScores:
    total, count, choices = 0.0, 0, []
    for ids in token_lists:
        logits = next_token_logits(model, ids)
        targets = torch.tensor(list(ids[1:]), dtype=torch.long, device=logits.device)
        total -= float(torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).sum())
        count += len(ids) - 1
        choices.append(logits.argmax(-1))
    return TextScores(math.exp(total / count), tuple(choices))


def top1_agreement(reference: LlamaModel, model: LlamaModel, token_lists: Iterable[Sequence[int]]) -> float:
    """Fraction of positions (teacher-forced on the texts) where both models' most likely next
    token is the same: per-step greedy agreement, free of the drift that one early difference
    causes in a free-running generation."""
    texts = list(token_lists)
    return score_texts(reference, texts).top1_agreement(score_texts(model, texts))


@dataclass
class Agreement:
    prefix_fraction: float  # generated tokens equal to the reference's before the first difference, over all
    identical_fraction: float  # outputs equal to the reference's from start to end


def greedy_agreement(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> Agreement:
    if len(reference) != len(candidate) or not reference:
        raise ValueError("need the same, non-zero number of reference and candidate outputs")
    matched = total = identical = 0
    for ref, cand in zip(reference, candidate):
        prefix = 0
        for a, b in zip(ref, cand):
            if a != b:
                break
            prefix += 1
        matched += prefix
        total += len(ref)
        identical += list(ref) == list(cand)
    return Agreement(matched / max(total, 1), identical / len(reference))


def load_texts(path: Path, limit: int | None = None) -> list[str]:
    """Texts from a JSON-lines file with a "text" field per line."""
    texts = []
    with open(path) as f:
        for line in f:
            if line.strip():
                texts.append(json.loads(line)["text"])
            if limit is not None and len(texts) >= limit:
                break
    return texts
