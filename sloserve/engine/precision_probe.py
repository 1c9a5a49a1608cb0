"""Measured, per machine: which float type runs this model fastest on a CPU, and up to how many
rows a step's weight-only quantized linears beat the dense ones.

Whether bf16 pays depends on the CPU, not on the model: with AVX512-BF16 or AMX a bf16 GEMM
reads half the bytes and runs on wider units; without them torch emulates it and it is several
times slower than float32. Machines change from day to day, so the engine measures rather than
reads a flag list. The probe cycles through more weight matrices than the caches hold (a decode
step streams every weight from memory) at a memory-bound, a middle and a compute-bound row
count, and takes ~1 s; the answer is cached per CPU (model and feature flags), torch version,
thread count and shape, so only the first start on a machine pays for it.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from sloserve.engine.kernels import build_digest, cpu_tag, load_fused_ops
from sloserve.engine.quant import DenseLinear, GroupAffine4, Int4Linear, W8A8Linear, can_prepack, int8_linear
from sloserve.user_cache import JsonCache, user_cache_path

logger = logging.getLogger(__name__)

PROBE_ROWS = (1, 16, 128)  # a single decode, a small batch, a prefill chunk
BF16_MARGIN = 0.9  # bf16 must be >= 10% faster (geometric mean over PROBE_ROWS) to be chosen
_WEIGHT_SET_BYTES = 64 * 2**20  # float32 bytes of matrices cycled through: more than a CPU's last-level cache


@dataclass
class ProbeResult:
    dtype: str  # "float32" or "bfloat16"
    bf16_over_fp32: dict[int, float]  # time ratio per row count (below 1: bf16 faster)
    key: str


def default_cache_path() -> Path:
    return user_cache_path("dtype-probe.json")


def _key(*parts: object) -> str:
    return "|".join([cpu_tag(), f"torch {torch.__version__}", f"threads {torch.get_num_threads()}", *map(str, parts)])


def choose_cpu_dtype(hidden: int, intermediate: int, cache_path: Optional[Path] = None,
                     native_kernels: bool = True) -> ProbeResult:
    """The faster of float32 and bfloat16 for a model of these widths on this CPU (cached), each
    timed on the linear the engine runs it with: with its native kernels on (the default), weights
    prepacked for oneDNN where `prepack_pays` says so for that dtype (measured and cached first),
    else torch's plain one; without them, torch's plain one for both."""
    cache_path = cache_path or default_cache_path()
    key = _key(f"{hidden}x{intermediate}", "as run" if native_kernels else "plain")
    cache = JsonCache(cache_path)
    cached = cache.get(key)
    if isinstance(cached, dict):
        return ProbeResult(cached["dtype"], {int(k): v for k, v in cached["bf16_over_fp32"].items()}, key)
    fp32, bf16 = (_DenseSet(hidden, intermediate, dtype,
                            prepack=native_kernels and prepack_pays(hidden, intermediate, dtype, cache_path))
                  for dtype in (torch.float32, torch.bfloat16))
    ratios = {rows: bf16.seconds(rows) / fp32.seconds(rows) for rows in PROBE_ROWS}
    mean = _geometric_mean(ratios.values())
    result = ProbeResult("bfloat16" if mean < BF16_MARGIN else "float32", ratios, key)
    logger.info("dtype probe: bf16/fp32 time %s -> %s", {k: round(v, 2) for k, v in ratios.items()}, result.dtype)
    cache.put(key, {"dtype": result.dtype, "bf16_over_fp32": ratios})
    return result


PREPACK_MARGIN = 0.95  # prepacked weights must be >= 5% faster (geometric mean over PROBE_ROWS)


def prepack_pays(hidden: int, intermediate: int, dtype: torch.dtype = torch.bfloat16,
                 cache_path: Optional[Path] = None) -> bool:
    """Whether linears of `dtype` with their weights prepacked for oneDNN (quant.can_prepack) beat
    torch's plain linear here (cached). bf16 on the 2-vCPU AMX Xeon: packed/plain 0.70 / 0.67 /
    0.73 at 1 / 16 / 128 rows; a 576x3072 matrix took 0.81x at 200 rows and about the same time at
    2048. float32 on the 2-vCPU Zen4 EPYC, the embedded model's four shapes together: oneDNN's
    prepacked kernel 1.44x / 1.24x / 1.30x the GFLOP/s of torch's (MKL's) at 64 / 200 / 2048 rows.
    False without measuring where it cannot run (can_prepack)."""
    if not can_prepack(dtype, torch.device("cpu")):
        return False
    cache_path = cache_path or default_cache_path()
    name = str(dtype).removeprefix("torch.")
    key = _key(f"{hidden}x{intermediate}", f"prepack {name}")
    cache = JsonCache(cache_path)
    cached = cache.get(key)
    if isinstance(cached, dict):
        return bool(cached["pays"])
    plain = _DenseSet(hidden, intermediate, dtype)
    packed = _DenseSet(hidden, intermediate, dtype, prepack=True)
    ratios = {rows: packed.seconds(rows) / plain.seconds(rows) for rows in PROBE_ROWS}
    pays = _geometric_mean(ratios.values()) < PREPACK_MARGIN
    logger.info("prepack probe: packed/plain %s time %s -> %s", name, {k: round(v, 2) for k, v in ratios.items()},
                "prepack" if pays else "plain")
    cache.put(key, {"pays": pays, "packed_over_plain": ratios})
    return pays


def _geometric_mean(ratios) -> float:
    values = list(ratios)
    return math.exp(sum(math.log(r) for r in values) / len(values))


CROSSOVER_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# A dense copy costs memory (the embedded model's int4 layers: 198 -> 401 MiB with a bf16 one), so
# it is kept only from the row count where dense is >= 10% faster; where the two are level the
# answer flipped between runs on a drifting machine (2-vCPU Zen4, 2026-12-04).
COPY_MARGIN = 0.9


def dense_pays(packed_s: float, dense_s: float) -> bool:
    return dense_s < COPY_MARGIN * packed_s


def crossover(times: dict[int, tuple[float, float]], final: bool = True) -> Optional[int]:
    """From (packed, dense) seconds per row count: the most rows below the first count where a
    dense copy pays there and at the next count measured (0 if from one row), or None where it
    never does. One count alone does not decide: a pass slowed by another process once made a
    dense copy "pay" at 16 rows on a machine where whole steps ran 1.3-2x slower with it (2-vCPU
    Zen4, 2026-12-05), and the answer is cached for good. A dense copy that pays only at the last
    count measured is kept when `final` (nothing follows to confirm it)."""
    ordered = sorted(times)
    for i, rows in enumerate(ordered):
        if not dense_pays(*times[rows]):
            continue
        if i + 1 < len(ordered):
            if not dense_pays(*times[ordered[i + 1]]):
                continue
        elif not final:
            return None
        return rows // 2 if rows > 1 else 0
    return None


def quantized_max_rows(hidden: int, intermediate: int, quantization: str, dtype: torch.dtype,
                       cache_path: Optional[Path] = None, prepack: bool = False,
                       int8_activations=None) -> Optional[int]:
    """The most rows for which dense `dtype` linears (prepacked if `prepack`) are not COPY_MARGIN
    faster than `quantization` ("int8", "int4", "w8a8") ones at any row count up to it (0: never), or
    None when they win at every probed size, so no dense copy is worth its memory (cached like the dtype).
    `int8_activations`: the native kernels (engine/kernels) the packed linears will run with int8
    activations (W4A8/W8A8), so that is what is timed (keyed by their ISA and sources: a VNNI build
    or a changed kernel moves the crossover); None = torch's weight-only kernels."""
    cache_path = cache_path or default_cache_path()
    a8 = [] if int8_activations is None else [f"a8-{int8_activations.int8_kernel_isas()[0]}-{build_digest()}"]
    key = _key(f"{hidden}x{intermediate}", quantization, str(dtype).removeprefix("torch."),
               *(["prepacked"] if prepack else []), *a8)
    cache = JsonCache(cache_path)
    cached = cache.get(key)
    if isinstance(cached, dict):
        return cached["max_rows"]
    dense = _DenseSet(hidden, intermediate, dtype, prepack)
    packed = _QuantizedSet(hidden, intermediate, quantization, int8_activations)
    times: dict[int, tuple[float, float]] = {}
    for rows in CROSSOVER_ROWS:
        times[rows] = (packed.seconds(rows), dense.seconds(rows))
        if crossover(times, final=False) is not None:
            break
    max_rows = crossover(times)
    logger.info("%s probe: (packed, dense) seconds per row count %s -> dense above %s rows", quantization,
                times, max_rows)
    cache.put(key, {"max_rows": max_rows})
    return max_rows


