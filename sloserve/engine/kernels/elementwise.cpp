// The fused elementwise work of a decoder layer (RMSNorm with the residual add, SiLU-and-mul,
// in-place RoPE, the new tokens' K and V stored into the paged cache) and the greedy argmax over
// logits rows.
#include "kernels.h"

#include "common.h"

namespace sloserve {
namespace {

// ---------------------------------------------------------------- fused elementwise ops

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * h;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) {
        const float v = load(xr[i]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / load(h) + eps);
      scalar_t* o = out + r * h;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) o[i] = store<scalar_t>(load(xr[i]) * inv * load(w[i]));
    }
  });
}

template <typename scalar_t>
void add_rows(scalar_t* res, const scalar_t* d, int64_t rows, int64_t h) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#pragma omp simd
      for (int64_t i = 0; i < h; ++i)
        res[r * h + i] = store<scalar_t>(load(res[r * h + i]) + load(d[r * h + i]));
    }
  });
}

template <typename scalar_t>
void silu_mul_rows(const scalar_t* in, scalar_t* o, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = in + r * 2 * inter;
      const scalar_t* u = g + inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float gv = load(g[i]);
        o[r * inter + i] = store<scalar_t>(gv / (1.f + fast_exp(-gv)) * load(u[i]));
      }
    }
  });
}

template <typename scalar_t>
void rope_rows(scalar_t* base, const scalar_t* c, const scalar_t* s, int64_t rows, int64_t row_stride,
               int64_t num_heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> cf(dim), sf(dim), lo(half), hi(half);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* cr = c + r * dim;
      const scalar_t* sr = s + r * dim;
#pragma omp simd
      for (int64_t i = 0; i < dim; ++i) {
        cf[i] = load(cr[i]);
        sf[i] = load(sr[i]);
      }
      for (int64_t hd = 0; hd < num_heads; ++hd) {
        scalar_t* v = base + r * row_stride + hd * dim;
        // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); via float buffers, so the
        // loops carry no aliasing between what they read and what they write.
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = load(v[i]), b = load(v[i + half]);
          lo[i] = a * cf[i] - b * sf[i];
          hi[i] = b * cf[i + half] + a * sf[i + half];
        }
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          v[i] = store<scalar_t>(lo[i]);
          v[i + half] = store<scalar_t>(hi[i]);
        }
      }
    }
  });
}

// ---------------------------------------------------------------- greedy sampling

// The index of the largest value of x[n] (the first on ties; the first NaN if any, as torch's
// max does). Two passes over a row that the LM head has just written (it sits in cache): the
// max, then the first position holding it, a vector's width at a time.
template <typename scalar_t>
int64_t argmax_row_scalar(const scalar_t* x, int64_t n) {
  float best = load(x[0]);
  int64_t at = 0;
  for (int64_t i = 1; i < n && best == best; ++i) {
    const float v = load(x[i]);
    if (v > best || v != v) best = v, at = i;
  }
  return at;
}

#ifndef __AVX512F__
template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t n) {
  return argmax_row_scalar(x, n);
}
#else
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const double*) { return _mm512_setzero_ps(); }  // unused: doubles take the scalar loop

template <typename scalar_t>
int64_t argmax_row(const scalar_t* x, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, double>) return argmax_row_scalar(x, n);
  const int64_t vec_end = n / 16 * 16;
  __m512 best16 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan_lanes = 0;
  for (int64_t i = 0; i < vec_end; i += 16) {
    const __m512 v = load16(x + i);
    best16 = _mm512_max_ps(best16, v);
    nan_lanes |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  }
  float best = _mm512_reduce_max_ps(best16);
  bool nans = nan_lanes != 0;
  for (int64_t i = vec_end; i < n; ++i) {
    const float v = load(x[i]);
    best = std::max(best, v);
    nans |= v != v;
  }
  const __m512 target = _mm512_set1_ps(best);
  for (int64_t i = 0; i < vec_end; i += 16) {
    const __m512 v = load16(x + i);
    const __mmask16 hit = nans ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (int64_t i = vec_end; i < n; ++i) {
    const float v = load(x[i]);
    if (nans ? v != v : v == best) return i;
  }
  return 0;
}
#endif

}  // namespace

