"""The shared KV tier: a Valkey/Redis server every instance of the fleet reaches.

Why Valkey/Redis: it is the store the field already runs (LMCache and vLLM's KV connectors ship
Redis backends), it has a Debian package and a maintained Python client, bounds its memory with
LRU eviction (`sloserve kv-store` starts it so), and needs no GPU or RDMA, where Mooncake's store
and LMCache's server target CUDA hosts. One block is one value under
`sloserve:kv:<fingerprint>:<key hex>`: the fingerprint names the model and KV layout, the key
chains over the tokens and the tenant's salt (a keyed hash), so a tenant never reads another's
blocks and a different model never reads this one's.

The store changes under us (other instances write, the server evicts), so presence is asked,
not assumed; a block we wrote or saw is remembered only to skip writing it again. A store that
stops answering costs cache hits, never a request: lookups find nothing and saves are dropped
for a back-off period, and a load that misses makes its requests recompute (engine.py).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Iterable, Sequence

import numpy as np
import torch

from sloserve.kv.hashing import BlockHash

logger = logging.getLogger(__name__)


class KVStoreClient:
    def __init__(self, url: str, fingerprint: str, block_shape: tuple[int, ...], dtype: torch.dtype,
                 timeout_s: float = 2.0, backoff_s: float = 10.0, remember: int = 200_000) -> None:
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - a dev install has it
            raise RuntimeError("--kv-store needs the redis client: pip install 'sloserve[kvstore]'") from exc
        self._errors = (redis.exceptions.RedisError, OSError)
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        try:
            self._redis.ping()
        except self._errors as exc:
            raise ValueError(f"cannot reach the KV store at {url}: {exc}") from exc
        self.url = url
        self.prefix = f"sloserve:kv:{fingerprint}:".encode()
        self.block_shape = block_shape
        self.dtype = dtype
        self.bytes_per_block = int(np.prod(block_shape)) * torch.empty((), dtype=dtype).element_size()
        self._known: OrderedDict[BlockHash, None] = OrderedDict()
        self._lock = threading.Lock()  # saves run on the engine's tier thread, lookups on its step thread
        self._remember = remember
        self._backoff_s = backoff_s
        self._down_until = 0.0

    def _name(self, key: BlockHash) -> bytes:
        return self.prefix + f"{key:032x}".encode()

    def _up(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: Exception) -> None:
        self._down_until = time.monotonic() + self._backoff_s
        logger.warning("KV store %s: %s failed (%s); not using it for %.0f s", self.url, what, exc, self._backoff_s)

    # ---- the SharedIndex the KV manager asks --------------------------------------------
    def leading(self, keys: Sequence[BlockHash]) -> int:
        n = 0
        with self._lock:
            while n < len(keys) and keys[n] in self._known:
                n += 1
        if n == len(keys) or not self._up():
            return n
        rest = keys[n:]
        try:
            pipe = self._redis.pipeline(transaction=False)
            for key in rest:
                pipe.exists(self._name(key))
            present = pipe.execute()
        except self._errors as exc:
            self._failed("lookup", exc)
            return n
        for key, there in zip(rest, present):
            if not there:
                break
            self._note([key])
            n += 1
        return n

    def saved(self, keys: Iterable[BlockHash]) -> None:
        self._note(keys)

    def forget(self, keys: Iterable[BlockHash]) -> None:
        with self._lock:
            for key in keys:
                self._known.pop(key, None)

    def _note(self, keys: Iterable[BlockHash]) -> None:
        with self._lock:
            for key in keys:
                self._known[key] = None
                self._known.move_to_end(key)
            while len(self._known) > self._remember:
                self._known.popitem(last=False)

    # ---- the byte mover the engine's TierMovers calls -----------------------------------
    def save(self, blocks: torch.Tensor, keys: list[BlockHash]) -> None:
        """`blocks`: (n, *block_shape) on the CPU. Raises OSError when the store fails."""
        if not self._up():
            self.forget(keys)
            return
        data = blocks.contiguous().view(torch.uint8).numpy()
        try:
            pipe = self._redis.pipeline(transaction=False)
            for i, key in enumerate(keys):
                pipe.set(self._name(key), memoryview(data[i]).cast("B").tobytes())
            pipe.execute()
        except self._errors as exc:
            self.forget(keys)
            self._failed("save", exc)
            raise OSError(str(exc)) from exc

    def load(self, keys: list[BlockHash]) -> torch.Tensor:
        """(n, *block_shape) on the CPU. Raises OSError when any block is missing or short."""
        try:
            values = self._redis.mget([self._name(k) for k in keys])
        except self._errors as exc:
            self._failed("load", exc)
            raise OSError(str(exc)) from exc
        out = torch.empty((len(keys), *self.block_shape), dtype=self.dtype)
        raw = out.view(torch.uint8).numpy()
        for i, (key, value) in enumerate(zip(keys, values)):
            if value is None or len(value) != self.bytes_per_block:
                self.forget([key])
                raise OSError(f"KV store lost block {key:032x}")
            raw[i].reshape(-1)[:] = np.frombuffer(value, dtype=np.uint8)
        return out
