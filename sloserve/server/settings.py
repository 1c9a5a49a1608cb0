"""What a server instance is configured with, apart from the engine."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Optional

from sloserve.server.connections import ConnectionLimits
from sloserve.server.qos import QoSRegistry
from sloserve.tracing import traces_url


EVENT_LOOPS = ("auto", "asyncio", "uvloop")
TOOL_PARSER_CHOICES = ("auto", "hermes", "llama3_json", "mistral")  # auto, then tool_parsers.TOOL_PARSERS


@dataclass
class ServerSettings:
    # Names clients may put in `model`; the first is the one responses report.
    served_model_names: list[str] = field(default_factory=list)
    registry: QoSRegistry = field(default_factory=QoSRegistry)
    # Requests beyond one full batch that may wait for the engine; more get 429.
    max_queue: int = 256
    max_body_bytes: int = 4 * 2**20
    grace_period_s: float = 30.0
    retry_after_s: int = 1
    # Connection hygiene (see connections.py): head and body read timeouts, open-socket cap.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024
    keep_alive_s: float = 5.0
    # Refuse (429 slo_unattainable) a request whose predicted TTFT already misses its class's
    # target, instead of queueing it behind work it cannot overtake (see shedding.py).
    shed_unattainable: bool = True
    # A stream whose client does not accept one write within this many seconds is ended and its
    # engine requests aborted (a client that stopped reading must not hold a batch slot forever).
    stall_timeout_s: float = 60.0
    # Keys the prefix cache's salts (HMAC of each request's cache namespace); None = the
    # environment's SLOSERVE_CACHE_SECRET, else random per process.
    cache_salt_secret: Optional[str] = field(default=None, repr=False)
    # With admin keys, /metrics (and on a multi-instance front /v1/instances) needs one of them.
    admin_keys: list[str] = field(default_factory=list, repr=False)
    # How often the dashboard's timeline samples the instances (seconds of wall clock).
    timeline_interval_s: float = 1.0
    # The HTTP server's event loop (uvicorn's `loop`): "auto" takes uvloop where installed.
    event_loop: str = "auto"
    # Reads tool calls out of chat outputs and names the format forced calls are generated in
    # (tool_calls.py): hermes, llama3_json, mistral, or auto (the one the chat template's format calls for).
    tool_call_parser: str = "auto"
    # A constraint (schema, regex, grammar, forced tool calls) compiles off the event loop; one that
    # takes longer than this is refused with 400 constraint_too_complex.
    grammar_compile_timeout_s: float = 10.0
    # An OTLP/HTTP collector that gets a span per request (tracing.py); None: no tracing.
    otlp_traces_endpoint: Optional[str] = None

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(header_timeout_s=self.header_timeout_s, body_timeout_s=self.body_timeout_s,
                                max_connections=self.max_connections, keep_alive_s=self.keep_alive_s,
                                retry_after_s=self.retry_after_s)

    def validate(self) -> None:
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period must be >= 0, got {self.grace_period_s}")
        if any(not n for n in self.served_model_names):
            raise ValueError("served model names must be non-empty")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"client stall timeout must be > 0, got {self.stall_timeout_s}")
        if not self.timeline_interval_s > 0:
            raise ValueError(f"dashboard interval must be > 0, got {self.timeline_interval_s}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar compile timeout must be > 0, got {self.grammar_compile_timeout_s}")
        if self.tool_call_parser not in TOOL_PARSER_CHOICES:
            raise ValueError(f"tool-call parser must be one of {', '.join(TOOL_PARSER_CHOICES)}, "
                             f"got {self.tool_call_parser!r}")
        if self.event_loop not in EVENT_LOOPS:
            raise ValueError(f"event loop must be one of {', '.join(EVENT_LOOPS)}, got {self.event_loop!r}")
        if self.event_loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
            raise ValueError("event loop uvloop: the uvloop package is not installed (pip install uvloop)")
        self.connection_limits().validate()
        if self.otlp_traces_endpoint is not None:
            traces_url(self.otlp_traces_endpoint)
