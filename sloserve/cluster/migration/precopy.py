"""When a live migration stops copying in the background and suspends the request: the one rule
both backends follow (the worker's `server/worker_migration.py`, the simulator's `sim/migration.py`).

A move copies the request's KV in rounds while it keeps decoding; each round sends what the
previous ones did not. Once less than a block's worth is left, or after `max_rounds`, another round
would cost about as much as it saves, so the request is suspended and the rest is copied in one
stop-and-copy (its downtime). The first round always runs."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrecopyRule:
    max_rounds: int = 4  # pre-copy rounds, the first included, before the stop-and-copy

    def another_round(self, rounds_done: int, tokens_left: int, block_size: int) -> bool:
        """After `rounds_done` rounds, with `tokens_left` computed tokens not yet sent: copy
        again while the request runs (True), or suspend it and copy the rest (False)."""
        return rounds_done < self.max_rounds and tokens_left > block_size


PRECOPY = PrecopyRule()
