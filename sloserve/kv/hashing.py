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


def pack_tokens(token_ids: Sequence[int], start: int, stop: int) -> bytes:
    """Ids [start, stop) as the int64 bytes block keys hash. A sequence with its own
    `packed(start, stop)` (the simulator's synthetic prompts) packs without making Python ints."""
    packed = getattr(token_ids, "packed", None)
    if packed is not None:
        return packed(start, stop)
    return array("q", token_ids[start:stop]).tobytes()


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
    packed = pack_tokens(token_ids, start_block * block_size, end_block * block_size)
    return hash_packed_blocks(packed, block_size, salt, start_parent)


def hash_packed_blocks(packed: bytes, block_size: int, salt: str = "",
                       parent: Optional[BlockHash] = None) -> list[BlockHash]:
    """Keys of the whole blocks in `packed` (from `pack_tokens`), chained on from `parent`."""
    salt_bytes = salt.encode() if salt else b""
    step = block_size * _TOKEN_BYTES
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes
    # The loop carries the parent's digest as bytes: the key is the digest read as an integer.
    digest = (parent or 0).to_bytes(_KEY_BYTES, "little")
    keys: list[BlockHash] = []
    for offset in range(0, len(packed) - step + 1, step):
        digest = blake2b(digest + packed[offset:offset + step] + salt_bytes, digest_size=_KEY_BYTES).digest()
        keys.append(from_bytes(digest, "little"))
    return keys
