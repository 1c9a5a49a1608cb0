"""Step-time models: how long would the real engine take to execute a StepPlan?

Both models see a step only through its StepLoad (the few numbers that decide its cost), so
a simulated instance can also price steps it never materialises as plans (fast-forwarded
decode runs).
"""
from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Iterable, Mapping, NamedTuple, Optional, Sequence

from sloserve.core.config import ModelConfig
from sloserve.kv.tiers import DISK, HOST, STORE
from sloserve.sched.costs import StepLoad
from sloserve.sched.plan import StepPlan
from sloserve.sim.hardware import HardwareSpec


class CostModel(ABC):
    """Prices steps for the simulator, and is also what a simulated instance's scheduler gets
    as its step-cost and swap-cost estimator (`estimate`, `swap_time`): in simulation the
    scheduler's estimates are exact, as a well-profiled engine's would be."""

    @abstractmethod
    def step_time(self, shape: StepLoad) -> float:
        """Seconds the step takes (swap copies included)."""

    # Seconds per KV block to or from the prefix cache's disk tier and shared store (set by the
    # fleet builder from the hardware's disk and the store's link; the host tier is the swap link).
    tier_s_per_block: Mapping[str, float] = MappingProxyType({})

    def swap_time(self, num_blocks: int) -> float:
        """Seconds to copy `num_blocks` KV blocks one way between device and host (0: not modelled)."""
        return 0.0

    def tier_time(self, tier: str, num_blocks: int) -> float:
        """The scheduler's TierCostEstimator: one-way copy time of `num_blocks` to or from `tier`."""
        if tier == HOST:
            return self.swap_time(num_blocks)
        per = self.tier_s_per_block.get(tier)
        return math.inf if per is None else num_blocks * per

    def kv_ops_time(self, shape: StepLoad) -> float:
        """Seconds of the step's KV copies that run before its compute (swaps, tier loads)."""
        t = self.swap_time(shape.swap_blocks) if shape.swap_blocks else 0.0
        if shape.disk_blocks:
            t += self.tier_time(DISK, shape.disk_blocks)
        if shape.store_blocks:
            t += self.tier_time(STORE, shape.store_blocks)
        return t

    def save_time(self, shape: StepLoad) -> float:
        """Seconds of the step's tier saves, which overlap its compute (tiers are written at once)."""
        host, disk, store = shape.saves
        if not (host or disk or store):
            return 0.0
        return max(self.tier_time(HOST, host), self.tier_time(DISK, disk) if disk else 0.0,
                   self.tier_time(STORE, store) if store else 0.0)

    def with_saves(self, compute_s: float, shape: StepLoad) -> float:
        """The step's time when its saves run behind its compute: they show only if longer."""
        saves = self.save_time(shape)
        return compute_s if saves <= compute_s else saves

    def plan_time(self, plan: StepPlan) -> float:
        return self.step_time(StepLoad.of_plan(plan))

    def decode_run(self, num_decodes: int, context: int, steps: int) -> list[float]:
        """Durations of `steps` pure-decode steps of `num_decodes` requests whose computed
        tokens sum to `context` before the first; each step adds one token to each. Models
        override this with a closed form: it prices the simulator's fast-forwarded runs."""
        n = num_decodes
        return [self.step_time(StepLoad.decodes(n, context + i * n)) for i in range(1, steps + 1)]

    def estimate(self, load: StepLoad) -> float:
        """The scheduler's StepCostEstimator interface."""
        return self.step_time(load)

    def advance(self, now: float) -> None:
        """Simulated time moved to `now` before a step is planned (a model whose prices change over
        time, such as an expert placement under drifting popularity, catches up here)."""