// out = x / rms(x) * weight, per row of x [T, H].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: contiguous x [T, H] and weight [H] expected");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// The residual add and the next norm in one pass: residual += delta (rounded to its dtype, as
// `residual + delta` would be), then returns rms_norm(residual) * weight.
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight,
                           double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.sizes() == delta.sizes() && residual.is_contiguous() &&
              delta.is_contiguous() && weight.is_contiguous() && weight.numel() == residual.size(1),
              "add_rms_norm: contiguous residual and delta [T, H] and weight [H] expected");
  TORCH_CHECK(residual.scalar_type() == delta.scalar_type() && delta.scalar_type() == weight.scalar_type(),
              "add_rms_norm: tensors must share a dtype");
  const int64_t rows = residual.size(0), h = residual.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm", [&] {
    add_rows<scalar_t>(residual.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), rows, h);
  });
  return rms_norm(residual, weight, eps);
}

// SwiGLU's activation: gate_up [T, 2I] (gate then up) -> silu(gate) * up [T, I].
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: contiguous gate_up [T, 2I] expected");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, inter);
  });
  return out;
}

// Rotary embedding in place on the first `num_heads` heads of each row of x [T, heads, D]
// (rotate-half layout: pairs (i, i + D/2)), with cos/sin [T, D] per row.
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rope_: x [T, heads, D] with dense rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2),
              "rope_: cos/sin [T, D] expected");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && cos.scalar_type() == sin.scalar_type(),
              "rope_: tensors must share a dtype");
  const int64_t rows = x.size(0), dim = x.size(2), row_stride = x.stride(0);
  TORCH_CHECK(num_heads <= x.size(1) && dim % 2 == 0, "rope_: bad head count or odd head size");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), rows, row_stride,
                        num_heads, dim);
  });
}

// Greedy tokens: the argmax of each row of logits [R, V] (int64 [R]). torch's bf16 argmax is
// scalar (15.7 ms for 200 x 49k) and max().indices, its vectorized stand-in, 3.8 ms.
void write_kv_(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, const at::Tensor& k,
               const at::Tensor& v) {
  // One layer's two index_copy_ calls took ~20 us a decode step (dispatch, for one row each): a
  // row copy per token here. K and V are views into the fused qkv output: rows strided, each
  // token's heads contiguous.
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.dim() == 3 && slots.scalar_type() == at::kLong && slots.dim() == 1 && k.dim() == 3 &&
                  v.sizes() == k.sizes() && k.size(0) == slots.size(0) && k.size(1) == k_cache.size(1) &&
                  k.size(2) == k_cache.size(2) && k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
                  v.stride(1) == v.size(2) && k.scalar_type() == k_cache.scalar_type() &&
                  v.scalar_type() == v_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "write_kv_: caches [slots, heads, dim] and k, v [T, heads, dim] (rows of contiguous heads) of the "
              "cache's dtype expected");
  const int64_t T = k.size(0), row = k.size(1) * k.size(2), capacity = k_cache.size(0);
  const int64_t bytes = row * k.element_size();
  const int64_t* s = slots.data_ptr<int64_t>();
  auto* kc = static_cast<char*>(k_cache.data_ptr());
  auto* vc = static_cast<char*>(v_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(s[t] >= 0 && s[t] < capacity, "write_kv_: slot ", s[t], " outside the cache");
    std::memcpy(kc + s[t] * bytes, kp + t * ks, bytes);
    std::memcpy(vc + s[t] * bytes, vp + t * vs, bytes);
  }
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.size(1) > 0,
              "argmax_rows: contiguous logits [R, V] with V > 0 expected");
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "argmax_rows", [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(x + r * n, n);
    });
  });
  return out;
}

// W8A8 activations (quant.W8A8Linear): each row of x [M, K] rounded to int8 with its own scale
// s = max(|x|) / 127 (at least 1e-12 / 127), then shifted by 128 into uint8 for oneDNN's u8 x s8
// GEMM. One pass per row where the ATen form takes seven; the same bits: the division and the
// round-half-to-even are those of `(x.float() / s).round() + 128`.
namespace {
template <typename scalar_t>
void quantize_row_u8(const scalar_t* xr, int64_t k, uint8_t* o, float* scale) {
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(load(xr[i])));
  const float s = std::max(amax, 1e-12f) / 127.f;
  *scale = s;
#pragma omp simd
  for (int64_t i = 0; i < k; ++i) o[i] = static_cast<uint8_t>(std::nearbyint(load(xr[i]) / s) + 128.f);
}
}  // namespace

