"""The shared vocabulary: requests, sampling parameters and QoS classes.

Pure Python. The scheduler, the memory manager, the engine and the simulator all speak
these types, which is what lets one scheduler drive both a real model and a cost model.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
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
class SLO:
    """Latency targets in seconds; None = not part of this SLO. The one SLO type: a QoS class's
    targets (`QoSClass.slo`), the bench's and simulator's goodput, the server's attainment
    metrics. A request meets it if it succeeded and meets every target given (TPOT, the mean time
    between output tokens, is not checked for requests with fewer than two tokens)."""

    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None
    e2e_s: Optional[float] = None

    @property
    def empty(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None and self.e2e_s is None

    def met_by(self, ttft_s: Optional[float], tpot_s: Optional[float], e2e_s: Optional[float] = None) -> bool:
        """Whether a request that succeeded with these latencies meets every target given."""
        if self.ttft_s is not None and (ttft_s is None or ttft_s > self.ttft_s):
            return False
        if self.tpot_s is not None and tpot_s is not None and tpot_s > self.tpot_s:
            return False
        if self.e2e_s is not None and (e2e_s is None or e2e_s > self.e2e_s):
            return False
        return True

    def met(self, r) -> bool:
        """Whether request record `r` (success, ttft_s, tpot_s, e2e_s) met this SLO."""
        return bool(r.success) and self.met_by(r.ttft_s, r.tpot_s, r.e2e_s)

    def over(self, base: "SLO") -> "SLO":
        """This SLO's targets, falling back to `base` where this one gives none."""
        return SLO(*(getattr(self, f.name) if getattr(self, f.name) is not None else getattr(base, f.name)
                     for f in fields(self)))

    @classmethod
    def parse(cls, text: str) -> "SLO":
        """`ttft=500,tpot=50,e2e=10000` in milliseconds (as `vllm bench serve --goodput`)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, raw = part.partition("=")
            key = {"e2el": "e2e"}.get(key.strip().lower(), key.strip().lower())
            if not sep or key not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"bad SLO {part!r}: use ttft=MS, tpot=MS and/or e2e=MS")
            try:
                ms = float(raw)
            except ValueError:
                raise ValueError(f"bad SLO value {raw!r} for {key}: a number of milliseconds") from None
            if not ms > 0:
                raise ValueError(f"SLO {key} must be > 0 ms, got {raw}")
            values[f"{key}_s"] = ms / 1000.0
        return cls(**values)


def _finite(x: float) -> Optional[float]:
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class QoSClass:
    """A service class. Deadlines derive from a request's arrival time."""

    name: str = "default"
    ttft_target_s: float = math.inf
    tbt_target_s: float = math.inf
    priority: int = 0  # lower value = served first (as in vLLM's priority policy)
    weight: float = 1.0

    @property
    def slo(self) -> SLO:
        """This class's targets as an SLO (TBT checked as TPOT, the mean gap, as vLLM's goodput)."""
        return SLO(_finite(self.ttft_target_s), _finite(self.tbt_target_s))


DEFAULT_QOS = QoSClass()

# Limits on SamplingParams: what the engine can take without overflowing a torch integer or
# letting one request's stop list slow the whole batch. The server reports a breach as a 400.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # int64; torch seeds take [-2**63, 2**64 - 1], so seed + j (n) fits
INT32_MAX = 2**31 - 1  # top_k, max_tokens, min_tokens and token ids become int32/int64 tensors
MAX_LOGPROBS = 20  # top logprobs per token, as OpenAI
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


