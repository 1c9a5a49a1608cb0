"""From a workload name and a few knobs to the list of requests a run sends.

One pipeline for every source, so `sloserve bench` and the simulator agree on what "azure-conv at
4 req/s for 60 s" means: load the source -> choose arrivals (replay the trace's own times, its
pattern rescaled to a rate, or a synthetic process at a rate) -> cut to N requests or S seconds
-> assign classes and tenants -> clip lengths. Prompts are added afterwards by
`PromptSynthesizer`, only where a tokenizer is at hand (the simulator needs none).
"""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import sloserve.workload.servegen as servegen
import sloserve.workload.traces as traces
from sloserve.workload.arrivals import make_process
from sloserve.workload.mix import Mix, assign_mix
from sloserve.workload.transforms import (clip_lengths, cut, scale_to_rate, spread_ties, time_scale, time_window,
                                          with_structured_share,
                                          with_arrivals)
from sloserve.workload.types import WorkloadRequest

#: workload names besides a file path
NAMES = ("sharegpt", "azure-code", "azure-conv", "mooncake-conv", "mooncake-synthetic", "servegen", "synthetic")
ARRIVAL_PROCESSES = ("auto", "poisson", "gamma", "weibull", "trace")


@dataclass
class WorkloadSpec:
    """Everything that decides a run's request list (the CLI flags of `sloserve bench`).

    Exactly one arrival mode: `replay` (the trace's own times, `time_scale` times faster) or a
    `rate` (req/s, `inf` = all at once) produced by `arrival_process`: `poisson`, `gamma` or
    `weibull` (burstiness `cv`), or `trace` (the trace's own pattern, rescaled to the rate).
    `auto` is `trace` for ServeGen (rates are relative weights there) and `poisson` otherwise.
    """

    name: str
    seed: int = 0
    replay: bool = False
    rate: Optional[float] = None
    arrival_process: str = "auto"
    cv: float = 1.0
    time_scale: float = 1.0
    start_s: float = 0.0
    num_requests: Optional[int] = None
    duration_s: Optional[float] = None
    max_prompt_len: Optional[int] = None
    max_output_len: Optional[int] = None
    input_len: int = 256  # synthetic workload
    output_len: int = 64  # synthetic workload
    servegen_model: str = "m-large"
    spread_ties: Optional[bool] = None  # None: on for the quantized Mooncake conversation trace
    mix: Optional[Mix] = None
    structured_share: float = 0.0  # requests under a token mask (WorkloadRequest.structured)

    def validate(self) -> None:
        if self.name not in NAMES and not Path(self.name).is_file():
            raise ValueError(f"workload must be one of {NAMES} or an existing file, got {self.name!r}")
        if self.replay and self.rate is not None:
            raise ValueError("give either a rate or replay, not both")
        if self.arrival_process not in ARRIVAL_PROCESSES:
            raise ValueError(f"arrival process must be one of {ARRIVAL_PROCESSES}, got {self.arrival_process!r}")
        if not 0.0 <= self.structured_share <= 1.0:
            raise ValueError(f"structured share must be in [0, 1], got {self.structured_share}")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"rate must be > 0 (or inf), got {self.rate}")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"number of requests must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be > 0, got {self.duration_s}")
        if self.num_requests is None and self.duration_s is None:
            raise ValueError("bound the workload with a number of requests or a duration")
        burst = (self.rate is not None and math.isinf(self.rate)) or (
            self.rate is None and not self.replay and not self.has_trace_times)
        if burst and self.num_requests is None:
            raise ValueError("without a rate everything is sent at once: bound it with a number of requests")

    @property
    def has_trace_times(self) -> bool:
        if self.name in ("sharegpt", "synthetic"):
            return False
        if self.name in NAMES:
            return True
        return traces.sniff_format(self.name) != "sharegpt"

    @property
    def is_servegen(self) -> bool:
        return self.name == "servegen" or (self.name not in NAMES and traces.sniff_format(self.name) == "servegen")


def sharegpt_requests(seed: int, path: Optional[Path] = None) -> list[WorkloadRequest]:
    """ShareGPT first turns in a seeded random order (the file order means nothing)."""
    reqs = traces.load_sharegpt(path or traces.shared_path("sharegpt"))
    random.Random(f"{seed}:sharegpt").shuffle(reqs)
    return reqs


