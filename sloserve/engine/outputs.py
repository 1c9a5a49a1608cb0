"""What the engine hands back to callers, one object per request per step."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # N most likely (id, logprob), descending


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> Optional[float]:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str  # the whole output text so far (stop string removed)
    token_ids: list[int]  # the whole output so far
    delta_text: str  # text new since the previous output of this request
    delta_token_ids: list[int]
    finished: bool
    finish_reason: Optional[str]  # "stop", "length", "abort" once finished
    logprobs: Optional[list[TokenLogprob]]
    num_cached_tokens: int
    metrics: RequestMetrics
    stop_reason: Optional[str | int] = None  # the stop string or stop token id that ended it

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)