# What a structured output may constrain a generation to (engine/structured.py compiles each):
# a JSON schema (as JSON text), any JSON object, a regular expression, one of a list of strings,
# an EBNF grammar (GBNF, as llama.cpp and xgrammar read it), or tool calls in a model family's
# format (JSON text: {"functions": [{"name", "parameters"}], "format": "hermes", "parallel": bool}).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_calls")
MAX_STRUCTURED_CHARS = 100_000  # a schema, pattern or grammar longer than this is refused before compiling


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on what a request may generate: the tokens it samples are masked to those the
    constraint allows, and it ends when the constraint is complete (an EOS is then the only
    choice). `spec`: the schema's JSON text, the pattern, the grammar, or the choices (a tuple)."""

    kind: str
    spec: object = ""
    source: str = field(default="response_format", compare=False)  # the request field it came from (errors name it)

    def validate(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            ok = isinstance(self.spec, tuple) and 0 < len(self.spec) <= 1024 and all(
                isinstance(c, str) and c for c in self.spec)
            if not ok or sum(len(c) for c in self.spec) > MAX_STRUCTURED_CHARS:  # type: ignore[union-attr]
                raise ValueError("guided_choice must be a list of 1 to 1024 non-empty strings")
        elif self.kind != "json_object":
            if not isinstance(self.spec, str) or not self.spec:
                raise ValueError(f"a {self.kind} constraint needs its {self.kind} as a non-empty string")
            if len(self.spec) > MAX_STRUCTURED_CHARS:
                raise ValueError(f"a {self.kind} constraint may have at most {MAX_STRUCTURED_CHARS} characters")


def _show(value: object) -> str:
    """A value for an error message; a huge int has no printable repr (Python caps it at 4300 digits)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 64 else text[:61] + "..."


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
    structured: Optional[StructuredOutput] = None  # JSON schema, regex, choice or grammar (engine/structured.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        """Every field against the range the engine can take; messages start with the field name."""
        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        def is_int(x: object) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x: object) -> bool:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                return False
            try:
                return math.isfinite(x)
            except OverflowError:  # an int too large for a float
                return False

        def int_in(x: object, lo: int, hi: int) -> bool:
            return is_int(x) and lo <= x <= hi  # type: ignore[operator]

        check(self.max_tokens is None or int_in(self.max_tokens, 1, INT32_MAX),
              f"max_tokens must be an integer in [1, {INT32_MAX}], got {_show(self.max_tokens)}")
        check(is_num(self.temperature) and self.temperature >= 0,
              f"temperature must be a finite number >= 0, got {_show(self.temperature)}")
        check(is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {_show(self.top_p)}")
        check(int_in(self.top_k, -1, INT32_MAX),
              f"top_k must be -1, 0 or a positive integer up to {INT32_MAX}, got {_show(self.top_k)}")
        check(is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {_show(self.min_p)}")
        check(is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
              f"presence_penalty must be in [-2, 2], got {_show(self.presence_penalty)}")
        check(is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
              f"frequency_penalty must be in [-2, 2], got {_show(self.frequency_penalty)}")
        check(is_num(self.repetition_penalty) and self.repetition_penalty > 0,
              f"repetition_penalty must be a finite number > 0, got {_show(self.repetition_penalty)}")
        check(self.seed is None or int_in(self.seed, SEED_MIN, SEED_MAX),
              f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}], got {_show(self.seed)}")
        check(isinstance(self.stop, (list, tuple)) and len(self.stop) <= MAX_STOP_STRINGS,
              f"stop must be a list of at most {MAX_STOP_STRINGS} strings")
        check(all(isinstance(s, str) and 1 <= len(s) <= MAX_STOP_STRING_CHARS for s in self.stop),
              f"stop must hold strings of 1 to {MAX_STOP_STRING_CHARS} characters")
        check(isinstance(self.stop_token_ids, (list, tuple)) and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
              f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids")
        check(all(int_in(t, 0, INT32_MAX) for t in self.stop_token_ids),
              f"stop_token_ids must be integers in [0, {INT32_MAX}]")
        check(int_in(self.min_tokens, 0, INT32_MAX),
              f"min_tokens must be an integer in [0, {INT32_MAX}], got {_show(self.min_tokens)}")
        check(self.logprobs is None or int_in(self.logprobs, 0, MAX_LOGPROBS),
              f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {_show(self.logprobs)}")
        if self.structured is not None:
            check(isinstance(self.structured, StructuredOutput), "structured must be a StructuredOutput")
            self.structured.validate()
            # the constraint ends the output with EOS: neither may hold it back
            check(not self.ignore_eos, "ignore_eos must be false with a structured output (the constraint ends the output)")
            check(self.min_tokens == 0, "min_tokens must be 0 with a structured output (the constraint ends the output)")

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
    # Salts the prefix cache's block keys: requests with different salts never share cached KV.
    # None = the tenant (the simulator's default); the server passes a keyed hash of the
    # request's cache namespace (tenant, API key or shared), so the salt reveals nothing.
    cache_salt: Optional[str] = None
    # The LoRA adapter the request runs with (engine/lora.py); None = the base model. The same
    # tokens give other KV under another adapter, so the adapter's name salts the cache too.
    lora: Optional[str] = None
    priority: Optional[int] = None  # overrides qos.priority when set
    predicted_output_len: Optional[int] = None
    # What the scheduler expects at arrival (policies that price prefills ask for it): prompt
    # tokens a prefix hit will skip, on the device or in a lower KV tier, and the seconds
    # loading the tier's part will take. An estimate: the caches may change before admission.
    expected_cached_tokens: int = 0
    expected_load_s: float = 0.0
    resume_after: float = 0.0  # rotated out for its SLO slack: not readmitted before this (sched/rotation.py)
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
    # Every gap between the steps that gave this request tokens (what a streaming client sees as
    # inter-token latency), kept only when asked (the simulator's --token-gaps): None keeps nothing.
    token_gaps: Optional[list[float]] = None
    finished_time: Optional[float] = None
    num_prompt_tokens: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.prompt_token_ids)
        if self.cache_salt is None:
            self.cache_salt = self.tenant
        if self.lora is not None and not self.cache_salt.endswith(suffix := f"\x1flora:{self.lora}"):
            self.cache_salt += suffix
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
