"""Per-tenant admission limits and per-tenant request-id namespaces.

One tenant must not be able to take the whole server (every seat, every token) nor learn
anything about another tenant's traffic. Two small pieces live here:

- `TenantLimiter`: at most `max_concurrent_requests` engine requests in flight per tenant,
  and at most `max_tokens_per_minute` tokens (prompt + generated) per tenant, enforced by a
  token bucket that refills at `max_tokens_per_minute / 60` per second and holds one minute's
  worth. Prompt tokens are charged at admission; generated tokens are charged as they are
  reported, so the bucket can go into debt, and a tenant in debt waits until it is repaid:
  over any long window the rate holds. The clock is injected; nothing here is global.
- `scope_request_id` / `client_request_id`: the engine's ids are one namespace for everybody,
  so the server prefixes each client-chosen id with a digest of its tenant; a duplicate
  `X-Request-Id` then collides only with the same tenant's own requests.

Everything runs on the server's event loop thread (as Admission does): no locks.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from sloserve.server.errors import APIError

_SCOPE_HEX = 16  # 64 bits of the tenant digest: no two tenants share a namespace by accident


@dataclass(frozen=True)
class TenantLimits:
    """Limits of one tenant; None means unlimited."""

    max_concurrent_requests: Optional[int] = None
    max_tokens_per_minute: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("max_concurrent_requests", "max_tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def over(self, defaults: "TenantLimits") -> "TenantLimits":
        """These limits, with `defaults` filling the fields left unset."""
        return TenantLimits(
            self.max_concurrent_requests if self.max_concurrent_requests is not None
            else defaults.max_concurrent_requests,
            self.max_tokens_per_minute if self.max_tokens_per_minute is not None
            else defaults.max_tokens_per_minute,
        )

    @property
    def unlimited(self) -> bool:
        return self.max_concurrent_requests is None and self.max_tokens_per_minute is None


UNLIMITED = TenantLimits()


@dataclass
class _TenantState:
    in_flight: set[str] = field(default_factory=set)
    level: float = math.nan  # tokens in the bucket at `stamp` (negative: debt); nan until first use
    stamp: float = 0.0


class TenantLimiter:
    """Admission limits per tenant (see the module docstring).

    `limits_for(tenant)` says a tenant's limits (e.g. `QoSRegistry.limits_for`); `clock` gives
    seconds from any monotonic origin. Errors are `APIError` 429s with `Retry-After`, so the
    server lets them propagate as it does Admission's.
    """

    def __init__(self, limits_for: Callable[[str], TenantLimits],
                 clock: Callable[[], float] = time.monotonic, retry_after_s: int = 1) -> None:
        self.limits_for = limits_for
        self.clock = clock
        self.retry_after_s = retry_after_s  # when a concurrency slot frees is unknown: a hint
        self._tenants: dict[str, _TenantState] = {}

    # ---- the three calls the server makes ------------------------------------------------
    def try_acquire(self, tenant: str, request_ids: Iterable[str], prompt_tokens: int) -> None:
        """Take a concurrency slot per engine request and charge the prompt tokens, all or
        nothing. APIError 429 (`tenant_concurrency_limit` or `tenant_token_limit`) otherwise.

        A prompt larger than the bucket is admitted once the bucket is full and leaves it in
        debt, so no request is refused forever and the long-run rate still holds."""
        ids = list(request_ids)
        limits = self.limits_for(tenant)
        if limits.unlimited:
            return
        state = self._tenants.setdefault(tenant, _TenantState())
        cap = limits.max_concurrent_requests
        if cap is not None and len(state.in_flight) + len(ids) > cap:
            self._forget_if_idle(tenant, state, limits)
            if len(ids) > cap:
                raise APIError(429, f"this request needs {len(ids)} sequences but your limit is {cap} in flight; "
                               "send fewer prompts or a smaller n", param="n", code="tenant_concurrency_limit",
                               headers={"Retry-After": str(self.retry_after_s)})
            raise APIError(429, f"too many concurrent requests for this API key's tenant (limit {cap}); retry later",
                           code="tenant_concurrency_limit", headers={"Retry-After": str(self.retry_after_s)})
        tpm = limits.max_tokens_per_minute
        if tpm is not None:
            level = self._refill(state, tpm)
            need = min(max(0, prompt_tokens), tpm)
            if level < need:
                self._forget_if_idle(tenant, state, limits)
                wait = math.ceil((need - level) / (tpm / 60.0))
                raise APIError(429, f"token rate limit for this API key's tenant reached ({tpm} tokens per minute); "
                               f"retry in {wait} s", code="tenant_token_limit", headers={"Retry-After": str(wait)})
            state.level = level - max(0, prompt_tokens)
        state.in_flight.update(ids)

    def record(self, tenant: str, tokens: int) -> None:
        """Charge generated tokens (as they are produced, or all at the end)."""
        if tokens <= 0:
            return
        limits = self.limits_for(tenant)
        tpm = limits.max_tokens_per_minute
        if tpm is None:
            return
        state = self._tenants.setdefault(tenant, _TenantState())
        state.level = self._refill(state, tpm) - tokens

    def release(self, tenant: str, request_id: str) -> None:
        """Give back a request's slot (a no-op for an unknown id, so it is safe to call twice)."""
        state = self._tenants.get(tenant)
        if state is None:
            return
        state.in_flight.discard(request_id)
        self._forget_if_idle(tenant, state, self.limits_for(tenant))

    # ---- introspection (metrics, tests) --------------------------------------------------
    def in_flight(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return len(state.in_flight) if state is not None else 0

    def tokens_available(self, tenant: str) -> Optional[float]:
        """Tokens in the tenant's bucket now (negative: debt); None without a token limit."""
        tpm = self.limits_for(tenant).max_tokens_per_minute
        if tpm is None:
            return None
        state = self._tenants.get(tenant)
        return float(tpm) if state is None else self._refill(state, tpm)

    @property
    def num_tracked(self) -> int:
        return len(self._tenants)

    # ---- internals -----------------------------------------------------------------------
    def _refill(self, state: _TenantState, tpm: int) -> float:
        """The bucket's level now, stored back with its time stamp."""
        now = self.clock()
        if math.isnan(state.level):
            state.level = float(tpm)
        else:
            state.level = min(float(tpm), state.level + max(0.0, now - state.stamp) * tpm / 60.0)
        state.stamp = now
        return state.level

    def _forget_if_idle(self, tenant: str, state: _TenantState, limits: TenantLimits) -> None:
        """Drop a tenant with nothing in flight and a full bucket: it is back to its initial
        state, so memory stays bounded by the tenants active in the last minute."""
        if state.in_flight:
            return
        tpm = limits.max_tokens_per_minute
        if tpm is None or math.isnan(state.level) or self._refill(state, tpm) >= tpm:
            del self._tenants[tenant]


# ---- request ids ------------------------------------------------------------------------
def tenant_scope(tenant: str) -> str:
    """The prefix of a tenant's engine ids: 64 bits of a digest of its name (not the name,
    which may be secret-ish and would make ids long)."""
    return hashlib.sha256(b"request-scope\0" + tenant.encode()).hexdigest()[:_SCOPE_HEX]


def scope_request_id(tenant: str, client_id: str) -> str:
    """The engine-side id of a client's request id: `<scope>:<client id>`."""
    return f"{tenant_scope(tenant)}:{client_id}"


def client_request_id(engine_id: str) -> str:
    """The client's id back from an engine id made by `scope_request_id` (others unchanged)."""
    scope, sep, rest = engine_id.partition(":")
    if sep and len(scope) == _SCOPE_HEX and all(c in "0123456789abcdef" for c in scope):
        return rest
    return engine_id
