"""Prometheus metrics with vLLM's names under the `sloserve:` prefix, plus SLO attainment.

Each app owns its registry (no process-global state), so several servers or test apps can
live in one process. Engine gauges are read at scrape time from the engine's own counters,
so the engine loop pays nothing for them; per-request histograms are fed once, when a
request finishes, from the server side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from sloserve.timeline import FleetTimeline
from sloserve.core.types import QoSClass

PREFIX = "sloserve:"

# Bucket edges follow vLLM's, so dashboards' heatmaps look the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)

# What the README documents: sloserve name -> vLLM name (None = sloserve only).
VLLM_NAMES: dict[str, Optional[str]] = {
    "sloserve:num_requests_running": "vllm:num_requests_running",
    "sloserve:num_requests_waiting": "vllm:num_requests_waiting",
    "sloserve:kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "sloserve:prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "sloserve:prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "sloserve:num_preemptions_total": "vllm:num_preemptions_total",
    "sloserve:prompt_tokens_total": "vllm:prompt_tokens_total",
    "sloserve:generation_tokens_total": "vllm:generation_tokens_total",
    "sloserve:request_success_total": "vllm:request_success_total",
    "sloserve:time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "sloserve:inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "sloserve:e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "sloserve:request_time_per_output_token_seconds": "vllm:request_time_per_output_token_seconds",
    "sloserve:request_queue_time_seconds": "vllm:request_queue_time_seconds",
    "sloserve:request_prompt_tokens": "vllm:request_prompt_tokens",
    "sloserve:request_generation_tokens": "vllm:request_generation_tokens",
    "sloserve:spec_decode_num_draft_tokens_total": "vllm:spec_decode_num_draft_tokens_total",
    "sloserve:spec_decode_num_accepted_tokens_total": "vllm:spec_decode_num_accepted_tokens_total",
    "sloserve:num_requests_in_flight": None,
    "sloserve:engine_steps_total": None,
    "sloserve:engine_scheduled_seqs_total": None,
    "sloserve:engine_max_batch_size": None,
    "sloserve:requests_rejected_total": None,
    "sloserve:http_requests_total": None,
    "sloserve:client_stalled_total": None,
    "sloserve:slo_requests_total": None,
    "sloserve:slo_attained_requests_total": None,
    "sloserve:slo_attainment_ratio": None,
}


@dataclass
class FinishedRequest:
    """What the server learned about one request by the time it ended."""

    request_id: str
    tenant: str
    qos: QoSClass
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    finish_reason: str
    ttft: Optional[float]
    e2e: Optional[float]
    queue_time: Optional[float]
    itls: list[float] = field(default_factory=list)
    lora: Optional[str] = None  # the adapter it ran with: its metrics carry the adapter's name as model_name

    @property
    def tpot(self) -> Optional[float]:
        """Mean time between output tokens after the first (TPOT = mean TBT)."""
        if self.ttft is None or self.e2e is None or self.num_output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)

    @property
    def meets_slo(self) -> bool:
        """TTFT within the class target and mean TBT within the TBT target (QoSClass.slo)."""
        return self.ttft is not None and self.qos.slo.met_by(self.ttft, self.tpot)


@dataclass(frozen=True)
class EngineGauges:
    """How the collector reads the engine; plain callables so tests can fake an engine."""

    num_running: Callable[[], int]
    num_waiting: Callable[[], int]
    kv_usage: Callable[[], float]
    prefix_queries: Callable[[], int]
    prefix_hits: Callable[[], int]
    num_preemptions: Callable[[], int]
    num_steps: Callable[[], int]
    scheduled_seqs: Callable[[], int]
    max_batch_size: Callable[[], int]
    num_in_flight: Callable[[], int]
    spec_draft_tokens: Callable[[], int] = lambda: 0
    spec_accepted_tokens: Callable[[], int] = lambda: 0

    @classmethod
    def of(cls, engine, num_in_flight: Callable[[], int]) -> "EngineGauges":
        """Views of an LLMEngine's scheduler and KV manager (read-only, from any thread)."""
        sched, kv = engine.scheduler, engine.kv
        spec = sched.speculator
        return cls(
            num_running=lambda: sched.num_running,
            num_waiting=lambda: sched.num_waiting,
            kv_usage=lambda: kv.usage,
            prefix_queries=lambda: kv.stats.queries,
            prefix_hits=lambda: kv.stats.hits,
            num_preemptions=lambda: sched.stats.num_preemptions,
            num_steps=lambda: sched.stats.num_steps,
            scheduled_seqs=lambda: sched.stats.total_scheduled_seqs,
            max_batch_size=lambda: sched.stats.max_batch_size,
            num_in_flight=num_in_flight,
            spec_draft_tokens=(lambda: spec.stats.num_draft_tokens) if spec else (lambda: 0),
            spec_accepted_tokens=(lambda: spec.stats.num_accepted_tokens) if spec else (lambda: 0),
        )


