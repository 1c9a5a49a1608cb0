"""Memory manager: paged KV blocks, prefix sharing, eviction. Pure Python."""
from sloserve.kv.block_pool import Block, BlockPool
from sloserve.kv.hashing import BlockHash, hash_block, hash_full_blocks
from sloserve.kv.host_pool import HostBlockPool
from sloserve.kv.manager import CopyOp, KVCacheManager, PrefixCacheStats

__all__ = ["Block", "BlockPool", "BlockHash", "CopyOp", "HostBlockPool", "KVCacheManager", "PrefixCacheStats", "hash_block", "hash_full_blocks"]
