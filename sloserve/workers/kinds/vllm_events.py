"""What a stock vLLM server's prefix cache holds, from its KV events (`--kv-events-config`, ZMQ),
as the fleet's prefix-aware routers read any worker's: a set of sloserve block keys.

vLLM publishes, per engine step, a msgpack `KVEventBatch` [timestamp, events, dp rank] in a
three-frame ZMQ message (topic, 8-byte big-endian sequence number, payload). Its events:
`BlockStored` (its block hashes, the parent block's hash, the blocks' token ids, block size),
`BlockRemoved` (hashes) and `AllBlocksCleared`. vLLM's hashes are its own (sha256 over its keys,
or a per-process seed): this index re-keys every stored block with kv/hashing.hash_block over
its token ids, chained on its parent's key and salted with the prefix's cache salt (the first
block's extra key; the front sends each request's tenant salt as vLLM's `cache_salt`), so the
keys are the ones the routers compute from a request's prompt (cluster/routers/prefix.py). A
block whose parent this index never saw is not keyed (its prefix cannot be matched from the
start anyway).

Sequence numbers count batches per publisher: a gap means lost events, which the subscriber asks
the replay socket for; so does a subscriber that starts after the worker (what it cached before
is in the replay buffer). A number seen before is skipped; one that goes back to 0, or further
back than the replay buffer reaches, means the worker restarted, and the index starts over.
Whatever the payload, a malformed batch is counted and skipped, never raised into the fleet's
loop."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from sloserve.kv.hashing import hash_block

logger = logging.getLogger(__name__)

SEQ_BYTES = 8
REPLAY_WINDOW = 10_000  # vLLM's replay buffer (`buffer_steps`): an older number is a restarted publisher's


class EventError(ValueError):
    """A KV event message this index cannot read."""


@dataclass
class KVEventIndex:
    """One worker's cached blocks, keyed as sloserve keys them."""

    max_blocks: int = 1_000_000  # a bound on memory: past it, the oldest keys are forgotten first
    # vLLM's block hash -> (sloserve key, the prefix's cache salt), in insertion order
    keys: dict[Any, tuple[int, str]] = field(default_factory=dict)
    last_seq: Optional[int] = None
    counters: dict[str, int] = field(default_factory=lambda: {"batches": 0, "stored": 0, "removed": 0, "cleared": 0,
                                                              "gaps": 0, "restarts": 0, "malformed": 0,
                                                              "orphans": 0})
    block_size: int = 0  # as the events say

    _frozen: Optional[frozenset[int]] = field(default=None, init=False, repr=False)  # prefix_keys till a change

    @property
    def prefix_keys(self) -> frozenset[int]:
        """The keys a router matches a prompt against (built once per change, not once per poll)."""
        if self._frozen is None:
            self._frozen = frozenset(key for key, _ in self.keys.values())
        return self._frozen

    def reset(self) -> None:
        self._frozen = None
        self.keys.clear()
        self.last_seq = None

    def receive(self, frames: list[bytes]) -> Optional[int]:
        """Apply one ZMQ message (topic, sequence number, payload). On a gap nothing is applied:
        the first missing sequence number is returned, and the caller hands the batches from
        there on (the replay socket's, else this message alone) to `replayed`."""
        try:
            seq, events = parse_message(frames)
        except EventError as e:
            self.counters["malformed"] += 1
            logger.warning("skipped a malformed KV event message: %s", e)
            return None
        if self.last_seq is not None:
            if seq <= self.last_seq:
                if seq != 0 and self.last_seq - seq <= REPLAY_WINDOW:
                    return None  # seen already (it came in a replay too)
                self.counters["restarts"] += 1  # the publisher restarted: what this index holds is of a process gone
                self.reset()
            elif seq > self.last_seq + 1:
                self.counters["gaps"] += 1
                return self.last_seq + 1
        self.apply(events)
        self.last_seq = seq
        return None

    def replayed(self, messages: list[list[bytes]]) -> None:
        """Apply, in order, the messages a gap's replay brought that this index has not seen."""
        for frames in messages:
            try:
                seq, events = parse_message(frames)
            except EventError as e:
                self.counters["malformed"] += 1
                logger.warning("skipped a malformed replayed KV event message: %s", e)
                continue
            if self.last_seq is None or seq > self.last_seq:
                self.apply(events)
                self.last_seq = seq

    def apply(self, events: list[dict]) -> None:
        self.counters["batches"] += 1
        self._frozen = None
        for event in events:
            kind = event.get("type")
            try:
                if kind == "BlockStored":
                    self._stored(event)
                elif kind == "BlockRemoved":
                    for h in _hashes(event):
                        self.keys.pop(_hashable(h), None)
                        self.counters["removed"] += 1
                elif kind == "AllBlocksCleared":
                    self.keys.clear()
                    self.counters["cleared"] += 1
                # other kinds (newer vLLMs) carry nothing a router reads
            except EventError as e:  # one bad event: the others of its batch still count
                self.counters["malformed"] += 1
                logger.warning("skipped a malformed KV event: %s", e)

    def _stored(self, event: dict) -> None:
        hashes = _hashes(event)
        tokens = event.get("token_ids")
        size = event.get("block_size")
        if not isinstance(tokens, list) or not isinstance(size, int) or size < 1 or len(tokens) != size * len(hashes):
            raise EventError(f"BlockStored with {len(hashes)} hashes, block size {size!r} and "
                             f"{len(tokens) if isinstance(tokens, list) else tokens!r} token ids")
        if event.get("lora_name") or event.get("lora_id"):
            return  # an adapter's blocks: a base-model prompt never matches them
        self.block_size = size
        parent_hash = event.get("parent_block_hash")
        if parent_hash is None:  # a prefix's first block carries its cache salt, the rest inherit it
            parent, salt = None, first_salt(event.get("extra_keys"))
        else:
            found = self.keys.get(_hashable(parent_hash))
            if found is None:
                self.counters["orphans"] += len(hashes)
                return
            parent, salt = found
        for i, h in enumerate(hashes):
            parent = hash_block(parent, tokens[i * size:(i + 1) * size], salt)
            self.keys[_hashable(h)] = (parent, salt)
            self.counters["stored"] += 1
        while len(self.keys) > self.max_blocks:
            self.keys.pop(next(iter(self.keys)))


