"""A per-step log of the engine: when each step started, how its time split between
scheduling, the model and output processing, and what it computed.

For users it answers "where does my server's time go"; for `benchmarks/sim_fidelity.py` it
separates the simulator's two error sources: the cost model's price of a step (compare
`execute_s` with the model's estimate of the same load) and the time outside the model
(scheduling, sampling bookkeeping, detokenization, the server's event loop between steps).
One JSON object per line, written as it happens (line-buffered), so a killed server keeps
everything up to its last step.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Iterator, Optional

from sloserve.sched.costs import StepLoad


@dataclass(frozen=True)
class StepRecord:
    start_s: float  # engine clock when the step began (scheduling included)
    schedule_s: float
    execute_s: float  # the model runner: forward, sampling, KV copies
    process_s: float  # scheduler update, detokenization, stop checks, outputs
    load: StepLoad

    @property
    def end_s(self) -> float:
        return self.start_s + self.schedule_s + self.execute_s + self.process_s

    def to_json(self) -> str:
        return json.dumps({"start_s": self.start_s, "schedule_s": self.schedule_s, "execute_s": self.execute_s,
                           "process_s": self.process_s, **asdict(self.load)})

    @classmethod
    def from_json(cls, line: str) -> "StepRecord":
        d = json.loads(line)
        fields = ("start_s", "schedule_s", "execute_s", "process_s")
        if "saves" in d:
            d["saves"] = tuple(d["saves"])  # JSON has no tuples; a StepLoad compares equal only with its own
        return cls(*(float(d.pop(k)) for k in fields), StepLoad(**d))


class StepTraceWriter:
    def __init__(self, path: str | Path) -> None:
        self._file: Optional[IO[str]] = open(path, "w", buffering=1, encoding="utf-8")

    def write(self, record: StepRecord) -> None:
        if self._file is not None:
            self._file.write(record.to_json() + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_step_trace(path: str | Path) -> Iterator[StepRecord]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield StepRecord.from_json(line)
