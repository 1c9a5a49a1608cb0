// Decode attention straight from the paged KV cache (CPU, float32).
//
// The portable path gathers each decode's blocks into a contiguous copy and calls SDPA: the
// KV bytes are read, written and read again. This kernel reads each cached K/V row once, in
// place, for all the query heads that share its KV head (GQA), which is what bounds a decode
// step on a CPU: memory traffic, not arithmetic.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

torch::Tensor paged_decode_attention(const torch::Tensor& q,             // [D, nh, hd]
                                     const torch::Tensor& k_cache,       // [slots, nkv, hd]
                                     const torch::Tensor& v_cache,       // [slots, nkv, hd]
                                     const torch::Tensor& block_tables,  // [D, W] int64
                                     const torch::Tensor& context_lens,  // [D] int64
                                     int64_t block_size, double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "paged_decode_attention: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              block_tables.is_contiguous() && context_lens.is_contiguous(), "contiguous inputs expected");
  const int64_t D = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t nkv = k_cache.size(1), W = block_tables.size(1);
  TORCH_CHECK(nh % nkv == 0 && k_cache.size(2) == hd, "head shapes do not match");
  const int64_t group = nh / nkv;  // query heads per KV head (GQA)
  auto out = torch::zeros_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);

  // One task per sequence: each cached row (all KV heads of a position, contiguous) is read
  // once, front to back, for every query head; a block's rows are adjacent in memory, so
  // the reads stream.
  at::parallel_for(0, D, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t d = begin; d < end; ++d) {
      const int64_t ctx = cl[d];
      const int64_t first = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
      const int64_t n = ctx - first;
      if (n <= 0) continue;
      scores.assign(nh * n, 0.f);  // [head][position]
      const float* qd = qp + d * nh * hd;
      const int64_t* table = bt + d * W;
      for (int64_t j = first; j < ctx; ++j) {
        const int64_t slot = table[j / block_size] * block_size + j % block_size;
        const float* row = kp + slot * nkv * hd;
        for (int64_t qh = 0; qh < nh; ++qh) {
          const float* qv = qd + qh * hd;
          const float* kv = row + (qh / group) * hd;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t x = 0; x < hd; ++x) acc += qv[x] * kv[x];
          scores[qh * n + (j - first)] = acc * fscale;
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
      float* od = op + d * nh * hd;
      for (int64_t j = first; j < ctx; ++j) {
        const int64_t slot = table[j / block_size] * block_size + j % block_size;
        const float* row = vp + slot * nkv * hd;
        for (int64_t qh = 0; qh < nh; ++qh) {
          const float p = scores[qh * n + (j - first)];
          const float* vv = row + (qh / group) * hd;
          float* o = od + qh * hd;
#pragma omp simd
          for (int64_t x = 0; x < hd; ++x) o[x] += p * vv[x];
        }
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache",
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
