"""Expert placement policies for an expert-parallel instance: which GPU holds which experts of each
MoE layer, how many copies of each, which stay in host memory, and when to re-place them.

A policy sees the experts' popularity per layer (each expert's share of the layer's routed tokens:
estimated from a calibration run at deployment, later from the tokens observed over a window) and
answers with an ExpertPlacement. Pure Python, no clock: the caller decides when to ask
(`interval_s`) and what a move costs. The packing is the classic longest-processing-time greedy
(DeepSeek's EPLB packs replicated experts to GPUs the same way).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Optional, Sequence

from sloserve.expert_layout import HOST, ExpertPlacement


class ExpertPlacer(ABC):
    name: str = ""
    interval_s: Optional[float] = None  # re-place every this many seconds; None: placed once

    def __init__(self, redundant: int = 1, offload_share: float = 0.25, interval_s: float = 600.0):
        """`redundant`: extra expert copies per GPU per layer (memory for replicas); `offload_share`:
        the coldest share of each layer's experts kept in host memory; `interval_s`: how often a
        re-placing policy re-places."""
        if redundant < 0 or not 0 <= offload_share < 1 or not interval_s > 0:
            raise ValueError("need redundant >= 0, 0 <= offload_share < 1 and interval_s > 0")
        self.redundant, self.offload_share = redundant, offload_share
        if type(self).interval_s is not None:
            self.interval_s = interval_s

    @abstractmethod
    def place(self, popularity: Sequence[Sequence[float]], gpus: int) -> ExpertPlacement:
        """A placement for experts whose per-layer popularity is `popularity` on `gpus` GPUs."""


def replicate(popularity: Sequence[float], copies: int, gpus: int) -> list[int]:
    """Copies per expert (at least one each, at most one per GPU), `copies` in all: each extra
    copy goes to the expert whose copies carry the most load each."""
    counts = [1] * len(popularity)
    for _ in range(max(0, copies - len(popularity))):
        best, load = -1, -1.0
        for e, p in enumerate(popularity):
            if counts[e] < gpus and p / counts[e] > load:
                best, load = e, p / counts[e]
        if best < 0:
            break
        counts[best] += 1
    return counts


def pack(popularity: Sequence[float], counts: Sequence[int], gpus: int) -> tuple[tuple[int, ...], ...]:
    """Copies onto GPUs, heaviest copy first to the least-loaded GPU that has room and no copy of
    that expert yet (experts with 0 copies stay in host memory). Every GPU gets the same number of
    slots, the fewest that hold all copies."""
    slots = math.ceil(sum(counts) / gpus) if sum(counts) else 0
    items = sorted(((popularity[e] / c, e) for e, c in enumerate(counts) for _ in range(c)), reverse=True)
    load, used = [0.0] * gpus, [0] * gpus
    where: list[list[int]] = [[] for _ in popularity]
    for share, e in items:
        free = [g for g in range(gpus) if used[g] < slots and g not in where[e]]
        g = min(free, key=lambda g: (load[g], used[g], g))
        where[e].append(g)
        load[g] += share
        used[g] += 1
    return tuple(tuple(sorted(w)) if w else HOST for w in where)


def balanced(popularity: Sequence[Sequence[float]], gpus: int, extra_per_gpu: int) -> ExpertPlacement:
    """Every expert on the device, the hottest replicated into `extra_per_gpu` more slots per GPU, packed."""
    layers = []
    for pop in popularity:
        counts = replicate(pop, len(pop) + extra_per_gpu * gpus, gpus)
        layers.append(pack(pop, counts, gpus))
    return ExpertPlacement(gpus, tuple(layers))
