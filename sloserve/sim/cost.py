"""Step-time models: how long would the real engine take to execute a StepPlan?

Both models see a step only through its StepShape (the few numbers that decide its cost), so
a simulated instance can also price steps it never materialises as plans (fast-forwarded
decode runs).
"""
from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

from sloserve.config import ModelConfig
from sloserve.sched.plan import StepPlan
from sloserve.sim.hardware import HardwareSpec


@dataclass(frozen=True)
class StepShape:
    num_tokens: int  # new tokens computed (prefill chunks + decodes)
    num_sampled: int  # rows that go through the LM head
    num_decodes: int
    decode_context: int  # sum over decodes of the tokens each attends to
    prefill_attention: float  # sum over prefill chunks of n * (start + (n + 1) / 2): attended (query, key) pairs
    prefill_context: int  # sum over prefill chunks of start + n: KV the chunks read

    @staticmethod
    def from_plan(plan: StepPlan) -> "StepShape":
        tokens = sampled = decodes = dctx = pctx = 0
        pattn = 0.0
        for s in plan.scheduled:
            n = s.num_new_tokens
            tokens += n
            sampled += s.samples
            if n == 1:
                decodes += 1
                dctx += s.start + 1
            else:
                pattn += n * (s.start + (n + 1) / 2)
                pctx += s.start + n
        return StepShape(tokens, sampled, decodes, dctx, pattn, pctx)

    @staticmethod
    def decode_only(num_decodes: int, decode_context: int) -> "StepShape":
        return StepShape(num_decodes, num_decodes, num_decodes, decode_context, 0.0, 0)


class CostModel(ABC):
    @abstractmethod
    def step_time(self, shape: StepShape) -> float:
        """Seconds the step takes."""

    def plan_time(self, plan: StepPlan) -> float:
        return self.step_time(StepShape.from_plan(plan))


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


class RooflineCostModel(CostModel):
    """max(compute, memory) per phase (linear layers, attention) plus tensor-parallel all-reduces."""

    def __init__(self, hardware: HardwareSpec, model: ModelConfig, tp: int = 1, dtype_bytes: int = 2,
                 efficiency: Efficiency = Efficiency()):
        if tp < 1:
            raise ValueError("tensor parallel degree must be >= 1")
        self.hw, self.model, self.tp, self.dtype_bytes, self.eff = hardware, model, tp, dtype_bytes, efficiency
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

    def step_time(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        m, hw, eff, tp = self.model, self.hw, self.eff, self.tp
        per_token_experts = max(1, m.num_experts_per_token)
        linear_flops = 2.0 * shape.num_tokens * (self.attn_params + per_token_experts * self.expert_params)
        linear_flops += 2.0 * shape.num_sampled * self.head_params
        weight_bytes = (self.attn_params + self._experts_touched(shape.num_tokens) * self.expert_params
                        + self.head_params) * self.dtype_bytes
        t_linear = max(linear_flops / tp / (hw.peak_flops * eff.compute),
                       weight_bytes / tp / (hw.mem_bandwidth * eff.memory))
        pairs = shape.decode_context + shape.prefill_attention
        attn_flops = 4.0 * m.num_layers * m.num_heads * m.head_dim * pairs
        kv_bytes = self.kv_bytes_per_token * (shape.decode_context + shape.prefill_context + shape.num_tokens)
        t_attn = max(attn_flops / tp / (hw.peak_flops * eff.attention), kv_bytes / tp / (hw.mem_bandwidth * eff.memory))
        t_comm = 0.0
        if tp > 1:  # two all-reduces of the hidden states per layer (ring: 2(tp-1)/tp of the data)
            data = shape.num_tokens * m.hidden_size * self.dtype_bytes * 2 * (tp - 1) / tp
            per = data / (hw.interconnect_bandwidth * eff.interconnect) + eff.allreduce_latency_s
            t_comm = 2 * m.num_layers * per
        return t_linear + t_attn + t_comm + eff.step_overhead_s


FEATURES = ("const", "num_tokens", "num_sampled", "num_decodes", "decode_context", "prefill_attention")


def features(shape: StepShape) -> list[float]:
    return [1.0, shape.num_tokens, shape.num_sampled, shape.num_decodes, shape.decode_context, shape.prefill_attention]


@dataclass
class Profile:
    """A measured step-time model of one engine on one machine (`sloserve profile`)."""

    model: str
    machine: str
    dtype: str
    num_threads: int
    coefficients: list[float]  # seconds per unit of each FEATURES entry
    samples: list[dict]  # the measured grid: shape fields + "seconds"
    fit_error: Optional[float] = None  # mean relative error of the fit over the samples

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
        if len(profile.coefficients) != len(FEATURES):
            raise ValueError(f"{path}: expected {len(FEATURES)} coefficients, got {len(profile.coefficients)}")
        return profile


class ProfiledCostModel(CostModel):
    """A linear model over step features, fitted to measured steps of the real engine."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self.coefficients = list(profile.coefficients)

    def step_time(self, shape: StepShape) -> float:
        if shape.num_tokens == 0:
            return 0.0
        return sum(c * f for c, f in zip(self.coefficients, features(shape)))


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
