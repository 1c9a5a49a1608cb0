"""A finished run as data: label, inputs (`config`), outcomes beyond the records (`outcome`: a
simulation's migrations, hand-offs, scaling, energy, ...), records and summary, and its JSON form.

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
from sloserve.core.records import RequestRecord

FORMAT_VERSION = 2
# What version 1 wrote under `config` that is an outcome of the run (read back into `outcome`).
V1_OUTCOMES = ("migrations", "handoffs", "scaling", "energy", "expert_books", "expert_weights_gb", "stage_books",
               "kv_blocks", "preemptions", "prefix_hit_rate", "num_requests", "completed", "rejected", "sim_end_s",
               "wall_s", "events", "speedup_vs_real_time")


@dataclass
class BenchResult:
    label: str
    summary: Summary
    records: list[RequestRecord]
    rate: Optional[float] = None  # offered rate (req/s); None for a replay
    config: dict = field(default_factory=dict)  # what was run: the inputs
    num_unsent: int = 0
    # The fleet over the run (`FleetTimeline.to_dict()`): recorded by the simulator, or fetched
    # from a sloserve server's /dashboard/data; written as report.html, not into results.json.
    timeline: Optional[dict] = None
    outcome: dict = field(default_factory=dict)  # what the run did beyond its records (simulations)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "rate": jsonable(self.rate) if self.rate is not None else None,
                "rate_is_inf": self.rate is not None and math.isinf(self.rate), "num_unsent": self.num_unsent,
                "config": jsonable(self.config), "outcome": jsonable(self.outcome), "summary": self.summary.to_dict(),
                "records": [jsonable(r.to_dict()) for r in self.records]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BenchResult":
        rate = math.inf if d.get("rate_is_inf") else d.get("rate")
        return cls(d["label"], Summary.from_dict(d["summary"]), [RequestRecord.from_dict(r) for r in d["records"]],
                   rate, dict(d.get("config") or {}), int(d.get("num_unsent", 0)), outcome=dict(d.get("outcome") or {}))


def save_results(path: str | Path, results: Sequence[BenchResult]) -> None:
    payload = {"format": "sloserve-bench", "version": FORMAT_VERSION, "runs": [r.to_dict() for r in results]}
    Path(path).write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n", encoding="utf-8")


def load_results(path: str | Path) -> list[BenchResult]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("format") != "sloserve-bench":
        raise ValueError(f"{path}: not a sloserve bench result file")
    version = data.get("version")
    if version == 1:
        return [BenchResult.from_dict(split_v1(r)) for r in data["runs"]]
    if version != FORMAT_VERSION:
        raise ValueError(f"{path}: result format version {version}, this sloserve reads 1 and {FORMAT_VERSION}")
    return [BenchResult.from_dict(r) for r in data["runs"]]


def split_v1(run: Mapping[str, Any]) -> dict[str, Any]:
    """A version-1 run with its outcomes moved out of `config` into `outcome`."""
    config = dict(run.get("config") or {})
    outcome = {k: config.pop(k) for k in V1_OUTCOMES if k in config}
    tiers = config.get("kv_tiers")
    if isinstance(tiers, dict) and ("loads" in tiers or "prefetches" in tiers):
        tiers = dict(tiers)
        outcome["tier_loads"] = {k: tiers.pop(k) for k in ("loads", "prefetches") if k in tiers}
        config["kv_tiers"] = tiers
    return {**run, "config": config, "outcome": outcome}