@dataclass(frozen=True)
class MaskCost:
    """What structured outputs add to a step: per sampled row under a token mask, the serial part
    (the matcher's advance, applying the mask to the logits, the sampler's masked path) and the
    mask's computation, which runs on host threads while the step computes and shows only when it
    outlasts the step. Defaults: the CPU engine's measured costs (BENCHMARKS.md, "Structured
    outputs"; `benchmarks/structured_outputs.py` prints both): 34-50 us a masked row at batch 16,
    26 us at 64, on a 2-vCPU Zen4 EPYC, and xgrammar's mask at 1-3 us a row (median). An upper
    bound for a GPU host, whose cores are not the ones computing the step."""

    serial_s: float = 40e-6
    fill_s: float = 3e-6
    fill_threads: int = 1

    def __post_init__(self) -> None:
        if self.serial_s < 0 or self.fill_s < 0 or self.fill_threads < 1:
            raise ValueError(f"mask cost needs serial_s, fill_s >= 0 and fill_threads >= 1, got {self}")

    def extra(self, masked: int, compute_s: float) -> float:
        """Seconds `masked` rows add to a step that computes for `compute_s`."""
        if not masked:
            return 0.0
        fill = self.fill_s * masked / self.fill_threads
        return self.serial_s * masked + (fill - compute_s if fill > compute_s else 0.0)


