"""How much of a request's prompt each instance already holds in its prefix cache.

The router hashes the prompt's leading full blocks exactly as the KV manager does
(`sloserve.kv.hashing`: chained blake2b keys salted with the tenant), and asks every
instance's `PrefixIndex` about them. Keys are computed lazily, one block at a time, only
while some instance still matches: a prompt nobody shares costs one hash, and a shared one
costs its matched depth, capped at `max_blocks`.
"""
from __future__ import annotations

from typing import Sequence

from sloserve.kv.hashing import hash_block
from sloserve.sched.state import InstanceState
from sloserve.core.types import Request

DEFAULT_MAX_BLOCKS = 256  # 4096 tokens at 16-token blocks: deep enough to tell conversations apart


def prefix_matches(request: Request, states: Sequence[InstanceState], max_blocks: int = DEFAULT_MAX_BLOCKS
                   ) -> list[int]:
    """Matched prompt blocks per instance (0 where an instance publishes no index).

    Like the KV manager's lookup, the prompt's last token is never counted as cached (the
    step that computes it produces the first sampled token)."""
    n = len(states)
    matches = [0] * n
    alive = [i for i in range(n) if states[i].prefix_index is not None]
    if not alive:
        return matches
    bs = states[alive[0]].block_size
    prompt = request.prompt_token_ids
    depth = min(max_blocks, (len(prompt) - 1) // bs)
    parent = None
    for b in range(depth):
        key = hash_block(parent, prompt[b * bs:(b + 1) * bs], request.cache_salt)
        alive = [i for i in alive if key in states[i].prefix_index]  # type: ignore[operator]
        if not alive:
            break
        for i in alive:
            matches[i] = b + 1
        parent = key
    return matches
