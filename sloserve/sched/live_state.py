"""An instance's state as a router reads it in the same process, computed field by field.

A router of a 64-instance fleet reads two counters of each instance per arrival; the simulator
routes a million arrivals. So one live view per instance lives for the whole run, and a shared
`Moment` says when it is read: counters read the scheduler directly, fields that walk a queue
are computed on first read at a moment and kept until the moment moves on.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Optional

from sloserve.sched.state import InstanceState, KeySetIndex, PrefixIndex, _LoadMeasures


class Moment:
    """When live states are read. `advance` starts a new moment: every view recomputes what it
    had kept, since anything may have changed in between (even at the same simulated time)."""

    __slots__ = ("now", "tick")

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.tick = 0

    def advance(self, now: float) -> None:
        self.now = now
        self.tick += 1


def _per_moment(compute: Callable[["LiveInstanceState"], Any]) -> property:
    """A field computed on its first read at each moment (routers read some several times)."""
    name = compute.__name__

    def read(self: "LiveInstanceState") -> Any:
        memo = self._memo if self._tick == self._moment.tick else self._start_moment()
        if name in memo:
            return memo[name]
        value = memo[name] = compute(self)
        return value

    read.__doc__ = compute.__doc__
    return property(read)


class LiveInstanceState(_LoadMeasures):
    """A scheduler's InstanceState at the current `Moment`.

    `catch_up(now)` (the simulator's: apply the steps of a fast-forwarded decode run that ended
    before now) runs once per moment, before the first field that steps change is read. The
    request counts do not need it: a run keeps its running set until its last step."""

    def __init__(self, scheduler: Any, moment: Moment,
                 catch_up: Optional[Callable[[float], None]] = None) -> None:
        self._s = scheduler
        self._moment = moment
        self._catch_up = catch_up
        self._tick = moment.tick - 1  # nothing kept yet
        self._memo: dict[str, Any] = {}
        self._caught_up = False

    def _start_moment(self) -> dict[str, Any]:
        self._tick = self._moment.tick
        self._memo = {}
        self._caught_up = False
        return self._memo

    def _current(self) -> Any:  # a sched.scheduler.Scheduler (not imported here: it imports this module)
        """The scheduler, brought up to the moment (called from per-moment fields only)."""
        if not self._caught_up:
            self._caught_up = True
            if self._catch_up is not None:
                self._catch_up(self._moment.now)
        return self._s

    @property
    def num_running(self) -> int:  # type: ignore[override]
        return len(self._s.running)

    @property
    def num_waiting(self) -> int:  # type: ignore[override]
        return len(self._s.waiting)

    @property
    def num_requests(self) -> int:  # the one field least-requests reads, read 64 times an arrival
        s = self._s
        return len(s.running) + len(s.waiting)

    @property
    def kv_blocks_total(self) -> int:  # type: ignore[override]
        return self._s.kv.num_blocks

    @property
    def block_size(self) -> int:
        return self._s.kv.block_size

    @property
    def prefix_cache_hit_rate(self) -> float:  # counted at admissions, which a decode run has none of
        return self._s.kv.stats.hit_rate

    @_per_moment
    def kv_blocks_used(self) -> int:
        return self._current().kv.pool.num_used

    @_per_moment
    def kv_blocks_free(self) -> int:
        return self._current().kv.num_free_blocks

    @_per_moment
    def prefix_index(self) -> Optional[PrefixIndex]:
        kv = self._current().kv
        return KeySetIndex(kv.held_keys()) if kv.enable_prefix_caching else None

    @_per_moment
    def queued_prefill_tokens(self) -> int:
        s = self._current()
        return (sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in s.running)
                + sum(r.num_tokens for r in s.waiting))

    @_per_moment
    def kv_blocks_waiting(self) -> int:
        bs = self.block_size
        return sum(-(-r.num_tokens // bs) for r in self._s.waiting)

    @_per_moment
    def predicted_remaining_decode_tokens(self) -> int:
        total = 0
        s = self._current()
        for r in itertools.chain(s.running, s.waiting):
            expected = r.predicted_output_len if r.predicted_output_len is not None else r.max_output_tokens
            total += max(0, (expected or 0) - r.num_output_tokens)
        return total

    @_per_moment
    def min_ttft_slack_s(self) -> float:
        now = self._moment.now
        return min((r.ttft_deadline - now for r in self._s.waiting if r.first_token_time is None), default=math.inf)

    def freeze(self) -> InstanceState:
        return InstanceState(
            num_running=self.num_running, num_waiting=self.num_waiting,
            queued_prefill_tokens=self.queued_prefill_tokens, kv_blocks_used=self.kv_blocks_used,
            kv_blocks_free=self.kv_blocks_free, kv_blocks_total=self.kv_blocks_total,
            predicted_remaining_decode_tokens=self.predicted_remaining_decode_tokens,
            prefix_cache_hit_rate=self.prefix_cache_hit_rate, min_ttft_slack_s=self.min_ttft_slack_s,
            block_size=self.block_size, kv_blocks_waiting=self.kv_blocks_waiting, prefix_index=self.prefix_index)
