"""Token log-probabilities in the two OpenAI shapes (completions and chat).

Byte-level BPE tokens can be fragments of a UTF-8 character; such a token is shown as
`bytes:\\xNN...` (OpenAI's convention) and its raw bytes are given in the chat shape, so
clients can reassemble the exact text.
"""
from __future__ import annotations

from typing import Optional, Sequence

from sloserve.engine.outputs import TokenLogprob
from sloserve.engine.tokenizer import Tokenizer
from sloserve.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class TokenStrings:
    """Display string and bytes of token ids, memoized (bounded by the vocabulary)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            try:
                raw = self._tokenizer.token_bytes(token_id)
            except KeyError:
                raw = b""
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            hit = self._cache[token_id] = (text, raw)
        return hit

    def text(self, token_id: int) -> str:
        return self.get(token_id)[0]


def completion_logprobs(
    entries: Sequence[TokenLogprob], strings: TokenStrings, text_offset: int = 0
) -> CompletionLogprobs:
    """`{tokens, token_logprobs, top_logprobs, text_offset}`; offsets continue from `text_offset`."""
    tokens: list[str] = []
    token_logprobs: list[Optional[float]] = []
    top_logprobs: list[Optional[dict[str, float]]] = []
    offsets: list[int] = []
    offset = text_offset
    for entry in entries:
        token = strings.text(entry.token_id)
        tokens.append(token)
        token_logprobs.append(_finite(entry.logprob))
        top: dict[str, float] = {}
        for token_id, lp in entry.top:
            top.setdefault(strings.text(token_id), _finite(lp))
        top_logprobs.append(top)
        offsets.append(offset)
        offset += len(token)
    # Every field set explicitly: streaming chunks are dumped with exclude_unset.
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs,
                              text_offset=offsets)


def chat_logprobs(entries: Sequence[TokenLogprob], strings: TokenStrings) -> ChatLogprobs:
    """`{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`."""
    content = []
    for entry in entries:
        text, raw = strings.get(entry.token_id)
        top = []
        for token_id, lp in entry.top:
            t, b = strings.get(token_id)
            top.append(TopLogprob(token=t, logprob=_finite(lp), bytes=list(b)))
        content.append(ChatTokenLogprob(token=text, logprob=_finite(entry.logprob), bytes=list(raw), top_logprobs=top))
    return ChatLogprobs(content=content)


def _finite(lp: Optional[float]) -> float:
    """JSON has no -inf; OpenAI clients expect a number (vLLM uses the same floor)."""
    if lp is None or lp != lp:
        return -9999.0
    return max(float(lp), -9999.0)
