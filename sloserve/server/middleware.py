"""The server's edge, as plain ASGI middleware (no BaseHTTPMiddleware: it breaks streaming
and hides client disconnects).

In order: count every response by route and status; refuse oversized bodies (413) before
reading them, and bound the wait for each body chunk (408, connections.timed_receive); for
API routes refuse new work while draining (503) and check the API key (401) before the body
is even parsed, so a bad key never reveals how the body would have been judged.
"""
from __future__ import annotations

import hmac
import json
from typing import Callable, Optional, Sequence

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sloserve.server.admission import Admission
from sloserve.server.connections import timed_receive
from sloserve.server.errors import APIError
from sloserve.server.qos import QoSRegistry

API_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/internal/resume/")
# KV blocks in transit between a fleet's workers: large bodies, from the fleet itself (the
# worker's InternalGuard checked the fleet secret before this middleware runs).
UNLIMITED_BODY_PREFIX = "/internal/kv/"
ADMIN_ROUTES = frozenset({"/metrics", "/dashboard/data"})  # what `--admin-key` restricts on a single instance
# Routes that change what the server serves: an admin key only, refused outright without `--admin-key`.
ADMIN_ACTIONS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# Behind the API's own keys too when there are no admin keys (the fleet's load and latencies).
KEYED_ROUTES = frozenset({"/dashboard/data"})
KNOWN_ROUTES = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/health",
                          "/metrics", "/tokenize", "/detokenize", "/version", "/dashboard", "/dashboard/data",
                          *ADMIN_ACTIONS})


async def send_error(send: Send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def admin_refusal(token: Optional[str], admin_keys: Sequence[bytes]) -> Optional[APIError]:
    """Why `token` may not use an admin route (401 none, 403 not an admin key), or None.
    Constant-time comparison, so response timing says nothing about a key's prefix."""
    if not token:
        return APIError(401, "this route needs an admin key (send 'Authorization: Bearer <key>')",
                        code="invalid_api_key")
    given = token.encode()
    if not any(hmac.compare_digest(given, key) for key in admin_keys):
        return APIError(403, "this key may not use this route", code="forbidden")
    return None


def bearer_token(headers: Headers) -> Optional[str]:
    value = headers.get("authorization")
    if value and value[:7].lower() == "bearer ":
        return value[7:].strip()
    return headers.get("x-api-key")


class EdgeMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        admission: Admission,
        registry: QoSRegistry,
        max_body_bytes: int,
        observe_http: Callable[[str, int], None],
        on_rejected: Callable[[str], None],
        body_timeout_s: float = 30.0,
        admin_keys: Sequence[str] = (),
    ) -> None:
        """With `admin_keys`, the routes in ADMIN_ROUTES (`/metrics`) need one of them."""
        self.app = app
        self.admin_keys = [k.encode() for k in admin_keys if k]
        self.admission = admission
        self.registry = registry
        self.max_body_bytes = max_body_bytes
        self.observe_http = observe_http
        self.on_rejected = on_rejected
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        route = path if path in KNOWN_ROUTES else "other"
        status_seen: list[int] = []

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status_seen.append(message["status"])
            await send(message)

        try:
            err = self._refuse(scope)
            if err is not None:
                await send_error(counting_send, err)
                return
            unlimited = scope.get("path", "").startswith(UNLIMITED_BODY_PREFIX)
            await self.app(scope, receive if unlimited else self._limited(receive), counting_send)
        finally:
            if status_seen:
                self.observe_http(route, status_seen[0])

    def _refuse(self, scope: Scope) -> Optional[APIError]:
        headers = Headers(scope=scope)
        if scope.get("path", "") in ADMIN_ACTIONS:
            if scope.get("state", {}).get("fleet"):  # a fleet's front, fanning out what its admin asked
                return None
            if not self.admin_keys:
                return APIError(403, "this route needs the server to run with --admin-key", code="forbidden")
            return admin_refusal(bearer_token(headers), self.admin_keys)
        if self.admin_keys and scope.get("path", "") in ADMIN_ROUTES:
            return admin_refusal(bearer_token(headers), self.admin_keys)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes and not scope.get(
                "path", "").startswith(UNLIMITED_BODY_PREFIX):
            return APIError(413, f"request body of {length} bytes exceeds the limit of {self.max_body_bytes}",
                            code="request_too_large")
        if scope.get("path", "") in KEYED_ROUTES:
            if self.registry.authenticate(bearer_token(headers)) is None:
                return APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                code="invalid_api_key")
            return None
        if not scope.get("path", "").startswith(API_PREFIXES):
            return None
        if self.admission.draining:
            self.on_rejected("draining")
            try:
                self.admission.check_open()
            except APIError as e:
                return e
        principal = self.registry.authenticate(bearer_token(headers))
        if principal is None:
            self.on_rejected("unauthorized")
            return APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                            code="invalid_api_key")
        scope.setdefault("state", {})["principal"] = principal
        return None

    def _limited(self, receive: Receive) -> Receive:
        return limited_receive(receive, self.max_body_bytes, self.body_timeout_s)


def limited_receive(receive: Receive, max_body_bytes: int, body_timeout_s: float) -> Receive:
    """Count body bytes as they arrive (chunked uploads have no Content-Length to check: 413
    past the limit), and give up on a client that stalls mid-body (BodyTimeout: 408)."""
    seen = 0
    timed = timed_receive(receive, body_timeout_s)

    async def wrapped() -> Message:
        nonlocal seen
        message = await timed()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > max_body_bytes:
                raise HTTPException(413, f"request body exceeds the limit of {max_body_bytes} bytes")
        return message

    return wrapped
