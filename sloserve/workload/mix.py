"""QoS-class and tenant mixes: which share of requests belongs to which class and tenant.

The file format is the server's `--qos-config` (classes with `ttft_ms`/`tbt_ms`/`priority`,
`api_keys` mapping keys to tenants) plus the keys only a load generator needs: `share` (the
fraction of requests of that class or tenant; equal shares when omitted) and `e2e_ms`/`e2e_s`
(an end-to-end target). So one file can describe both what the server promises and what the
benchmark sends and checks:

    default_class: standard
    classes:
      interactive: {ttft_ms: 500, tbt_ms: 100, priority: 0, share: 0.2}
      standard:    {ttft_ms: 2000, tbt_ms: 250, e2e_s: 30, share: 0.8}
    api_keys:
      sk-alice: {tenant: alice, share: 0.7}
      sk-bob: bob
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Optional, Sequence

from sloserve.core.types import QoSClass
from sloserve.workload.types import DEFAULT_CLASS, WorkloadRequest

_CLASS_KEYS = {"ttft_ms", "tbt_ms", "ttft_s", "tbt_s", "e2e_ms", "e2e_s", "priority", "weight", "share"}
_TENANT_KEYS = {"tenant", "default_class", "share"}
_TOP_KEYS = {"default_class", "classes", "api_keys"}


@dataclass(frozen=True)
class ClassSpec:
    """A QoS class as the benchmark sees it: the server's targets plus an E2E target and a share."""

    qos: QoSClass
    e2e_target_s: float = math.inf
    share: Optional[float] = None

    @property
    def name(self) -> str:
        return self.qos.name


@dataclass(frozen=True)
class TenantSpec:
    name: str
    api_key: Optional[str] = None
    share: Optional[float] = None
    default_class: Optional[str] = None


@dataclass(frozen=True)
class Mix:
    classes: tuple[ClassSpec, ...] = ()
    tenants: tuple[TenantSpec, ...] = ()
    default_class: str = DEFAULT_CLASS

    def class_spec(self, name: str) -> Optional[ClassSpec]:
        return next((c for c in self.classes if c.name == name), None)

    def api_key(self, tenant: str) -> Optional[str]:
        return next((t.api_key for t in self.tenants if t.name == tenant), None)


def _shares(items: Sequence[Any]) -> list[float]:
    """Normalized shares; items without one split what the explicit ones leave (or equally)."""
    given = [it.share for it in items]
    explicit = sum(s for s in given if s is not None)
    if any(s is not None and s < 0 for s in given):
        raise ValueError("shares must be >= 0")
    n_missing = sum(1 for s in given if s is None)
    rest = max(0.0, 1.0 - explicit) / n_missing if n_missing else 0.0
    raw = [rest if s is None else s for s in given]
    total = sum(raw)
    if total <= 0:
        raise ValueError("shares sum to zero")
    return [s / total for s in raw]


def _seconds(spec: Mapping[str, Any], base: str, where: str) -> float:
    if f"{base}_ms" in spec and f"{base}_s" in spec:
        raise ValueError(f"{where}: give {base}_ms or {base}_s, not both")
    for suffix, unit in (("_ms", 1e-3), ("_s", 1.0)):
        if base + suffix in spec:
            value = spec[base + suffix]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{where}: {base}{suffix} must be a positive number, got {value!r}")
            return float(value) * unit
    return math.inf


def _share(spec: Mapping[str, Any], where: str) -> Optional[float]:
    share = spec.get("share")
    if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or share < 0):
        raise ValueError(f"{where}: share must be a number >= 0, got {share!r}")
    return None if share is None else float(share)


