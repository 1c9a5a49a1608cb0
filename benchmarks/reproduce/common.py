"""What every reproduction prints and keeps: the paper's number, ours, their ratio, and how the
setting differs. Each script in this folder runs the simulator on the closest public setting."""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parents[1] / "results"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing


@dataclass
class Claim:
    paper: str  # short name, e.g. "Sarathi-Serve (OSDI '24)"
    claim: str  # what the paper reports, in its words
    metric: str  # what both numbers measure
    paper_value: float
    ours: float
    setting: str  # ours
    differs: str  # where our setting differs from the paper's

    @property
    def ratio(self) -> float:
        return self.ours / self.paper_value if self.paper_value else float("nan")


def report(name: str, claim: Claim, details: dict) -> Path:
    console = Console()
    table = Table(title=f"{claim.paper}: {claim.claim}", show_lines=True)
    for col in ("metric", "paper", "ours", "ours / paper", "our setting", "differs"):
        table.add_column(col)
    table.add_row(claim.metric, f"{claim.paper_value:g}", f"{claim.ours:.3g}", f"{claim.ratio:.2f}", claim.setting,
                  claim.differs)
    console.print(table)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"reproduce-{name}-{stamp}.json"
    path.write_text(json.dumps({"date": stamp, "claim": asdict(claim), "ratio": claim.ratio, "details": details},
                               indent=1))
    console.print(f"wrote {path}")
    return path
