"""Reduced precision and weight-only quantization: the packed forms are the weights they claim to
be, the linears compute with them, `auto` chooses by measuring, and every precision stays within
the quality tolerance written down in engine/quality.py (perplexity on held-out ShareGPT text and
greedy top-1 agreement with the float32 reference, on the embedded model)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q

from sloserve.core.config import CacheConfig, EngineConfig, SchedulerConfig
from sloserve.engine.kernels import load_fused_ops
from sloserve.engine.llm import LLM
from sloserve.engine.precision_probe import choose_cpu_dtype, crossover, prepack_pays, quantized_max_rows
from sloserve.engine.quality import (KV_TOLERANCES, TOLERANCES, TextScores, chunked_next_token_logits, greedy_agreement,
                                     load_texts, next_token_logits, perplexity, score_texts, top1_agreement)
from sloserve.engine.quant import (DenseLinear, GroupAffine4, Int4Linear, Int8Linear, RowDispatchLinear, W8A8Linear,
                                   can_prepack, quantize_rows_u8, resolve_quantization, w8a8_available)
from sloserve.engine.weights import load_model
from sloserve.core.types import SamplingParams
from test_weights import random_hf_weights, write_tiny_gguf

HELDOUT = Path(__file__).with_name("data") / "heldout_sharegpt.jsonl"


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda q: q.name)
def test_4bit_gguf_matrices_load_as_the_files_own_codes(tmp_path, qtype):
    """Kept packed, a Q4_0/Q4_1 matrix holds exactly the values the dequantizing load returns,
    Q/K row permutation included."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, random_hf_weights(0, tied=True, bias=False), qtype)
    dense = load_model(str(path)).weights
    packed = load_model(str(path), keep_int4=True)
    assert packed.precision_class == "int4"
    kept = {n: v for n, v in packed.weights.items() if isinstance(v, GroupAffine4)}
    assert any("q_proj" in n for n in kept) and any("down_proj" in n for n in kept)
    for name, value in kept.items():
        assert torch.equal(value.dequantize(), dense[name]), name


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_packed_linears_compute_with_their_own_weights(rows):
    torch.manual_seed(0)
    w, b = torch.randn(96, 128) * 0.05, torch.randn(96) * 0.1
    x = torch.randn(rows, 128, dtype=torch.bfloat16)
    for packed in (Int8Linear(w, b), Int4Linear(GroupAffine4.quantize(w), b)):
        ref = F.linear(x.float(), packed.dequantized(torch.float32), b)
        got = packed(x).float()
        assert got.dtype == torch.float32 and got.shape == (rows, 96)
        assert (got - ref).norm() / ref.norm() < 1e-2, type(packed).__name__
        # The packed form really is an approximation of w, not a copy of it.
        assert 0 < (packed.dequantized(torch.float32) - w).abs().max() < 0.05 * w.abs().max()


def _w8a8_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the W8A8 product computes, spelled out: activations rounded to int8 per 32-element
    block (scale max|x| / 127), exact integer dot products, then both scales."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, blocks * 127 / amax, torch.zeros_like(blocks)).round().clamp(-127, 127)
    ints = torch.einsum("mbk,nbk->mnb", q.double(), codes.double().view(codes.shape[0], -1, 32))
    return ((ints * (amax.squeeze(-1) / 127).double().unsqueeze(1)).sum(-1) * scale.double()).float()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 33, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["columns", "tiles"])
