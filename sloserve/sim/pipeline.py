"""Pipeline-parallel instances: `pp` stages of `tp` GPUs each, every stage running a contiguous
block of layers (sloserve/stage_layout.py), the last one also the LM head and sampling.

A step's batch is cut into m = min(pp, sequences) micro-batches that follow each other through
the stages, so each stage sees every micro-batch once per step and the step takes
max(sum of the stages' times, m x the slowest stage's) for one micro-batch: the pipeline is as
fast as its slowest stage once it is full, and a lone sequence crosses the stages one after the
other. Each micro-batch reads its stage's weights again (what pipeline parallelism costs in decode).
A stage's time is its share of the roofline (sim/cost.py) per layer, plus the LM head (compute
for the sampled rows, its weights read per micro-batch) and sampling (the fp32 logits written
once and read for softmax and sampling) on the last stage, plus sending the hidden states on
for the others.

The partition is a stage policy's (cluster/stages, given by the fleet builder: sim/ never imports
cluster/): it picks one at the start from a profiled decode step and may change it at the end
of each window from the stages' times over that window; moving layers stalls the instance while
their weights cross `stage_link_bytes_s` (the boundaries move in parallel).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

from sloserve.core.config import ModelConfig
from sloserve.sched.costs import StepLoad
from sloserve.sched.plan import StepPlan
from sloserve.sim.cost import Efficiency, RooflineCostModel
from sloserve.sim.hardware import HardwareSpec
from sloserve.stage_layout import Partition, StageLoad, layers_moved

LOGIT_PASSES = 3  # fp32 logits: written by the head, read by softmax, read by the sampler
REFERENCE_DECODE_BATCH = 64  # the profiled step the static policies balance for
REFERENCE_DECODE_CONTEXT = 1024


class StagePolicyLike(Protocol):
    window_s: float

    def initial(self, layers: int, stages: int, reference: StageLoad) -> Partition: ...

    def decide(self, partition: Partition, load: StageLoad,
               move_s: Callable[[Partition], float]) -> Optional[Partition]: ...


@dataclass
class StageBooks:
    """What the partition did over a run: its changes, their cost, and how unbalanced the stages
    were window by window (slowest stage over the mean, under the partition in force)."""

    partitions: list[tuple[float, Partition]] = field(default_factory=list)
    moves: int = 0
    layers_moved: int = 0
    stall_s: float = 0.0
    windows: list[tuple[float, float]] = field(default_factory=list)  # (window end, imbalance)

    def as_dict(self) -> dict:
        imb = [x for _, x in self.windows]
        return {"partitions": [[t, list(p)] for t, p in self.partitions], "moves": self.moves,
                "layers_moved": self.layers_moved, "stall_s": self.stall_s,
                "mean_imbalance": sum(imb) / len(imb) if imb else 1.0, "windows": self.windows}


class PipelineCostModel(RooflineCostModel):
    prices_stages = True

    def __init__(self, hardware: HardwareSpec, model: ModelConfig, tp: int, pp: int, policy: StagePolicyLike,
                 stage_link_bytes_s: float, dtype_bytes: int = 2, efficiency: Efficiency = Efficiency(),
                 block_size: int = 16):
        super().__init__(hardware, model, tp, dtype_bytes, efficiency, block_size)
        if not 1 <= pp <= model.num_layers:
            raise ValueError(f"--pp must be between 1 and the model's {model.num_layers} layers, got {pp}")
        self.pp, self.policy, self.link = pp, policy, stage_link_bytes_s
        self.layer_weight_bytes = (self.attn_params + self.expert_params * max(1, model.num_experts)) \
            / model.num_layers * dtype_bytes
        self.partition = policy.initial(model.num_layers, pp, self.micro_load(
            StepLoad.decodes(REFERENCE_DECODE_BATCH, REFERENCE_DECODE_BATCH * REFERENCE_DECODE_CONTEXT))[0])
        self.books = StageBooks(partitions=[(0.0, self.partition)])
        self._window = StageLoad(0.0, 0.0, 0.0)
        self._window_end = policy.window_s
        self._pending_stall = 0.0
        self._now = 0.0
        self._run: Optional[tuple[list[float], StageLoad]] = None  # step ends, stage work per step

    def weight_bytes(self) -> float:
        """Device memory the weights take on one GPU (each stage holds its layers' share)."""
        return self.model.num_params * self.dtype_bytes / (self.tp * self.pp)

    def swap_time(self, num_blocks: int) -> float:
        """Every stage moves its layers' share of the blocks over its own host links."""
        return super().swap_time(num_blocks) / self.pp

    def micro_load(self, shape: StepLoad) -> tuple[StageLoad, int]:
        """(one micro-batch's stage load, micro-batches) for the step."""
        m = max(1, min(self.pp, max(shape.num_sampled, shape.num_decodes + (shape.num_tokens > shape.num_decodes))))
        model, hw, eff, tp = self.model, self.hw, self.eff, self.tp
        tokens, sampled = shape.num_tokens / m, shape.num_sampled / m
        per_token_experts = max(1, model.num_experts_per_token)
        flops = 2.0 * tokens * (self.attn_params + per_token_experts * self.expert_params) / model.num_layers
        weights = (self.attn_params + self._experts_touched(max(1, round(tokens))) * self.expert_params) \
            / model.num_layers * self.dtype_bytes
        linear = max(flops / tp / (hw.peak_flops * eff.compute), weights / tp / (hw.mem_bandwidth * eff.memory))
        attention = self._attention_time((shape.decode_context + shape.prefill_attention) / m,
                                         (shape.decode_context + shape.prefill_context + shape.num_tokens) / m)
        comm = 0.0
        if tp > 1:
            data = tokens * model.hidden_size * self.dtype_bytes * 2 * (tp - 1) / tp
            comm = 2 * (data / (hw.interconnect_bandwidth * eff.interconnect) + eff.allreduce_latency_s)
        layer = linear + attention / model.num_layers + comm
        head = max(2.0 * sampled * self.head_params / tp / (hw.peak_flops * eff.compute),
                   self.head_params * self.dtype_bytes / tp / (hw.mem_bandwidth * eff.memory))
        head += LOGIT_PASSES * sampled * model.vocab_size * 4 / tp / (hw.mem_bandwidth * eff.memory)
        send = tokens * model.hidden_size * self.dtype_bytes / (self.link * eff.interconnect)
        return StageLoad(layer, head, send), m

    def _cycle(self, shape: StepLoad) -> tuple[float, StageLoad]:
        """(the step's compute seconds, the stage work it adds to the window)."""
        load, m = self.micro_load(shape)
        times = load.stage_times(self.partition)
        compute = max(sum(times), m * max(times)) + self.eff.step_overhead_s
        return compute, StageLoad(load.layer_s * m, load.head_s * m, load.send_s * m)

    def step_time(self, shape: StepLoad) -> float:
        if shape.num_tokens == 0:
            return self.kv_ops_time(shape) + self.save_time(shape)
        return self.with_saves(self._cycle(shape)[0], shape) + self.kv_ops_time(shape)

    def step_time_at(self, shape: StepLoad, clock: float, work=None) -> float:
        if clock != 1.0:
            raise ValueError("clock policies are not modelled for pipeline-parallel instances")
        return self.step_time(shape)

    def plan_time(self, plan: StepPlan) -> float:
        """A step the instance runs (estimates go through step_time and count for nothing)."""
        shape = StepLoad.of_plan(plan)
        stall, self._pending_stall = self._pending_stall, 0.0
        if shape.num_tokens == 0:
            return self.step_time(shape) + stall
        compute, work = self._cycle(shape)
        self._window = self._window + work
        return self.with_saves(compute, shape) + self.kv_ops_time(shape) + stall

    def observe(self, shape: StepLoad) -> None:
        """A step that ran: its stage work counts toward the window."""
        if shape.num_tokens:
            self._window = self._window + self._cycle(shape)[1]

    def decode_run(self, num_decodes: int, context: int, steps: int) -> list[float]:
        n = num_decodes
        cycles = [self._cycle(StepLoad.decodes(n, context + i * n)) for i in range(1, steps + 1)]
        out = [compute for compute, _ in cycles]
        if out:
            out[0] += self._pending_stall
            self._pending_stall = 0.0
            ends, t = [], self._now
            for d in out:
                t += d
                ends.append(t)
            self._run = (ends, cycles[0][1])  # a run's steps differ only in attention: its first prices the window
        return out

    def advance(self, now: float) -> None:
        """Count the steps of the last decode run that ended by `now` (a run cut short by an
        arrival ran only those), then close every window that ended."""
        self._now = now
        if self._run is not None:
            ends, work = self._run
            done = sum(1 for e in ends if e <= now + 1e-12)
            self._window = self._window + StageLoad(work.layer_s * done, work.head_s * done, work.send_s * done)
            self._run = None
        while now >= self._window_end:
            self._close_window(self._window_end)
            self._window_end += self.policy.window_s

    def move_time(self, partition: Partition) -> float:
        moved = layers_moved(self.partition, partition)
        return max(moved, default=0) * self.layer_weight_bytes / self.tp / self.link

    def _close_window(self, end: float) -> None:
        load, self._window = self._window, StageLoad(0.0, 0.0, 0.0)
        if load.layer_s <= 0:
            return
        self.books.windows.append((end, load.imbalance(self.partition)))
        new = self.policy.decide(self.partition, load, self.move_time)
        if new is None or new == self.partition:
            return
        stall = self.move_time(new)
        self.books.moves += 1
        self.books.layers_moved += sum(layers_moved(self.partition, new))
        self.books.stall_s += stall
        self._pending_stall += stall
        self.partition = new
        self.books.partitions.append((end, new))
