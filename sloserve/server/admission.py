"""Admission: a bound on requests in flight, and the draining state for shutdown.

The bound is `max_num_seqs + max_queue` engine requests: as many as one batch can run plus
the configured queue. Counting on the event loop (not reading the engine thread's queues)
makes the decision exact under a burst: N simultaneous arrivals see each other at once.
Everything here runs on the event loop thread; no locks needed.

Two more questions are asked here: can a request *ever* fit (more engine requests than the
bound is a 400, not a 429 the client would retry forever), and, with a shedder, can it still
meet its TTFT target (`check_deadline`, after tokenization, when its size is known).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Callable, Iterable, Optional

from sloserve.server.errors import APIError
from sloserve.server.shedding import Shedder
from sloserve.server.tenants import client_request_id
from sloserve.core.types import QoSClass


class Admission:
    def __init__(self, max_running: int, max_queue: int, retry_after_s: int = 1,
                 shedder: Optional[Shedder] = None) -> None:
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.capacity = max_running + max_queue
        self.retry_after_s = retry_after_s
        self.shedder = shedder
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
        """APIError 400 if `count` requests can never fit the bound, 503 while draining, 429 if
        `count` more would exceed it now."""
        if count > self.capacity:
            raise APIError(
                400,
                f"this request needs {count} sequences (prompts x n) but the server holds at most "
                f"{self.capacity} in flight; send fewer prompts or a smaller n",
                param="n", code="exceeds_capacity")
        self.check_open()
        if len(self._in_flight) + count > self.capacity:
            raise APIError(
                429,
                f"server is at capacity ({len(self._in_flight)} requests in flight, limit {self.capacity}); "
                "retry later",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            )

    def check_deadline(self, prompt_tokens: int, qos: QoSClass, priority: Optional[int] = None, *,
                       count: int = 1, max_tokens: Optional[int] = None) -> None:
        """APIError 429 `slo_unattainable` (with Retry-After) when the engine's load already puts
        this request's first token past its class's TTFT target. Call after tokenization, right
        before `admit` with no await in between: the shedder records the work it passed for the
        ids `admit` takes next. `prompt_tokens` sums all `count` engine requests; `max_tokens` is
        each one's. A no-op without a shedder or for classes without a TTFT target."""
        self.check_open()
        if self.shedder is not None:
            self.shedder.check(prompt_tokens, qos, priority, count=count, max_tokens=max_tokens)

    def admit(self, request_ids: Iterable[str]) -> None:
        """Take slots for these engine requests, all or none (APIError 429/503 otherwise)."""
        ids = list(request_ids)
        self.check_room(len(ids))
        duplicate = self._in_flight.intersection(ids)
        if duplicate:
            raise APIError(400, f"request id {client_request_id(sorted(duplicate)[0])!r} is already in flight",
                           param="X-Request-Id")
        self._in_flight.update(ids)
        self._idle.clear()
        if self.shedder is not None:
            self.shedder.on_admit(ids)

    def first_token(self, request_id: str) -> None:
        """The engine request's first token reached its handler: the shedder learns from it."""
        if self.shedder is not None:
            self.shedder.on_first_token(request_id)

    def release(self, request_id: str) -> None:
        self._in_flight.discard(request_id)
        if self.shedder is not None:
            self.shedder.on_release(request_id)
        if not self._in_flight:
            self._idle.set()

    def take_slot(self, prefix: str) -> str:
        """One slot for work that is not an engine request (tokenizing): 429/503 like generation
        when the server is full, so a flood of it cannot take the CPU without bound. Give it
        back with `release`."""
        slot_id = f"{prefix}-{uuid.uuid4().hex}"
        self.admit([slot_id])
        return slot_id

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
