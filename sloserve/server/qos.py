"""Named QoS classes, API keys and what each key may do, loaded from one config file.

A deployment names its service classes once (TTFT and TBT targets, priority) and maps each
API key to a tenant, so requests carry their SLO and tenant without the client having to
know the numbers. Since a higher class (or a smaller priority number) is served first and,
under `edf`/`slo`, preempts other tenants' requests, the config also says which classes and
priorities a key may ask for; a client cannot grant itself more. Format (YAML or JSON,
chosen by the file's suffix; YAML also reads JSON):

    default_class: standard
    classes:
      interactive: {ttft_ms: 500, tbt_ms: 100, priority: 0}
      standard:    {ttft_ms: 2000, tbt_ms: 250, priority: 1}
      batch:       {ttft_s: 60, tbt_s: 1, priority: 2, weight: 0.5}
    api_keys:
      sk-alice: {tenant: alice, default_class: interactive, classes: [standard, batch], min_priority: 0,
                 adapters: [alice-sql]}
      sk-bob: bob            # shorthand: the tenant name
      sk-ops: {tenant: ops, classes: "*", max_concurrent_requests: 4}
    anonymous: {classes: "*"}   # callers when no keys are configured (this is the default)
    limits: {max_concurrent_requests: 64, max_tokens_per_minute: 200000}   # per tenant, defaults
    tenants:
      alice: {max_concurrent_requests: 16, max_tokens_per_minute: 1000000}
    cache_isolation: tenant     # tenant (default) | key | shared

What a key may request:
- classes: its default class always; with `classes: [names]` also those, with `classes: "*"`
  every class; without `classes`, also every class no more urgent than its default (priority
  number at least the default class's), so a key can always downgrade but never upgrade.
- priority: any int32 at least its class's priority (lowering urgency is always allowed);
  with `min_priority: N`, any int32 at least N instead.
- adapters: the LoRA adapters it may name as `model` (`adapters: [names]`); without the field,
  every adapter the server serves. One it may not use is "not found" to it, and `/v1/models`
  lists only the ones it may.
- `anonymous` (used only when no keys are configured) takes the same fields; each one it
  leaves out is unrestricted (every class, any int32 priority, tenant ""): with no keys there
  is no tenant to protect from another, and single-tenant deployments work unconfigured. Restrict it on a server open to untrusted callers.

Limits (`max_concurrent_requests`, `max_tokens_per_minute`: prompt + generated tokens) are per
tenant (server/tenants.py enforces them): `limits` gives the defaults, `tenants` per-tenant
values, and a key (or `anonymous`) entry may give them for its tenant.

Cache isolation decides who shares cached prefixes (a cached prefix makes a request faster and
shows in `usage.prompt_tokens_details.cached_tokens`, so sharing one tells a caller that
someone else sent the same prefix): `tenant` = one namespace per tenant (keys of one tenant
share), `key` = one per API key, `shared` = everybody shares. The prefix-cache salt is an
HMAC of the namespace under a server secret (`cache_salt`), so the salt reveals nothing.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import secrets
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from sloserve.server.errors import APIError
from sloserve.server.tenants import UNLIMITED, TenantLimits
from sloserve.core.types import DEFAULT_QOS, INT32_MAX, QoSClass
from sloserve.workers.contract import CACHE_SECRET_ENV  # shared with the workers

logger = logging.getLogger(__name__)

INT32_MIN = -(2**31)
ANY_CLASS = "*"
CACHE_ISOLATION_MODES = ("tenant", "key", "shared")

_CLASS_KEYS = {"ttft_ms", "tbt_ms", "ttft_s", "tbt_s", "priority", "weight"}
_LIMIT_KEYS = {"max_concurrent_requests", "max_tokens_per_minute"}
_KEY_KEYS = {"tenant", "default_class", "classes", "min_priority", "adapters"} | _LIMIT_KEYS
_TOP_KEYS = {"default_class", "classes", "api_keys", "anonymous", "limits", "tenants", "cache_isolation"}


class UnknownQoSClass(APIError, KeyError):
    """The class a request named does not exist: 400, param qos_class. A KeyError too, for
    callers that catch the lookup failure themselves."""

    def __init__(self, name: str, known: Iterable[str] = ()) -> None:
        super().__init__(400, f"unknown qos_class {name!r}; known: {sorted(known)}", param="qos_class")
        self.name = name

    def __str__(self) -> str:  # KeyError's would quote the message
        return self.message


class QoSNotPermitted(APIError):
    """The caller's key may not use this class or priority: 403 permission_error, `param`
    qos_class or priority. An APIError, so a server that lets it propagate answers it right."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(403, message, param=param, code="qos_not_permitted")


