"""Finished jobs of an evaluation kept as they finish, so a run cut short goes on where it stopped.

A split of the routing grid is hours of simulation on two cores: longer than a working session.
With `--checkpoint FILE`, each finished (cell, seed) is appended to FILE as one JSON line; a
later run with the same FILE skips every job already there and measured by the same code, and
judges the cells with the restored metrics beside the new ones. "The same code" is a digest of the
sources that produce the decision's numbers (the simulator, the schedulers, the KV manager, the
cluster policies, the fleet assembly, the workloads, and the evaluation modules that measure: the
suite, the fleet, the metrics and the decision's own module): a job recorded before any of them
changed is measured again; the digest is of the code's syntax trees without docstrings, so a
comment or a docstring edited is not a change. A line that cannot be read (a run killed mid-write)
is skipped."""
from __future__ import annotations

import ast
import hashlib
import json
import logging
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from sloserve.evaluation.decisions import DECISIONS
from sloserve.evaluation.suite import Cell
from sloserve.core.records import jsonable

logger = logging.getLogger(__name__)

_PACKAGE = Path(__file__).resolve().parents[1]  # sloserve/
_MEASURED_BY = ("sim", "sched", "kv", "cluster", "workload", "core")
_MEASURED_BY_FILES = ("simulation.py", "planning.py", "fleet_view.py",
                      "evaluation/suite.py", "evaluation/fleet.py", "evaluation/metrics.py", "evaluation/workloads.py",
                      "evaluation/result.py", "evaluation/decisions/base.py")


@lru_cache(maxsize=None)
def code_fingerprint(decision: str) -> str:
    """A digest of the sources `decision`'s numbers depend on (see the module docstring)."""
    return code_digest(measured_by(decision))


def measured_by(decision: str, package: Path = _PACKAGE) -> list[Path]:
    """The source files `decision`'s numbers depend on, under `package` (sloserve/ or a copy of it)."""
    files = [p for d in _MEASURED_BY for p in (package / d).rglob("*.py")]
    own = Path(sys.modules[DECISIONS[decision].__module__].__file__ or "")
    return files + [package / f for f in _MEASURED_BY_FILES] + [package / own.relative_to(_PACKAGE)]


def code_digest(paths: list[Path]) -> str:
    """A digest of source files as code: their syntax trees without docstrings (comments never reach one)."""
    h = hashlib.blake2b(digest_size=12)
    for path in sorted(paths):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                    isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                    isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        h.update(path.name.encode())
        h.update(ast.dump(tree).encode())
    return h.hexdigest()


def job_key(decision: str, measure: Any, cell: Cell, seed: int) -> str:
    """What makes two jobs the same: the decision, how it is measured, the cell and the seed."""
    return json.dumps([decision, jsonable(measure.as_dict()), cell.description, seed], sort_keys=True)


@dataclass
class Checkpoint:
    path: Path

    def restore(self) -> dict[str, dict[str, Any]]:
        """Job key -> its metrics per policy, for every readable line measured by this code."""
        if not self.path.exists():
            return {}
        out, stale = {}, 0
        for n, line in enumerate(self.path.read_text().splitlines(), 1):
            try:
                entry = json.loads(line)
                if entry["code"] != code_fingerprint(entry["decision"]):
                    stale += 1
                    continue
                metrics_type = DECISIONS[entry["decision"]].metrics_type
                out[entry["key"]] = {p: metrics_type.from_dict(m) for p, m in entry["metrics"].items()}
            except (ValueError, KeyError, TypeError) as exc:
                logger.warning("%s:%d: skipped an unreadable job (%s)", self.path, n, exc)
        if stale:
            logger.warning("%s: %d job(s) were measured by other code and run again", self.path, stale)
        return out

    def record(self, key: str, decision: str, metrics: Mapping[str, Any]) -> None:
        line = json.dumps({"key": key, "decision": decision, "code": code_fingerprint(decision),
                           "metrics": {p: jsonable(m.as_dict()) for p, m in metrics.items()}})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")