class _EngineCollector(Collector):
    def __init__(self, gauges: EngineGauges, model_name: str, slo: "ServerMetrics") -> None:
        self._g = gauges
        self._model = model_name
        self._slo = slo

    def collect(self) -> Iterable[Metric]:
        g, labels = self._g, ["model_name"]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            m = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            m.add_metric([self._model], value)
            return m

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            m.add_metric([self._model], value)
            return m

        yield gauge("num_requests_running", "Requests in the running batch.", g.num_running())
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).", g.num_waiting())
        yield gauge("num_requests_in_flight", "Requests admitted by the server and not yet answered.",
                    g.num_in_flight())
        yield gauge("kv_cache_usage_perc", "KV-cache usage, 0 to 1 (1 = all blocks referenced).", g.kv_usage())
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", g.prefix_queries())
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", g.prefix_hits())
        yield counter("num_preemptions", "Preemptions of running requests.", g.num_preemptions())
        yield counter("engine_steps", "Engine iterations that ran the model.", g.num_steps())
        yield counter("engine_scheduled_seqs", "Sum of batch sizes over engine steps (mean = this / steps).",
                      g.scheduled_seqs())
        yield gauge("engine_max_batch_size", "Largest batch an engine step has run.", g.max_batch_size())
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding).",
                      g.spec_draft_tokens())
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens the model agreed with.",
                      g.spec_accepted_tokens())
        ratio = GaugeMetricFamily(PREFIX + "slo_attainment_ratio",
                                  "Share of finished requests of a QoS class that met its TTFT and TBT targets.",
                                  labels=labels + ["qos_class"])
        for qos_class, (total, attained) in self._slo.slo_totals().items():
            ratio.add_metric([self._model, qos_class], attained / total if total else math.nan)
        yield ratio


class ServerMetrics:
    """The registry behind `/metrics`, and the hooks the server feeds."""

    def __init__(self, gauges: EngineGauges, model_name: str, timeline: Optional[FleetTimeline] = None) -> None:
        """`timeline`: where finished requests also go (the dashboard's per-class latencies)."""
        self.timeline = timeline
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefill tokens processed.", m, registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generation tokens produced.", m, registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                       m + ["finished_reason"], registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between consecutive output tokens.", m,
                             buckets=ITL_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "request_time_per_output_token_seconds",
                              "Per request: mean time per output token after the first.", m,
                              buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.", m,
                             buckets=E2E_BUCKETS, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Arrival to first scheduled.", m,
                                    buckets=TTFT_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(PREFIX + "request_prompt_tokens", "Prompt length per request.", m,
                                               buckets=TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(PREFIX + "request_generation_tokens",
                                                   "Output length per request.", m, buckets=TOKEN_BUCKETS, registry=r)
        self.slo_requests = Counter(PREFIX + "slo_requests", "Finished (not aborted) requests per QoS class.",
                                    m + ["qos_class"], registry=r)
        self.slo_attained = Counter(PREFIX + "slo_attained_requests",
                                    "Finished requests that met their class's TTFT and TBT targets.",
                                    m + ["qos_class"], registry=r)
        self.rejected = Counter(PREFIX + "requests_rejected", "Requests refused before admission, by reason.",
                                m + ["reason"], registry=r)
        self.http_requests = Counter(PREFIX + "http_requests", "HTTP responses by route and status code.",
                                     m + ["route", "status"], registry=r)
        self.client_stalled = Counter(PREFIX + "client_stalled", "Streams ended because the client stopped reading.",
                                      m, registry=r)
        self.client_stalled.labels(model_name)  # exposed (as 0) before the first one
        self._slo_totals: dict[str, list[int]] = {}
        r.register(_EngineCollector(gauges, model_name, self))

    def observe_finished(self, rec: FinishedRequest) -> None:
        name = rec.lora or self.model_name
        self.prompt_tokens.labels(name).inc(rec.num_prompt_tokens)
        self.generation_tokens.labels(name).inc(rec.num_output_tokens)
        self.request_success.labels(name, rec.finish_reason).inc()
        self.request_prompt_tokens.labels(name).observe(rec.num_prompt_tokens)
        self.request_generation_tokens.labels(name).observe(rec.num_output_tokens)
        if rec.ttft is not None:
            self.ttft.labels(name).observe(rec.ttft)
        if rec.e2e is not None:
            self.e2e.labels(name).observe(rec.e2e)
        if rec.queue_time is not None:
            self.queue_time.labels(name).observe(rec.queue_time)
        if rec.tpot is not None:
            self.tpot.labels(name).observe(rec.tpot)
        itl = self.itl.labels(name)
        for gap in rec.itls:
            itl.observe(gap)
        if rec.finish_reason != "abort":  # a client that left says nothing about the SLO
            cls = rec.qos.name
            self.slo_requests.labels(name, cls).inc()
            totals = self._slo_totals.setdefault(cls, [0, 0])
            totals[0] += 1
            if rec.meets_slo:
                self.slo_attained.labels(name, cls).inc()
                totals[1] += 1
            if self.timeline is not None:
                self.timeline.finished(cls, rec.ttft, rec.tpot, rec.meets_slo)

    def slo_totals(self) -> dict[str, tuple[int, int]]:
        return {k: (v[0], v[1]) for k, v in list(self._slo_totals.items())}

    def observe_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def observe_stalled(self) -> None:
        self.client_stalled.labels(self.model_name).inc()

    def observe_http(self, route: str, status: int) -> None:
        self.http_requests.labels(self.model_name, route, str(status)).inc()
