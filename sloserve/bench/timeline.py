"""A bench run's fleet timeline, for its report.html.

Against a sloserve server (one instance or a front) the server's own `/dashboard/data` is
fetched after the run and cut to the run's window: the instances, their KV and the fleet's
events as the server recorded them. Any other server (vLLM, llama.cpp) has none, so the
timeline is rebuilt from the client's records: per QoS class and interval, TTFT/TPOT
percentiles and SLO attainment, no instance rows.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional, Sequence

import httpx

from sloserve.dashboard import DATA_ROUTE
from sloserve.core.records import RequestRecord
from sloserve.timeline import FleetTimeline, frame_interval

log = logging.getLogger(__name__)

CLIENT_FRAMES = 300  # about this many frames when the client rebuilds the timeline


def server_timeline(base_url: str, headers: dict, start: float, end: float, records: Sequence[RequestRecord],
                    met: Callable[[RequestRecord], bool]) -> Optional[dict]:
    """The server's timeline between wall-clock `start` and `end` (None when it has none); waits
    for the frame that closes the interval holding `end`, so the run's last requests are in it."""
    root = base_url[:-3] if base_url.endswith("/v1") else base_url
    deadline = time.time() + 10.0
    while True:
        data = _fetch(root + DATA_ROUTE, headers, start)
        if data is None or (data.get("now") or 0) >= end or time.time() > deadline:
            break
        time.sleep(min(0.5, float(data.get("interval_s", 1.0)) / 2))
    if data is None:
        return None
    try:
        slack = float(data.get("interval_s", 1.0))
        data["frames"] = [f for f in data["frames"] if f["t"] <= end + slack]
        data["events"] = [e for e in data["events"] if start <= e["t"] <= end + slack]
    except (ValueError, KeyError, TypeError, AttributeError):  # answers 200, but not sloserve's timeline
        log.info("%s did not answer with a timeline: rebuilt from the client's records", DATA_ROUTE)
        return None
    # Totals: this run's requests as the client judged them (as report.md does); the frames'
    # per-interval counts are the server's, and its first frame may hold the warm-up request.
    data["totals"] = client_totals(records, met)
    return data if data["frames"] else None


def client_totals(records: Sequence[RequestRecord], met: Callable[[RequestRecord], bool]) -> dict:
    totals: dict[str, dict] = {}
    for r in records:
        if r.success:
            t = totals.setdefault(r.qos_class, {"finished": 0, "attained": 0})
            t["finished"] += 1
            t["attained"] += bool(met(r))
    return dict(sorted(totals.items()))


def _fetch(url: str, headers: dict, since: float) -> Optional[dict]:
    try:
        resp = httpx.get(url, headers=headers, params={"since": since}, timeout=10.0)
    except httpx.HTTPError as e:
        log.info("no server timeline (%s): the report's is rebuilt from the client's records", e)
        return None
    if resp.status_code != 200:
        log.info("no server timeline (HTTP %d at %s): rebuilt from the client's records", resp.status_code,
                 DATA_ROUTE)
        return None
    try:
        data = resp.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        log.info("%s did not answer with a timeline: rebuilt from the client's records", DATA_ROUTE)
        return None
    return data


def client_timeline(records: Sequence[RequestRecord], duration_s: float,
                    met: Callable[[RequestRecord], bool]) -> dict:
    """Per class and interval, from what the client measured (times from the run's start)."""
    interval = frame_interval(duration_s, CLIENT_FRAMES)
    tl = FleetTimeline(interval, source="client", max_frames=10 * CLIENT_FRAMES)
    done = sorted((r for r in records if r.success and r.e2e_s is not None), key=lambda r: r.send_s + r.e2e_s)
    k, t = 0, interval
    while k < len(done) or t <= duration_s:
        while k < len(done) and done[k].send_s + done[k].e2e_s <= t:  # type: ignore[operator]
            r = done[k]
            tl.finished(r.qos_class, r.ttft_s, r.tpot_s, met(r))
            k += 1
        tl.sample(t, [])
        t += interval
    return tl.to_dict()
