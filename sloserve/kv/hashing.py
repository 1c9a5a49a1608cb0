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


_KEY_BYTES = 16
_TOKEN_BYTES = 8  # int64: every vocabulary fits, and so do the simulator's synthetic ids


def hash_block(parent: Optional[BlockHash], tokens: Sequence[int], salt: str = "") -> BlockHash:
    return _key(parent, array("q", tokens).tobytes(), salt.encode() if salt else b"")


def _key(parent: Optional[BlockHash], token_bytes: bytes, salt: bytes) -> BlockHash:
    data = (parent or 0).to_bytes(_KEY_BYTES, "little") + token_bytes + salt
    return int.from_bytes(hashlib.blake2b(data, digest_size=_KEY_BYTES).digest(), "little")


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str = "",
    start_parent: Optional[BlockHash] = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Keys of every full block of `token_ids` from block `start_block` on (the same keys as
    chaining hash_block, with the tokens packed once rather than once per block)."""
    end_block = len(token_ids) // block_size
    if end_block <= start_block:
        return []
    packed = memoryview(array("q", token_ids[start_block * block_size:end_block * block_size]).tobytes())
    salt_bytes = salt.encode() if salt else b""
    step = block_size * _TOKEN_BYTES
    keys: list[BlockHash] = []
    parent = start_parent
    for offset in range(0, len(packed), step):
        parent = _key(parent, packed[offset:offset + step], salt_bytes)
        keys.append(parent)
    return keys
