"""Mixture-of-experts instances in the simulator: expert popularity that is skewed and drifts, and a
cost model that prices a step by where the experts are (sloserve.expert_layout).

The instance is one expert-parallel group of G GPUs: attention is data-parallel (each GPU holds
the attention weights and its share of the requests' KV), the experts of every MoE layer are spread
over the G GPUs by the placement. Per MoE layer and step of T tokens (k experts each):
- dispatch and combine: each GPU sends its T/G tokens' hidden states to the GPUs of their experts
  and gets the results back (all-to-all over the instance's interconnect); a GPU that holds many
  popular experts receives more, and the slowest GPU sets the time;
- expert compute: each GPU runs the tokens routed to its copies; its time is the roofline of those
  FLOPs and of the weights of its experts that any token touched; the layer waits for the slowest
  GPU (the straggler), which is why placement matters;
- offloaded experts: a touched expert that lives in host memory is fetched over its home GPU's host
  link, prefetched while the previous layer computes, so only the part longer than that shows.

Popularity (`ExpertPopularity`): each layer's experts have log-weights drawn from N(0, skew^2)
(a skew of 0.6 puts the hottest of 8 experts at ~2x the mean share and the hottest of 128 at ~4x;
published inference traces report that a minority of experts takes most tokens and that imbalance
grows with batch size, Liu et al., "A Replicate-and-Quantize Strategy...", arXiv 2602.19938, 2026,
and DeepSeek-V3 serves with 32 redundant experts for its 256 because of it), moving as a
mean-reverting random walk with time constant `drift_s` (expert use depends on the domain of the
traffic, which shifts over the day), updated every `epoch_s`. These are modelling assumptions, not
a measured trace: the study varies skew and drift.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

from sloserve.core.config import ModelConfig
from sloserve.expert_layout import ExpertPlacement
from sloserve.sched.costs import StepLoad
from sloserve.sched.plan import StepPlan
from sloserve.sim.cost import Efficiency, RooflineCostModel
from sloserve.sim.hardware import HardwareSpec


class ExpertPopularity:
    """Per layer, each expert's share of the layer's routed tokens, epoch by epoch (forward only)."""

    def __init__(self, num_layers: int, num_experts: int, skew: float = 0.6, drift_s: float = 1800.0,
                 epoch_s: float = 60.0, seed: int = 0):
        if skew < 0 or not epoch_s > 0 or drift_s < 0:
            raise ValueError("need skew >= 0, epoch_s > 0 and drift_s >= 0 (0: no drift)")
        self.skew, self.epoch_s = skew, epoch_s
        self.rho = 1.0 if drift_s == 0 else math.exp(-epoch_s / drift_s)
        self._rng = random.Random(seed)
        self._w = [[self._rng.gauss(0.0, skew) for _ in range(num_experts)] for _ in range(num_layers)]
        self.epoch = 0
        self.current = self._normalized()

    def _normalized(self) -> list[list[float]]:
        out = []
        for w in self._w:
            e = [math.exp(x) for x in w]
            total = sum(e)
            out.append([x / total for x in e])
        return out

    def advance_to(self, epoch: int) -> None:
        noise = math.sqrt(max(0.0, 1.0 - self.rho ** 2)) * self.skew
        while self.epoch < epoch:
            if self.rho < 1.0:
                gauss = self._rng.gauss
                self._w = [[self.rho * x + noise * gauss(0.0, 1.0) for x in w] for w in self._w]
            self.epoch += 1
        self.current = self._normalized()


@dataclass
class ExpertBooks:
    """What the placement did over a run (SimResult.experts)."""

    replacements: int = 0
    moved_copies: int = 0
    moved_bytes: float = 0.0
    stall_s: float = 0.0  # steps held while moved copies arrived
    fetched_bytes: float = 0.0  # offloaded experts' weights copied from host memory
    timeline: list = field(default_factory=list)  # (t, straggler factor of the placement on the popularity)

    def as_dict(self) -> dict:
        stragglers = [s for _, s in self.timeline]
        return {"replacements": self.replacements, "moved_copies": self.moved_copies,
                "moved_bytes": self.moved_bytes, "stall_s": self.stall_s, "fetched_bytes": self.fetched_bytes,
                "mean_straggler": sum(stragglers) / len(stragglers) if stragglers else None,
                "timeline": self.timeline}


@dataclass(frozen=True)
class _LayerView:
    shares: tuple[float, ...]  # per GPU, of the layer's routed tokens
    local: tuple[float, ...]  # per GPU, chance that a token there finds its expert on that GPU
    share_per_expert: tuple[float, ...]  # per GPU, mean share of one of its copies
    counts: tuple[int, ...]  # copies per GPU
    offloaded: tuple[tuple[int, float], ...]  # (home GPU, share) of each offloaded expert


class ExpertParallelCostModel(RooflineCostModel):
    """The roofline of an expert-parallel MoE instance of `gpus` GPUs (module docstring). Its time
    depends on the popularity of the moment: the instance calls `advance(now)` before each step,
    which moves the popularity to `now`'s epoch and, every `replace_every_s`, asks `replace` for a
    placement from the popularity seen since the last one (a move holds the next step while the
    copies that change GPU cross the interconnect)."""

    prices_experts = True

    def __init__(self, hardware: HardwareSpec, model: ModelConfig, gpus: int, placement: ExpertPlacement,
                 popularity: ExpertPopularity, replace: Optional[Callable[[list[list[float]]], ExpertPlacement]] = None,
                 replace_every_s: Optional[float] = None, dtype_bytes: int = 2, efficiency: Efficiency = Efficiency(),
                 block_size: int = 16):
        if not model.num_experts:
            raise ValueError(f"{model.name or 'the model'} has no experts to place")
        if placement.num_layers != model.num_layers or placement.num_experts != model.num_experts \
                or placement.gpus != gpus:
            raise ValueError("the placement does not match the model's layers and experts or the GPU count")
        super().__init__(hardware, model, gpus, dtype_bytes, efficiency, block_size)
        self.gpus, self.placement, self.popularity = gpus, placement, popularity
        self.replace, self.replace_every_s = replace, replace_every_s
        self.next_replace = replace_every_s if replace is not None and replace_every_s else math.inf
        self.expert_params_1 = 3 * model.hidden_size * model.intermediate_size  # one expert of one layer
        self.dense_params = model.num_params - model.num_layers * model.num_experts * self.expert_params_1
        self.books = ExpertBooks()
        self._window: list[list[float]] = [[0.0] * model.num_experts for _ in range(model.num_layers)]
        self._window_epochs = 0
        self._pending_stall = 0.0
        self._views: list[_LayerView] = []
        self._moe_cache: dict[int, tuple[float, float]] = {}
        self._refresh(0.0)

    # ---- time and placement --------------------------------------------------------
    def advance(self, now: float) -> None:
        epoch = int(now // self.popularity.epoch_s)
        if epoch > self.popularity.epoch:
            for layer, pop in zip(self._window, self.popularity.current):  # the epoch that ended counts
                for e, p in enumerate(pop):
                    layer[e] += p
            self._window_epochs += 1
            self.popularity.advance_to(epoch)
            self._refresh(now)
        if now >= self.next_replace:
            self._replace(now)

    def _replace(self, now: float) -> None:
        n = max(1, self._window_epochs)
        seen = [[x / n for x in layer] for layer in self._window] if self._window_epochs else self.popularity.current
        new = self.replace(seen)  # type: ignore[misc]
        moved = self.placement.moved_copies(new)
        expert_bytes = self.expert_params_1 * self.dtype_bytes
        b = self.books
        b.replacements += 1
        b.moved_copies += sum(moved)
        b.moved_bytes += sum(moved) * expert_bytes
        stall = max(moved) * expert_bytes / (self.hw.interconnect_bandwidth * self.eff.interconnect) if moved else 0.0
        b.stall_s += stall
        self._pending_stall += stall
        self.placement = new
        self._window = [[0.0] * len(layer) for layer in self._window]
        self._window_epochs = 0
        self.next_replace = now + self.replace_every_s  # type: ignore[operator]
        self._refresh(now)

    def _refresh(self, now: float) -> None:
        """Per-layer views of the placement under the current popularity (they do not depend on T)."""
        views = []
        for layer, pop in enumerate(self.popularity.current):
            copies = self.placement.layers[layer]
            shares = self.placement.gpu_shares(layer, pop)
            counts = self.placement.experts_per_gpu(layer)
            local = [0.0] * self.gpus
            for p, where in zip(pop, copies):
                for g in where:
                    local[g] += p
            offloaded = tuple((self.placement.home(e), pop[e]) for e, where in enumerate(copies) if not where)
            views.append(_LayerView(tuple(shares), tuple(local),
                                    tuple(s / c if c else 0.0 for s, c in zip(shares, counts)), tuple(counts),
                                    offloaded))
        self._views = views
        self._moe_cache = {}
        self.books.timeline.append((now, self.placement.straggler(self.popularity.current)))

    # ---- pricing -----------------------------------------------------------------------
    def weight_bytes(self) -> float:
        """A GPU's weights, on average over the group: the attention and dense weights (data-parallel:
        a full copy on each) and its share of the expert copies. The mean, not the fullest GPU: each
        GPU keeps the KV of its own requests, so the group's KV room is the sum of what each leaves."""
        copies = self.placement.copies_total() / self.gpus
        return (self.dense_params + copies * self.expert_params_1) * self.dtype_bytes

    def _linear_and_comm(self, num_tokens: int, num_sampled: int) -> tuple[float, float, float]:
        """Only the dense part (attention projections, LM head): each GPU computes 1/G of the tokens
        with its own full copy of the weights; the experts are priced by `_moe`."""
        hw, eff, g = self.hw, self.eff, self.gpus
        flops = 2.0 * num_tokens * self.attn_params + 2.0 * num_sampled * self.head_params
        weight_bytes = (self.attn_params + self.head_params) * self.dtype_bytes
        return flops / g / (hw.peak_flops * eff.compute), weight_bytes / (hw.mem_bandwidth * eff.memory), 0.0

    def _moe(self, tokens: int) -> tuple[float, float]:
        """(seconds, bytes fetched from host memory) of all MoE layers for a step of `tokens`."""
        cached = self._moe_cache.get(tokens)
        if cached is not None:
            return cached
        m, hw, eff, g = self.model, self.hw, self.eff, self.gpus
        selections = tokens * m.num_experts_per_token
        per_token_bytes = m.hidden_size * self.dtype_bytes
        link = hw.interconnect_bandwidth * eff.interconnect
        flops_per_selection = 2.0 * self.expert_params_1
        expert_bytes = self.expert_params_1 * self.dtype_bytes
        compute_rate, memory_rate = hw.peak_flops * eff.compute, hw.mem_bandwidth * eff.memory
        host_rate = hw.host_link_bandwidth * eff.host_link
        total, fetched, previous = 0.0, 0.0, 0.0
        for view in self._views:
            slowest = 0.0
            a2a = 0.0
            for gpu in range(g):
                share, count = view.shares[gpu], view.counts[gpu]
                routed = selections * share
                touched = count * (1.0 - (1.0 - view.share_per_expert[gpu]) ** selections) if count else 0.0
                t = max(routed * flops_per_selection / compute_rate, touched * expert_bytes / memory_rate)
                if t > slowest:
                    slowest = t
                sent = selections / g * (1.0 - view.local[gpu])
                received = routed - selections / g * view.local[gpu]
                a2a = max(a2a, sent, received)
            fetch_by_gpu = [0.0] * g
            for home, share in view.offloaded:
                fetch_by_gpu[home] += (1.0 - (1.0 - share) ** selections) * expert_bytes
            fetch = max(fetch_by_gpu) / host_rate if view.offloaded else 0.0
            fetched += sum(fetch_by_gpu)
            comm = 2.0 * (a2a * per_token_bytes / link + eff.allreduce_latency_s) if g > 1 else 0.0
            layer = slowest + comm
            total += layer + max(0.0, fetch - previous)  # the fetch overlaps the previous layer
            previous = layer
        self._moe_cache[tokens] = (total, fetched)
        return total, fetched

    def step_time(self, shape: StepLoad) -> float:
        base = RooflineCostModel.step_time_at(self, shape, 1.0)
        return base + self._moe(shape.num_tokens)[0] if shape.num_tokens else base

    def step_time_at(self, shape: StepLoad, clock: float, work=None) -> float:
        if clock != 1.0:
            raise ValueError("clock policies are not modelled for expert-parallel instances")
        return self.step_time(shape)

    def plan_time(self, plan: StepPlan) -> float:
        shape = StepLoad.of_plan(plan)
        if shape.num_tokens:
            self.books.fetched_bytes += self._moe(shape.num_tokens)[1]
        stall, self._pending_stall = self._pending_stall, 0.0
        return self.step_time(shape) + stall

    def decode_run(self, num_decodes: int, context: int, steps: int) -> list[float]:
        moe, fetched = self._moe(num_decodes)
        self.books.fetched_bytes += fetched * steps
        out = [t + moe for t in RooflineCostModel.decode_run_at(self, num_decodes, context, steps, 1.0)]
        if out:
            out[0] += self._pending_stall
            self._pending_stall = 0.0
        return out

    def decode_run_at(self, num_decodes: int, context: int, steps: int, clock: float) -> list[float]:
        if clock != 1.0:
            raise ValueError("clock policies are not modelled for expert-parallel instances")
        return self.decode_run(num_decodes, context, steps)
