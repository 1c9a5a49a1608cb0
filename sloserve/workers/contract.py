"""What a front and its workers agree on: how a worker is started and configured, how the
front authenticates itself to the worker's internal routes, and how the worker annotates the
streams it sends its front."""
from __future__ import annotations

import dataclasses
import json

from sloserve.config import CacheConfig, EngineConfig, SchedulerConfig

WORKER_MODULE = "sloserve.server.worker"  # the worker program: `python -m` it, or import it in a Ray actor
API_KEYS_ENV = "SLOSERVE_WORKER_API_KEYS"  # newline-separated keys the front hands its workers
FLEET_SECRET_ENV = "SLOSERVE_FLEET_SECRET"  # the front's per-run secret for /internal/*
CACHE_SECRET_ENV = "SLOSERVE_CACHE_SECRET"  # keys the prefix cache's salts, shared by the front and its workers
FLEET_SECRET_HEADER = "X-Sloserve-Fleet-Secret"
INTERNAL_PREFIX = "/internal/"
RELAY_COMMENT = ": sloserve "  # SSE comment lines a worker adds for its front (which strips them)
# "TARGET_URL MIGRATION_ID" on a generation request from the front (with the fleet secret): send
# the request's KV blocks to that worker as its prefill computes them (a pipelined P/D hand-off).
KV_PUSH_HEADER = "X-Sloserve-KV-Push"


def config_to_json(config: EngineConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def config_from_json(text: str) -> EngineConfig:
    d = json.loads(text)
    cache = CacheConfig(**d.pop("cache"))
    sched = SchedulerConfig(**d.pop("scheduler"))
    loras = tuple((name, path) for name, path in d.pop("lora_modules", ()))
    return EngineConfig(**d, cache=cache, scheduler=sched, lora_modules=loras)
