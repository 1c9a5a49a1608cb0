"""A stock vLLM server's load, read from its Prometheus `/metrics` as the fleet reads any worker:
an InstanceState for the router and the counters the dashboard draws (timeline.READING_FIELDS).

The text is parsed with prometheus_client's own parser. Both generations of vLLM's metric names
are read (`vllm:kv_cache_usage_perc`, older `vllm:gpu_cache_usage_perc`; the prefix-cache counters
likewise); samples of every label set (model, engine) are summed. A server whose metrics lack
what the router needs is refused in one line naming what is missing: a vLLM of another
generation, or not a vLLM server at all.

What vLLM does not publish is left for the front to add: queued prompt tokens and predicted
decode (the front counts what it routed since the last poll), TTFT slack (none: inf), and the
prefix cache's contents (its KV events: kinds/vllm_events.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional

from sloserve.sched.state import InstanceState

# What the router needs, each under any of its names (newest first)
RUNNING = ("vllm:num_requests_running",)
WAITING = ("vllm:num_requests_waiting",)
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
REQUIRED = {"running requests": RUNNING, "waiting requests": WAITING, "KV cache usage": KV_USAGE}
# Read where present
PREFIX_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
PREFIX_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")
PREEMPTIONS = ("vllm:num_preemptions",)
GENERATION_TOKENS = ("vllm:generation_tokens",)
CACHE_INFO = "vllm:cache_config_info"  # labels: block_size, num_gpu_blocks, ...
LORA_INFO = "vllm:lora_requests_info"  # labels: running_lora_adapters, waiting_lora_adapters, max_lora


class MetricsError(ValueError):
    """A worker's /metrics this front cannot read."""


@dataclass(frozen=True)
class VllmLoad:
    """One scrape of a vLLM server, summed over its label sets."""

    running: int
    waiting: int
    kv_usage: float  # 0..1 of the device's KV blocks in use
    block_size: int
    num_blocks: int  # the KV pool's size, 0 when the server does not say
    prefix_queries: float = 0.0  # tokens asked of the prefix cache, since start
    prefix_hits: float = 0.0
    preemptions: float = 0.0
    generation_tokens: float = 0.0
    lora_in_flight: frozenset[str] = frozenset()  # adapters of running or waiting requests

    def instance_state(self, default_block_size: int = 16) -> InstanceState:
        block_size = self.block_size or default_block_size
        used = round(self.kv_usage * self.num_blocks)
        return InstanceState(
            num_running=self.running, num_waiting=self.waiting, queued_prefill_tokens=0, kv_blocks_used=used,
            kv_blocks_free=max(0, self.num_blocks - used), kv_blocks_total=self.num_blocks,
            predicted_remaining_decode_tokens=0,
            prefix_cache_hit_rate=self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
            min_ttft_slack_s=math.inf, block_size=block_size, adapters=self.lora_in_flight)

    def reading(self) -> dict[str, float]:
        """The dashboard's counters (timeline.READING_FIELDS) vLLM publishes."""
        return {"running": self.running, "waiting": self.waiting, "preempted": self.preemptions,
                "kv_blocks_used": round(self.kv_usage * self.num_blocks), "kv_blocks_total": self.num_blocks,
                "prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits,
                "output_tokens": self.generation_tokens}


def parse_metrics(text: str) -> VllmLoad:
    """The load one `/metrics` text reports; MetricsError when it lacks what routing needs."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    labels: dict[str, list[dict[str, str]]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith(("_created", "_bucket", "_count", "_sum")):
                    continue
                name = sample.name[:-len("_total")] if sample.name.endswith("_total") else sample.name
                values[name] = values.get(name, 0.0) + float(sample.value)
                if name in (CACHE_INFO, LORA_INFO):
                    labels.setdefault(name, []).append(dict(sample.labels))
    except (ValueError, TypeError, IndexError) as e:
        raise MetricsError(f"unreadable /metrics ({type(e).__name__}: {e})") from None
    missing = [what for what, names in REQUIRED.items() if _first(values, names) is None]
    if missing:
        raise MetricsError(f"/metrics has no {', '.join(missing)} (looked for "
                           f"{', '.join(n for what in missing for n in REQUIRED[what])}): not a vLLM server, or a "
                           f"vLLM whose metric names this sloserve does not know")
    info = (labels.get(CACHE_INFO) or [{}])[0]
    adapters: set[str] = set()
    for lora in labels.get(LORA_INFO, []):
        for key in ("running_lora_adapters", "waiting_lora_adapters"):
            adapters.update(a for a in lora.get(key, "").split(",") if a)
    usage = float(_first(values, KV_USAGE))  # type: ignore[arg-type]
    running, waiting = int(_first(values, RUNNING)), int(_first(values, WAITING))  # type: ignore[arg-type]
    return VllmLoad(running=running, waiting=waiting,
                    kv_usage=usage / 100.0 if usage > 1.0 else usage, block_size=_int(info.get("block_size")),
                    num_blocks=_int(info.get("num_gpu_blocks")),
                    prefix_queries=_first(values, PREFIX_QUERIES) or 0.0,
                    prefix_hits=_first(values, PREFIX_HITS) or 0.0,
                    preemptions=_first(values, PREEMPTIONS) or 0.0,
                    generation_tokens=_first(values, GENERATION_TOKENS) or 0.0, lora_in_flight=frozenset(adapters))


def _first(values: dict[str, float], names: Iterable[str]) -> Optional[float]:
    return next((values[n] for n in names if n in values), None)


def _int(text: Optional[str]) -> int:
    try:
        return int(float(text)) if text not in (None, "", "None") else 0
    except ValueError:
        return 0