class InvalidPriority(APIError, ValueError):
    """A priority that is not an int32: 400, param priority."""

    def __init__(self, message: str) -> None:
        super().__init__(400, message, param="priority")


@dataclass(frozen=True)
class Principal:
    """Who sent a request and what it may ask for.

    `classes`: None = its default class and any class no more urgent; a set = those plus the
    default class (`"*"` in it: every class). `min_priority`: the smallest priority number it
    may set (None: its class's priority). `cache_namespace`: who it shares cached prefixes
    with, set by the registry (None: everybody); it derives from the key's digest, never the key.
    """

    tenant: str = ""
    default_class: Optional[str] = None
    classes: Optional[frozenset[str]] = None
    min_priority: Optional[int] = None
    cache_namespace: Optional[str] = None
    adapters: Optional[frozenset[str]] = None  # the LoRA adapters it may use (None: every one)

    def may_use_adapter(self, name: str) -> bool:
        return self.adapters is None or name in self.adapters


# What callers are when no keys are configured: every class, any priority (see the docstring).
ANONYMOUS = Principal(classes=frozenset({ANY_CLASS}), min_priority=INT32_MIN, cache_namespace="tenant\0")


@dataclass
class QoSRegistry:
    """The classes a server knows, the keys it accepts (no keys = no authentication), what
    each may request, per-tenant limits and how the prefix cache is partitioned."""

    classes: dict[str, QoSClass] = field(default_factory=lambda: {DEFAULT_QOS.name: DEFAULT_QOS})
    default_class: str = DEFAULT_QOS.name
    api_keys: dict[str, Principal] = field(default_factory=dict)
    anonymous: Principal = ANONYMOUS
    default_limits: TenantLimits = UNLIMITED
    tenant_limits: dict[str, TenantLimits] = field(default_factory=dict)
    cache_isolation: str = "tenant"

    def __post_init__(self) -> None:
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not one of the classes {sorted(self.classes)}")
        if self.cache_isolation not in CACHE_ISOLATION_MODES:
            raise ValueError(f"cache_isolation must be one of {list(CACHE_ISOLATION_MODES)}, "
                             f"got {self.cache_isolation!r}")
        for principal in (*self.api_keys.values(), self.anonymous):
            self._check_principal(principal)
        # Look keys up by digest: no plain key kept for lookups, no timing hint about key prefixes.
        self._by_digest = {}
        for key, principal in self.api_keys.items():
            digest = _digest(key)
            self._by_digest[digest] = replace(principal, cache_namespace=self._namespace(principal.tenant, digest))
        self._anonymous = replace(self.anonymous, cache_namespace=self._namespace(self.anonymous.tenant, None))

    def _check_principal(self, principal: Principal) -> None:
        who = f"API key for tenant {principal.tenant!r}" if principal is not self.anonymous else "anonymous"
        if principal.default_class is not None and principal.default_class not in self.classes:
            raise ValueError(f"{who}: unknown default_class {principal.default_class!r}")
        unknown = sorted((principal.classes or frozenset()) - set(self.classes) - {ANY_CLASS})
        if unknown:
            raise ValueError(f"{who}: unknown class(es) {unknown} in classes")
        if principal.min_priority is not None and not _is_int32(principal.min_priority):
            raise ValueError(f"{who}: min_priority must be an integer in [{INT32_MIN}, {INT32_MAX}]")

    def _namespace(self, tenant: str, digest: Optional[bytes]) -> Optional[str]:
        """The prefix-cache namespace of a tenant or key (None: shared). Never holds the key."""
        if self.cache_isolation == "shared":
            return None
        if self.cache_isolation == "key" and digest is not None:
            return "key\0" + digest.hex()
        return "tenant\0" + tenant

    @property
    def auth_required(self) -> bool:
        return bool(self.api_keys)

    def authenticate(self, key: Optional[str]) -> Optional[Principal]:
        """The key's principal, the anonymous one when no keys are configured, None when the key is wrong."""
        if not self.api_keys:
            return self._anonymous
        if key is None:
            return None
        return self._by_digest.get(_digest(key))

    def resolve(self, name: Optional[str], principal: Principal) -> QoSClass:
        """The class a request asked for, else its key's default, else the server's.
        UnknownQoSClass (a KeyError) if unknown, QoSNotPermitted if the key may not use it."""
        default = self.classes[principal.default_class or self.default_class]
        if not name:
            return default
        qos = self.classes.get(name)
        if qos is None:
            raise UnknownQoSClass(name, self.classes)
        if not self._class_allowed(principal, qos, default):
            raise QoSNotPermitted(f"this API key may not use qos_class {name!r}; allowed: "
                                  f"{self.allowed_classes(principal)}", "qos_class")
        return qos

    def authorize(self, name: Optional[str], principal: Principal,
                  priority: Optional[int]) -> tuple[QoSClass, Optional[int]]:
        """The class and priority override a request may have. Raises UnknownQoSClass (400),
        InvalidPriority (400: not an int32) or QoSNotPermitted (403)."""
        qos = self.resolve(name, principal)
        if priority is None:
            return qos, None
        if not _is_int32(priority):
            raise InvalidPriority(f"priority must be an integer in [{INT32_MIN}, {INT32_MAX}]")
        floor = principal.min_priority if principal.min_priority is not None else qos.priority
        if priority < floor:
            raise QoSNotPermitted(f"this API key may not set a priority below {floor} for qos_class {qos.name!r} "
                                  "(a smaller number is more urgent)", "priority")
        return qos, priority

    def allowed_classes(self, principal: Principal) -> list[str]:
        default = self.classes[principal.default_class or self.default_class]
        return sorted(n for n, q in self.classes.items() if self._class_allowed(principal, q, default))

    @staticmethod
    def _class_allowed(principal: Principal, qos: QoSClass, default: QoSClass) -> bool:
        if qos.name == default.name:
            return True
        if principal.classes is None:
            return qos.priority >= default.priority  # downgrading is always allowed
        return ANY_CLASS in principal.classes or qos.name in principal.classes

    def limits_for(self, tenant: str) -> TenantLimits:
        """A tenant's limits: its own entry, the defaults filling the rest."""
        own = self.tenant_limits.get(tenant)
        return self.default_limits if own is None else own.over(self.default_limits)

    def with_keys(self, keys: Iterable[str]) -> "QoSRegistry":
        """Add command-line keys; each gets a tenant derived from its hash (the key never shows
        in logs), the server's default class and the classes no more urgent than it."""
        merged = dict(self.api_keys)
        for key in keys:
            merged.setdefault(key, Principal(tenant=anonymous_tenant(key)))
        return replace(self, classes=dict(self.classes), api_keys=merged)

    def with_cache_isolation(self, mode: str) -> "QoSRegistry":
        """The same registry with another cache isolation mode (a command-line override)."""
        return replace(self, classes=dict(self.classes), api_keys=dict(self.api_keys), cache_isolation=mode)


