"""What moves when a running request changes instance: plain data, never live objects.

A request continues elsewhere from a `ResumeState`: its output tokens so far (with the
prompt, they are everything its continuation depends on: seeded sampling is keyed on the
token index, penalties count the output), how much text its client has already seen, and
its ages (clocks differ between hosts; ages do not). With `block_ids` the KV came along
(a live migration); without, the new instance recomputes it (a failover).

KV moves as raw block bytes in table order: `read_blocks` on the source, `write_blocks`
into blocks the target reserved. Both run off the engine thread: the blocks are pinned
(source) or reserved (target), so no step writes them meanwhile.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from sloserve.engine.model import KVCache


@dataclass
class ResumeState:
    output_token_ids: list[int]
    sent_text_len: int = 0  # characters of output text the client has received
    age_s: float = 0.0  # since arrival: deadlines and queueing order carry over
    first_token_age_s: Optional[float] = None
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (usage reports them)
    num_preemptions: int = 0
    block_ids: Optional[list[int]] = None  # KV already here (reserved for a migration), table order

    def to_json(self) -> dict:
        return {"output_token_ids": self.output_token_ids, "sent_text_len": self.sent_text_len, "age_s": self.age_s,
                "first_token_age_s": self.first_token_age_s, "num_cached_tokens": self.num_cached_tokens,
                "num_preemptions": self.num_preemptions}

    @classmethod
    def from_json(cls, d: dict) -> "ResumeState":
        """Validated: this arrives over the network (from the fleet's own front, but still)."""
        tokens = d.get("output_token_ids")
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            raise ValueError("resume.output_token_ids must be a list of token ids")
        age = d.get("age_s", 0.0)
        first = d.get("first_token_age_s")
        sent = d.get("sent_text_len", 0)
        if not isinstance(age, (int, float)) or age < 0 or (first is not None and not isinstance(first, (int, float))):
            raise ValueError("resume ages must be numbers >= 0")
        if type(sent) is not int or sent < 0:
            raise ValueError("resume.sent_text_len must be an integer >= 0")
        return cls(list(tokens), sent, float(age), None if first is None else float(first),
                   int(d.get("num_cached_tokens", 0)), int(d.get("num_preemptions", 0)))


@dataclass(frozen=True)
class KVLayout:
    """What two instances must agree on to exchange blocks byte for byte."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_bytes: int = field(compare=False)

    @classmethod
    def of(cls, cache: KVCache) -> "KVLayout":
        layers, _, _, heads, dim = cache.data.shape
        per_block = 2 * layers * cache.block_size * heads * dim * cache.data.element_size()
        return cls(layers, cache.block_size, heads, dim, str(cache.data.dtype).removeprefix("torch."), per_block)

    def to_json(self) -> dict:
        return {"num_layers": self.num_layers, "block_size": self.block_size, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": self.dtype, "block_bytes": self.block_bytes}


def _slots(cache: KVCache, block_ids: Sequence[int]) -> torch.Tensor:
    bs = cache.block_size
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=cache.data.device)
    return (ids.unsqueeze(1) * bs + torch.arange(bs, device=cache.data.device)).reshape(-1)


def read_blocks(cache: KVCache, block_ids: Sequence[int]) -> bytes:
    """The KV of whole blocks as bytes: [layers, 2, blocks * block_size, heads, dim], host order."""
    if not block_ids:
        return b""
    data = cache.data[:, :, _slots(cache, block_ids)].contiguous().cpu()
    return data.view(torch.uint8).numpy().tobytes()


def write_blocks(cache: KVCache, block_ids: Sequence[int], payload: bytes) -> None:
    """Write bytes made by `read_blocks` (same layout) into `block_ids`."""
    if not block_ids:
        return
    layers, two, _, heads, dim = cache.data.shape
    n = len(block_ids) * cache.block_size
    expected = layers * two * n * heads * dim * cache.data.element_size()
    if len(payload) != expected:
        raise ValueError(f"KV payload of {len(payload)} bytes for {len(block_ids)} blocks; expected {expected}")
    raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    values = raw.view(cache.data.dtype).view(layers, two, n, heads, dim)
    cache.data[:, :, _slots(cache, block_ids)] = values.to(cache.data.device)
