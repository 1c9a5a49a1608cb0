"""The tokenizer prompts are synthesized with: the served model's, wherever it comes from.

Lives apart from the rest of `bench/` because it may import the engine (and so torch); the
workload, metric and report code only ever see the resulting object.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence


class HFTokenizerFile:
    """A bare `tokenizer.json` (e.g. copied from a vLLM model directory) as a TokenizerLike."""

    def __init__(self, path: str | Path) -> None:
        import tokenizers

        self._tok = tokenizers.Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def load_bench_tokenizer(path: Optional[str]):
    """`tokenizer.json`, a GGUF file, an HF model directory, or None for sloserve's embedded model."""
    if path is not None and str(path).endswith(".json"):
        return HFTokenizerFile(path)
    from sloserve.engine.weights import load_tokenizer

    return load_tokenizer(path)
