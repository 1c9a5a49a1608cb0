"""The one normalized request a workload is made of.

Every trace format, synthetic generator and transform speaks `WorkloadRequest`, so the load
generator and the simulator consume the same stream whatever it came from. It is plain data
(no torch, no engine): the simulator needs only the lengths and arrival times, the HTTP
client additionally needs a prompt (text or token ids).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Sequence

DEFAULT_CLASS = "default"


@dataclass
class WorkloadRequest:
    """One request of a workload.

    `prompt_len` is the intended prompt length in tokens of the served model's tokenizer once a
    prompt has been synthesized; before that (a trace giving only counts) it is the trace's count.
    `hash_ids` name the prompt's prefix blocks of `hash_block_size` tokens: two requests with equal
    ids at equal positions share that prefix (Mooncake semantics), which the synthesizer turns
    into identical token blocks so that prefix caching has real work to reuse.
    """

    arrival_s: float
    prompt_len: int
    output_len: int
    tenant: str = ""
    qos_class: str = DEFAULT_CLASS
    prompt_text: Optional[str] = None
    prompt_token_ids: Optional[list[int]] = None
    hash_ids: Optional[tuple[int, ...]] = None
    hash_block_size: Optional[int] = None
    request_id: str = ""
    source: str = ""
    structured: bool = False  # its output is under a structured output's token mask (a JSON schema)

    def __post_init__(self) -> None:
        if self.prompt_len < 0 or self.output_len < 0:
            raise ValueError(f"negative length in request {self.request_id!r}: "
                             f"prompt_len={self.prompt_len}, output_len={self.output_len}")
        if self.hash_ids is not None and not isinstance(self.hash_ids, tuple):
            self.hash_ids = tuple(self.hash_ids)

    @property
    def has_prompt(self) -> bool:
        return self.prompt_text is not None or self.prompt_token_ids is not None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (None fields dropped, so a lengths-only stream stays small)."""
        d = asdict(self)
        if self.hash_ids is not None:
            d["hash_ids"] = list(self.hash_ids)
        return {k: v for k, v in d.items() if v is not None and v != "" and v is not False}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "WorkloadRequest":
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown workload request fields: {sorted(unknown)}")
        return cls(**dict(d))


def is_sorted_by_arrival(requests: Sequence[WorkloadRequest]) -> bool:
    return all(a.arrival_s <= b.arrival_s for a, b in zip(requests, requests[1:]))
