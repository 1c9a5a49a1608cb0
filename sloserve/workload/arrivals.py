"""Synthetic arrival processes: Poisson, Gamma with a burstiness CV, Weibull.

Each process is a renewal process described by its mean rate and the coefficient of variation
(CV) of its inter-arrival times: CV = 1 is Poisson, CV > 1 is burstier, CV < 1 smoother. The
same description is what ServeGen publishes per client and window, so a trace-fitted pattern and
a hand-picked one are interchangeable. Randomness comes only from a seeded `random.Random`, so a
seed reproduces a schedule exactly (the client's rate-control test relies on this).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterator, Literal, Optional, Union

ProcessName = Literal["poisson", "gamma", "weibull"]


def weibull_shape_for_cv(cv: float) -> float:
    """The Weibull shape k whose inter-arrival CV is `cv`.

    CV^2 = Gamma(1 + 2/k) / Gamma(1 + 1/k)^2 - 1 decreases monotonically in k, so bisection on
    log k finds it; k = 1 is the exponential (CV = 1).
    """
    if not cv > 0 or not math.isfinite(cv):
        raise ValueError(f"cv must be a positive finite number, got {cv!r}")

    def cv_of(k: float) -> float:
        return math.sqrt(math.exp(math.lgamma(1 + 2 / k) - 2 * math.lgamma(1 + 1 / k)) - 1)

    lo, hi = math.log(0.05), math.log(200.0)
    if cv >= cv_of(math.exp(lo)) or cv <= cv_of(math.exp(hi)):
        raise ValueError(f"cv={cv} is outside the range a Weibull process can reach here")
    for _ in range(100):
        mid = (lo + hi) / 2
        if cv_of(math.exp(mid)) > cv:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


@dataclass(frozen=True)
class ArrivalProcess:
    """A renewal process: `rate` requests per second on average, inter-arrival CV `cv`.

    `rate = inf` sends everything at time 0 (a closed burst, as `vllm bench serve --request-rate inf`).
    For `weibull` an explicit `shape` (as fitted by ServeGen) overrides the one derived from `cv`.
    """

    kind: ProcessName = "poisson"
    rate: float = 1.0
    cv: float = 1.0
    shape: Optional[float] = None

    def __post_init__(self) -> None:
        if self.kind not in ("poisson", "gamma", "weibull"):
            raise ValueError(f"unknown arrival process {self.kind!r}; use poisson, gamma or weibull")
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0, got {self.rate!r}")
        if not (self.cv > 0 and math.isfinite(self.cv)):
            raise ValueError(f"cv must be a positive finite number, got {self.cv!r}")
        if self.shape is not None and not self.shape > 0:
            raise ValueError(f"shape must be > 0, got {self.shape!r}")

    @property
    def mean_interval_s(self) -> float:
        return 0.0 if math.isinf(self.rate) else 1.0 / self.rate

    def intervals(self, rng: random.Random) -> Iterator[float]:
        """Endless inter-arrival gaps in seconds, with mean 1/rate."""
        mean = self.mean_interval_s
        if mean == 0.0:
            while True:
                yield 0.0
        if self.kind == "poisson" or (self.kind == "gamma" and self.cv == 1.0 and self.shape is None):
            while True:
                yield rng.expovariate(self.rate)
        if self.kind == "gamma":
            a = self.shape if self.shape is not None else 1.0 / (self.cv * self.cv)
            scale = mean / a
            while True:
                yield rng.gammavariate(a, scale)
        k = self.shape if self.shape is not None else weibull_shape_for_cv(self.cv)
        scale = mean / math.gamma(1.0 + 1.0 / k)
        while True:
            yield rng.weibullvariate(scale, k)

    def arrival_times(self, seed: Union[int, str, random.Random], start_s: float = 0.0) -> Iterator[float]:
        """Endless, non-decreasing arrival times from `start_s` (the first one a gap after it).

        `seed` may be a string so callers can derive independent streams ("7:arrivals").
        """
        rng = seed if isinstance(seed, random.Random) else random.Random(seed)
        t = start_s
        for gap in self.intervals(rng):
            t += gap
            yield t


def make_process(kind: str, rate: float, cv: float = 1.0) -> ArrivalProcess:
    """`--arrival-process` + `--rate` + `--cv` as a process; `poisson` ignores the CV."""
    if kind == "poisson":
        return ArrivalProcess("poisson", rate)
    return ArrivalProcess(kind, rate, cv)  # type: ignore[arg-type]