def parse_message(frames: list[bytes]) -> tuple[int, list[dict]]:
    """(sequence number, events) of one three-frame message."""
    if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
        raise EventError(f"expected 3 frames with an {SEQ_BYTES}-byte sequence number, got {len(frames)} frames")
    return int.from_bytes(frames[1], "big"), decode_batch(frames[2])


def decode_batch(payload: bytes) -> list[dict]:
    """The events of one msgpack KVEventBatch ([ts, events, ...] or a map with `events`)."""
    import msgspec

    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as e:
        raise EventError(f"not msgpack ({e})") from None
    events = batch.get("events") if isinstance(batch, dict) else batch[1] \
        if isinstance(batch, list) and len(batch) >= 2 else None
    if not isinstance(events, list) or not all(isinstance(e, dict) for e in events):
        raise EventError(f"not a KV event batch: {type(batch).__name__}")
    return events


def first_salt(extra_keys: Any) -> str:
    """The cache salt vLLM mixed into a prefix's first block (the request's `cache_salt`, which
    the front sends as sloserve's tenant salt): the first string among that block's extra keys."""
    first = extra_keys[0] if isinstance(extra_keys, list) and extra_keys else None
    return next((k for k in first if isinstance(k, str)), "") if isinstance(first, list) else ""


def _hashes(event: dict) -> list:
    hashes = event.get("block_hashes")
    if not isinstance(hashes, list):
        raise EventError(f"{event.get('type')} without a list of block_hashes")
    return hashes


def _hashable(h: Any) -> Any:
    return bytes(h) if isinstance(h, (bytearray, memoryview)) else h