class _WeightSet:
    """Matrices of one [2*intermediate, hidden] shape, more bytes of them (in their stored form)
    than the caches hold, so each is read from memory as in a real step."""

    def __init__(self, hidden: int, intermediate: int, bytes_per_element: float, make):
        count = max(2, int(_WEIGHT_SET_BYTES // (2 * intermediate * hidden * bytes_per_element)))
        gen = torch.Generator().manual_seed(0)
        self.linears = [make(torch.randn(2 * intermediate, hidden, generator=gen)) for _ in range(count)]
        self.hidden = hidden

    def seconds(self, rows: int) -> float:
        """Seconds per matrix for [rows, hidden] (best of 3 passes over the set)."""
        x = self.input(torch.randn(rows, self.hidden, generator=torch.Generator().manual_seed(1)))
        best = math.inf
        with torch.inference_mode():
            for linear in self.linears[:2]:
                linear(x)  # warm-up: kernel selection, first touch
            for _ in range(3):
                start = time.perf_counter()
                for linear in self.linears:
                    linear(x)
                best = min(best, time.perf_counter() - start)
        return best / len(self.linears)

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _DenseSet(_WeightSet):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, prepack: bool = False):
        self.dtype = dtype
        super().__init__(hidden, intermediate, torch.finfo(dtype).bits / 8,
                         lambda w: DenseLinear(w.to(dtype), prepack=prepack))

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


class _QuantizedSet(_WeightSet):
    def __init__(self, hidden: int, intermediate: int, quantization: str, int8_activations=None):
        ops = int8_activations
        self.a8 = ops is not None
        if quantization == "int8":
            super().__init__(hidden, intermediate, 1, lambda w: int8_linear(w, ops=ops))
        elif quantization == "w8a8":
            self.a8 = True  # it quantizes the activations itself, with the kernels' pass where they build
            quantize = getattr(load_fused_ops(), "quantize_rows_u8", None)
            super().__init__(hidden, intermediate, 1, lambda w: W8A8Linear(w, quantize=quantize))
        elif quantization == "int4":
            super().__init__(hidden, intermediate, 0.5, lambda w: Int4Linear(GroupAffine4.quantize(w),
                                                                             w4a8=ops.int4_gemv if ops else None))
        else:
            raise ValueError(f"no packed kernel for quantization {quantization!r}")

    def input(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.a8 else x.to(torch.bfloat16)
