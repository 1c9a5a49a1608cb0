"""`/dashboard` and `/dashboard/data`: the fleet timeline of a running server.

A sampler thread reads the instances once per interval (the single server its engine, the
multi-instance front its workers' last polled state) into a `FleetTimeline`; the page polls
the data route for the frames and events it has not seen. The page itself holds no data, so
it is public; the data route needs an admin key when there are some, else an API key when there
are some (the edge middlewares' ADMIN_ROUTES and KEYED_ROUTES).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from typing import Callable, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from sloserve.dashboard import DATA_ROUTE, live_page
from sloserve.server.errors import bad_request
from sloserve.timeline import FleetTimeline, InstanceReading

logger = logging.getLogger(__name__)

PAGE_ROUTE = "/dashboard"


class TimelineSampler:
    """Samples `read()` into the timeline every interval on a daemon thread, until `stop()` or
    until `alive()` turns false (the engine it reads has shut down)."""

    def __init__(self, timeline: FleetTimeline, read: Callable[[], Sequence[InstanceReading]],
                 clock: Callable[[], float] = time.time, alive: Callable[[], bool] = lambda: True) -> None:
        self.timeline = timeline
        self.read = read
        self.clock = clock
        self.alive = alive
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "TimelineSampler":
        self._thread = threading.Thread(target=self._run, name="sloserve-timeline", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def sample_now(self) -> None:
        self.timeline.sample(self.clock(), self.read())

    def _run(self) -> None:
        interval = self.timeline.interval_s
        next_at = math.ceil(self.clock() / interval) * interval  # frames on whole multiples of the interval
        while not self._stop.wait(max(0.0, next_at - self.clock())):
            if not self.alive():
                return
            try:
                self.sample_now()
            except Exception:  # noqa: BLE001 - a bad reading must not end the timeline
                logger.exception("sampling the fleet timeline failed")
            next_at += interval
            if next_at < self.clock():  # fell behind (a stalled process): skip, do not burst
                next_at = math.ceil(self.clock() / interval) * interval


def add_dashboard_routes(app: FastAPI, timeline: FleetTimeline, title: str) -> None:
    page = live_page(title)

    @app.get(PAGE_ROUTE, response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page)

    @app.get(DATA_ROUTE, include_in_schema=False)
    async def dashboard_data(request: Request) -> JSONResponse:
        since = _number(request.query_params.get("since"), "since")
        after = _number(request.query_params.get("after_event"), "after_event")
        last = _number(request.query_params.get("last"), "last")
        if last is not None and last < 0:
            raise bad_request("last must be >= 0", "last")
        return JSONResponse(timeline.to_dict(since, int(after or 0), None if last is None else int(last)))


def _number(value: Optional[str], name: str) -> Optional[float]:
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except ValueError:
        raise bad_request(f"{name} must be a number, got {value[:40]!r}", name) from None
    if not math.isfinite(number):
        raise bad_request(f"{name} must be finite", name)
    return number
