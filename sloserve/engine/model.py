"""The Llama-family decoder forward over a paged KV cache.

One forward computes a mixed batch: decodes (one new token each, attending to their
cached context) and prefill chunks (several new tokens, attending to their cached prefix
and causally to each other). Tokens are laid out flat, decodes first. Logits are computed
only at the positions that sample: the tied LM head alone costs as much as several layers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from sloserve.core.config import ModelConfig
from sloserve.engine.lora import LoraBatch
from sloserve.engine.quant import (DenseLinear, GroupAffine4, Int4Linear, Int8Linear, Linear, RowDispatchLinear,
                                   W8A8Linear, as_dtype, can_prepack, head_kind, int8_activation_kernels, int8_linear,
                                   takes_int8_activations)


@dataclass
class PrefillSpan:
    """One prefill chunk inside the flat token batch."""

    token_start: int  # index of its first token in the flat batch
    num_tokens: int
    start_pos: int  # tokens of this sequence already in the cache
    context_blocks: Optional[torch.Tensor]  # block ids covering all start_pos + num_tokens positions; None if start_pos == 0


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V is written
    num_decodes: int  # the first num_decodes tokens are decodes
    decode_blocks: Optional[torch.Tensor]  # [D, W] long: each decode's block table, padded to W blocks
    decode_mask: Optional[torch.Tensor]  # [D, 1, 1, W * block_size] additive mask (0 or -inf)
    decode_context_lens: Optional[torch.Tensor]  # [D] long: tokens each decode attends to
    prefills: list[PrefillSpan]
    sample_indices: torch.Tensor  # [S] long: flat token indices whose logits are wanted
    # [P, W] long: every prefill span's block table (the native prefill kernel reads K/V from the cache)
    prefill_tables: Optional[torch.Tensor] = None
    lora: Optional[LoraBatch] = None  # the adapters of this step's requests and their rows (engine/lora.py)


_SCALE_BYTES = 4  # an int8 slot's float32 scale, stored in the slot's own bytes


class KVCache:
    """K and V for every layer, as flat slot arrays: slot = block_id * block_size + offset.

    With `quantized` (the int8 cache) every slot holds a head's int8 values followed by its
    float32 scale (symmetric, absmax / 127, one per token and head), as raw bytes in one int8
    tensor: every byte mover (swap, tiers, migration, copy-on-write) moves blocks of `data` and
    needs no second tensor. The scale is per token, not per block: blocks fill one decode token
    at a time, so a block-wide scale would have to be fixed before the block's later tokens
    exist. Reads dequantize inside attention, block by block as they are gathered.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 kv_dtype: Optional[torch.dtype] = None):
        """`dtype`: what attention computes in; `kv_dtype`: what the cache stores (default the same;
        torch.int8 for the quantized cache, or another float type, cast on write and read)."""
        hd = config.head_dim
        self.head_dim = hd
        self.compute_dtype = dtype
        self.storage_dtype = kv_dtype or dtype
        self.quantized = self.storage_dtype == torch.int8
        width = hd + _SCALE_BYTES if self.quantized else hd
        shape = (config.num_layers, 2, num_blocks * block_size, config.num_kv_heads, width)
        self.data = torch.zeros(shape, dtype=self.storage_dtype, device=device)
        # each layer's K and V caches as views, made once: indexing `data` costs ~2.5 us a time,
        # four times a layer in a decode step
        self.layers = [(self.data[i, 0], self.data[i, 1]) for i in range(config.num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks

    @property
    def native(self) -> bool:
        """The cache holds exactly what attention computes with (the fused decode kernel reads it as is)."""
        return self.storage_dtype == self.compute_dtype

    @staticmethod
    def bytes_per_token(config: ModelConfig, kv_dtype: torch.dtype) -> int:
        """Bytes one token's K and V take in every layer, stored as `kv_dtype`."""
        per_head = (config.head_dim + _SCALE_BYTES if kv_dtype == torch.int8
                    else config.head_dim * torch.finfo(kv_dtype).bits // 8)
        return 2 * config.num_layers * config.num_kv_heads * per_head

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fused=None) -> None:
        """Store the new tokens' K and V [T, kv_heads, head_dim] at `slots`; `fused`: the native
        kernels, whose row copy replaces two index_copy_ calls when no conversion is needed."""
        k_cache, v_cache = self.layers[layer]
        if self.quantized:
            k_cache.index_copy_(0, slots, quantize_int8(k))
            v_cache.index_copy_(0, slots, quantize_int8(v))
        elif fused is not None and k.dtype == self.storage_dtype and k.device.type == "cpu":
            fused.write_kv_(k_cache, v_cache, slots, k, v)
        else:
            k_cache.index_copy_(0, slots, as_dtype(k, self.storage_dtype))
            v_cache.index_copy_(0, slots, as_dtype(v, self.storage_dtype))

    def gather(self, layer: int, kind: int, block_ids: torch.Tensor) -> torch.Tensor:
        """K (kind 0) or V (kind 1) of whole blocks, [*block_ids.shape[:-1], W * block_size, kv_heads, head_dim],
        in the compute dtype.

        Gathering whole blocks (one contiguous row each) instead of single slots makes this a
        memcpy-speed copy; slot-wise advanced indexing was the slowest op of a decode step.
        """
        flat = self.layers[layer][kind].view(self.num_blocks, -1)
        rows = flat.index_select(0, block_ids.reshape(-1))
        rows = rows.view(*block_ids.shape[:-1], block_ids.shape[-1] * self.block_size, *self.data.shape[-2:])
        if self.quantized:
            return dequantize_int8(rows, self.head_dim, self.compute_dtype)
        return rows if self.native else rows.to(self.compute_dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write)."""
        if not pairs:
            return
        bs = self.block_size
        offsets = torch.arange(bs, device=self.data.device)
        src = torch.cat([s * bs + offsets for s, _ in pairs])
        dst = torch.cat([d * bs + offsets for _, d in pairs])
        self.data[:, :, dst] = self.data[:, :, src]


def quantize_int8(x: torch.Tensor) -> torch.Tensor:
    """[..., hd] floats -> [..., hd + 4] int8: symmetric per-row values, then the row's float32 scale's bytes."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127.0
    q = torch.round(xf / scale).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_int8(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize_int8 (up to rounding), in `dtype`."""
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies, with Llama-3 style or linear scaling when configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def head_weight_name(config: ModelConfig, weights: dict) -> str:
    """The weight the LM head computes with: the embedding table when tied (or no head is stored)."""
    tied = config.tie_word_embeddings or "lm_head.weight" not in weights
    return "model.embed_tokens.weight" if tied else "lm_head.weight"


def lm_head_kind(config: ModelConfig, weights: dict, quantization: str, a8_ops, head_w8a8: bool) -> str:
    """How the LM head is stored (quant.head_kind): a file's 4-bit head stays 4-bit where the
    W4A8 kernel (`a8_ops`, wanted by `head_w8a8`) reads it."""
    head = weights[head_weight_name(config, weights)]
    return head_kind(quantization, head, head_w8a8 and a8_ops is not None and head.shape[1] % 32 == 0)


class LlamaModel:
    """Weights plus a forward function; no nn.Module bookkeeping is needed for inference."""

    def __init__(self, config: ModelConfig, weights: dict[str, Union[torch.Tensor, GroupAffine4]],
                 device: torch.device, dtype: torch.dtype, decode_attention: Optional[Callable] = None,
                 quantization: str = "none", dense_above: Optional[dict[str, Optional[int]]] = None,
                 fused_ops=None, prepack: bool = False, attention_kernel: str = "auto", head_w8a8: bool = False,
                 layers_a8: bool = False):
        """`quantization` is resolved ("none", "int8", "int4", or "w8a8": int8 activations too, the
        head dense); `dense_above` maps "layers" and "head" to the most rows their packed kernel
        serves before a dense copy takes over (None: no copy; a part absent from it keeps no copy
        either). The LM head is packed as int8 in both weight-only modes: it is the most sensitive
        matrix. `prepack`: dense bf16 weights live in oneDNN's layout (quant.can_prepack).
        `head_w8a8`: that int8 head quantizes its activations too and runs the native W8A8 product
        (kernels' int8_gemv); `layers_a8`: the int4 layers do (int4_gemv); each where `fused_ops`
        has the kernel."""
        self.config = config
        # A native kernel reading K/V in place (see engine/kernels); None = gather + SDPA.
        self.decode_attention = decode_attention
        self.attention_kernel = attention_kernel  # the native path for a bf16 cache (EngineConfig.attention_kernel)
        # A native bf16 prefill path on this CPU (AMX or AVX512-BF16; the portable one is SDPA), until
        # the kernel declines this model's tensors.
        self._native_prefill = fused_ops is not None and hasattr(fused_ops, "attention_kernels") and any(
            k in ("amx", "avx512_bf16") for k in fused_ops.attention_kernels())
        # Native fused RMSNorm(+residual), SiLU-and-mul and in-place RoPE (engine/kernels/elementwise.cpp);
        # None = the portable ATen ops.
        self.fused = fused_ops
        self.device = device
        self.dtype = dtype
        self.quantization = quantization
        dense_above = dense_above or {}

        def w(name: str) -> torch.Tensor:
            value = weights[name]
            if isinstance(value, GroupAffine4):
                value = value.dequantize()
            return value.to(device=device, dtype=dtype)

        prepack = prepack and can_prepack(dtype, device)
        head_name = head_weight_name(config, weights)
        tied = head_name == "model.embed_tokens.weight"

        a8_ops = int8_activation_kernels(fused_ops, device)

        def linear(names: list[str], bias: list[str] = (), kind: str = quantization, keep_weight: bool = False,
                   part: str = "layers", a8: bool = False) -> Linear:
            # Fusing q/k/v and gate/up makes two GEMMs out of five: fewer, larger calls.
            b = torch.cat([w(n) for n in bias]) if bias else None
            max_rows = dense_above.get(part)
            if kind == "none" or max_rows == 0:
                return DenseLinear(torch.cat([w(n) for n in names]), b, prepack, keep_weight)
            # int8 activations come in whole 32-element blocks
            ops = a8_ops if a8 and takes_int8_activations(part, kind) and all(
                weights[n].shape[1] % 32 == 0 for n in names) else None
            if kind == "w8a8":
                packed: Union[Int4Linear, Int8Linear, W8A8Linear] = W8A8Linear(
                    torch.cat([w(n) for n in names]), b, quantize=getattr(fused_ops, "quantize_rows_u8", None))
            elif kind == "int4":
                parts = [v if isinstance(v, GroupAffine4) else GroupAffine4.quantize(v)
                         for v in (weights[n] for n in names)]
                packed = Int4Linear(GroupAffine4.cat(parts), b, w4a8=ops.int4_gemv if ops else None)
            else:
                packed = int8_linear(torch.cat([w(n) for n in names]), b, ops)
            # The dense copy holds the packed form's own weights, so a request computes with the
            # same numbers whichever kernel its step runs.
            dense = None if max_rows is None else DenseLinear(packed.dequantized(dtype).to(device), b, prepack,
                                                              keep_weight)
            if isinstance(packed, (Int4Linear, W8A8Linear)):
                packed.drop_codes()
            return packed if dense is None else RowDispatchLinear(packed, dense, max_rows)

        self.lm_head = linear([head_name], keep_weight=tied, part="head", a8=head_w8a8,
                              kind=lm_head_kind(config, weights, quantization, a8_ops, head_w8a8))
        packed_head = getattr(self.lm_head, "small", self.lm_head)
        self.head_w8a8 = (isinstance(packed_head, Int8Linear) and (packed_head.w8a8 or packed_head.tiled) is not None) \
            or (isinstance(packed_head, Int4Linear) and packed_head.w4a8 is not None)
        dense_head = self.lm_head if isinstance(self.lm_head, DenseLinear) else getattr(self.lm_head, "large", None)
        if not tied:
            self.embed: Optional[torch.Tensor] = w("model.embed_tokens.weight")
        else:  # a tied table shares the head's dense weight, or reads its rows from the int8 codes
            self.embed = dense_head.weight if dense_head is not None else None
        self.norm = w("model.norm.weight")
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            qkv_bias = [p + f"self_attn.{x}_proj.bias" for x in "qkv"] if config.attention_bias else []
            self.layers.append({
                "in_norm": w(p + "input_layernorm.weight"),
                "qkv": linear([p + f"self_attn.{x}_proj.weight" for x in "qkv"], qkv_bias, a8=layers_a8),
                "o": linear([p + "self_attn.o_proj.weight"], a8=layers_a8),
                "post_norm": w(p + "post_attention_layernorm.weight"),
                "gate_up": linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], a8=layers_a8),
                "down": linear([p + "mlp.down_proj.weight"], a8=layers_a8),
            })
        down = getattr(self.layers[0]["down"], "small", self.layers[0]["down"]) if self.layers else None
        self.layers_a8 = getattr(down, "w4a8", None) is not None or getattr(down, "w8a8", None) is not None \
            or isinstance(down, W8A8Linear)
        inv_freq = rope_inv_freq(config).to(device)
        t = torch.arange(config.max_position_embeddings, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        # A decode-only step through every layer in one native call (kernels/decode_stack.cpp), where
        # every layer runs the kernels it chains; None = the Python loop for every step.
        self.decode_stack, self._stack_rows = self._build_decode_stack(fused_ops, device)
        self._stack_cache: Optional[KVCache] = None  # the cache bound to it (it holds the tensors too)

    def _build_decode_stack(self, fused_ops, device: torch.device):
        """The native whole-stack decode and the most rows its 4-bit products take (the dense
        copies take more), or (None, 0) unless every layer is W4A8 4-bit linears without bias."""
        if device.type != "cpu" or not hasattr(fused_ops, "DecodeStack") or self.decode_attention is None \
                or not self.layers:
            return None, 0
        rows = math.inf
        cfg = self.config
        widths = {"qkv": self.q_size + 2 * self.kv_size, "o": cfg.hidden_size, "gate_up": 2 * cfg.intermediate_size,
                  "down": cfg.hidden_size}
        tiles: dict[str, list[torch.Tensor]] = {name: [] for name in widths}
        for layer in self.layers:
            for name, width in widths.items():
                lin = layer[name]
                if isinstance(lin, RowDispatchLinear):
                    rows = min(rows, lin.max_small_rows)
                    lin = lin.small
                if not (isinstance(lin, Int4Linear) and lin.w4a8 is not None and lin.bias is None
                        and lin.out_features == width):
                    return None, 0
                tiles[name].append(lin.tiles)
        stack = fused_ops.DecodeStack(
            [layer["in_norm"] for layer in self.layers], [layer["post_norm"] for layer in self.layers],
            tiles["qkv"], tiles["o"], tiles["gate_up"], tiles["down"], cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim, cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps, self.scale,
            cfg.sliding_window or 0)
        return stack, rows

    @property
    def cost_jumps(self) -> list[int]:
        """Row counts after which a step runs another way (the dense copies take over from the
        packed kernels, the native decode stack hands over to the layer loop): a step's time may
        jump between r and r + 1 rows. What `sloserve profile` measures either side of."""
        jumps = {lin.max_small_rows for layer in self.layers for lin in layer.values()
                 if isinstance(lin, RowDispatchLinear)}
        if isinstance(self.lm_head, RowDispatchLinear):
            jumps.add(self.lm_head.max_small_rows)
        if self.decode_stack is not None and math.isfinite(self._stack_rows):
            jumps.add(int(self._stack_rows))
        return sorted(j for j in jumps if j >= 1)

    def _stack_takes(self, batch: ForwardBatch, kv_cache: KVCache) -> bool:
        """Whether this step runs as one native call: decodes only, few enough rows for the 4-bit
        kernels, no adapter, a cache attention reads as is (what the Python loop would do natively too)."""
        T = batch.input_ids.shape[0]
        return self.decode_stack is not None and batch.num_decodes == T and T <= self._stack_rows \
            and batch.lora is None and kv_cache.native and not kv_cache.quantized and kv_cache.data.device.type == "cpu"

    def _bind_stack(self, kv_cache: KVCache) -> None:
        """Point the native stack at `kv_cache`'s tensors (once per cache: it keeps them)."""
        if self._stack_cache is not kv_cache:
            self.decode_stack.bind_cache([k for k, _ in kv_cache.layers], [v for _, v in kv_cache.layers],
                                         kv_cache.block_size, self._kernel_for(kv_cache))
            self._stack_cache = kv_cache

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            return F.embedding(ids, self.embed)
        return self.lm_head.rows(ids, self.dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights occupy in the form the forward reads them."""
        linears = [self.lm_head] + [layer[k] for layer in self.layers for k in ("qkv", "o", "gate_up", "down")]
        head = getattr(self.lm_head, "large", self.lm_head)
        shared = self.embed is None or self.embed is getattr(head, "weight", None)  # tied
        dense = [self.norm] + ([] if shared else [self.embed])
        dense += [layer[k] for layer in self.layers for k in ("in_norm", "post_norm")]
        return sum(lin.nbytes for lin in linears) + sum(t.numel() * t.element_size() for t in dense)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel: one op instead of seven (float32: the same numbers as the spelled-out form).
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _prefill_mask(self, span: PrefillSpan) -> Optional[torch.Tensor]:
        """Boolean [n, ctx] mask, or None when SDPA's own causal mask is right.

        SDPA's is_causal is top-left aligned: right only when the chunk starts at position 0.
        With a cached prefix the new tokens sit at the bottom right of the score matrix; with a
        sliding window (Mistral) keys more than window-1 positions back are hidden too.
        """
        window = self.config.sliding_window
        n, start = span.num_tokens, span.start_pos
        if start == 0 and (window is None or n <= window):
            return None
        q_pos = torch.arange(start, start + n, device=self.device).unsqueeze(1)
        k_pos = torch.arange(start + n, device=self.device).unsqueeze(0)
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        return mask

    def takes_prefill_tables(self, kv_cache: KVCache) -> bool:
        """Whether a native prefill kernel may run over this cache: the runner builds the prefill
        spans' block tables only then. False for good once the build declined these tensors."""
        bf16_cache = kv_cache.native and kv_cache.storage_dtype == torch.bfloat16
        int8_cache = kv_cache.quantized and self.dtype == torch.bfloat16  # read through a dequantized copy
        return (self._native_prefill and self.fused is not None and hasattr(self.fused, "prefill_attention")
                and (bf16_cache or int8_cache) and self.attention_kernel != "portable")

    def _prefill_kv(self, li: int, kv_cache: KVCache, tables: torch.Tensor) -> tuple:
        """The K and V caches and block tables the native prefill kernel reads for layer `li`:
        the cache itself, or for an int8 cache the spans' blocks dequantized into a compact bf16
        copy (span i's j-th block at i * W + j). Dequantizing the context once per layer is what
        the SDPA fallback's gather does too; the attention then runs in the native kernel."""
        if not kv_cache.quantized:
            return (*kv_cache.layers[li], tables)
        shape = (-1, *kv_cache.data.shape[-2:-1], kv_cache.head_dim)
        k = kv_cache.gather(li, 0, tables).reshape(shape)
        v = kv_cache.gather(li, 1, tables).reshape(shape)
        return k, v, torch.arange(tables.numel(), dtype=torch.long).view(tables.shape)

    def _kernel_for(self, kv_cache: KVCache) -> str:
        """The configured native path applies to a bf16 cache; any other takes the portable one."""
        return self.attention_kernel if kv_cache.native and kv_cache.storage_dtype == torch.bfloat16 else "auto"

    def reads_decode_mask(self, kv_cache: KVCache) -> bool:
        """Whether decode attention takes the batch's additive mask (gather + SDPA); the native
        kernel masks by context length and needs none."""
        return self.decode_attention is None or not (kv_cache.native or kv_cache.quantized)

    def _decode_attention(self, li: int, q: torch.Tensor, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """[D, nh, hd] attention of the batch's decodes to their cached context."""
        if not self.reads_decode_mask(kv_cache):
            return self.decode_attention(
                q.contiguous(), *kv_cache.layers[li], batch.decode_blocks,
                batch.decode_context_lens, kv_cache.block_size, self.scale, self.config.sliding_window or 0,
                kernel=self._kernel_for(kv_cache),
            )
        # [D, nh, 1, hd] against each decode's gathered context [D, nkv, ctx, hd].
        kd = kv_cache.gather(li, 0, batch.decode_blocks).transpose(1, 2)
        vd = kv_cache.gather(li, 1, batch.decode_blocks).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), kd, vd, attn_mask=batch.decode_mask, scale=self.scale, enable_gqa=True
        )
        return out.squeeze(2)

    def _native_prefill_args(self, batch: ForwardBatch, kv_cache: KVCache):
        """The native prefill kernel's arguments for this batch's spans: their block tables
        [P, W] and their [P, 3] (first row, rows, start position); None when it cannot run (no
        build, a cache neither bf16 nor int8 under a bf16 model: SDPA per span then). One layer, 2,048 tokens in
        ShareGPT-sized chunks (30-367 tokens) against per-chunk SDPA calls: AMX on the 2-vCPU Xeon
        2.48 against 4.12 ms; AVX512-BF16 on the 2-vCPU EPYC (Zen4) 3.2-4.2 against 11-14 ms."""
        if batch.prefill_tables is None or not batch.prefills or not self.takes_prefill_tables(kv_cache):
            return None
        meta = [[sp.token_start, sp.num_tokens, sp.start_pos] for sp in batch.prefills]
        return batch.prefill_tables, torch.tensor(meta, dtype=torch.long)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Logits [S, vocab] at batch.sample_indices, in the model's dtype."""
        cfg = self.config
        T = batch.input_ids.shape[0]
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = self._embed(batch.input_ids)
        D = batch.num_decodes
        native = self._native_prefill_args(batch, kv_cache)  # None: SDPA per span
        prefill_masks = None
        fused = self.fused
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]  # [T, hd]
        if fused is None:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
        delta: Optional[torch.Tensor] = None  # the previous layer's MLP output, not yet added to h
        lora = batch.lora
        layers = self.layers
        if self._stack_takes(batch, kv_cache):  # the same kernels in the same order, in one call
            self._bind_stack(kv_cache)
            h = self.decode_stack.forward(h, cos, sin, batch.slot_mapping, batch.decode_blocks,
                                          batch.decode_context_lens)
            layers = []
        for li, layer in enumerate(layers):
            if fused is None:
                x = self._rms_norm(h, layer["in_norm"])
            elif delta is None:
                x = fused.rms_norm(h, layer["in_norm"], cfg.rms_norm_eps)
            else:
                x = fused.add_rms_norm(h, delta, layer["in_norm"], cfg.rms_norm_eps)
            qkv = layer["qkv"](x)
            if lora is not None:
                lora.add(li, "qkv", x, qkv)
            # Q and K heads sit side by side in the fused output: one RoPE call rotates both.
            if fused is None:
                qk = self._rope(qkv[:, :self.q_size + self.kv_size].view(T, nh + nkv, hd), cos, sin)
                q, k = qk[:, :nh], qk[:, nh:]
            else:
                fused.rope_(qkv.view(T, nh + 2 * nkv, hd), cos, sin, nh + nkv)
                q = qkv[:, :self.q_size].view(T, nh, hd)
                k = qkv[:, self.q_size:self.q_size + self.kv_size].view(T, nkv, hd)
            v = qkv[:, self.q_size + self.kv_size:].view(T, nkv, hd)
            kv_cache.write(li, batch.slot_mapping, k, v, fused)
            if D == T:  # decodes only: their attention is the whole output
                attn = self._decode_attention(li, q, batch, kv_cache)
            else:
                attn = torch.empty(T, nh, hd, dtype=q.dtype, device=q.device)
                if D:
                    attn[:D] = self._decode_attention(li, q[:D], batch, kv_cache)
            if native is not None and not self.fused.prefill_attention(
                    q, *self._prefill_kv(li, kv_cache, native[0]), native[1], kv_cache.block_size, self.scale,
                    cfg.sliding_window or 0, attn, kernel=self._kernel_for(kv_cache)):
                native = None  # this build or cache cannot take it: SDPA for every span, from now on
                self._native_prefill = False
            if native is None and prefill_masks is None:
                prefill_masks = {span.token_start: self._prefill_mask(span) for span in batch.prefills}
            for span in batch.prefills if native is None else ():
                s, n = span.token_start, span.num_tokens
                qp = q[s:s + n].transpose(0, 1).unsqueeze(0)
                if span.context_blocks is None:
                    kp, vp = k[s:s + n], v[s:s + n]
                else:
                    kp = kv_cache.gather(li, 0, span.context_blocks)[:span.start_pos + n]
                    vp = kv_cache.gather(li, 1, span.context_blocks)[:span.start_pos + n]
                mask = prefill_masks[span.token_start]
                causal = mask is None
                out = F.scaled_dot_product_attention(
                    qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                    attn_mask=mask, is_causal=causal, scale=self.scale, enable_gqa=True,
                )
                attn[s:s + n] = out.squeeze(0).transpose(0, 1)
            flat = attn.view(T, self.q_size)
            o = layer["o"](flat)
            if lora is not None:
                lora.add(li, "o", flat, o)
            if fused is None:
                h = h + o
                x = self._rms_norm(h, layer["post_norm"])
            else:
                x = fused.add_rms_norm(h, o, layer["post_norm"], cfg.rms_norm_eps)
            gate_up = layer["gate_up"](x)
            if lora is not None:
                lora.add(li, "gate_up", x, gate_up)
            if fused is None:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            else:
                act = fused.silu_and_mul(gate_up)
            delta = layer["down"](act)
            if lora is not None:
                lora.add(li, "down", act, delta)
            if fused is None:
                h, delta = h + delta, None
        if delta is not None:
            h = h + delta
        h = self._rms_norm(h[batch.sample_indices], self.norm)
        # In the model's dtype: the sampler's greedy path takes the argmax as is (exact: a 16-bit
        # value converts to float32 exactly) and converts only when it processes the logits.
        # The float32 copy of 200 rows of a 49k vocabulary took 7 ms of a 145 ms step.
        return self.lm_head(h)
