"""Configuration shared by every layer: model shape, KV cache, scheduler, engine.

Pure dataclasses (no torch) so the simulator and the cluster layer can read a model's
shape and an instance's limits without loading anything.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

PREEMPTION_VICTIMS = ("slack", "rank")  # sched/rotation.py; the first is the default


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2)."""

    architecture: str  # "llama", "mistral" or "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q/k/v projections
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: Optional[int] = None
    num_experts: int = 0  # MoE: experts per layer (0 = dense MLP)
    num_experts_per_token: int = 0  # MoE: experts each token is routed to
    name: str = ""

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def num_active_params(self) -> int:
        """Parameters one token touches (MoE: only its routed experts)."""
        if not self.num_experts:
            return self.num_params
        idle = self.num_experts - self.num_experts_per_token
        return self.num_params - self.num_layers * idle * 3 * self.hidden_size * self.intermediate_size

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        experts = max(1, self.num_experts)
        per_layer = h * (q + 2 * kv) + q * h + experts * 3 * h * i + 2 * h + (h * self.num_experts)
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * per_layer + h + head


KV_DTYPES = ("auto", "float32", "bfloat16", "int8")  # what a KV cache may store (CacheConfig.kv_dtype)
# How a clean stop ranks the blocks it writes to the disk tier (CacheConfig.tier_flush_order; kv/tiers.py)
KV_FLUSH_ORDERS = ("most-reused", "newest", "off")


