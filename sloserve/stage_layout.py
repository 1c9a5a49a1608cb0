"""Pipeline-stage partitions (shared vocabulary of the stage policies in cluster/stages and the
pipeline cost model in sim/pipeline.py): which contiguous layers each stage of a pipeline-parallel instance
runs. A stage's time per step is its layers' time plus its extra work: the last stage also runs
the LM head and sampling, the others send activations on. The step's cycle is set by the slowest
stage, so an even split of the layers leaves the last stage the bottleneck when the head is heavy
(decode: it reads the head's weights for a handful of tokens) and not when the layers dominate
(prefill: every token goes through every layer, only the last one through the head)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

Partition = tuple[int, ...]


@dataclass(frozen=True)
class StageLoad:
    """Work over a window, in seconds: one layer's time, the last stage's extra (LM head and
    sampling), and every other stage's extra (sending activations on)."""

    layer_s: float
    head_s: float
    send_s: float

    def stage_times(self, partition: Sequence[int]) -> list[float]:
        last = len(partition) - 1
        return [n * self.layer_s + (self.head_s if i == last else self.send_s) for i, n in enumerate(partition)]

    def bottleneck(self, partition: Sequence[int]) -> float:
        return max(self.stage_times(partition))

    def imbalance(self, partition: Sequence[int]) -> float:
        """Slowest stage over the mean stage: 1.0 is perfectly balanced."""
        times = self.stage_times(partition)
        mean = sum(times) / len(times)
        return max(times) / mean if mean > 0 else 1.0

    def __add__(self, other: "StageLoad") -> "StageLoad":
        return StageLoad(self.layer_s + other.layer_s, self.head_s + other.head_s, self.send_s + other.send_s)


def even_partition(layers: int, stages: int) -> Partition:
    """vLLM's default: layers split as evenly as they go, the remainder on the first stages."""
    if not 1 <= stages <= layers:
        raise ValueError(f"{stages} pipeline stages need 1 to {layers} layers' worth of stages")
    base, extra = divmod(layers, stages)
    return tuple(base + (1 if i < extra else 0) for i in range(stages))


def best_partition(layers: int, stages: int, load: StageLoad) -> Partition:
    """The partition whose slowest stage is fastest under `load`, every stage at least one layer.
    The non-last stages all carry the same extra, so only the last stage's share is a real choice:
    the rest go evenly over the others (ties: the most layers on the last stage, the fewest moved)."""
    if stages == 1:
        return (layers,)
    best: Optional[Partition] = None
    best_time = float("inf")
    for last in range(layers - stages + 1, 0, -1):  # from the most layers on the last stage down
        head = even_partition(layers - last, stages - 1)
        candidate = head + (last,)
        t = load.bottleneck(candidate)
        if t < best_time - 1e-12:
            best, best_time = candidate, t
    assert best is not None
    return best


def layers_moved(old: Sequence[int], new: Sequence[int]) -> list[int]:
    """Layers crossing each stage boundary when re-partitioning from `old` to `new`."""
    out, a, b = [], 0, 0
    for i in range(len(old) - 1):
        a += old[i]
        b += new[i]
        out.append(abs(a - b))
    return out
