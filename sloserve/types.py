"""The shared vocabulary: requests, sampling parameters and QoS classes.

Pure Python. The scheduler, the memory manager, the engine and the simulator all speak
these types, which is what lets one scheduler drive both a real model and a cost model.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Optional


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # lost its KV (recompute) and waits to run again
    SWAPPED = "swapped"  # KV parked in a lower memory tier
    MIGRATING = "migrating"
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the client or the server


@dataclass(frozen=True)
class QoSClass:
    """A service class. Deadlines derive from a request's arrival time."""

    name: str = "default"
    ttft_target_s: float = math.inf
    tbt_target_s: float = math.inf
    priority: int = 0  # lower value = served first (as in vLLM's priority policy)
    weight: float = 1.0


DEFAULT_QOS = QoSClass()


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. Validated before any work is done."""

    max_tokens: Optional[int] = 16  # None = up to the context window
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: Optional[int] = None  # None = no logprobs; N >= 0 = sampled token plus top-N
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: object) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
              f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        check(is_num(self.temperature) and self.temperature >= 0,
              f"temperature must be a finite number >= 0, got {self.temperature!r}")
        check(is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        check(is_int(self.top_k) and self.top_k >= -1, f"top_k must be -1, 0 or a positive integer, got {self.top_k!r}")
        check(is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        check(is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}")
        check(is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}")
        check(is_num(self.repetition_penalty) and self.repetition_penalty > 0,
              f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        check(self.seed is None or is_int(self.seed), f"seed must be an integer, got {self.seed!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")
        check(all(is_int(t) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids must be a list of non-negative integers")
        check(is_int(self.min_tokens) and self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens!r}")
        check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
              f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(slots=True)
class Request:
    """One generation request as the schedulers see it.

    `num_computed_tokens` counts tokens whose KV is in the cache; the next step computes
    from there. After a preemption by recompute it drops to zero and the request recomputes
    its prompt *and* its output so far (all_token_ids), so greedy output is unchanged.

    The prompt is fixed once the request is made: its length is counted once, because the
    schedulers read it for every request in every step (and a simulated prompt is a lazy
    sequence whose len() is a Python call).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    qos: QoSClass = DEFAULT_QOS
    tenant: str = ""
    priority: Optional[int] = None  # overrides qos.priority when set
    predicted_output_len: Optional[int] = None
    max_output_tokens: Optional[int] = None  # max_tokens clipped to the context window
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: Optional[FinishReason] = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first schedule
    num_preemptions: int = 0
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.max_output_tokens is None:
            self.max_output_tokens = self.sampling_params.max_tokens

    @property
    def effective_priority(self) -> int:
        return self.qos.priority if self.priority is None else self.priority

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids in [start, end) of prompt + output, without building the whole list."""
        p = self.num_prompt_tokens
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def ttft_deadline(self) -> float:
        return self.arrival_time + self.qos.ttft_target_s
