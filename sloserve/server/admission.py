"""Admission: a bound on requests in flight, and the draining state for shutdown.

The bound is `max_num_seqs + max_queue` engine requests: as many as one batch can run plus
the configured queue. Counting on the event loop (not reading the engine thread's queues)
makes the decision exact under a burst: N simultaneous arrivals see each other at once.
Everything here runs on the event loop thread; no locks needed.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterable, Optional

from sloserve.server.errors import APIError


class Admission:
    def __init__(self, max_running: int, max_queue: int, retry_after_s: int = 1) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.capacity = max_running + max_queue
        self.retry_after_s = retry_after_s
        self._in_flight: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False
        self.drain_started: Optional[float] = None

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def in_flight_ids(self) -> list[str]:
        return list(self._in_flight)

    def check_open(self) -> None:
        if self.draining:
            raise APIError(503, "server is shutting down; retry on another instance", code="draining",
                           headers={"Retry-After": str(self.retry_after_s)})

    def check_room(self, count: int) -> None:
        """APIError 503 while draining, 429 if `count` more requests would exceed the bound."""
        self.check_open()
        if len(self._in_flight) + count > self.capacity:
            raise APIError(
                429,
                f"server is at capacity ({len(self._in_flight)} requests in flight, limit {self.capacity}); "
                "retry later",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            )

    def admit(self, request_ids: Iterable[str]) -> None:
        """Take slots for these engine requests, all or none (APIError 429/503 otherwise)."""
        ids = list(request_ids)
        self.check_room(len(ids))
        duplicate = self._in_flight.intersection(ids)
        if duplicate:
            raise APIError(400, f"request id {sorted(duplicate)[0]!r} is already in flight", param="X-Request-Id")
        self._in_flight.update(ids)
        self._idle.clear()

    def release(self, request_id: str) -> None:
        self._in_flight.discard(request_id)
        if not self._in_flight:
            self._idle.set()

    def start_draining(self) -> None:
        if not self.draining:
            self.draining = True
            self.drain_started = time.monotonic()

    async def wait_idle(self, timeout: float) -> bool:
        """True when nothing is in flight before the timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, timeout))
            return True
        except asyncio.TimeoutError:
            return not self._in_flight

    async def drain(self, grace_s: float, abort: Callable[[str], None], settle_s: float = 5.0) -> int:
        """Stop admitting, let requests finish within `grace_s`, abort the rest; returns how many."""
        self.start_draining()
        if await self.wait_idle(grace_s):
            return 0
        leftovers = self.in_flight_ids()
        for request_id in leftovers:
            abort(request_id)
        await self.wait_idle(settle_s)  # their handlers answer with finish_reason "abort"
        return len(leftovers)
