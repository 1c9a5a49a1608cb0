"""Prompt token ids for simulated requests, without storing them.

The simulated KV manager hashes prompt blocks exactly as the engine's does, so prefix reuse in
a trace must show up as equal token ids: blocks named by the same Mooncake `hash_id` get the
same ids, everything else gets ids no other request has. A trace of a million requests would
need tens of GB as Python lists; these sequences compute each id on demand instead.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Optional, Union, overload

import numpy as np

_REQUEST_SPACE = 1 << 40  # unique-token namespace per request
_HASH_SPACE = 1 << 62  # shared-prefix namespace per hash id, far from every request's


class SyntheticPrompt(Sequence):
    """`length` token ids: shared blocks for `hash_ids` (of `hash_block` tokens), then unique ids."""

    __slots__ = ("length", "uid", "hash_ids", "hash_block")

    def __init__(self, length: int, uid: int, hash_ids: Optional[tuple[int, ...]] = None, hash_block: int = 512):
        self.length = length
        self.uid = uid
        self.hash_ids = hash_ids or ()
        self.hash_block = hash_block

    def __len__(self) -> int:
        return self.length

    def _at(self, i: int) -> int:
        b = i // self.hash_block
        if b < len(self.hash_ids):
            return _HASH_SPACE + self.hash_ids[b] * self.hash_block + i % self.hash_block
        return (self.uid + 1) * _REQUEST_SPACE + i

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: Union[int, slice]):
        if isinstance(i, slice):
            start, stop, step = i.indices(self.length)
            if step != 1:
                return [self._at(j) for j in range(start, stop, step)]
            return self._span(start, stop)
        if i < 0:
            i += self.length
        if not 0 <= i < self.length:
            raise IndexError(i)
        return self._at(i)

    def _span(self, start: int, stop: int) -> list[int]:
        """Ids of [start, stop) built from ranges (the KV manager hashes prompts block by block)."""
        out: list[int] = []
        for first, count in self._runs(start, stop):
            out.extend(range(first, first + count))
        return out

    def packed(self, start: int, stop: int) -> bytes:
        """Ids of [start, stop) as int64 bytes, what `sloserve.kv.hashing.pack_tokens` makes of
        a list, built without a Python int per token (block keys of a million prompts)."""
        start, stop, _ = slice(start, stop).indices(self.length)
        return b"".join(np.arange(first, first + count, dtype=np.int64).tobytes()
                        for first, count in self._runs(start, stop))

    def _runs(self, start: int, stop: int) -> Iterator[tuple[int, int]]:
        """[start, stop) as runs of consecutive ids: (first id, count)."""
        shared_end = min(stop, len(self.hash_ids) * self.hash_block)
        pos = start
        while pos < shared_end:
            b, off = divmod(pos, self.hash_block)
            end = min(shared_end, (b + 1) * self.hash_block)
            yield _HASH_SPACE + self.hash_ids[b] * self.hash_block + off, end - pos
            pos = end
        if pos < stop:
            yield (self.uid + 1) * _REQUEST_SPACE + pos, stop - pos

    def __add__(self, other):  # Request.all_token_ids (only the real executor needs it)
        return self[:] + list(other)
