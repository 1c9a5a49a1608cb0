"""The native decode-attention kernel against PyTorch's SDPA on gathered context."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sloserve.engine.kernels import attention_kernels, load_paged_decode_attention

kernel = load_paged_decode_attention()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C++ toolchain to build the native kernel")
# The bf16 paths beside the portable loop that this machine has (AMX tiles, AVX512-BF16): each
# is checked against the portable loop and SDPA; an empty list skips those tests.
FAST_BF16 = [name for name in attention_kernels() if name != "portable"]
FAST_BF16_DECODE = FAST_BF16  # each bf16 path decodes as well as prefills


# A 16-bit cache is summed in float32: against a float32 reference over the same (rounded)
# values, only the final rounding of the output to 16 bits differs.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


# The kernel splits work per sequence when there are many, per (sequence, KV head) when there
# are few (under 4 per thread), and unrolls head sizes 64 and 128: cover both splits, both
# unrolled sizes and a generic one.
FEW = [1, 17, 40, 100, 5, 128]
MANY = [(i * 37) % 128 + 1 for i in range(48)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("contexts", [FEW, MANY], ids=["few", "many"])
def test_matches_sdpa_over_gathered_blocks(window, heads, kv_heads, dtype, contexts):
    check_against_sdpa(window, heads, kv_heads, dtype, contexts, hd=64)


@pytest.mark.parametrize("hd", [128, 40])
@pytest.mark.parametrize("contexts", [[300], MANY], ids=["one", "many"])
def test_other_head_sizes(hd, contexts):
    check_against_sdpa(0, 6, 2, torch.bfloat16, contexts, hd)


@pytest.mark.parametrize("path", FAST_BF16_DECODE)
@pytest.mark.parametrize("window", [0, 7, 40])
@pytest.mark.parametrize("heads, kv_heads, hd", [(9, 3, 64), (8, 1, 64), (4, 4, 64), (32, 8, 128), (6, 2, 128)])
@pytest.mark.parametrize("contexts", [FEW, MANY, [1, 16, 17, 31, 32, 33, 300]], ids=["few", "many", "tile-edges"])
def test_bf16_paths_agree_with_the_vector_loop(path, window, heads, kv_heads, hd, contexts):
    """The AMX and AVX512-BF16 paths round the probabilities to bf16 before P.V; against the portable loop over
    the same cache it may differ by that rounding, not more. The cases: partial first and last
    tiles (windows, contexts off the 16-position grid), one and several KV heads per tile, head
    size 128, and few sequences (one task per KV head) as well as many."""
    torch.manual_seed(2)
    bs, nb = 16, 80
    k_cache = torch.randn(nb * bs, kv_heads, hd).bfloat16()
    v_cache = torch.randn(nb * bs, kv_heads, hd).bfloat16()
    ctx = torch.tensor(contexts)
    tables = torch.stack([torch.randperm(nb)[:-(-max(contexts) // bs)] for _ in ctx])
    q = torch.randn(len(ctx), heads, hd).bfloat16()
    fast = kernel(q, k_cache, v_cache, tables, ctx, bs, hd ** -0.5, window, kernel=path).float()
    loop = kernel(q, k_cache, v_cache, tables, ctx, bs, hd ** -0.5, window, kernel="portable").float()
    torch.testing.assert_close(fast, loop, rtol=0, atol=1.6e-2)
    assert (fast - loop).abs().mean() < 1e-3
    check_against_sdpa(window, heads, kv_heads, torch.bfloat16, contexts, hd)


def test_work_is_split_by_context_not_by_sequence_count():
    """Threads get runs of sequences of about equal context (one long sequence among short ones
    must not leave one thread with most of the work): the answer is the same whatever the cut."""
    contexts = [1000] + [3] * 60 + [700, 2, 2, 900]
    for hd, dtype in [(64, torch.bfloat16), (64, torch.float32), (40, torch.bfloat16)]:
        check_against_sdpa(0, 9, 3, dtype, contexts, hd)


def check_against_sdpa(window, heads, kv_heads, dtype, contexts, hd):
    torch.manual_seed(0)
    bs, nb = 16, max(64, sum(-(-n // 16) for n in contexts))
    k_cache = torch.randn(nb * bs, kv_heads, hd).to(dtype)
    v_cache = torch.randn(nb * bs, kv_heads, hd).to(dtype)
    ctx = torch.tensor(contexts)
    width = -(-max(contexts) // bs)
    tables = torch.stack([torch.randperm(nb)[:width] for _ in ctx])
    q = torch.randn(len(ctx), heads, hd).to(dtype)
    out = kernel(q, k_cache, v_cache, tables, ctx, bs, hd ** -0.5, window)
    assert out.dtype == dtype
    out, q, k_cache, v_cache = out.float(), q.float(), k_cache.float(), v_cache.float()
    tol = TOLERANCE[dtype]
    for d, n in enumerate(ctx.tolist()):
        pos = torch.arange(max(0, n - window) if window else 0, n)
        slots = tables[d][pos // bs] * bs + pos % bs
        ref = F.scaled_dot_product_attention(
            q[d].unsqueeze(1).unsqueeze(0), k_cache[slots].transpose(0, 1).unsqueeze(0),
            v_cache[slots].transpose(0, 1).unsqueeze(0), enable_gqa=True, scale=hd ** -0.5,
        )[0, :, 0]
        torch.testing.assert_close(out[d], ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("contexts", [FEW, MANY], ids=["few", "many"])
def test_reads_the_int8_cache_as_its_dequantized_values(dtype, contexts):
    """The int8 cache (values then each head's float32 scale, engine/model.py) against SDPA over
    the same cache dequantized: the kernel's reading adds no error of its own."""
    from sloserve.engine.model import dequantize_int8, quantize_int8

    torch.manual_seed(1)
    bs, nb, hd, kv_heads, heads = 16, 64, 64, 3, 9
    k_q = quantize_int8(torch.randn(nb * bs, kv_heads, hd))
    v_q = quantize_int8(torch.randn(nb * bs, kv_heads, hd))
    ctx = torch.tensor(contexts)
    tables = torch.stack([torch.randperm(nb)[:-(-max(contexts) // bs)] for _ in ctx])
    q = torch.randn(len(ctx), heads, hd).to(dtype)
    out = kernel(q, k_q, v_q, tables, ctx, bs, hd ** -0.5, 0).float()
    k, v = dequantize_int8(k_q, hd, torch.float32), dequantize_int8(v_q, hd, torch.float32)
    tol = TOLERANCE[dtype]
    for d, n in enumerate(ctx.tolist()):
        pos = torch.arange(n)
        slots = tables[d][pos // bs] * bs + pos % bs
        ref = F.scaled_dot_product_attention(
            q[d].float().unsqueeze(1).unsqueeze(0), k[slots].transpose(0, 1).unsqueeze(0),
            v[slots].transpose(0, 1).unsqueeze(0), enable_gqa=True, scale=hd ** -0.5,
        )[0, :, 0]
        torch.testing.assert_close(out[d], ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("path", FAST_BF16)
@pytest.mark.parametrize("window", [0, 20, 21])
@pytest.mark.parametrize("heads, kv_heads, hd", [(9, 3, 64), (4, 4, 64), (6, 2, 128)])
def test_prefill_attention_matches_sdpa_over_the_paged_context(path, window, heads, kv_heads, hd):
    """The native prefill kernel: each chunk's queries (rows of a strided view, as the fused QKV
    output gives them) attend causally to the cached prefix and the chunk, read through the
    block table; chunks on and off the 16-row tile grid, with and without a cached prefix.
    Rows of other spans stay untouched."""
    from sloserve.engine.kernels import load_fused_ops

    ops = load_fused_ops()
    torch.manual_seed(4)
    bs, nb = 16, 200
    k_cache = torch.randn(nb * bs, kv_heads, hd).bfloat16()
    v_cache = torch.randn(nb * bs, kv_heads, hd).bfloat16()
    specs = [(5, 0), (16, 0), (17, 0), (140, 0), (33, 40), (300, 7), (1, 100)]  # (rows, cached start)
    width = max(-(-(n + s) // bs) for n, s in specs)
    perm = torch.randperm(nb)
    tables = torch.stack([perm[i * width:(i + 1) * width] for i in range(len(specs))])
    total = sum(n for n, _ in specs) + 3  # three rows belong to no span
    fused = torch.randn(total, (heads + 2 * kv_heads) * hd).bfloat16()
    q = fused[:, :heads * hd].view(total, heads, hd)
    spans, row = [], 3
    for n, s in specs:
        spans.append([row, n, s])
        row += n
    out = torch.full((total, heads, hd), 7.0, dtype=torch.bfloat16)
    assert ops.prefill_attention(q, k_cache, v_cache, tables, torch.tensor(spans), bs, hd ** -0.5, window, out,
                                 kernel=path)
    assert (out[:3] == 7.0).all()
    for i, (r0, n, s) in enumerate(spans):
        pos = torch.arange(s + n)
        slots = tables[i][pos // bs] * bs + pos % bs
        qpos = torch.arange(s, s + n).unsqueeze(1)
        mask = pos.unsqueeze(0) <= qpos
        if window:
            mask &= pos.unsqueeze(0) > qpos - window
        ref = F.scaled_dot_product_attention(
            q[r0:r0 + n].float().transpose(0, 1).unsqueeze(0), k_cache[slots].float().transpose(0, 1).unsqueeze(0),
            v_cache[slots].float().transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=hd ** -0.5, enable_gqa=True,
        )[0].transpose(0, 1)
        torch.testing.assert_close(out[r0:r0 + n].float(), ref, rtol=0, atol=2e-2)
    # what it cannot take, it leaves to the caller
    assert not ops.prefill_attention(q.float(), k_cache.float(), v_cache.float(), tables, torch.tensor(spans), bs,
                                     hd ** -0.5, window, out.float())
    assert not ops.prefill_attention(q, k_cache, v_cache, tables, torch.tensor(spans), bs, hd ** -0.5, window, out,
                                     kernel="portable")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("vocab", [1, 15, 16, 49152, 1000003 % 4099])
def test_argmax_rows_is_torchs_max_index(dtype, vocab):
    """Greedy sampling's native argmax: torch's `max(dim=-1).indices` exactly, ties to the first
    index, a NaN wins (the first one), +inf beats everything, an all -inf row gives 0, and
    row lengths off the vector width."""
    from sloserve.engine.kernels import load_fused_ops

    ops = load_fused_ops()
    torch.manual_seed(3)
    x = torch.randn(12, vocab).to(dtype)
    x[1] = x[1].round()  # many ties
    x[2, vocab // 2] = float("nan")
    x[2, -1] = float("nan")
    x[3, vocab - 1] = float("inf")
    x[4] = float("-inf")
    x[5, 0] = 50.0
    x[6, -1] = 50.0
    got = ops.argmax_rows(x)
    assert got.dtype == torch.long and got.tolist() == x.max(dim=-1).indices.tolist()
    with pytest.raises(RuntimeError, match="argmax_rows"):
        ops.argmax_rows(torch.randn(4, 8).to(dtype)[:, ::2])


def test_rejects_what_it_cannot_do():
    q = torch.randn(1, 9, 64)
    cache = torch.randn(16, 3, 64)
    one = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernel(q.bfloat16(), cache, cache, one, torch.ones(1, dtype=torch.long), 16, 0.125, 0)
    with pytest.raises(RuntimeError, match="int64"):
        kernel(q, cache, cache, one.int(), torch.ones(1, dtype=torch.long), 16, 0.125, 0)
    with pytest.raises(RuntimeError, match="unknown attention kernel 'fast'"):
        kernel(q, cache, cache, one, torch.ones(1, dtype=torch.long), 16, 0.125, 0, kernel="fast")
    for path in FAST_BF16_DECODE:  # a path asked for by name fails where it cannot serve (here: float32)
        with pytest.raises(RuntimeError, match="cannot take these tensors"):
            kernel(q, cache, cache, one, torch.ones(1, dtype=torch.long), 16, 0.125, 0, kernel=path)


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_engine():
    """torch waits forever on its extension build lock; one left behind by a process killed
    mid-build (hours ago) must not stop every later engine start."""
    import os
    import time
    from pathlib import Path

    from torch.utils import cpp_extension

    from sloserve.engine.kernels import STALE_LOCK_S, cpu_tag, load_paged_decode_attention

    name = f"sloserve_cpu_kernels_{cpu_tag()}"
    lock = Path(cpp_extension._get_build_directory(name, verbose=False)) / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert load_paged_decode_attention() is not None
    assert not lock.exists()
