"""The fleet's page: one self-contained HTML file (no build step, no CDN; charts are SVG drawn by
its own script) over a `timeline.FleetTimeline` as JSON.

Live (`/dashboard` on a server or a front) it polls `/dashboard/data`; as a run's `report.html`
(`sloserve simulate --out`, `sloserve bench --out`) the recorded timeline is embedded and a
time slider walks through it.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Optional

DATA_ROUTE = "/dashboard/data"


def _template() -> str:
    return resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")


def live_page(title: str = "sloserve fleet") -> str:
    """The page a server serves: it polls `DATA_ROUTE` for the frames it has not seen."""
    return _render(title, {"mode": "live", "data_url": DATA_ROUTE}, None)


def report_page(timeline: dict, title: str = "sloserve run") -> str:
    """A recorded timeline (`FleetTimeline.to_dict()`) as one static page."""
    return _render(title, {"mode": "report"}, timeline)


def write_report(path: Path, timeline: dict, title: str = "sloserve run") -> Path:
    path.write_text(report_page(timeline, title), encoding="utf-8")
    return path


def _render(title: str, config: dict, timeline: Optional[dict]) -> str:
    def embed(value: object) -> str:  # JSON inside <script>: no "</script>" can end it early
        return json.dumps(value, allow_nan=False).replace("</", "<\\/")

    page = _template()
    page = page.replace("__TITLE__", _escape(title))
    page = page.replace("__CONFIG__", embed(config))
    return page.replace("__DATA__", embed(timeline))


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
