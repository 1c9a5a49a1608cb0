"""Summary statistics of a run, computed only from `RequestRecord`s.

Definitions follow `vllm bench serve`, so numbers are comparable with what people already quote:
TTFT is the time to the first streamed token, TPOT = (E2E - TTFT) / (output tokens - 1) per
request, ITL pools every gap between streamed chunks of every request, E2E is send to last byte.
SLO attainment is the share of *all* requests (failures count as misses) that meet every target
of their class; goodput is the number of such requests per second of run time. Percentiles use
linear interpolation between order statistics (numpy's default), in pure Python so the
simulator can summarize a million records without extra dependencies.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from sloserve.core.records import ERROR_KINDS, RequestRecord, jsonable, percentile
from sloserve.core.types import SLO  # noqa: F401 (re-exported: the bench's SLO is the one SLO type)

PERCENTILES = (50.0, 90.0, 99.0)
METRICS = ("ttft", "tpot", "itl", "e2e", "normalized_e2e")


@dataclass(frozen=True)
class Stats:
    """Distribution of one latency metric in seconds (all NaN when there were no samples)."""

    count: int = 0
    mean: float = math.nan
    std: float = math.nan
    min: float = math.nan
    max: float = math.nan
    percentiles: dict = field(default_factory=dict)  # {"p50": s, ...}

    @classmethod
    def of(cls, values: Iterable[float], qs: Sequence[float] = PERCENTILES) -> "Stats":
        xs = sorted(values)
        if not xs:
            return cls(percentiles={_pname(q): math.nan for q in qs})
        n = len(xs)
        mean = math.fsum(xs) / n
        var = math.fsum((x - mean) ** 2 for x in xs) / n
        return cls(n, mean, math.sqrt(var), xs[0], xs[-1], {_pname(q): percentile(xs, q) for q in qs})

    def p(self, q: float) -> float:
        return self.percentiles.get(_pname(q), math.nan)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Stats":
        return cls(**{k: (_num(v) if k != "percentiles" else {pk: _num(pv) for pk, pv in v.items()})
                      for k, v in d.items()})


def _pname(q: float) -> str:
    return f"p{q:g}"


def _num(v: Any) -> Any:
    return math.nan if v is None else v


@dataclass(frozen=True)
class GroupSummary:
    """Metrics of a set of requests (a whole run, or one QoS class of it)."""

    num_requests: int
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    latency: dict  # metric name -> Stats
    slo: Optional[SLO] = None
    slo_met: Optional[int] = None
    slo_attainment: Optional[float] = None
    goodput: Optional[float] = None


@dataclass(frozen=True)
class Summary:
    """The run's summary: overall metrics, per-class metrics, error counts, the run's duration."""

    duration_s: float
    overall: GroupSummary
    per_class: dict  # class name -> GroupSummary
    errors: dict  # error kind -> count
    percentiles: tuple = PERCENTILES

    def to_dict(self) -> dict[str, Any]:
        return jsonable(asdict(self))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Summary":
        return cls(float(d["duration_s"]), _group_from_dict(d["overall"]),
                   {k: _group_from_dict(v) for k, v in d["per_class"].items()}, dict(d["errors"]),
                   tuple(d.get("percentiles", PERCENTILES)))


def _group_from_dict(d: Mapping[str, Any]) -> GroupSummary:
    kw = dict(d)
    kw["latency"] = {k: Stats.from_dict(v) for k, v in d["latency"].items()}
    kw["slo"] = SLO(**d["slo"]) if d.get("slo") else None
    return GroupSummary(**kw)


def metric_values(records: Iterable[RequestRecord], metric: str) -> list[float]:
    """The samples of one metric over successful requests (ITL: every gap of every request)."""
    ok = [r for r in records if r.success]
    if metric == "itl":
        return [g for r in ok for g in r.itl_s]
    getter: Callable[[RequestRecord], Optional[float]] = {
        "ttft": lambda r: r.ttft_s, "tpot": lambda r: r.tpot_s, "e2e": lambda r: r.e2e_s,
        "normalized_e2e": lambda r: r.normalized_e2e_s,
    }[metric]
    return [v for v in map(getter, ok) if v is not None]


def run_duration(records: Sequence[RequestRecord]) -> float:
    """From the run's start (time 0) to the last request's end, as the client saw it."""
    ends = [r.send_s + (r.e2e_s if r.e2e_s is not None else 0.0) for r in records]
    return max(ends, default=0.0)


def summarize_group(records: Sequence[RequestRecord], duration_s: float, slo: Optional[SLO],
                    qs: Sequence[float] = PERCENTILES) -> GroupSummary:
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    latency = {m: Stats.of(metric_values(ok, m), qs) for m in METRICS}
    met = attainment = goodput = None
    if slo is not None and not slo.empty:
        met = sum(1 for r in records if slo.met(r))
        attainment = met / len(records) if records else math.nan
        goodput = per_s(met)
    return GroupSummary(len(records), len(ok), len(records) - len(ok), in_tokens, out_tokens, per_s(len(ok)),
                        per_s(out_tokens), per_s(out_tokens + in_tokens), latency, slo, met, attainment, goodput)


def slo_checker(slo: Optional[SLO] = None, class_slos: Optional[Mapping[str, SLO]] = None
                ) -> Callable[[RequestRecord], bool]:
    """Whether a record met its SLO: its class's targets, falling back to `slo` per target."""
    base = slo or SLO()
    per_class = {name: s.over(base) for name, s in (class_slos or {}).items()}
    return lambda r: per_class.get(r.qos_class, base).met(r)


def summarize(records: Sequence[RequestRecord], duration_s: Optional[float] = None, slo: Optional[SLO] = None,
              class_slos: Optional[Mapping[str, SLO]] = None, qs: Sequence[float] = PERCENTILES) -> Summary:
    """Summarize a run. A request's SLO is its class's targets, falling back to `slo` per target.

    Overall attainment checks each request against its own class's SLO, so a mix of classes
    with different targets has one meaningful number.
    """
    duration = run_duration(records) if duration_s is None else duration_s
    base = slo or SLO()
    class_slos = dict(class_slos or {})

    def slo_of(cls: str) -> SLO:
        return class_slos.get(cls, SLO()).over(base)

    classes = sorted({r.qos_class for r in records})
    per_class = {c: summarize_group([r for r in records if r.qos_class == c], duration, slo_of(c), qs)
                 for c in classes}
    overall = summarize_group(records, duration, None, qs)
    if any(not slo_of(c).empty for c in classes):
        met_slo = slo_checker(base, class_slos)
        met = sum(1 for r in records if met_slo(r))
        overall = _with_slo(overall, met, len(records), duration, base)
    errors = {k: 0 for k in ERROR_KINDS}
    for r in records:
        if r.error_kind is not None:
            errors[r.error_kind if r.error_kind in errors else "other"] += 1
    return Summary(duration, overall, per_class, {k: v for k, v in errors.items() if v}, tuple(qs))


def _with_slo(g: GroupSummary, met: int, n: int, duration: float, slo: SLO) -> GroupSummary:
    return replace(g, slo=None if slo.empty else slo, slo_met=met, slo_attainment=met / n if n else math.nan,
                   goodput=met / duration if duration > 0 else math.nan)
