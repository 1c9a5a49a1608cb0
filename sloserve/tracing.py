"""OpenTelemetry traces of requests: what a trace viewer shows of one call through sloserve.

Off unless an OTLP/HTTP collector is named (`sloserve serve --otlp-traces-endpoint URL`); the
OpenTelemetry SDK is imported only then. When on:
- a worker (or a single server) records one span per engine request, `llm_request`, from its
  arrival to its end, with the GenAI semantic conventions' attributes (model, operation, usage,
  finish reason) and sloserve's own (QoS class, whether it met its SLO, TTFT, TPOT, time queued,
  cached tokens, adapter), and events at its first scheduling and its first token;
- a fleet's front records `sloserve.front` per call, from arrival until it hands the client an
  answer or the start of a stream (routing, retries, a cold start's wait), and passes its context
  on to the workers in the W3C `traceparent` header, so their spans are its children; a stream
  resumed elsewhere (failover, migration) carries the same context.
A client's own `traceparent` makes every span part of the client's trace.

Spans are recorded when a request ends, with the times it had (arrival to end), so nothing is held
open across the event loop, and a span that fails to export never touches the request."""
from __future__ import annotations

import logging
import time
from typing import Any, Mapping, MutableMapping, Optional
from urllib.parse import urlparse

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context: what is carried between processes
EXPORT_DELAY_MS = 1000  # spans go out in batches at most this long after they end


def trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace-context headers of an incoming request (empty when it has none)."""
    return {k: v for k in TRACE_HEADERS if (v := headers.get(k))}


def wall_ns(monotonic_s: float, now_monotonic: Optional[float] = None) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds (what spans are stamped with)."""
    now = time.monotonic() if now_monotonic is None else now_monotonic
    return time.time_ns() - int((now - monotonic_s) * 1e9)


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of `endpoint`: as given when it names a path, else its /v1/traces."""
    parsed = urlparse(endpoint)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL of an OTLP collector, got {endpoint!r}")
    return endpoint if parsed.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


class Tracing:
    """Spans of one process (`service`: sloserve-front, sloserve-worker, sloserve); `endpoint`
    None: off, every call a no-op."""

    def __init__(self, endpoint: Optional[str], service: str, instance: Optional[str] = None) -> None:
        self._provider = None
        self._tracer = None
        if endpoint is None:
            return
        url = traces_url(endpoint)
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError:
            raise ValueError("--otlp-traces-endpoint needs the OpenTelemetry SDK: pip install 'sloserve[tracing]'") \
                from None
        attributes = {"service.name": service}
        if instance:
            attributes["service.instance.id"] = instance
        self._provider = TracerProvider(resource=Resource.create(attributes))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url),
                                                             schedule_delay_millis=EXPORT_DELAY_MS))
        self._tracer = self._provider.get_tracer("sloserve")

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def record(self, name: str, carrier: Mapping[str, str], start_ns: int, end_ns: int,
               attributes: Mapping[str, Any], events: Mapping[str, int] = {}, error: Optional[str] = None) -> None:
        """A span `name` that ran from `start_ns` to `end_ns`, child of the context in `carrier`
        (W3C headers; none: a new trace); `events`: name -> time in ns; `error`: its description
        when the request failed."""
        self.end(self.begin(name, carrier, start_ns), end_ns, attributes, events, error)

    def begin(self, name: str, carrier: Mapping[str, str], start_ns: Optional[int] = None):
        """A server span started now (or at `start_ns`), child of `carrier`'s context; None when off."""
        if self._tracer is None:
            return None
        from opentelemetry.propagate import extract
        from opentelemetry.trace import SpanKind

        return self._tracer.start_span(name, context=extract(dict(carrier)), start_time=start_ns,
                                       kind=SpanKind.SERVER)

    def inject(self, span, headers: MutableMapping[str, str]) -> None:
        """Put `span`'s context into `headers` (what the next process continues)."""
        if span is None:
            return
        from opentelemetry.propagate import inject
        from opentelemetry.trace import set_span_in_context

        for key in TRACE_HEADERS:
            headers.pop(key, None)
        inject(headers, context=set_span_in_context(span))

    def end(self, span, end_ns: Optional[int] = None, attributes: Mapping[str, Any] = {},
            events: Mapping[str, int] = {}, error: Optional[str] = None) -> None:
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        try:
            span.set_attributes({k: v for k, v in attributes.items() if v is not None})
            for event, at in events.items():
                span.add_event(event, timestamp=at)
            if error is not None:
                span.set_status(Status(StatusCode.ERROR, error))
        except Exception:  # a span must never take a request down
            logger.exception("recording span %s failed", getattr(span, "name", "?"))
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Export what is pending and stop (at the process's end)."""
        if self._provider is not None:
            try:
                self._provider.shutdown()
            except Exception:
                logger.exception("flushing traces failed")
            self._provider = self._tracer = None


OFF = Tracing(None, "sloserve")

__all__ = ["Tracing", "OFF", "TRACE_HEADERS", "trace_headers", "wall_ns", "traces_url", "EXPORT_DELAY_MS"]
