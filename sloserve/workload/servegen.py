"""ServeGen per-client arrival windows as a request-arrival generator.

ServeGen publishes, per anonymized client and 10-minute window, a mean rate, the CV of
inter-arrival times and a fitted Gamma or Weibull distribution. Replaying those windows gives
arrivals with the bursty, many-tenant shape of a production service (each client becomes a
tenant). The fitted shape parameter is kept and the scale is set from the published rate, so
each client's mean rate is exact and its burstiness is the fitted one. As in ServeGen's own
generator, client rates can be treated as relative weights and scaled to a target total rate.
"""
from __future__ import annotations

import csv
import heapq
import random
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional, Sequence

from sloserve.workload.arrivals import ArrivalProcess
from sloserve.workload.traces import PathLike, open_text

WINDOW_S = 600.0


@dataclass(frozen=True)
class ClientWindow:
    """One client's arrival pattern in one window (a row of the per-client file)."""

    model: str
    client_id: int
    window_start_s: float
    rate_rps: float
    cv: float
    dist: str  # "Gamma" (param1 = shape a) or "Weibull" (param1 = shape c); param2 = fitted scale
    param1: float
    param2: float

    def process(self, rate_scale: float = 1.0) -> ArrivalProcess:
        kind = "gamma" if self.dist.lower() == "gamma" else "weibull"
        return ArrivalProcess(kind, self.rate_rps * rate_scale, cv=1.0, shape=self.param1)  # type: ignore[arg-type]


def load_client_windows(path: PathLike, model: str, start_s: float = 0.0,
                        end_s: Optional[float] = None) -> list[ClientWindow]:
    """The windows of one model whose start lies in [start_s, end_s), sorted by start then client.

    A window that begins before `start_s` but overlaps it is included too, so a time range that
    does not fall on a window boundary still sees the traffic of its first window.
    """
    out = []
    with open_text(path) as f:
        for row in csv.DictReader(f):
            if row["model"] != model:
                continue
            ws = float(row["window_start_s"])
            if ws + WINDOW_S <= start_s or (end_s is not None and ws >= end_s):
                continue
            rate = float(row["rate_rps"])
            if rate <= 0:
                continue
            out.append(ClientWindow(model, int(row["client_id"]), ws, rate, float(row["cv"]), row["arrival_dist"],
                                    float(row["dist_param1"]), float(row["dist_param2"])))
    if not out:
        raise ValueError(f"no ServeGen windows for model {model!r} in [{start_s}, {end_s})")
    out.sort(key=lambda w: (w.window_start_s, w.client_id))
    return out


def mean_total_rate(windows: Sequence[ClientWindow]) -> float:
    """Average over windows of the summed client rates (what a target total rate is relative to)."""
    totals: dict[float, float] = {}
    for w in windows:
        totals[w.window_start_s] = totals.get(w.window_start_s, 0.0) + w.rate_rps
    return sum(totals.values()) / len(totals)


def servegen_arrivals(windows: Iterable[ClientWindow], seed: int = 0, start_s: float = 0.0,
                      end_s: Optional[float] = None, rate_scale: float = 1.0) -> Iterator[tuple[float, int]]:
    """(arrival time - start_s, client id), in time order, window after window, lazily.

    Every (client, window) draws from its own generator seeded by (seed, client, window), so a
    time range produces the same arrivals whichever larger range it is cut from.
    """
    by_window: dict[float, list[ClientWindow]] = {}
    for w in windows:
        by_window.setdefault(w.window_start_s, []).append(w)
    for ws in sorted(by_window):
        lo = max(ws, start_s)
        hi = ws + WINDOW_S if end_s is None else min(ws + WINDOW_S, end_s)
        if hi <= lo:
            continue
        heap: list[tuple[float, int]] = []
        for w in by_window[ws]:
            rng = random.Random(f"{seed}:{w.client_id}:{ws}")
            for t in w.process(rate_scale).arrival_times(rng, start_s=ws):
                if t >= hi:
                    break
                if t >= lo:
                    heap.append((t - start_s, w.client_id))
        heapq.heapify(heap)
        while heap:
            yield heapq.heappop(heap)
