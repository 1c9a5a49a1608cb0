"""Prompts of exact token lengths, synthesized from ShareGPT text with the served model's tokenizer.

Traces such as Azure and Mooncake give only token counts. To make a server do real work of the
right size, each request gets a prompt of exactly `prompt_len` tokens of the served model's
tokenizer, cut from a pool of tokenized ShareGPT prompts (natural text, not random ids, so
attention and sampling see realistic input). Prefix reuse is made real: the tokens of a
Mooncake-style hash id are a pure function of (seed, id), so requests sharing leading hash ids
share those prompt blocks token for token. Requests that share nothing start with a distinct
tag, so no accidental prefix is shared either.

The tokenizer is a parameter (anything with `encode(text) -> list[int]` and `decode(ids) -> str`),
so this module imports neither torch nor the engine and the simulator can use it too.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import replace
from typing import Iterable, Literal, Optional, Protocol, Sequence

from sloserve.workload.types import WorkloadRequest

log = logging.getLogger(__name__)

PromptFormat = Literal["tokens", "text"]


class TokenizerLike(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class PromptSynthesizer:
    """Builds prompt token ids (or text) of exact lengths from a token pool.

    A prompt is a short tag followed by segments of `segment_tokens` tokens copied from
    pseudo-random offsets of the pool. Offsets come from a keyed hash, not from shared RNG
    state, so the same key always yields the same tokens, in any order and in any process.
    """

    def __init__(self, tokenizer: TokenizerLike, corpus: Iterable[str], seed: int = 0,
                 pool_tokens: int = 1 << 17, segment_tokens: int = 64) -> None:
        self.tokenizer = tokenizer
        self.seed = seed
        self.segment_tokens = segment_tokens
        pool: list[int] = []
        sep = tokenizer.encode("\n\n")
        for text in corpus:
            pool.extend(tokenizer.encode(text))
            pool.extend(sep)
            if len(pool) >= pool_tokens:
                break
        if len(pool) < 2 * segment_tokens:
            raise ValueError(f"corpus too small: {len(pool)} tokens, need at least {2 * segment_tokens}")
        self.pool = pool
        log.debug("prompt pool: %d tokens", len(pool))

    # ------------------------------------------------------------------ primitives

    def _offset(self, key: str, i: int) -> int:
        h = hashlib.blake2b(f"{self.seed}:{key}:{i}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "little") % (len(self.pool) - self.segment_tokens)

    def _fill(self, key: str, length: int) -> list[int]:
        """`length` tokens for `key`: a tag that makes the key's tokens unique, then pool segments."""
        out = self.tokenizer.encode(f"[{key}] ")[:length]
        i = 0
        while len(out) < length:
            o = self._offset(key, i)
            out.extend(self.pool[o:o + min(self.segment_tokens, length - len(out))])
            i += 1
        return out

    def block(self, hash_id: int, size: int) -> list[int]:
        """The tokens of prefix block `hash_id` (identical wherever that id appears)."""
        return self._fill(f"b{hash_id}", size)

    # ------------------------------------------------------------------ requests

    def token_ids(self, req: WorkloadRequest) -> list[int]:
        """Exactly `req.prompt_len` tokens; shared hash ids give shared leading blocks."""
        n = req.prompt_len
        if req.hash_ids and req.hash_block_size:
            ids: list[int] = []
            for h in req.hash_ids:
                if len(ids) >= n:
                    break
                ids.extend(self.block(h, req.hash_block_size))
            if len(ids) < n:  # more tokens than the blocks cover: a private tail
                ids.extend(self._fill(f"t{req.request_id}", n - len(ids)))
            return ids[:n]
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids[:n])
        if req.prompt_text is not None:
            return self.tokenizer.encode(req.prompt_text)[:n]
        return self._fill(f"r{req.request_id}", n)

    def text(self, req: WorkloadRequest, max_rounds: int = 8) -> str:
        """A text that re-encodes to `req.prompt_len` tokens (as near as decoding allows).

        Decoding ids and encoding the text again can merge or split tokens at segment seams, so
        the ids are trimmed or extended by the difference and retried a few times.
        """
        target = req.prompt_len
        ids = self.token_ids(req)
        extra_key = f"x{req.request_id}"
        best_text, best_err = self.tokenizer.decode(ids), None
        for round_ in range(max_rounds):
            text = self.tokenizer.decode(ids)
            got = len(self.tokenizer.encode(text))
            err = got - target
            if best_err is None or abs(err) < abs(best_err):
                best_text, best_err = text, err
            if err == 0:
                break
            if err > 0:
                ids = ids[:max(0, len(ids) - err)]
            else:
                o = self._offset(extra_key, round_)
                ids = ids + self.pool[o:o - err]
        if best_err:
            log.debug("request %s: text prompt is %+d tokens off", req.request_id, best_err)
        return best_text

    def synthesize(self, requests: Iterable[WorkloadRequest], fmt: PromptFormat = "tokens",
                   recount_text: bool = True, max_prompt_len: Optional[int] = None) -> list[WorkloadRequest]:
        """Give every request a prompt in `fmt`.

        Requests that already have text (ShareGPT) keep it in text format, re-counted with this
        tokenizer so `prompt_len` is in the served model's tokens; in token format (or when the
        text is longer than `max_prompt_len`) they are sent as their tokenized text, truncated.
        """
        out = []
        for r in requests:
            if r.prompt_text is not None and r.hash_ids is None:
                ids = self.tokenizer.encode(r.prompt_text)
                too_long = max_prompt_len is not None and len(ids) > max_prompt_len
                if fmt == "text" and not too_long:
                    out.append(replace(r, prompt_len=len(ids) if recount_text else r.prompt_len))
                    continue
                ids = ids[:max_prompt_len] if too_long else ids
                if fmt == "text":
                    out.append(replace(r, prompt_text=self.tokenizer.decode(ids), prompt_len=len(ids)))
                else:
                    out.append(replace(r, prompt_text=None, prompt_token_ids=ids, prompt_len=len(ids)))
                continue
            if fmt == "tokens":
                out.append(replace(r, prompt_token_ids=self.token_ids(r), prompt_text=None))
            else:
                out.append(replace(r, prompt_text=self.text(r), prompt_token_ids=None))
        return out
