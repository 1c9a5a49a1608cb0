"""Content keys for full KV blocks.

A block's key chains over its parent's key, so equal keys mean equal whole prefixes, not
just equal 16-token windows. The tenant salt keeps one tenant's cached prefix from
serving another. blake2b (not Python's hash) keeps keys stable across processes, which
the cluster router relies on when it compares prefix summaries from several workers.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Optional, Sequence

BlockHash = int


def hash_block(parent: Optional[BlockHash], tokens: Sequence[int], salt: str = "") -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update((parent or 0).to_bytes(16, "little"))
    h.update(array("q", tokens).tobytes())
    if salt:
        h.update(salt.encode())
    return int.from_bytes(h.digest(), "little")


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str = "",
    start_parent: Optional[BlockHash] = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Keys of every full block of `token_ids` from block `start_block` on."""
    keys: list[BlockHash] = []
    parent = start_parent
    for b in range(start_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[b * block_size:(b + 1) * block_size], salt)
        keys.append(parent)
    return keys