def _is_int32(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and INT32_MIN <= value <= INT32_MAX


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def anonymous_tenant(key: str) -> str:
    """A command-line key's tenant: 64 bits of its SHA-256 (few enough to log, too many to collide)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


# ---- the prefix-cache salt ----------------------------------------------------------------
def cache_salt(secret: bytes, namespace: Optional[str]) -> str:
    """The prefix-cache salt of a namespace: HMAC-SHA256 under the server secret, hex. A
    shared namespace (None) has the empty salt, so everybody's equal prefixes share blocks."""
    if namespace is None:
        return ""
    return hmac.new(secret, namespace.encode(), hashlib.sha256).hexdigest()


def cache_secret(value: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> bytes:
    """The server's cache secret: `value` (--cache-salt-secret), else $SLOSERVE_CACHE_SECRET,
    else random for this process (caches are then per process; every worker behind one front
    must get the same secret, or prefix-affinity routing stops matching their keys)."""
    if not value:
        value = (os.environ if env is None else env).get(CACHE_SECRET_ENV) or None
    if value:
        return value.encode()
    logger.info("no cache salt secret given: using a random one (prefix caches are private to this process)")
    return secrets.token_bytes(32)


class CacheSalter:
    """Per-request salts for one server: `salt(principal)`, memoized per namespace (the
    namespaces are the configured tenants or keys, so the memo is bounded)."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self._memo: dict[Optional[str], str] = {}

    def salt(self, principal: Principal) -> str:
        ns = principal.cache_namespace
        found = self._memo.get(ns)
        if found is None:
            found = self._memo[ns] = cache_salt(self._secret, ns)
        return found


# ---- the config file ----------------------------------------------------------------------
def load_qos_config(path: str | Path) -> QoSRegistry:
    """Read a QoS/API-key file; ValueError names the offending entry."""
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix.lower() == ".json":
            raw = json.loads(text)
        else:
            import yaml

            raw = yaml.safe_load(text)
    except Exception as exc:  # yaml and json raise unrelated error types
        raise ValueError(f"{p}: cannot parse: {exc}") from exc
    try:
        return parse_qos_config(raw or {})
    except ValueError as exc:
        raise ValueError(f"{p}: {exc}") from exc


def parse_qos_config(raw: Mapping[str, Any]) -> QoSRegistry:
    if not isinstance(raw, Mapping):
        raise ValueError("the top level must be a mapping")
    _no_unknown(raw, _TOP_KEYS, "top level")
    classes = {DEFAULT_QOS.name: DEFAULT_QOS}
    for name, spec in (_mapping(raw.get("classes"), "classes")).items():
        classes[str(name)] = _parse_class(str(name), spec)
    default_class = str(raw.get("default_class", DEFAULT_QOS.name))
    tenant_limits: dict[str, TenantLimits] = {}
    for tenant, spec in _mapping(raw.get("tenants"), "tenants").items():
        where = f"tenant {str(tenant)!r}"
        _no_unknown(_mapping(spec, where), _LIMIT_KEYS, where)
        _add_limits(tenant_limits, str(tenant), _parse_limits(spec or {}, where), where)
    keys: dict[str, Principal] = {}
    for key, spec in _mapping(raw.get("api_keys"), "api_keys").items():
        key = str(key)
        if not key:
            raise ValueError("api_keys: empty key")
        if isinstance(spec, str):
            keys[key] = Principal(tenant=spec)
        elif isinstance(spec, Mapping):
            keys[key] = _parse_principal(spec, f"api key of tenant {spec.get('tenant')!r}", anonymous_tenant(key),
                                         tenant_limits)
        elif spec is None:
            keys[key] = Principal(tenant=anonymous_tenant(key))
        else:
            raise ValueError("api_keys: each entry is a tenant name or a mapping")
    anonymous = ANONYMOUS
    if raw.get("anonymous") is not None:
        spec = _mapping(raw["anonymous"], "anonymous")
        anonymous = _parse_principal(spec, "anonymous", "", tenant_limits, permissive=True)
    defaults = raw.get("limits")
    default_limits = UNLIMITED
    if defaults is not None:
        _no_unknown(_mapping(defaults, "limits"), _LIMIT_KEYS, "limits")
        default_limits = _parse_limits(defaults, "limits")
    return QoSRegistry(classes, default_class, keys, anonymous, default_limits, tenant_limits,
                       str(raw.get("cache_isolation", "tenant")))


def _parse_principal(spec: Mapping, where: str, fallback_tenant: str, tenant_limits: dict[str, TenantLimits],
                     permissive: bool = False) -> Principal:
    """A key (or the anonymous) entry; limits it gives are recorded for its tenant."""
    _no_unknown(spec, _KEY_KEYS, where)
    tenant = str(spec.get("tenant") or fallback_tenant)
    raw_classes = spec.get("classes", ANY_CLASS if permissive else None)
    if raw_classes is None:
        classes = None
    elif raw_classes == ANY_CLASS:
        classes = frozenset({ANY_CLASS})
    elif isinstance(raw_classes, list) and all(isinstance(c, str) for c in raw_classes):
        classes = frozenset(raw_classes)
    else:
        raise ValueError(f"{where}: classes must be a list of class names or \"*\"")
    min_priority = spec.get("min_priority", INT32_MIN if permissive else None)
    if min_priority is not None and not _is_int32(min_priority):
        raise ValueError(f"{where}: min_priority must be an integer in [{INT32_MIN}, {INT32_MAX}]")
    if _LIMIT_KEYS & set(spec):
        _add_limits(tenant_limits, tenant, _parse_limits(spec, where), where)
    default_class = spec.get("default_class")
    adapters = spec.get("adapters")
    if adapters is not None and not (isinstance(adapters, list) and all(isinstance(a, str) for a in adapters)):
        raise ValueError(f"{where}: adapters must be a list of adapter names")
    return Principal(tenant=tenant, default_class=None if default_class is None else str(default_class),
                     classes=classes, min_priority=min_priority,
                     adapters=None if adapters is None else frozenset(adapters))


def _parse_limits(spec: Mapping, where: str) -> TenantLimits:
    try:
        return TenantLimits(spec.get("max_concurrent_requests"), spec.get("max_tokens_per_minute"))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _add_limits(found: dict[str, TenantLimits], tenant: str, limits: TenantLimits, where: str) -> None:
    """Merge limits given for one tenant in several places; a contradiction is an error."""
    have = found.get(tenant, UNLIMITED)
    for name in _LIMIT_KEYS:
        a, b = getattr(have, name), getattr(limits, name)
        if a is not None and b is not None and a != b:
            raise ValueError(f"{where}: {name} {b} contradicts {a} given elsewhere for tenant {tenant!r}")
    found[tenant] = limits.over(have)


def _mapping(value: Any, where: str) -> Mapping:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a mapping")
    return value


def _parse_class(name: str, spec: Any) -> QoSClass:
    if not isinstance(spec, Mapping):
        raise ValueError(f"class {name!r}: expected a mapping of targets")
    _no_unknown(spec, _CLASS_KEYS, f"class {name!r}")

    def seconds(base: str) -> float:
        if f"{base}_ms" in spec and f"{base}_s" in spec:
            raise ValueError(f"class {name!r}: give {base}_ms or {base}_s, not both")
        if f"{base}_ms" in spec:
            value = _number(spec[f"{base}_ms"], f"class {name!r} {base}_ms") / 1000.0
        elif f"{base}_s" in spec:
            value = _number(spec[f"{base}_s"], f"class {name!r} {base}_s")
        else:
            return math.inf
        if value <= 0:
            raise ValueError(f"class {name!r}: {base} target must be positive")
        return value

    priority = spec.get("priority", 0)
    if not _is_int32(priority):
        raise ValueError(f"class {name!r}: priority must be an integer in [{INT32_MIN}, {INT32_MAX}]")
    weight = _number(spec.get("weight", 1.0), f"class {name!r} weight")
    return QoSClass(name=name, ttft_target_s=seconds("ttft"), tbt_target_s=seconds("tbt"), priority=priority,
                    weight=weight)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _no_unknown(spec: Mapping, allowed: set[str], where: str) -> None:
    unknown = set(map(str, spec)) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