class StepWork(NamedTuple):
    """A step's seconds at the full SM clock, by what a lower clock does to them: the compute
    part of a roofline phase stretches, its memory part does not (HBM has its own clock), nor
    do the all-reduces and the launch overhead. What the power model turns into joules."""

    linear_compute: float
    linear_memory: float
    attention_compute: float
    attention_memory: float
    comm: float
    overhead: float

    @property
    def phases(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """(compute, memory) seconds of the linear layers and of attention."""
        return (self.linear_compute, self.linear_memory), (self.attention_compute, self.attention_memory)


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak that real kernels reach. Assumptions, documented in the README:
    dense GEMMs in serving engines typically reach 50–75% of peak (MFU) at large batch, decode
    weight streaming 70–85% of HBM bandwidth; attention kernels do worse on compute."""

    compute: float = 0.65
    attention: float = 0.45
    memory: float = 0.8
    interconnect: float = 0.7
    step_overhead_s: float = 2e-3  # scheduler + launch overhead per step (CUDA graphs keep it small)
    allreduce_latency_s: float = 10e-6
    host_link: float = 0.8  # pinned-memory copies over PCIe reach ~80% of the link's bandwidth


class RooflineCostModel(CostModel):
    """max(compute, memory) per phase (linear layers, attention) plus tensor-parallel all-reduces."""

    def __init__(self, hardware: HardwareSpec, model: ModelConfig, tp: int = 1, dtype_bytes: int = 2,
                 efficiency: Efficiency = Efficiency(), block_size: int = 16):
        if tp < 1:
            raise ValueError("tensor parallel degree must be >= 1")
        self.hw, self.model, self.tp, self.dtype_bytes, self.eff = hardware, model, tp, dtype_bytes, efficiency
        self.block_size = block_size
        m = model
        q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        self.attn_params = m.num_layers * (m.hidden_size * (q + 2 * kv) + q * m.hidden_size)
        self.expert_params = m.num_layers * 3 * m.hidden_size * m.intermediate_size  # one expert (or the dense MLP)
        self.head_params = m.vocab_size * m.hidden_size
        self.kv_bytes_per_token = m.kv_bytes_per_token(dtype_bytes)

    def weight_bytes(self) -> float:
        """Device memory the weights take on one TP rank."""
        return self.model.num_params * self.dtype_bytes / self.tp

    def _experts_touched(self, tokens: int) -> float:
        m = self.model
        if not m.num_experts:
            return 1.0
        k, e = m.num_experts_per_token, m.num_experts
        return e * (1.0 - (1.0 - k / e) ** tokens)  # expected distinct experts hit by `tokens` tokens

    def swap_time(self, num_blocks: int) -> float:
        """Each tensor-parallel rank moves its shard of the blocks over its own host link."""
        block_bytes = self.block_size * self.kv_bytes_per_token / self.tp
        return num_blocks * block_bytes / (self.hw.host_link_bandwidth * self.eff.host_link)

    def _attention_time(self, pairs: float, kv_tokens: float, clock: float = 1.0) -> float:
        """The attention's roofline time at `clock`. A float, not _attention_phase's tuple: the
        simulator calls this about once per simulated step, and a tuple per call is a GC-tracked
        allocation that made whole runs ~13% slower (more collections of a large heap)."""
        m, hw, eff, tp = self.model, self.hw, self.eff, self.tp
        c = 4.0 * m.num_layers * m.num_heads * m.head_dim * pairs / tp / (hw.peak_flops * eff.attention) / clock
        b = self.kv_bytes_per_token * kv_tokens / tp / (hw.mem_bandwidth * eff.memory)
        return c if c > b else b

    def _attention_phase(self, pairs: float, kv_tokens: float) -> tuple[float, float]:
        """(compute, memory) seconds of the step's attention at the full clock."""
        m, hw, eff, tp = self.model, self.hw, self.eff, self.tp
        attn_flops = 4.0 * m.num_layers * m.num_heads * m.head_dim * pairs
        kv_bytes = self.kv_bytes_per_token * kv_tokens
        return attn_flops / tp / (hw.peak_flops * eff.attention), kv_bytes / tp / (hw.mem_bandwidth * eff.memory)

    def decode_run(self, num_decodes: int, context: int, steps: int) -> list[float]:
        # The simulator's hot path, so not through decode_run_at (same sum, same order, same bits).
        n = num_decodes
        lin_c, lin_m, t_comm = self._linear_and_comm(n, n)
        t_linear = lin_c if lin_c > lin_m else lin_m
        tail = self.eff.step_overhead_s
        swap = self.swap_time(0)
        attention = self._attention_time
        return [t_linear + attention(context + i * n, context + (i + 1) * n) + t_comm + tail + swap
                for i in range(1, steps + 1)]

    def decode_run_at(self, num_decodes: int, context: int, steps: int, clock: float) -> list[float]:
        """decode_run with the SM clock at `clock` of its maximum. Only the attention term changes
        from step to step; the sum keeps step_time's order so a fast-forwarded run is priced to
        the last bit like the same steps one at a time."""
        n = num_decodes
        lin_c, lin_m, t_comm = self._linear_and_comm(n, n)
        t_linear = max(lin_c / clock, lin_m)
        tail = self.eff.step_overhead_s
        swap = self.swap_time(0)
        out = []
        for i in range(1, steps + 1):
            out.append(t_linear + self._attention_time(context + i * n, context + (i + 1) * n, clock) + t_comm + tail
                       + swap)
        return out

    def _linear_and_comm(self, num_tokens: int, num_sampled: int) -> tuple[float, float, float]:
        """(compute, memory) seconds of the linear layers at the full clock, and the all-reduces'."""
        m, hw, eff, tp = self.model, self.hw, self.eff, self.tp
        per_token_experts = max(1, m.num_experts_per_token)
        linear_flops = 2.0 * num_tokens * (self.attn_params + per_token_experts * self.expert_params)
        linear_flops += 2.0 * num_sampled * self.head_params
        weight_bytes = (self.attn_params + self._experts_touched(num_tokens) * self.expert_params
                        + self.head_params) * self.dtype_bytes
        t_comm = 0.0
        if tp > 1:  # two all-reduces of the hidden states per layer (ring: 2(tp-1)/tp of the data)
            data = num_tokens * m.hidden_size * self.dtype_bytes * 2 * (tp - 1) / tp
            per = data / (hw.interconnect_bandwidth * eff.interconnect) + eff.allreduce_latency_s
            t_comm = 2 * m.num_layers * per
        return (linear_flops / tp / (hw.peak_flops * eff.compute),
                weight_bytes / tp / (hw.mem_bandwidth * eff.memory), t_comm)

    def work(self, shape: StepLoad) -> StepWork:
        """The step split into what the SM clock stretches and what it does not."""
        if shape.num_tokens == 0:
            return StepWork(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        lin_c, lin_m, t_comm = self._linear_and_comm(shape.num_tokens, shape.num_sampled)
        att_c, att_m = self._attention_phase(shape.decode_context + shape.prefill_attention,
                                             shape.decode_context + shape.prefill_context + shape.num_tokens)
        return StepWork(lin_c, lin_m, att_c, att_m, t_comm, self.eff.step_overhead_s)

    def step_time(self, shape: StepLoad) -> float:
        # step_time_at(shape, 1.0) without the extra call: the simulator prices every step here.
        if shape.num_tokens == 0:
            return self.kv_ops_time(shape) + self.save_time(shape)
        lin_c, lin_m, comm = self._linear_and_comm(shape.num_tokens, shape.num_sampled)
        t_attn = self._attention_time(shape.decode_context + shape.prefill_attention,
                                      shape.decode_context + shape.prefill_context + shape.num_tokens)
        compute = (lin_c if lin_c > lin_m else lin_m) + t_attn + comm + self.eff.step_overhead_s
        return self.with_saves(compute, shape) + self.kv_ops_time(shape)

    def step_time_at(self, shape: StepLoad, clock: float, work: Optional[StepWork] = None) -> float:
        """The step with the SM clock at `clock` (0 < clock <= 1) of its maximum: compute-bound
        terms stretch by 1/clock, memory-bound ones keep their time (HBM runs on its own clock),
        and so do the all-reduces, the launch overhead and the KV copies. At 1.0 this is the
        step_time every other study uses, to the last bit."""
        if shape.num_tokens == 0:
            return self.kv_ops_time(shape) + self.save_time(shape)
        lin_c, lin_m, att_c, att_m, comm, overhead = work if work is not None else self.work(shape)
        t_linear = max(lin_c / clock, lin_m)
        t_attn = max(att_c / clock, att_m)
        compute = t_linear + t_attn + comm + overhead
        return self.with_saves(compute, shape) + self.kv_ops_time(shape)


ATTENTION_FEATURES = ("num_sampled", "decode_context", "prefill_attention")


def choose_knots(token_counts: list[int], spacing: float = 1.25, keep: Iterable[int] = ()) -> list[int]:
    """Knots for the per-step token count: the measured counts, thinned so that each is at
    least `spacing` times the previous one, plus every count in `keep` that was measured.

    A step's cost is not linear in its token count on a CPU (small GEMMs run far below peak:
    8 decodes can cost 2.5x one decode), so the linear-layer part of the model is piecewise
    linear between these knots. Each knot is a measured count, so each has data on it. `keep`
    holds the counts on either side of a jump the engine makes (a kernel it switches at a row
    count), which thinning would otherwise smooth over."""
    measured = sorted(set(max(1, t) for t in token_counts))
    kept = set(keep) & set(measured)
    knots: list[int] = []
    for t in measured:
        if not knots or t >= spacing * knots[-1] or t in kept:
            knots.append(t)
    return knots


def _hats(t: int, knots: Sequence[int]) -> list[float]:
    """Hat-function weights of `t` over `knots` (linear interpolation, linear extrapolation past
    the ends)."""
    hats = [0.0] * len(knots)
    if len(knots) == 1:
        hats[0] = t / knots[0]
    else:
        i = 0
        while i < len(knots) - 2 and t > knots[i + 1]:
            i += 1
        lo, hi = knots[i], knots[i + 1]
        w = (hi - t) / (hi - lo)
        hats[i], hats[i + 1] = w, 1.0 - w
    return hats


def is_decode_only(shape: StepLoad) -> bool:
    return shape.num_decodes == shape.num_tokens > 0


def features(shape: StepLoad, knots: Sequence[int], decode_knots: Sequence[int] = ()) -> list[float]:
    """Hat-function weights of the token count over `knots`, then over `decode_knots` (a
    decode-only step is priced on its own curve when there is one: the engine may run it another
    way, as one native call per step), then the attention and LM-head terms."""
    t = shape.num_tokens
    if decode_knots and is_decode_only(shape):
        return [0.0] * len(knots) + _hats(t, decode_knots) + [shape.num_sampled, shape.decode_context,
                                                               shape.prefill_attention]
    return _hats(t, knots) + [0.0] * len(decode_knots) + [shape.num_sampled, shape.decode_context,
                                                          shape.prefill_attention]


@dataclass
class Profile:
    """A measured step-time model of one engine on one machine (`sloserve profile`)."""

    model: str
    machine: str
    dtype: str
    num_threads: int
    # Step time at each knot, then at each decode knot, then seconds per unit of each
    # ATTENTION_FEATURES entry.
    coefficients: list[float]
    samples: list[dict]  # the measured grid: shape fields + "seconds"
    knots: list[int] = field(default_factory=list)  # token counts of the piecewise-linear part
    fit_error: Optional[float] = None  # mean relative error of the fit over the samples
    # Token counts of decode-only steps' own piecewise-linear part (empty: they share `knots`).
    decode_knots: list[int] = field(default_factory=list)
    # Row counts at which the engine changes how it runs a step (engine/llm_engine.py
    # `cost_jumps`): the grid measured either side of each.
    jumps: list[int] = field(default_factory=list)
    # What the engine computed in: compute dtype, weights, KV cache ("bfloat16, int4 weights, KV
    # bfloat16"); a profile prices only the precision it was measured at.
    precision: str = ""
    # Seconds a served step spends outside the model runner (scheduling, output processing),
    # added to every step's price.
    step_overhead_s: float = 0.0

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=1))

    @staticmethod
    def load(path: str | Path) -> "Profile":
        try:
            data = json.loads(Path(path).read_text())
            profile = Profile(**data)
        except FileNotFoundError:
            raise
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a sloserve profile ({e})") from None
        want = len(profile.knots) + len(profile.decode_knots) + len(ATTENTION_FEATURES)
        if not profile.knots or len(profile.coefficients) != want:
            raise ValueError(f"{path}: expected knots and {want} coefficients, got {len(profile.coefficients)}")
        return profile


