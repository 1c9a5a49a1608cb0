"""Named QoS classes and API keys, loaded from one config file.

A deployment names its service classes once (TTFT and TBT targets, priority) and maps each
API key to a tenant, so requests carry their SLO and tenant without the client having to
know the numbers. Format (YAML or JSON, chosen by the file's suffix; YAML also reads JSON):

    default_class: standard
    classes:
      interactive: {ttft_ms: 500, tbt_ms: 100, priority: 0}
      standard:    {ttft_ms: 2000, tbt_ms: 250, priority: 1}
      batch:       {ttft_s: 60, tbt_s: 1, priority: 2, weight: 0.5}
    api_keys:
      sk-alice: {tenant: alice, default_class: interactive}
      sk-bob: bob            # shorthand: the tenant name
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from sloserve.types import DEFAULT_QOS, QoSClass

_CLASS_KEYS = {"ttft_ms", "tbt_ms", "ttft_s", "tbt_s", "priority", "weight"}
_KEY_KEYS = {"tenant", "default_class"}
_TOP_KEYS = {"default_class", "classes", "api_keys"}


@dataclass(frozen=True)
class Principal:
    """Who sent a request: the tenant an API key belongs to and its default class."""

    tenant: str = ""
    default_class: Optional[str] = None


ANONYMOUS = Principal()


@dataclass
class QoSRegistry:
    """The classes a server knows and the keys it accepts (no keys = no authentication)."""

    classes: dict[str, QoSClass] = field(default_factory=lambda: {DEFAULT_QOS.name: DEFAULT_QOS})
    default_class: str = DEFAULT_QOS.name
    api_keys: dict[str, Principal] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Look keys up by digest: no plain key kept for lookups, no timing hint about key prefixes.
        self._by_digest = {_digest(k): p for k, p in self.api_keys.items()}
        if self.default_class not in self.classes:
            raise ValueError(f"default_class {self.default_class!r} is not one of the classes {sorted(self.classes)}")
        for key, principal in self.api_keys.items():
            if principal.default_class is not None and principal.default_class not in self.classes:
                raise ValueError(f"API key for tenant {principal.tenant!r}: unknown default_class "
                                 f"{principal.default_class!r}")

    @property
    def auth_required(self) -> bool:
        return bool(self.api_keys)

    def authenticate(self, key: Optional[str]) -> Optional[Principal]:
        """The key's principal, ANONYMOUS when no keys are configured, None when the key is wrong."""
        if not self.api_keys:
            return ANONYMOUS
        if key is None:
            return None
        return self._by_digest.get(_digest(key))

    def resolve(self, name: Optional[str], principal: Principal) -> QoSClass:
        """The class a request asked for, else its key's default, else the server's. KeyError if unknown."""
        chosen = name or principal.default_class or self.default_class
        return self.classes[chosen]

    def with_keys(self, keys: Iterable[str]) -> "QoSRegistry":
        """Add command-line keys; each gets a tenant derived from its hash (the key never shows in logs)."""
        merged = dict(self.api_keys)
        for key in keys:
            merged.setdefault(key, Principal(tenant=anonymous_tenant(key)))
        return QoSRegistry(dict(self.classes), self.default_class, merged)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def anonymous_tenant(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


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
    for name, spec in (raw.get("classes") or {}).items():
        classes[str(name)] = _parse_class(str(name), spec)
    default_class = str(raw.get("default_class", DEFAULT_QOS.name))
    keys: dict[str, Principal] = {}
    for key, spec in (raw.get("api_keys") or {}).items():
        key = str(key)
        if not key:
            raise ValueError("api_keys: empty key")
        if isinstance(spec, str):
            keys[key] = Principal(tenant=spec)
        elif isinstance(spec, Mapping):
            _no_unknown(spec, _KEY_KEYS, f"api key of tenant {spec.get('tenant')!r}")
            tenant = spec.get("tenant") or anonymous_tenant(key)
            keys[key] = Principal(tenant=str(tenant), default_class=spec.get("default_class"))
        elif spec is None:
            keys[key] = Principal(tenant=anonymous_tenant(key))
        else:
            raise ValueError("api_keys: each entry is a tenant name or a mapping")
    return QoSRegistry(classes, default_class, keys)


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
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"class {name!r}: priority must be an integer")
    weight = _number(spec.get("weight", 1.0), f"class {name!r} weight")
    return QoSClass(name=name, ttft_target_s=seconds("ttft"), tbt_target_s=seconds("tbt"), priority=priority,
                    weight=weight)


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _no_unknown(spec: Mapping, allowed: set[str], where: str) -> None:
    unknown = set(map(str, spec)) - allowed
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
