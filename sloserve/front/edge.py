"""The multi-instance front's edge, as plain ASGI middleware (no BaseHTTPMiddleware: it breaks
streaming and hides client disconnects).

In order, before the route reads a byte of the body:
1. API routes need an API key (401), admin routes an admin key when some are configured
   (401 without a key, 403 with another one): a bad key learns nothing about how its body
   would have been judged, however large it says it is;
2. a declared body over the limit is 413; an undeclared (chunked) one is counted while it is
   read and refused (413) once past the limit; a client that stalls mid-body gets 408;
3. while draining, new API work is 503 `draining`;
4. proxied work takes a slot of the front's own bound on requests in flight (`FrontGate`):
   beyond it 429 + Retry-After at once, without touching a worker.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from sloserve.server.errors import APIError
from sloserve.server.middleware import KEYED_ROUTES, admin_refusal, bearer_token, limited_receive, send_error
from sloserve.server.qos import QoSRegistry

logger = logging.getLogger(__name__)

PROXIED_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"})
ADMIN_ROUTES = frozenset({"/v1/instances", "/metrics", "/dashboard/data"})
# Routes that change what the fleet does (drain an instance, move a request): an admin key
# only, and refused outright when the front has no admin key configured.
ADMIN_ACTION_PREFIXES = ("/v1/instances/", "/v1/migrations", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
API_PREFIXES = ("/v1/", "/tokenize", "/detokenize")


@dataclass
class Ticket:
    """One admitted request; `abort` is set when the drain's grace period is over."""

    id: int
    abort: asyncio.Event = field(default_factory=asyncio.Event)


class FrontGate:
    """The front's bound on proxied requests in flight, and its draining state."""

    def __init__(self, capacity: Optional[int], retry_after_s: int = 1) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"max in flight must be >= 1, got {capacity}")
        self.capacity = capacity
        self.retry_after_s = retry_after_s
        self.draining = False
        self._tickets: dict[int, Ticket] = {}
        self._ids = itertools.count()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._tickets)

    def check_open(self) -> None:
        if self.draining:
            raise APIError(503, "server is shutting down; retry later", code="draining",
                           headers={"Retry-After": str(self.retry_after_s)})

    def enter(self) -> Ticket:
        self.check_open()
        if self.capacity is not None and len(self._tickets) >= self.capacity:
            raise APIError(429, f"front is at capacity ({self.capacity} requests in flight); retry later",
                           code="queue_full", headers={"Retry-After": str(self.retry_after_s)})
        ticket = Ticket(next(self._ids))
        self._tickets[ticket.id] = ticket
        self._idle.clear()
        return ticket

    def leave(self, ticket: Ticket) -> None:
        self._tickets.pop(ticket.id, None)
        if not self._tickets:
            self._idle.set()

    async def _wait_idle(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), max(0.0, timeout_s))
        except asyncio.TimeoutError:
            pass
        return not self._tickets

    async def drain(self, grace_s: float, settle_s: float = 5.0) -> int:
        """Stop admitting, let requests finish within `grace_s`, then abort the rest (their
        streams end with an error event, their upstreams close); returns how many."""
        self.draining = True
        logger.info("draining: %d requests in flight, grace period %.1fs", len(self._tickets), grace_s)
        if await self._wait_idle(grace_s):
            return 0
        leftovers = list(self._tickets.values())
        logger.warning("grace period over: aborting %d requests", len(leftovers))
        for ticket in leftovers:
            ticket.abort.set()
        await self._wait_idle(settle_s)
        return len(leftovers)


class FrontEdge:
    def __init__(self, app: ASGIApp, *, gate: FrontGate, registry: QoSRegistry, max_body_bytes: int,
                 body_timeout_s: float = 30.0, admin_keys: Sequence[str] = ()) -> None:
        self.app = app
        self.gate = gate
        self.registry = registry
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.admin_keys = [k.encode() for k in admin_keys if k]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        ticket: Optional[Ticket] = None
        try:
            self._check(scope, path)
            if path in PROXIED_ROUTES:
                ticket = self.gate.enter()
        except APIError as err:
            await send_error(send, err)
            return
        scope.setdefault("state", {})["ticket"] = ticket
        try:
            await self.app(scope, self._limited(receive), send)
        finally:
            if ticket is not None:
                self.gate.leave(ticket)

    def _check(self, scope: Scope, path: str) -> None:
        headers = Headers(scope=scope)
        token = bearer_token(headers)
        if path.startswith(ADMIN_ACTION_PREFIXES):
            if not self.admin_keys:
                raise APIError(403, "this route needs the front to run with --admin-key", code="forbidden")
            self._check_admin(token)
        elif path in ADMIN_ROUTES and self.admin_keys:
            self._check_admin(token)
        elif path.startswith(API_PREFIXES) or path in KEYED_ROUTES:
            principal = self.registry.authenticate(token)
            if principal is None:
                raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                               code="invalid_api_key")
            scope.setdefault("state", {})["principal"] = principal
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise APIError(413, f"request body of {length} bytes exceeds the limit of {self.max_body_bytes}",
                           code="request_too_large")
        if path.startswith(API_PREFIXES) and path not in ADMIN_ROUTES and not path.startswith(ADMIN_ACTION_PREFIXES):
            self.gate.check_open()

    def _check_admin(self, token: Optional[str]) -> None:
        err = admin_refusal(token, self.admin_keys)
        if err is not None:
            raise err

    def _limited(self, receive: Receive) -> Receive:
        return limited_receive(receive, self.max_body_bytes, self.body_timeout_s)