class ProfiledCostModel(CostModel):
    """Fitted to measured steps of the real engine: piecewise linear in the step's token count,
    linear in attention work and sampled rows."""

    def __init__(self, profile: Profile, swap_s_per_block: float = 0.0):
        """`swap_s_per_block`: one-way copy time of a block (a profile does not time swaps)."""
        self.profile = profile
        self.coefficients = list(profile.coefficients)
        self.knots = list(profile.knots)
        self.decode_knots = list(profile.decode_knots)
        self.step_overhead_s = profile.step_overhead_s
        self.swap_s_per_block = swap_s_per_block

    def swap_time(self, num_blocks: int) -> float:
        return num_blocks * self.swap_s_per_block

    def step_time(self, shape: StepLoad) -> float:
        if shape.num_tokens == 0:
            return self.kv_ops_time(shape) + self.save_time(shape)
        t = sum(c * f for c, f in zip(self.coefficients, features(shape, self.knots, self.decode_knots)))
        return self.with_saves(max(t, 0.0) + self.step_overhead_s, shape) + self.kv_ops_time(shape)


def fit_nonnegative(rows: list[list[float]], targets: list[float], iterations: int = 2000) -> list[float]:
    """Least squares with coefficients >= 0 (a negative cost per token is unphysical).

    Projected coordinate descent on relative error: every sample counts the same whether
    it took 5 ms or 2 s. Small and dependency-free: the grid has tens of rows.
    """
    n = len(rows[0])
    w = [1.0 / max(t, 1e-9) for t in targets]  # relative-error weights
    scaled = [[x * wi for x in r] for r, wi in zip(rows, w)]
    y = [t * wi for t, wi in zip(targets, w)]
    norms = [math.fsum(r[j] ** 2 for r in scaled) for j in range(n)]
    coef = [0.0] * n
    resid = list(y)
    for _ in range(iterations):
        for j in range(n):
            if norms[j] == 0:
                continue
            grad = math.fsum(r[j] * e for r, e in zip(scaled, resid))
            new = max(0.0, coef[j] + grad / norms[j])
            delta = new - coef[j]
            if delta:
                coef[j] = new
                resid = [e - delta * r[j] for e, r in zip(resid, scaled)]
    return coef
