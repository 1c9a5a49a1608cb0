"""A request's hand-over between instances (live migration, P/D hand-off, failover resume): the
source suspends it and can take it back or drop it; the target checks for a seat and adopts it with
the KV blocks it received. A mixin of `Scheduler`."""
from __future__ import annotations

from typing import Optional

from sloserve.core.types import Request, RequestStatus


class Handover:
    def suspend(self, request_id: str) -> Optional[Request]:
        """Take a running request out of scheduling with its blocks (the stop-and-copy of a
        migration: its KV must not change while the last blocks are copied). None if the
        request is unknown, not running, or has a prefill chunk left (it only moves between
        steps, with all its tokens but the last computed)."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            return None
        if request.num_tokens - request.num_computed_tokens != 1:
            return None
        self.running.remove(request)
        request.status = RequestStatus.MIGRATING
        self.suspended[request_id] = request
        return request

    def unsuspend(self, request_id: str, now: float) -> None:
        """A migration failed: the suspended request goes on here, KV intact."""
        request = self.suspended.pop(request_id, None)
        if request is None:
            return
        request.status = RequestStatus.RUNNING
        self._insert_sorted(self.running, request, now)

    def drop_suspended(self, request_id: str, now: float) -> Optional[Request]:
        """A migration completed: the request now lives elsewhere; free its blocks here."""
        request = self.suspended.pop(request_id, None)
        if request is None:
            return None
        self.kv.free(request)
        del self.requests[request_id]
        del self._seq[request_id]
        if self.speculator is not None:
            self.speculator.forget(request_id)
        self.stats.num_migrated_out += 1
        if self._tracker is not None:
            self._tracker.on_departure(request)
        return request

    def has_seat(self, incoming: int = 0) -> bool:
        """Whether one more request can join the running batch, with `incoming` adoptions already
        promised seats (their KV in flight). A migration or hand-off needs a seat as well as KV
        room: `max_num_seqs` sizes the step's batch (activations, logits, graph buckets), and a
        target that adopted past it would run larger batches than it was sized for."""
        return len(self.running) + incoming < self.config.max_num_seqs

    def adopt(self, request: Request, block_ids: list[int], now: float) -> None:
        """Take over a request that arrives with its KV in held blocks (`kv.reserve` or
        `kv.pin_cached`, in table order): its `num_computed_tokens` tokens are computed, so it
        runs from its next token, ahead of nothing it would not have overtaken by arrival.
        The caller made sure of its seat (`has_seat`) when it reserved the blocks."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        if request.num_tokens - request.num_computed_tokens != 1:
            raise ValueError("only a request with every token but its last computed can be adopted")
        request.max_output_tokens = self._output_room(request)
        self.kv.adopt(request, block_ids)
        request.status = RequestStatus.RUNNING
        self.requests[rid] = request
        self._seq[rid] = self._next_seq
        self._next_seq += 1
        if self._tracker is not None:
            self._tracker.on_arrival(request)
        self._insert_sorted(self.running, request, now)
        self.stats.num_migrated_in += 1
