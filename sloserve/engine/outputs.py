"""What the engine hands back to callers, one object per request per step.

A `RequestOutput` carries only what is new since the previous output of its request (text,
token ids, logprobs) plus cheap cumulative counts, so producing one costs O(new tokens), not
O(output so far). Consumers that want the whole output fold the deltas with an
`OutputAccumulator`; a stream whose reader lags behind folds them the same way, so what it
holds is bounded by the output itself, never by the number of steps.
"""
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
    """One request's progress since its previous output."""

    request_id: str
    prompt_token_ids: list[int]  # the request's own list (not a copy): do not mutate
    delta_text: str  # text new since the previous output (a stop string is never shown)
    delta_token_ids: list[int]
    delta_logprobs: Optional[list[TokenLogprob]]  # one per delta token; None when not asked for
    num_output_tokens: int  # all output tokens so far, this delta included
    finished: bool
    finish_reason: Optional[str]  # "stop", "length", "abort" once finished
    num_cached_tokens: int
    metrics: RequestMetrics
    stop_reason: Optional[str | int] = None  # the stop string or stop token id that ended it
    error: Optional[str] = None  # set when the engine failed this request (finish_reason "abort")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class CompletedOutput:
    """A request's whole output so far, folded from its deltas."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: Optional[list[TokenLogprob]]
    finished: bool
    finish_reason: Optional[str]
    num_cached_tokens: int
    metrics: RequestMetrics
    stop_reason: Optional[str | int] = None
    error: Optional[str] = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)


class OutputAccumulator:
    """Folds successive outputs of one request: deltas are appended (in amortized O(delta):
    text pieces are joined only when read), everything else comes from the latest output."""

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._tokens: list[int] = []
        self._logprobs: Optional[list[TokenLogprob]] = None
        self._latest: Optional[RequestOutput] = None

    @property
    def empty(self) -> bool:
        return self._latest is None

    @property
    def latest(self) -> Optional[RequestOutput]:
        return self._latest

    def add(self, out: RequestOutput) -> None:
        if out.delta_text:
            self._texts.append(out.delta_text)
        self._tokens.extend(out.delta_token_ids)
        if out.delta_logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(out.delta_logprobs)
        self._latest = out

    def _text(self) -> str:
        if len(self._texts) > 1:
            self._texts = ["".join(self._texts)]
        return self._texts[0] if self._texts else ""

    def merged(self) -> RequestOutput:
        """Everything added, as one output whose deltas span all of them."""
        return self._merged(list(self._tokens), None if self._logprobs is None else list(self._logprobs))

    def take(self) -> Optional[RequestOutput]:
        """`merged()` and start over (handing the lists over, uncopied); None when nothing was
        added since the last take."""
        if self._latest is None:
            return None
        out = self._merged(self._tokens, self._logprobs)
        self._texts, self._tokens, self._logprobs, self._latest = [], [], None, None
        return out

    def _merged(self, tokens: list[int], logprobs: Optional[list[TokenLogprob]]) -> RequestOutput:
        last = self._require()
        return RequestOutput(
            request_id=last.request_id, prompt_token_ids=last.prompt_token_ids, delta_text=self._text(),
            delta_token_ids=tokens, delta_logprobs=logprobs, num_output_tokens=last.num_output_tokens,
            finished=last.finished, finish_reason=last.finish_reason, num_cached_tokens=last.num_cached_tokens,
            metrics=last.metrics, stop_reason=last.stop_reason, error=last.error,
        )

    def completed(self) -> CompletedOutput:
        """The whole output, when every output of the request was added from its first."""
        last = self._require()
        return CompletedOutput(
            request_id=last.request_id, prompt_token_ids=last.prompt_token_ids, text=self._text(),
            token_ids=list(self._tokens), logprobs=None if self._logprobs is None else list(self._logprobs),
            finished=last.finished, finish_reason=last.finish_reason, num_cached_tokens=last.num_cached_tokens,
            metrics=last.metrics, stop_reason=last.stop_reason, error=last.error,
        )

    def _require(self) -> RequestOutput:
        if self._latest is None:
            raise ValueError("no output added yet")
        return self._latest
