// Decode attention straight from the paged KV cache (CPU; float32, bfloat16 or float16 K/V).
//
// The portable path gathers each decode's blocks into a contiguous copy and calls SDPA: the
// KV bytes are read, written and read again. This kernel reads each cached K/V row once, in
// place, for all the query heads that share its KV head (GQA), which is what bounds a decode
// step on a CPU: memory traffic, not arithmetic. Scores, softmax and the output accumulate in
// float32 whatever the cache's type: a 16-bit cache halves the bytes read, not the precision
// of the sums.
#include <torch/extension.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// A cached row as float32: the row itself for a float32 cache, else converted into `buf`.
template <typename scalar_t>
inline const float* as_float(const scalar_t* src, int64_t n, std::vector<float>& buf) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return src;
  } else {
    float* dst = buf.data();
#pragma omp simd
    for (int64_t x = 0; x < n; ++x) dst[x] = static_cast<float>(src[x]);
    return dst;
  }
}

template <typename scalar_t>
void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& context_lens,
                           int64_t block_size, float scale, int64_t window, torch::Tensor& out) {
  const int64_t D = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t nkv = k_cache.size(1), W = block_tables.size(1);
  const int64_t group = nh / nkv;  // query heads per KV head (GQA)
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  scalar_t* op = out.data_ptr<scalar_t>();

  // One task per sequence: each cached row (all KV heads of a position, contiguous) is read
  // once, front to back, for every query head; a block's rows are adjacent in memory, so
  // the reads stream.
  at::parallel_for(0, D, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, qf(nh * hd), acc(nh * hd), row(nkv * hd);
    for (int64_t d = begin; d < end; ++d) {
      const int64_t ctx = cl[d];
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t n = ctx - first;
      scalar_t* od = op + d * nh * hd;
      if (n <= 0) {
        std::fill(od, od + nh * hd, scalar_t(0));
        continue;
      }
      scores.assign(nh * n, 0.f);  // [head][position]
      const scalar_t* qd = qp + d * nh * hd;
      for (int64_t x = 0; x < nh * hd; ++x) qf[x] = static_cast<float>(qd[x]);
      const int64_t* table = bt + d * W;
      for (int64_t j = first; j < ctx; ++j) {
        const int64_t slot = table[j / block_size] * block_size + j % block_size;
        const float* cached = as_float(kp + slot * nkv * hd, nkv * hd, row);
        for (int64_t qh = 0; qh < nh; ++qh) {
          const float* qv = qf.data() + qh * hd;
          const float* kv = cached + (qh / group) * hd;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t x = 0; x < hd; ++x) s += qv[x] * kv[x];
          scores[qh * n + (j - first)] = s * scale;
        }
      }
      for (int64_t qh = 0; qh < nh; ++qh) {
        float* s = scores.data() + qh * n;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < n; ++j) {
          s[j] = std::exp(s[j] - mx);
          sum += s[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < n; ++j) s[j] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = first; j < ctx; ++j) {
        const int64_t slot = table[j / block_size] * block_size + j % block_size;
        const float* cached = as_float(vp + slot * nkv * hd, nkv * hd, row);
        for (int64_t qh = 0; qh < nh; ++qh) {
          const float p = scores[qh * n + (j - first)];
          const float* vv = cached + (qh / group) * hd;
          float* o = acc.data() + qh * hd;
#pragma omp simd
          for (int64_t x = 0; x < hd; ++x) o[x] += p * vv[x];
        }
      }
      for (int64_t x = 0; x < nh * hd; ++x) od[x] = static_cast<scalar_t>(acc[x]);
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(const torch::Tensor& q,             // [D, nh, hd]
                                     const torch::Tensor& k_cache,       // [slots, nkv, hd]
                                     const torch::Tensor& v_cache,       // [slots, nkv, hd]
                                     const torch::Tensor& block_tables,  // [D, W] int64
                                     const torch::Tensor& context_lens,  // [D] int64
                                     int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              block_tables.is_contiguous() && context_lens.is_contiguous(), "contiguous inputs expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && k_cache.size(2) == q.size(2), "head shapes do not match");
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(q, k_cache, v_cache, block_tables, context_lens, block_size,
                                    static_cast<float>(scale), window, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
