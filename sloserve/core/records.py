"""One measured request: the record every metric, report and comparison is computed from.

Kept free of HTTP and of wall-clock reads so the simulator can fill the same records from
virtual time and reuse the summary and report code unchanged. All times are seconds; `*_s`
fields that are absolute are relative to the run's start, the others are durations.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional, Sequence

#: error kinds, in the order reports list them
ERROR_KINDS = ("http_429", "http_4xx", "http_5xx", "timeout", "connection", "incomplete", "stream_error",
               "cancelled", "other")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, linearly interpolated (NaN when empty)."""
    if not sorted_values:
        return math.nan
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return float(sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo))


def jsonable(x: Any) -> Any:
    """NaN and inf are not JSON; they become null (and NaN again on load)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x


def error_kind_for_status(status: int) -> str:
    if status == 429:
        return "http_429"
    if 400 <= status < 500:
        return "http_4xx"
    if status >= 500:
        return "http_5xx"
    return "other"


@dataclass
class RequestRecord:
    """What happened to one request, as the client saw it.

    TTFT is measured from `send_s` to the first streamed chunk that reports a token (its text may
    be empty); `itl_s` holds the gaps between consecutive token chunks (one per chunk after the first, so it has
    `output_tokens - 1` entries when every chunk is one token); `e2e_s` runs from `send_s` to
    the end of the stream. `scheduled_s` is when the workload said the request arrives and
    `dispatch_s` when the client's rate control released it; `send_s` can be later than
    `dispatch_s` only while a concurrency limit holds it back.
    """

    index: int
    request_id: str = ""
    tenant: str = ""
    qos_class: str = "default"
    scheduled_s: float = 0.0
    dispatch_s: float = 0.0
    send_s: float = 0.0
    ttft_s: Optional[float] = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: Optional[float] = None
    prompt_len: int = 0  # what the workload asked for
    output_len: int = 0  # max_tokens sent
    prompt_tokens: Optional[int] = None  # from the server's usage
    output_tokens: Optional[int] = None  # from usage; else the number of token chunks
    num_chunks: int = 0
    finish_reason: Optional[str] = None
    http_status: Optional[int] = None
    error: Optional[str] = None
    error_kind: Optional[str] = None

    @property
    def success(self) -> bool:
        return self.error_kind is None and self.e2e_s is not None

    @property
    def tpot_s(self) -> Optional[float]:
        """(E2E - TTFT) / (output tokens - 1), as `vllm bench serve`; undefined below 2 tokens."""
        if not self.success or self.ttft_s is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)  # type: ignore[operator]

    @property
    def normalized_e2e_s(self) -> Optional[float]:
        """E2E per output token: compares requests of different lengths."""
        if not self.success or not self.output_tokens:
            return None
        return self.e2e_s / self.output_tokens  # type: ignore[operator]

    @property
    def queue_delay_s(self) -> float:
        """Time the client itself held the request (concurrency limit), not the server's."""
        return self.send_s - self.dispatch_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RequestRecord":
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})