def parse_mix(raw: Mapping[str, Any]) -> Mix:
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise ValueError(f"classes file: unknown top-level key(s) {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    classes = []
    for name, spec in (raw.get("classes") or {}).items():
        where = f"class {name!r}"
        if not isinstance(spec, Mapping):
            raise ValueError(f"{where}: expected a mapping")
        bad = set(spec) - _CLASS_KEYS
        if bad:
            raise ValueError(f"{where}: unknown key(s) {sorted(bad)}; allowed: {sorted(_CLASS_KEYS)}")
        qos = QoSClass(name=str(name), ttft_target_s=_seconds(spec, "ttft", where),
                       tbt_target_s=_seconds(spec, "tbt", where), priority=int(spec.get("priority", 0)),
                       weight=float(spec.get("weight", 1.0)))
        classes.append(ClassSpec(qos, _seconds(spec, "e2e", where), _share(spec, where)))
    tenants = []
    for key, spec in (raw.get("api_keys") or {}).items():
        if isinstance(spec, str):
            tenants.append(TenantSpec(spec, str(key)))
            continue
        if not isinstance(spec, Mapping):
            raise ValueError("api_keys: each entry is a tenant name or a mapping")
        bad = set(spec) - _TENANT_KEYS
        if bad:
            raise ValueError(f"api key entry: unknown key(s) {sorted(bad)}; allowed: {sorted(_TENANT_KEYS)}")
        name = str(spec.get("tenant") or f"tenant-{len(tenants)}")
        tenants.append(TenantSpec(name, str(key), _share(spec, f"tenant {name!r}"), spec.get("default_class")))
    default = str(raw.get("default_class", classes[0].name if classes else DEFAULT_CLASS))
    if classes and default not in {c.name for c in classes}:
        raise ValueError(f"default_class {default!r} is not one of the classes")
    return Mix(tuple(classes), tuple(tenants), default)


def load_mix(path: str | Path) -> Mix:
    """Read a classes file (YAML or JSON; YAML parses JSON too)."""
    text = Path(path).read_text(encoding="utf-8")
    if str(path).endswith(".json"):
        raw = json.loads(text)
    else:
        import yaml

        raw = yaml.safe_load(text)
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return parse_mix(raw)


def _pick(rng: random.Random, names: Sequence[str], cum: Sequence[float]) -> str:
    x = rng.random()
    for name, c in zip(names, cum):
        if x < c:
            return name
    return names[-1]


def assign_mix(requests: Iterable[WorkloadRequest], mix: Mix, seed: int = 0) -> Iterator[WorkloadRequest]:
    """Give each request a class and a tenant drawn by share, reproducibly from `seed`.

    Draws depend only on the request's position and the seed, so every rate of a sweep sends
    the same class to the same request. A request that already names a tenant (ServeGen
    clients) keeps it when the mix lists no tenants.
    """
    rng = random.Random(f"{seed}:mix")
    cnames = [c.name for c in mix.classes]
    ccum = _cumulative(_shares(mix.classes)) if mix.classes else []
    tnames = [t.name for t in mix.tenants]
    tcum = _cumulative(_shares(mix.tenants)) if mix.tenants else []
    for r in requests:
        cls = _pick(rng, cnames, ccum) if cnames else r.qos_class
        tenant = _pick(rng, tnames, tcum) if tnames else r.tenant
        yield replace(r, qos_class=cls, tenant=tenant)


def _cumulative(shares: Sequence[float]) -> list[float]:
    out, acc = [], 0.0
    for s in shares:
        acc += s
        out.append(acc)
    return out


@dataclass(frozen=True)
class MixCounts:
    """How many requests of each class and tenant a stream holds (for reports and tests)."""

    classes: dict = field(default_factory=dict)
    tenants: dict = field(default_factory=dict)

    @classmethod
    def of(cls, requests: Iterable[WorkloadRequest]) -> "MixCounts":
        c: dict[str, int] = {}
        t: dict[str, int] = {}
        for r in requests:
            c[r.qos_class] = c.get(r.qos_class, 0) + 1
            t[r.tenant] = t.get(r.tenant, 0) + 1
        return cls(c, t)