@dataclass
class CacheConfig:
    """The paged KV pool. Size it by blocks or by GiB; one of them decides."""

    block_size: int = 16
    num_blocks: Optional[int] = None
    kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True
    # Keep this share of blocks free when admitting a new request, so a burst of
    # admissions does not force the running decodes straight into preemption.
    watermark: float = 0.01
    # The host-memory tier that preempted requests swap to (used only when the scheduler's
    # preemption_mode is "swap" or "auto"). Sized per device as vLLM's --swap-space; or by blocks.
    swap_space_gib: float = 4.0
    num_host_blocks: Optional[int] = None
    # Lower tiers of the prefix cache (kv/tiers.py): full blocks evicted from the device pool
    # are written through to each, and a prefix found there is loaded back when that costs
    # less than recomputing it. Host memory; a bounded directory on local disk that survives
    # a restart; a shared store every instance reaches (a Valkey/Redis URL).
    # What the KV cache stores: "auto" (the compute dtype), "float32", "bfloat16", or "int8"
    # (per-token, per-head absmax scales; dequantized inside attention).
    kv_dtype: str = "auto"
    host_tier_gib: float = 0.0
    disk_tier_dir: Optional[str] = None  # the engine's disk tier (the simulator needs only its size)
    disk_tier_gib: float = 0.0
    kv_store_url: Optional[str] = None
    # With host and disk tiers: the disk gets what the host tier evicts (write-back), or every
    # evicted device block at once (False: write-through).
    tier_write_back: bool = True
    # A clean stop writes what only host memory and the device hold to the disk tier, within the
    # stop's time budget, in this order (KV_FLUSH_ORDERS; see kv/tiers.py).
    tier_flush_order: str = "most-reused"

    def validate(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.num_blocks is None and self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be positive, got {self.kv_cache_gib}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.swap_space_gib < 0:
            raise ValueError(f"swap_space_gib must be >= 0, got {self.swap_space_gib}")
        if self.num_host_blocks is not None and self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {self.num_host_blocks}")
        if self.host_tier_gib < 0 or self.disk_tier_gib < 0:
            raise ValueError("--kv-host-gib and --kv-disk-gib must be >= 0")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"--kv-dtype must be auto, float32, bfloat16 or int8, got {self.kv_dtype!r}")
        if self.disk_tier_dir and not self.disk_tier_gib > 0:
            raise ValueError("--kv-disk-dir needs --kv-disk-gib > 0")
        if self.tier_flush_order not in KV_FLUSH_ORDERS:
            raise ValueError(f"--kv-flush-order must be one of {', '.join(KV_FLUSH_ORDERS)}, "
                             f"got {self.tier_flush_order!r}")
        if (self.host_tier_gib > 0 or self.disk_tier_dir or self.kv_store_url) and not self.enable_prefix_caching:
            raise ValueError("KV tiers hold the prefix cache: they need prefix caching on")

    def host_blocks(self, bytes_per_block: float) -> int:
        """Blocks of the host swap tier: `num_host_blocks`, else what `swap_space_gib` holds."""
        if self.num_host_blocks is not None:
            return self.num_host_blocks
        return int(self.swap_space_gib * 2**30 // bytes_per_block) if bytes_per_block > 0 else 0


@dataclass
class SchedulerConfig:
    """Limits of one step; the policy decides order within them."""

    max_num_batched_tokens: int = 512  # the per-step token budget (prefill chunks + decodes)
    max_num_seqs: int = 64  # requests running at once
    enable_chunked_prefill: bool = True
    # A single prefill chunk never exceeds this, so one long prompt cannot take the whole
    # budget from other waiting prompts. 0 means "up to the budget".
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    # How a preempted request gives back its blocks: "recompute" (drop the KV, re-run the
    # prefill later), "swap" (copy the KV to the host tier and back), or "auto" (per victim,
    # whichever the cost estimates say is cheaper).
    preemption_mode: str = "recompute"
    # Which running request is preempted when blocks run short: "slack" (the one with the most
    # SLO slack, which then sits out half of it: sched/rotation.py) or "rank" (the lowest-ranked
    # in policy order, vLLM's rule). Without SLO targets every request has infinite slack and
    # the two pick the same victim.
    preemption_victim: str = PREEMPTION_VICTIMS[0]
    # Size each step's prefill tokens from the TBT slack of the running decodes; None = the
    # policy's default (on for `slo`). Needs a step-cost estimator.
    dynamic_chunking: Optional[bool] = None
    # Dynamic chunking never shrinks a step's prefill below this, so prefills keep moving.
    min_prefill_chunk: int = 32
    # Speculative decoding without a draft model: "off" or a proposer name ("prompt-lookup").
    # The scheduler attaches drafts per step only when its cost estimate says they pay and the
    # TBT slack allows (sched/speculation.py); greedy requests without logprobs only.
    speculative: str = "off"
    num_speculative_tokens: int = 4  # drafts per request and step, at most
    speculative_max_batch: int = 8  # no drafts in steps with more decodes than this

    def validate(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.preemption_victim not in PREEMPTION_VICTIMS:
            raise ValueError(f"preemption_victim must be rank or slack, got {self.preemption_victim!r}")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption_mode must be recompute, swap or auto, got {self.preemption_mode!r}")
        if self.min_prefill_chunk < 1:
            raise ValueError("min_prefill_chunk must be >= 1")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if self.speculative_max_batch < 1:
            raise ValueError("speculative_max_batch must be >= 1")


@dataclass
class EngineConfig:
    """Everything an instance needs; `model=None` means the embedded SmolLM2-135M."""

    model: Optional[str] = None
    dtype: str = "auto"  # "float32", "bfloat16" or "auto" (bfloat16 on CUDA; on a CPU the faster, measured)
    device: str = "auto"  # "cpu", "cuda" or "auto"
    # Quantization of the linears: "none", "int8", "int4", or "auto" (the model file's own class:
    # int4 for a 4-bit GGUF, int8 for an 8-bit one, none for float weights): weights only; or "w8a8":
    # the layers' int8 weights times int8 activations (per token), the head dense (engine/quant.W8A8Linear).
    quantization: str = "auto"
    # Keep a dense copy of quantized linears for steps with more rows than the packed kernels
    # win at (measured per machine); False = least memory, every step on the packed kernels.
    quantized_dense_copy: bool = True
    # The int8 LM head of a quantized model also quantizes its activations (int8 per 32-element
    # block) and runs integer dot products, where the native kernel builds (AVX2): 2.4-2.6x faster at
    # one row on a Zen3 EPYC; False = bf16 activations (torch's weight-only kernel).
    head_w8a8: bool = True
    # The int4 layers do the same (W4A8: the file's 4-bit codes times int8 activations, as llama.cpp's
    # Q4 x Q8 products), where the native kernel builds (AVX2). False = bf16 activations (torch's
    # weight-only kernel). int8 layers keep bf16 activations (with int8 ones they left the int8 tolerance).
    layers_a8: bool = True
    num_threads: Optional[int] = None  # torch intra-op threads; None = OMP_NUM_THREADS, else the cores this process may use
    max_model_len: Optional[int] = None  # defaults to the model's context window
    seed: int = 0
    # Compiled CPU kernels (decode attention, fused norms/RoPE/SiLU; falls back if it cannot build)
    # and bf16 weights prepacked for oneDNN where the probe measures it faster. False = portable path.
    native_kernels: bool = True
    # Which native path runs bf16 attention: "auto" (the fastest this CPU offers: AMX tiles, then
    # AVX512-BF16 dot products, then the portable loops), or one of those by name ("amx",
    # "avx512_bf16", "portable"), for comparisons; other cache dtypes always take the portable path.
    attention_kernel: str = "auto"
    step_trace: Optional[str] = None  # write one JSON line per engine step to this file (engine/step_trace.py)
    # LoRA adapters served from the start, as (name, PEFT directory) pairs (engine/lora.py); more load at run time.
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 4  # adapters kept in the compute device's form (least recently used out first)
    max_lora_rank: int = 64  # the largest rank an adapter may have
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


ATTENTION_KERNELS = ("auto", "amx", "avx512_bf16", "portable")


@dataclass(frozen=True)
class PoolSettings:
    """What one pool of a prefill/decode-disaggregated fleet changes from the fleet's settings
    (None = keep): prefill pools usually want a big token budget and few sequences, decode
    pools the opposite, and (in the simulator) either may use another tensor-parallel degree."""

    tp: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None  # "budget"
    max_num_seqs: Optional[int] = None  # "seqs"
    long_prefill_token_threshold: Optional[int] = None  # "chunk": the largest prefill chunk

    KEYS = {"tp": "tp", "budget": "max_num_batched_tokens", "seqs": "max_num_seqs",
            "chunk": "long_prefill_token_threshold"}

    @classmethod
    def parse(cls, text: str) -> "PoolSettings":
        """`tp=2,budget=8192,seqs=16,chunk=2048` (any subset)."""
        values = {}
        for item in filter(None, (x.strip() for x in text.split(","))):
            key, _, value = item.partition("=")
            if key not in cls.KEYS or not value.isdigit() or int(value) < 1:
                raise ValueError(f"pool setting {item!r}: use {', '.join(cls.KEYS)} = a positive integer")
            values[cls.KEYS[key]] = int(value)
        return cls(**values)

    def apply(self, scheduler: SchedulerConfig) -> SchedulerConfig:
        """`scheduler` with this pool's budget, sequence cap and chunk size."""
        changes = {k: getattr(self, k) for k in ("max_num_batched_tokens", "max_num_seqs",
                                                 "long_prefill_token_threshold") if getattr(self, k) is not None}
        return replace(scheduler, **changes) if changes else scheduler


def parse_instance_range(text: str) -> tuple[int, int]:
    """`--instances N` or `MIN:MAX` -> (min, max)."""
    try:
        if ":" in str(text):
            low, high = (int(x) for x in str(text).split(":"))
        else:
            low = high = int(text)
    except ValueError:
        raise ValueError(f"--instances takes N or MIN:MAX, got {text!r}") from None
    if high < 1 or low < 0 or low > high:
        raise ValueError(f"--instances needs 0 <= MIN <= MAX and MAX >= 1, got {text!r}")
    return low, high
