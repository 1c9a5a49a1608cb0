"""The fleet over time: what `/dashboard`, `sloserve top` and a run's `report.html` show.

One recorder, fed the same way by a live server (a sampler reads its engine or its workers'
polled state once per interval, on the wall clock) and by the simulator (on its virtual
clock): per instance and interval its role and state, running / waiting / preempted, KV blocks
per tier, prefix-hit rate and output tokens/s; per QoS class the interval's TTFT and TPOT
percentiles and SLO attainment; and the fleet's events (migrations, scaling, cold starts,
failures, drains). Pure Python and clock-free: every call carries its time.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional, Sequence

from sloserve.core.records import jsonable, percentile

# An instance's state as the dashboard shows it (live workers and simulated slots alike).
READY, STARTING, DRAINING, STOPPED, UNRESPONSIVE, DEAD = \
    "ready", "starting", "draining", "stopped", "unresponsive", "dead"
STATUSES = (READY, STARTING, DRAINING, STOPPED, UNRESPONSIVE, DEAD)

# What happened to the fleet, beside the sampled numbers.
MIGRATION, SCALE, START, INSTANCE_READY, STOP, DRAIN, UNDRAIN, FAILURE = \
    "migration", "scale", "start", "ready", "stop", "drain", "undrain", "failure"
EVENT_KINDS = (MIGRATION, SCALE, START, INSTANCE_READY, STOP, DRAIN, UNDRAIN, FAILURE)

QUANTILES = (50.0, 90.0, 99.0)
NICE_INTERVALS_S = (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)


def frame_interval(span_s: float, frames: int) -> float:
    """A round interval giving about `frames` frames (at most) over `span_s` seconds."""
    return float(next((step for step in NICE_INTERVALS_S if span_s / step <= frames), NICE_INTERVALS_S[-1]))


@dataclass(frozen=True)
class InstanceReading:
    """One instance as read now; the counters (`prefix_*`, `output_tokens`) are cumulative, and
    the recorder turns them into the interval's rates."""

    instance: int
    role: str = "mixed"
    status: str = READY
    running: int = 0
    waiting: int = 0
    preempted: int = 0  # of the waiting, those preempted (or swapped out) at least once
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    tier_blocks: Mapping[str, int] = field(default_factory=dict)  # host / disk tiers, swap: blocks held
    prefix_queries: int = 0
    prefix_hits: int = 0
    output_tokens: int = 0


# What an instance reports about itself (a worker to its front); the rest the front knows.
READING_FIELDS = ("running", "waiting", "preempted", "kv_blocks_used", "kv_blocks_total", "tier_blocks",
                  "prefix_queries", "prefix_hits", "output_tokens")


def read_instance(instance: int, scheduler: Any, kv: Any, role: str = "mixed", status: str = READY) -> InstanceReading:
    """A reading of an in-process instance (`sched.Scheduler` and its `kv.KVCacheManager`):
    the single server's engine or a simulated instance. Reads plain counters only, so the
    server may call it from outside the engine's thread."""
    waiting = list(scheduler.waiting)
    # The shared store is the fleet's, not the instance's: not counted here.
    tier_blocks = {tier.name: len(tier) for tier in kv.tiers.local()}
    if kv.host.num_blocks:  # swapped-out requests' blocks
        tier_blocks["swap"] = kv.host.num_blocks - kv.num_free_host_blocks
    return InstanceReading(
        instance, role, status, running=scheduler.num_running, waiting=len(waiting),
        preempted=sum(1 for r in waiting if r.num_preemptions), kv_blocks_used=kv.num_blocks - kv.num_free_blocks,
        kv_blocks_total=kv.num_blocks, tier_blocks=tier_blocks, prefix_queries=kv.stats.queries,
        prefix_hits=kv.stats.hits, output_tokens=scheduler.stats.num_output_tokens)


@dataclass(frozen=True)
class InstanceSample:
    instance: int
    role: str
    status: str
    running: int
    waiting: int
    preempted: int
    kv_blocks_used: int
    kv_blocks_total: int
    tier_blocks: Mapping[str, int]
    prefix_hit_rate: Optional[float]  # over the interval; None when no prompt was looked up
    tokens_per_s: float  # output tokens over the interval

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@dataclass(frozen=True)
class ClassSample:
    """One QoS class over one interval: the requests that finished in it."""

    qos_class: str
    finished: int
    attained: int
    ttft_s: tuple[Optional[float], ...]  # at QUANTILES; None without samples
    tpot_s: tuple[Optional[float], ...]

    @property
    def attainment(self) -> Optional[float]:
        return self.attained / self.finished if self.finished else None


@dataclass(frozen=True)
class Frame:
    t: float
    instances: tuple[InstanceSample, ...]
    classes: tuple[ClassSample, ...]


@dataclass(frozen=True)
class FleetEvent:
    t: float
    kind: str  # one of EVENT_KINDS
    instance: Optional[int] = None
    detail: str = ""
    seq: int = 0  # 1, 2, ... in recording order (a poller asks for the events after the last it saw)


def _quantiles(values: list[float]) -> tuple[Optional[float], ...]:
    if not values:
        return tuple(None for _ in QUANTILES)
    values.sort()
    return tuple(round(percentile(values, q), 6) for q in QUANTILES)