std::vector<at::Tensor> quantize_rows_u8(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quantize_rows_u8: contiguous x [M, K] expected");
  const int64_t rows = x.size(0), k = x.size(1);
  auto codes = at::empty({rows, k}, x.options().dtype(at::kByte));
  auto scales = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows_u8", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) quantize_row_u8<scalar_t>(xp + r * k, k, cp + r * k, sp + r);
    });
  });
  return {codes, scales};
}

// Structured outputs: each listed row r of logits [R, V] (float32 or bf16) keeps the tokens
// bitmask row r allows (bit j of word w allows token 32 w + j) and the others become -inf.
// AVX-512: a word's 32 bits mask two 16-float vectors, or one 32-lane vector of bf16; a word of
// all ones is skipped. Otherwise a scalar loop.
namespace {
template <typename scalar_t>
void mask_row(scalar_t* row, const uint32_t* mask, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512BW__
  if constexpr (std::is_same_v<scalar_t, float>) {
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (; i + 32 <= n; i += 32) {
      const uint32_t w = mask[i / 32];
      if (w == 0xFFFFFFFFu) continue;
      _mm512_storeu_ps(row + i, _mm512_mask_blend_ps(static_cast<__mmask16>(w & 0xFFFF), ninf,
                                                     _mm512_loadu_ps(row + i)));
      _mm512_storeu_ps(row + i + 16, _mm512_mask_blend_ps(static_cast<__mmask16>(w >> 16), ninf,
                                                          _mm512_loadu_ps(row + i + 16)));
    }
  } else {
    const __m512i ninf = _mm512_set1_epi16(static_cast<int16_t>(0xFF80));  // bf16 -inf
    for (; i + 32 <= n; i += 32) {
      const uint32_t w = mask[i / 32];
      if (w == 0xFFFFFFFFu) continue;
      void* at = row + i;
      _mm512_storeu_si512(at, _mm512_mask_blend_epi16(static_cast<__mmask32>(w), ninf, _mm512_loadu_si512(at)));
    }
  }
#endif
  const scalar_t ninf = static_cast<scalar_t>(-std::numeric_limits<float>::infinity());
  for (; i < n; ++i) {
    if (!((mask[i / 32] >> (i % 32)) & 1u)) row[i] = ninf;
  }
}
}  // namespace

void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows, int64_t vocab) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() &&
                  (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "apply_token_bitmask_: contiguous float32 or bf16 logits [R, V] expected");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt,
              "apply_token_bitmask_: contiguous int32 bitmask [B, W] expected");
  TORCH_CHECK(rows.dim() == 1 && rows.is_contiguous() && rows.scalar_type() == at::kLong,
              "apply_token_bitmask_: int64 row indices expected");
  const int64_t n = std::min<int64_t>({vocab, logits.size(1), bitmask.size(1) * 32});
  const int64_t words = bitmask.size(1), width = logits.size(1);
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t* idx = rows.data_ptr<int64_t>();
  const int64_t count = rows.numel();
  for (int64_t k = 0; k < count; ++k) {
    TORCH_CHECK(idx[k] >= 0 && idx[k] < logits.size(0) && idx[k] < bitmask.size(0),
                "apply_token_bitmask_: row index out of range");
  }
  AT_DISPATCH_SWITCH(logits.scalar_type(), "apply_token_bitmask_",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        float* x = logits.data_ptr<float>();
        at::parallel_for(0, count, 1, [&](int64_t b, int64_t e) {
          for (int64_t k = b; k < e; ++k) mask_row(x + idx[k] * width, bits + idx[k] * words, n);
        });
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        c10::BFloat16* x = logits.data_ptr<c10::BFloat16>();
        at::parallel_for(0, count, 1, [&](int64_t b, int64_t e) {
          for (int64_t k = b; k < e; ++k) mask_row(x + idx[k] * width, bits + idx[k] * words, n);
        });
      }));
}

}  // namespace sloserve
