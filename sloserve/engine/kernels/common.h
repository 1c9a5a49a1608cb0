// What the kernel sources share: 16-bit loads and stores, a vectorizable exp, the cost-balanced
// split of work over threads and, where the build has AMX, the tile permission and config.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

// AVX512-BF16's dot products of bf16 pairs (AMD Zen4 and later, Intel Cooper Lake and later).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define SLOSERVE_AVX512BF16 1
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && \
    defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define SLOSERVE_AMX 1
#endif

namespace sloserve {

template <typename T>
inline float load(T v) {
  return static_cast<float>(v);
}

template <>
inline float load(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

template <typename T>
inline T store(float f) {
  return static_cast<T>(f);
}

template <>
inline c10::BFloat16 store(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint16_t rounded = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);  // to nearest even
  c10::BFloat16 out;
  out.x = f != f ? static_cast<uint16_t>(0x7FC0) : rounded;  // NaN stays a (quiet) NaN
  return out;
}

// exp(x) written so the compiler vectorizes it (libm's expf is a scalar call per element):
// 2^(x log2 e) as an integer power built into the exponent bits times a degree-6 polynomial
// on [-0.5, 0.5]; relative error below 2e-7. Clamped to [-87, 88], the float32 range.
#pragma omp declare simd notinbranch
inline float fast_exp(float x) {
  const float t = std::min(std::max(x, -87.0f), 88.0f) * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.5403530393381609e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// at::parallel_for cuts a range into equal counts, but a task's cost is its sequence's context:
// with ShareGPT's spread of prompt lengths one thread got most of the positions while the other
// waited. Here each thread gets one contiguous run of tasks of about equal context.
// Runs tasks [0, costs.size()) on the threads, each thread one contiguous run of about equal
// total cost: body(begin, end) once per non-empty run, on its thread.
template <typename F>
inline void parallel_balanced(const std::vector<int64_t>& costs, const F& body) {
  const int64_t tasks = costs.size();
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  int64_t total = 0;
  for (int64_t c : costs) total += c;
  std::vector<int64_t> bounds(threads + 1, tasks);
  bounds[0] = 0;
  int64_t done = 0, next = 1;
  for (int64_t t = 0; t < tasks && next < threads; ++t) {
    done += costs[t];
    if (done * threads >= total * next) bounds[next++] = t + 1;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k)
      if (bounds[k] < bounds[k + 1]) body(bounds[k], bounds[k + 1]);
  });
}

template <typename F>
void parallel_over_sequences(int64_t sequences, int64_t per_sequence, const int64_t* context_lens, int64_t window,
                             const F& body) {
  std::vector<int64_t> costs(sequences * per_sequence);
  for (int64_t t = 0; t < static_cast<int64_t>(costs.size()); ++t) {
    const int64_t ctx = context_lens[t / per_sequence];
    costs[t] = (window > 0 ? std::min(ctx, window) : ctx) + 16;  // + a fixed cost per task
  }
  parallel_balanced(costs, body);
}

// 64-byte aligned storage, for whole-vector loads and stores.
template <typename T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  bool operator==(const AlignedAllocator&) const { return true; }
};

#ifdef __AVX512F__
// fast_exp above, sixteen at a time.
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23));
  return _mm512_castsi512_ps(bits);
}
#endif

#ifdef SLOSERVE_AVX512BF16
// Two rows' 32 values a[0, 32) and b[0, 32) (nullptr: zeros) interleaved element by element into
// dst[64]: a0 b0 a1 b1 ..., the pairs a bf16 dot-product instruction multiplies by a pair of weights.
inline void interleave32(const uint16_t* a, const uint16_t* b, uint16_t* dst) {
  static const __m512i lo = [] {
    alignas(64) uint16_t idx[32];
    for (int i = 0; i < 32; ++i) idx[i] = static_cast<uint16_t>((i / 2) + (i % 2) * 32);
    return _mm512_load_si512(idx);
  }();
  static const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  const __m512i x = a ? _mm512_loadu_si512(a) : _mm512_setzero_si512();
  const __m512i y = b ? _mm512_loadu_si512(b) : _mm512_setzero_si512();
  _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(x, lo, y));
  _mm512_storeu_si512(dst + 32, _mm512_permutex2var_epi16(x, hi, y));
}

// acc + the products of the bf16 pairs in a and b, summed pairwise into 16 float lanes.
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
#endif  // SLOSERVE_AVX512BF16

#ifdef SLOSERVE_AMX
// Linux hands the tile state only to processes that ask for it (once, for every thread).
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int64_t TILE = 16;  // rows of a tile: positions, heads or queries

// bf16 q and cache, head size a multiple of 64, tiles inside blocks, a KV head's query heads in one tile.
inline bool amx_serves(const at::Tensor& q, const at::Tensor& k_cache, int64_t block_size) {
  const int64_t nh = q.size(1), hd = q.size(2), nkv = k_cache.size(1);
  return q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 && hd % 64 == 0 &&
         block_size % TILE == 0 && nh / nkv <= TILE && amx_permitted();
}

#endif  // SLOSERVE_AMX

}  // namespace sloserve