def synthetic_requests(input_len: int, output_len: int) -> Iterator[WorkloadRequest]:
    for i in itertools.count():
        yield WorkloadRequest(0.0, input_len, output_len, request_id=f"synthetic-{i}", source="synthetic")


def servegen_requests(spec: WorkloadSpec, path: Path) -> Iterator[WorkloadRequest]:
    """ServeGen arrivals (one tenant per client) carrying ShareGPT prompts and lengths, cycled."""
    replay_span = spec.duration_s * spec.time_scale if spec.replay and spec.duration_s else None
    end = spec.start_s + replay_span if replay_span else None
    windows = servegen.load_client_windows(path, spec.servegen_model, spec.start_s, end)
    scale = 1.0
    if spec.rate is not None and spec.arrival_process in ("auto", "trace"):
        # relative to the traffic of the windows the run covers (the first one for a count-bound run),
        # so --rate is the run's mean rate whatever the time of day
        horizon = spec.start_s + (spec.duration_s or servegen.WINDOW_S)
        covered = [w for w in windows if w.window_start_s < horizon] or windows
        scale = spec.rate / servegen.mean_total_rate(covered)
    prompts = sharegpt_requests(spec.seed)
    arrivals = servegen.servegen_arrivals(windows, spec.seed, spec.start_s, end, rate_scale=scale)
    for i, ((t, client), p) in enumerate(zip(arrivals, itertools.cycle(prompts))):
        yield WorkloadRequest(t, p.prompt_len, p.output_len, tenant=f"client-{client}", prompt_text=p.prompt_text,
                              request_id=f"servegen-{i}", source=f"servegen:{spec.servegen_model}")


def load_source(spec: WorkloadSpec) -> Iterable[WorkloadRequest]:
    """The raw request stream of a workload: trace times where it has them, else all at 0."""
    name = spec.name
    if name == "synthetic":
        return synthetic_requests(spec.input_len, spec.output_len)
    if name == "sharegpt":
        return sharegpt_requests(spec.seed)
    if spec.is_servegen:
        return servegen_requests(spec, traces.shared_path("servegen") if name == "servegen" else Path(name))
    if name in NAMES:
        path = traces.shared_path(name)
        reqs = traces.load_file(path, source=name)
    else:
        reqs = traces.load_file(name)
        if traces.sniff_format(name) == "sharegpt":
            random.Random(f"{spec.seed}:sharegpt").shuffle(reqs)
    spread = spec.spread_ties if spec.spread_ties is not None else name == "mooncake-conv"
    return spread_ties(reqs) if spread else reqs


def build_stream(spec: WorkloadSpec) -> list[WorkloadRequest]:
    """The requests of a run, with arrival times, classes, tenants and clipped lengths; no prompts."""
    spec.validate()
    stream = load_source(spec)
    if spec.replay or spec.rate is None:
        if not spec.has_trace_times:
            if spec.replay:
                raise ValueError(f"{spec.name} has no arrival times to replay; give a rate")
            stream = (r for r in stream)  # rate unset, no times: everything at 0 (a burst)
        elif not spec.is_servegen:
            span = spec.duration_s * spec.time_scale if spec.duration_s else None
            stream = time_window(stream, spec.start_s, span)
        if spec.time_scale != 1.0:
            stream = time_scale(stream, spec.time_scale)
    else:
        process = spec.arrival_process
        if process == "auto":
            process = "trace" if spec.is_servegen else "poisson"
        if process == "trace":
            if not spec.has_trace_times:
                raise ValueError(f"{spec.name} has no arrival pattern to rescale; use poisson, gamma or weibull")
            if not spec.is_servegen:  # ServeGen scaled its client rates already
                windowed = list(time_window(stream, spec.start_s))
                stream = scale_to_rate(windowed if spec.num_requests is None else windowed[:spec.num_requests],
                                       spec.rate)
        else:
            if spec.has_trace_times and not spec.is_servegen:
                stream = time_window(stream, spec.start_s)
            stream = with_arrivals(stream, make_process(process, spec.rate, spec.cv), f"{spec.seed}:arrivals")
    reqs = cut(stream, spec.num_requests, spec.duration_s)
    if spec.mix is not None:
        reqs = list(assign_mix(reqs, spec.mix, spec.seed))
    if spec.structured_share:
        reqs = list(with_structured_share(reqs, spec.structured_share, spec.seed))
    return list(clip_lengths(reqs, spec.max_prompt_len, spec.max_output_len))
