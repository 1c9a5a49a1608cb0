"""Weight-only quantization: the packed weight forms and the linears that read them.

A decode step at a handful of sequences reads every weight once and does little arithmetic
with it, so its time is the bytes read: int8 weights read a quarter of float32's, int4 an
eighth. Activations stay 16-bit (torch's CPU kernels `_weight_int8pack_mm` and
`_weight_int4pack_mm_for_cpu` take bfloat16 activations; float32 ones are cast in and out).

4-bit GGUF tensors (Q4_0, Q4_1) are packed from their own codes, scales and minimums, so the
weights the engine computes with are the file's, not a re-quantization of a dequantized copy.

`w8a8` is the other kind: int8 weights and int8 activations (W8A8Linear), integer GEMMs where
a step is compute-bound, as vLLM and compressed-tensors checkpoints run int8.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import numpy as np
import torch
import torch.nn.functional as F

QUANTIZATIONS = ("auto", "none", "int8", "int4", "w8a8")
INT4_GROUP = 32  # elements per scale/offset group along the input dimension (GGUF's block size)


class Linear(Protocol):
    """y = x W^T (+ b) for x of shape [rows, in_features], in whatever form W is stored."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...


@dataclass
class GroupAffine4:
    """4-bit codes with a scale and an offset per group of INT4_GROUP inputs: w = scale * q + offset.

    The neutral form between a file's 4-bit blocks and a kernel's packing; row operations
    (concatenation, llama.cpp's Q/K row permutation) apply to codes, scales and offsets alike."""

    codes: torch.Tensor  # uint8 [out, in], values 0..15
    scale: torch.Tensor  # float32 [out, in // INT4_GROUP]
    offset: torch.Tensor  # float32 [out, in // INT4_GROUP]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, inp = self.shape
        q = self.codes.view(out, inp // INT4_GROUP, INT4_GROUP).float()
        w = q * self.scale.unsqueeze(-1) + self.offset.unsqueeze(-1)
        return w.view(out, inp).to(dtype)

    def map_rows(self, fn) -> "GroupAffine4":
        """The same rows rearranged by `fn` (a function of a tensor with rows first)."""
        return GroupAffine4(fn(self.codes).contiguous(), fn(self.scale).contiguous(), fn(self.offset).contiguous())

    @staticmethod
    def cat(parts: list["GroupAffine4"]) -> "GroupAffine4":
        return GroupAffine4(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                            torch.cat([p.offset for p in parts]))

    @staticmethod
    def quantize(w: torch.Tensor) -> "GroupAffine4":
        """Round-to-nearest between each group's minimum and maximum (for weights not already 4-bit)."""
        out, inp = w.shape
        if inp % INT4_GROUP:
            raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}, got {inp}")
        g = w.float().view(out, inp // INT4_GROUP, INT4_GROUP)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-12)
        q = ((g - lo.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
        return GroupAffine4(q.view(out, inp), scale, lo)

    @staticmethod
    def from_gguf(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> "GroupAffine4":
        """Q4_0 (scale d, codes centred on 8) or Q4_1 (scale d, minimum m) blocks of 32, as stored.

        Each block is its fp16 scale (and, for Q4_1, fp16 minimum), then 16 bytes whose low
        nibbles are elements 0-15 and high nibbles elements 16-31."""
        out, inp = shape
        header = {"Q4_0": 2, "Q4_1": 4}[kind]
        blocks = np.asarray(raw, dtype=np.uint8).reshape(out, inp // INT4_GROUP, header + INT4_GROUP // 2)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if kind == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        else:
            m = -8.0 * d
        nibbles = blocks[..., header:]
        codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(out, inp)
        return GroupAffine4(torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m))


GGUF_INT4_TYPES = ("Q4_0", "Q4_1")
W4A8_TILE = 8  # output columns the W4A8 kernel computes side by side


def w4a8_tiles(weight: GroupAffine4) -> torch.Tensor:
    """The W4A8 kernel's layout: [ceil(out / 8), in / 32, 160] uint8, one 160-byte record per tile
    of eight output columns and group of 32 inputs: 128 bytes of codes, byte 32c + 4j + i holding
    input 4c + i of column j in its low nibble and input 16 + 4c + i in its high one (so one
    32-byte load feeds a vector product of four inputs for all eight columns), then the eight
    columns' float16 scales, then their float16 offsets. Columns past `out` are zeros.

    Records in the order the kernel reads them, scales beside their codes: one stream of bytes.
    With the model's layers at one row 1.35x faster than a column at a time (per-column
    horizontal sums and set-up gone), 1.7-1.9x at 4-8 rows (BENCHMARKS.md)."""
    out, inp = weight.shape
    groups, tiles = inp // INT4_GROUP, -(-out // W4A8_TILE)
    pad = tiles * W4A8_TILE - out

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t

    codes = padded(weight.codes).view(tiles, W4A8_TILE, groups, 2, 4, 4)  # tile, column, group, half, c, i
    low, high = (codes[:, :, :, half].permute(0, 2, 3, 1, 4) for half in (0, 1))  # tile, group, c, column, i
    packed = (low | (high << 4)).reshape(tiles, groups, W4A8_TILE * INT4_GROUP // 2)  # two codes a byte

    def per_tile(t: torch.Tensor) -> torch.Tensor:  # [out, groups] -> [tiles, groups, 8 float16 as 16 bytes]
        t = padded(t).to(torch.float16).view(tiles, W4A8_TILE, groups).permute(0, 2, 1).contiguous()
        return t.view(torch.uint8).view(tiles, groups, 2 * W4A8_TILE)
    return torch.cat([packed, per_tile(weight.scale), per_tile(weight.offset)], dim=-1).contiguous()


W8A8_TILE = 16  # output columns the tiled W8A8 kernel computes side by side


def w8a8_tiles(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiled W8A8 kernel's layout of int8 codes [out, in]: tiles [ceil(out / 16), in / 32, 512]
    int8, byte 64c + 4j + i of a tile's block holding input 4c + i of column j (one 64-byte load
    feeds a product of four inputs for all sixteen columns), and each tile block's starting sums
    [ceil(out / 16), in / 32, 16] int32: -128 times the column's codes summed over the block (the
    kernel feeds the activations in as q + 128). Columns past `out` are zeros."""
    out, inp = codes.shape
    tiles, groups = -(-out // W8A8_TILE), inp // 32
    padded = torch.cat([codes, codes.new_zeros(tiles * W8A8_TILE - out, inp)]) if tiles * W8A8_TILE > out else codes
    blocks = padded.view(tiles, W8A8_TILE, groups, 8, 4)  # tile, column, group, c, i
    packed = blocks.permute(0, 2, 3, 1, 4).reshape(tiles, groups, W8A8_TILE * 32).contiguous()
    starts = (-128 * blocks.to(torch.int32).sum((-1, -2))).to(torch.int32).permute(0, 2, 1).contiguous()  # tile, group, column
    return packed, starts


# The row count oneDNN tunes a prepacked layout for. With 16 or more, the prepacked product is
# bitwise the plain one at every row count measured (1 to 2048, torch 2.13, AMX Xeon); with 1 it
# took another kernel from 64 rows on.
PREPACK_ROWS_HINT = 16


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN can hold this dtype's linear weights prepacked in its blocked layout.
    torch's bf16 CPU linear hands its weight to oneDNN, which reorders it on every call;
    prepacking does that once. For float32 torch calls MKL's sgemm instead, and the prepacked
    oneDNN kernel is another one (not the same sums): faster on AMD Zen4 (1.24-1.44x on the
    embedded model's shapes), not on the CPU it was first tried on, so the engine measures
    which (precision_probe.prepack_pays). oneDNN's bf16 reorder needs AVX-512 (BW, VL, DQ): an AVX2 CPU
    (AMD Zen3) raises at load instead."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() == "AVX512"


class DenseLinear:
    """x W^T + b. `prepack` (see can_prepack) keeps the weight only in oneDNN's layout, unless
    `keep_weight` (a tied embedding reads its rows)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, prepack: bool = False,
                 keep_weight: bool = False):
        self.bias = bias
        self._weight_bytes = _nbytes(weight)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PREPACK_ROWS_HINT) if prepack else None
        self.weight: Optional[torch.Tensor] = weight if self.packed is None or keep_weight else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        kept = 0 if self.weight is None or self.packed is None else self._weight_bytes
        return self._weight_bytes + kept + _nbytes(self.bias)


class Int8Linear:
    """Symmetric int8 per output channel: w = scale[row] * q.

    `w8a8`: the native W8A8 product (kernels' int8_gemv: activations quantized to int8 per
    32-element block, integer dot products), used instead of torch's weight-only kernel; the
    weights are the same, the activations lose precision (the LM head's, measured in BENCHMARKS.md).
    `tiled`: kernels' int8_tile_gemm, the same product over sixteen columns side by side (VNNI-512
    builds), taking every row count where given. The codes are then kept only in its layout
    (w8a8_tiles); `codes` unpacks them on first use, for a benchmark that switches kernels."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 w8a8: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                 tiled: Optional[Callable[..., torch.Tensor]] = None):
        w = weight.float()
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12)
        codes = (w / scale.unsqueeze(1)).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.out_features = codes.shape[0]
        self.scale = scale.to(torch.bfloat16)
        self.bias = bias
        self.w8a8 = w8a8
        self.tiled = tiled
        self.tiles, self.starts = w8a8_tiles(codes) if tiled is not None else (None, None)
        self._codes: Optional[torch.Tensor] = codes if tiled is None else None
        # the bf16 scales in float32: the same weights as the weight-only kernel and the dense copy
        self._scale_f32 = self.scale.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiled is not None:
            y = self.tiled(x, self.tiles, self.starts, self._scale_f32, self.out_features)
        elif self.w8a8 is not None:
            y = self.w8a8(x, self.codes, self._scale_f32)
        else:
            y = torch.ops.aten._weight_int8pack_mm(as_dtype(x, torch.bfloat16), self.codes, self.scale)
        y = as_dtype(y, x.dtype)
        return y if self.bias is None else y + self.bias

    @property
    def codes(self) -> torch.Tensor:
        """The int8 codes [out, in] (unpacked from the tiles, once, where only those are kept)."""
        if self._codes is None:
            self._codes = self._code_rows(torch.arange(self.out_features)).contiguous()
        return self._codes

    def _code_rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self._codes is not None:
            return self._codes[ids]
        tiles, groups = self.tiles.shape[:2]  # code [n, k] sits at [n // 16, k // 32, k % 32 // 4, n % 16, k % 4]
        grid = self.tiles.view(tiles, groups, 8, W8A8_TILE, 4)
        return grid[ids // W8A8_TILE, :, :, ids % W8A8_TILE].reshape(*ids.shape, groups * 32)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows: an int8 embedding table shares the tied LM head's codes."""
        return (self._code_rows(ids).float() * self.scale[ids].float().unsqueeze(-1)).to(dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights this kernel computes with (its bf16 scales included), as a dense matrix."""
        return self.rows(torch.arange(self.out_features), dtype)

    @property
    def nbytes(self) -> int:
        return _nbytes(self._codes, self.tiles, self.starts, self.scale, self.bias)


def w8a8_available(device: torch.device) -> bool:
    """Whether oneDNN's int8 GEMM (u8 activations x s8 weights, through torch) runs here."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and \
        hasattr(torch.ops.onednn, "qlinear_pointwise")


class W8A8Linear:
    """compressed-tensors' W8A8 int8 scheme: symmetric int8 weights with one scale per output
    channel (the codes Int8Linear computes), activations quantized to int8 per row (token) at run
    time, symmetric, and multiplied in integer arithmetic; what vLLM runs for such a checkpoint.

    oneDNN's integer GEMM takes unsigned activations (its signed path is a slow reference loop),
    so each row's codes are shifted by 128 and 128 is its zero point; the weight scales are fused
    into the GEMM, each row's own scale multiplies its output row after. About 1.9x the bf16
    GEMM's FLOP/s from 16 rows up on a Zen4 EPYC (BENCHMARKS.md)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                 quantize: Optional[Callable[[torch.Tensor], list[torch.Tensor]]] = None):
        """`quantize`: the kernels' quantize_rows_u8 (one pass, the same bits); default the ATen form."""
        int8 = Int8Linear(weight)
        self.quantize = quantize or quantize_rows_u8
        self.out_features, self.in_features = int8.codes.shape
        # Int8Linear's bf16 scales in float32 (what oneDNN takes): the same weights as --quantization int8
        self.scale = int8.scale.float().contiguous()
        self._codes: Optional[torch.Tensor] = int8.codes
        self._w_zero = torch.zeros(self.out_features, dtype=torch.int64)
        self.packed = torch.ops.onednn.qlinear_prepack(int8.codes, None)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        codes, row_scale = self.quantize(x.contiguous())
        y = torch.ops.onednn.qlinear_pointwise(codes, 1.0, 128, self.packed, self.scale, self._w_zero, None,
                                               1.0, 0, x.dtype, "none", [], "")
        y.mul_(row_scale.to(y.dtype))
        return y if self.bias is None else y + self.bias

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights (codes times their bf16 scales) as a dense matrix, for a dense copy."""
        if self._codes is None:
            raise RuntimeError("this W8A8 linear dropped its codes (it keeps only oneDNN's packing)")
        return (self._codes.float() * self.scale.unsqueeze(1)).to(dtype)

    def drop_codes(self) -> None:
        self._codes = None

    @property
    def nbytes(self) -> int:  # oneDNN's packing holds the int8 codes, one byte each
        return self.out_features * self.in_features + _nbytes(self.scale, self.bias)


def quantize_rows_u8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x [M, K] as int8 codes by its own scale max|x| / 127, shifted by 128 into uint8,
    and the scales [M, 1] (float32): W8A8Linear's activations (the kernels' one-pass form gives the
    same bits)."""
    xf = x.float()
    row_scale = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return (xf / row_scale).round_().add_(128).to(torch.uint8), row_scale  # xf may be x itself: not in place


def int8_linear(weight: torch.Tensor, bias: Optional[torch.Tensor] = None, ops=None) -> Int8Linear:
    """An Int8Linear with the native W8A8 products of `ops` (int8_activation_kernels), where given:
    the tiled kernel where the build has it (1.7-2.2x the column kernel's speed at 1-200 rows on a
    Zen4 EPYC, BENCHMARKS.md), the column kernel elsewhere."""
    if ops is None:
        return Int8Linear(weight, bias)
    tiled = ops.int8_tile_gemm if hasattr(ops, "int8_tiles_supported") and ops.int8_tiles_supported() else None
    return Int8Linear(weight, bias, w8a8=ops.int8_gemv, tiled=tiled)


class Int4Linear:
    """Group-wise affine int4: w = scale * q + offset per group of INT4_GROUP inputs.

    By default in torch's CPU packing (scales and offsets in bfloat16, bf16 activations). With
    `w4a8` (kernels' int4_gemv) the codes stay two to a byte, eight output columns interleaved
    (w4a8_tiles), the groups' scales and offsets in float16 (a Q4_1 file's own values, exactly),
    and the activations are quantized to int8 per 32-element block for integer dot products
    (llama.cpp's Q4 x Q8 arithmetic)."""

    def __init__(self, weight: GroupAffine4, bias: Optional[torch.Tensor] = None,
                 w4a8: Optional[Callable[..., torch.Tensor]] = None):
        out, inp = weight.shape
        self.bias = bias
        self.w4a8 = w4a8
        self.out_features = out
        self.packed = self.scales_zeros = self.tiles = None
        if w4a8 is not None:
            self.tiles = w4a8_tiles(weight)
        else:
            # torch's kernel dequantizes as (q - 8) * scale + zero.
            zero = weight.offset + 8 * weight.scale
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                weight.codes.to(torch.int32).contiguous(), 1)
            self.scales_zeros = torch.stack([weight.scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        self._source: Optional[GroupAffine4] = weight  # kept only until dequantized() is asked for (or dropped)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights this kernel computes with (torch's packing: bf16 scales and zeros included;
        W4A8's: float16 ones), as a dense matrix: a dense copy for large steps that differs from
        the packed form only in the order of the sums (and, with `w4a8`, in the activations' rounding)."""
        w = self._source
        if self.w4a8 is not None:
            return GroupAffine4(w.codes, w.scale.half().float(), w.offset.half().float()).dequantize(dtype)
        out, inp = w.shape
        q = w.codes.view(out, inp // INT4_GROUP, INT4_GROUP).float()
        scale = self.scales_zeros[..., 0].t().float().unsqueeze(-1)
        zero = self.scales_zeros[..., 1].t().float().unsqueeze(-1)
        return ((q - 8) * scale + zero).view(out, inp).to(dtype)

    def drop_codes(self) -> None:
        self._source = None

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantized rows read from the W4A8 records: a tied embedding shares a 4-bit head's codes."""
        if self.tiles is None:
            raise RuntimeError("rows of an int4 linear are read from its W4A8 records; this one has torch's packing")
        groups = self.tiles.shape[1]
        flat = ids.reshape(-1)
        records = self.tiles[flat // W4A8_TILE]  # [n, groups, 160]
        column = (flat % W4A8_TILE).view(-1, 1, 1, 1, 1).expand(-1, groups, 4, 1, 4)
        packed = records[..., :128].view(-1, groups, 4, W4A8_TILE, 4).gather(3, column).squeeze(3)  # [n, g, c, i]
        codes = torch.cat([(packed & 15).reshape(-1, groups, 16), (packed >> 4).reshape(-1, groups, 16)], dim=-1)
        halves = records[..., 128:].contiguous().view(torch.float16).view(-1, groups, 2, W4A8_TILE)
        pick = (flat % W4A8_TILE).view(-1, 1, 1, 1).expand(-1, groups, 2, 1)
        scale, offset = halves.gather(3, pick).squeeze(3).float().unbind(-1)  # [n, groups] each
        w = codes.float() * scale.unsqueeze(-1) + offset.unsqueeze(-1)
        return w.reshape(*ids.shape, groups * INT4_GROUP).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.w4a8 is not None:
            y = self.w4a8(x, self.tiles, self.out_features)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(as_dtype(x, torch.bfloat16), self.packed, INT4_GROUP,
                                                            self.scales_zeros)
        y = as_dtype(y, x.dtype)
        return y if self.bias is None else y + self.bias

    @property
    def nbytes(self) -> int:
        if self.w4a8 is not None:
            return _nbytes(self.tiles, self.bias)
        return _nbytes(self.packed, self.scales_zeros, self.bias)


class RowDispatchLinear:
    """A quantized form for small batches and a dense one for large: weight-only kernels win
    while a step is memory-bound (few rows) and lose to the dense GEMM once it is compute-bound.
    The crossover is measured per machine (engine/precision_probe.py)."""

    def __init__(self, small: Linear, large: DenseLinear, max_small_rows: int):
        self.small, self.large, self.max_small_rows = small, large, max_small_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(x) if x.shape[0] <= self.max_small_rows else self.large(x)

    @property
    def nbytes(self) -> int:
        return self.small.nbytes + self.large.nbytes


def int8_activation_kernels(fused_ops, device: torch.device):
    """The native kernels that multiply int8 activations (int8_gemv, int4_gemv), or None where
    they are not built (no AVX2, no compiler, not a CPU)."""
    supported = device.type == "cpu" and hasattr(fused_ops, "int8_gemv_supported") and fused_ops.int8_gemv_supported()
    return fused_ops if supported else None


def head_kind(quantization: str, head: object, w4a8: bool) -> str:
    """How a quantized model stores its LM head: int8, the most sensitive matrix, unless the file's
    own head is 4-bit and the W4A8 kernel (`w4a8`) can read it as it is: re-encoding 4-bit values
    as int8 adds no precision and reads 1.6x the bytes every step (on a 128k vocabulary, more
    than 100 MB a token). Unquantized: "none"."""
    if quantization in ("none", "w8a8"):  # W8A8 checkpoints keep the head dense (compressed-tensors' ignore)
        return "none"
    return "int4" if quantization == "int4" and w4a8 and isinstance(head, GroupAffine4) else "int8"


def takes_int8_activations(part: str, kind: str) -> bool:
    """Whether a quantized `part` ("layers" or "head") stored as `kind` may round its activations
    to int8. int8 layers keep 16-bit ones: with int8 activations as well their top-1 agreement fell
    below the int8 tolerance (0.926 against 0.93 on the held-out texts); the int8 head and int4
    layers stay within theirs."""
    return kind in ("int8", "int4") and not (part == "layers" and kind == "int8")


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype`; the dtype test first, because a no-op `.to` still costs ~3 us of argument
    parsing and a one-sequence decode step makes ~300 of them (~5% of the step)."""
    return x if x.dtype == dtype else x.to(dtype)


def _nbytes(*tensors: Optional[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def resolve_quantization(name: str, file_class: Optional[str], device: torch.device) -> str:
    """`auto` keeps the file's own precision class (int4 for 4-bit GGUF layers, int8 for 8-bit,
    none for float weights); the packed kernels are CPU-only, so CUDA gets none."""
    if name not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {name!r}; use one of {', '.join(QUANTIZATIONS)}")
    if name == "auto":
        return file_class if device.type == "cpu" and file_class else "none"
    if name != "none" and device.type != "cpu":
        raise ValueError(f"--quantization {name} runs on CPU only (torch's packed weight-only kernels); "
                         f"use --quantization none on {device.type}")
    if name == "w8a8" and not w8a8_available(device):
        raise ValueError("--quantization w8a8 needs oneDNN's int8 GEMM (a torch built with mkldnn); "
                         "use --quantization int8 (int8 weights, 16-bit activations)")
    return name