class FleetTimeline:
    """Frames at a fixed interval and the events between them; bounded (the oldest go first),
    so a server can keep one for as long as it runs. Safe to feed from several threads (a
    server's sampler thread and its event loop)."""

    def __init__(self, interval_s: float = 1.0, source: str = "live", max_frames: int = 3600,
                 max_events: int = 2000) -> None:
        if interval_s <= 0:
            raise ValueError(f"timeline interval must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.source = source  # "live" or "simulated": which clock the times are on
        self.frames: deque[Frame] = deque(maxlen=max_frames)
        self._frame_dicts: deque[dict] = deque(maxlen=max_frames)  # the same, JSON-ready (made once)
        self.events: deque[FleetEvent] = deque(maxlen=max_events)
        self.num_events = 0  # ever recorded (the deque may have let the oldest go)
        self.totals: dict[str, list[int]] = {}  # class -> [finished, attained], since the start
        self._pending: dict[str, tuple[list[float], list[float], list[int]]] = {}
        self._last: dict[int, tuple[float, InstanceReading]] = {}
        self.meta: dict[str, Any] = {}  # what the page titles: model, router, policies, fleet size
        self._lock = threading.Lock()

    def finished(self, qos_class: str, ttft_s: Optional[float], tpot_s: Optional[float], attained: bool) -> None:
        """A request of `qos_class` finished (aborted ones say nothing about the SLO: skip them)."""
        with self._lock:
            ttfts, tpots, counts = self._pending.setdefault(qos_class, ([], [], [0, 0]))
            if ttft_s is not None:
                ttfts.append(ttft_s)
            if tpot_s is not None:
                tpots.append(tpot_s)
            counts[0] += 1
            counts[1] += bool(attained)
            total = self.totals.setdefault(qos_class, [0, 0])
            total[0] += 1
            total[1] += bool(attained)

    def event(self, t: float, kind: str, instance: Optional[int] = None, detail: str = "") -> None:
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown fleet event {kind!r} (one of {EVENT_KINDS})")
        with self._lock:
            self.num_events += 1
            self.events.append(FleetEvent(t, kind, instance, detail, self.num_events))

    def sample(self, t: float, readings: Sequence[InstanceReading]) -> Frame:
        """Close the interval ending at `t`: rates from the counters' change since the last
        reading of each instance, class percentiles from the requests finished since."""
        with self._lock:
            return self._sample(t, readings)

    def _sample(self, t: float, readings: Sequence[InstanceReading]) -> Frame:
        instances = []
        for r in readings:
            before = self._last.get(r.instance)
            self._last[r.instance] = (t, r)
            hit_rate, tokens_per_s = None, 0.0
            if before is not None and t > before[0]:
                prev = before[1]
                queries = r.prefix_queries - prev.prefix_queries
                if queries > 0:
                    hit_rate = round((r.prefix_hits - prev.prefix_hits) / queries, 4)
                tokens_per_s = round(max(0, r.output_tokens - prev.output_tokens) / (t - before[0]), 3)
            instances.append(InstanceSample(r.instance, r.role, r.status, r.running, r.waiting, r.preempted,
                                            r.kv_blocks_used, r.kv_blocks_total, dict(r.tier_blocks), hit_rate,
                                            tokens_per_s))
        classes = tuple(ClassSample(name, counts[0], counts[1], _quantiles(ttfts), _quantiles(tpots))
                        for name, (ttfts, tpots, counts) in sorted(self._pending.items()))
        self._pending = {}
        frame = Frame(t, tuple(instances), classes)
        self.frames.append(frame)
        self._frame_dicts.append(_frame_json(frame))
        return frame

    def to_totals(self) -> dict[str, tuple[int, int]]:
        """class -> (finished, attained) since the start."""
        with self._lock:
            return {name: (v[0], v[1]) for name, v in sorted(self.totals.items())}

    def to_dict(self, since: Optional[float] = None, after_event: int = 0, last: Optional[int] = None) -> dict:
        """JSON-ready: the frames after time `since` (all when None; only the newest `last` of
        them when given), the events after number `after_event`, totals, and the frame layout
        (`quantiles`), so a poller asks only for what it has not seen."""
        with self._lock:
            frames, events = list(self._frame_dicts), list(self.events)
        totals = {name: {"finished": v[0], "attained": v[1]} for name, v in self.to_totals().items()}
        now = frames[-1]["t"] if frames else None
        frames = [f for f in frames if since is None or f["t"] > since]
        if last is not None:
            frames = frames[-last:] if last > 0 else []
        events = [e for e in events if e.seq > after_event]
        return {
            "source": self.source, "interval_s": self.interval_s, "quantiles": list(QUANTILES),
            "meta": self.meta, "now": now, "totals": totals,
            "num_events": self.num_events,
            "frames": frames,
            "events": [asdict(e) for e in events],
        }


def _frame_json(frame: Frame) -> dict:
    """A frame as JSON-ready dicts, made directly (dataclasses.asdict deep-copies: 6x slower, and a
    simulator samples thousands of frames). Rates are finite by construction; class latencies
    come from the requests, so they are cleaned."""
    return {"t": frame.t, "instances": [dict(vars(s)) for s in frame.instances],
            "classes": [jsonable(dict(vars(c))) for c in frame.classes]}
