"""What a front and its workers agree on: how a worker is started and configured, how the
front authenticates itself to the worker's internal routes, how the worker annotates the
streams it sends its front, and the two messages they exchange as data: `WorkerState` (each
health poll) and `MigrationSnapshot` (a live migration's stop-and-copy). Both carry
`CONTRACT_VERSION`; a front refuses a message of another version."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from sloserve.core.config import CacheConfig, EngineConfig, SchedulerConfig
from sloserve.sched.state import InstanceState

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
# "CLASS PRIORITY" (PRIORITY an int or "-") on a generation request from the front (with the fleet
# secret): the QoS class and priority the front resolved for its caller, which the worker uses as
# given instead of resolving them again.
QOS_HEADER = "X-Sloserve-QoS"
# A generation body's field from the front (with the fleet secret): the prompt's token ids, tokenized once there.
FRONT_IDS_FIELD = "sloserve_prompt_ids"


def qos_header(class_name: str, priority) -> str:
    return f"{class_name} {'-' if priority is None else int(priority)}"


def parse_qos_header(value: str) -> tuple[str, "int | None"]:
    """(class name, priority or None) of a QOS_HEADER value; ValueError if malformed."""
    name, _, priority = value.strip().rpartition(" ")
    if not name:
        raise ValueError(f"malformed {QOS_HEADER} {value!r}: expected 'CLASS PRIORITY'")
    return name, None if priority == "-" else int(priority)


def config_to_json(config: EngineConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def config_from_json(text: str) -> EngineConfig:
    d = json.loads(text)
    cache = CacheConfig(**d.pop("cache"))
    sched = SchedulerConfig(**d.pop("scheduler"))
    loras = tuple((name, path) for name, path in d.pop("lora_modules", ()))
    return EngineConfig(**d, cache=cache, scheduler=sched, lora_modules=loras)


CONTRACT_VERSION = 2  # of the messages below: change it with any change to their fields


class ContractError(ValueError):
    """A worker's message this front cannot read (another contract version, or malformed)."""


def _check_version(payload: Any, what: str) -> dict:
    if not isinstance(payload, dict):
        raise ContractError(f"{what}: expected a JSON object, got {type(payload).__name__}")
    version = payload.get("version")
    if version != CONTRACT_VERSION:
        raise ContractError(f"{what}: the worker speaks contract version {version!r}, this front "
                            f"{CONTRACT_VERSION} (run the front and its workers from one sloserve)")
    return payload


@dataclass(frozen=True)
class WorkerState:
    """What a worker's `GET /internal/state` tells its front: the scheduler's load snapshot (its
    router's view), the newest cached block keys (for prefix-aware routing) and the counters
    the front's dashboard draws."""

    state: InstanceState  # without its live prefix index: `prefix_keys` stands for it
    prefix_keys: frozenset[int] = frozenset()
    reading: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        fields = {f.name: getattr(self.state, f.name) for f in dataclasses.fields(self.state)
                  if f.name != "prefix_index"}
        if math.isinf(fields["min_ttft_slack_s"]):
            fields["min_ttft_slack_s"] = None  # JSON has no infinity
        fields["adapters"] = sorted(fields["adapters"])
        return {"version": CONTRACT_VERSION, "state": fields,
                "prefix_keys": [format(k, "x") for k in self.prefix_keys], "reading": dict(self.reading)}

    @classmethod
    def from_json(cls, payload: Any) -> "WorkerState":
        payload = _check_version(payload, "worker state")
        try:
            fields = dict(payload["state"])
            if fields.get("min_ttft_slack_s") is None:
                fields["min_ttft_slack_s"] = float("inf")
            fields["adapters"] = frozenset(fields.get("adapters") or ())
            return cls(InstanceState(**fields), frozenset(int(k, 16) for k in payload.get("prefix_keys", ())),
                       dict(payload.get("reading") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise ContractError(f"worker state: malformed ({type(e).__name__}: {e})") from e


@dataclass(frozen=True)
class MigrationSnapshot:
    """A source worker's answer to `POST /internal/migrate`: the suspended request's resume
    state (the target adopts it with the KV already sent) and what the copy took."""

    resume: dict  # engine.migration.ResumeState as JSON
    num_output_tokens: int  # tokens the request had produced when it was suspended
    rounds: int = 0  # pre-copy rounds before the stop-and-copy
    bytes: int = 0  # KV bytes sent, pre-copy and stop-and-copy
    copy_s: float = 0.0  # the whole copy, pre-copy rounds included
    stop_copy_s: float = 0.0  # the stop-and-copy alone: the request was suspended this long here
    stop_copy_blocks: int = 0
    early_bytes: int = 0  # of `bytes`, those a pipelined hand-off sent while the prompt was computed

    def to_json(self) -> dict:
        return {"version": CONTRACT_VERSION, **dataclasses.asdict(self)}

    def timings(self) -> dict:
        """Everything but the resume state: what the worker reports of its latest move."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "resume"}

    @classmethod
    def from_json(cls, payload: Any) -> "MigrationSnapshot":
        payload = _check_version(payload, "migration snapshot")
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in payload.items() if k in names})
        except TypeError as e:
            raise ContractError(f"migration snapshot: malformed ({e})") from e
