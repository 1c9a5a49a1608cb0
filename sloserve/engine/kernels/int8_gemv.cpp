// y = x W^T for a few rows with int8 weights and int8 activations (W8A8), for the LM head of a
// small decode step. One row of the embedded model's head reads 28 MB of int8 weights and does
// little arithmetic with them: the bytes are the cost, and torch's weight-only kernel (int8
// widened in registers, bf16 activations) runs well below the memory's rate on one core. Integer
// dot products keep up with memory.
//
// Activations are quantized per 32-element block, q = round(x * 127 / max|x|), with one float
// scale a block (llama.cpp's Q8_0 shape); weights are the int8 codes of Int8Linear (symmetric, in
// [-127, 127]) with one float scale a row. A 256-bit register holds one block of each. AVX2 has
// only an unsigned-by-signed byte product (vpmaddubsw, which saturates its int16 pair sums), so
// the sign moves onto the activation: |w| * (q * sign(w)) = w * q, each factor within 127, so a
// pair sum stays within 2 * 127 * 127 < 32767. The int32 sums of a block are scaled by its
// activation scale and accumulate in float; the row's weight scale multiplies the total.
#include "common.h"
#include "kernels.h"

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace sloserve {

bool int8_gemv_supported() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& weight_scale) {
  TORCH_CHECK(int8_gemv_supported(), "int8_gemv: this build has no AVX2");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  weight_scale.scalar_type() == at::kFloat && weight_scale.is_contiguous() &&
                  weight_scale.numel() == codes.size(0),
              "int8_gemv: x [M, K], codes [N, K] int8, weight_scale [N] float32 expected");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.size(1) == K && K % 32 == 0, "int8_gemv: K must match and be a multiple of 32, got ", K);
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
#if defined(__AVX2__) && defined(__FMA__)
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const int64_t blocks = K / 32;
  std::vector<int8_t, AlignedAllocator<int8_t>> xq(M * K);
  std::vector<float> xs(M * blocks);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* src = xp + m * K + b * 32;
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(src[i]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int8_t* dst = xq.data() + m * K + b * 32;
      for (int i = 0; i < 32; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(src[i] * inv));
        dst[i] = static_cast<int8_t>(std::min(127, std::max(-127, q)));
      }
      xs[m * blocks + b] = amax / 127.0f;
    }
  }
  const int8_t* w = codes.data_ptr<int8_t>();
  const float* ws = weight_scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const __m256i ones = _mm256_set1_epi16(1);
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int8_t* row = w + n * K;
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* q = xq.data() + m * K;
        const float* s = xs.data() + m * blocks;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
          const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * 32));
          const __m256i qv = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + b * 32));
          const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(qv, wv));
          const __m256i sums = _mm256_madd_epi16(pairs, ones);
          acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(s[b]), acc);
        }
        const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        const __m128 quad = _mm_add_ps(half, _mm_movehl_ps(half, half));
        const __m128 one = _mm_add_ss(quad, _mm_shuffle_ps(quad, quad, 1));
        op[m * N + n] = _mm_cvtss_f32(one) * ws[n];
      }
    }
  });
#endif
  return out;
}

}  // namespace sloserve
