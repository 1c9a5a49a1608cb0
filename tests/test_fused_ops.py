"""The native fused elementwise kernels against the portable ATen ops they replace, and the
model's forward with them against the forward without."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sloserve.engine.kernels import load_fused_ops

fused = load_fused_ops()
pytestmark = pytest.mark.skipif(fused is None, reason="no C++ toolchain to build the native kernels")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float32 matches to rounding; 16-bit types round once (float32 inside) where the portable
# path rounds after every op, so they may differ by a unit in the last place.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 130])
def test_rms_norm_and_residual(dtype, rows):
    torch.manual_seed(0)
    x = torch.randn(rows, 576).to(dtype)
    w = torch.rand(576).to(dtype) + 0.5
    tol = TOL[dtype]
    expected = F.rms_norm(x.float(), (576,), w.float(), 1e-5)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5).float(), expected, rtol=tol, atol=tol)
    residual, delta = x.clone(), torch.randn(rows, 576).to(dtype)
    out = fused.add_rms_norm(residual, delta, w, 1e-5)
    torch.testing.assert_close(residual, x + delta, rtol=0, atol=0)  # the sum is rounded as `x + delta` is
    torch.testing.assert_close(out.float(), F.rms_norm((x + delta).float(), (576,), w.float(), 1e-5),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    torch.manual_seed(0)
    gate_up = (torch.randn(9, 2 * 1536) * 4).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    tol = TOL[dtype]
    torch.testing.assert_close(fused.silu_and_mul(gate_up).float(), F.silu(gate) * up, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_the_leading_heads(dtype):
    torch.manual_seed(0)
    rows, heads, rotated, hd = 5, 15, 12, 64
    x = torch.randn(rows, heads, hd).to(dtype)
    angles = torch.randn(rows, hd // 2)
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    expected = reference_rope(x[:, :rotated].float(), cos.float(), sin.float())
    untouched = x[:, rotated:].clone()
    fused.rope_(x, cos, sin, rotated)
    tol = TOL[dtype]
    torch.testing.assert_close(x[:, :rotated].float(), expected, rtol=tol, atol=tol)
    assert torch.equal(x[:, rotated:], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_stores_the_rows_index_copy_would(dtype):
    """K and V as the model hands them over (views into the fused qkv output: strided rows) land
    at their slots, exactly, and nothing else in the cache changes; a slot outside the cache is
    refused before anything is written past it."""
    torch.manual_seed(0)
    T, nkv, hd, slots_total = 5, 3, 64, 48
    qkv = torch.randn(T, (9 + 2 * nkv) * hd).to(dtype)
    k = qkv[:, 9 * hd:(9 + nkv) * hd].view(T, nkv, hd)
    v = qkv[:, (9 + nkv) * hd:].view(T, nkv, hd)
    assert not k.is_contiguous()
    slots = torch.tensor([40, 3, 17, 18, 0])
    kc, vc = torch.randn(slots_total, nkv, hd).to(dtype), torch.randn(slots_total, nkv, hd).to(dtype)
    expected_k, expected_v = kc.clone().index_copy_(0, slots, k), vc.clone().index_copy_(0, slots, v)
    fused.write_kv_(kc, vc, slots, k, v)
    assert torch.equal(kc, expected_k) and torch.equal(vc, expected_v)
    with pytest.raises(RuntimeError, match="outside the cache"):
        fused.write_kv_(kc, vc, torch.tensor([1, 2, 3, 4, slots_total]), k, v)
    with pytest.raises(RuntimeError, match="dtype"):
        fused.write_kv_(kc.double(), vc.double(), slots, k, v)


def test_rejects_what_it_cannot_do():
    with pytest.raises(RuntimeError, match="share a dtype"):
        fused.rms_norm(torch.randn(2, 8), torch.ones(8).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        fused.silu_and_mul(torch.randn(4, 6).t())
    with pytest.raises(RuntimeError, match="rope_"):
        fused.rope_(torch.randn(2, 3, 8), torch.randn(3, 8), torch.randn(3, 8), 2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_forward_matches_the_portable_path(dtype):
    """One mixed step (decodes and a chunked prefill) through both paths of the same model."""
    from sloserve.core.config import EngineConfig
    from sloserve.engine.llm_engine import LLMEngine
    from sloserve.core.types import SamplingParams

    engine = LLMEngine(EngineConfig(dtype=dtype, quantization="none", num_threads=1))
    model = engine.model
    assert model.fused is not None
    captured = {}
    forward = model.forward

    def capture(batch, kv_cache):
        captured["batch"] = batch
        captured["kv"] = kv_cache.data.clone()
        return forward(batch, kv_cache)

    model.forward = capture
    params = SamplingParams(max_tokens=3, temperature=0)
    engine.add_request(list(range(100, 160)), params)
    engine.step()
    engine.add_request(list(range(300, 340)), params)
    engine.step()  # a decode of the first request and the whole second prompt
    model.forward = forward
    batch, kv = captured["batch"], captured["kv"]
    assert batch.num_decodes == 1 and batch.prefills
    engine.kv_cache.data.copy_(kv)
    with_fused = model.forward(batch, engine.kv_cache).float()
    model.fused = None
    engine.kv_cache.data.copy_(kv)
    portable = model.forward(batch, engine.kv_cache).float()
    tol = 1e-4 if dtype == "float32" else 0.25
    torch.testing.assert_close(with_fused, portable, rtol=tol, atol=tol)
    assert torch.equal(with_fused.argmax(-1), portable.argmax(-1))
