"""Capacity planning on the simulator: the goodput of a fleet layout, and the best
prefill/decode split for a workload and SLO (DistServe's placement search, on sloserve's own
schedulers and cost models).

Goodput is the highest request rate at which at least `attainment` (90%) of requests meet both
their TTFT and TPOT targets, with the workload's own arrival pattern stretched or squeezed to
that rate. The search brackets it from the burst throughput (every request at once: requests /
makespan), doubling or halving until one end meets the SLO and the other does not, then bisects
geometrically. Each rate is tried with the same sample, or (`sustained`) with as many requests
as a minimum duration of arrivals at that rate takes: the steady-state answer at high rates.

A fixed sample squeezed to a high rate is a burst, and a fleet absorbs a burst within a loose TTFT
however far past its capacity the rate is (100 requests at 177,000 req/s arrive in half a
millisecond). So every search that holds rates for a minimum duration (`sustained`, SUSTAIN_S by
default) also refuses to credit a rate its sample cannot hold that long: a rate that would need
more requests than the sample has counts as not met, and the answer is then a lower bound
(`Goodput.limited`), never a burst absorbed. Each answer says how long it was held (`Goodput.held_s`).
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from sloserve.bench.metrics import SLO
from sloserve.simulation import FleetConfig, PoolSettings, build_fleet, fleet_gpus, sim_requests, simulate
from sloserve.sim.fluid import ResponseCurve
from sloserve.user_cache import JsonCache, source_fingerprint, user_cache_path
from sloserve.workload.types import WorkloadRequest

logger = logging.getLogger(__name__)

ATTAINMENT = 0.9
MAX_BRACKET_STEPS = 12  # 2^12 either way of the burst throughput: far past any real fleet's range


def stretchable(reqs: Sequence[WorkloadRequest]) -> Sequence[WorkloadRequest]:
    """`reqs`, checked to have an arrival pattern to stretch: requests all sent at once stay a
    burst at every rate (`at_rate` cannot spread them), so a search over rates would measure the
    same burst at each."""
    if len(reqs) > 1 and reqs[-1].arrival_s <= reqs[0].arrival_s:
        raise ValueError(f"the {len(reqs)} requests arrive all at once: a rate search needs arrival times to "
                         "stretch (give the workload a rate, or --replay a trace)")
    return reqs


def at_rate(reqs: Sequence[WorkloadRequest], rate: float) -> list[WorkloadRequest]:
    """The same requests, their arrival pattern stretched or squeezed to a mean of `rate` req/s."""
    span = reqs[-1].arrival_s or 1.0
    native = (len(reqs) - 1) / span if len(reqs) > 1 else rate
    f = native / rate
    return [replace(r, arrival_s=r.arrival_s * f) for r in reqs]


SUSTAIN_S = 60.0
"""Seconds of arrivals each rate of a search is held for by default (the capacity model and `sloserve
plan`). A rate a share e over capacity queues about e x t seconds of work after t seconds, so requests
arriving after TTFT / e miss, and over W seconds the misses pass the 10% the attainment allows once
e > TTFT / (0.9 W): with W = 60 s, from 1.9% over capacity at a 1 s TTFT (9% at 5 s). Longer
windows resolve finer but cost rate x W requests per simulated probe: 60 s is ~1,800 requests at
30 req/s, a minute or two for an 8-GPU plan."""


@dataclass(frozen=True)
class Sustained:
    """Requests for probing a rate with sustained load (see `sustained`)."""

    source: Callable[[int], Sequence[WorkloadRequest]]
    base: int
    min_duration_s: float
    max_requests: int

    def size(self, rate: float) -> int:
        """Requests asked for at `rate`: the base sample, or `min_duration_s` of arrivals, capped."""
        return min(self.max_requests, max(self.base, math.ceil(rate * self.min_duration_s)))

    def holds(self, count: int, rate: float) -> bool:
        """Whether `count` requests at `rate` last `min_duration_s`."""
        return count >= rate * self.min_duration_s * (1 - 1e-9)

    def __call__(self, rate: float) -> list[WorkloadRequest]:
        return at_rate(self.source(self.size(rate)), rate)


def sustained(source: Callable[[int], Sequence[WorkloadRequest]], base: int, min_duration_s: float,
              max_requests: int) -> Sustained:
    """Requests for probing a rate with sustained load: at `rate`, the first max(`base`, rate x
    `min_duration_s`) requests of the workload (`source(n)` gives its first n; at most
    `max_requests`), squeezed or stretched to that rate.

    A fixed sample squeezed to a high rate arrives in a few seconds, and a fleet absorbs one such
    burst within a loose TTFT target however far past its capacity the rate is: the search then
    measures a transient (2,000 ShareGPT requests at 800 req/s arrive in 2.5 s). With a minimum
    duration, a rate past capacity builds a queue that grows for the whole window, so the misses
    it causes outnumber the 10% the attainment allows once the window is long against the TTFT
    target (SUSTAIN_S). A rate whose probe cannot last `min_duration_s` (the cap, or the end of
    the workload) is not credited by the searches (`search_rate`)."""
    return Sustained(source, base, min_duration_s, max_requests)


@dataclass(frozen=True)
class Goodput:
    """What a rate search found: the rate, the requests it was tried with and how many seconds of
    arrivals they lasted at it, and, when the sample bounded the search, the lowest rate the search
    wanted to try but could not hold for the probe's minimum duration (with the requests the sample
    gave there): the rate is then a lower bound."""

    rps: float
    requests: int = 0
    refused_rps: Optional[float] = None
    refused_requests: Optional[int] = None

    @property
    def held_s(self) -> float:
        """Seconds of arrivals at `rps` (requests / rate; inf when nothing was met)."""
        return self.requests / self.rps if self.rps > 0 else math.inf

    @property
    def limited(self) -> bool:
        return self.refused_rps is not None

    def as_dict(self) -> dict:
        return {"rps": self.rps, "requests": self.requests,
                "held_s": self.held_s if self.rps > 0 else None, "refused_rps": self.refused_rps,
                "refused_requests": self.refused_requests}

    @classmethod
    def from_dict(cls, d: dict) -> "Goodput":
        return cls(float(d["rps"]), int(d["requests"]), d.get("refused_rps"), d.get("refused_requests"))


def search_rate(check: Callable[[list[WorkloadRequest], float], bool],
                requests_at: Callable[[float], list[WorkloadRequest]], start: float, iters: int) -> Goodput:
    """The highest rate at which `check(requests_at(rate), rate)` holds (`max_rate`). With a
    `Sustained` probe, a rate whose requests cannot last its minimum duration counts as not met
    without a run: the search never credits a burst, and says when that bounded it (a rate the
    sample could not hold, below every rate that failed on its merits)."""
    sustain = requests_at if isinstance(requests_at, Sustained) else None
    counts: dict[float, int] = {}
    refused: list = [math.inf, None]
    failed = [math.inf]

    def meets(rate: float) -> bool:
        tried: list[WorkloadRequest] = []
        count = sustain.size(rate) if sustain is not None else 0
        if sustain is None or sustain.holds(count, rate):  # built only when the cap leaves it a chance to hold
            tried = requests_at(rate)
            count = len(tried)
        counts[rate] = count
        if sustain is not None and not sustain.holds(count, rate):
            if rate < refused[0]:
                refused[:] = [rate, count]
            return False
        if check(tried, rate):
            return True
        failed[0] = min(failed[0], rate)
        return False

    found = max_rate(meets, start, iters)
    limited = refused[0] < failed[0]
    return Goodput(found, counts.get(found, 0) if found > 0 else 0, refused[0] if limited else None,
                   refused[1] if limited else None)


def max_rate(meets: Callable[[float], bool], start: float, iters: int) -> float:
    """The highest rate (within the bisection's resolution) at which `meets(rate)` holds, assuming
    it holds below some rate and fails above it; 0 if it fails even at start / 2^12."""
    if meets(start):
        lo, hi = start, 2 * start
        for _ in range(MAX_BRACKET_STEPS):
            if not meets(hi):
                break
            lo, hi = hi, 2 * hi
        else:
            return lo
    else:
        lo, hi = start / 2, start
        for _ in range(MAX_BRACKET_STEPS):
            if meets(lo):
                break
            lo, hi = lo / 2, lo
        else:
            return 0.0
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def attainment(reqs: Sequence[WorkloadRequest], cfg: FleetConfig, slo: SLO) -> tuple[float, float]:
    """(share of requests meeting the SLO, simulated makespan) of one run."""
    records, result = simulate(build_fleet(cfg), sim_requests(reqs))
    return sum(slo.met(r) for r in records) / max(1, len(reqs)), result.end_time


def search_goodput(reqs: Sequence[WorkloadRequest], cfg: "FleetConfig | Callable[[float], FleetConfig]", slo: SLO,
                   iters: int = 3, target: float = ATTAINMENT,
                   requests_at: Optional[Callable[[float], list[WorkloadRequest]]] = None) -> Goodput:
    """Requests/s the fleet serves with >= `target` of them within `slo` (module docstring), with
    how long that rate was held. `cfg` may be a function of the rate tried (a fleet sized to it);
    `requests_at` the requests each rate is tried with (`sustained`: rates it cannot hold are not
    credited), by default `reqs` at that rate."""
    stretchable(reqs)  # the sample the search starts from, and its pattern (`sustained` draws more like it)
    fleet_at = cfg if callable(cfg) else (lambda rate: cfg)
    probe = requests_at or (lambda rate: at_rate(reqs, rate))
    return search_rate(lambda tried, rate: attainment(tried, fleet_at(rate), slo)[0] >= target, probe,
                       burst_rate(reqs, fleet_at(0.0), slo), iters)


def goodput(reqs: Sequence[WorkloadRequest], cfg: "FleetConfig | Callable[[float], FleetConfig]", slo: SLO,
            iters: int = 3, target: float = ATTAINMENT,
            requests_at: Optional[Callable[[float], list[WorkloadRequest]]] = None) -> float:
    """The rate `search_goodput` finds."""
    return search_goodput(reqs, cfg, slo, iters, target, requests_at).rps


def burst_rate(reqs: Sequence[WorkloadRequest], cfg: FleetConfig, slo: SLO) -> float:
    """Requests / makespan with every request at once: where the search starts."""
    _, makespan = attainment([replace(r, arrival_s=0.0) for r in reqs], cfg, slo)
    return len(reqs) / makespan if makespan > 0 else 1.0


def capacity_cache() -> JsonCache:
    """Measured capacities kept across runs, in the user's cache (sloserve/user_cache.py)."""
    return JsonCache(user_cache_path("capacity.json"))


def simulator_fingerprint() -> str:
    """What a capacity was measured with: the code that prices a simulated run (sim/, sched/,
    kv/, cluster policies and the fleet assembly). Any change to it measures again."""
    root = Path(__file__).resolve().parent
    files = [p for d in ("sim", "sched", "kv", "cluster") for p in (root / d).rglob("*.py")]
    return source_fingerprint(files + [root / "simulation.py", root / "planning.py", root / "core" / "types.py",
                                       root / "core" / "config.py"])


CAPACITY_SUSTAIN_S = SUSTAIN_S  # arrivals each rate of the capacity search is held for (see `sustained`)
CAPACITY_MOST_REQUESTS = 50_000  # with `more`: the most requests a capacity probe draws (833 req/s held 60 s)


def instance_capacity(reqs: Sequence[WorkloadRequest], cfg: FleetConfig, slo: SLO, iters: int = 3,
                      sample: int = 400, cache: Optional[JsonCache] = None,
                      min_duration_s: float = CAPACITY_SUSTAIN_S,
                      more: Optional[Callable[[int], Sequence[WorkloadRequest]]] = None,
                      most: int = CAPACITY_MOST_REQUESTS) -> float:
    """The capacity model of autoscaling: requests/s ONE instance of `cfg` serves with >= 90% of
    them within `slo`, by the goodput search. Each rate is tried with at least `sample` requests
    of the workload and with as many of `reqs` as `min_duration_s` of arrivals at that rate take
    (`sustained`), so the answer is what an instance keeps up with, not a burst it absorbs
    (a 400-request sample at 30 req/s is 13 s of arrivals, which a 1 s TTFT forgives ~10% past
    capacity). A rate that would need more requests than `reqs` has is not credited: give `reqs`
    long enough (rate x duration), or `more(n)` (the workload's first n requests, at most `most`)
    to draw from past them; when the sample bounds the search, the answer is a lower bound and a
    warning says so (again whenever it is read back from the cache).
    Kept in `cache` (default: on disk, `capacity_cache()`) per hardware, model, tp, profile
    (its contents), scheduler and cache settings, SLO, workload shape and simulator code: the
    search runs dozens of simulations, and the same question comes back every run."""
    head = _sample(reqs, len(reqs))
    cache = capacity_cache() if cache is None else cache
    probe = _probe(head, sample, min_duration_s, more, most)
    key = _capacity_key(head, cfg, slo, iters, "mixed", sample, min_duration_s, probe.max_requests)
    known = cache.get(key)
    if isinstance(known, dict) and "rps" in known:
        found = Goodput.from_dict(known)
    else:
        found = search_goodput(head[:sample], cfg.fixed(instances=1, pd=None, migration="none"),
                               slo, iters, requests_at=probe)
        cache.put(key, found.as_dict())
    _warn_if_limited(found, found.rps, min_duration_s, "an instance")
    return found.rps


POOL_HEADROOM = 4  # the other pool's instances, at least, while one pool's instance is measured
POOL_MOST = 16  # ... and at most: a pool this size is what the measured instance can be shown to outrun


def pool_capacity(reqs: Sequence[WorkloadRequest], cfg: FleetConfig, slo: SLO, iters: int = 3, sample: int = 400,
                  cache: Optional[JsonCache] = None,
                  min_duration_s: float = CAPACITY_SUSTAIN_S,
                  more: Optional[Callable[[int], Sequence[WorkloadRequest]]] = None,
                  most: int = CAPACITY_MOST_REQUESTS) -> tuple[float, float]:
    """The capacity model of an autoscaled P/D fleet: requests/s ONE prefill instance serves
    within the SLO's TTFT, and ONE decode instance within its TPOT, with `cfg`'s pool settings
    (cached as instance_capacity).

    Each is measured with the other pool sized to the rate tried (twice what it needs, at
    least POOL_HEADROOM instances), so that only the measured instance limits: a fixed small
    prefill pool would cap the rate a decode instance ever sees, and a saturated decode pool
    would keep requests decoding on the prefill instance. Pool sizes come from the other pool's
    capacity, so prefill is measured first against a POOL_HEADROOM decode pool, then decode
    against prefill pools sized from that, then prefill again against decode pools sized from
    the decode answer. A decode instance is held to having room for (nearly) every hand-off too:
    one that has none leaves the request decoding on its prefill instance, which is the fleet's
    fallback, not decode capacity. Rates are held for `min_duration_s` as in instance_capacity
    (`more`, `most` and the lower bound too)."""
    head = _sample(reqs, len(reqs))
    cache = capacity_cache() if cache is None else cache
    probe = _probe(head, sample, min_duration_s, more, most)
    key = _capacity_key(head, cfg, slo, iters, "prefill/decode", sample, min_duration_s, probe.max_requests)
    known = cache.get(key)
    if isinstance(known, dict) and "capacity" in known:
        (prefill, decode), searches = known["capacity"], [Goodput.from_dict(d) for d in known["searches"]]
    else:
        prefill, decode, searches = _measure_pools(head[:sample], cfg, slo, iters, probe)
        cache.put(key, {"capacity": [prefill, decode], "searches": [g.as_dict() for g in searches]})
    _warn_if_limited(searches[0], prefill, min_duration_s, "a prefill instance")
    _warn_if_limited(searches[1], decode, min_duration_s, "a decode instance")
    return float(prefill), float(decode)


def _measure_pools(first: list[WorkloadRequest], cfg: FleetConfig, slo: SLO, iters: int,
                   probe: Sustained) -> tuple[float, float, list[Goodput]]:
    """pool_capacity's searches: (prefill, decode, [the prefill search, the decode search])."""
    base = cfg.fixed(migration="none")
    ttft_only, tpot_only = replace(slo, tpot_s=None), replace(slo, ttft_s=None, e2e_s=None)

    def sized(rate: float, capacity: float) -> int:
        return min(POOL_MOST, max(POOL_HEADROOM, math.ceil(2 * rate / capacity))) if capacity > 0 else POOL_HEADROOM

    def bounded(found: float, other: float, role: str) -> float:
        """What the search can vouch for: an instance that outran POOL_MOST of the other pool's
        is known to carry at least half their rate, not how much more (short outputs make a decode
        instance outlast many prefill instances)."""
        most = POOL_MOST * other / 2
        if found > most:
            logger.info("one %s instance keeps up with %d of the other pool's: capacity taken as %.2f req/s "
                        "(a lower bound)", role, POOL_MOST, most)
            return most
        return found

    def decode_keeps_up(tried: list[WorkloadRequest], rate: float) -> bool:
        """TPOT met, and the decode instance had room for the hand-offs: a request it cannot
        take keeps decoding on its prefill instance, which must not count as decode capacity."""
        records, result = simulate(build_fleet(base.with_fleet(pd=(sized(rate, prefill), 1))), sim_requests(tried))
        met = sum(tpot_only.met(r) for r in records) / len(tried)
        decoding = sum(r.output_len > 1 for r in tried)  # a one-token request has nothing to hand off
        return met >= ATTAINMENT and result.handoffs.get("completed", 0) >= ATTAINMENT * decoding

    prefill = search_goodput(first, base.with_fleet(pd=(1, POOL_HEADROOM)), ttft_only, iters, requests_at=probe).rps
    start = burst_rate(first, base.with_fleet(pd=(POOL_HEADROOM, 1)), tpot_only)
    decode_search = search_rate(decode_keeps_up, probe, start, iters)
    decode = bounded(decode_search.rps, prefill, "decode")
    prefill_search = search_goodput(first, lambda rate: base.with_fleet(pd=(1, sized(rate, decode))), ttft_only,
                                    iters, requests_at=probe)
    prefill = bounded(prefill_search.rps, decode, "prefill")
    return prefill, decode, [prefill_search, decode_search]


CURVE_LOADS = (0.25, 0.5, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5)  # of the capacity model's rate
CURVE_INSTANCES = 4  # the calibration fleet: routing between instances is part of what the curve measures
CURVE_DURATION_S = 120.0  # arrivals per load (as `sustained`): long against a TTFT target


def response_curve(reqs: Sequence[WorkloadRequest], cfg: FleetConfig, slo: SLO, capacity: float,
                   loads: Sequence[float] = CURVE_LOADS, instances: int = CURVE_INSTANCES,
                   duration_s: float = CURVE_DURATION_S, cache: Optional[JsonCache] = None) -> ResponseCurve:
    """What the fluid fleet (sim/fluid.py) prices requests with: SLO attainment of `instances`
    instances of `cfg` at each load (a multiple of `capacity` per instance), each held for
    `duration_s` of the workload's arrivals squeezed to that rate, and the rate an instance
    completes requests at when it is busy (the most over the loads, counted after a quarter of
    the arrivals), and how many requests wait in an instance's queue at each load. Give `reqs` with
    Poisson arrivals shaped like the run's, long enough for the highest load (warned otherwise).
    Cached like the capacity model."""
    head = _sample(reqs, len(reqs))
    cache = capacity_cache() if cache is None else cache
    key = _capacity_key(head, cfg, slo, 0, "curve", len(head), duration_s) + json.dumps(
        [round(capacity, 6), list(loads), instances])
    known = cache.get(key)
    if isinstance(known, dict) and "waiting" in known:
        return ResponseCurve(tuple(known["loads"]), tuple(known["attainment"]), known["saturation_rps"], capacity,
                             tuple(known["waiting"]))
    fleet = cfg.fixed(instances=instances, pd=None, migration="none")
    probe = sustained(lambda n: head[:n], min(len(head), 50), duration_s, len(head))
    attained, mean_ttft, saturation = [], [], 0.0
    for load in loads:
        rate = load * capacity * instances
        tried = probe(rate)
        if len(tried) < rate * duration_s * 0.99:
            logger.warning("response curve at load %.2f: %.0f s at %.1f req/s needs %d requests, the workload gave %d",
                           load, duration_s, rate, math.ceil(rate * duration_s), len(tried))
        records, _ = simulate(build_fleet(fleet), sim_requests(tried))
        attained.append(sum(slo.met(r) for r in records) / max(1, len(tried)))
        ttfts = [r.ttft_s for r in records if r.ttft_s is not None]
        mean_ttft.append(sum(ttfts) / len(ttfts) if ttfts else 0.0)
        # completions per second once the fleet is busy (the last quarter of the arrivals, not the makespan,
        # whose tail is one request's decode): past capacity, what an instance completes
        span = tried[-1].arrival_s
        done = sum(1 for r in records if r.e2e_s is not None and span / 4 <= r.send_s + r.e2e_s <= span)
        if span > 0:
            saturation = max(saturation, done / (0.75 * span) / instances)
    # requests waiting in an instance's queue (what an autoscaler reads as `queued`), by Little's law on the
    # time to first token each load adds over the lightest one
    waiting = tuple(load * capacity * max(0.0, t - mean_ttft[0]) for load, t in zip(loads, mean_ttft))
    curve = ResponseCurve(tuple(loads), tuple(attained), saturation, capacity, waiting)
    cache.put(key, {"loads": list(curve.loads), "attainment": list(curve.attainment), "saturation_rps": saturation,
                    "waiting": list(waiting)})
    return curve


def _sample(reqs: Sequence[WorkloadRequest], sample: int) -> list[WorkloadRequest]:
    head = list(reqs[:sample])
    if len(head) < 10:
        raise ValueError(f"the capacity model needs at least 10 requests of the workload, got {len(head)}")
    return list(stretchable(head))


def _probe(head: Sequence[WorkloadRequest], sample: int, min_duration_s: float,
           more: Optional[Callable[[int], Sequence[WorkloadRequest]]] = None, most: int = 0) -> Sustained:
    """The capacity search's requests at a rate: at least `sample`, and `min_duration_s` of them,
    from `head` and past it from `more` (up to `most`)."""
    if more is None:
        return sustained(lambda n: head[:n], min(sample, len(head)), min_duration_s, len(head))
    return sustained(lambda n: head[:n] if n <= len(head) else more(n), min(sample, len(head)), min_duration_s,
                     max(most, len(head)))


def _warn_if_limited(found: Goodput, capacity: float, min_duration_s: float, what: str) -> None:
    """Say that a capacity is a lower bound when the sample stopped the search (`search_rate`)."""
    if found.limited:
        logger.warning("capacity of %s: %.2f req/s is a lower bound: holding %.0f s of arrivals at %.2f req/s needs "
                       "%d requests, the sample gave %d (give a longer workload)", what, capacity, min_duration_s,
                       found.refused_rps, math.ceil(found.refused_rps * min_duration_s),  # type: ignore[operator]
                       found.refused_requests)


def _capacity_key(head: Sequence[WorkloadRequest], cfg: FleetConfig, slo: SLO, iters: int, what: str,
                  sample: int, min_duration_s: float, most: Optional[int] = None) -> str:
    shape = (round(sum(r.prompt_len for r in head) / len(head), -1), round(sum(r.output_len for r in head) / len(head), -1))
    profile = source_fingerprint([Path(cfg.profile)]) if cfg.profile else None
    spec = cfg.fleet
    pools = [asdict(spec.prefill_pool), asdict(spec.decode_pool), cfg.link, spec.pd_transfer, spec.decode_router] \
        if what != "mixed" else []
    return json.dumps([cfg.hardware, cfg.model, cfg.tp, profile, asdict(cfg.scheduler), asdict(cfg.cache),
                       cfg.num_blocks, cfg.max_model_len, cfg.dtype_bytes, spec.resolved_predictor, cfg.kv_store_gib,
                       cfg.kv_store_link, slo.ttft_s, slo.tpot_s, slo.e2e_s, shape, len(head), min(sample, len(head)),
                       min_duration_s, iters, simulator_fingerprint(), what, most or len(head), *pools], sort_keys=True,
                      default=str)


@dataclass(frozen=True)
class Layout:
    """One candidate: colocated (`pd` None) or a P:D split with per-pool settings."""

    pd: Optional[str] = None
    prefill_pool: PoolSettings = PoolSettings()
    decode_pool: PoolSettings = PoolSettings()

    @property
    def label(self) -> str:
        if self.pd is None:
            return "colocated"
        pools = [f"{name}[{','.join(f'{k}={v}' for k, v in vars(pool).items() if v is not None)}]"
                 for name, pool in (("P", self.prefill_pool), ("D", self.decode_pool)) if pool != PoolSettings()]
        return " ".join([self.pd, *pools])

    def apply(self, cfg: FleetConfig, gpus: int) -> FleetConfig:
        if self.pd is None:
            return cfg.with_fleet(instances=gpus // cfg.tp, pd=None)
        return cfg.with_fleet(pd=self.pd, prefill_pool=self.prefill_pool, decode_pool=self.decode_pool)


@dataclass(frozen=True)
class PlanRow:
    layout: Layout
    gpus: int
    found: Goodput  # the search's answer: the rate, how long it was held, whether the sample bounded it

    @property
    def goodput(self) -> float:  # req/s
        return self.found.rps

    @property
    def per_gpu(self) -> float:
        return self.goodput / self.gpus


def layouts(gpus: int, prefill_pools: Sequence[PoolSettings] = (PoolSettings(),),
            decode_pools: Sequence[PoolSettings] = (PoolSettings(),)) -> list[Layout]:
    """Colocated, and every P:D split of `gpus` single-device instances with each pool setting."""
    out = [Layout()]
    for p in range(1, gpus):
        out.extend(Layout(f"{p}:{gpus - p}", pp, dp) for pp in prefill_pools for dp in decode_pools)
    return out


def plan(reqs: Sequence[WorkloadRequest], cfg: FleetConfig, slo: SLO, gpus: int, candidates: Sequence[Layout],
         iters: int = 3, on_done: Optional[Callable[[PlanRow], None]] = None,
         requests_at: Optional[Callable[[float], list[WorkloadRequest]]] = None) -> list[PlanRow]:
    """Goodput of every candidate layout on `gpus` devices, best per GPU first. Candidates whose
    pools' tensor-parallel degrees do not add up to `gpus` are priced at the devices they use.
    `requests_at`: the requests each rate is tried with (`sustained`, whose rates a row's search
    credits only when they last its minimum duration; by default `reqs` squeezed to each rate, which
    holds rates only as long as `reqs` lasts at them: see `PlanRow.found`)."""
    rows = []
    for layout in candidates:
        fleet = layout.apply(cfg, gpus)
        fleet.validate()
        row = PlanRow(layout, fleet_gpus(fleet), search_goodput(reqs, fleet, slo, iters, requests_at=requests_at))
        rows.append(row)
        if on_done is not None:
            on_done(row)
    return sorted(rows, key=lambda r: -r.per_gpu)
