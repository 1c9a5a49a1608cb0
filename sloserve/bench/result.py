"""A finished run as data: label, configuration, records and summary, and its JSON form.

One JSON file holds one or more runs (a rate sweep writes all its rates), each with every
per-request record, so any metric can be recomputed later and `bench compare` can overlay runs
from different servers. Loading recomputes nothing: the stored summary is what was reported.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from sloserve.bench.metrics import Summary, jsonable
from sloserve.records import RequestRecord

FORMAT_VERSION = 1


@dataclass
class BenchResult:
    label: str
    summary: Summary
    records: list[RequestRecord]
    rate: Optional[float] = None  # offered rate (req/s); None for a replay
    config: dict = field(default_factory=dict)
    num_unsent: int = 0
    # The fleet over the run (`FleetTimeline.to_dict()`): recorded by the simulator, or fetched
    # from a sloserve server's /dashboard/data; written as report.html, not into results.json.
    timeline: Optional[dict] = None

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "rate": jsonable(self.rate) if self.rate is not None else None,
                "rate_is_inf": self.rate is not None and math.isinf(self.rate), "num_unsent": self.num_unsent,
                "config": jsonable(self.config), "summary": self.summary.to_dict(),
                "records": [jsonable(r.to_dict()) for r in self.records]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BenchResult":
        rate = math.inf if d.get("rate_is_inf") else d.get("rate")
        return cls(d["label"], Summary.from_dict(d["summary"]), [RequestRecord.from_dict(r) for r in d["records"]],
                   rate, dict(d.get("config") or {}), int(d.get("num_unsent", 0)))


def save_results(path: str | Path, results: Sequence[BenchResult]) -> None:
    payload = {"format": "sloserve-bench", "version": FORMAT_VERSION, "runs": [r.to_dict() for r in results]}
    Path(path).write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n", encoding="utf-8")


def load_results(path: str | Path) -> list[BenchResult]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("format") != "sloserve-bench":
        raise ValueError(f"{path}: not a sloserve bench result file")
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"{path}: result format version {data.get('version')}, this sloserve reads {FORMAT_VERSION}")
    return [BenchResult.from_dict(r) for r in data["runs"]]