def test_the_w8a8_head_kernel_computes_what_it_claims(rows, dtype, form):
    """The native int8 x int8 products against the spelled-out arithmetic: the column kernel (AVX2's
    byte products with the sign moved onto the activation) and the tiled one (VNNI-512: sixteen
    columns at a time, activations fed in as q + 128 with the offset taken back in the tile's
    starting sums). Equal to float rounding, including codes at +-127, zero blocks, one row, rows
    that do and do not fill the kernels' groups of rows and its chunks of 64, a last tile of
    fewer than sixteen columns (77); within int8 rounding of the exact product; and the tiled form
    hands back the same codes (rows of a tied embedding, the dense copy) as the plain one."""
    kernels = load_fused_ops()
    if kernels is None or not kernels.int8_gemv_supported():
        pytest.skip("no native W8A8 kernel on this machine")
    if form == "tiles" and not kernels.int8_tiles_supported():
        pytest.skip("no AVX512-VNNI (BW, DQ, VL) on this machine: no tiled W8A8 kernel")
    torch.manual_seed(0)
    w = torch.randn(77, 96) * 0.05
    w[0, :5] = 1.0  # a row whose largest codes are +127 and -127
    w[0, 5:10] = -1.0
    plain = Int8Linear(w, w8a8=kernels.int8_gemv)
    assert plain.codes.max() == 127 and plain.codes.min() == -127
    packed = plain if form == "columns" else Int8Linear(w, w8a8=kernels.int8_gemv, tiled=kernels.int8_tile_gemm)
    assert torch.equal(packed.dequantized(torch.float32), plain.dequantized(torch.float32))
    ids = torch.tensor([76, 0, 15, 16, 33])
    assert torch.equal(packed.rows(ids, torch.float32), plain.rows(ids, torch.float32))
    x = torch.randn(rows, 96).to(dtype)
    x[0, 32:64] = 0  # an all-zero activation block
    got = packed(x)
    assert got.dtype == dtype and got.shape == (rows, 77)
    # a bf16 output is the float32 one rounded (the kernel writes it; no float32 copy in between)
    assert torch.equal(got, packed(x.float()).to(dtype))
    expected = _w8a8_reference(x, plain.codes, packed.scale.float())
    assert torch.allclose(got.float(), expected.to(dtype).float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                          atol=1e-3 if dtype == torch.bfloat16 else 1e-5)
    exact = F.linear(x.float(), packed.dequantized(torch.float32))
    assert (got.float() - exact).norm() / exact.norm() < 2e-2


