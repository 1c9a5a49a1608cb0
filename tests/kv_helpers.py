"""Checks shared by the KV state machines: a shadow copy of block contents (what a device
would hold) must agree with what the KV manager claims."""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from sloserve.kv.manager import KVCacheManager
from sloserve.core.types import Request


def assert_tables_read_back(kv: KVCacheManager, requests: Iterable[Request], content: Mapping[int, Sequence],
                            block_size: int) -> None:
    """Each request's block table, read through the shadow contents, gives its computed tokens."""
    for req in requests:
        table = kv.block_table(req.request_id)
        got = [content[table[p // block_size]][p % block_size] for p in range(req.num_computed_tokens)]
        assert got == req.all_token_ids[:req.num_computed_tokens], req.request_id


def assert_cached_blocks_unchanged(kv: KVCacheManager, content: Mapping[int, Sequence],
                                   first_cached: Mapping[int, tuple]) -> None:
    """A block with a content key still holds what it held when it was first cached under it."""
    for block in kv.pool.blocks:
        if block.block_hash is not None:
            assert tuple(content[block.block_id]) == first_cached[block.block_hash]