def _w4a8_reference(x: torch.Tensor, weight: GroupAffine4) -> torch.Tensor:
    """What the W4A8 product computes, spelled out: activations rounded to int8 per 32-element
    block as for W8A8; per block, scale * s * sum(code * q) + offset * s * sum(q), in float64."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, blocks * 127 / amax, torch.zeros_like(blocks)).round().clamp(-127, 127).double()
    s = (amax.squeeze(-1) / 127).double()  # [M, B]
    codes = weight.codes.double().view(weight.codes.shape[0], -1, 32)  # [N, B, 32]
    ints = torch.einsum("mbk,nbk->mnb", q, codes)
    return (s.unsqueeze(1) * (weight.scale.double() * ints + weight.offset.double() * q.sum(-1).unsqueeze(1))
            ).sum(-1).float()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, 33, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_w4a8_layer_kernel_computes_what_it_claims(rows, dtype):
    """The native 4-bit x int8 product (the codes as vpmaddubsw's unsigned factor, the groups'
    offsets through each block's activation sum) against the spelled-out arithmetic: equal to
    float rounding, with codes at 0 and 15, a zero activation block, and row counts that do and
    do not fill the kernel's groups of rows or its chunks of 64, over an odd number of columns (83: the last tile of
    eight columns is partial, the threads' shares differ); within int8 rounding of the exact product; and the
    dense copy it hands large steps is exactly the file's weights."""
    kernels = load_fused_ops()
    if kernels is None or not kernels.int8_gemv_supported():
        pytest.skip("no native W4A8 kernel on this machine")
    torch.manual_seed(0)
    w = torch.randn(83, 96) * 0.05
    w[0, :32] = torch.linspace(-1, 1, 32)  # a group whose codes run from 0 to 15
    weight = GroupAffine4.quantize(w)
    # as a Q4_1 file stores them: float16 scales and offsets
    weight = GroupAffine4(weight.codes, weight.scale.half().float(), weight.offset.half().float())
    assert weight.codes[0, :32].min() == 0 and weight.codes[0, :32].max() == 15
    packed = Int4Linear(weight, w4a8=kernels.int4_gemv)
    # two codes a byte and two float16 halves a group, for the columns padded to whole tiles of eight
    assert packed.nbytes == 88 * (96 // 2 + 2 * 2 * (96 // 32))
    assert torch.equal(packed.dequantized(torch.float32), weight.dequantize())
    x = torch.randn(rows, 96).to(dtype)
    x[0, 32:64] = 0
    got = packed(x)
    assert got.dtype == dtype and got.shape == (rows, 83)
    assert torch.equal(got, packed(x.float()).to(dtype))
    expected = _w4a8_reference(x, weight)
    assert torch.allclose(got.float(), expected.to(dtype).float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                          atol=1e-3 if dtype == torch.bfloat16 else 1e-5)
    exact = F.linear(x.float(), weight.dequantize())
    assert (got.float() - exact).norm() / exact.norm() < 2e-2


@pytest.mark.parametrize("rows", [1, 3, 4, 6, 9, 16, 17, 130])
def test_every_int8_kernel_isa_gives_the_same_bits(rows):
    """AVX512-VNNI's vpdpbusd sums the same integer products as AVX2's vpmaddubsw + vpmaddwd, and
    the float work around them is the same, so where a CPU has both the outputs are equal bit for
    bit (W8A8 and W4A8, each row count the kernels group differently); a name the build lacks is
    refused with the list of those it has."""
    kernels = load_fused_ops()
    if kernels is None or not kernels.int8_gemv_supported():
        pytest.skip("no native int8 kernels on this machine")
    isas = kernels.int8_kernel_isas()
    assert isas[-1] == "avx2" and set(isas) <= {"vnni", "avx2"}
    torch.manual_seed(1)
    x = torch.randn(rows, 160)
    # 83 columns: 11 tiles of eight, the last partial and alone where VNNI takes tiles in pairs;
    # 90: 12 tiles, the partial one second in a pair
    for cols in (83, 90):
        w = torch.randn(cols, 160) * 0.05
        int8 = Int8Linear(w)
        int4 = Int4Linear(GroupAffine4.quantize(w), w4a8=kernels.int4_gemv)
        scale = int8.scale.float().contiguous()
        expected = _w4a8_reference(x, GroupAffine4(int4._source.codes, int4._source.scale.half().float(),
                                                   int4._source.offset.half().float()))
        for isa in isas:
            assert torch.equal(kernels.int8_gemv(x, int8.codes, scale, isa), kernels.int8_gemv(x, int8.codes, scale))
            got = kernels.int4_gemv(x, int4.tiles, cols, isa)
            assert torch.equal(got, kernels.int4_gemv(x, int4.tiles, cols)), (isa, cols)
            assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5), (isa, cols)
    with pytest.raises(RuntimeError, match="avx2"):
        kernels.int4_gemv(x, int4.tiles, 90, "neon")
    if isas == ["avx2"]:
        pytest.skip("this CPU has no AVX512-VNNI: one ISA, nothing to compare it with")


def test_row_dispatch_sends_small_steps_to_the_packed_kernel():
    torch.manual_seed(0)
    w = torch.randn(64, 96)
    packed = Int4Linear(GroupAffine4.quantize(w))
    dense = DenseLinear(packed.dequantized(torch.bfloat16))
    both = RowDispatchLinear(packed, dense, max_small_rows=4)
    for rows, expected in ((1, packed), (4, packed), (5, dense), (64, dense)):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        assert torch.equal(both(x), expected(x)), rows
    assert both.nbytes == packed.nbytes + dense.nbytes


@pytest.mark.skipif(not can_prepack(torch.bfloat16, torch.device("cpu")),
                    reason="torch built without oneDNN, or a CPU without AVX-512 (oneDNN's bf16 reorder needs it)")
def test_prepacked_bf16_linear_is_the_plain_one_without_the_per_call_reorder():
    """Same kernel, the weight reordered once instead of on every call: bitwise the plain
    product at every row count a step has, with and without a bias; the plain weight is kept
    only when asked for (a tied embedding reads it)."""
    torch.manual_seed(0)
    w, b = torch.randn(192, 96).bfloat16(), torch.randn(192).bfloat16()
    for bias in (None, b):
        plain, packed = DenseLinear(w, bias), DenseLinear(w, bias, prepack=True)
        assert packed.weight is None and packed.nbytes == plain.nbytes
        for rows in (1, 3, 16, 64, 200, 700):
            x = torch.randn(rows, 96).bfloat16()
            assert torch.equal(packed(x), plain(x)), (rows, bias is None)
    kept = DenseLinear(w, prepack=True, keep_weight=True)
    assert kept.weight is w and kept.nbytes == 2 * DenseLinear(w).nbytes
    assert not can_prepack(torch.float16, torch.device("cpu"))


@pytest.mark.skipif(not can_prepack(torch.float32, torch.device("cpu")), reason="torch built without oneDNN")
def test_prepacked_float32_linear_is_another_kernel_with_the_same_product_and_batch_independent_rows():
    """float32 prepacked runs oneDNN's kernel, not torch's (MKL's): the same product to float32
    rounding, and a row's result does not depend on how many rows share its call (what the
    exact configuration's batched-equals-alone tests rely on) from two rows on."""
    torch.manual_seed(0)
    w, b = torch.randn(192, 96), torch.randn(192)
    for bias in (None, b):
        plain, packed = DenseLinear(w, bias), DenseLinear(w, bias, prepack=True)
        assert packed.weight is None and packed.nbytes == plain.nbytes
        x = torch.randn(700, 96)
        whole = packed(x)
        torch.testing.assert_close(whole, plain(x), rtol=1e-5, atol=1e-4)
        for rows in (2, 3, 16, 64, 200):
            assert torch.equal(packed(x[:rows]), whole[:rows]), (rows, bias is None)


@pytest.mark.skipif(not w8a8_available(torch.device("cpu")), reason="torch built without oneDNN's int8 GEMM")
@pytest.mark.parametrize("rows", [1, 3, 16, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_w8a8_linear_is_int8_activations_per_token_times_the_int8_codes(rows, dtype):
    """W8A8Linear holds Int8Linear's codes and bf16 scales, and computes what compressed-tensors'
    W8A8 scheme defines: each row rounded to int8 with its own scale (max |x| / 127), integer
    products with the codes, both scales applied; only the output's rounding separates them."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen) * 0.05
    bias = torch.randn(96, generator=gen).to(dtype)
    x = (torch.randn(rows, 64, generator=gen) * torch.linspace(0.1, 4, rows).unsqueeze(1)).to(dtype)
    linear, int8 = W8A8Linear(w, bias), Int8Linear(w)
    assert torch.equal(linear.scale, int8.scale.float())
    assert torch.equal(linear.dequantized(torch.float32), int8.dequantized(torch.float32))
    xf = x.float()
    row_scale = xf.abs().amax(1, keepdim=True) / 127
    codes = (xf / row_scale).round()
    want = (codes @ int8.codes.float().t()) * row_scale * int8.scale.float() + bias.float()
    got = linear(x)
    assert got.dtype == dtype and got.shape == (rows, 96)
    assert (got.float() - want).norm() / want.norm() < (4e-3 if dtype == torch.bfloat16 else 1e-6)
    exact = xf @ w.t() + bias.float()  # the int8 activations cost a little, not more
    assert (got.float() - exact).norm() / exact.norm() < 0.02
    linear.drop_codes()
    assert torch.equal(linear(x), got)  # it computes from oneDNN's packing alone
    ops = load_fused_ops()
    if ops is not None:  # the engine's form: the kernels' one-pass quantizer, the same bits
        assert torch.equal(W8A8Linear(w, bias, quantize=ops.quantize_rows_u8)(x), got)
    with pytest.raises(RuntimeError, match="dropped its codes"):
        linear.dequantized(torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_row_quantizer_gives_the_aten_forms_bits(dtype):
    """kernels' quantize_rows_u8 (one pass) against quant.quantize_rows_u8 (ATen): the same codes,
    ties (k + 0.5 steps) rounded to even, and the same scales, zero rows included."""
    ops = load_fused_ops()
    if ops is None:
        pytest.skip("no native kernels on this machine")
    gen = torch.Generator().manual_seed(3)
    for rows, width in ((1, 64), (7, 2048), (130, 96)):
        x = (torch.randn(rows, width, generator=gen) * torch.linspace(0.01, 30, rows).unsqueeze(1)).to(dtype)
        step = x[0].abs().max().float() / 127
        x[0, :4] = (torch.tensor([0.5, -1.5, 2.5, 3.5]) * step).to(dtype)
        x[-1] = 0
        codes, scales = ops.quantize_rows_u8(x)
        want_codes, want_scales = quantize_rows_u8(x)
        assert codes.dtype == torch.uint8 and torch.equal(codes, want_codes)
        assert torch.equal(scales, want_scales)
        assert (codes[-1] == 128).all()


@pytest.mark.skipif(not w8a8_available(torch.device("cpu")), reason="torch built without oneDNN's int8 GEMM")
def test_the_w8a8_engine_quantizes_the_layers_and_keeps_the_head_dense():
    """`--quantization w8a8` (vLLM's W8A8 int8): every layer linear a W8A8Linear (int8 activations),
    the LM head and the tied embedding dense, no dense copy of the layers (the integer GEMM is the
    fast kernel at every step size), and it generates."""
    llm = LLM(config=EngineConfig(dtype="bfloat16", quantization="w8a8"))
    model = llm.engine.model
    assert llm.engine.quantization == "w8a8" and model.layers_a8 and not model.head_w8a8
    assert all(isinstance(layer[part], W8A8Linear) for layer in model.layers for part in ("qkv", "o", "gate_up", "down"))
    assert isinstance(model.lm_head, DenseLinear)
    assert (model.layers[0]["down"].quantize is not quantize_rows_u8) == (load_fused_ops() is not None)
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 8


def test_quantization_names_resolve_per_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization("auto", "int4", cpu) == "int4"
    assert resolve_quantization("auto", None, cpu) == "none"
    assert resolve_quantization("auto", "int4", cuda) == "none"
    assert resolve_quantization("int8", None, cpu) == "int8"
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("int4", None, cuda)
    with pytest.raises(ValueError, match="CPU only"):
        resolve_quantization("w8a8", None, cuda)
    with pytest.raises(ValueError, match="unsupported quantization"):
        resolve_quantization("fp8", None, cpu)


def test_a_dense_copy_is_kept_only_where_it_is_clearly_faster():
    """The copy costs memory: level timings (noise) keep none; the first row count where dense
    is >= 10% faster there and at the next count sets the crossover; one count alone (a pass
    another process slowed) does not."""
    level = {rows: (1.0, 0.95) for rows in (1, 2, 4, 8, 16)}
    assert crossover(level) is None
    assert crossover({**level, 8: (1.0, 0.85), 16: (1.0, 0.5)}) == 4
    assert crossover({**level, 8: (1.0, 0.5)}) is None  # 16 does not confirm 8
    assert crossover({1: (1.0, 0.8)}) == 0  # the last count measured: nothing to confirm it
    assert crossover({1: (1.0, 0.8)}, final=False) is None  # ... unless the probe goes on
    assert crossover({4: (2.0, 1.7), 2: (1.0, 0.2)}) == 1  # by row count, not insertion order


@pytest.mark.slow
def test_the_probes_measure_once_and_then_read_their_cache(tmp_path):
    cache = tmp_path / "probe.json"
    result = choose_cpu_dtype(64, 128, cache)
    mean = float(np.exp(np.mean(np.log(list(result.bf16_over_fp32.values())))))
    assert result.dtype == ("bfloat16" if mean < 0.9 else "float32")
    # The dtype was timed on the linears the engine would run: whether to prepack each was measured first.
    assert sum("prepack" in k for k in json.loads(cache.read_text())) == sum(
        can_prepack(d, torch.device("cpu")) for d in (torch.bfloat16, torch.float32))
    rows = quantized_max_rows(64, 128, "int4", torch.bfloat16, cache)
    assert rows is None or rows in (0, 1, 2, 4, 8, 16, 32, 64, 128)
    pays = {dtype: prepack_pays(64, 128, dtype, cache_path=cache) for dtype in (torch.bfloat16, torch.float32)}
    entries = json.loads(cache.read_text())
    assert result.key in entries
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float32, "float32")):
        measured = [v["packed_over_plain"] for k, v in entries.items() if k.endswith(f"prepack {name}")]
        if not can_prepack(dtype, torch.device("cpu")):  # nothing to measure: oneDNN cannot run it here
            assert not pays[dtype] and not measured
            continue
        [ratios] = measured
        assert pays[dtype] == (float(np.exp(np.mean(np.log(list(ratios.values()))))) < 0.95)
    assert len(entries) == 2 + sum(can_prepack(d, torch.device("cpu")) for d in (torch.bfloat16, torch.float32))
    # What the cache says is what the next engine start uses: no second measurement.
    flipped = "float32" if result.dtype == "bfloat16" else "bfloat16"
    entries[result.key]["dtype"] = flipped
    cache.write_text(json.dumps(entries))
    assert choose_cpu_dtype(64, 128, cache).dtype == flipped
    # Without the native kernels the engine runs torch's plain linears, and the dtype is timed on those:
    # an entry of its own, and no prepack probe run for it.
    plain_cache = tmp_path / "plain.json"
    plain = choose_cpu_dtype(64, 128, plain_cache, native_kernels=False)
    assert plain.key != result.key and plain.key.endswith("plain")
    assert list(json.loads(plain_cache.read_text())) == [plain.key]


@pytest.fixture(scope="module")
def heldout_ids(llm):
    return [llm.tokenizer.encode(t)[:192] for t in load_texts(HELDOUT, 16)]


@pytest.fixture(scope="module")
def reference_scores(llm, heldout_ids):
    """The float32 reference's perplexity and per-position choices on the held-out texts."""
    return score_texts(llm.engine.model, heldout_ids)


def test_one_pass_scores_give_the_perplexity_and_agreement_of_their_own_passes(llm, heldout_ids):
    texts = [ids[:24] for ids in heldout_ids[:3]]
    model = llm.engine.model
    scores = score_texts(model, texts)
    assert scores.perplexity == pytest.approx(perplexity(model, texts), rel=1e-6)
    assert scores.top1_agreement(scores) == 1.0 == top1_agreement(model, model, texts)
    shifted = TextScores(scores.perplexity, tuple(c + 1 for c in scores.choices))
    assert scores.top1_agreement(shifted) == 0.0


# Each precision alone, its packed kernels scored without the dense copy (which prefill would use).
PRECISIONS = {
    "bfloat16": dict(dtype="bfloat16", quantization="none"),
    "int8": dict(dtype="bfloat16", quantization="int8", quantized_dense_copy=False),
    "int4": dict(dtype="bfloat16", quantization="int4", quantized_dense_copy=False),
    "w8a8": dict(dtype="bfloat16", quantization="w8a8"),
    # torch's weight-only kernels (bf16 activations), which the above replace where the native ones build
    "int4 weight-only": dict(dtype="bfloat16", quantization="int4", quantized_dense_copy=False, layers_a8=False,
                             head_w8a8=False),
}


@pytest.mark.parametrize("name", list(PRECISIONS))
@pytest.mark.slow
def test_each_precision_stays_within_its_quality_tolerance(llm, heldout_ids, reference_scores, name):
    candidate = LLM(config=EngineConfig(**PRECISIONS[name]))
    model = candidate.engine.model
    tolerance = TOLERANCES[name.split()[0]]
    scores = score_texts(model, heldout_ids)
    ratio = scores.perplexity / reference_scores.perplexity
    assert ratio <= tolerance.max_perplexity_ratio, (name, ratio)
    agreement = reference_scores.top1_agreement(scores)
    assert agreement >= tolerance.min_top1_agreement, (name, agreement)
    exact = llm.engine.model.weight_bytes
    # A tied table prepacked as the LM head is held twice: the embedding reads the plain rows.
    head = model.lm_head
    twice = head.nbytes / 2 if getattr(head, "packed", None) is not None and head.weight is not None else 0
    assert model.weight_bytes - twice < {"bfloat16": 0.51, "int8": 0.3, "int4": 0.2, "w8a8": 0.45}[name.split()[0]] * exact


@pytest.mark.slow
def test_the_default_engine_generates_what_the_reference_does_within_tolerance(llm, heldout_ids, reference_scores):
    """The default (dtype and quantization auto) on this machine: whatever it picked, its greedy
    generations start as the float32 reference's and its per-step choices agree within the
    loosest tolerance of the precisions it may have picked."""
    default = LLM()
    assert default.engine.quantization == "int4"  # the embedded GGUF is Q4_1: auto keeps its class
    kernels = load_fused_ops()  # its int8 LM head quantizes activations too, where the kernel builds
    native = kernels is not None and kernels.int8_gemv_supported()
    assert default.engine.model.head_w8a8 == native and default.engine.model.layers_a8 == native
    prompts = [ids[:32] for ids in heldout_ids[:8]]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompts, params)]
    got = [o.token_ids for o in default.generate(prompts, params)]
    assert all(len(t) == 24 for t in got)
    assert greedy_agreement(ref, got).prefix_fraction > 0.3
    loosest = min(t.min_top1_agreement for t in TOLERANCES.values())
    assert reference_scores.top1_agreement(score_texts(default.engine.model, heldout_ids)) >= loosest
    assert default.engine.kv.num_free_blocks == default.engine.kv.num_blocks


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_native_decode_stack_computes_what_the_layer_loop_does(heldout_ids, dtype):
    """The whole-stack decode call (kernels/decode_stack.cpp) chains the loop's own kernels: the
    same tokens and bit-identical logprobs, for a batch of decodes of different lengths. Without
    the prefix cache: the second run's prefills would be shorter. Without the dense copy: the
    stack takes every decode step whatever this machine's probe (a timing) would give the copy,
    so the batch of three goes through it on a busy machine too."""
    engine = LLM(config=EngineConfig(dtype=dtype, quantization="int4", quantized_dense_copy=False,
                                     cache=CacheConfig(enable_prefix_caching=False)))
    model = engine.engine.model
    kernels = load_fused_ops()
    if kernels is None or not kernels.int8_gemv_supported():
        assert model.decode_stack is None
        pytest.skip("no native W4A8 kernels on this machine")
    stack = model.decode_stack
    assert stack is not None and model._stack_rows >= 4
    prompts = [ids[:n] for ids, n in zip(heldout_ids, (9, 40, 23))]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    calls = []
    model.decode_stack = type("Counted", (), {"forward": lambda _, *a: calls.append(1) or stack.forward(*a),
                                               "bind_cache": stack.bind_cache})()
    fast = engine.generate(prompts, params)
    assert len(calls) >= 11  # every decode step of the batch went through it
    model.decode_stack = None
    slow = engine.generate(prompts, params)
    for a, b in zip(fast, slow):
        assert a.token_ids == b.token_ids
        assert [(t.token_id, t.logprob, t.top) for t in a.logprobs] == \
            [(t.token_id, t.logprob, t.top) for t in b.logprobs]
    assert engine.engine.kv.num_free_blocks == engine.engine.kv.num_blocks


def test_exact_configuration_is_unchanged(llm):
    assert llm.engine.dtype == torch.float32 and llm.engine.quantization == "none"
    assert isinstance(llm.engine.model.lm_head, DenseLinear)


@pytest.mark.slow
def test_the_default_server_serves_the_fast_precision(tmp_path):
    """`sloserve serve` with no precision flags: the file's int4 codes (and whatever dtype the
    probe picked), streamed through the official client like any other model."""
    import openai

    from server_helpers import ServerProcess

    server = ServerProcess([], tmp_path / "serve.log", exact=False)
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == 16 and text.strip()
        assert "weights int4" in server.log()
    finally:
        server.kill()


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
@pytest.mark.slow
def test_kv_cache_precision_stays_within_its_tolerance(llm, heldout_ids, kv_dtype):
    """The float32 model reading its context from a bf16 or int8 cache (chunked prefills, so
    every chunk after the first reads the cache) against reading it from a float32 cache."""
    model, texts = llm.engine.model, [ids[:96] for ids in heldout_ids[:4]]
    stored = {"bfloat16": torch.bfloat16, "int8": torch.int8}[kv_dtype]
    tolerance = KV_TOLERANCES[kv_dtype]
    nll = {None: 0.0, stored: 0.0}
    same = total = 0
    for ids in texts:
        targets = torch.tensor(ids[1:]).unsqueeze(1)
        logits = {kv: chunked_next_token_logits(model, ids, kv, 32) for kv in nll}
        for kv, lg in logits.items():
            nll[kv] -= float(torch.log_softmax(lg, -1).gather(1, targets).sum())
        same += int((logits[None].argmax(-1) == logits[stored].argmax(-1)).sum())
        total += len(ids) - 1
    assert np.exp((nll[stored] - nll[None]) / total) <= tolerance.max_perplexity_ratio  # the perplexity ratio
    assert same / total >= tolerance.min_top1_agreement


@pytest.mark.slow
def test_int8_kv_cache_holds_more_tokens_and_generates_what_float32_does(llm, heldout_ids):
    """Greedy runs through the engine's int8 cache (chunked prefill and decode both read it back) pick, at every
    step, a token the float32 model ranks first or within a near-tie of first after the same prefix. A flipped
    near-tie changes the rest of a greedy run, so equal whole outputs are luck (one of the first three prompts
    differed on the AMX Xeon, where the EPYC had none); a wrong cache would show as large gaps."""
    prompts = [ids[:40] for ids in heldout_ids[:8]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    small = dict(dtype="float32", quantization="none", scheduler=SchedulerConfig(max_num_batched_tokens=16))
    fp32 = LLM(config=EngineConfig(**small, cache=CacheConfig(kv_cache_gib=0.05)))
    int8 = LLM(config=EngineConfig(**small, cache=CacheConfig(kv_cache_gib=0.05, kv_dtype="int8")))
    # 64 + 4 bytes per head and token against 256: 3.76x the tokens in the same memory.
    assert int8.engine.kv.num_blocks >= 3.7 * fp32.engine.kv.num_blocks
    ref = [o.token_ids for o in fp32.generate(prompts, params)]
    got = [o.token_ids for o in int8.generate(prompts, params)]
    gaps = []
    for prompt, out in zip(prompts, got):
        logp = torch.log_softmax(next_token_logits(llm.engine.model, prompt + out)[len(prompt) - 1:], -1)
        gaps += (logp.max(-1).values - logp.gather(1, torch.tensor(out).unsqueeze(1)).squeeze(1)).tolist()
    assert max(gaps) < 0.25, gaps  # nats below float32's best: a near-tie at worst (measured flips: 0.05-0.06)
    assert sum(g == 0 for g in gaps) >= 0.95 * len(gaps), gaps  # and almost always float32's own choice
    assert greedy_agreement(ref, got).prefix_fraction >= 0.6  # measured 0.875 over these 8 (AMX Xeon)
    assert int8.engine.kv.num_free_blocks == int8.engine.kv.num_blocks


def test_a_bf16_model_reads_an_int8_cache_through_the_native_prefill_kernel(heldout_ids):
    """An int8 cache's context is dequantized into a bf16 copy and attended by the native prefill
    kernel (it ran SDPA per chunk before): the same next-token scores as the SDPA path over the same
    int8 cache, chunk after chunk (each chunk after the first reads its context back)."""
    from sloserve.engine.model import ForwardBatch, KVCache, PrefillSpan

    llm = LLM(config=EngineConfig(dtype="bfloat16", cache=CacheConfig(kv_cache_gib=0.05, kv_dtype="int8")))
    model = llm.engine.model
    probe = KVCache(model.config, 1, 16, model.dtype, model.device, torch.int8)
    if not model.takes_prefill_tables(probe):
        pytest.skip("no native prefill kernel in this build")
    ids, chunk, bs = heldout_ids[0][:150], 37, 16
    blocks = -(-len(ids) // bs)
    scores = {}
    for native in (True, False):
        cache = KVCache(model.config, blocks + 3, bs, model.dtype, model.device, torch.int8)
        table = torch.arange(3, blocks + 3)  # not starting at block 0: the compact copy must renumber them
        out = []
        for start in range(0, len(ids) - 1, chunk):
            m = min(chunk, len(ids) - start)
            positions = torch.arange(start, start + m)
            used = table[:-(-(start + m) // bs)]
            batch = ForwardBatch(
                input_ids=torch.tensor(ids[start:start + m]), positions=positions,
                slot_mapping=table[positions // bs] * bs + positions % bs, num_decodes=0, decode_blocks=None,
                decode_mask=None, decode_context_lens=None,
                prefills=[PrefillSpan(0, m, start, None if start == 0 else used)],
                sample_indices=torch.arange(min(m, len(ids) - 1 - start)),
                prefill_tables=used.unsqueeze(0) if native else None)
            out.append(model.forward(batch, cache).float())
        scores[native] = torch.log_softmax(torch.cat(out), -1)
    assert model.takes_prefill_tables(probe)  # the kernel took every call (it sets this false when it declines)
    same = (scores[True].argmax(-1) == scores[False].argmax(-1)).float().mean().item()
    # the SDPA path attends a chunk's own keys unquantized, the native one reads them back from the cache
    assert same >= 0.95, same
    top = scores[False].argmax(-1, keepdim=True)
    gap = (scores[True].gather(1, top) - scores[False].gather(1, top)).abs().max().item()
    kl = (scores[False].exp() * (scores[False] - scores[True])).sum(-1).max().item()
    print(f"top-1 agreement {same:.3f}, largest top-1 logprob gap {gap:.3f}, largest KL {kl:.4f}")
    assert gap < 0.5 and kl < 0.1, (gap, kl)


def test_a_files_4bit_head_stays_4bit_and_the_tied_embedding_reads_its_codes(tmp_path):
    """A Q4_0 file's tied head runs on the W4A8 kernel as the file's own codes (not re-encoded as
    int8, which reads 1.6x the bytes a step): its logits are the dequantized head's within the int8
    activations' rounding, and the embedding rows it serves are exactly the file's values."""
    kernels = load_fused_ops()
    if kernels is None or not kernels.int8_gemv_supported():
        pytest.skip("no native W4A8 kernel on this CPU: the head stays int8 (covered by the default tests)")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, random_hf_weights(0, tied=True, bias=False), Q.Q4_0)
    file_head = load_model(str(path), keep_int4=True).weights["model.embed_tokens.weight"]
    exact = GroupAffine4(file_head.codes, file_head.scale.half().float(), file_head.offset.half().float()).dequantize()
    llm = LLM(config=EngineConfig(model=str(path), dtype="float32", quantized_dense_copy=False))
    model = llm.engine.model
    head = model.lm_head
    assert isinstance(head, Int4Linear) and head.w4a8 is not None and model.head_w8a8
    assert head.nbytes < 0.7 * exact.numel()  # int8 codes alone would take numel bytes
    ids = torch.tensor([[0, 5, 17], [exact.shape[0] - 1, 8, 9]])
    assert torch.equal(model._embed(ids), exact[ids])
    h = torch.randn(4, exact.shape[1])
    logits, want = head(h), h @ exact.t()
    assert (logits - want).norm() / want.norm() < 0.02
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 6
    bf16 = LLM(config=EngineConfig(model=str(path), dtype="float32", quantization="int8")).engine.model
    assert isinstance(getattr(bf16.lm_head, "small", bf16.lm_head), Int8Linear)  # int8 weights: an int8 head
